"""Generate text from a training checkpoint or a Hugging Face folder, on a device mesh.

    python experiments/generate.py --checkpoint runs/ck --prompt "def " --max-new-tokens 100
    python experiments/generate.py --init-from HF_DIR --prompt "Hello" --prompt "The" \\
        --mesh data=2,tensor=2 --cpu-devices 4 --temperature 0.8 --top-p 0.95 --seed 1

The prompts are one batch, split over the mesh's batch axes when they divide it; tensor
parallelism splits the heads (and the KV cache) over ``tensor``. Decoding uses a KV cache.
Temperature 0 decodes greedily.
"""

from __future__ import annotations

import argparse
import os
import sys

# The repository root instead of this folder, whose inspect.py would shadow the standard library's.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxshard import cli, runtime  # noqa: E402
from jaxshard.errors import ConfigError  # noqa: E402
from jaxshard.runtime import DEFAULT_CACHE  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = cli.Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR", help="a training run's --checkpoint-dir")
    source.add_argument("--init-from", metavar="HF_DIR", help="a Hugging Face GPT-2 or Llama folder")
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the latest)")
    p.add_argument("--prompt", action="append", default=None,
                   help="a prompt; repeat for a batch (default: one newline)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample among the likeliest tokens of mass p")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, metavar="bytes|PATH",
                   help="default: the checkpoint's, or the Hugging Face folder's tokenizer.json, else bytes")
    p.add_argument("--mesh", default="data=-1", help="AXIS=SIZE,... over data, fsdp and tensor")
    p.add_argument("--cpu-devices", type=int, default=None)
    p.add_argument("--platform", default=None)
    p.add_argument("--compile-cache", default=str(DEFAULT_CACHE))
    return p


def main(argv: list[str] | None = None) -> int:
    with cli.one_line_errors():
        a = parser().parse_args(argv)
        if a.step is not None and not a.checkpoint:
            raise ConfigError("--step picks a step of --checkpoint's; --init-from has one set of weights")
        runtime.configure(runtime.RuntimeConfig(cpu_devices=a.cpu_devices, platform=a.platform,
                                                compile_cache=a.compile_cache or None))
        from jaxshard.analysis.inspect import max_bytes_per_device
        from jaxshard.data import tokenizer as tok
        from jaxshard.mesh import MeshSpec, axis_sizes, build_mesh
        from jaxshard.rules import ShardingRules, StateKind, Strategy
        from jaxshard.train import restore_model
        from models import TransformerLM, hf
        from models.generate import generate

        rules = ShardingRules(build_mesh(MeshSpec.parse(a.mesh)), Strategy())
        if a.checkpoint:
            model, params, tokenizer, _ = restore_model(a.checkpoint, rules, a.step)
            if tokenizer is None and not a.tokenizer:
                raise ConfigError(f"--checkpoint {a.checkpoint} was trained on token ids without a "
                                  "tokenizer: give --tokenizer")
        else:
            model = TransformerLM(hf.read_config(a.init_from))
            shardings = rules.param_shardings(model.param_axes(), model.abstract_params(), StateKind.PARAMS)
            params = hf.load_params(a.init_from, model, shardings)
            has_own = os.path.isfile(os.path.join(a.init_from, "tokenizer.json"))
            tokenizer = tok.load_tokenizer(a.init_from) if has_own else tok.ByteTokenizer()
        if a.tokenizer:
            tokenizer = tok.tokenizer_from_spec(tok.parse_spec(a.tokenizer))
        texts = a.prompt or ["\n"]
        prompts = [[int(t) for t in tokenizer.encode(text)] for text in texts]
        outputs = generate(model, params, prompts, a.max_new_tokens, temperature=a.temperature,
                           top_k=a.top_k, top_p=a.top_p, seed=a.seed, rules=rules,
                           stop_id=tokenizer.eot_id)
        for text, new in zip(texts, outputs):
            if new and new[-1] == tokenizer.eot_id:
                new = new[:-1]  # the end-of-text token that stopped it
            print(text + tokenizer.decode(new))
            if len(texts) > 1:
                print("-" * 40)
        print(f"model {model.cfg.name}: {model.n_params():,} params, {max_bytes_per_device(params):,} B "
              f"per device on mesh {axis_sizes(rules.mesh)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
