"""DPO at 2 ranks (gloo, CPU) ends with the weights of one process: each rank takes a block of the
reference pass and of every step's pairs (4 micro-batches a step), the loss is the mean over the
step's pairs wherever they ran; the metrics are one process's, and rank 0 alone writes the
reference file and the log. LoRA DPO likewise (the adapters' gradient reduced at the step). ~25 s
on 2 cores, most of it the two spawned ranks' start-up, which one spawn shares for both runs."""

from __future__ import annotations

import json

import pytest
import torch
from support.parallel_util import ok, run_ranks
from support.trainers import dpo_trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SETS = ("grad_accum=4", "batch_tokens=60", "steps=3", "optim.lr=2e-2")
LORA = ("lora.r=4", "lora.alpha=8", "lora.init=gaussian")


def _ranks(rank, tmp):
    t = dpo_trainer(tmp / "two", *SETS)
    t.train()
    lo = dpo_trainer(tmp / "two-lora", *SETS, *LORA)
    lo.train()
    return {"flat": t.model.flat.clone(), "hist": t.history, "ref": t.reference_logprobs()["train"],
            "lora": lo.model.lora.flat.clone()}


def test_dpo_two_ranks_equal_one_process(tmp_path):
    d, _ = run_ranks(_ranks, 2, tmp_path, tmp_path, timeout=240)
    r0, r1 = ok(d)
    one = dpo_trainer(tmp_path / "one", *SETS)
    start = one.model.flat.clone()
    one.train()
    assert torch.equal(r0["flat"], r1["flat"])
    assert float((one.model.flat - start).norm() / start.norm()) > 1e-3
    # the same sums in another order (micro-batches packed per rank): fp32 rounding apart
    assert float((r0["flat"] - one.model.flat).norm() / one.model.flat.norm()) < 5e-5
    torch.testing.assert_close(r0["ref"], one.reference_logprobs()["train"], rtol=1e-5, atol=1e-5)
    for a, b in zip(r0["hist"], one.history):
        for k in ("loss", "rewards/margins", "rewards/accuracies", "eval/rewards/accuracies", "pairs"):
            if k in b:
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
    rows = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert (tmp_path / "two" / "ref_logprobs.pt").is_file()
    lo = dpo_trainer(tmp_path / "one-lora", *SETS, *LORA)
    start = lo.model.lora.flat.clone()
    lo.train()
    assert torch.equal(r0["lora"], r1["lora"])
    assert float((lo.model.lora.flat - start).norm() / start.norm()) > 1e-3
    assert float((r0["lora"] - lo.model.lora.flat).norm() / lo.model.lora.flat.norm()) < 5e-5
