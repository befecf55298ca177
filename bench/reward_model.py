"""Reward-model training benchmark: rlcu.RewardTrainer beside TRL's RewardTrainer (the peer) in the
same call, each side in its own process.

Protocol: the Qwen3-0.6B and Qwen3-4B shapes (bench/common.py SHAPES) as sequence classifiers (one
label, a fresh score head), random bf16 weights; 16 pairs a step, each a 256-token prompt with a
256-token chosen and a 256-token rejected completion, given as token ids (the whole chosen and
rejected sequences, 512 tokens each, ids in [1, V); TRL's pad id 0 appears nowhere), so a step
reads 16 x 1024 = 16384 tokens on both sides and TRL pads nothing. Bradley-Terry loss without
margin or centring, one optimizer step per batch of 16 pairs (rlcu: one packed micro-batch of
16384 tokens, chosen and rejected in one varlen batch; TRL: per_device_train_batch_size 16, which
its collator runs as one padded batch of 32 sequences), full gradient checkpointing on both.
Reported per side: the median seconds per step over the timed steps after warm-up, pairs/s,
tokens/s, and the peak GPU memory of the timed steps above what the process held before the
model was made. rlcu's optimizer holds fp32 master weights and fp32 Adam moments (its default);
TRL's torch AdamW holds bf16 moments of bf16 parameters: the peaks differ by that too.

    python bench/reward_model.py                 # both shapes, both sides: bench/results/reward_model.json
    python bench/reward_model.py --shapes 0.6b   # one shape
    python bench/reward_model.py --tiny          # a tiny model, 4 short pairs, on the CPU: reward_model_tiny.json
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.preference import hf_peer, hf_word_tokenizer, main, model_cfg, release, summary, time_rlcu_steps, trl_missing  # noqa: E402

PROTOCOL = dict(pairs=16, prompt_len=256, chosen_len=256, rejected_len=256)
TINY_PROTOCOL = dict(pairs=4, prompt_len=12, chosen_len=8, rejected_len=6)


def _pairs(V: int, n: int, p: dict, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """n (chosen, rejected) whole sequences of random ids in [1, V), sharing their prompt."""
    g = torch.Generator().manual_seed(seed)

    def ids(k):
        return torch.randint(1, V, (k,), generator=g).tolist()

    out = []
    for _ in range(n):
        a = ids(p["prompt_len"])
        out.append((a + ids(p["chosen_len"]), a + ids(p["rejected_len"])))
    return out


# ---------------------------------------------------------------- rlcu
def bench_rlcu(shape: str, p: dict, steps: int, warmup: int, tiny: bool) -> dict:
    from rlcu.config import RMConfig, _build
    from rlcu.model.causal_lm import CausalLM
    from rlcu.model.reward_model import RewardModel
    from rlcu.train.reward_trainer import RewardTrainer

    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    cfg = model_cfg(shape, tiny)
    base = torch.cuda.memory_allocated() if cuda else 0
    rm = RewardModel.from_causal_lm(CausalLM.from_config(cfg, device=dev, dtype=dtype, seed=0), pad_token_id=0)
    rm.gradient_checkpointing = True
    total = warmup + steps
    rows = [{"chosen_token_ids": c, "rejected_token_ids": r} for c, r in _pairs(cfg.vocab_size, p["pairs"] * total, p)]
    seq = p["prompt_len"] + max(p["chosen_len"], p["rejected_len"])
    rcfg = _build(RMConfig, dict(
        steps=total, batch_pairs=p["pairs"], batch_tokens=p["pairs"] * 2 * seq, max_seq_len=seq,
        optim=dict(lr=1e-6), data=dict(shuffle=False),
        log=dict(out_dir=tempfile.mkdtemp(prefix="rlcu-bench-rm-"), progress=False, tensorboard=False, plot=False),
        checkpoint=dict(save_at_end=False)))
    tr = RewardTrainer(rcfg, rows, model=rm)
    times, m = time_rlcu_steps(tr, p, total, warmup, cuda)
    res = {**summary(times, p, cuda, base), "loss_last": m["loss"],
           "optimizer": "fp32 master + fp32 Adam m, v; fp32 gradients"}
    del tr, rm
    release(cuda)
    return res


# ---------------------------------------------------------------- TRL
def _hf_reward_model(cfg):
    """transformers' Qwen3ForSequenceClassification of cfg's shape, one label, pad id 0."""
    import transformers

    d = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "torch_dtype")}
    hcfg = transformers.AutoConfig.for_model(d.pop("model_type"), num_labels=1, pad_token_id=0, **d)
    hcfg._attn_implementation = "sdpa"
    return getattr(transformers, cfg.fam.architecture.replace("ForCausalLM", "ForSequenceClassification"))(hcfg)


def bench_trl(shape: str, p: dict, steps: int, warmup: int, tiny: bool) -> dict:
    if (missing := trl_missing()) is not None:
        return missing
    import datasets
    import trl

    from bench.common import trl_step_timer

    cfg = model_cfg(shape, tiny)
    cuda, base, model = hf_peer(_hf_reward_model, cfg)
    tok = hf_word_tokenizer(["a"])  # only its pad id 0 is read
    total = warmup + steps
    rows = [{"chosen_ids": c, "rejected_ids": r} for c, r in _pairs(cfg.vocab_size, p["pairs"] * total, p)]
    args = trl.RewardConfig(output_dir=tempfile.mkdtemp(prefix="trl-bench-rm-"), per_device_train_batch_size=p["pairs"],
                            gradient_accumulation_steps=1, gradient_checkpointing=True, bf16=cuda, learning_rate=1e-6,
                            max_length=None, max_steps=total, logging_steps=1, report_to=[], save_strategy="no",
                            seed=0, use_cpu=not cuda, dataloader_drop_last=True)
    times: list[float] = []
    trainer = trl.RewardTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                                processing_class=tok, callbacks=[trl_step_timer(times, warmup, cuda)])
    first = trainer.train_dataset[0]
    if (first["chosen_ids"], first["rejected_ids"]) != _pairs(cfg.vocab_size, 1, p)[0]:  # rlcu's first pair
        return {"error": "TRL holds other ids for the first pair than rlcu's"}
    trainer.train()
    return {**summary(times, p, cuda, base), "trl": trl.__version__,
            "optimizer": "torch AdamW on bf16 parameters (bf16 m, v and gradients)"}


# ---------------------------------------------------------------- driver
if __name__ == "__main__":
    main(__doc__, __file__, {"rlcu": bench_rlcu, "trl": bench_trl}, (PROTOCOL, TINY_PROTOCOL), "reward_model",
         "random bf16 weights, a fresh one-label score head; 16 pairs of 256 + 256 + 256 tokens a step, "
         "one optimizer step each; full gradient checkpointing; median s/step after warm-up; each side "
         "in its own process", "RM step")
