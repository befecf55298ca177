"""A short GRPO run on the sort task from a Qwen2 folder (q/k/v biases, no q/k norm; model.path,
so the family comes from config.json): it learns, the biases among what it updates; the scheduler
sizes a job of that folder from its config alone, the biases counted."""

import torch
from support.trainers import TINY, first_is_seven, grpo_config, grpo_trainer

import rlcu
from rlcu.data import synthetic as syn


def _qwen2_folder(tmp_path):
    tok = syn.make_tokenizer()
    cfg = rlcu.CausalLMConfig(**dict(TINY, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id), family="qwen2")
    folder = tmp_path / "qwen2"
    rlcu.CausalLM.from_config(cfg, seed=3).save_pretrained(folder)
    return folder


def test_grpo_learns_from_a_qwen2_folder(tmp_path):
    folder = _qwen2_folder(tmp_path)
    tr = grpo_trainer(tmp_path, rewards=[first_is_seven], steps=16, prompts_per_step=8, group_size=8,
                      max_new_tokens=2, optim=dict(lr=2e-2), loss_agg="seq_mean", clip_high=0.28,
                      model=dict(tiny=None, path=str(folder)))
    before = tr.model.w["layers.0.qkv_bias"].clone()
    hist = tr.train()
    assert tr.model.cfg.family == "qwen2"
    assert not torch.equal(tr.model.w["layers.0.qkv_bias"], before)
    assert sum(h["reward"] for h in hist[-3:]) / 3 > 0.7, [round(h["reward"], 3) for h in hist]


def test_the_scheduler_sizes_a_qwen2_job_from_its_folder(tmp_path):
    from rlcu.memory.parts import params
    from rlcu.sched.job import estimate_memory
    from rlcu.train.sizing import config_shape

    cfg, _ = grpo_config(tmp_path, model=dict(tiny=None, path=str(_qwen2_folder(tmp_path))))
    shape = config_shape(cfg)
    assert shape.cfg.family == "qwen2" and params(shape.cfg) == rlcu.from_pretrained(tmp_path / "qwen2").flat.numel()
    assert estimate_memory(cfg)["resident"] > 0
