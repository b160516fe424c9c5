"""Multi-process training and checkpoints, through the command line, each run under a timeout.

Processes are real (gloo collectives between them); the 'cluster' is this machine.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
CACHE = os.environ.get("JAXSHARD_TEST_CACHE", str(ROOT / ".cache" / "xla-tests"))
COMMON = ["--model", "tiny", "--batch-size", "16", "--seq-len", "64", "--no-progress",
          "--eval-every", "0", "--compile-cache", CACHE]
RTOL = 1e-6


def run(args, timeout=240, env=None, devices=8):
    cmd = [sys.executable, str(ROOT / "experiments" / "train.py"), *COMMON, "--platform", "cpu",
           "--cpu-devices", str(devices), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def launch(args, processes=2, timeout=240, env=None):
    cmd = [sys.executable, str(ROOT / "scripts" / "launch_local.py"), "--processes", str(processes),
           "--devices-per-process", "4", "--timeout", str(timeout - 20), "--init-timeout", "60",
           "--", *COMMON, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def losses(path):
    return {r["step"]: r["loss"] for r in map(json.loads, Path(path).read_text().splitlines())}


def assert_close(a: dict, b: dict, steps):
    for s in steps:
        assert abs(a[s] - b[s]) <= RTOL * abs(b[s]), (s, a[s], b[s])


def assert_params_close(a_path, b_path):
    a, b = np.load(a_path), np.load(b_path)
    assert set(a) == set(b)
    for k in b:
        assert np.linalg.norm(a[k] - b[k]) <= RTOL * np.linalg.norm(b[k]), k


@pytest.mark.parametrize("mesh, hosts_mesh, resume", [
    ("fsdp=8", ["--mesh", "fsdp=8"], False),
    ("data=2,fsdp=2,tensor=2", ["--mesh", "data=2,fsdp=2,tensor=2"], True),
    ("data=2,fsdp=4", ["--mesh", "fsdp=4", "--dcn-mesh", "data=2"], False),  # HSDP: data across hosts
    ("sequence=2,data=4", ["--mesh", "sequence=2,data=4"], False),  # each process holds half the columns
])
def test_two_processes_train_like_one(tmp_path, mesh, hosts_mesh, resume):
    one = run(["--mesh", mesh, "--steps", "5", "--metrics", str(tmp_path / "one.jsonl"),
               "--export", str(tmp_path / "one.npz")])
    assert one.returncode == 0, one.stderr
    saves = ["--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "3"] if resume else []
    two = launch([*hosts_mesh, "--steps", "5", "--metrics", str(tmp_path / "two.jsonl"),
                  "--export", str(tmp_path / "two.npz"), *saves])
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr
    assert "[p1]" in two.stdout and "in 2 processes" in two.stdout
    assert_close(losses(tmp_path / "two.jsonl"), losses(tmp_path / "one.jsonl"), range(1, 6))
    assert_params_close(tmp_path / "two.npz", tmp_path / "one.npz")  # plain numpy, no jaxshard
    if not resume:
        return
    # A checkpoint written by 2 processes resumes in 1 process on another mesh.
    shutil.rmtree(tmp_path / "ck" / "5")
    resumed = run(["--mesh", "data=4,fsdp=2", "--steps", "5", "--checkpoint-dir", str(tmp_path / "ck"),
                   "--resume", "--metrics", str(tmp_path / "two.jsonl")])
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    assert_close(losses(tmp_path / "two.jsonl"), losses(tmp_path / "one.jsonl"), range(1, 6))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Ten steps on data=2,fsdp=2,tensor=2 with a checkpoint every five."""
    d = tmp_path_factory.mktemp("uninterrupted")
    r = run(["--mesh", "data=2,fsdp=2,tensor=2", "--steps", "10", "--save-every", "5", "--keep", "5",
             "--checkpoint-dir", str(d / "ck"), "--metrics", str(d / "m.jsonl"), "--export", str(d / "params.npz")])
    assert r.returncode == 0, r.stderr
    return d, losses(d / "m.jsonl")


@pytest.mark.parametrize("mesh, devices", [("fsdp=8", 8), ("data=4,fsdp=2", 8), ("data=1", 1),
                                           ("stage=2,data=4", 8)])  # into a pipeline
