"""A reward model in the RL loop on the CPU twins: PPO's four models in one process (policy,
frozen reference, reward model, critic) scoring with the reward model beside a function reward;
GRPO against a reward model rlcu's RewardTrainer trained on preference pairs, raising on held-out
prompts a property that a plain function measures; multi-turn episodes scored whole."""

from __future__ import annotations

import math
import random

import pytest
import torch
from support.trainers import TINY, grpo_trainer, ppo_trainer

from rlcu.data import synthetic as syn
from rlcu.memory import job_memory
from rlcu.model.causal_lm import CausalLM
from rlcu.model.config import CausalLMConfig
from rlcu.model.reward_model import RewardModel

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def tiny_rm_folder(tmp_path, seed=11):
    """A reward model of the policy's tiny shape and vocabulary (random trunk, a head of std 1),
    saved as an HF sequence-classification folder without a tokenizer: it reads the policy's ids."""
    tok = syn.make_tokenizer()
    lm = CausalLM.from_config(CausalLMConfig(**dict(TINY, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id)),
                              seed=seed)
    rm = RewardModel.from_causal_lm(lm, head_init_std=1.0, seed=seed)
    rm.save_pretrained(tmp_path / "rm")
    return tmp_path / "rm"


def test_ppo_four_models_in_one_process(tmp_path):
    """Two PPO steps with a KL reference, a critic and a reward model (weight 2) beside the
    partial-match function: every model's buffer its own, the reward model frozen, its part in
    the memory model, and the step's scores the reward model's for the policy's own ids."""
    folder = tiny_rm_folder(tmp_path)
    tr = ppo_trainer(tmp_path, rewards=[{"model": str(folder), "weight": 2.0},
                                        {"fn": "rlcu.data.synthetic:partial_match_reward"}])
    assert tr.ref is not None and tr.critic is not None and len(tr.rewards.models) == 1
    rm = tr.rewards.models[0]
    ptrs = {tr.model.flat.data_ptr(), tr.ref.flat.data_ptr(), tr.critic.flat.data_ptr(), rm.rm.flat.data_ptr()}
    assert len(ptrs) == 4
    w0 = rm.rm.flat.clone()
    hist = tr.train()
    assert len(hist) == 2 and torch.equal(w0, rm.rm.flat)
    for h in hist:
        for k in ("reward", "reward/rm", "reward/partial_match_reward", "vf_loss", "loss", "kl_penalty"):
            assert k in h and math.isfinite(h[k]), (k, h.get(k))
    mem = job_memory(tr._memory_shape())
    assert mem.reward_model == rm.rm.flat.numel() * 4 and mem.reward_work > 0 and mem.critic > 0
    samples = tr._engine_phase(lambda: tr.rollout(tr.rows[:2], 2, seed=3))
    tr.score(samples)
    want = rm.rm.score([s.prompt_ids + s.completion_ids for s in samples])
    fn = syn.partial_match_reward(None, [s.completion_text for s in samples], [s.row["answer"] for s in samples])
    torch.testing.assert_close(torch.tensor([s.reward for s in samples]), 2.0 * want + torch.tensor(fn))


def _ends_in_seven_pairs(split: str, n: int, seed: int) -> list[dict]:
    """Preference pairs (TRL's text format) over the sort task's prompts: two-word completions,
    the chosen one ending in 7, the rejected one alike but ending in another digit."""
    rng, digits = random.Random(seed), [str(i) for i in range(10)]
    out = []
    for r in syn.sort_rows(n, split, seed=seed, min_len=2, max_len=3):
        first = rng.choice(digits + ["sort", ":"])
        other = rng.choice([d for d in digits if d != "7"])
        out.append({"prompt": r["prompt"], "chosen": f" {first} 7", "rejected": f" {first} {other}"})
    return out


def ends_in_seven(completions) -> float:
    return sum(c.split()[-1:] == ["7"] for c in completions) / len(completions)


def test_grpo_against_a_trained_reward_model_raises_a_held_out_metric(tmp_path):
    """rlcu's RewardTrainer learns "ends in 7" from preference pairs (held-out accuracy > 0.9);
    GRPO whose only reward is that model (a RewardModel through the Python API) then raises the
    rate of completions ending in 7 on held-out prompts, which neither model trained on, as a
    plain function counts it, from ~1/15 to most (about 10 s on 2 cores)."""
    from rlcu.train.reward_trainer import RewardTrainer

    tok = syn.make_tokenizer()
    rt = RewardTrainer(dict(model=dict(tiny=dict(TINY, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id),
                                       init_seed=4),
                            steps=30, batch_pairs=16, batch_tokens=512, optim=dict(lr=3e-3),
                            log=dict(out_dir=str(tmp_path / "rm"), progress=False, tensorboard=False, plot=False),
                            checkpoint=dict(save_at_end=False)),
                       _ends_in_seven_pairs("train", 256, 0), eval_dataset=_ends_in_seven_pairs("eval", 64, 1),
                       tokenizer=tok)
    rt.train()
    assert rt.evaluate()["eval/accuracy"] > 0.9
    held_out = syn.sort_rows(32, "eval", min_len=2, max_len=3)
    tr = grpo_trainer(tmp_path, rewards=[rt.model], steps=12, prompts_per_step=8, group_size=8, max_new_tokens=2,
                      optim=dict(lr=2e-2), loss_agg="seq_mean", clip_high=0.28, stop_at_eos=False)

    def rate():
        samples = tr._engine_phase(lambda: tr.rollout(held_out, 4, seed=123))
        return ends_in_seven([s.completion_text for s in samples])

    before = rate()
    hist = tr.train()
    after = rate()
    assert before < 0.2 and after > 0.7, (before, after, [round(h["reward"], 2) for h in hist])
    assert hist[-1]["reward"] > hist[0]["reward"]


def test_episodes_are_scored_whole(tmp_path):
    """Multi-turn episodes: a reward model reading the policy's ids scores prompt + every token of
    the episode (the environment's included); one with a tokenizer of its own scores the whole
    conversation rendered by its chat template (the prompt's messages, then the episode's)."""
    from support.episode_trainer import chat_tokenizer, trainer

    from rlcu.rewards.model_reward import ModelReward

    tok = chat_tokenizer()
    lm = CausalLM.from_config(CausalLMConfig(**dict(TINY, vocab_size=tok.vocab_size, max_position_embeddings=96)),
                              seed=2)
    rm = RewardModel.from_causal_lm(lm, head_init_std=1.0, seed=2)
    tr, _ = trainer(tmp_path, rewards=[{"model": ModelReward(rm), "name": "ids", "weight": 1.0},
                                       {"model": ModelReward(rm, tokenizer=tok), "name": "chat", "weight": 0.5}],
                    eos_digits=True, steps=1, max_new_tokens=3)
    samples = tr._engine_phase(lambda: tr.rollout(tr.rows[:2], 2, seed=3))
    assert any(m["role"] == "user" for s in samples for m in s.messages)  # the environment spoke
    tr.score(samples)
    ids = rm.score([s.prompt_ids + s.completion_ids for s in samples])
    chat = rm.score([tok.apply_chat_template(s.prompt_messages + s.messages, tokenize=True) for s in samples])
    env = torch.tensor([s.episode["env_reward"] for s in samples])
    torch.testing.assert_close(torch.tensor([s.reward for s in samples]), ids + 0.5 * chat + env)
