"""The built-in synthetic task and a shortened run of `rlcu demo` (the full demo, with its
accuracy gain and time limit, is measured by running `rlcu demo` itself)."""

from __future__ import annotations

import json

import pytest

from rlcu.data import synthetic as syn

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_sort_task():
    kw = dict(min_len=4, max_len=8, distinct=True, sloppy=0.7, sloppy_min_len=6)
    train = syn.sort_rows(2000, "train", **kw)
    held = syn.sort_rows(300, "eval", **kw)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert train == syn.sort_rows(2000, "train", **kw)  # deterministic
    tok = syn.make_tokenizer()
    for r in train[:50]:
        digits = r["prompt"].split()[1:-1]
        assert 4 <= len(digits) <= 8 and len(set(digits)) == len(digits)
        assert r["answer"].split() == sorted(digits)
        assert tok.decode(tok.encode(r["prompt"])) == r["prompt"]
    long_rows = [r for r in train if len(r["answer"].split()) >= 6]
    short_rows = [r for r in train if len(r["answer"].split()) < 6]
    sloppy = sum(r["completion"].split() != r["answer"].split() for r in long_rows) / len(long_rows)
    assert 0.6 < sloppy < 0.8
    assert all(r["completion"].split() == r["answer"].split() for r in short_rows)
    assert syn.exact_match_reward(None, [" 1 2 3", "1 2"], ["1 2 3", "1 2 3"]) == [1.0, 0.0]
    pm = syn.partial_match_reward(None, ["1 2 3", "1 2", "9 9 9"], ["1 2 3"] * 3)
    assert pm[0] == 1.0 and pm[2] == 0.0 and 0 < pm[1] < 1


def test_demo_short_run(tmp_path, capsys):
    from rlcu.train.demo import main

    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--set", "sft_steps=3", "--set", "grpo_steps=2", "--no-progress"]) == 0
    s = json.loads((out / "summary.json").read_text())
    for k in ("accuracy_before_grpo", "accuracy_after_grpo", "wall_seconds", "sampled_accuracy_before_grpo",
              "sampled_accuracy_after_grpo"):
        assert 0 <= s[k] <= 1 or k == "wall_seconds", k
    assert s["grpo_steps"] == 2 and s["wall_seconds"] > 0
    assert (out / "demo.png").exists()
    assert (out / "sft" / "metrics.jsonl").exists() and (out / "grpo" / "metrics.jsonl").exists()
    assert len((out / "grpo" / "metrics.jsonl").read_text().splitlines()) == 3  # the step-0 baseline + 2
    assert (out / "checkpoints" / "step-000002" / "trainer_state.json").exists()
    assert (out / "model" / "config.json").exists() and (out / "model" / "tokenizer.json").exists()
    assert "held-out accuracy" in capsys.readouterr().out


@pytest.mark.gpu
def test_full_demo_on_gpu(tmp_path):
    """The demo with its defaults on the GPU (the kernels): the gain and the speed."""
    from rlcu.train.demo import main

    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--no-progress"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["device"].startswith("cuda") and s["backend"] == "triton"
    assert s["accuracy_after_grpo"] - s["accuracy_before_grpo"] >= 0.15, s
    assert s["wall_seconds"] < 300
