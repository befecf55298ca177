"""bench/learning.py's plumbing on the CPU twins at a tiny size: each rlcu mode's GRPO config,
exact mode's bit-equal logprobs through a real (2-step) run, the other modes' runs and their
mismatch records, TRL's arm (skipped without TRL), and the summary and the figure."""

import json
import math

import pytest
import torch

from bench import learning, learning_tasks
from bench import learning_worker as w

TINY = dict(sft_steps=3, n_train=64, n_eval=8)


def test_mode_configs(tmp_path):
    task = learning_tasks.get("demo")
    c = {m: w.grpo_config(task, 0, m, 2, tmp_path / m) for m in w.MODES}
    assert (c["default"].old_logprobs, c["default"].behaviour_correction, c["default"].exact) == ("engine", "none",
                                                                                                  False)
    assert (c["tis"].old_logprobs, c["tis"].behaviour_correction, c["tis"].tis_cap) == ("recompute", "tis", 2.0)
    assert (c["recompute"].old_logprobs, c["recompute"].behaviour_correction) == ("recompute", "none")
    assert c["exact"].exact and c["exact"].old_logprobs == "engine"
    shared = ("prompts_per_step", "group_size", "max_new_tokens", "temperature", "clip_low", "clip_high", "loss_agg",
              "seed")
    for m in w.MODES:  # the modes differ in their MODES entry only
        assert all(getattr(c[m], k) == getattr(c["default"], k) for k in shared)
        assert c[m].optim.lr == w.HYPER["lr"]
    with pytest.raises(ValueError, match="mode must be one of"):
        w.grpo_config(task, 0, "bogus", 2, tmp_path)


def test_long_task_rows():
    t = learning_tasks.get("long")
    train, held = t.rows("train", 0)[:200], t.rows("eval", 0)
    tok = t.tokenizer()
    lens = [len(tok.encode(r["answer"])) for r in held]
    assert 24 <= min(lens) and max(lens) <= 40 and t.max_new_tokens == 42
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert all(0 not in tok.encode(r["prompt"] + r["completion"]) for r in train[:50])  # id 0: <unk>


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("learning")
    task = learning_tasks.get("demo").scaled(**TINY)
    sft = {**w.sft(task, 0, d, "cpu", torch.float32), "task": "demo", "seed": 0, "mode": "sft"}
    out = []
    for m, steps in (("default", 1), ("tis", 1), ("recompute", 1), ("exact", 2)):  # exact mode: the model's
        out.append({**w.grpo(task, 0, m, steps, d, "cpu", torch.float32, engine_eval=False), "task": "demo",
                    "seed": 0, "mode": m})
    return sft, out


def test_exact_mode_is_bit_equal(runs):
    ex = next(r for r in runs[1] if r["mode"] == "exact")
    assert len(ex["reward"]) == 2
    assert ex["mismatch"]["mismatch/exact_frac"] == [1.0, 1.0]
    assert ex["mismatch"]["mismatch/abs_mean"] == [0.0, 0.0]


def test_modes_record_mismatch(runs):
    sft, rs = runs
    assert 0 <= sft["accuracy_before"] <= 1
    for r in rs:
        assert set(r["mismatch"]) == set(w.MISMATCH) and 0 <= r["accuracy_after"] <= 1
        assert all(v is not None and math.isfinite(v) for v in r["mismatch"]["mismatch/abs_mean"])


def test_summary_and_plot(runs, tmp_path):
    sft, rs = runs
    s = learning.summarize([sft], rs, ["demo"], list(w.MODES), tail=5)
    assert s["demo"]["exact"]["mismatch/exact_frac_mean"] == 1.0
    assert s["demo"]["default"]["seeds"] == 1
    json.dumps(s)
    from bench.learning_plot import plot

    plot(rs, [sft], ["demo"], list(w.MODES), "test", tmp_path / "l.png")
    assert (tmp_path / "l.png").stat().st_size > 10_000


def test_trl_arm(tmp_path):
    pytest.importorskip("trl", reason="TRL is not installed (bench-only)")
    pytest.importorskip("datasets", reason="datasets is not installed (TRL needs it)")
    task = learning_tasks.get("demo").scaled(**TINY)
    w.sft(task, 1, tmp_path, "cpu", torch.float32)
    r = w.grpo(task, 1, "trl", 1, tmp_path, "cpu", torch.float32)
    assert len(r["reward"]) == 1 and r["mismatch"] is None and 0 <= r["accuracy_after"] <= 1
