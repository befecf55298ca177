"""bench/lora_host.py --quick: both modes (one LoRA host process; the same jobs as separate
processes under the scheduler) run to their end on the CPU, and the report's lines come out, with
each mode's start-up and step times and the host's phases; `--shape` makes a SHAPES trunk over the
task's vocabulary."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    for mode in ("host", "separate_sched"):
        st = got[mode]["step_times"]
        assert [len(s) for s in st["step_times_s"]] == [2, 2, 2], mode  # --quick: 3 jobs x 2 steps
        assert 0 < st["step_s"] < got[mode]["makespan_s"] and 0 < st["startup_s"] < got[mode]["makespan_s"], mode
    ph = got["host"]["phases_s"]
    assert len(ph["serve_s"]) == 3 and ph["before_host_s"] > 0 and ph["builds_s"] > 0, ph
    assert "later steps" in p.stdout and "host phases" in p.stdout


def test_lora_host_bench_shape(monkeypatch):
    import argparse

    monkeypatch.syspath_prepend(str(ROOT))
    from bench import sched

    for k in ("job_config", "tiny_model", "base_checkpoint"):  # bench/lora_host.py replaces them: put them back
        monkeypatch.setattr(sched, k, getattr(sched, k))
    from bench import lora_host
    from bench.common import SHAPES

    a = argparse.Namespace(shape="8b", quick=False, hidden=1024, layers=28, new_tokens=128)
    cfg = lora_host.shape_model(a)
    assert cfg["hidden_size"] == SHAPES["8b"]["hidden_size"] == 4096 and cfg["num_hidden_layers"] == 36
    assert cfg["head_dim"] == 128 and cfg["vocab_size"] < 1000 and cfg["max_position_embeddings"] == 192
    assert lora_host.shape_model(argparse.Namespace(**{**vars(a), "quick": True}))["hidden_size"] == 64
    a.shape = "9b"
    with pytest.raises(SystemExit, match="9b"):
        lora_host.shape_model(a)
