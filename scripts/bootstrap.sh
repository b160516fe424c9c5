# Sourced by train.sh and test.sh: makes sure .venv exists and holds the pinned dependencies.
# Sets ROOT (the repository) and PY (the venv's python). JAXSHARD_VENV overrides the venv path.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${JAXSHARD_VENV:-$ROOT/.venv}
LOCK=$ROOT/requirements/lock.txt

find_python() {
  for c in python3.13 python3.12 python3.11 python3; do
    if command -v "$c" >/dev/null 2>&1 &&
       "$c" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  echo "error: jaxshard needs Python >= 3.11 (none found on PATH)" >&2
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  base=$(find_python)
  echo "creating $VENV with $($base --version)" >&2
  "$base" -m venv "$VENV" || { echo "error: could not create a venv (on Debian/Ubuntu: apt install python3-venv)" >&2; exit 1; }
fi
PY=$VENV/bin/python
stamp=$VENV/.jaxshard-lock
want=$(cat "$LOCK" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "installing pinned dependencies into $VENV" >&2
  "$PY" -m pip install --quiet --disable-pip-version-check -r "$LOCK"
  echo "$want" > "$stamp"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
