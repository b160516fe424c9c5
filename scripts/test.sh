#!/usr/bin/env bash
# Run the test suite on 8 fake CPU devices (bootstraps .venv on first use).
#   bash scripts/test.sh              all tests
#   bash scripts/test.sh -k fsdp      pytest arguments pass through
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
exec "$PY" -m pytest "${@:--q}"
