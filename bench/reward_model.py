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

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import SHAPES, qwen3_06b_config, write_json  # noqa: E402

PROTOCOL = dict(pairs=16, prompt_len=256, chosen_len=256, rejected_len=256)
TINY_PROTOCOL = dict(pairs=4, prompt_len=12, chosen_len=8, rejected_len=6)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)


def _model_cfg(shape: str, tiny: bool):
    from rlcu.model.config import Qwen3Config

    return Qwen3Config(**TINY, eos_token_id=1, bos_token_id=None) if tiny else qwen3_06b_config(**SHAPES[shape])


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


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _summary(times: list[float], p: dict, cuda: bool, base: int) -> dict:
    s = statistics.median(times)
    tokens = p["pairs"] * (2 * p["prompt_len"] + p["chosen_len"] + p["rejected_len"])
    res = {"s_per_step": s, "steps": times, "pairs_per_s": p["pairs"] / s, "tokens_per_s": tokens / s,
           "tokens_per_step": tokens}
    if cuda:
        res["peak_GiB"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return res


# ---------------------------------------------------------------- rlcu
def bench_rlcu(shape: str, p: dict, steps: int, warmup: int, tiny: bool) -> dict:
    from rlcu.config import RMConfig, _build
    from rlcu.model.causal_lm import CausalLM
    from rlcu.model.reward_model import RewardModel
    from rlcu.train.reward_trainer import RewardTrainer

    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    cfg = _model_cfg(shape, tiny)
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
    times = []
    for s in range(total):
        if s == warmup and cuda:
            torch.cuda.reset_peak_memory_stats()
        _sync()
        t0 = time.perf_counter()
        m = tr.train_step(s)
        _sync()
        if s >= warmup:
            times.append(time.perf_counter() - t0)
        if m["pairs"] != p["pairs"]:
            raise RuntimeError(f"a step took {m['pairs']} pairs, not {p['pairs']}")
    res = {**_summary(times, p, cuda, base), "loss_last": m["loss"],
           "optimizer": "fp32 master + fp32 Adam m, v; fp32 gradients"}
    del tr, rm
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
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
    try:
        import datasets
        import trl
        from transformers import PreTrainedTokenizerFast, TrainerCallback
    except ImportError as e:
        return {"error": f"TRL side skipped: {e} (install trl, datasets)"}
    from rlcu.data.tokenizer import make_word_tokenizer

    cuda = torch.cuda.is_available()
    cfg = _model_cfg(shape, tiny)
    base = torch.cuda.memory_allocated() if cuda else 0
    torch.manual_seed(0)
    model = _hf_reward_model(cfg).to("cuda" if cuda else "cpu", torch.bfloat16 if cuda else torch.float32)
    wt = make_word_tokenizer(["a"], special_tokens=("<eos>",), eos_token="<eos>")  # only its pad id 0 is read
    tok = PreTrainedTokenizerFast(tokenizer_object=wt.backend, unk_token="<unk>", pad_token="<unk>",
                                  eos_token="<eos>")
    total = warmup + steps
    rows = [{"chosen_ids": c, "rejected_ids": r} for c, r in _pairs(cfg.vocab_size, p["pairs"] * total, p)]
    args = trl.RewardConfig(output_dir=tempfile.mkdtemp(prefix="trl-bench-rm-"), per_device_train_batch_size=p["pairs"],
                            gradient_accumulation_steps=1, gradient_checkpointing=True, bf16=cuda, learning_rate=1e-6,
                            max_length=None, max_steps=total, logging_steps=1, report_to=[], save_strategy="no",
                            seed=0, use_cpu=not cuda, dataloader_drop_last=True)
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            _sync()
            self.t0 = time.perf_counter()
            if state.global_step == warmup and cuda:
                torch.cuda.reset_peak_memory_stats()

        def on_step_end(self, a, state, control, **kw):
            _sync()
            if state.global_step > warmup:
                times.append(time.perf_counter() - self.t0)

    trainer = trl.RewardTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                                processing_class=tok, callbacks=[Timer()])
    first = trainer.train_dataset[0]
    if (first["chosen_ids"], first["rejected_ids"]) != _pairs(cfg.vocab_size, 1, p)[0]:  # rlcu's first pair
        return {"error": "TRL holds other ids for the first pair than rlcu's"}
    trainer.train()
    return {**_summary(times, p, cuda, base), "trl": trl.__version__,
            "optimizer": "torch AdamW on bf16 parameters (bf16 m, v and gradients)"}


