"""Starting several processes as one JAX job (``jax.distributed``): NCCL on GPUs, gloo on CPU.

Flags ``--coordinator HOST:PORT --num-processes N --process-id I`` (or the environment
variables ``JAXSHARD_COORDINATOR``, ``JAXSHARD_NUM_PROCESSES``, ``JAXSHARD_PROCESS_ID``); with
none of them under SLURM or Open MPI, JAX's own cluster detection (under SLURM with the GPUs each
process drives chosen here: :func:`slurm_local_devices`). A process that waits for a
peer that never comes would otherwise hang, then abort inside XLA; here a rendezvous over
plain TCP on the coordinator's port runs first, with a bounded timeout, and fails with one
line naming the missing process(es) or the unreachable coordinator.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time
from dataclasses import dataclass

from jaxshard.errors import JaxshardError
from jaxshard.options import flag, option

_HELLO = "jaxshard-rendezvous"


class DistributedError(JaxshardError):
    """A multi-process job that cannot start."""


_JOINED = False  # set once this process has joined a multi-process job
TIMEOUT_S = 120.0  # how long a multi-process start waits for every process without --init-timeout


@dataclass(frozen=True, slots=True)
class DistributedConfig:
    coordinator: str | None = option(None, "HOST:PORT of process 0", run_only=True)
    num_processes: int | None = option(None, "processes in the job", run_only=True)
    process_id: int | None = option(None, "this process's index, from 0", run_only=True)
    timeout_s: float | None = option(None, "seconds to wait for every process to join",
                                     flag="--init-timeout", default_text=f"{TIMEOUT_S:g}", run_only=True)
    timeout_given: bool = False  # --init-timeout was given (it bounds a multi-process start)

    def __post_init__(self) -> None:
        if self.timeout_s is None:
            object.__setattr__(self, "timeout_s", TIMEOUT_S)
        given = [v is not None for v in (self.coordinator, self.num_processes, self.process_id)]
        if any(given) and not all(given):
            raise DistributedError(f"{_flag('coordinator')}, {_flag('num_processes')} and "
                                   f"{_flag('process_id')} go together (or set none of them)")
        if self.coordinator is not None:
            host_port(self.coordinator)
            if self.num_processes < 1:
                raise DistributedError(f"{_flag('num_processes')} must be >= 1, got {self.num_processes}")
            if not 0 <= self.process_id < self.num_processes:
                raise DistributedError(f"{_flag('process_id')} must be in [0, {self.num_processes}), "
                                       f"got {self.process_id}")
        if self.timeout_s <= 0:
            raise DistributedError(f"{_flag('timeout_s')} must be > 0, got {self.timeout_s}")

    @property
    def multi_process(self) -> bool:
        return (self.num_processes or 1) > 1

    @classmethod
    def from_env(cls, coordinator=None, num_processes=None, process_id=None, timeout_s=None):
        """Flags win; else the JAXSHARD_* environment variables. ``timeout_s`` None: TIMEOUT_S."""
        env = os.environ
        coordinator = coordinator or env.get("JAXSHARD_COORDINATOR")
        if num_processes is None and "JAXSHARD_NUM_PROCESSES" in env:
            num_processes = _int(env["JAXSHARD_NUM_PROCESSES"], "JAXSHARD_NUM_PROCESSES")
        if process_id is None and "JAXSHARD_PROCESS_ID" in env:
            process_id = _int(env["JAXSHARD_PROCESS_ID"], "JAXSHARD_PROCESS_ID")
        return cls(coordinator, num_processes, process_id, timeout_s, timeout_s is not None)

    from_flags = from_env  # what the flags leave unset, the environment gives


def _flag(name: str) -> str:
    return flag(DistributedConfig, name)


def _int(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise DistributedError(f"{name} must be an integer, got '{text}'") from None


def host_port(address: str) -> tuple[str, int]:
    m = re.fullmatch(r"\[?([\w.\-:]+?)\]?:(\d+)", address.strip())
    if m is None or not 0 < int(m[2]) < 65536:
        raise DistributedError(f"--coordinator must be HOST:PORT (e.g. 10.0.0.1:1234), got '{address}'")
    return m[1], int(m[2])


def cluster_detected() -> str | None:
    """The scheduler JAX can read the job's layout from, if any."""
    if "SLURM_JOB_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return "SLURM"
    if "OMPI_COMM_WORLD_SIZE" in os.environ and int(os.environ["OMPI_COMM_WORLD_SIZE"]) > 1:
        return "Open MPI"
    return None


