"""Training under a real SLURM: Debian's slurm-wlm and munge daemons on this machine
(scripts/slurm/cluster.sh), started for this module and stopped after it whatever the outcome.

Jobs run on the cluster's CPU node (partition debug) with 4 fake CPU devices per process; the
sbatch template's GPU request is checked by the scheduler against two 8-GPU nodes (partition gpu)
on which nothing runs.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
from test_distributed import COMMON, ROOT, assert_close, assert_params_close, losses, uninterrupted  # noqa: F401

from jaxshard.distributed import DistributedError, local_devices, slurm_local_devices

CLUSTER = ROOT / "scripts" / "slurm" / "cluster.sh"
TEMPLATE = ROOT / "scripts" / "slurm" / "train.sbatch"
TRAIN = [sys.executable, "-u", str(ROOT / "experiments" / "train.py"), *COMMON, "--platform", "cpu",
         "--cpu-devices", "4"]
# Like tests/test_distributed.py's uninterrupted run, which they must reproduce.
TEN_STEPS = ["--mesh", "data=2,fsdp=2,tensor=2", "--steps", "10", "--save-every", "5", "--keep", "5"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The environment (SLURM_CONF) of a running one-node cluster."""
    if shutil.which("slurmctld") is None:  # scripts/test.sh installs it; a bare pytest may not have
        install = subprocess.run(["bash", str(CLUSTER), "install"], capture_output=True, text=True, timeout=900)
        if install.returncode:  # no root, no apt, no package mirror: the reason, not a pass
            pytest.skip(f"no SLURM on this machine: {install.stderr.strip().splitlines()[-1]}")
    d = tmp_path_factory.mktemp("slurm")
    try:
        start = subprocess.run(["bash", str(CLUSTER), "start", str(d)], capture_output=True, text=True,
                               timeout=120)
        assert start.returncode == 0, start.stderr
        yield {**os.environ, "SLURM_CONF": str(d / "slurm.conf")}
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop", str(d)], timeout=60)


def srun(env, args, processes=2, timeout=300):
    cmd = ["srun", "-p", "debug", "-n", str(processes), "--overcommit", "--kill-on-bad-exit=1", *TRAIN, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def sbatch_and_wait(env, args, timeout=400) -> tuple[str, int]:
    """Submits ``sbatch ARGS`` and waits for the job to end: its final state and exit status as
    the controller reports them. (``sbatch --wait`` polls at intervals that grow to 10 s, so it
    returns up to 10 s after the job ended; this asks every 0.2 s.)"""
    r = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env=env)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30,
                               env=env).stdout
        state = re.search(r"JobState=(\w+)", shown)
        if state and state[1] not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED"):
            return state[1], int(re.search(r"ExitCode=(\d+):", shown)[1])
        time.sleep(0.2)
    subprocess.run(["scancel", job], env=env, timeout=30)
    raise AssertionError(f"job {job} still running after {timeout} s")


def test_srun_runs_two_processes_that_train_like_one(slurm, tmp_path, uninterrupted):
    """Two processes started by srun, with no flag saying who is who: JAX reads the layout
    (coordinator from the node list, process ids) from SLURM, each process reads its own rows."""
    source, want = uninterrupted
    r = srun(slurm, [*TEN_STEPS, "--checkpoint-dir", str(tmp_path / "ck"), "--metrics", str(tmp_path / "m.jsonl"),
                     "--export", str(tmp_path / "p.npz")])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "8 cpu devices in 2 processes" in r.stdout
    assert_close(losses(tmp_path / "m.jsonl"), want, range(1, 11))
    assert_params_close(tmp_path / "p.npz", source / "params.npz")


