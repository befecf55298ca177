"""DPO-step benchmark: rlcu.DPOTrainer beside TRL's DPOTrainer (the peer) in the same call, each
side in its own process.

Protocol: the Qwen3-0.6B and Qwen3-4B shapes (bench/common.py SHAPES), random bf16 weights; 16
pairs a step, each a 256-token prompt with a 256-token chosen and a 256-token rejected completion
(exact lengths: random words of a word-level tokenizer over the model's vocabulary, word i =
"t{i}", the last id a special <eos> that ends every completion, so TRL appends nothing), so a step reads 16 x
1024 = 16384 tokens on both sides and TRL pads nothing. Sigmoid loss, beta 0.1, one optimizer
step per batch of 16 pairs (rlcu: one packed micro-batch of 16384 tokens; TRL:
per_device_train_batch_size 16), full gradient checkpointing on both. The reference logprobs
are precomputed on both sides (rlcu always; TRL with precompute_ref_log_probs=True, which
then holds no reference model), so a step is the policy's forward and backward and the update
alone; the precompute's time is reported apart (ref_s; TRL's includes its tokenisation).
Reported per side: the median seconds per step over the timed steps after warm-up, pairs/s,
tokens/s, and the peak GPU memory of the timed steps above what the process held before the
model was made. rlcu's optimizer holds fp32 master weights and fp32 Adam moments (its default);
TRL's torch AdamW holds bf16 moments of bf16 parameters: the peaks differ by that too.

    python bench/dpo.py                    # both shapes, rlcu and (if installed) TRL: bench/results/dpo.json
    python bench/dpo.py --shapes 0.6b      # one shape
    python bench/dpo.py --tiny             # a tiny model, 4 short pairs, on the CPU: dpo_tiny.json (a smoke test)
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import sync  # noqa: E402
from bench.preference import hf_peer, hf_word_tokenizer, main, model_cfg, release, summary, time_rlcu_steps, trl_missing  # noqa: E402

PROTOCOL = dict(pairs=16, prompt_len=256, chosen_len=256, rejected_len=256, beta=0.1)
TINY_PROTOCOL = dict(pairs=4, prompt_len=12, chosen_len=8, rejected_len=6, beta=0.1)


def _pairs(V: int, n: int, p: dict, seed: int = 0) -> list[tuple[list[int], list[int], list[int]]]:
    """n pairs of random word ids in [1, V - 1), each completion ending with the <eos> id V - 1."""
    g = torch.Generator().manual_seed(seed)

    def ids(k):
        return torch.randint(1, V - 1, (k,), generator=g).tolist()

    return [(ids(p["prompt_len"]), ids(p["chosen_len"] - 1) + [V - 1], ids(p["rejected_len"] - 1) + [V - 1])
            for _ in range(n)]


# ---------------------------------------------------------------- rlcu
def bench_rlcu(shape: str, p: dict, steps: int, warmup: int, tiny: bool) -> dict:
    from rlcu.config import DPOConfig, _build
    from rlcu.model.causal_lm import CausalLM
    from rlcu.train.dpo import DPOTrainer

    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    cfg = model_cfg(shape, tiny)
    base = torch.cuda.memory_allocated() if cuda else 0
    model = CausalLM.from_config(cfg, device=dev, dtype=dtype, seed=0)
    model.gradient_checkpointing = True
    total = warmup + steps
    rows = [{"prompt_token_ids": a, "chosen_token_ids": c, "rejected_token_ids": r}
            for a, c, r in _pairs(cfg.vocab_size, p["pairs"] * total, p)]
    pair_tokens = 2 * p["prompt_len"] + p["chosen_len"] + p["rejected_len"]
    dcfg = _build(DPOConfig, dict(
        steps=total, batch_tokens=p["pairs"] * pair_tokens, beta=p["beta"], max_seq_len=pair_tokens,
        optim=dict(lr=1e-6), data=dict(shuffle=False),
        log=dict(out_dir=tempfile.mkdtemp(prefix="rlcu-bench-dpo-"), progress=False, tensorboard=False, plot=False),
        checkpoint=dict(save_at_end=False)))
    tr = DPOTrainer(dcfg, rows, model=model)
    sync()
    t0 = time.perf_counter()
    tr.reference_logprobs()
    sync()
    ref_s = time.perf_counter() - t0
    times, m = time_rlcu_steps(tr, p, total, warmup, cuda)
    res = {**summary(times, p, cuda, base), "ref_s": ref_s, "loss_last": m["loss"],
           "optimizer": "fp32 master + fp32 Adam m, v; fp32 gradients"}
    del tr, model
    release(cuda)
    return res


# ---------------------------------------------------------------- TRL
def bench_trl(shape: str, p: dict, steps: int, warmup: int, tiny: bool) -> dict:
    if (missing := trl_missing()) is not None:
        return missing
    import datasets
    import trl

    from bench.common import hf_model, trl_step_timer

    cfg = model_cfg(shape, tiny)
    cuda, base, model = hf_peer(hf_model, cfg)
    V = cfg.vocab_size
    tok = hf_word_tokenizer([f"t{i}" for i in range(1, V - 1)])
    total = warmup + steps

    def text(ids):
        return " ".join("<eos>" if i == V - 1 else f"t{i}" for i in ids)

    rows = [{"prompt": text(a), "chosen": " " + text(c), "rejected": " " + text(r)}
            for a, c, r in _pairs(V, p["pairs"] * total, p)]
    args = trl.DPOConfig(output_dir=tempfile.mkdtemp(prefix="trl-bench-dpo-"), per_device_train_batch_size=p["pairs"],
                         gradient_accumulation_steps=1, gradient_checkpointing=True, bf16=cuda, learning_rate=1e-6,
                         beta=p["beta"], loss_type=["sigmoid"], precompute_ref_log_probs=True, max_length=None,
                         max_steps=total, logging_steps=1, report_to=[], save_strategy="no", seed=0,
                         use_cpu=not cuda, dataloader_drop_last=True)
    times: list[float] = []
    t0 = time.perf_counter()
    trainer = trl.DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=tok, callbacks=[trl_step_timer(times, warmup, cuda)])
    ref_s = time.perf_counter() - t0
    n = trainer.train_dataset[0]
    if (n["prompt_ids"], n["chosen_ids"], n["rejected_ids"]) != _pairs(V, 1, p)[0]:  # rlcu's first pair
        return {"error": "TRL tokenised the first pair to other ids than rlcu's "
                         f"({len(n['prompt_ids'])}, {len(n['chosen_ids'])}, {len(n['rejected_ids'])} tokens)"}
    trainer.train()
    return {**summary(times, p, cuda, base), "ref_s": ref_s, "trl": trl.__version__,
            "optimizer": "torch AdamW on bf16 parameters (bf16 m, v and gradients)"}


# ---------------------------------------------------------------- driver
if __name__ == "__main__":
    main(__doc__, __file__, {"rlcu": bench_rlcu, "trl": bench_trl}, (PROTOCOL, TINY_PROTOCOL), "dpo",
         "random bf16 weights; 16 pairs of 256 + 256 + 256 tokens a step, one optimizer step each; full "
         "gradient checkpointing; reference logprobs precomputed on both sides (TRL: "
         "precompute_ref_log_probs); median s/step after warm-up; each side in its own process",
         "DPO step", ref_col=True)
