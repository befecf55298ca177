"""What exact mode costs on the CPU twins, and where: a tiny GRPO run (16 prompts x 8 samples, 8
new tokens, one thread) with and without exact mode, at the GRPO tests' model (tests/support/trainers.py) and at the
demo's, then one profiled run of each (cProfile: the cumulative seconds of the ops that differ)
and the twin matmul against torch's at the run's shapes.

    python bench/exact_cpu.py [--steps 6] [--reps 3]     # -> bench/results/exact_cpu.json

CPU seconds (time.process_time), not wall time, so that a shared machine's load counts less;
runs of the two modes alternate.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time

import torch
from common import write_json

MODELS = {
    "test": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,  # test_grpo's
                 num_key_value_heads=1, head_dim=16, max_position_embeddings=32, tie_word_embeddings=True),
    "demo": None,  # rlcu.config.MODEL
}
PROFILED = ("matmul_invariant.py:mm_ref", "exact.py:tree_sum", "attention_exact.py:attention_exact_paged_ref",
            "paged_attention.py:paged_attention_ref", "llm.py:generate", "causal_lm.py:forward_backward")


def trainer(model: dict, exact: bool, steps: int):
    from rlcu.config import GRPOConfig, config_from_dict
    from rlcu.data import synthetic as syn
    from rlcu.train.grpo import GRPOTrainer

    tok = syn.make_tokenizer()
    d = dict(model=dict(tiny=dict(model, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id), init_seed=1,
                        gradient_checkpointing=False),
             steps=steps, prompts_per_step=16, group_size=8, max_new_tokens=8, exact=exact, optim=dict(lr=1e-3),
             rewards=[{"fn": "rlcu.data.synthetic:exact_match_reward"}],
             log=dict(out_dir=tempfile.mkdtemp(), progress=False, tensorboard=False, plot=False),
             checkpoint=dict(save_at_end=False), seed=0)
    return GRPOTrainer(config_from_dict(GRPOConfig, d), syn.sort_rows(256, "train", min_len=3, max_len=6),
                       tokenizer=tok)


def cpu_seconds(model: dict, exact: bool, steps: int) -> float:
    tr = trainer(model, exact, steps)
    t0 = time.process_time()
    tr.train()
    return time.process_time() - t0


def profile(model: dict, exact: bool, steps: int) -> dict:
    tr = trainer(model, exact, steps)
    pr = cProfile.Profile()
    pr.enable()
    tr.train()
    pr.disable()
    st = pstats.Stats(pr).stats
    out = {"total_s": sum(v[2] for v in st.values())}
    for (f, _, name), (_, _, _, cum, _) in st.items():
        key = f"{f.rsplit('/', 1)[-1]}:{name}"
        if key in PROFILED and "rlcu" in f:
            out[key] = cum
    return out


def matmuls() -> list[dict]:
    """torch's matmul against the exact twin (mm_ref) at the demo run's training shapes."""
    from rlcu.ops.matmul_invariant import mm_ref

    def ms(fn, n=3):
        fn()
        t = time.process_time()
        for _ in range(n):
            fn()
        return (time.process_time() - t) / n * 1e3

    rows = []
    for M, N, K in ((2048, 288, 96), (2048, 512, 96), (2048, 96, 256)):  # qkv, gate_up, down
        x, w = torch.randn(M, K), torch.randn(N, K)
        a, b = ms(lambda x=x, w=w: x @ w.T), ms(lambda x=x, w=w: mm_ref(x, w))
        rows.append({"shape": [M, N, K], "torch_ms": a, "twin_ms": b, "ratio": b / a})
    return rows


def main() -> None:
    from rlcu.config import MODEL

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    out = {"steps": a.steps, "reps": a.reps, "models": {}}
    for name, model in MODELS.items():
        model = model or MODEL
        runs = {False: [], True: []}
        for _ in range(a.reps):
            for exact in (False, True):
                runs[exact].append(cpu_seconds(model, exact, a.steps))
        med = {e: statistics.median(v) for e, v in runs.items()}
        out["models"][name] = {"model": model, "default_cpu_s": runs[False], "exact_cpu_s": runs[True],
                               "ratio": med[True] / med[False],
                               "profile": {"default": profile(model, False, 3), "exact": profile(model, True, 3)}}
        print(f"{name}: default {med[False]:.2f} s, exact {med[True]:.2f} s (CPU, {a.steps} steps): "
              f"{med[True] / med[False]:.2f}x")
    out["matmuls"] = matmuls()
    for r in out["matmuls"]:
        print(f"matmul {r['shape']}: torch {r['torch_ms']:.2f} ms, twin {r['twin_ms']:.1f} ms ({r['ratio']:.0f}x)")
    print(write_json("exact_cpu.json", out))


if __name__ == "__main__":
    main()