def test_the_sbatch_template_restarts_a_killed_process_and_loses_nothing(slurm, tmp_path, uninterrupted):
    """scripts/slurm/train.sbatch submitted for real (its GPU request overridden for the CPU
    node): process 1 is SIGKILLed at step 8, srun stops the other, the template starts the step
    again with --resume, and the job ends as the uninterrupted run did."""
    source, want = uninterrupted
    metrics, out = tmp_path / "m.jsonl", tmp_path / "job.out"
    args = ["-p", "debug", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0",
            "--overcommit", f"--output={out}", str(TEMPLATE), *TRAIN[3:], *TEN_STEPS,
            "--checkpoint-dir", str(tmp_path / "ck"), "--metrics", str(metrics), "--export", str(tmp_path / "p.npz")]
    env = {**slurm, "JAXSHARD_PYTHON": sys.executable, "MAX_RESTARTS": "2", "JAXSHARD_FAULT": "kill:1:8"}
    state, status = sbatch_and_wait(env, args)
    log = out.read_text()
    assert (state, status) == ("COMPLETED", 0), log[-4000:]
    assert "2 processes on 1 node(s)" in log
    assert "restart 1/2: the job step ended with status" in log and "restart 2/2" not in log
    assert f"resumed from {tmp_path / 'ck'}/5" in log
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, 11))  # none missing, none twice
    assert_close(losses(metrics), want, range(1, 11))
    assert_params_close(tmp_path / "p.npz", source / "params.npz")


def test_the_sbatch_template_does_not_restart_bad_input(slurm, tmp_path):
    """A mesh that does not fit the job's devices is bad input (status 2): the same flags would
    fail again, so the template stops at once with the run's own line, restarts left unused."""
    out = tmp_path / "job.out"
    args = ["-p", "debug", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--overcommit",
            f"--output={out}", str(TEMPLATE), *TRAIN[3:], "--mesh", "data=3", "--steps", "10",
            "--checkpoint-dir", str(tmp_path / "ck")]
    state, status = sbatch_and_wait({**slurm, "JAXSHARD_PYTHON": sys.executable, "MAX_RESTARTS": "2"}, args)
    log = out.read_text()
    assert (state, status) == ("FAILED", 2), log[-4000:]
    assert "error: --mesh data=3" in log
    assert log.rstrip().endswith("error: bad input (status 2): not restarted"), log[-2000:]
    assert "restart 1/2" not in log
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


@pytest.mark.parametrize("layout, processors", [([], 16), (["--ntasks-per-node=1"], 2),
                                                (["--gpus-per-node=0", "--gpus-per-task=1"], 16)])
