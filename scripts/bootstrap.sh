# Sourced by train.sh and test.sh: makes sure .venv exists and holds the pinned dependencies.
# Sets ROOT (the repository) and PY (the venv's python). Environment overrides:
#   JAXSHARD_VENV=DIR     the venv path (default .venv, or .venv-latest with JAXSHARD_UNPINNED=1)
#   JAXSHARD_PYTHON=EXE   the interpreter that creates the venv (default: the newest python3.x >= 3.11)
#   JAXSHARD_UNPINNED=1   install the newest releases pyproject.toml allows instead of the lock,
#                         to check a newer jax/flax (delete the venv to upgrade again)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
UNPINNED=${JAXSHARD_UNPINNED:-0}
if [ "$UNPINNED" = 1 ]; then VENV=${JAXSHARD_VENV:-$ROOT/.venv-latest}; else VENV=${JAXSHARD_VENV:-$ROOT/.venv}; fi
LOCK=$ROOT/requirements/lock.txt

find_python() {
  local candidates=(python3.13 python3.12 python3.11 python3)
  [ -n "${JAXSHARD_PYTHON:-}" ] && candidates=("$JAXSHARD_PYTHON")
  for c in "${candidates[@]}"; do
    if command -v "$c" >/dev/null 2>&1 &&
       "$c" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  echo "error: jaxshard needs Python >= 3.11 (${JAXSHARD_PYTHON:-none found on PATH} is not one)" >&2
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  base=$(find_python)
  echo "creating $VENV with $($base --version)" >&2
  "$base" -m venv "$VENV" || { echo "error: could not create a venv (on Debian/Ubuntu: apt install python3-venv)" >&2; exit 1; }
fi
PY=$VENV/bin/python
stamp=$VENV/.jaxshard-lock
if [ "$UNPINNED" = 1 ]; then
  if [ "$(cat "$stamp" 2>/dev/null)" != unpinned ]; then
    echo "installing the newest allowed dependencies into $VENV" >&2
    "$PY" -m pip install --quiet --disable-pip-version-check --upgrade -e "$ROOT[test,plot]"
    echo unpinned > "$stamp"
  fi
else
  want=$(cat "$LOCK" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "installing pinned dependencies into $VENV" >&2
    "$PY" -m pip install --quiet --disable-pip-version-check -r "$LOCK"
    echo "$want" > "$stamp"
  fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
