"""Where a pure decode step's time goes, on the Qwen3-0.6B and 8B shapes with random bf16
weights, against the step's bandwidth bound; and one schedule tried and measured against it.

The step: the embedding, every layer over the paged KV cache, the final norm and the LM head's
GEMM, of B sequences whose contexts are uniform in [200, 2048] (the generation protocol's
mid-run state), kv slots -1 (nothing written, so every replay reads the same cache). Variants:
  serial   paged_forward.hidden + the head (what the decode graphs capture);
  attn     the step's attention kernels alone (L launches over the whole batch);
  rest     the step without its attention (each layer's q passed on as its output): the GEMMs,
           the norms, qkv_prep, swiglu;
  fused    serial with the projections through ops/decode_linear.py (--fused-linear: the norms
           and SwiGLU inside the GEMMs, tiles from a bench/decode_linear.py JSON), and
           fused_pdl the same with programmatic dependent launch, rest_fused `rest` with the op,
           and halves_fused `halves` with
           the op (its GEMMs hold less shared memory than cuBLAS's, so that one half's GEMM
           programs may sit on an SM beside the other half's attention); logits compared with
           serial's;
  rest_hot `rest` with every layer reading layer 0's weights (they stay in L2): what the rest
           would cost if no GEMM waited on DRAM (0-11% less on the H200: the rest is its kernels'
           own latency; an L2 prefetch of each layer's next weights, measured slower,
           bench/results/l2_prefetch.json, 0033ff8);
  duo      (--overlap) the batch as two halves run as two independent chains (paged_forward.hidden
           each) on two streams, forked at the step's start and joined at its end, so that one
           chain's latency-bound kernels may fill the SMs the other's leave idle; duo_u2 / duo_u1
           the same with the list attention's target units at 2 / 1 an SM (fewer attention
           programs, room beside them for the other chain's GEMMs), attn_u2 / attn_u1 and
           serial_u2 the attention alone and the serial step at those units (measured slower
           than serial at every size: bench/results/l2_prefetch.json);
  halves   the batch as two halves on two streams, their attentions in turn (A0, B0, A1, ...),
           so that one half's attention could run beside the other half's GEMMs (`halves`
           below; measured slower at every size on the H200: each half reads every weight, and
           the attention's programs fill the SMs, so the GEMMs wait for them anyway).
With --split-kernel, two more: serial_split and attn_split, the step and its attention alone
through the decode attention's split kernel (ops/paged_attention.py; the default before the
list kernel, ops/paged_decode_list.py), in the same run. `attn` builds one work list a step
for its L launches, as paged_forward.hidden does.
Each variant is one CUDA graph (as the engine replays it), timed by CUDA events: median of 30
replays after 5 (common.replay_ms); halves' logits are compared with serial's (relative error,
recorded: the GEMMs round M and M / 2 rows differently); `kernels` is the sum of serial's
kernel times (torch.profiler), so serial - kernels is the time between kernels.
The bound: (weight bytes + context tokens x KV bytes a token) / the copy bandwidth measured in
the same run (bytes read + written), as bench/generate.py counts a decode step.

    python bench/decode_step.py [--shapes 0.6b,8b] [--batches 64,128,256] [--fused-linear [TABLE]] [--split-kernel]
                                [--overlap]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    SHAPES,
    capture,
    measure_ceilings,
    overriding,
    qwen3_06b_config,
    rel_err,
    replay_ms,
    write_json,
)
from bench.generate import random_model  # noqa: E402
from rlcu.engine.paged_forward import PagedKV  # noqa: E402

BS = 16


class NoAttention(PagedKV):
    """The engine's paged K/V with the attention left out (o = q): the rest of a step's work."""

    def attend(self, i, q, k, v):
        return q, None


class Chained(PagedKV):
    """The engine's paged K/V whose attention waits for the one before it, of either half (`last`)."""

    last = None

    def attend(self, i, q, k, v):
        stream = torch.cuda.current_stream()
        if Chained.last is not None:
            stream.wait_event(Chained.last)
        o = super().attend(i, q, k, v)
        Chained.last = torch.cuda.Event()
        Chained.last.record(stream)
        return o


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


