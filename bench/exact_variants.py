"""Which of exact mode's choices keeps the engine's logprobs equal to the trainer's at a shape?

A diagnostic beside tests/integration/test_exact_gpu.py: at the given model shape (default: the learning
bench's tiny model, head_dim 24), random bf16 weights, n = 8 samples of 32 prompts, the share of
sampled tokens whose engine logprob equals Qwen3.forward's (and forward_backward's fused head's)
bit for bit, with the current choices and with each one swapped for its older form:
- attention_exact's training / prefill row tile (BM_TRAIN 32 -> 16, the decode's);
- the GEMM's tiles by M and N (-> one pointer-load configuration for every M).
(The first run of this, at this session's first form -- tiles by M at any K, the 32-row
attention tile at any head_dim -- found 87.5% of the tokens equal; 100% with both restricted as
they are now: bench/results/exact_variants_tiny.json. Its variant "rms_copy", the engine's q / k
norm reading the heads in place or copied out, is gone: both sides now run one fused kernel.)

    python bench/exact_variants.py [--shape tiny|0.6b] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TINY = dict(hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=24, max_position_embeddings=2048, tie_word_embeddings=True, vocab_size=128)


def gemm_rows(cfg) -> dict:
    """Each tile class of matmul_invariant.CONFIGS against the reference tiles at this shape's
    weights, bit for bit, rows of an 8192-row product at M in {1, 7, 64, 256}."""
    from rlcu.ops import matmul_invariant as mi

    H, inter, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes = {"qkv": (cfg.q_size + 2 * cfg.kv_size, H), "o": (H, cfg.q_size), "gate_up": (2 * inter, H),
              "down": (H, inter), "lm_head": (V, H)}
    g = torch.Generator(device="cuda").manual_seed(0)
    keep, out = mi.CONFIGS, {}
    ref_cfg = (128, 128, 64, 8, 8, 3, False)
    try:
        for name, (N, K) in shapes.items():
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
            x = torch.randn(8192, K, device="cuda", dtype=torch.bfloat16, generator=g)
            mi.CONFIGS = ((1 << 62, 1 << 62, ref_cfg),)
            ref = mi.mm(x, w)
            for _, _, c in keep:
                mi.CONFIGS = ((1 << 62, 1 << 62, c),)
                bad = sum(int((mi.mm(x[3:3 + M], w) != ref[3:3 + M]).sum()) for M in (1, 7, 64, 256))
                out[f"{name} N={N} K={K} {list(c)}"] = bad
    finally:
        mi.CONFIGS = keep
    return out


@contextlib.contextmanager
def variant(name: str):
    from rlcu.ops import attention_exact as ae
    from rlcu.ops import matmul_invariant as mi

    keep_ae, keep_mi = dict(ae.CONFIG), mi.CONFIGS
    try:
        if name in ("bm16", "all_old"):
            ae.CONFIG["BM_TRAIN"] = 16
        if name in ("gemm_one", "all_old", "gemm_one_bm16"):
            mi.CONFIGS = ((1 << 62, 1 << 62, (128, 128, 64, 8, 8, 3, False)),)
        if name == "gemm_one_bm16":
            ae.CONFIG["BM_TRAIN"] = 16
        if name == "no_tma":
            mi.CONFIGS = tuple((m, n, c[:6] + (False,)) for m, n, c in keep_mi)
        if name == "bk64":
            mi.CONFIGS = tuple((m, n, c[:2] + (64,) + c[3:]) for m, n, c in keep_mi)
        if name == "no_mma2":
            mi.CONFIGS = tuple((m, n, c if c[0] >= 64 else (64, 32, 128, 8, 4, 4, True)) for m, n, c in keep_mi)
        yield
    finally:
        ae.CONFIG.clear()
        ae.CONFIG.update(keep_ae)
        mi.CONFIGS = keep_mi


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=("tiny", "0.6b"), default="tiny")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--out")
    ap.add_argument("--variants", default="current,bm16,gemm_one,all_old")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/exact_variants.py: needs a CUDA device", file=sys.stderr)
        return 2
    from bench.common import scale_to_entropy
    from bench.generate import random_model
    from rlcu.engine import LLM, SamplingParams
    from rlcu.model.config import Qwen3Config

    cfg = Qwen3Config(**TINY) if a.shape == "tiny" else Qwen3Config()
    m = random_model(cfg, "cuda")
    scale_to_entropy(m, 2.9 if a.shape == "0.6b" else 1.5)
    m.exact = True  # the model's mode, which its engines read
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 60, (a.prompts,), generator=g)]
    res = {"shape": a.shape, "config": {k: getattr(cfg, k) for k in TINY}}
    res["gemm_rows_differing"] = gemm_rows(cfg)
    print(f"gemm: {sum(res['gemm_rows_differing'].values())} elements differ over "
          f"{len(res['gemm_rows_differing'])} (shape, tiles)", flush=True)
    for name in a.variants.split(","):
        with variant(name):
            sp = SamplingParams(n=8, temperature=1.0, max_tokens=48, ignore_eos=True, seed=5, logprobs=True)
            llm = LLM(m, num_kv_blocks=2048, max_num_batched_tokens=512, warmup=False)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            gens = [(p, c.token_ids, c.logprobs) for p, o in zip(prompts, outs) for c in o.outputs]
            llm.sleep()
            del llm
            seqs = [p + t for p, t, _ in gens]
            tokens = torch.tensor([x for s in seqs for x in s], device="cuda")
            cu = torch.tensor([0] + torch.tensor([len(s) for s in seqs]).cumsum(0).tolist(), device="cuda",
                              dtype=torch.int32)
            eng = torch.tensor([x for _, _, lps in gens for x in lps])
            row = {}
            for how in ("forward", "fused"):
                if how == "fused":
                    lp, _ = m.forward_backward(tokens, cu, lambda lp_c, e, i: (torch.zeros_like(lp_c), None),
                                               temperature=1.0, return_entropy=True)
                    m.release_grads()
                else:
                    lp = m.forward(tokens, cu, temperature=1.0, grad=False)
                tr = torch.cat([lp[s + len(p):s + len(p) + len(t)].float().cpu()
                                for (p, t, _), s in zip(gens, cu[:-1].tolist())])
                d = (tr - eng).abs()
                row[how] = {"exact_frac": float((d == 0).double().mean()), "abs_max": float(d.max())}
            res[name] = row
            print(name, row, flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
