"""RunLogger: metrics.jsonl, log.txt's per-step lines, resume truncation, the PNG's name; the
TensorBoard event files read back by tensorboard's EventAccumulator (one point per step after
any resume), the warning without the package."""

import json
import sys

import pytest

from rlcu.config import LogConfig
from rlcu.train.logging import RunLogger


def _scalars(folder, tag="loss"):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _run(folder, steps, f, total=6, resume_step=None, **cfg):
    cfg = {"progress": False, "plot": False, **cfg}
    with RunLogger(folder, LogConfig(**cfg), total_steps=total, resume_step=resume_step) as log:
        for s in steps:
            log.log(s, {"loss": f(s)})


def test_run_logger(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = LogConfig(every=2, progress=False, plot=True)
    with RunLogger(tmp_path, cfg, total_steps=5) as log:
        for s in range(1, 6):
            log.log(s, {"loss": 1.0 / s, "reward/mean": 0.1 * s, "note": "x", "skipped": False})
        log.info("hello")
        log.warn("careful")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 5]  # every 2 steps, and the last
    assert rows[0] == {"step": 2, "loss": 0.5, "reward/mean": 0.2, "note": "x", "skipped": 0}
    txt = (tmp_path / "log.txt").read_text()
    assert "INFO hello" in txt and "WARN careful" in txt
    steps = [line.split(" STEP ", 1)[1] for line in txt.splitlines() if " STEP " in line]
    assert steps == ["step 2/5  loss 0.5  reward/mean 0.2  skipped 0",
                     "step 4/5  loss 0.25  reward/mean 0.4  skipped 0",
                     "step 5/5  loss 0.2  reward/mean 0.5  skipped 0"]
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
    assert _scalars(tmp_path) == [(2, 0.5), (4, 0.25), (5, pytest.approx(0.2))]
    assert _scalars(tmp_path, "reward/mean") == [(2, pytest.approx(0.2)), (4, pytest.approx(0.4)),
                                                 (5, pytest.approx(0.5))]
    try:
        import matplotlib  # noqa: F401

        assert (tmp_path / "reward_curve.png").stat().st_size > 0
    except ImportError:
        assert "matplotlib is not installed" in txt


def test_plot_is_named_for_what_it_shows(tmp_path):
    pytest.importorskip("matplotlib")
    _run(tmp_path, range(1, 4), lambda s: 1.0 / s, total=3, plot=True, tensorboard=False)
    assert (tmp_path / "loss_curve.png").stat().st_size > 0  # an SFT run: the loss, no reward
    assert not (tmp_path / "reward_curve.png").exists()
    assert RunLogger.plot_name(["reward", "eval/accuracy"]) == "reward_curve.png"
    assert RunLogger.plot_name(["loss", "eval/loss"]) == "loss_curve.png"
    assert RunLogger.plot_name(["kl"]) == "curves.png"


def test_tensorboard_resume_has_no_duplicate_points(tmp_path):
    pytest.importorskip("tensorboard")
    _run(tmp_path, range(1, 6), float)  # steps 1-5; the checkpoint was at 3
    _run(tmp_path, range(4, 6), lambda s: 10.0 * s, resume_step=3)  # killed again after 5; checkpoint at 4
    _run(tmp_path, range(5, 7), lambda s: 100.0 * s, resume_step=4)
    assert _scalars(tmp_path) == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 500.0), (6, 600.0)]
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
    _run(tmp_path, range(1, 3), lambda s: -s)  # a fresh run into the folder starts anew, as metrics.jsonl does
    assert _scalars(tmp_path) == [(1, -1.0), (2, -2.0)]


def test_tensorboard_stale_file_is_purged(tmp_path):
    """A process killed between writing the resumed file and deleting the old one leaves both:
    the new file's SessionLog START still hides the old points."""
    pytest.importorskip("tensorboard")
    _run(tmp_path, range(1, 6), float)
    (old,) = tmp_path.glob("events.out.tfevents.*")
    data = old.read_bytes()
    _run(tmp_path, range(4, 7), lambda s: 10.0 * s, resume_step=3)
    (tmp_path / "events.out.tfevents.0000000000.stale").write_bytes(data)  # sorts first, as an older file does
    assert _scalars(tmp_path) == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]