def test_the_sbatch_template_fits_two_eight_gpu_nodes(slurm, layout, processors):
    r = subprocess.run(["sbatch", "--test-only", "-p", "gpu", *layout, str(TEMPLATE), "--model", "tiny"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, env=slurm)
    assert r.returncode == 0, r.stderr
    assert f"using {processors} processors on nodes gpu[1-2] in partition gpu" in r.stderr


def test_the_scheduler_refuses_what_the_nodes_do_not_have(slurm):
    for more in ["--gpus-per-node=9", "--nodes=3"]:
        r = subprocess.run(["sbatch", "--test-only", "-p", "gpu", more, str(TEMPLATE), "--model", "tiny"],
                           capture_output=True, text=True, timeout=60, cwd=ROOT, env=slurm)
        assert r.returncode != 0 and "Requested node configuration is not available" in r.stderr, more


def test_a_task_that_never_starts_is_named_in_one_line(slurm):
    """Under srun too, every process checks in with process 0 before JAX starts (at the address
    JAX reads from SLURM): a task that never comes up is named, not a hang or an abort."""
    r = srun({**slurm, "JAXSHARD_FAULT": "never-start:1"}, ["--steps", "1", "--init-timeout", "10"], timeout=120)
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.fullmatch(r"error: process\(es\) 1 of 2 did not reach the coordinator "
                                             r"\S+:\d+ within 10 s", errors[0]), r.stderr[-2000:]


def test_too_few_devices_for_the_mesh_names_what_each_process_sees(slurm, tmp_path):
    r = srun(slurm, ["--mesh", "fsdp=16", "--steps", "1"])
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert ("error: --mesh fsdp=16 needs 16 devices but 8 are available; the sizes must multiply to the "
            "device count (or use -1 to fill) (the job's 2 processes see 4 each: is each process given "
            "the GPUs it should drive? see scripts/slurm/train.sbatch)") in r.stderr


@pytest.mark.parametrize("flags, message", [
    ([], "error: give experiments/train.py's flags after the script's name"),
    (["--model", "tiny"], "error: restarts need --checkpoint-dir"),
    (["--model", "tiny", "--checkpoint-dir", "ck"], "error: submit this with sbatch"),
])
def test_the_template_refuses_flags_it_cannot_run(flags, message):
    r = subprocess.run(["bash", str(TEMPLATE), *flags], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.startswith(message), r.stderr


@pytest.mark.parametrize("layout, visible, want", [
    (["-N1", "-n8", "--gpus-per-node=8"], 8, [[i] for i in range(8)]),  # one process per GPU
    (["-N1", "-n1", "--gpus-per-node=8"], 8, [list(range(8))]),  # one per node: all eight
    (["-N1", "-n8", "--gpus-per-task=1"], 1, [[0]] * 8),  # bound: each the one it sees
    (["-N2", "--ntasks-per-node=2", "--gpus-per-node=8"], 8, [[0, 1, 2, 3], [4, 5, 6, 7]] * 2),
])
def test_each_slurm_layout_gives_each_process_its_gpus(slurm, layout, visible, want):
    """SLURM's own variables for each layout, from job steps on the two 8-GPU nodes. Their GPUs
    are files, so SLURM sets no CUDA_VISIBLE_DEVICES: ``visible`` is what it would list (all the
    node's GPUs, or the task's one under --gpus-per-task)."""
    names = ["SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_GPUS_ON_NODE"]
    r = subprocess.run(["srun", "-p", "gpu", *layout, sys.executable, "-c",
                        f"import json, os; print(json.dumps({{k: os.environ[k] for k in {names}}}))"],
                       capture_output=True, text=True, timeout=120, env=slurm)
    assert r.returncode == 0, r.stderr
    envs = sorted(map(json.loads, r.stdout.splitlines()), key=lambda e: int(e["SLURM_PROCID"]))
    assert [slurm_local_devices(e, visible) for e in envs] == want


def slurm_env(tasks_per_node, localid, gpus_on_node=None, nodeid=0):
    env = {"SLURM_STEP_TASKS_PER_NODE": tasks_per_node, "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid)}
    if gpus_on_node is not None:
        env["SLURM_GPUS_ON_NODE"] = str(gpus_on_node)
    return env


@pytest.mark.parametrize("env, visible, want", [
    (slurm_env("8(x2)", 3, 8), 8, [3]),  # one process per GPU, every GPU visible to each: JAX's choice
    (slurm_env("1(x2)", 0, 8), 8, list(range(8))),  # one process per node: all of its GPUs, not GPU 0
    (slurm_env("8(x2)", 5, 8), 1, [0]),  # --gpus-per-task=1: the one GPU it sees, not GPU 5
    (slurm_env("2(x2)", 1, 8), 8, [4, 5, 6, 7]),  # two per node: the second half
    (slurm_env("8,4", 2, 4, nodeid=1), 4, [2]),  # the second node runs 4 processes
    (slurm_env("8(x2)", 3), 0, None),  # no GPU: the CPU devices
])
def test_slurm_processes_drive_the_gpus_of_their_layout(env, visible, want):
    assert slurm_local_devices(env, visible) == want


def test_jax_local_device_ids_wins_over_the_slurm_split():
    """What initialize passes JAX: the split for a GPU job under SLURM; None (JAX's own choice,
    which reads JAX_LOCAL_DEVICE_IDS) where the user set it, on CPU, or under no scheduler."""
    one_per_node = slurm_env("1(x2)", 0, 8)
    assert local_devices("SLURM", one_per_node, None, lambda: 8) == list(range(8))
    assert local_devices("SLURM", {**one_per_node, "JAX_LOCAL_DEVICE_IDS": "2,3"}, None, lambda: 8) is None
    assert local_devices("SLURM", one_per_node, "cpu", lambda: 8) is None
    assert local_devices("SLURM", {**one_per_node, "JAX_PLATFORMS": "cpu"}, None, lambda: 8) is None
    assert local_devices("Open MPI", one_per_node, None, lambda: 8) is None
    assert local_devices(None, one_per_node, None, lambda: 8) is None


def test_gpus_that_do_not_split_between_processes_are_one_line():
    with pytest.raises(DistributedError, match="this node's 3 SLURM tasks cannot share its 8 GPUs evenly"):
        slurm_local_devices(slurm_env("3", 0, 8), 8)
    # --gpu-bind=closest: each of 8 tasks sees its socket's 4 GPUs, which 4 tasks share
    with pytest.raises(DistributedError, match="this process sees 4 of its node's 8 GPUs, shared by 8 SLURM tasks"):
        slurm_local_devices(slurm_env("8", 0, 8), 4)
