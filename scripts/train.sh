#!/usr/bin/env bash
# The default experiment: GPT-2-style `tiny` on the Python standard library's source, on 8 fake
# CPU devices as HSDP (data=2 x fsdp=4), about 4 minutes on 2 cores, ending with a sample of
# what it learned. Extra flags pass through (later ones win), e.g.
# `bash scripts/train.sh --mesh fsdp=8 --steps 50`.
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
exec "$PY" experiments/train.py \
  --model tiny --mesh data=2,fsdp=4 --cpu-devices 8 --platform cpu \
  --steps 400 --batch-size 32 --seq-len 256 --lr 3e-3 --warmup-steps 30 --eval-every 50 \
  --metrics runs/default/metrics.jsonl --report runs/default/report.json \
  --sample-tokens 200 --sample-prompt "def " "$@"