def test_tensorboard_missing_is_one_warning(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "tensorboard" or m.startswith("tensorboard.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError
    _run(tmp_path, range(1, 3), float, tensorboard=True)
    warns = [line for line in (tmp_path / "log.txt").read_text().splitlines() if " WARN " in line]
    assert len(warns) == 1 and "log.tensorboard" in warns[0] and "rlcu[tensorboard]" in warns[0]
    assert not list(tmp_path.glob("events.out.tfevents.*"))
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2  # the run goes on


def test_resume_truncates(tmp_path):
    cfg = LogConfig(progress=True, plot=False, tensorboard=False)
    with RunLogger(tmp_path, cfg, total_steps=6) as log:
        for s in range(1, 6):
            log.log(s, {"loss": float(s)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # a line torn by a kill mid-write
    with RunLogger(tmp_path, cfg, total_steps=6, resume_step=3) as log:
        assert [r["step"] for r in log.history] == [1, 2, 3]
        for s in range(4, 7):
            log.log(s, {"loss": 10.0 * s})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]
    with RunLogger(tmp_path, cfg, total_steps=6):  # a fresh run starts a fresh file
        pass
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_plot_draws_eval_beside_train_and_the_legend_off_the_lines(tmp_path, monkeypatch):
    """The held-out curve is drawn with its training curve (same colour), and the legend sits
    outside the axes, where it covers no line."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    seen = {}
    save = Figure.savefig

    def recording_savefig(fig, *a, **kw):
        fig.canvas.draw()
        (ax,) = fig.axes
        legends = fig.legends + ([ax.get_legend()] if ax.get_legend() else [])
        seen["labels"] = [t.get_text() for lg in legends for t in lg.get_texts()]
        box = ax.get_window_extent()
        seen["overlap"] = [lg.get_window_extent().overlaps(box) for lg in legends]
        seen["colours"] = {ln.get_label(): ln.get_color() for ln in ax.get_lines()}
        return save(fig, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", recording_savefig)
    cfg = LogConfig(progress=False, plot=True, tensorboard=False)
    with RunLogger(tmp_path, cfg, total_steps=4) as log:
        log.log(0, {"eval/reward": 0.1, "eval/reward/exact": 0.0, "eval/accuracy": 1.0})
        for s in range(1, 5):
            m = {"reward/exact": 0.1 * s, "reward/format": 0.2, "reward": 0.2 + 0.1 * s, "reward_std": 0.1,
                 "reward_failed/exact": 1.0}
            if s % 2 == 0:
                m.update({"eval/reward": 0.1 * s, "eval/reward/exact": 0.05 * s})
            log.log(s, m)
        assert log._plot_keys() == ["reward", "reward/exact", "reward/format", "eval/reward", "eval/reward/exact"]
    assert (tmp_path / "reward_curve.png").stat().st_size > 0
    assert seen["labels"] == ["reward", "reward/exact", "reward/format", "eval/reward (held out)",
                              "eval/reward/exact (held out)"]
    assert seen["overlap"] == [False]
    c = seen["colours"]
    assert c["reward"] == c["eval/reward (held out)"] and c["reward/exact"] == c["eval/reward/exact (held out)"]
    assert c["reward"] != c["reward/exact"]
    sft = RunLogger(tmp_path / "sft", cfg, total_steps=2)
    sft.log(0, {"eval/loss": 3.0})
    sft.log(1, {"loss": 2.0})
    sft.log(2, {"loss": 1.0, "eval/loss": 1.5})
    assert sft._plot_keys() == ["loss", "eval/loss"]
    sft.close()
    assert seen["labels"] == ["loss", "eval/loss (held out)"] and (tmp_path / "sft" / "loss_curve.png").exists()