def test_resume_on_another_mesh_continues_exactly(tmp_path, uninterrupted, mesh, devices):
    source, want = uninterrupted
    ck = tmp_path / "ck"
    shutil.copytree(source / "ck", ck)
    shutil.rmtree(ck / "10")  # resume from step 5
    r = run(["--mesh", mesh, "--steps", "10", "--checkpoint-dir", str(ck), "--resume",
             "--metrics", str(tmp_path / "m.jsonl")], devices=devices)
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout and "80 samples seen" in r.stdout  # 5 steps x 16: the data position
    got = losses(tmp_path / "m.jsonl")
    assert sorted(got) == list(range(6, 11))
    assert_close(got, want, range(6, 11))


def assert_resumes_elsewhere(tmp_path, flags, saved_on, meshes):
    """Six steps on ``saved_on`` with a checkpoint at 3 and 6; from step 3 on each of
    ``meshes`` ((mesh, devices) pairs), the next losses are the uninterrupted run's."""
    r = run([*flags, "--mesh", saved_on, "--steps", "6", "--save-every", "3", "--keep", "3",
             "--checkpoint-dir", str(tmp_path / "ck"), "--metrics", str(tmp_path / "saved.jsonl")])
    assert r.returncode == 0, r.stderr
    want = losses(tmp_path / "saved.jsonl")
    shutil.rmtree(tmp_path / "ck" / "6")  # resume from step 3
    for mesh, devices in meshes:
        ck = tmp_path / mesh
        shutil.copytree(tmp_path / "ck", ck)
        r = run([*flags, "--mesh", mesh, "--steps", "6", "--checkpoint-dir", str(ck), "--resume",
                 "--metrics", str(tmp_path / f"{mesh}.jsonl")], devices=devices)
        assert r.returncode == 0, r.stderr
        assert "resumed from" in r.stdout
        assert_close(losses(tmp_path / f"{mesh}.jsonl"), want, range(4, 7))


def test_a_pipeline_checkpoint_resumes_without_stages(tmp_path):
    """Saved on data=2,stage=2,tensor=2 (each device holding half the layer stack), resumed on
    fsdp=8 and on one device."""
    assert_resumes_elsewhere(tmp_path, [], "data=2,stage=2,tensor=2", [("fsdp=8", 8), ("data=1", 1)])


def test_an_expert_parallel_checkpoint_resumes_on_other_meshes(tmp_path):
    """Saved on expert=4,data=2 (each device holding a quarter of the experts), resumed on
    expert=2,data=2 (4 devices) and on one device (a capacity of S slots per sequence: nothing
    drops). The routing biases of ``--moe-balance both`` (at a rate that moves choices) are
    part of what resumes."""
    assert_resumes_elsewhere(tmp_path, ["--model", "moe-tiny", "--moe-capacity-factor", "4", "--moe-balance", "both",
                                        "--moe-bias-rate", "0.05"], "expert=4,data=2",
                             [("expert=2,data=2", 4), ("data=1", 1)])


def test_a_checkpoint_keeps_the_layer_order_whatever_the_stage_layout(tmp_path):
    """Saved under uneven stages (3 + 1 layers: stage 1 stores an empty slot), resumed under
    interleaved chunks (stage 0 holding layers 0 and 2) and without stages: the checkpoint holds
    the stack in model order, so each continues the uninterrupted run."""
    model = ["--model", "tiny-llama", "--n-layers", "4", "--batch-size", "8"]
    r = run([*model, "--mesh", "stage=2,data=4", "--stage-layers", "3,1", "--steps", "4",
             "--save-every", "2", "--checkpoint-dir", str(tmp_path / "ck"), "--metrics", str(tmp_path / "pp.jsonl")])
    assert r.returncode == 0, r.stderr
    want = losses(tmp_path / "pp.jsonl")
    shutil.rmtree(tmp_path / "ck" / "4")  # resume from step 2
    for name, mesh in (("interleaved", ["--mesh", "stage=2,data=4", "--pipeline-schedule", "interleaved",
                                        "--microbatches", "2"]), ("data", ["--mesh", "data=8"])):
        ck = tmp_path / name
        shutil.copytree(tmp_path / "ck", ck)
        r = run([*model, *mesh, "--steps", "4", "--checkpoint-dir", str(ck), "--resume",
                 "--metrics", str(tmp_path / f"{name}.jsonl")])
        assert r.returncode == 0, r.stderr
        assert "resumed from" in r.stdout
        assert_close(losses(tmp_path / f"{name}.jsonl"), want, range(3, 5))


