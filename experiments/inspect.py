"""Compile one training step without training and check it against the accounting.

    python experiments/inspect.py --model tiny --mesh data=2,fsdp=4 --cpu-devices 8

Prints, per device: predicted vs XLA-measured memory, predicted vs compiled collective bytes
by kind and mesh axes, FLOPs, and a table of every parameter's logical dims -> mesh axes ->
bytes; flags any collective the strategy does not explain. Takes the flags of train.py.
"""

from __future__ import annotations

import os
import sys

# The repository root instead of this folder: this file would shadow the standard library's inspect.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxshard import cli, runtime  # noqa: E402
from jaxshard.errors import ConfigError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    with cli.one_line_errors():
        cfg, args = cli.parse_run(cli.inspect_parser(), argv, compile_only=True)
        if cfg.sync_every is not None:
            raise ConfigError("--sync-every: the verifier covers the DDP-family step, not local SGD's "
                              "(its compiled collectives are in the training report)")
        runtime.configure(cfg.runtime)

        from experiments.common import build_model
        from jaxshard.analysis import hlo, inspect
        from jaxshard.loop import documents_eot
        from jaxshard.mesh import axis_sizes, build_mesh
        from jaxshard.rules import ShardingRules
        from jaxshard.training.step import balance_stages, build_program, check_batch

        model = build_model(cfg)  # the program training runs: the layer scan rolled
        rules = ShardingRules(build_mesh(cfg.mesh, dcn=cfg.dcn_mesh), cfg.strategy)
        # Packed documents where training would pack them, by the same end-of-text id.
        eot = documents_eot(cfg, data_eot(cfg.data), cfg.data.path or "the embedded corpus", rules, model.cfg)
        if eot is not None:
            model = build_model(cfg, documents_eot=eot)
        step = cfg.step
        if step.balance:
            step, line = balance_stages(model, rules, step, cfg.batch_size, cfg.seq_len)
            print(line)
        program = build_program(model, rules, cfg.optim, step)
        check_batch(rules, cfg.batch_size, cfg.seq_len, step.grad_accum,
                    program.schedule.microbatches if program.schedule else 1)
        packed = " | documents packed (--packing false: one sequence a row)" if eot is not None else ""
        print(f"model {model.cfg.name}: {model.n_params():,} params | mesh {axis_sizes(rules.mesh)} | "
              f"strategy {rules.name} | batch {cfg.batch_size} x {cfg.seq_len}{packed}\n")
        compiled = program.lower_step(cfg.batch_size, cfg.seq_len).compile()
        v = inspect.verify(model, program, compiled, cfg.batch_size, cfg.seq_len, step=step)
        print(inspect.format_verification(v))
        print(f"\ncompiled step: fingerprint {hlo.fingerprint(compiled.as_text())} (a hash of its HLO)")
        return 1 if args.strict and v.flags else 0


def data_eot(data) -> int | None:
    """The end-of-text id of a run's data, found without reading them: their tokenizer's (a
    tokenizer file's, such as an --init-from folder's, or the bytes'), or none for token ids
    with no tokenizer file (a .bin or .tokens that a --config file names)."""
    from pathlib import Path

    from jaxshard.data import mixture
    from jaxshard.data.tokenizer import ByteTokenizer, load_tokenizer, parse_spec

    spec = parse_spec(data.spec)
    if spec.kind == "file":
        return load_tokenizer(spec.path).eot_id
    paths = [p for p, _ in mixture.parse(data.path) or [(data.path, 1.0)] if p is not None]
    return None if any(Path(p).suffix in (".bin", ".tokens") for p in paths) else ByteTokenizer.eot_id


if __name__ == "__main__":
    sys.exit(main())