# ---------------------------------------------------------------- driver
def run_side(side: str, a) -> dict:
    p = TINY_PROTOCOL if a.tiny else PROTOCOL
    fn = bench_rlcu if side == "rlcu" else bench_trl
    return fn(a.shape, p, a.steps, a.warmup, a.tiny)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="0.6b,4b")
    ap.add_argument("--sides", default="rlcu,trl")
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and 4 short pairs a step (CPU smoke test)")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per side and shape")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.tiny:
        a.shapes, a.steps, a.warmup = "tiny", min(a.steps, 2), min(a.warmup, 1)
    if a.side:
        print("RESULT " + json.dumps(run_side(a.side, a)))
        return
    t0 = time.time()
    res = {"protocol": TINY_PROTOCOL if a.tiny else PROTOCOL, "tiny": a.tiny,
           "method": "random bf16 weights, a fresh one-label score head; 16 pairs of 256 + 256 + 256 tokens a step, "
                     "one optimizer step each; full gradient checkpointing; median s/step after warm-up; each side "
                     "in its own process",
           "timed_steps": a.steps, "warmup_steps": a.warmup}
    for shape in a.shapes.split(","):
        res[shape] = {}
        for side in a.sides.split(","):
            cmd = [sys.executable, __file__, "--side", side, "--shape", shape, "--steps", str(a.steps),
                   "--warmup", str(a.warmup)] + (["--tiny"] if a.tiny else [])
            try:
                pr = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout,
                                    env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
                line = [x for x in pr.stdout.splitlines() if x.startswith("RESULT ")]
                res[shape][side] = json.loads(line[-1][7:]) if line else {"error": (pr.stderr or pr.stdout)[-800:]}
            except subprocess.TimeoutExpired:
                res[shape][side] = {"error": f"timed out after {a.timeout} s"}
        r, t = res[shape].get("rlcu", {}), res[shape].get("trl", {})
        if r.get("s_per_step") and t.get("s_per_step"):
            res[shape]["speedup_vs_trl"] = t["s_per_step"] / r["s_per_step"]
            if r.get("peak_GiB") and t.get("peak_GiB"):
                res[shape]["memory_ratio_vs_trl"] = r["peak_GiB"] / t["peak_GiB"]
    res["wall_s"] = time.time() - t0
    path = write_json("reward_model_tiny.json" if a.tiny else "reward_model.json", res)
    print(f"\n{'RM step':<14} {'s/step':>8} {'pairs/s':>8} {'tokens/s':>9} {'peak GiB':>9} {'vs TRL':>7}")
    for shape in a.shapes.split(","):
        for side in a.sides.split(","):
            r = res[shape].get(side, {})
            if not r.get("s_per_step"):
                print(f"{shape + ' ' + side:<14} {str(r.get('error', 'no result'))[-300:]}")
                continue
            sp = f"{res[shape]['speedup_vs_trl']:.2f}x" if side == "rlcu" and "speedup_vs_trl" in res[shape] else ""
            pk = f"{r['peak_GiB']:.2f}" if "peak_GiB" in r else "-"
            print(f"{shape + ' ' + side:<14} {r['s_per_step']:>8.3f} {r['pairs_per_s']:>8.1f} "
                  f"{r['tokens_per_s']:>9.0f} {pk:>9} {sp:>7}")
    print(f"\n{path}")


if __name__ == "__main__":
    main()