def halves(model, kv, ids, pos, kv_slots, tables, cu, lens, max_k: int, side) -> torch.Tensor:
    """The step's hidden states with the batch as two halves, half B on stream `side`, each
    layer's attentions in turn (A_i waits for B_i-1, B_i for A_i). A decode step's cu_q is
    0..S, so a half of n rows passes cu[:n + 1]."""
    from rlcu.engine.paged_forward import final, schedule
    from rlcu.model.layer import layer_fwd
    from rlcu.ops.embedding import embedding_fwd

    S = ids.shape[0]
    x = embedding_fwd(ids, model.w["embed"])
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    Chained.last = None
    parts = [(rows, stream, Chained(model, kv, kv_slots[rows], tables[rows], cu[:rows.stop - rows.start + 1],
                                    lens[rows], 1, max_k), schedule(model, rows.stop - rows.start))
             for rows, stream in ((slice(0, S // 2), main), (slice(S // 2, S), side))]
    for i in range(model.cfg.num_hidden_layers):
        for rows, stream, cache, ops in parts:
            with torch.cuda.stream(stream):
                layer_fwd(model, i, x[rows], pos[rows], cache, ops)
    main.wait_stream(side)
    return final(model, x)


def duo(model, kv, ids, pos, kv_slots, tables, cu, lens, max_k: int, side) -> torch.Tensor:
    """The step's hidden states with the batch as two halves run as two independent chains
    (paged_forward.hidden each, the second on stream `side`), forked at the step's start and
    joined at its end: the GPU interleaves the two chains' kernels as their resources allow."""
    from rlcu.engine.paged_forward import hidden

    S = ids.shape[0]
    h = S // 2
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    a = hidden(model, kv, ids[:h], pos[:h], kv_slots[:h], tables[:h], cu[:h + 1], lens[:h], 1, max_k)
    with torch.cuda.stream(side):
        b = hidden(model, kv, ids[h:], pos[h:], kv_slots[h:], tables[h:], cu[:S - h + 1], lens[h:], 1, max_k)
    main.wait_stream(side)
    return torch.cat([a, b])


def kernel_ms(g, reps: int = 5) -> float:
    """The sum of the kernels' device times of one replay of g (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    t = sum(getattr(e, "device_time", 0.0) or 0.0 for e in prof.events()
            if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    return t / 1e3 / reps


def hot(model):
    """model with every layer's weights replaced by layer 0's (views of the same bytes): a step of
    it reads one layer's weights L times, from L2 after the first."""
    import re
    import types

    w = {k: model.w[re.sub(r"^layers\.\d+\.", "layers.0.", k)] for k in model.w}
    return types.SimpleNamespace(cfg=model.cfg, w=w, lm_head=model.lm_head, exact=False, inv_freq=model.inv_freq,
                                 rope_mscale=model.rope_mscale)


def run_case(model, B: int, copy_Bps: float, fused_table: dict | None = None, split_kernel: bool = False,
             overlap: bool = False) -> dict:
    from rlcu.engine import paged_forward
    from rlcu.engine.paged_forward import final, schedule
    from rlcu.model.layer import layer_fwd
    from rlcu.ops import decode_linear as dl
    from rlcu.ops import paged_attention as pa
    from rlcu.ops.embedding import embedding_fwd
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
        return paged_forward.logits(model, paged_forward.hidden(model, kv, ids, pos, slots, tables, cu, lens, 1, kb))

    def attn():  # one work list for the L launches (list kernel), as paged_forward.hidden builds it
        work = pa.decode_work(cu, lens, cfg.num_key_value_heads)
        for i in range(cfg.num_hidden_layers):
            paged_attention(q, kv[0, i], kv[1, i], tables, cu, lens, 1, kb, scale, None, work)

    def rest(m=model):  # the step without its attention (o = q)
        x = embedding_fwd(ids, m.w["embed"])
        cache, ops = NoAttention(m, kv, slots, tables, cu, lens, 1, kb), schedule(m, B)
        for i in range(cfg.num_hidden_layers):
            layer_fwd(m, i, x, pos, cache, ops)
        return paged_forward.logits(m, final(m, x))

    def two():
        return paged_forward.logits(model, halves(model, kv, ids, pos, slots, tables, cu, lens, kb, side))

    def chains():
        return paged_forward.logits(model, duo(model, kv, ids, pos, slots, tables, cu, lens, kb, side))

    def units(fn, n):  # fn with the list kernel's target units an SM set to n
        def run():
            with overriding(pa.CONFIGS, decode_list=dict(pa.CONFIGS["decode_list"], units_per_sm=n)):
                return fn()
        return run

    def with_linear(pdl: bool, body=serial, inline=True):
        # inline: split-K's partials added by each tile's last program; off for the two streams,
        # whose concurrent launches would share the op's tile counters
        def step():
            with overriding(dl.CONFIGS, enabled=True, pdl=pdl, table=fused_table, inline_reduce=inline):
                return body()
        return step

    def split(fn):  # fn captured with the split kernel as the decode plan
        def run():
            with overriding(pa.CONFIGS, decode_plan=dict(pa.CONFIGS["decode_plan"], kernel="split")):
                return fn()
        return run

    kv_tok = 2 * cfg.num_hidden_layers * cfg.kv_size * 2
    weight_bytes = model.flat.numel() * model.flat.element_size()
    ctx = int(lens.sum())
    bound = (weight_bytes + ctx * kv_tok) / copy_Bps * 1e3
    r = {"B": B, "context_tokens": ctx, "bound_ms": bound, "attention_bytes_bound_ms": ctx * kv_tok / copy_Bps * 1e3}
    ref = None
    variants = [("serial", serial), ("attn", attn), ("rest", rest), ("rest_hot", lambda: rest(hot(model))),
                ("halves", two)]
    if overlap:
        variants += [("duo", chains), ("duo_u2", units(chains, 2)), ("duo_u1", units(chains, 1)),
                     ("attn_u2", units(attn, 2)), ("attn_u1", units(attn, 1)), ("serial_u2", units(serial, 2))]
    if fused_table is not None:
        variants += [("fused", with_linear(False)), ("fused_pdl", with_linear(True)),
                     ("rest_fused", with_linear(False, rest)), ("halves_fused", with_linear(False, two, inline=False))]
    if split_kernel:
        variants += [("serial_split", split(serial)), ("attn_split", split(attn))]
    for name, fn in variants:
        gr, out = capture(fn)
        e = {"ms": replay_ms(gr.replay, 30, warm=5)}
        e["bound_fraction"] = bound / e["ms"]
        if name == "serial":
            ref = out.float().clone()
            e["kernels_ms"] = kernel_ms(gr)
        elif name.startswith("attn"):
            e["attention_fraction"] = r["attention_bytes_bound_ms"] / e["ms"]
        elif not name.startswith("rest"):  # a whole step, another schedule or kernel: its logits against serial's
            e["rel_err"] = rel_err(out, ref)
        r[name] = e
        del gr
    torch.cuda.empty_cache()
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="0.6b,8b")
    ap.add_argument("--batches", default="64,128,256")
    ap.add_argument("--fused-linear", nargs="?", const="", default=None, metavar="TABLE",
                    help="add the fused variants (tiles from a decode_linear.py JSON; default: the measured table)")
    ap.add_argument("--split-kernel", action="store_true", help="also the step through the split kernel")
    ap.add_argument("--overlap", action="store_true", help="also duo, duo_u2 / u1, attn_u2 / u1 and serial_u2")
    a = ap.parse_args()
    table = None
    if a.fused_linear is not None:
        from bench.decode_linear import load_table
        from rlcu.ops.decode_linear import MEASURED

        table = load_table(a.fused_linear) if a.fused_linear else MEASURED
    ceil = measure_ceilings()
    copy_Bps = ceil["copy_GBps"] * 1e9
    rows = []
    for shape in a.shapes.split(","):
        model = random_model(qwen3_06b_config(**SHAPES[shape]), "cuda")
        for B in map(int, a.batches.split(",")):
            r = {"shape": shape, **run_case(model, B, copy_Bps, table, a.split_kernel, a.overlap)}
            rows.append(r)
            cols = "  ".join(f"{k} {v['ms']:6.2f} ({100 * v['bound_fraction']:.0f}%)" for k, v in r.items()
                             if isinstance(v, dict))
            print(f"{shape:>5} B={B:<4} bound {r['bound_ms']:6.2f} ms  {cols}  serial's kernels "
                  f"{r['serial']['kernels_ms']:6.2f}  attention at {100 * r['attn']['attention_fraction']:.0f}% "
                  f"of its bytes" + (f" (split kernel {100 * r['attn_split']['attention_fraction']:.0f}%)"
                                     if "attn_split" in r else ""), flush=True)
        del model
        torch.cuda.empty_cache()
    name = "decode_step" + ("_fused_linear" if table is not None else "") + ("_split_kernel" if a.split_kernel else "")
    name += "_overlap" if a.overlap else ""
    write_json(name + ".json", {"ceilings": ceil, "rows": rows})


if __name__ == "__main__":
    main()