def test_killed_during_training_resumes_from_the_last_checkpoint(tmp_path, uninterrupted):
    _, want = uninterrupted
    metrics = tmp_path / "m.jsonl"
    args = ["--mesh", "data=2,fsdp=2,tensor=2", "--steps", "10", "--save-every", "3",
            "--checkpoint-dir", str(tmp_path / "ck"), "--metrics", str(metrics)]
    cmd = [sys.executable, str(ROOT / "experiments" / "train.py"), *COMMON, "--platform", "cpu",
           "--cpu-devices", "8", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and (not metrics.exists() or len(losses(metrics)) < 7):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert 7 <= len(losses(metrics)) < 10
    r = run(args + ["--resume"])
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout
    got = losses(metrics)
    # the steps after the checkpoint were run again, each written once (the file's records, in order)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(1, 11))
    assert_close(got, want, range(1, 11))


def test_sigterm_saves_the_last_finished_step_and_resume_loses_nothing(tmp_path, uninterrupted):
    """A scheduler's preemption notice (SIGTERM, sent by the process to itself as step 7 is
    dispatched) stops the run at the next step boundary: exit 0, a complete checkpoint of step 7
    although --save-every would have saved only 5 and 10, and --resume gives the uninterrupted
    losses."""
    _, want = uninterrupted
    args = ["--mesh", "data=2,fsdp=2,tensor=2", "--steps", "10", "--save-every", "5",
            "--checkpoint-dir", str(tmp_path / "ck"), "--metrics", str(tmp_path / "m.jsonl")]
    stopped = run(args, env={"JAXSHARD_FAULT": "term:7"})
    assert stopped.returncode == 0, stopped.stderr
    assert f"SIGTERM: saved step 7 in {tmp_path / 'ck'}; continue with --resume" in stopped.stderr
    assert re.search(r"goodput \d+% of [\d.]+ s in training steps; .*checkpoint [1-9]\d*%", stopped.stdout)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.isdigit()) == ["5", "7"]
    assert sorted(losses(tmp_path / "m.jsonl")) == list(range(1, 8))
    r = run(args + ["--resume"])
    assert r.returncode == 0, r.stderr
    assert f"{tmp_path / 'ck'}/7" in r.stdout
    assert_close(losses(tmp_path / "m.jsonl"), want, range(1, 11))
    # Without a checkpoint folder there is nothing to save: the status of a run SIGTERM ended.
    unsaved = run(["--mesh", "data=8", "--steps", "10"], env={"JAXSHARD_FAULT": "term:3"})
    assert unsaved.returncode == 143 and "stopped after step 3; nothing saved" in unsaved.stderr


def test_killed_during_an_async_save_never_uses_the_half_written_step(tmp_path, uninterrupted):
    _, want = uninterrupted
    args = ["--mesh", "data=2,fsdp=2,tensor=2", "--steps", "10", "--save-every", "3",
            "--checkpoint-dir", str(tmp_path / "ck"), "--metrics", str(tmp_path / "m.jsonl")]
    killed = run(args, env={"JAXSHARD_FAULT": "kill-after-save:6"})
    assert killed.returncode == -signal.SIGKILL
    complete = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.isdigit())
    assert complete == ["3"]  # step 6 was being written: never listed as a checkpoint
    r = run(args + ["--resume"])
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout and f"{tmp_path / 'ck'}/3" in r.stdout
    assert_close(losses(tmp_path / "m.jsonl"), want, range(1, 11))


