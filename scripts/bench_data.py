"""Does the data loader keep up? Record corpora read, tokenized and batched, against the token
rate of a training step.

    python scripts/bench_data.py                  # 1 GiB of JSONL and the same as Parquet
    python scripts/bench_data.py --size-mb 64     # a quick look

Makes a corpus of ``--size-mb`` MiB of text (the Python standard library's source files cut into
documents of 200 B to 8 KiB, repeated until the size is reached) as one JSONL file and as
Parquet shards of 128 MiB (zstd), in ``--work``. Then measures, each from a cold cache:

* preparation, once per corpus: the records read into the spool file and tokenized into the
  token file -- with the byte tokenizer (the spool is the token file) and with a byte-level BPE of
  ``--vocab`` tokens (trained on the first 16 MiB beforehand, not timed: ``bpe:N`` trains on the
  training split first, once);
* the loader, every step: ``--steps`` batches of ``--batch-size`` x ``--seq-len`` cut from the
  token file (``corpus.Batches``: a permutation of windows, this process's rows) and from a
  mixture of the two (``mixture.MixedBatches``: whole documents drawn by weight), each put on a
  device (``jax.make_array_from_process_local_data``), as the training loop's prefetch thread
  does.

The step's token rate to keep up with is the time model's for ``--model`` on one ``--device``
(``analysis.timing``, as ``plan.py`` prices it) at the same batch, bfloat16. Writes data.json and
data.md to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHARD_MB = 128


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size-mb", type=int, default=1024, help="text in the corpus, MiB")
    p.add_argument("--vocab", type=int, default=32768, help="the BPE's vocabulary")
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--device", default="h100")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=200, help="batches timed per loader")
    p.add_argument("--work", default=str(ROOT / ".cache" / "bench-data"))
    p.add_argument("--out", default="docs/bench")
    return p


def make_corpus(work: Path, size: int) -> tuple[Path, Path]:
    """A JSONL file and a folder of Parquet shards holding the same documents."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl, parquet = work / f"corpus-{size >> 20}mb.jsonl", work / f"corpus-{size >> 20}mb-parquet"
    if jsonl.is_file() and parquet.is_dir():
        return jsonl, parquet
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(stdlib.rglob("*.py"))[:4000]]
    rng = np.random.default_rng(0)
    shutil.rmtree(parquet, ignore_errors=True)
    parquet.mkdir(parents=True)
    written, shard, batch, batch_bytes = 0, 0, [], 0
    with open(jsonl.with_suffix(".tmp"), "w", encoding="utf-8") as out:
        while written < size:
            for text in sources:
                at = 0
                while at < len(text) and written < size:
                    n = int(rng.integers(200, 8192))
                    doc = text[at:at + n]
                    at += n
                    out.write(json.dumps({"text": doc}) + "\n")
                    batch.append(doc)
                    batch_bytes += len(doc.encode("utf-8"))
                    written += len(doc.encode("utf-8"))
                    if batch_bytes >= SHARD_MB << 20:
                        pq.write_table(pa.table({"text": batch}), parquet / f"part-{shard:05d}.parquet", compression="zstd")
                        shard, batch, batch_bytes = shard + 1, [], 0
                if written >= size:
                    break
    if batch:
        pq.write_table(pa.table({"text": batch}), parquet / f"part-{shard:05d}.parquet", compression="zstd")
    jsonl.with_suffix(".tmp").rename(jsonl)
    return jsonl, parquet


def bpe_file(work: Path, jsonl: Path, vocab: int) -> Path:
    """A BPE trained on the first 16 MiB of the corpus (as a tokenizer.json)."""
    from jaxshard.data.tokenizer import train_bpe

    path = work / f"bpe-{vocab}.json"
    if not path.is_file():
        def texts():
            seen = 0
            with open(jsonl, encoding="utf-8") as fh:
                for line in fh:
                    text = json.loads(line)["text"]
                    seen += len(text)
                    yield text
                    if seen >= 16 << 20:
                        return
        path.write_text(train_bpe(texts(), vocab).to_json(), encoding="utf-8")
    return path


def prepare(data: str, tokenizer: str, cache: Path, size: int) -> dict:
    """``data`` read into ``cache`` (cold where it holds nothing of this data and tokenizer)."""
    from jaxshard.data.corpus import DataConfig, load_corpus

    t0 = time.perf_counter()
    corpus = load_corpus(DataConfig(path=data, tokenizer=tokenizer, cache_dir=str(cache)))
    seconds = time.perf_counter() - t0
    tokens = len(corpus.train) + len(corpus.val) if not corpus.sources else \
        sum(len(s.train) + len(s.val) for s in corpus.sources)
    return {"seconds": seconds, "mb_per_s": size / 2**20 / seconds, "tokens": tokens,
            "tokens_per_s": tokens / seconds, "corpus": corpus}


