"""SFT's global batch at 2 ranks (gloo, CPU) for any grad_accum: the step's examples are split
over the ranks by tokens, so grad_accum 1 and 3 (which 2 does not divide), and steps where a
rank gets no example at all, train as one process does (losses and weights)."""

from __future__ import annotations

import pytest
import torch
from support.parallel_util import ok, run_ranks
from support.trainers import sft_config, tiny, token_rows

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# (grad_accum, batch_tokens): 1 micro-batch a step; 3; and micro-batches of one example each,
# where the step's one example leaves the other rank without any (it runs a zero backward)
CASES = ((1, 24), (3, 24), (1, 4))


def _sft(out, grad_accum: int, batch_tokens: int):
    from rlcu.train.sft import SFTTrainer

    cfg = sft_config(out, "optim.lr=3e-2", f"grad_accum={grad_accum}", f"batch_tokens={batch_tokens}", "steps=3",
                     "checkpoint.every=0", "checkpoint.save_at_end=false")
    tr = SFTTrainer(cfg, token_rows(16), model=tiny())
    tr.train()
    return tr.model.flat.clone(), [(h["loss"], h["tokens"], h["completion_tokens"], h["sequences"])
                                   for h in tr.history]


def _ranks(rank, tmp):
    return [_sft(tmp / f"dp-{ga}-{bt}", ga, bt) for ga, bt in CASES]


def test_sft_any_grad_accum_two_ranks_equal_one_process(tmp_path):
    res, _ = run_ranks(_ranks, 2, tmp_path, tmp_path, timeout=240)
    r0, r1 = ok(res)
    for (ga, bt), (w0, h0), (w1, h1) in zip(CASES, r0, r1):
        w, h = _sft(tmp_path / f"one-{ga}-{bt}", ga, bt)
        assert float((w - tiny().flat).norm() / w.norm()) > 1e-3  # it trained
        assert torch.equal(w0, w1), (ga, bt)
        assert float((w0 - w).norm() / w.norm()) < 3e-5, (ga, bt)  # fp32 sums in another order (4e-6 seen)
        assert h0 == h1
        for a, b in zip(h0, h):
            assert a[1:] == b[1:], (ga, bt)  # the global batch's counts
            assert a[0] == pytest.approx(b[0], rel=1e-5), (ga, bt)


def test_rank_micro_batches_split_by_tokens():
    from rlcu.parallel.batch import rank_micro_batches
    from rlcu.parallel.comm import World

    lens = [5, 1, 7, 3, 3, 2, 9]
    steps = [[0, 1], [2], [3, 4, 5], [6]]
    assert rank_micro_batches(steps, lens, 9, World()) == steps  # one process: the step as drawn
    parts = [rank_micro_batches(steps, lens, 9, World(rank=r, size=3)) for r in range(3)]
    assert [i for p in parts for mb in p for i in mb] == list(range(7))  # each example once, in order
    assert all(sum(lens[i] for i in mb) <= 9 for p in parts for mb in p)
    assert parts[0] == [[0, 1], [2]]  # 13 of the 30 tokens: example 2's middle lies in rank 0's third
    assert [sum(lens[i] for mb in p for i in mb) for p in parts] == [13, 8, 9]  # 5's middle: on 2/3
    assert rank_micro_batches([[0]], [4], 8, World(rank=1, size=2)) == []  # nothing for rank 1
    assert rank_micro_batches([[0], [1]], [20, 3], 8, World(rank=0, size=2)) == [[0]]  # too long: alone
