"""SFT with LoRA (issue 35): the adapters learn while the base's bits stay put, the optimizer holds
the adapters' state alone, resume equals the uninterrupted run, the run's PEFT folder loads in
peft with rlcu's logits (and `rlcu merge` makes an HF folder of it), a run starts from a PEFT
adapter, and the `lora:` section's errors name their field."""

import json

import pytest
import torch
from support.trainers import sft_config, tiny, token_rows

import rlcu
from rlcu.config import ConfigError, SFTConfig, config_from_dict
from rlcu.model.lora import LoraAdapters, LoraConfig
from rlcu.model.lora_peft import load_adapter, save_adapter
from rlcu.train.sft import SFTTrainer

LORA = ["lora.r=4", "lora.alpha=8", "optim.lr=1e-2"]


def _rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lora_sft_learns_and_only_adapters_change(tmp_path):
    rows = token_rows(8)
    model = tiny()
    base = model.flat.clone()
    t = SFTTrainer(sft_config(tmp_path / "run", "steps=12", "batch_tokens=128", *LORA), rows, model=model)
    ad = model.lora
    assert ad is not None and model.grad_flat is None and not model.trains_base
    assert t.optimizer.model is ad and t.optimizer.m.numel() == ad.flat.numel()  # the adapters' state alone
    a0 = ad.flat.clone()
    t.train()
    losses = [r["loss"] for r in _rows_of(tmp_path / "run" / "metrics.jsonl")]
    assert losses[-1] < 0.8 * losses[0], losses
    assert torch.equal(model.flat, base)  # the base's bits
    assert model.grad_flat is None
    assert not torch.equal(ad.flat, a0)
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "LoRA r=4" in log and f"{ad.num_params():,} trained" in log
    ck = tmp_path / "run" / "checkpoints" / "step-000012" / "model"
    assert sorted(p.name for p in ck.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                     "config.json"]  # no copy of the base
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


def test_lora_resume_equals_uninterrupted(tmp_path):
    rows = token_rows(10)
    sets = ["steps=6", "batch_tokens=24", "grad_accum=2", "optim.schedule=cosine", "optim.weight_decay=0.1",
            "lora.dropout=0.1", "lora.target_modules=[q_proj,v_proj,down_proj]", *LORA]
    a = SFTTrainer(sft_config(tmp_path / "a", *sets), rows, model=tiny())
    a.train()
    b = SFTTrainer(sft_config(tmp_path / "b", *sets), rows, model=tiny())
    b.train(until=3)
    c = SFTTrainer(sft_config(tmp_path / "b", *sets, "checkpoint.resume=auto"), rows, model=tiny())
    c.train()
    assert c.step == 6
    assert torch.equal(c.model.lora.flat, a.model.lora.flat)  # dropout's masks included
    assert torch.equal(c.optimizer.m, a.optimizer.m) and torch.equal(c.optimizer.v, a.optimizer.v)
    strip = [{k: v for k, v in r.items() if k not in ("tokens_per_s", "step_seconds")}
             for r in _rows_of(tmp_path / "b" / "metrics.jsonl")]
    want = [{k: v for k, v in r.items() if k not in ("tokens_per_s", "step_seconds")}
            for r in _rows_of(tmp_path / "a" / "metrics.jsonl")]
    assert strip == want


def test_lora_resume_refuses_another_rank(tmp_path):
    rows = token_rows(6)
    SFTTrainer(sft_config(tmp_path / "a", "steps=2", *LORA), rows, model=tiny()).train()
    c = SFTTrainer(sft_config(tmp_path / "a", "steps=4", *LORA[1:], "lora.r=8", "checkpoint.resume=auto",
                              "checkpoint.allow_config_change=true"), rows, model=tiny())
    with pytest.raises(Exception, match="r=4"):
        c.train()


