"""Convert a training checkpoint into a Hugging Face model folder (config.json, safetensors,
tokenizer.json) that ``transformers.AutoModelForCausalLM.from_pretrained`` loads as it is.

    python scripts/convert_checkpoint.py runs/ck runs/ck-hf            # the latest step
    python scripts/convert_checkpoint.py runs/ck runs/ck-hf --step 200 --cpu-devices 8 --mesh fsdp=8

Only the params are read (not the optimizer state), each into its sharding on ``--mesh``, and
gathered one param at a time for writing: a model larger than one device converts on a mesh.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxshard import cli, runtime  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = cli.Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a training run's --checkpoint-dir")
    p.add_argument("out", help="the Hugging Face folder to write (new or empty)")
    p.add_argument("--step", type=int, default=None, help="default: the latest complete step")
    p.add_argument("--mesh", default="data=-1", help="where the params are read to (e.g. fsdp=8)")
    p.add_argument("--cpu-devices", type=int, default=None)
    p.add_argument("--platform", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    with cli.one_line_errors():
        a = parser().parse_args(argv)
        runtime.configure(runtime.RuntimeConfig(cpu_devices=a.cpu_devices, platform=a.platform,
                                                compile_cache=None))
        from jaxshard.mesh import MeshSpec, build_mesh
        from jaxshard.rules import ShardingRules, Strategy
        from jaxshard.train import restore_model
        from models import hf

        hf.check_export_dir(a.out)
        rules = ShardingRules(build_mesh(MeshSpec.parse(a.mesh)), Strategy())
        model, params, tokenizer, step = restore_model(a.checkpoint, rules, a.step)
        folder = hf.export(params, model.cfg, a.out, tokenizer and tokenizer.to_json(),
                           tokenizer and tokenizer.eot_id)
        print(f"wrote step {step} of {a.checkpoint} ({model.cfg.name}, {model.n_params():,} params) to {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
