"""One pure decode step, serial against two half-batches on two streams (engine/decode_overlap.py),
on the Qwen3-0.6B and 8B shapes with random bf16 weights, against the step's bandwidth bound.

The step: the embedding, every layer over the paged KV cache, the final norm and the LM head's
GEMM, of B sequences whose contexts are uniform in [200, 2048] (the generation protocol's
mid-run state), kv slots -1 (nothing written, so every replay reads the same cache). Variants:
  serial   paged_forward.hidden (what the decode graphs capture today);
  overlap  decode_overlap.hidden_decode: half B on a second stream, the attentions in turn;
  drift    the same without the attention order (the streams drift as they go);
  attn     the step's attention kernels alone (L launches over the whole batch): a floor for
           any schedule that does not make the attention faster.
Each variant is one CUDA graph (as the engine replays it), checked against serial (relative
error of the logits, bf16 tolerance), timed by CUDA events: median of 30 replays after 5.
The bound: (weight bytes + context tokens x KV bytes a token) / the copy bandwidth measured in
the same run (bytes read + written), as bench/generate.py counts a decode step.

    python bench/decode_overlap.py [--shapes 0.6b,8b] [--batches 64,128,256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import SHAPES, measure_ceilings, qwen3_06b_config, write_json  # noqa: E402
from bench.generate import random_model  # noqa: E402

BS = 16


def cache(cfg, B: int, seed: int = 0):
    """A shuffled paged pool of B random contexts -> (kv, tables, lens, context bucket)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    lens = torch.randint(200, 2049, (B,), generator=g, device="cuda")
    need = (lens + BS - 1) // BS
    nb = int(need.sum()) + 8
    kv = torch.empty(2, cfg.num_hidden_layers, nb, BS, cfg.num_key_value_heads, cfg.head_dim, device="cuda",
                     dtype=torch.bfloat16).normal_(generator=g)
    perm = torch.randperm(nb, generator=g, device="cuda").int()
    W = 2048 // BS
    tables = torch.zeros(B, W, dtype=torch.int32, device="cuda")
    start = torch.cumsum(need, 0) - need
    col = torch.arange(W, device="cuda")
    used = col[None, :] < need[:, None]
    tables[used] = perm[(start[:, None] + col[None, :])[used]]
    return kv, tables, lens.int(), 4096  # graphs.context_bucket(2048) at max_model_len >= 4096


def graph(fn):
    """fn captured in a CUDA graph (after one eager run that compiles its kernels)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    torch.cuda.synchronize()
    return g, out


def time_ms(g, reps: int = 30, warm: int = 5) -> float:
    for _ in range(warm):
        g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def run_case(model, B: int, copy_Bps: float) -> dict:
    from rlcu.engine import paged_forward
    from rlcu.engine.decode_overlap import hidden_decode
    from rlcu.ops.paged_attention import paged_attention

    cfg = model.cfg
    kv, tables, lens, kb = cache(cfg, B)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (B,), generator=g, device="cuda", dtype=torch.int32)
    pos = (lens - 1).int()
    slots = torch.full((B,), -1, device="cuda", dtype=torch.int64)
    cu = torch.arange(B + 1, device="cuda", dtype=torch.int32)
    side = torch.cuda.Stream()
    q = torch.randn(B, cfg.num_attention_heads, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
    scale = cfg.head_dim**-0.5

    def serial():
        h = paged_forward.hidden(model, kv, ids, pos, slots, tables, cu, lens, 1, kb)
        return paged_forward.logits(model, h)

    def overlap(gate=True):
        h = hidden_decode(model, kv, ids, pos, slots, tables, cu, lens, kb, side, gate)
        return paged_forward.logits(model, h)

    def attn():
        for i in range(cfg.num_hidden_layers):
            paged_attention(q, kv[0, i], kv[1, i], tables, cu, lens, 1, kb, scale)

    kv_tok = 2 * cfg.num_hidden_layers * cfg.kv_size * 2
    weight_bytes = model.flat.numel() * model.flat.element_size()
    ctx = int(lens.sum())
    bound = (weight_bytes + ctx * kv_tok) / copy_Bps * 1e3
    r = {"B": B, "context_tokens": ctx, "bound_ms": bound,
         "attention_bytes_bound_ms": ctx * kv_tok / copy_Bps * 1e3}
    ref = None
    for name, fn in (("serial", serial), ("overlap", overlap), ("drift", lambda: overlap(False)), ("attn", attn)):
        gr, out = graph(fn)
        ms = time_ms(gr)
        e = {"ms": ms, "bound_fraction": bound / ms}
        if out is not None:
            if ref is None:
                ref = out.float().clone()
            e["rel_err"] = float((out.float() - ref).norm() / ref.norm())
            e["ok"] = e["rel_err"] < 2e-2
        r[name] = e
        del gr
    torch.cuda.empty_cache()
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="0.6b,8b")
    ap.add_argument("--batches", default="64,128,256")
    a = ap.parse_args()
    ceil = measure_ceilings()
    copy_Bps = ceil["copy_GBps"] * 1e9
    rows = []
    for shape in a.shapes.split(","):
        model = random_model(qwen3_06b_config(**SHAPES[shape]), "cuda")
        for B in map(int, a.batches.split(",")):
            r = {"shape": shape, **run_case(model, B, copy_Bps)}
            rows.append(r)
            cols = "  ".join(f"{k} {r[k]['ms']:6.2f} ({100 * r[k]['bound_fraction']:.0f}%)"
                             for k in ("serial", "overlap", "drift", "attn"))
            print(f"{shape:>5} B={B:<4} bound {r['bound_ms']:6.2f} ms  {cols}  err {r['overlap']['rel_err']:.1e}",
                  flush=True)
        del model
        torch.cuda.empty_cache()
    write_json("decode_overlap.json", {"ceilings": ceil, "rows": rows})


if __name__ == "__main__":
    main()
