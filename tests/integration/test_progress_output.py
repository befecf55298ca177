"""The console. When it is not a terminal (a pipe, a batch job's log): one plain line per logged
step, long messages unwrapped, no live-bar redraws or escape codes. On a terminal: the live bar
keeps step n/N, the elapsed time and the ETA at any width, cutting the metrics. Either way the
line shows the total reward and the loss first."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")

SCRIPT = """
import sys
from rlcu.config import LogConfig
from rlcu.train.logging import RunLogger
cfg = LogConfig(progress=True, plot=False, tensorboard=False, every=2)
with RunLogger(sys.argv[1], cfg, total_steps=5) as log:
    log.info("checkpoint: " + "/very/long/path" * 12 + "/step-000005")
    for s in range(1, 6):
        log.log(s, {"loss": 1.0 / s, "reward": 0.25 * s})
print("done")
"""


def test_non_tty_progress_is_one_line_per_logged_step(tmp_path):
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "COLUMNS": "80", "TERM": "xterm-256color"}
    env.pop("FORCE_COLOR", None)
    # stdout and stderr are pipes: not a terminal
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "done\n"
    lines = p.stderr.splitlines()
    assert "\x1b" not in p.stderr and "\r" not in p.stderr and "━" not in p.stderr
    assert lines[0] == "checkpoint: " + "/very/long/path" * 12 + "/step-000005"  # not wrapped at 80 columns
    steps = lines[1:]
    assert [s.split("  ")[0] for s in steps] == ["step 2/5", "step 4/5", "step 5/5"]
    assert all("loss" in s and "elapsed" in s for s in steps)
    txt = (tmp_path / "log.txt").read_text().splitlines()
    assert [t.split(" STEP ")[1].split("  ")[0] for t in txt if " STEP " in t] == ["step 2/5", "step 4/5", "step 5/5"]


def _live_bar(tmp_path, width: int, total: int = 40, steps: int = 9) -> str:
    """The live bar's last frame on a terminal `width` columns wide."""
    import io
    import re

    from rich.console import Console

    from rlcu.config import LogConfig
    from rlcu.train.logging import RunLogger

    buf = io.StringIO()
    con = Console(file=buf, width=width, force_terminal=True, color_system=None)
    metrics = {"loss": 0.123456, "reward": 0.5, "reward_std": 0.25, "kl": 0.0123, "entropy": 1.2345,
               "completion_len": 187.5, "mismatch/abs_mean": 0.0474, "mismatch/exact_frac": 0.0001}
    with RunLogger(tmp_path / f"w{width}", LogConfig(progress=True, plot=False, tensorboard=False),
                   total_steps=total, console=con) as log:
        for s in range(1, steps + 1):
            log.log(s, metrics)
    frames = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue()).replace("\r", "\n").splitlines()
    return [f for f in frames if f.strip()][-1]


def test_live_bar_keeps_step_and_clocks_at_80_and_120_columns(tmp_path):
    """The metrics are what a narrow terminal cuts, never step n/N, the elapsed time or the ETA."""
    import re

    for width in (80, 120):
        line = _live_bar(tmp_path, width)
        assert len(line) <= width, (width, line)
        assert re.search(r" 9/40 \d+:\d\d:\d\d (\d+:\d\d:\d\d|-:--:--) loss 0.1235", line), (width, line)
        assert line.endswith("…"), (width, line)  # the metrics cut, with an ellipsis
    wide = _live_bar(tmp_path, 250)
    assert "mismatch/exact_frac 0.0001" in wide and "…" not in wide


@pytest.mark.usefixtures("one_thread")
def test_ppo_progress_line_keeps_the_total_reward_with_two_reward_functions(tmp_path):
    """PPO's step puts the per-function rewards and the lengths before the total: the line still
    shows the total reward and the loss."""
    from support.trainers import ppo_trainer

    from rlcu.train.logging import RunLogger

    tr = ppo_trainer(tmp_path, steps=1, rewards=[{"fn": "rlcu.data.synthetic:partial_match_reward"},
                                                 {"fn": "rlcu.data.synthetic:exact_match_reward"}])
    m = tr.train_step(0)
    shown = dict(kv.split(" ") for kv in RunLogger._short(m).split("  "))
    assert {"reward", "loss", "mismatch/abs_mean"} <= set(shown), shown
    assert float(shown["reward"]) == pytest.approx(m["reward"], rel=1e-3)
