"""The tiny trainers the tests run on the CPU twins, in two families:

- SFT on random token ids (vocabulary V = 61, no tokenizer): `tiny()`, `token_rows()`,
  `sft_config()`; the model and rows the SFT, step-graph and 2-rank SFT tests share.
- GRPO and PPO on the synthetic sort task (its word tokenizer): the model shape `TINY` (the
  vocabulary and eos come from the tokenizer), `grpo_trainer()` / `ppo_trainer()` and the reward
  functions the runs learn (also as "support.trainers:first_is_seven" strings in configs)."""

from __future__ import annotations

import torch

import rlcu
from rlcu.config import SFTConfig, load_config
from rlcu.data import synthetic as syn

# ---------------------------------------------------------------- SFT on random token ids
V = 61
SFT_TINY = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)


def tiny(seed=0):
    return rlcu.Qwen3.from_config(rlcu.Qwen3Config(**SFT_TINY), seed=seed)


def token_rows(n=12, seed=0):
    """n rows of 1 to 8 prompt and completion token ids each, seeded."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        lp, lc = torch.randint(1, 9, (2,), generator=g).tolist()
        rows.append({"prompt_token_ids": torch.randint(0, V, (lp,), generator=g).tolist(),
                     "completion_token_ids": torch.randint(0, V, (lc,), generator=g).tolist()})
    return rows


def sft_config(out, *sets):
    """An SFTConfig logging to `out` (no progress, no plot), lr 1e-3; `sets` as `--set` takes them."""
    return load_config(SFTConfig, None, [f"log.out_dir={out}", "log.progress=false", "log.plot=false",
                                         "optim.lr=1e-3", *sets])


def preference_rows(n, seed):
    """n pre-tokenised preference pairs: 2 to 6 random prompt ids, chosen completions of even ids,
    rejected of odd ones (what a policy can learn to prefer, and generalise to held-out pairs)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lp, lc, lr = torch.randint(2, 7, (3,), generator=g).tolist()
        out.append({"prompt_token_ids": torch.randint(0, V, (lp,), generator=g).tolist(),
                    "chosen_token_ids": (2 * torch.randint(0, V // 2, (lc,), generator=g)).tolist(),
                    "rejected_token_ids": (2 * torch.randint(0, V // 2, (lr,), generator=g) + 1).tolist()})
    return out


def dpo_trainer(out, *sets, model=None, n=16):
    """A DPOTrainer over n preference_rows (n // 2 held out) logging to `out`: 4 steps of 250 tokens
    at lr 2e-2; `sets` as `--set` takes them."""
    from rlcu.config import DPOConfig

    cfg = load_config(DPOConfig, None, [f"log.out_dir={out}", "log.progress=false", "log.plot=false",
                                        "log.tensorboard=false", "optim.lr=2e-2", "steps=4", "batch_tokens=250",
                                        *sets])
    return rlcu.DPOTrainer(cfg, dataset=preference_rows(n, 0), eval_dataset=preference_rows(n // 2, 1),
                           model=model if model is not None else tiny())


# ---------------------------------------------------------------- GRPO and PPO on the sort task
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=32, tie_word_embeddings=True,
            rope_theta=10000.0, bos_token_id=None)


def first_is_seven(prompts, completions, **_):
    return [1.0 if c.split()[:1] == ["7"] else 0.0 for c in completions]


def first_is_even(prompts, completions, **_):
    return [1.0 if c.split()[:1] and c.split()[0] in "02468" else 0.0 for c in completions]


def grpo_config(tmp_path, **kw):
    """(GRPOConfig, tokenizer): 4 steps of 4 prompts x 4 samples of 4 new tokens, exact-match
    reward, logging under tmp_path/run; a dict in `kw` merges into its section, anything else
    replaces the field."""
    from rlcu.config import GRPOConfig, _build

    tok = syn.make_tokenizer()
    d = dict(model=dict(tiny=dict(TINY, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id), init_seed=3,
                        gradient_checkpointing=True),
             steps=4, prompts_per_step=4, group_size=4, max_new_tokens=4, micro_batch_tokens=64,
             optim=dict(lr=3e-3), rewards=[{"fn": "rlcu.data.synthetic:exact_match_reward"}],
             log=dict(out_dir=str(tmp_path / "run"), progress=False, tensorboard=False, plot=False),
             checkpoint=dict(save_at_end=False), engine=dict(block_size=16), seed=5)
    for k, v in kw.items():
        if isinstance(v, dict) and isinstance(d.get(k), dict):
            d[k] = {**d[k], **v}
        else:
            d[k] = v
    return _build(GRPOConfig, d), tok


def grpo_trainer(tmp_path, rewards=None, rows=None, **kw):
    """A GRPOTrainer of grpo_config(tmp_path, **kw) on 64 sort rows (or `rows`)."""
    from rlcu.train.grpo import GRPOTrainer

    cfg, tok = grpo_config(tmp_path, **kw)
    rows = rows if rows is not None else syn.sort_rows(64, "train", min_len=2, max_len=3)
    return GRPOTrainer(cfg, rows, rewards, tokenizer=tok)


def ppo_trainer(tmp_path, **kw):
    """A PPOTrainer of 2 steps (4 prompts x 2 samples, partial-match reward, KL and entropy
    terms) on 32 sort rows; `model` merges into the model section, the rest replaces fields."""
    from rlcu.config import PPOConfig, _build
    from rlcu.train.ppo import PPOTrainer

    tok = syn.make_tokenizer()
    model = dict(tiny=dict(TINY, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id), init_seed=3)
    d = dict(model=dict(model, **kw.pop("model", {})),
             steps=2, prompts_per_step=4, group_size=2, max_new_tokens=4, micro_batch_tokens=64,
             optim=dict(lr=3e-3), critic=dict(optim=dict(lr=3e-3)), kl_coef=0.05, entropy_coef=0.01,
             rewards=[{"fn": "rlcu.data.synthetic:partial_match_reward"}],
             log=dict(out_dir=str(tmp_path / "run"), progress=False, tensorboard=False, plot=False),
             checkpoint=dict(save_at_end=False), seed=5)
    d.update(kw)
    cfg = _build(PPOConfig, d)
    return PPOTrainer(cfg, syn.sort_rows(32, "train", min_len=2, max_len=3), tokenizer=tok)


def no_timing(hist):
    """A run's metrics without its wall-clock ones (time/...), to compare runs bit for bit."""
    return [{k: v for k, v in h.items() if not k.startswith("time/")} for h in hist]