def test_a_checkpoint_of_another_model_or_a_corrupt_one_is_one_line(tmp_path, uninterrupted):
    source, _ = uninterrupted
    ck = tmp_path / "ck"
    shutil.copytree(source / "ck", ck)
    fresh = run(["--mesh", "data=8", "--steps", "12", "--checkpoint-dir", str(ck)])  # no --resume
    assert fresh.returncode == 2 and fresh.stderr.count("\n") == 1, fresh.stderr
    assert f"--checkpoint-dir {ck} already holds step 10: pass --resume" in fresh.stderr
    other = run(["--mesh", "data=8", "--steps", "12", "--checkpoint-dir", str(ck), "--resume",
                 "--model", "tiny-llama"])
    assert other.returncode == 2 and other.stderr.count("\n") == 1, other.stderr
    assert "holds another model: param" in other.stderr
    shorter = run(["--mesh", "data=8", "--steps", "12", "--checkpoint-dir", str(ck), "--resume", "--seq-len", "32"])
    assert shorter.returncode == 2 and shorter.stderr.count("\n") == 1, shorter.stderr
    assert "the checkpoint was trained with --seq-len 64; resume with it (got --seq-len 32)" in shorter.stderr
    reseeded = run(["--mesh", "data=8", "--steps", "12", "--checkpoint-dir", str(ck), "--resume", "--seed", "7"])
    assert reseeded.returncode == 2 and reseeded.stderr.count("\n") == 1, reseeded.stderr
    assert "the checkpoint was trained with --seed 0; resume with it (got --seed 7)" in reseeded.stderr
    for f in (ck / "10").rglob("*"):
        if f.is_file() and "state" in f.parts:
            f.write_bytes(b"garbage")
    corrupt = run(["--mesh", "data=8", "--steps", "12", "--checkpoint-dir", str(ck), "--resume"])
    assert corrupt.returncode == 2 and corrupt.stderr.count("\n") == 1, corrupt.stderr
    assert f"checkpoint {ck}/10" in corrupt.stderr


def test_a_worker_that_dies_stops_the_job_naming_it():
    t = time.monotonic()
    r = launch(["--mesh", "fsdp=8", "--steps", "8"], env={"JAXSHARD_FAULT": "exit:1:3"}, timeout=200)
    assert r.returncode == 17
    assert "error: process 1 of 2 exited with status 17; process 0 ended with status 1" in r.stderr
    assert time.monotonic() - t < 180


# How a killed process's peer ends: it fails in its next collective, or the launcher stops it.
# Waiting inside a collective, it takes SIGTERM as a preemption notice only when the collective
# returns (loop.Termination), so on a loaded machine it may still be waiting after the grace.
SURVIVOR = r"(ended with status 1|stopped \(SIGTERM\)|killed \(still running \d+ s after SIGTERM\))"


def test_a_killed_process_restarts_the_job_from_its_checkpoint_and_loses_nothing(tmp_path, uninterrupted):
    """Process 1 of 2 is SIGKILLed as it dispatches step 8 (after the checkpoint of step 5):
    the launcher stops the other, starts both again with --resume, and the job ends as the
    uninterrupted run: the same losses, each step once in the metrics file, the same params."""
    _, want = uninterrupted
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, str(ROOT / "scripts" / "launch_local.py"), "--processes", "2",
           "--devices-per-process", "4", "--timeout", "300", "--init-timeout", "60", "--max-restarts", "2", "--",
           *COMMON, "--mesh", "data=2,fsdp=2,tensor=2", "--steps", "10", "--save-every", "5", "--keep", "5",
           "--checkpoint-dir", str(tmp_path / "ck"), "--metrics", str(metrics), "--export", str(tmp_path / "p.npz")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=320, cwd=ROOT,
                       env={**os.environ, "JAXSHARD_FAULT": "kill:1:8"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    # The survivor fails in its next collective, or, where that takes longer than the
    # launcher's settling second (a loaded machine), is stopped or killed: either way, once.
    assert re.search(rf"restart 1/2: process 1 of 2 exited with signal SIGKILL; process 0 {SURVIVOR}; starting the "
                     r"job again from its last complete checkpoint", r.stderr), r.stderr
    assert "restart 2/2" not in r.stderr and f"resumed from {tmp_path / 'ck'}/5" in r.stdout, \
        r.stdout[-3000:] + r.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, 11))  # none missing, none twice
    assert_close(losses(metrics), want, range(1, 11))
    source, _ = uninterrupted
    assert_params_close(tmp_path / "p.npz", source / "params.npz")