def loader(corpus, steps: int, B: int, L: int) -> dict:
    """The training split's batches: made ready (a mixture finds its sources' documents), then
    ``steps`` of them made and put on a device."""
    import jax

    from jaxshard.data.corpus import split_batches, to_global

    t0 = time.perf_counter()
    batches = split_batches(corpus, "train", L, B, seed=0)
    ready = time.perf_counter() - t0
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    jax.block_until_ready(to_global(batches.batch_at(0), sharding, (B, L)))  # (first-touch costs)
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        out = to_global(batches.batch_at(i * B), sharding, (B, L))
    jax.block_until_ready(out)
    seconds = time.perf_counter() - t0
    return {"ready_s": ready, "seconds": seconds, "tokens_per_s": steps * B * L / seconds}


def step_rate(a) -> dict:
    from jaxshard.analysis import devices, timing
    from jaxshard.mesh import build_mesh
    from jaxshard.rules import ShardingRules, Strategy
    from models import TransformerLM, get_preset

    import jax

    model = TransformerLM(get_preset(a.model))
    rules = ShardingRules(build_mesh("data=1", jax.devices()[:1]), Strategy())
    device = devices.KNOWN_DEVICES[a.device]
    t = timing.step_time(model, rules, device, a.batch_size, a.seq_len, software=timing.SOFTWARE["jaxshard"],
                         compute_dtype="bfloat16", param_dtype="float32")
    return {"model": a.model, "device": device.name, "step_time_s": t.total,
            "tokens_per_s": a.batch_size * a.seq_len / t.total}


def table(result: dict) -> list[str]:
    """The markdown table of a result (data.json)."""
    t = result["target"]
    lines = [f"{result['size_mb']:,} MiB of text, {result['cpu_cores']} CPU cores; the step to keep up with: "
             f"{t['model']} on one {t['device']}, {result['batch_size']} x {result['seq_len']} tokens, "
             f"{t['tokens_per_s']:,.0f} tokens/s (time model)", "",
             "| data | tokenizer | prepared once (read, spool, tokenize) | loader, tokens/s | × the step's rate |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        p, ld = r["prepare"], r["loader"]
        prepared = (f"their token files: {p['seconds'] + ld['ready_s']:.1f} s to map and find the documents"
                    if "cached" in r["tokenizer"] else
                    f"{p['seconds']:,.0f} s: {p['mb_per_s']:.1f} MiB/s, {p['tokens_per_s'] / 1e6:.1f} M tokens/s")
        lines.append(f"| {r['data']} | {r['tokenizer']} | {prepared} | {ld['tokens_per_s'] / 1e6:,.1f} M | "
                     f"{ld['times_step_rate']:,.0f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    size = a.size_mb << 20
    t0 = time.perf_counter()
    jsonl, parquet = make_corpus(work, size)
    print(f"corpus: {jsonl} and {parquet}/ ({time.perf_counter() - t0:.0f} s to make or find)", file=sys.stderr)
    bpe = bpe_file(work, jsonl, a.vocab)
    target = step_rate(a)
    print(f"{a.model} on one {target['device']}: {target['step_time_s']:.3f} s per step of "
          f"{a.batch_size} x {a.seq_len} = {target['tokens_per_s']:,.0f} tokens/s (time model)", file=sys.stderr)
    rows = []
    cache = work / "cache"  # (each row's files are its own: named by the data and the tokenizer)
    shutil.rmtree(cache, ignore_errors=True)
    for name, data in (("JSONL", str(jsonl)), ("Parquet", str(parquet))):
        for tok_name, tok in (("bytes", "bytes"), (f"BPE {a.vocab:,}", str(bpe))):
            p = prepare(data, tok, cache, size)
            corpus = p.pop("corpus")
            row = {"data": name, "tokenizer": tok_name, "prepare": p}
            B, L = a.batch_size, a.seq_len
            row["loader"] = loader(corpus, a.steps, B, L)
            rows.append(row)
            print(f"{name:8} {tok_name:11} prepare {p['seconds']:7.1f} s ({p['mb_per_s']:6.1f} MiB/s, "
                  f"{p['tokens_per_s']:>12,.0f} tokens/s) | loader {row['loader']['tokens_per_s']:>13,.0f} tokens/s",
                  file=sys.stderr, flush=True)
    # the mixture of the two, from their token files made above: its preparation finds their
    # documents (the end-of-text ids), nothing is tokenized again
    p = prepare(f"{jsonl}:0.5,{parquet}:0.5", str(bpe), cache, 2 * size)
    corpus = p.pop("corpus")
    rows.append({"data": "mixture JSONL:0.5,Parquet:0.5", "tokenizer": f"BPE {a.vocab:,} (cached)", "prepare": p,
                 "loader": loader(corpus, a.steps, a.batch_size, a.seq_len)})
    shutil.rmtree(cache, ignore_errors=True)
    for r in rows:
        r["loader"]["times_step_rate"] = r["loader"]["tokens_per_s"] / target["tokens_per_s"]
    result = {"size_mb": a.size_mb, "batch_size": a.batch_size, "seq_len": a.seq_len, "cpu_cores": os.cpu_count(),
              "target": target, "rows": rows}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "data.json").write_text(json.dumps(result, indent=1))
    lines = table(result)
    (out / "data.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
