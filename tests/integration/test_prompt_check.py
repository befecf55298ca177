"""Over-long prompts are checked at load against the model's context (prompt + max_new_tokens)
and data.max_prompt_tokens: dropped and counted with their rows in the log, or an error before
training; the run never meets them mid-way, and the KV pool is sized from the prompts kept."""

from __future__ import annotations

import json

import pytest
from support.trainers import TINY

from rlcu.data import synthetic as syn
from rlcu.data.prompt_check import check_prompts, checked_prompts, prompt_limit

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _long(n):
    return {"prompt": "sort " + " ".join(["1"] * n) + " :", "answer": " ".join(["1"] * n)}


def test_limit_and_report(tmp_path):
    lim = prompt_limit(32, 4)
    assert lim.max_tokens == 28 and "max_position_embeddings=32" in lim.why
    assert prompt_limit(32, 4, max_prompt_tokens=10).max_tokens == 10
    assert prompt_limit(32, 4, max_prompt_tokens=100).max_tokens == 28  # the context wins
    with pytest.raises(ValueError, match="max_new_tokens=32 leaves no room for a prompt"):
        prompt_limit(32, 32)
    with pytest.raises(ValueError, match="overlong_prompts must be one of drop, error"):
        prompt_limit(32, 4, policy="truncate")
    f = tmp_path / "d.jsonl"
    rows = [{"prompt": "a b"}, _long(40), {"prompt": "c"}, {"prompt": "x " * 30}]
    lines = [json.dumps(r) for r in rows]
    f.write_text("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n")  # a blank line 3
    kept, rep = checked_prompts(f, "prompt", lambda r: len(r["prompt"].split()), lim)
    assert [r["prompt"] for r in kept] == ["a b", "c"] and rep.longest == 2
    assert rep.dropped == [(f"{f}:2", 42), (f"{f}:5", 30)]  # file:line, blank line counted
    assert rep.message() == (f"{f}: dropped 2 of 4 prompts longer than 28 tokens ({lim.why}): "
                             f"{f}:2 (42 tokens), {f}:5 (30 tokens)")
    with pytest.raises(ValueError, match=rf"{f}: 2 of 4 prompts are longer than 28 tokens .*{f}:2 \(42 tokens\)"):
        checked_prompts(f, "prompt", lambda r: len(r["prompt"].split()), prompt_limit(32, 4, policy="error"))
    with pytest.raises(ValueError, match=r"every one of its 1 prompts is longer"):
        check_prompts([("dataset[0]", _long(40))], lambda r: len(r["prompt"].split()), lim, "dataset")
    _, rep = checked_prompts([{"prompt": "a"}] * 12 + [_long(30)] * 12, "prompt", lambda r: len(r["prompt"].split()),
                             lim)
    assert rep.message().endswith("dataset[21] (32 tokens) and 2 more")


def _trainer(tmp_path, rows, **kw):
    from rlcu.config import GRPOConfig, _build
    from rlcu.train.grpo import GRPOTrainer

    tok = syn.make_tokenizer()
    d = dict(model=dict(tiny=dict(TINY, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id), init_seed=3),
             steps=2, prompts_per_step=4, group_size=2, max_new_tokens=4, micro_batch_tokens=64,
             rewards=[{"fn": "rlcu.data.synthetic:exact_match_reward"}],
             log=dict(out_dir=str(tmp_path / "run"), progress=False, tensorboard=False, plot=False),
             checkpoint=dict(save_at_end=False), engine=dict(block_size=16), seed=5, **kw)
    f = tmp_path / "train.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return GRPOTrainer(_build(GRPOConfig, d), str(f), tokenizer=tok), f


def test_trainer_drops_overlong_prompts_and_runs(tmp_path):
    rows = syn.sort_rows(7, "train", min_len=2, max_len=3)
    rows.insert(2, _long(40))  # 42 tokens: over the context of 32 less 4 new tokens
    rows.insert(0, _long(200_000))  # a huge line: must not size the KV pool
    tr, f = _trainer(tmp_path, rows)
    assert len(tr.rows) == 7 and tr.n_filtered == 2
    assert tr.llm.runner.num_blocks < 100  # sized from the longest prompt kept, not the huge line
    hist = tr.train()  # every row is sampled in 2 steps of 4: none reaches the engine too long
    assert len(hist) == 2
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "dropped 2 of 9 prompts longer than 28 tokens" in log
    assert f"{f}:1 (200002 tokens)" in log and f"{f}:4 (42 tokens)" in log


def test_trainer_overlong_error(tmp_path):
    rows = syn.sort_rows(4, "train", min_len=2, max_len=3) + [_long(12)]
    with pytest.raises(ValueError, match=r"train\.jsonl: 1 of 5 prompts are longer than 10 tokens "
                                         r"\(data\.max_prompt_tokens=10\): .*train\.jsonl:5 \(14 tokens\)"):
        _trainer(tmp_path, rows, data=dict(max_prompt_tokens=10, overlong_prompts="error"))