def test_saved_adapter_loads_in_peft_with_the_same_logits(tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel
    from support.hf_util import make_hf_model

    hf, folder = make_hf_model(tmp_path / "base", seed=0)
    model = rlcu.Qwen3.from_pretrained(folder)
    g = torch.Generator().manual_seed(0)
    V = model.cfg.vocab_size
    rows = [{"prompt_token_ids": torch.randint(0, V, (4,), generator=g).tolist(),
             "completion_token_ids": torch.randint(0, V, (5,), generator=g).tolist()} for _ in range(6)]
    SFTTrainer(sft_config(tmp_path / "run", "steps=3", *LORA, "lora.rslora=true"), rows, model=model).train()
    out = tmp_path / "run" / "adapter"
    ids = torch.tensor(rows[0]["prompt_token_ids"] + rows[0]["completion_token_ids"])[None]
    pm = PeftModel.from_pretrained(hf, out).eval()
    with torch.no_grad():
        want = pm(ids).logits
    got = model.logits(ids)
    assert (got - want).norm() / want.norm() < 1e-5
    # rlcu merge: the full HF folder of base + adapter gives the same logits without adapters
    from rlcu.model.merge_cli import main as merge

    assert merge(["merge", str(folder), str(out), str(tmp_path / "merged")]) == 0
    merged = rlcu.Qwen3.from_pretrained(tmp_path / "merged")
    assert (merged.logits(ids) - want).norm() / want.norm() < 1e-5


def test_lora_starts_from_a_peft_folder(tmp_path):
    model = tiny()
    start = LoraAdapters.create(model.cfg, LoraConfig(r=4, alpha=8, target_modules=("o_proj", "up_proj")))
    start.flat.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    save_adapter(start, tmp_path / "start")
    start = load_adapter(tmp_path / "start", model.cfg)  # what the folder holds (no padding, no untargeted rows)
    rows = token_rows(6)
    t = SFTTrainer(sft_config(tmp_path / "run", "steps=1", f"lora.path={tmp_path / 'start'}", "optim.lr=1e-9"),
                   rows, model=model)
    assert model.lora.cfg.target_modules == ("o_proj", "up_proj") and model.lora.cfg.r == 4
    assert torch.equal(model.lora.flat, start.flat)
    t.train()
    assert (model.lora.flat - start.flat).abs().max() < 1e-6  # trained on from there
    with pytest.raises(ConfigError, match="lora.r is 8, but the adapter"):
        SFTTrainer(sft_config(tmp_path / "run2", f"lora.path={tmp_path / 'start'}", "lora.r=8"), rows, model=tiny())
    with pytest.raises(ConfigError, match="lora.path"):
        SFTTrainer(sft_config(tmp_path / "run3", f"lora.path={tmp_path / 'nope'}"), rows, model=tiny())


@pytest.mark.parametrize("lora, match", [
    ({"alpha": 4}, "lora.alpha is set but LoRA is off"),
    ({"r": -1}, "lora.r must be >= 0"),
    ({"r": 4, "dropout": 1.0}, "lora.dropout must be < 1"),
    ({"r": 4, "init": "pissa"}, "lora.init must be one of"),
    ({"r": 4, "target_modules": ["q_proj", "lm_head"]}, "lora.target_modules .*'lm_head' is not one"),
    ({"r": 4, "target_modules": []}, "lora.target_modules"),
    ({"r": 4, "rank": 3}, "unknown option 'lora.rank'"),
])
def test_lora_config_errors_name_the_field(lora, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(SFTConfig, {"lora": lora})


def test_lora_config_from_python_and_yaml(tmp_path):
    from rlcu.config import GRPOConfig, PPOConfig, load_config

    for cls in (SFTConfig, GRPOConfig, PPOConfig):
        assert not cls().lora.enabled
        c = load_config(cls, None, ["lora.r=8", "lora.target_modules=[q_proj, v_proj]"])
        assert c.lora.enabled and c.lora.lora_config().target_modules == ("q_proj", "v_proj")
    y = tmp_path / "c.yaml"
    y.write_text("lora:\n  r: 16\n  alpha: 32\n  target_modules: all-linear\n")
    assert load_config(SFTConfig, y).lora.lora_config().scale == 2.0
    assert SFTConfig(lora={"r": 2}).lora.r == 2