def initialize(cfg: DistributedConfig, platform: str | None = None) -> None:
    """Join the job described by ``cfg`` (or detected); a no-op for one process.

    Call before any other JAX computation (with the other runtime settings).
    """
    import jax

    detected = None if cfg.coordinator else cluster_detected()
    if not cfg.multi_process and detected is None:
        if cfg.timeout_given and cfg.coordinator is None:
            raise DistributedError("--init-timeout bounds the wait for the processes of a multi-process "
                                   "job; this run is one process")
        return
    if (platform or os.environ.get("JAX_PLATFORMS", "")).startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    gpus = local_devices(detected, os.environ, platform, _node_gpus)
    if detected:
        cfg = cluster_layout(cfg)
    if os.environ.get("JAXSHARD_FAULT") == f"never-start:{cfg.process_id}":
        time.sleep(10 * cfg.timeout_s)  # fault injection for the tests: a host that never comes up
    rendezvous(cfg)
    jax.distributed.initialize(coordinator_address=cfg.coordinator, num_processes=cfg.num_processes,
                               process_id=cfg.process_id, initialization_timeout=int(cfg.timeout_s),
                               local_device_ids=gpus)
    _joined()


def cluster_layout(cfg: DistributedConfig) -> DistributedConfig:
    """``cfg`` with the coordinator, process count and index a detected scheduler gives (SLURM,
    Open MPI), as ``jax.distributed.initialize`` would read them -- by JAX's own cluster
    detection, so the address is the one JAX's service takes (on SLURM the job's first node, at
    a port derived from the job's id, or ``JAX_COORDINATOR_PORT``) -- so that the processes
    check in with process 0 (:func:`rendezvous`) as with the flags."""
    from jax._src.clusters import ClusterEnv  # (no public API gives the detected layout)

    coordinator, n, me, _ = ClusterEnv.auto_detect_unset_distributed_params(
        None, None, None, None, None, int(cfg.timeout_s))
    if coordinator is None or n is None or me is None:
        raise DistributedError(f"JAX's cluster detection found no layout in this job's environment "
                               f"({cluster_detected()}): give {_flag('coordinator')}, {_flag('num_processes')} "
                               f"and {_flag('process_id')}")
    return DistributedConfig(coordinator, n, me, cfg.timeout_s, cfg.timeout_given)


def _joined() -> None:
    global _JOINED
    _JOINED = True


def joined() -> bool:
    """Whether this process is one of a multi-process job (:func:`initialize` joined one)."""
    return _JOINED


