"""rlcu.DPOTrainer on a tiny model (the CPU twins): a preference task (chosen completions of even
token ids, rejected of odd ones) whose held-out implicit-reward accuracy rises from 0 (every
reward 0 before training) to >= 0.9; the reference logprobs stored with their fingerprint and
read back by a resume that then equals the uninterrupted run bit for bit; LoRA DPO, whose
reference is the base with the adapters off. The first test runs three short trainings (8 steps of
~250 tokens, four evaluations of 8 pairs): ~10 s of CPU on the twins, whose per-sequence attention
loop is most of it."""

import json

import pytest
import torch
from support.trainers import V, tiny

import rlcu
from rlcu.config import DPOConfig, load_config


def preference_rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lp, lc, lr = torch.randint(2, 7, (3,), generator=g).tolist()
        out.append({"prompt_token_ids": torch.randint(0, V, (lp,), generator=g).tolist(),
                    "chosen_token_ids": (2 * torch.randint(0, V // 2, (lc,), generator=g)).tolist(),
                    "rejected_token_ids": (2 * torch.randint(0, V // 2, (lr,), generator=g) + 1).tolist()})
    return out


def _config(out, *sets):
    return load_config(DPOConfig, None, [f"log.out_dir={out}", "log.progress=false", "log.plot=false",
                                         "log.tensorboard=false", "optim.lr=2e-2", "steps=4", "batch_tokens=250",
                                         *sets])


def _trainer(out, *sets, model=None, n=16):
    return rlcu.DPOTrainer(_config(out, *sets), dataset=preference_rows(n, 0), eval_dataset=preference_rows(n // 2, 1),
                           model=model if model is not None else tiny())


def test_dpo_learns_the_preference_and_resume_equals_uninterrupted(tmp_path):
    a = _trainer(tmp_path / "a", "checkpoint.every=2")
    a.train()
    h = a.history
    assert h[0]["eval/rewards/accuracies"] == 0.0 and h[0]["eval/loss"] == pytest.approx(0.6931, abs=1e-4)
    assert abs(h[1]["rewards/chosen"]) < 1e-5 and abs(h[1]["rewards/margins"]) < 1e-5  # the policy is the reference
    assert h[-1]["eval/rewards/accuracies"] >= 0.9 and h[-1]["eval/rewards/margins"] > 0.1
    assert h[-1]["eval/loss"] < 0.6 and h[-1]["pairs"] > 0
    assert (tmp_path / "a" / "ref_logprobs.pt").is_file()

    b = _trainer(tmp_path / "b", "checkpoint.every=2")
    b.train(until=2)
    first = b.reference_logprobs()["train"].clone()
    r = _trainer(tmp_path / "b", "checkpoint.every=2", "checkpoint.resume=auto")
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
    t = _trainer(tmp_path / "run", "lora.r=4", "lora.alpha=8", "batch_tokens=400", "beta=0.5", model=base, n=32)
    g = torch.Generator().manual_seed(3)
    t.model.lora.flat.copy_(0.05 * torch.randn(t.model.lora.flat.shape, generator=g))  # the policy is not the base
    t.train()
    h = t.history
    assert abs(h[1]["rewards/chosen"]) > 1e-4  # measured against the base, not the adapted start
    assert h[-1]["eval/rewards/accuracies"] >= 0.9
    assert torch.equal(t.model.flat, before)  # the base stays frozen
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()  # PEFT's folder
