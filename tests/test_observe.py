"""TensorBoard scalars written and read back, the profiler's window of steps, and the loss plot."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import plot
from jaxshard.errors import ConfigError, DataError
from jaxshard.training.observe import ProfileWindow, TensorBoardLog, read_curve, read_scalars

ROOT = Path(__file__).resolve().parents[1]


def f32(x: float) -> float:
    return float(np.float32(x))  # TensorBoard keeps scalars as float32


def test_tensorboard_log_reads_back_what_it_wrote(tmp_path):
    records = [
        {"step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.7, "tokens_per_s": 12345.0, "mfu": 0.31,
         "moe_load_balance": 1.02, "step_time_s": 0.1, "hfu": 0.4},
        {"step": 2, "loss": float("nan"), "lr": 2e-3, "grad_norm": float("inf"), "tokens_per_s": 12000.0},
        {"step": 3, "loss": 2.0, "val_loss": 2.2, "lr": 3e-3, "grad_norm": 0.5, "tokens_per_s": 13000.0,
         "mfu": 0.33, "moe_load_balance": 1.01},
    ]
    with TensorBoardLog(tmp_path) as log:
        for r in records:
            log.write(r["step"], r)
    assert read_scalars(tmp_path) == {
        "train/loss": [(1, f32(2.5)), (3, f32(2.0))],
        "val/loss": [(3, f32(2.2))],
        "train/lr": [(1, f32(1e-3)), (2, f32(2e-3)), (3, f32(3e-3))],
        "train/grad_norm": [(1, f32(0.7)), (3, f32(0.5))],
        "perf/tokens_per_s": [(1, 12345.0), (2, 12000.0), (3, 13000.0)],
        "perf/mfu": [(1, f32(0.31)), (3, f32(0.33))],
        "train/moe_load_balance": [(1, f32(1.02)), (3, f32(1.01))],
    }


def test_a_resumed_log_replaces_the_steps_after_its_checkpoint(tmp_path):
    # Within the same second as the first run, too: its file must survive the second's.
    with TensorBoardLog(tmp_path) as log:
        for step in range(1, 5):
            log.write(step, {"loss": float(step)})
    with TensorBoardLog(tmp_path, start_step=2) as log:
        for step in (3, 4):
            log.write(step, {"loss": 10.0 * step})
    assert len(list(tmp_path.glob("*tfevents*"))) == 2
    assert read_scalars(tmp_path) == {"train/loss": [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]}


def test_a_record_cut_short_ends_the_file(tmp_path):
    with TensorBoardLog(tmp_path) as log:
        for step in range(1, 4):
            log.write(step, {"loss": float(step)})
    (events,) = tmp_path.glob("*tfevents*")
    events.write_bytes(events.read_bytes()[:-3])
    assert read_scalars(tmp_path) == {"train/loss": [(1, 1.0), (2, 2.0)]}


def test_no_directory_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # tensorboardX's default would be ./runs/...
    with TensorBoardLog(None) as log:
        log.write(1, {"loss": 1.0})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("make", [lambda p: p, lambda p: p / "missing"])
def test_no_event_file_is_a_one_line_error(tmp_path, make):
    with pytest.raises(DataError, match="no TensorBoard event file") as e:
        read_scalars(make(tmp_path))
    assert "\n" not in str(e.value)


def test_profile_window_traces_steps_first_to_last(tmp_path):
    window = ProfileWindow.parse("2:3", str(tmp_path / "profile"))
    f = jax.jit(lambda x: x @ x / 64)
    x = jnp.ones((64, 64))
    blocked = []

    def block():
        blocked.append(step)
        x.block_until_ready()

    with window:
        for step in range(1, 5):
            window.before(step)
            with jax.profiler.TraceAnnotation(f"observe-test-step-{step}"):
                x = f(x)
            window.after(step, block)
    assert blocked == [3]
    (trace,) = (tmp_path / "profile" / "plugins" / "profile").glob("*/*.xplane.pb")
    data = trace.read_bytes()
    assert [f"observe-test-step-{s}".encode() in data for s in range(1, 5)] == [False, True, True, False]


def test_profile_window_close_stops_a_trace_still_running(tmp_path):
    window = ProfileWindow.parse("2:9", str(tmp_path / "profile"))
    f = jax.jit(lambda x: x + 1)
    x = jnp.zeros(8)
    for step in range(1, 4):
        window.before(step)
        x = f(x)
        window.after(step, x.block_until_ready)
    assert not (tmp_path / "profile").exists()  # written when the trace stops
    window.close()
    assert len(list((tmp_path / "profile").glob("plugins/profile/*/*.xplane.pb"))) == 1
    jax.profiler.start_trace(tmp_path / "again")  # raises if a trace were still running
    jax.profiler.stop_trace()


@pytest.mark.parametrize("spec, directory, flag", [
    ("5", "d", "--profile-steps"), ("a:b", "d", "--profile-steps"), ("2:", "d", "--profile-steps"),
    ("0:3", "d", "--profile-steps"), ("-1:3", "d", "--profile-steps"), ("3:2", "d", "--profile-steps"),
    ("2:3", None, "--profile-dir"), (None, "d", "--profile-steps"),
])
def test_bad_profile_flags_name_the_flag(spec, directory, flag):
    with pytest.raises(ConfigError, match=flag) as e:
        ProfileWindow.parse(spec, directory)
    assert "\n" not in str(e.value)


def test_profile_flags_parse():
    assert ProfileWindow.parse(None, None) is None
    window = ProfileWindow.parse("3:3", "d")
    assert (window.first, window.last, window.directory) == (3, 3, "d")
    window.check(3)
    with pytest.raises(ConfigError, match=r"--profile-steps 3:3 .*--steps 2"):
        window.check(2)


def write_metrics(path: Path, records) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_read_curve_from_metrics_file_folder_and_event_files(tmp_path):
    records = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": "nan"}, {"step": 3, "loss": 2.0, "val_loss": 2.5},
               {"step": 4, "loss": 1.5}]
    write_metrics(tmp_path / "a.jsonl", records)
    write_metrics(tmp_path / "run_b" / "metrics.jsonl", records)
    with TensorBoardLog(tmp_path / "run_c") as log:
        for r in records[:1] + records[2:]:
            log.write(r["step"], r)
    for run, name in [(tmp_path / "a.jsonl", "a.jsonl"), (tmp_path / "run_b", "run_b"),
                      (tmp_path / "run_b" / "metrics.jsonl", "run_b"), (tmp_path / "run_c", "run_c")]:
        curve = read_curve(run)
        assert (curve.name, curve.train, curve.val) == (name, [(1, 3.0), (3, 2.0), (4, 1.5)], [(3, 2.5)])


def test_plot_draws_every_run(tmp_path):
    write_metrics(tmp_path / "a" / "metrics.jsonl",
                  [{"step": s, "loss": 4.0 / s, **({"val_loss": 4.5 / s} if s % 5 == 0 else {})}
                   for s in range(1, 21)])
    write_metrics(tmp_path / "b.jsonl", [{"step": s, "loss": 3.0 / s} for s in range(1, 21)])
    out = tmp_path / "figs" / "loss.png"
    plot.main([str(tmp_path / "a"), str(tmp_path / "b.jsonl"), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    rgb = (matplotlib.image.imread(out)[..., :3] * 255).round().astype(int)
    for color in ((0x1f, 0x77, 0xb4), (0xff, 0x7f, 0x0e)):  # C0, C1: each run's line
        assert (np.abs(rgb - color).sum(-1) <= 6).sum() > 100, color


@pytest.mark.parametrize("content, message", [("", "empty"), ('{"step": 1, "lr": 0.1}\n', "no step has 'loss'"),
                                              ('{"step": 1, "loss": \n', "not a JSON object")])
def test_plot_bad_metrics_file_is_a_one_line_error(tmp_path, capsys, content, message):
    (tmp_path / "m.jsonl").write_text(content)
    with pytest.raises(SystemExit) as e:
        plot.main([str(tmp_path / "m.jsonl"), "--out", str(tmp_path / "x.png")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not (tmp_path / "x.png").exists()


def test_plot_missing_file_from_the_command_line(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "experiments" / "plot.py"), str(tmp_path / "nope.jsonl"),
                             "--out", str(tmp_path / "x.png")], capture_output=True, text=True, timeout=60,
                            cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [f"error: {tmp_path / 'nope.jsonl'}: no such file or folder"]
