"""bench/lora_host.py --quick: both modes (one LoRA host process; the same jobs as separate
processes under the scheduler) run to their end on the CPU, and the report's lines come out."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_lora_host_bench_quick(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(ROOT / "src"))
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "lora_host.py"), "--quick"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "host: 3/3 jobs" in p.stdout and "separate processes under the scheduler: 3/3 jobs" in p.stdout
    import json

    got = json.loads((tmp_path / "lora_host.json").read_text())
    assert got["host"]["in_place"] is False  # ranks 4, 8, 4: the slots copy them
    assert got["host"]["engine_steps"] > 0 and got["separate_sched"]["jobs_done"] == 3
