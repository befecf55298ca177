"""bench/ppo_rm.py's TRL side where the installed TRL has no PPO trainer (TRL 1.13 removed it): the
row is an error naming the removal and the way to run the peer (--trl-path), not a crash."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ppo_rm_trl_side_without_ppo_trainer(monkeypatch):
    import trl

    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.delattr(trl, "PPOTrainer", raising=False)
    monkeypatch.setitem(sys.modules, "trl.experimental.ppo", None)  # its import raises ImportError
    from bench.ppo_rm import run_trl

    row = run_trl(tiny=True, steps=1, warmup=0, micro_batch=4)
    assert set(row) == {"error", "trl"} and row["trl"] == trl.__version__
    assert "huggingface/trl#7020" in row["error"] and "--trl-path" in row["error"] and "1.12.0" in row["error"]