def test_an_elastic_restart_goes_on_without_the_lost_host(tmp_path, uninterrupted):
    """--min-processes 1: process 1 of 2 is SIGKILLed at step 8; the job restarts on process 0
    alone (its 4 devices: the mesh's -1 axis shrinks from 2 to 1) from the checkpoint of step 5
    and ends as the uninterrupted 8-device run did."""
    source, want = uninterrupted
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, str(ROOT / "scripts" / "launch_local.py"), "--processes", "2",
           "--devices-per-process", "4", "--timeout", "300", "--init-timeout", "60", "--max-restarts", "1",
           "--min-processes", "1", "--", *COMMON, "--mesh", "data=-1,fsdp=2,tensor=2", "--steps", "10",
           "--save-every", "5", "--keep", "5", "--checkpoint-dir", str(tmp_path / "ck"), "--metrics", str(metrics),
           "--export", str(tmp_path / "p.npz")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=320, cwd=ROOT,
                       env={**os.environ, "JAXSHARD_FAULT": "kill:1:8"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert re.search(rf"restart 1/1: process 1 of 2 exited with signal SIGKILL; process 0 {SURVIVOR}; starting the "
                     r"job again on 1 process \(process 1's host left out\) from its last complete checkpoint",
                     r.stderr), r.stderr
    after = r.stdout[r.stdout.index("'data': 1, 'fsdp': 2, 'tensor': 2"):]  # the restart's mesh
    assert "| 4 cpu devices\n" in after and "[p1]" not in after
    assert f"resumed from {tmp_path / 'ck'}/5 (trained on mesh {{'data': 2, 'fsdp': 2, 'tensor': 2" in after, \
        r.stdout[-3000:] + r.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, 11))
    assert_close(losses(metrics), want, range(1, 11))
    assert_params_close(tmp_path / "p.npz", source / "params.npz")


@pytest.mark.parametrize("flags, message", [
    (["--min-processes", "3"], "error: --min-processes must be in [1, --processes 2], got 3"),
    (["--min-processes", "1"], "error: --min-processes applies to restarts: give --max-restarts"),
])
def test_bad_elastic_flags_are_one_line(flags, message):
    cmd = [sys.executable, str(ROOT / "scripts" / "launch_local.py"), "--processes", "2", *flags, "--", *COMMON]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.strip() == message


def test_a_bad_flag_is_not_restarted(tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "launch_local.py"), "--processes", "2", "--max-restarts", "3",
           "--", *COMMON, "--mesh", "data=3", "--checkpoint-dir", str(tmp_path / "ck")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=200, cwd=ROOT)
    assert r.returncode == 2 and "restart" not in r.stderr, r.stderr
    no_dir = subprocess.run(cmd[:cmd.index("--checkpoint-dir")], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert no_dir.returncode == 2 and no_dir.stderr.strip() == (
        "error: --max-restarts needs --checkpoint-dir in the job's flags: a restart resumes from its last "
        "complete checkpoint")


def test_the_launcher_names_a_worker_that_never_starts():
    cmd = [sys.executable, str(ROOT / "scripts" / "launch_local.py"), "--processes", "2",
           "--devices-per-process", "4", "--timeout", "100", "--init-timeout", "4", "--", *COMMON,
           "--mesh", "fsdp=8", "--steps", "2"]
    t = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "JAXSHARD_FAULT": "never-start:1"})
    assert r.returncode == 2 and time.monotonic() - t < 60
    assert "[p0] error: process(es) 1 of 2 did not reach the coordinator" in r.stdout
    assert "error: process 0 of 2 exited with status 2; process 1 stopped (SIGTERM)" in r.stderr


