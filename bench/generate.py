"""Generation benchmark (BENCHMARKS.md section 1): rlcu's engine, and HF transformers `generate`
in the same run, on the Qwen3-0.6B shape with random bf16 weights.

Cases:
- protocol: 256 requests, prompt and output lengths uniform in [100, 1024] (seeded), temperature
  0.6, EOS ignored, all submitted at once; output tokens / wall seconds;
- fixed: B = 64 and B = 256 requests of prompt 128 / output 256 (rlcu and HF `generate`).

The bound: a step must read every weight once plus the K/V of every running sequence's context
(and a prefill step must do its matmul FLOPs), so
    bound(step) = max((weight bytes + context tokens x KV bytes per token) / bandwidth,
                      2 x matmul params x tokens / matmul peak)
For a MoE (--shape qwen3-30b-a3b) the weight bytes are attention's, the routers', the dense
parts' and only the experts the step's tokens are routed to (`step_weight_bytes`: the expected
distinct experts under uniform routing), and the matmul params the active ones (the router and
k experts a token).
and the achieved fraction is sum(bound) / wall. Beside it (JSON bound_split_s / bound_split_fraction,
total and decode) a per-kernel-class roofline that does not let the GEMMs' FLOPs hide attention's
K/V reads: per step max(GEMM weight bytes / bandwidth, GEMM FLOPs / peak) + context K/V bytes /
bandwidth (`split_step_seconds`; bench/bound_replay.py computes both from a CPU replay of the
protocol's steps). The per-phase host timings (schedule, launch,
wait for the device, postprocess) and the prefill/decode split say where the rest goes.

    python bench/generate.py [--quick] [--no-hf] [--bandwidth 4.3e12 | --measure] [--shape 8b]
                             [--no-prefill-graphs] [--split-cap] [--fused-linear [TABLE]] [--pdl]
                             [--split-kernel]

--shape picks another published shape, llama3.1-8b and qwen2.5-7b too (JSON generate_<shape>.json);
qwen3-30b-a3b's 61 GB of weights want --gpu-memory-utilization 0.85 and --no-hf (transformers'
MoE loops over the experts in Python);
--no-prefill-graphs runs prefill and mixed steps eagerly (engine/prefill_graphs.py; JSON *_eager_prefill.json);
--split-cap caps the decode attention's splits (ops/paged_attention.py decode_splits, max_part
512: past the 1k context bucket no split longer than 512 keys below 12 programs an SM; JSON
*_split_cap.json); --fused-linear runs the projections of steps of <= 256 tokens through
ops/decode_linear.py (norm and SwiGLU inside the GEMMs) at the tiles of TABLE (a
bench/decode_linear.py JSON; default: its measured table, decode_linear.MEASURED), --pdl with
programmatic dependent launch (JSON *_fused_linear[_pdl].json); --split-kernel runs the decode
attention's split kernel (ops/paged_attention.py), the default before the list kernel
(ops/paged_decode_list.py; JSON *_split_kernel.json).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402  # noqa: E402
    SHAPES,
    expected_experts,
    hf_model,
    matmul_params,
    measure_ceilings,
    qwen3_06b_config,
    random_prompts,
    write_json,
)

MATMUL_PEAK = 790e12  # bf16 dense, measured on the H200 (BENCHMARKS.md section 4)


def random_model(cfg, device, seed=0):
    """Random bf16 weights straight on the device: N(0, 0.02) matrices, unit norms."""
    from rlcu.model.causal_lm import Qwen3
    from rlcu.model.layout import ParamLayout

    layout = ParamLayout(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    flat = torch.zeros(layout.numel, device=device, dtype=torch.bfloat16)
    for name, v in layout.views(flat).items():
        if name.endswith("norm"):
            v.fill_(1.0)
        else:
            v.normal_(0.0, 0.02, generator=gen)
    return Qwen3(cfg, flat)


def hf_twin(m):
    """The same weights in the HF model of m's family (bf16, SDPA)."""
    with torch.device(m.device):
        hf = hf_model(m.cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():  # (a tied lm_head is not listed: it is the embedding)
            p.copy_(m.params[name])
    return hf


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_weight_bytes(cfg, weight_bytes: int, ntok: int) -> float:
    """The weight bytes a step of ntok tokens reads: every weight of a dense model; of a MoE's
    sparse layers only the experts the step's tokens are routed to. The engine's step log does
    not say which (its route log is per token, on the device), so this takes the expected number
    of distinct experts of ntok tokens under uniform routing, E (1 - (1 - k/E)^ntok)
    (common.py expected_experts; a random model's routing is close to uniform)."""
    if not cfg.fam.moe:
        return weight_bytes
    L, E, k = len(cfg.sparse_layers), cfg.num_experts, cfg.num_experts_per_tok
    expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * 2  # an expert's bf16 gate, up and down
    return weight_bytes - L * E * expert + L * expected_experts(E, k, ntok) * expert


def bound_seconds(stats, cfg, weight_bytes, bandwidth):
    kv_tok = 2 * cfg.num_hidden_layers * cfg.kv_size * 2  # bf16 K and V of every layer
    flops_tok = 2 * matmul_params(cfg)  # a MoE's active parameters
    tot = dec = dec_t = pre_t = 0.0
    for ntok, nseq, ctx, _graph, dt in stats["step_log"]:
        b = max((step_weight_bytes(cfg, weight_bytes, ntok) + ctx * kv_tok) / bandwidth,
                flops_tok * ntok / MATMUL_PEAK)
        tot += b
        if ntok == nseq:
            dec += b
            dec_t += dt
        else:
            pre_t += dt
    return tot, dec, dec_t, pre_t


def split_step_seconds(cfg, weight_bytes, ntok, nseq, ctx, bandwidth, peak=MATMUL_PEAK) -> tuple[float, float]:
    """One step's per-kernel-class roofline -> (GEMM seconds, attention seconds); the step's split
    bound is their sum. Unlike `bound_seconds`, the GEMMs' FLOPs cannot hide attention's K/V
    reads (at 256 decode rows a GEMM's ~256 FLOP/byte is past the H200's ridge of ~200, so a
    decode step's GEMMs are compute-bound and attention runs after them, not under them):
    - GEMM class (the projections, the MLP or the routed experts, the LM head, the sampler):
      max(bytes / bandwidth, FLOPs / peak), where bytes are the weights the step reads (every one
      but an untied embedding table, of which only the step's rows are gathered; a MoE's routed
      experts as `step_weight_bytes`) plus the bf16 logits the head writes and the sampler reads
      (nseq x vocab x 4), and FLOPs are 2 x the matmul params but the head's x ntok plus the
      head's 2 x vocab x hidden x nseq (the engine takes logits of each sequence's last row only;
      nseq errs high by a prefill chunk that is not a prompt's last, at most one a step);
    - attention: the context's K/V bytes / bandwidth (its FLOPs, ~2% of a prefill step's at
      these lengths, left out, so the split bound stays a lower bound)."""
    head = cfg.vocab_size * cfg.hidden_size
    embed = 0 if cfg.tie_word_embeddings else 2 * head  # gathered by rows, not read whole
    kv_tok = 2 * cfg.num_hidden_layers * cfg.kv_size * 2
    read = step_weight_bytes(cfg, weight_bytes, ntok) - embed + 4 * cfg.vocab_size * nseq
    flops = 2 * (matmul_params(cfg) - head) * ntok + 2 * head * nseq
    return max(read / bandwidth, flops / peak), ctx * kv_tok / bandwidth


def bound_split_seconds(stats, cfg, weight_bytes, bandwidth, peak=MATMUL_PEAK) -> tuple[float, float]:
    """The split roofline (`split_step_seconds`) summed over a step log -> (all steps, decode steps)."""
    tot = dec = 0.0
    for ntok, nseq, ctx, _graph, _dt in stats["step_log"]:
        b = sum(split_step_seconds(cfg, weight_bytes, ntok, nseq, ctx, bandwidth, peak))
        tot += b
        dec += b if ntok == nseq else 0.0
    return tot, dec


def run_rlcu(llm, prompts, params, cfg, weight_bytes, bandwidth, name):
    sync()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sync()
    wall = time.perf_counter() - t
    st = llm.stats
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    bound, dec_bound, dec_t, pre_t = bound_seconds(st, cfg, weight_bytes, bandwidth)
    split, dec_split = bound_split_seconds(st, cfg, weight_bytes, bandwidth)
    r = {
        "case": name, "requests": len(prompts), "prompt_tokens": int(sum(map(len, prompts))),
        "output_tokens": n_out, "wall_s": wall, "tok_per_s": n_out / wall,
        "steps": st["steps"], "graph_steps": st["graph_steps"], "preemptions": st["preemptions"],
        "bound_s": bound, "bound_fraction": bound / wall,
        "bound_split_s": split, "bound_split_fraction": split / wall,
        "decode": {"time_s": dec_t, "bound_s": dec_bound, "bound_fraction": dec_bound / max(dec_t, 1e-9),
                   "bound_split_s": dec_split, "bound_split_fraction": dec_split / max(dec_t, 1e-9)},
        "prefill_time_s": pre_t,
        "prefill_steps_ms": [round(1e3 * dt, 1) for ntok, nseq, _c, _g, dt in st["step_log"] if ntok != nseq],
        "host_s": {k[2:]: st[k] for k in ("t_schedule", "t_launch", "t_wait", "t_postprocess")},
    }
    h = r["host_s"]
    print(f"rlcu {name:<22} {n_out:>8} tok {wall:7.2f} s {r['tok_per_s']:>9,.0f} tok/s   bound {bound:6.2f} s "
          f"({100 * r['bound_fraction']:.0f}%; decode {100 * r['decode']['bound_fraction']:.0f}%; split "
          f"{100 * r['bound_split_fraction']:.0f}%)   "
          f"steps {st['steps']} (graph {st['graph_steps']}), prefill {pre_t:.2f} s, decode {dec_t:.2f} s; "
          f"host: schedule {h['schedule']:.2f} launch {h['launch']:.2f} wait {h['wait']:.2f} "
          f"post {h['postprocess']:.2f} s", flush=True)
    print(f"     prefill/mixed steps (ms): {r['prefill_steps_ms'][:40]}", flush=True)
    return r


def run_hf(hf, B, prompt_len, new, V, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, prompt_len), generator=g).to(hf.device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.6, top_p=1.0, top_k=0,
              max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
    with torch.no_grad():
        hf.generate(ids[:2, :16], **{**kw, "attention_mask": torch.ones_like(ids[:2, :16]),
                                      "max_new_tokens": 4, "min_new_tokens": 4})
        sync()
        t = time.perf_counter()
        out = hf.generate(ids, **kw)
        sync()
    wall = time.perf_counter() - t
    n = (out.shape[1] - prompt_len) * B
    print(f"hf   B={B:<4} {prompt_len}/{new}          {n:>8} tok {wall:7.2f} s {n / wall:>9,.0f} tok/s", flush=True)
    return {"case": f"fixed B={B} prompt {prompt_len} new {new}", "requests": B, "output_tokens": n, "wall_s": wall,
            "tok_per_s": n / wall}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a short smoke run (2 layers, few requests)")
    p.add_argument("--no-hf", action="store_true", help="skip HF transformers generate")
    p.add_argument("--protocol-only", action="store_true", help="the protocol case alone (no fixed cases)")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--bandwidth", type=float, default=4.3e12, help="copy bandwidth ceiling, bytes/s")
    p.add_argument("--measure", action="store_true", help="measure the copy bandwidth ceiling in this run")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--sync-scheduling", action="store_true", help="no one-step lookahead")
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.6b", help="a published shape (bench/common.py SHAPES)")
    p.add_argument("--no-prefill-graphs", action="store_true", help="prefill and mixed steps eagerly")
    p.add_argument("--split-cap", action="store_true",
                   help="the decode attention's splits capped at 512 keys past the 1k context bucket")
    p.add_argument("--fused-linear", nargs="?", const="", default=None, metavar="TABLE",
                   help="decode projections through ops/decode_linear.py (tiles from a decode_linear.json)")
    p.add_argument("--pdl", action="store_true", help="with --fused-linear: programmatic dependent launch")
    p.add_argument("--split-kernel", action="store_true",
                   help="the decode attention's split kernel (the previous default)")
    args = p.parse_args(argv)
    from rlcu.ops import decode_linear as dl
    from rlcu.ops import paged_attention as pa

    if args.split_cap:
        pa.CONFIGS["splits"] = dict(pa.CONFIGS["splits"], max_part=512)
    if args.fused_linear is not None:
        from bench.decode_linear import load_table

        table = load_table(args.fused_linear) if args.fused_linear else dl.MEASURED
        dl.CONFIGS.update(enabled=True, pdl=args.pdl, table=table)
    if args.split_kernel:
        pa.CONFIGS["decode_plan"] = dict(pa.CONFIGS["decode_plan"], kernel="split")

    from rlcu.engine import LLM, SamplingParams

    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        print("bench/generate.py: needs a CUDA device (or --quick for a CPU smoke run)", file=sys.stderr)
        return 2
    dev = "cuda" if cuda else "cpu"
    ceil = measure_ceilings() if (args.measure and cuda) else {}
    bw = ceil["copy_GBps"] * 1e9 if ceil else args.bandwidth
    if args.quick:  # the shape cut to 2 layers; on the CPU a small one of its family (a MoE: 8 experts, top 2)
        moe = dict(family="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                   norm_topk_prob=True) if SHAPES[args.shape].get("family") == "qwen3_moe" else {}
        cfg = qwen3_06b_config(**dict(SHAPES[args.shape], num_hidden_layers=2)) if cuda else qwen3_06b_config(
            vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, bos_token_id=None, eos_token_id=None, **moe)
        n_req, lo, hi, fixed = min(args.requests, 32 if cuda else 8), 16, 128 if cuda else 48, [(8, 32, 32)]
    else:
        cfg = qwen3_06b_config(**SHAPES[args.shape])
        n_req, lo, hi, fixed = args.requests, 100, 1024, [(64, 128, 256), (256, 128, 256)]
    if args.protocol_only:
        fixed = []
    m = random_model(cfg, dev)
    weight_bytes = m.num_params() * 2
    llm = LLM(m, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
              async_scheduling=not args.sync_scheduling, num_kv_blocks=None if cuda else 4096,
              prefill_graphs=not args.no_prefill_graphs)
    print(f"model: {cfg.num_hidden_layers} layers, {m.num_params() / 1e6:.0f}M params; KV pool "
          f"{llm.runner.num_blocks} blocks x {llm.runner.block_size} tokens; max_model_len {llm.max_model_len}",
          flush=True)

    # warm-up: compile the kernels, capture the decode graphs (outside the timings)
    t = time.perf_counter()
    rng = np.random.default_rng(0)
    # enough prompts that prefill runs full token-budget steps and mixed prefill+decode steps,
    # so every kernel variant the timed runs use is compiled here
    n_warm = 8 if args.quick else 64
    warm = random_prompts(rng, cfg.vocab_size, rng.integers(lo, hi + 1, n_warm))
    llm.generate([{"prompt_token_ids": w} for w in warm], SamplingParams(temperature=0.6, max_tokens=8,
                                                                         ignore_eos=True), use_tqdm=False)
    graphs = llm.capture_graphs(2 * hi + 16)
    sync()
    print(f"warm-up {time.perf_counter() - t:.1f} s ({graphs} CUDA graphs)", flush=True)

    results = {"config": {"layers": cfg.num_hidden_layers, "family": cfg.family, "params": m.num_params(),
                          "bandwidth_Bps": bw,
                          "matmul_peak_flops": MATMUL_PEAK, "max_num_seqs": args.max_num_seqs,
                          "max_num_batched_tokens": args.max_num_batched_tokens,
                          "kv_blocks": llm.runner.num_blocks, "block_size": llm.runner.block_size,
                          "cuda_graphs": llm.runner.use_graphs, "async_scheduling": llm.async_scheduling,
                          "prefill_graphs": sorted(llm.runner.prefill_graphs.graphs), "shape": args.shape,
                          "decode_kernel": pa.CONFIGS["decode_plan"]["kernel"],
                          "decode_splits": dict(pa.CONFIGS["splits"]),
                          "decode_linear": {"enabled": dl.CONFIGS["enabled"], "pdl": dl.CONFIGS["pdl"],
                                            "table": args.fused_linear or None},
                          "quick": args.quick}, "ceilings": ceil, "rlcu": [], "hf": []}
    rng = np.random.default_rng(1234)
    plens = rng.integers(lo, hi + 1, n_req)
    olens = rng.integers(lo, hi + 1, n_req)
    prompts = random_prompts(rng, cfg.vocab_size, plens)
    params = [SamplingParams(temperature=0.6, max_tokens=int(o), ignore_eos=True, seed=i) for i, o in enumerate(olens)]
    results["rlcu"].append(run_rlcu(llm, prompts, params, cfg, weight_bytes, bw,
                                    f"protocol {n_req} x [{lo},{hi}]"))
    for B, pl, new in fixed:
        prompts = random_prompts(rng, cfg.vocab_size, [pl] * B)
        sp = SamplingParams(temperature=0.6, max_tokens=new, ignore_eos=True, seed=7)
        results["rlcu"].append(run_rlcu(llm, prompts, sp, cfg, weight_bytes, bw, f"fixed B={B} {pl}/{new}"))

    if not args.no_hf:
        llm.sleep()  # give the KV pool back for HF's cache
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        hf = hf_twin(m)
        for B, pl, new in fixed:
            results["hf"].append(run_hf(hf, B, pl, new, cfg.vocab_size, seed=B))
        del hf
        for r, h in zip(results["rlcu"][1:], results["hf"]):
            r["speedup_vs_hf"] = r["tok_per_s"] / h["tok_per_s"]
            print(f"{r['case']}: rlcu / hf = {r['speedup_vs_hf']:.2f}x", flush=True)
    name = ("generate_quick" if args.quick else "generate") + ("" if args.shape == "0.6b" else "_" + args.shape)
    name += ("_eager_prefill" if args.no_prefill_graphs else "") + ("_split_cap" if args.split_cap else "")
    name += ("_fused_linear" + ("_pdl" if args.pdl else "")) if args.fused_linear is not None else ""
    name += "_split_kernel" if args.split_kernel else ""
    name += "_protocol" if args.protocol_only else ""
    path = write_json(name + ".json", results)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
