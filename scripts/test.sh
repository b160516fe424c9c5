#!/usr/bin/env bash
# Run the test suite on 8 fake CPU devices (bootstraps .venv on first use).
#   bash scripts/test.sh              all tests, in parallel workers (pytest-xdist)
#   bash scripts/test.sh -k fsdp      pytest arguments pass through (and override, e.g. -n 0)
# Compiling dominates the suite and XLA compiles on one thread, so one worker per core (at most
# 4; JAXSHARD_TEST_WORKERS overrides) nearly halves it on 2 cores. Two sessions: the tests compile
# with XLA:CPU's faster-compiling elemental emitters, then the few marked default_emitters (they
# compare differently fused programs at rounding level) with its default ones (tests/conftest.py).
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
# tests/test_slurm.py starts a real SLURM cluster: Debian's slurm-wlm and munge, installed once
# (as root or with sudo; otherwise those tests say why they cannot run)
bash "$ROOT/scripts/slurm/cluster.sh" install || echo "warning: SLURM is not installed; tests/test_slurm.py will be skipped" >&2
cores=$(nproc 2>/dev/null || echo 2)
workers=${JAXSHARD_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
status=0
"$PY" -m pytest -n "$workers" --dist worksteal "${@:--q}" || status=$?
second=0
JAXSHARD_TEST_EMITTERS=default "$PY" -m pytest -n "$workers" --dist worksteal -m default_emitters "${@:--q}" || second=$?
# (5: the arguments selected none of the marked tests)
[ "$second" = 5 ] && second=0
[ "$status" = 5 ] && [ "$second" = 0 ] && status=0
exit $(( status != 0 ? status : second ))
