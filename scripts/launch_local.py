"""Run N processes of a jaxshard job on this machine, as N hosts would, each with its own CPU devices.

    python scripts/launch_local.py --processes 2 --devices-per-process 4 -- \\
        --model tiny --mesh data=2,fsdp=4 --steps 20

Every process runs experiments/train.py (or --script) with the flags after ``--`` plus
``--coordinator 127.0.0.1:PORT --num-processes N --process-id I --cpu-devices D --platform
cpu`` on a free port. Output is streamed with a ``[pI]`` prefix. If one process fails, the
others are stopped and the launcher exits with that status, naming the process; past
--timeout all are stopped. The processes run in the caller's folder, so relative paths in the
flags (``--checkpoint-dir runs/x``) mean what they mean to the caller.

``--max-restarts N``: a job whose process failed (killed, crashed, or stopped by the hang
watchdog -- anything but bad input, exit status 2) is started again, all its processes on a
fresh port with ``--resume``, from the last complete checkpoint of its ``--checkpoint-dir``,
up to N times; with ``--min-processes M`` (elastic) each restart leaves the failed process's
host out, as a lost host would be, while M remain -- the checkpoint resumes on the smaller mesh
(a ``--mesh`` with a -1 axis fits it). Each attempt's processes see ``JAXSHARD_ATTEMPT`` (0, 1,
...); the test faults (``JAXSHARD_FAULT``) fire on attempt 0 only.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream(proc: subprocess.Popen, prefix: str, out) -> None:
    for line in proc.stdout:
        out.write(f"{prefix} {line}")
        out.flush()


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


def _stop(procs: list[subprocess.Popen], ended: dict[int, tuple[float, int]], settle: float = 1.0,
          grace: float = 5.0) -> dict[int, str]:
    """Ends every process still running: each gets ``settle`` s to end by itself (a process of
    a job that lost a peer fails in its next collective and exits), then SIGTERM, then SIGKILL
    after ``grace`` s. How each that was running at the call ended, by index."""
    running = [i for i in range(len(procs)) if i not in ended]
    end = time.monotonic() + settle
    while time.monotonic() < end and any(i not in ended for i in running):
        time.sleep(0.02)
    how = {i: f"ended with {_describe(ended[i][1])}" for i in running if i in ended}
    for i in running:
        if i not in ended:
            procs[i].send_signal(signal.SIGTERM)
            how[i] = "stopped (SIGTERM)"
    end = time.monotonic() + grace
    for i in running:
        try:
            procs[i].wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            procs[i].kill()
            procs[i].wait()
            how[i] = f"killed (still running {grace:g} s after SIGTERM)"
    return how


BAD_INPUT = 2  # a one-line error: the same flags would fail again


def attempt(a: argparse.Namespace, rest: list[str], number: int, deadline: float,
            processes: int) -> tuple[int, str, int | None]:
    """One run of the job's processes: (its status, the line naming a failure or "", the
    failed process or None)."""
    port = free_port()
    procs = []
    env = {**os.environ, "JAXSHARD_ATTEMPT": str(number)}
    for i in range(processes):
        cmd = [sys.executable, "-u", os.path.abspath(a.script), *rest, "--coordinator", f"127.0.0.1:{port}",
               "--num-processes", str(processes), "--process-id", str(i),
               "--cpu-devices", str(a.devices_per_process), "--platform", "cpu",
               "--init-timeout", str(a.init_timeout)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, bufsize=1, env=env))
    threads = [threading.Thread(target=_stream, args=(proc, f"[p{i}]", sys.stdout), daemon=True)
               for i, proc in enumerate(procs)]
    # When each process ended: the first to fail is the one named (its peers fail after it,
    # their collectives having lost it), however close together the polls below see them.
    # (A waiting thread holds the process's lock, so poll() would answer None: read ``ended``.)
    ended: dict[int, tuple[float, int]] = {}

    def wait(i: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        ended[i] = (time.monotonic(), code)

    waiters = [threading.Thread(target=wait, args=(i, proc), daemon=True) for i, proc in enumerate(procs)]
    for t in threads + waiters:
        t.start()
    failed = None
    try:
        while True:
            codes = [ended[i][1] if i in ended else None for i in range(len(procs))]
            done = sorted((when, i, code) for i, (when, code) in list(ended.items()) if code != 0)
            failed = (done[0][1], done[0][2]) if done else None
            if failed or all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                running = [str(i) for i, c in enumerate(codes) if c is None]
                _stop(procs, ended, settle=0)
                return 124, (f"error: timed out after {a.timeout:g} s; process(es) {', '.join(running)} "
                             "still running were stopped"), None
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(procs, ended, settle=0)
        return 130, "", None
    others = _stop(procs, ended) if failed else {}
    for t in threads:
        t.join(timeout=2)
    if not failed:
        return 0, "", None
    i, code = failed
    # The others that were running as it failed (those that had failed before it too are named).
    rest = "".join(f"; process {j} {how}" for j, how in sorted(others.items())) + "".join(
        f"; process {j} ended with {_describe(c)}" for j, (_, c) in sorted(ended.items()) if j != i and j not in others)
    return code if code > 0 else 128 - code, f"process {i} of {processes} exited with {_describe(code)}{rest}", i


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--processes", type=int, required=True)
    p.add_argument("--devices-per-process", type=int, default=4)
    p.add_argument("--script", default=os.path.join(ROOT, "experiments", "train.py"))
    p.add_argument("--timeout", type=float, default=3600, help="seconds before every process is stopped "
                   "(all attempts together)")
    p.add_argument("--init-timeout", type=float, default=60, help="seconds for all processes to join")
    p.add_argument("--max-restarts", type=int, default=0, help="start a failed job again from its last "
                   "complete checkpoint (with --resume) up to N times; needs --checkpoint-dir in its flags")
    p.add_argument("--min-processes", type=int, default=None, help="elastic: each restart leaves out the "
                   "failed process's host, as if it were lost, while at least M processes remain (the "
                   "mesh must fit fewer devices: give it a -1 axis); default: restart on all")
    a = p.parse_args(own)
    if a.processes < 1 or a.devices_per_process < 1:
        print("error: --processes and --devices-per-process must be >= 1", file=sys.stderr)
        return 2
    if a.max_restarts < 0:
        print("error: --max-restarts must be >= 0", file=sys.stderr)
        return 2
    if a.max_restarts and not any(x == "--checkpoint-dir" or x.startswith("--checkpoint-dir=") for x in rest):
        print("error: --max-restarts needs --checkpoint-dir in the job's flags: a restart resumes from its "
              "last complete checkpoint", file=sys.stderr)
        return 2
    least = a.processes if a.min_processes is None else a.min_processes
    if not 1 <= least <= a.processes:
        print(f"error: --min-processes must be in [1, --processes {a.processes}], got {least}", file=sys.stderr)
        return 2
    if least < a.processes and not a.max_restarts:
        print("error: --min-processes applies to restarts: give --max-restarts", file=sys.stderr)
        return 2
    deadline = time.monotonic() + a.timeout
    processes = a.processes
    for number in range(a.max_restarts + 1):
        code, why, failed = attempt(a, rest, number, deadline, processes)
        if code in (0, 130, BAD_INPUT) or code == 124 and why.startswith("error: timed out"):
            break
        if number == a.max_restarts or time.monotonic() > deadline:  # (no time left to start again)
            break
        on = ""
        if failed is not None and processes > least:
            processes -= 1
            on = f" on {processes} process{'es' if processes > 1 else ''} (process {failed}'s host left out)"
        print(f"restart {number + 1}/{a.max_restarts}: {why}; starting the job again{on} from its last "
              "complete checkpoint", file=sys.stderr, flush=True)
        if "--resume" not in rest:
            rest = [*rest, "--resume"]
    if why:
        print(why if why.startswith("error: ") else f"error: {why}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
