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


def _stop(procs: list[subprocess.Popen], grace: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


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
    for t in threads:
        t.start()
    failed = None
    try:
        while True:
            codes = [proc.poll() for proc in procs]
            failed = next(((i, c) for i, c in enumerate(codes) if c not in (None, 0)), None)
            if failed or all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                running = [str(i) for i, c in enumerate(codes) if c is None]
                _stop(procs)
                return 124, (f"error: timed out after {a.timeout:g} s; process(es) {', '.join(running)} "
                             "still running were stopped"), None
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(procs)
        return 130, "", None
    if failed:
        _stop(procs)
    for t in threads:
        t.join(timeout=2)
    if not failed:
        return 0, "", None
    i, code = failed
    return (code if code > 0 else 128 - code,
            f"process {i} of {processes} exited with {_describe(code)}; stopped the others", i)


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
