"""The console when it is not a terminal (a pipe, a batch job's log): one plain line per logged
step, long messages unwrapped, no live-bar redraws or escape codes."""

import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")

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
