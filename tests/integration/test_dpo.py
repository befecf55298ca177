"""rlcu.DPOTrainer on a tiny model (the CPU twins): a preference task (chosen completions of even
token ids, rejected of odd ones) whose held-out implicit-reward accuracy rises from 0 (every
reward 0 before training) to >= 0.9; the reference logprobs stored with their fingerprint and
read back by a resume that then equals the uninterrupted run bit for bit; LoRA DPO, whose
reference is the base with the adapters off."""

import json

import pytest
import torch
from support.trainers import dpo_trainer, tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_dpo_learns_the_preference_and_resume_equals_uninterrupted(tmp_path):
    a = dpo_trainer(tmp_path / "a", "checkpoint.every=2")
    a.train()
    h = a.history
    assert h[0]["eval/rewards/accuracies"] == 0.0 and h[0]["eval/loss"] == pytest.approx(0.6931, abs=1e-4)
    assert abs(h[1]["rewards/chosen"]) < 1e-5 and abs(h[1]["rewards/margins"]) < 1e-5  # the policy is the reference
    assert h[-1]["eval/rewards/accuracies"] >= 0.9 and h[-1]["eval/rewards/margins"] > 0.1
    assert h[-1]["eval/loss"] < 0.6 and h[-1]["pairs"] > 0
    assert (tmp_path / "a" / "ref_logprobs.pt").is_file()

    b = dpo_trainer(tmp_path / "b", "checkpoint.every=2")
    b.train(until=2)
    first = b.reference_logprobs()["train"].clone()
    r = dpo_trainer(tmp_path / "b", "checkpoint.every=2", "checkpoint.resume=auto")
    r.train()
    log = (tmp_path / "b" / "log.txt").read_text()
    assert "reference logprobs: read from" in log  # not taken again from the resumed weights
    assert torch.equal(r.reference_logprobs()["train"], first)
    assert torch.equal(r.model.flat, a.model.flat)
    rows = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [x["loss"] for x in rows if x["step"] > 2 and "loss" in x] == [x["loss"] for x in h[3:]]


def test_lora_dpo_reference_is_the_base_with_adapters_off(tmp_path):
    base = tiny()
    before = base.flat.clone()
    t = dpo_trainer(tmp_path / "run", "lora.r=4", "lora.alpha=8", "batch_tokens=400", "beta=0.5", model=base, n=32)
    g = torch.Generator().manual_seed(3)
    t.model.lora.flat.copy_(0.05 * torch.randn(t.model.lora.flat.shape, generator=g))  # the policy is not the base
    t.train()
    h = t.history
    assert abs(h[1]["rewards/chosen"]) > 1e-4  # measured against the base, not the adapted start
    assert h[-1]["eval/rewards/accuracies"] >= 0.9
    assert torch.equal(t.model.flat, before)  # the base stays frozen
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()  # PEFT's folder
