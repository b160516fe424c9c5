#!/usr/bin/env bash
# The default experiment: GPT-2-style `tiny` on the Python standard library's source, read
# through a byte-level BPE of 1,024 tokens trained on it, on 8 fake CPU devices as HSDP
# (data=2 x fsdp=4); under 4 minutes on 2 cores from a fresh clone, ending with a sample of what it learned.
# Extra flags pass through (later ones win), e.g. `bash scripts/train.sh --mesh fsdp=8 --steps 50`.
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
exec "$PY" experiments/train.py \
  --model tiny --mesh data=2,fsdp=4 --cpu-devices 8 --platform cpu --tokenizer bpe:1024 \
  --steps 800 --batch-size 32 --seq-len 128 --lr 5e-3 --warmup-steps 30 --eval-every 100 \
  --eval-at-start --metrics runs/default/metrics.jsonl --report runs/default/report.json \
  --sample-tokens 200 --sample-prompt "class " "$@"