def exit_failed(code: int) -> None:
    """End a process of a multi-process job that failed (``code`` != 0) at once. Python's exit
    would run JAX's shutdown, whose barrier waits for every process of the job -- up to
    ``jax.distributed.initialize``'s shutdown timeout, 300 s, where a peer has died (the usual
    reason this one failed: its collectives lost the peer). What the run writes is closed by
    then (the checkpointer waits for its last save before the error leaves the loop), so
    nothing is lost; the launcher or scheduler sees the status at once. A no-op in a
    one-process run and for status 0."""
    if _JOINED and code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _node_gpus() -> int:
    """NVIDIA GPUs this process can open, before CUDA starts (0 where there are none)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:  # (SLURM writes NoDevFiles where a job has no GPU)
        return len([v for v in visible.split(",") if re.fullmatch(r"\d+|GPU-[\w-]+|MIG-[\w/-]+", v.strip())])
    try:
        return sum(1 for n in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", n))
    except OSError:
        return 0


def _tasks_on_this_node(env) -> int:
    """This node's processes in the SLURM step: SLURM_STEP_TASKS_PER_NODE reads like '8(x2),4',
    one count per node in SLURM_NODEID order."""
    counts = []
    for part in env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "1")).split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            return 1
        counts += [int(m[1])] * int(m[2] or 1)
    node = int(env.get("SLURM_NODEID", "0"))
    return counts[node] if node < len(counts) else counts[-1]


def local_devices(detected: str | None, env, platform: str | None, visible) -> list[int] | None:
    """The ``local_device_ids`` this process passes to ``jax.distributed.initialize``; None: JAX's.

    Chosen here only for a GPU job under SLURM (:func:`slurm_local_devices`, ``visible()`` counting
    the GPUs this process sees); ``JAX_LOCAL_DEVICE_IDS``, where set, is the user's choice and wins.
    """
    if detected != "SLURM" or "JAX_LOCAL_DEVICE_IDS" in env:
        return None
    if (platform or env.get("JAX_PLATFORMS", "")).startswith("cpu"):
        return None
    return slurm_local_devices(env, visible())


def slurm_local_devices(env, visible: int) -> list[int] | None:
    """The GPUs (numbered as this process sees them) it drives in a SLURM job; None: JAX's choice.

    JAX's own SLURM detection gives each process GPU number SLURM_LOCALID. That is right for one
    process per GPU with every GPU of the node visible to each, and wrong otherwise: with one
    process per node (``--ntasks-per-node=1``) it drives GPU 0 of 8 -- the job sees one GPU per
    node -- and with GPUs bound to tasks (``--gpus-per-task=1``, ``--gpu-bind``) each process sees
    one GPU, numbered 0, and GPU SLURM_LOCALID does not exist. Here the node's visible GPUs are
    split evenly between its processes; a process that sees fewer GPUs than the job has on its node
    (SLURM_GPUS_ON_NODE) has been given its own, and drives all it sees.
    """
    if visible <= 0:
        return None
    on_node = _int(env.get("SLURM_GPUS_ON_NODE", str(visible)), "SLURM_GPUS_ON_NODE")
    tasks = _tasks_on_this_node(env)
    if visible < on_node:  # bound to this task by SLURM: its own share, all of it
        if visible * tasks != on_node:
            raise DistributedError(f"this process sees {visible} of its node's {on_node} GPUs, shared by "
                                   f"{tasks} SLURM tasks: bind a GPU share to each task (--gpus-per-task) "
                                   "or let each see all (see scripts/slurm/train.sbatch)")
        return list(range(visible))
    if visible % tasks:
        raise DistributedError(f"this node's {tasks} SLURM tasks cannot share its {visible} GPUs evenly: "
                               "run one task per GPU or one per node (see scripts/slurm/train.sbatch)")
    share = visible // tasks
    local = int(env.get("SLURM_LOCALID", "0"))
    return list(range(local * share, (local + 1) * share))


def rendezvous(cfg: DistributedConfig) -> None:
    """Every process checks in with process 0 over TCP before JAX starts its own service there.

    Process 0 listens on the coordinator's port until all others have said hello (or the timeout
    passes: it then names who is missing), answers 'go' and closes the port for JAX to take.
    """
    host, port = host_port(cfg.coordinator)
    n, me = cfg.num_processes, cfg.process_id
    deadline = time.monotonic() + cfg.timeout_s
    if me == 0:
        _await_peers(port, n, deadline, cfg)
    else:
        _check_in(host, port, n, me, deadline, cfg)


def _await_peers(port: int, n: int, deadline: float, cfg: DistributedConfig) -> None:
    arrived: dict[int, socket.socket] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind(("", port))
        except OSError as e:
            raise DistributedError(f"process 0 cannot listen on port {port} of --coordinator "
                                   f"{cfg.coordinator}: {e.strerror}") from None
        server.listen(n)
        try:
            while len(arrived) < n - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, n)) - set(arrived))
                    raise DistributedError(
                        f"process(es) {', '.join(map(str, missing))} of {n} did not reach the "
                        f"coordinator {cfg.coordinator} within {cfg.timeout_s:g} s")
                server.settimeout(left)
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                conn.settimeout(max(1.0, deadline - time.monotonic()))
                try:
                    hello = conn.makefile().readline().split()
                except OSError:
                    conn.close()
                    continue
                if len(hello) != 3 or hello[0] != _HELLO:
                    conn.close()
                    continue
                if int(hello[1]) != n:
                    conn.close()
                    raise DistributedError(f"a process expects {hello[1]} processes but process 0 "
                                           f"expects {n}: give every process the same --num-processes")
                arrived[int(hello[2])] = conn
            for conn in arrived.values():
                conn.sendall(b"go\n")
        finally:
            for conn in arrived.values():
                conn.close()


def _check_in(host: str, port: int, n: int, me: int, deadline: float, cfg: DistributedConfig) -> None:
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DistributedError(f"process {me} cannot reach the coordinator {cfg.coordinator} "
                                   f"within {cfg.timeout_s:g} s (is process 0 running there?)")
        try:
            conn = socket.create_connection((host, port), timeout=min(left, 5.0))
        except socket.gaierror:
            raise DistributedError(f"cannot resolve the coordinator host in {cfg.coordinator}") from None
        except OSError:  # refused or unreachable: process 0 may not be listening yet
            time.sleep(0.2)
            continue
        with conn:
            try:
                conn.sendall(f"{_HELLO} {n} {me}\n".encode())
                conn.settimeout(max(1.0, deadline - time.monotonic()))
                reply = conn.makefile().readline().strip()
            except TimeoutError:
                raise DistributedError(
                    f"the coordinator {cfg.coordinator} accepted process {me} but did not release "
                    f"it within {cfg.timeout_s:g} s: another process is missing") from None
            except OSError:
                reply = ""
        if reply == "go":
            return
        raise DistributedError(f"the coordinator {cfg.coordinator} turned process {me} away "
                               "(see process 0's error)")