def test_a_worker_that_never_starts_is_named():
    r = run(["--mesh", "fsdp=4", "--steps", "2", "--coordinator", "127.0.0.1:45877", "--num-processes", "3",
             "--process-id", "0", "--init-timeout", "3"], devices=4, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == ("error: process(es) 1, 2 of 3 did not reach the coordinator "
                                "127.0.0.1:45877 within 3 s")


@pytest.mark.parametrize("flags, message", [
    (["--coordinator", "127.0.0.1:45879", "--num-processes", "2", "--process-id", "1", "--init-timeout", "2"],
     "process 1 cannot reach the coordinator 127.0.0.1:45879 within 2 s"),
    (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "1"],
     "--coordinator must be HOST:PORT"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2"], "go together"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"],
     "--process-id must be in [0, 2)"),
])
def test_bad_or_unreachable_coordinator_is_one_line(flags, message):
    r = run(["--mesh", "fsdp=4", "--steps", "2", *flags], devices=4, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert message in r.stderr


def test_the_launched_processes_run_in_the_callers_folder(tmp_path):
    """Relative paths in the job's flags mean what they mean where the launcher was started
    (``--checkpoint-dir runs/x`` lands in the caller's folder, not the checkout); a relative
    --script is found from there too."""
    (tmp_path / "job.py").write_text("import os, sys\n"
                                     "i = sys.argv[sys.argv.index('--process-id') + 1]\n"
                                     "out = sys.argv[sys.argv.index('--out') + 1]\n"
                                     "os.makedirs(out, exist_ok=True)\n"
                                     "open(os.path.join(out, i), 'w').write(os.getcwd())\n")
    cmd = [sys.executable, str(ROOT / "scripts" / "launch_local.py"), "--processes", "2", "--script", "job.py",
           "--", "--out", "runs/here"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    for i in "01":
        assert (tmp_path / "runs" / "here" / i).read_text() == str(tmp_path)
    assert not (ROOT / "runs" / "here").exists()


def test_the_environment_gives_what_the_flags_leave_unset(monkeypatch):
    """JAXSHARD_COORDINATOR, JAXSHARD_NUM_PROCESSES and JAXSHARD_PROCESS_ID stand in for the
    flags; a flag wins; a value that is not a number is one line."""
    from jaxshard.distributed import DistributedConfig, DistributedError

    monkeypatch.setenv("JAXSHARD_COORDINATOR", "10.0.0.1:1234")
    monkeypatch.setenv("JAXSHARD_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAXSHARD_PROCESS_ID", "2")
    cfg = DistributedConfig.from_env()
    assert (cfg.coordinator, cfg.num_processes, cfg.process_id, cfg.multi_process) == ("10.0.0.1:1234", 4, 2, True)
    assert DistributedConfig.from_env(process_id=3).process_id == 3
    monkeypatch.setenv("JAXSHARD_NUM_PROCESSES", "four")
    with pytest.raises(DistributedError, match="^JAXSHARD_NUM_PROCESSES must be an integer, got 'four'$"):
        DistributedConfig.from_env()


def test_the_launcher_stops_the_survivors_after_a_second_then_kills_after_five():
    """docs/hosts-and-checkpoints.md: when a process fails, a peer still running a second
    later gets SIGTERM, and SIGKILL 5 s after that (``launch_local._stop``'s defaults), on
    real processes: one ends by itself within the second, one ends on SIGTERM, one ignores it."""
    import importlib.util
    import threading

    spec = importlib.util.spec_from_file_location("launch_local", ROOT / "scripts" / "launch_local.py")
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    ignores = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
             for code in ("import time; time.sleep(0.3)", "import time; time.sleep(60)", ignores)]
    assert procs[2].stdout.readline() == "ready\n"
    ended, start = {}, time.monotonic()

    def wait(i):
        code = procs[i].wait()
        ended[i] = (time.monotonic(), code)

    for i in range(3):
        threading.Thread(target=wait, args=(i,), daemon=True).start()
    how = launcher._stop(procs, ended)
    assert how == {0: "ended with status 0", 1: "stopped (SIGTERM)", 2: "killed (still running 5 s after SIGTERM)"}
    assert [p.returncode for p in procs] == [0, -signal.SIGTERM, -signal.SIGKILL]
    took = {i: when - start for i, (when, _) in ended.items() if i in (1, 2)}
    assert 0.95 <= took[1] < 2.5, took  # SIGTERM at the settle's end, not before
    assert 5.9 <= took[2] < 8.5, took  # SIGKILL 5 s after it


def test_the_shutdown_wait_a_failed_process_skips_is_jaxs_default():
    """docs/hosts-and-checkpoints.md: a failed process exits at once (``distributed.exit_failed``)
    because JAX's shutdown would wait up to 300 s for a lost peer: that is
    ``jax.distributed.initialize``'s default, and jaxshard passes no other."""
    import inspect

    import jax

    from jaxshard import distributed

    assert inspect.signature(jax.distributed.initialize).parameters["shutdown_timeout_seconds"].default == 300
    assert "shutdown_timeout" not in inspect.getsource(distributed)
    assert "up to 300 s for the lost peer" in (ROOT / "docs" / "hosts-and-checkpoints.md").read_text()
