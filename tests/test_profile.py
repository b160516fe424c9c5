"""A traced step's kernels tied to their HLO instructions and source lines, and summed into the
time model's parts (jaxshard/analysis/profile.py): on a hand-written module and trace, and on a
real training step's trace and optimized HLO."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxshard.analysis import profile
from jaxshard.analysis.profile import Kernel

ROOT = Path(__file__).resolve().parents[1]

MODULE = """HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[4]{0}, /*index=1*/f32[4]{0})->f32[4]{0}}

FileNames
1 "/src/models/layers.py"
2 "/site-packages/optax/_src/update.py"
3 "/src/jaxshard/parallel/vocab.py"

FunctionNames
1 "Mlp.__call__"
2 "apply_updates"
3 "project"

FileLocations
1 {file_name_id=1 function_name_id=1 line=52 end_line=52 column=1 end_column=9}
2 {file_name_id=2 function_name_id=2 line=42 end_line=42 column=1 end_column=9}
3 {file_name_id=3 function_name_id=3 line=120 end_line=120 column=1 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=0}
2 {file_location_id=2 parent_frame_id=0}
3 {file_location_id=3 parent_frame_id=0}
4 {file_location_id=1 parent_frame_id=4}

ENTRY %main.1 (p.0: f32[4], p.1: f32[4]) -> f32[4] {
  %custom-call.3 = (bf16[8,16]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/dot_general" stack_frame_id=1}
  %loop_add_fusion.3 = f32[4]{0} fusion(%p.0, %p.1), kind=kLoop, calls=%fused, metadata={op_name="jit(step)/add" stack_frame_id=2}
  %input_reduce_fusion.7 = f32[8]{0} fusion(%x), kind=kInput, calls=%fused.2, metadata={op_name="jit(step)/reduce_max" stack_frame_id=4}
  %while.4 = (s32[], /*index=1*/f32[4]{0}) while(%tuple), condition=%cond, body=%body
  ROOT %copy.1 = f32[4]{0} copy(%loop_add_fusion.3)
}
"""


def test_hlo_sources_reads_opcodes_targets_and_stack_frames():
    src = profile.hlo_sources(MODULE)
    assert src["custom-call.3"].opcode == "custom-call"
    assert src["custom-call.3"].target == "__cublas$gemm"
    assert src["custom-call.3"].source == "models/layers.py:52"
    assert src["loop_add_fusion.3"].source == "optax/_src/update.py:42"
    assert src["while.4"].opcode == "while"  # a tuple shape's /*index=1*/ comment does not hide it
    # A frame's chain: the reduction made in layers.py, called from vocab.py.
    assert src["input_reduce_fusion.7"].files == ("models/layers.py", "jaxshard/parallel/vocab.py")
    assert src["copy.1"].source == ""  # no metadata: made by XLA


def k(name, hlo_op, start, dur):
    return Kernel(name, hlo_op, start * 1e6, dur * 1e6, "stream")


def test_summarize_sums_kernels_into_the_time_models_parts():
    src = profile.hlo_sources(MODULE)
    ks = [
        k("nvjet_sm90_tst_128x160", "custom-call.3", 0, 4),  # cuBLAS: a matmul by its kernel's name
        k("loop_add_fusion_3", "command_buffer_1", 4, 1),  # in a CUDA graph: found by its fusion's name
        k("input_reduce_fusion_7", "command_buffer_1", 5, 1),  # the loss: vocab.py is up its frames
        k("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "command_buffer_1", 6, 2),
        k("memcpy128", "command_buffer_1", 8, 1),
        k("ncclDevKernel_AllReduce_Sum_f32", "all-reduce.1", 7, 3),  # overlaps the last two
        k("while.4", "while.4", 0, 10),  # a CPU thunk that runs others: not counted
        k("loop_convert_fusion", "", 12, 1),  # no instruction known
    ]
    # Two steps traced: everything per step.
    out = profile.summarize(ks, src, steps=2)
    assert out["parts_s"] == pytest.approx({"matmul": 2e-3, "attention": 1e-3, "collective": 1.5e-3, "loss": 0.5e-3,
                                            "optimizer": 0.5e-3, "copy": 0.5e-3, "other": 0.5e-3})
    assert out["kernel_s"] == pytest.approx(6.5e-3)
    assert out["busy_s"] == pytest.approx(5.5e-3)  # 0 to 10 ms and 12 to 13, halved
    assert out["span_s"] == pytest.approx(6.5e-3)
    top = {r["hlo_op"] or r["kernels"][0]: r for r in out["top"]}
    assert top["custom-call.3"]["source"] == "models/layers.py:52"
    assert top["loop_add_fusion.3"]["part"] == "optimizer" and top["loop_add_fusion.3"]["ms"] == pytest.approx(0.5)
    # Library kernels inside a graph keep their own names as rows.
    assert top["cudnn_generated_fort_native_sdpa_sm90_flash_fprop"]["part"] == "attention"

    # Two devices traced: the same per device. A kernel of another module (an evaluation
    # program's fusion of the same name) is not credited to the step's instructions.
    from dataclasses import replace

    two = profile.summarize(ks + [replace(k, plane="/device:GPU:1") for k in ks], src, steps=2, module="jit_step")
    assert two["devices"] == 2 and two["parts_s"] == pytest.approx(out["parts_s"])
    assert two["busy_s"] == pytest.approx(out["busy_s"])
    other = profile.summarize([Kernel("loop_add_fusion_3", "command_buffer_9", 0, 1e6, "s", "", "jit_eval")], src,
                              steps=1, module="jit_step")
    assert other["parts_s"]["optimizer"] == 0 and other["parts_s"]["other"] == pytest.approx(1e-3)


def test_a_training_steps_trace_is_tied_to_its_source(tmp_path, capsys):
    """CPU: XLA's thunks stand in for kernels. The optimizer's and the loss's work are found by
    the source lines up their stack frames, the layers' matmuls by their opcode."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_dump_to={tmp_path / 'hlo'} --xla_dump_hlo_as_text "
                                      "--xla_dump_hlo_module_re=jit_step"}
    done = subprocess.run(
        [sys.executable, "experiments/train.py", "--model", "llama-tiny", "--seq-len", "64", "--batch-size", "2",
         "--steps", "3", "--eval-every", "0", "--profile-steps", "2:3", "--profile-dir", str(tmp_path / "trace")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = profile.profile(str(tmp_path / "trace"), str(tmp_path / "hlo"), steps=2)
    assert out["sources_found"] > 0.9
    parts = out["parts_s"]
    assert parts["matmul"] > 0 and parts["optimizer"] > 0 and parts["loss"] > 0 and parts["other"] > 0
    assert parts["attention"] == parts["collective"] == 0  # CPU: no fused kernel, one device
    assert out["busy_s"] <= out["span_s"]
    sources = {r["source"].split(":")[0] for r in out["top"]}
    assert "models/layers.py" in sources
    # The command line prints the same summary.
    assert profile.main([str(tmp_path / "trace"), "--steps", "2", "--hlo", str(tmp_path / "hlo")]) == 0
    printed = capsys.readouterr().out
    assert f"{out['kernels']} kernels a step" in printed and "optimizer" in printed
    assert profile.main([str(tmp_path / "nothing"), "--steps", "2"]) == 1
    assert capsys.readouterr().out.startswith("error: no .xplane.pb under")


def test_stack_frames_of_a_real_compiled_module(tmp_path, monkeypatch):
    """The chain of files behind each instruction, read from the module text XLA prints: sin is
    made in one file, called from a second, called from this one; cos in this file alone."""
    import jax
    import jax.numpy as jnp

    (tmp_path / "inner_mod.py").write_text("import jax.numpy as jnp\n\n\ndef inner(x):\n    return jnp.sin(x)\n")
    (tmp_path / "middle_mod.py").write_text("import inner_mod\n\n\ndef middle(x):\n    return inner_mod.inner(x) * 3.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import middle_mod

    def step(x):
        return middle_mod.middle(x) + jnp.cos(x)

    src = profile.hlo_sources(jax.jit(step).lower(jnp.ones(4)).compile().as_text())
    sin = [v for v in src.values() if v.source == "inner_mod.py:5"]
    assert sin and sin[0].files[:3] == ("inner_mod.py", "middle_mod.py", "test_profile.py"), sin
    cos = [v for v in src.values() if v.op_name.endswith("/cos")]
    assert cos and cos[0].files[0] == "test_profile.py" and "inner_mod.py" not in cos[0].files, cos


def test_a_pipeline_steps_ops_are_put_in_the_executors_parts():
    """An instruction is the executor's op whose scope it runs in (the innermost), a send
    between stages, the tick loop's own work, the step around the loop, or XLA's own."""
    tick = "jit(step)/shard_map/while/body/closed_call/cond/branch_1_fun/"
    cases = {
        (tick + "pipeline_tick_F/jvp()/while/body/closed_call/dot_general", "fusion"): "F",
        (tick + "pipeline_tick_W_first/while/body/closed_call/transpose", "dot"): "W_first",
        (tick + "pipeline_tick_last/jvp()/pipeline_tick_B/reduce_sum", "fusion"): "B",
        ("jit(step)/shard_map/while/body/closed_call/ppermute", "collective-permute"): "send",
        ("jit(step)/shard_map/while/body/closed_call/ppermute", "fusion"): "tick",
        (tick + "add", "fusion"): "tick",
        ("jit(step)/shard_map/psum_invariant", "all-reduce"): "outside",
        ("jit(step)/adam/mul", "fusion"): "outside",
        ("", "copy"): "xla",
    }
    for (op_name, opcode), want in cases.items():
        assert profile.tick_part(profile.Source(opcode, op_name=op_name)) == want, (op_name, opcode)
    assert profile.tick_part(None) == "xla"
    # Per device and step; the loops and branches that run others are not counted.
    src = {"f": profile.Source("fusion", op_name=tick + "pipeline_tick_F/dot_general"),
           "s": profile.Source("collective-permute", op_name="jit(step)/shard_map/while/body/ppermute"),
           "w": profile.Source("while", op_name="jit(step)/shard_map/while")}
    ks = [Kernel("f", "f", 0, 4e6, "t0", "/host:CPU", "jit_step", "0"), Kernel("f", "f", 5e6, 2e6, "t1", "/host:CPU",
                                                                             "jit_step", "1"),
          Kernel("s", "s", 4e6, 6e6, "t0", "/host:CPU", "jit_step", "0"), Kernel("w", "w", 0, 9e6, "t0", "", "", "0")]
    assert profile.tick_parts(ks, src, steps=2) == {"0": {"F": 2e-3, "send": 3e-3}, "1": {"F": 1e-3}}
