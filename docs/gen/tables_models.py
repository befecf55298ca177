"""The benchmark tables of the model families, Qwen3-MoE, LoRA and multi-turn episodes (rendered
at build time from bench/results, as bench_tables' others)."""

from __future__ import annotations

from results import _k, _pct, _table, device, load, source


# ---------------------------------------------------------------- the model families
def families() -> str:
    d = load("families.json")
    names = {"8b": "Qwen3-8B", "llama3.1-8b": "Llama-3.1-8B", "qwen2.5-7b": "Qwen2.5-7B"}
    rows, trees = [], set()
    for shape, row in d["shapes"].items():
        t, g, e = row["train"], row["generate"], row["exact"]["exact"]
        trees |= {f"`{p['meta']['commit']}`" for p in (t, g, row["exact"])}
        pct = "{:.1%}".format  # one decimal: these are read against the 50% and 75% targets
        rows.append([names.get(shape, shape), f"{t['ms']:.0f} ms", pct(t["mfu"]), f"{t['peak_GiB']:.0f} GiB",
                     f"{_k(g['tok_per_s'])} tok/s", pct(g["bound_fraction"]), pct(g["decode_bound_fraction"]),
                     f"{_pct(e['exact_frac'])} of {e['tokens']:,}"])
    return _table(["shape (random bf16 weights)", "train step 8 x 2048", "MFU", "peak", "generation protocol",
                   "of bound", "decode of bound", "exact mode bit-equal"], rows) + (
        f"\n\nTraining: the bf16 memory mode, checkpointing auto, fused head; MFU against 989 TFLOP/s. "
        f"Generation: 256 requests, prompt and output uniform in [100, 1024]; the bound reads every weight once "
        f"a step plus the running sequences' KV at 4.3 TB/s, or the prefill's FLOPs. Exact mode: 32 prompts x 8 "
        f"samples x 128 tokens, the engine's logprobs against the trainer's forward. `bench/families.py` runs "
        f"a part at every shape in one call, each in its own process; each part names its tree in the file; "
        f"source: `families.json`, trees {', '.join(sorted(trees))}, {device(d)}.") + _qwen3_ab()


def _qwen3_ab() -> str:
    d = load("qwen3_8b_ab.json")
    o, n = d["old"], d["new"]
    return (f"\n\nQwen3 before and after the one layer path, the generation protocol at the Qwen3-8B shape in "
            f"one call: {_k(o['tok_per_s'])} tok/s at `{o['tree']}`, {_k(n['tok_per_s'])} tok/s at `{n['tree']}` "
            f"({n['tok_per_s'] / o['tok_per_s'] - 1:+.1%}; {_pct(o['bound_fraction'])} and "
            f"{_pct(n['bound_fraction'])} of the bound). Source: {source('qwen3_8b_ab.json', d)}.")


# ---------------------------------------------------------------- LoRA and episodes
def lora() -> str:
    d = load("lora_grpo_8b_r64.json")
    rows = [[f"LoRA r = {d['lora_r']}, all linear" if side == "lora" else "full fine-tuning, bf16 memory mode",
             f"{d[side]['s_per_step']:.2f} s", f"{d[side]['phases_s']['generate']:.2f} s",
             f"{d[side]['phases_s']['train']:.2f} s", f"{d[side]['peak_GiB']:.1f} GiB", _ckpt(d[side])]
            for side in ("lora", "full")]
    out = _table(["Qwen3-8B shape, 32 x 8, 128 + 256", "step", "generate", "train", "peak memory",
                  "checkpointing (auto), micro-batch"], rows)
    out += (f"\n\nLoRA's step is {d['step_ratio_lora_vs_full']:.2f}x full fine-tuning's (target 0.8x); its peak "
            f"{'is' if d['lora']['peak_GiB'] <= 40 else 'is not'} under the 40 GiB target. Source: "
            f"{source('lora_grpo_8b_r64.json', d)}.\n\n")
    g = load("generate_lora_0.6b_n8_r64.json")
    rows = [[c["case"], f"{_k(c['tok_per_s'])} tok/s", _pct(c["overhead_vs_no_lora"]) if "overhead_vs_no_lora" in c
             else ""] for c in g["cases"]]
    return out + _table(["generation protocol, Qwen3-0.6B shape, adapters r = 64", "throughput",
                         "overhead against an engine without adapters"], rows) + \
        (f"\n\nThe first three rows are an engine serving adapter slots (the plain schedule, the grouped "
         f"kernels; 'no adapters': requests on the base); measured before a step's rows were ordered by "
         f"adapter (`261bd17`), which the kernel bench puts at 385 -> 138 us a layer for 8 interleaved adapters "
         f"at 8B. Source: {source('generate_lora_0.6b_n8_r64.json', g)}.")


def _ckpt(r: dict) -> str:
    g = r.get("gradient_checkpointing") or {}
    cap = f", allocator capped at {r['budget_GiB']:.0f} GiB" if r.get("budget_GiB") else ""
    return f"{g.get('ran', 'all')} layers, {r['micro_batch_tokens']:,} tokens{cap}"


def episodes() -> str:
    d = load("episodes.json")
    c, e, s = d["config"], d["episodes"], d["single_turn"]
    rows = [[f"{c['episodes']} episodes x {c['turns']} turns of {c['turn_tokens']} tokens, "
             f"{c['tool_tokens']}-token tool results after {1000 * c['tool_sleep']:.0f} ms",
             f"{_k(e['tok_per_s'])} tok/s"],
            [f"{s['requests']} single-turn completions of the same {s['model_tokens']:,} tokens",
             f"{_k(s['tok_per_s'])} tok/s"]]
    return _table(["Qwen3-0.6B shape, model tokens", "throughput"], rows) + \
        f"\n\nEpisodes at {d['ratio']:.2f}x single-turn (target 0.8x). Source: {source('episodes.json', d)}." + \
        "\n\n" + _grpo_tools()


def _grpo_tools() -> str:
    d = load("grpo_tools.json")
    sh = d["shape"]
    rows = []
    for side, label in (("rlcu", "rlcu"), ("trl", "TRL GRPOTrainer(tools=)")):
        r = d.get(side, {})
        if r.get("s_per_step"):
            rows.append([label, f"{r['s_per_step']:.2f} s", f"{_k(r['model_tokens_per_s'])} tok/s"
                         if "model_tokens_per_s" in r else "", f"{r['peak_GiB']:.1f} GiB" if "peak_GiB" in r else ""])
        else:
            rows.append([label, f"not measured: {str(r.get('error', 'no result'))[:80]}", "", ""])
    head = (f"multi-turn GRPO, Qwen3-0.6B shape, {sh['prompts']} x {sh['group']}, {sh['turns']} turns of "
            f"{sh['turn_tokens']} tokens, {sh['tool_tokens']}-token tool results")
    return _table([head, "step", "model tokens", "peak memory"], rows) + \
        f"\n\nSource: {source('grpo_tools.json', d)}."


# ---------------------------------------------------------------- Qwen3-MoE
def moe() -> str:
    g = load("generate_qwen3-30b-a3b_protocol.json")
    gp = next(r for r in g["rlcu"] if r["case"].startswith("protocol"))
    t = load("train_step_qwen3-30b-a3b-cut_auto.json")
    tr = t["rlcu_auto"]
    lo, ex = load("lora_grpo_qwen3-30b-a3b_r64.json"), load("lora_grpo_qwen3-30b-a3b_r64_exact.json")
    rows = [["generation protocol 256 x [100, 1024]", f"{_k(gp['tok_per_s'])} tok/s",
             f"{_pct(gp['bound_fraction'])} of the bound (decode {_pct(gp['decode']['bound_fraction'])})", ">= 60%",
             source("generate_qwen3-30b-a3b_protocol.json", g)],
            [f"training step, cut to 10 layers, 32 x 1024, checkpointing auto ({tr['gradient_checkpointing']} "
             f"layers)", f"{tr['ms']:.0f} ms", f"{_pct(tr['mfu'])} MFU on active parameters", ">= 35%",
             source("train_step_qwen3-30b-a3b-cut_auto.json", t)]]
    for d, name, label in ((lo, "lora_grpo_qwen3-30b-a3b_r64.json", "default mode"),
                           (ex, "lora_grpo_qwen3-30b-a3b_r64_exact.json", "exact mode")):
        r = d["lora"]
        m = r.get("moe", {})
        rows.append([f"LoRA GRPO r = {d['lora_r']} (attention), 32 x 8, 128 + 256, {label}",
                     f"{r['s_per_step']:.2f} s a step, peak {r['peak_GiB']:.0f} GiB",
                     f"routes differing: {_pct(m.get('moe/route_mismatch', float('nan')))} of a layer's rows, "
                     f"{_pct(m.get('moe/route_mismatch_any', float('nan')))} of rows in some layer",
                     "0 in exact mode" if label == "exact mode" else "", source(name, d)])
    k = load("moe_kernel_after.json")  # the current kernels (moe_kernel.json: before the dW grid change)
    tk = k["train"][0]
    dec = {r["T"]: r for r in k.get("decode", [])}
    rows.append([f"expert GEMMs, training T = {tk['T']}", f"forward {tk['fwd_us'] / 1000:.2f} ms, backward "
                 f"{tk['bwd_us'] / 1000:.2f} ms", f"{_pct(tk['fwd_mfu'])} / {_pct(tk['bwd_mfu'])} MFU", "",
                 source("moe_kernel_after.json", k)])
    Ts = [T for T in (1, 16, 256) if T in dec]
    if Ts:
        rows.append([f"expert GEMMs, decode T = {' / '.join(map(str, Ts))}",
                     " / ".join(f"{dec[T]['rlcu_us']:.0f} us" for T in Ts),
                     " / ".join(_pct(dec[T]["bound_us"] / dec[T]["rlcu_us"]) for T in Ts) + " of the bound", "",
                     source("moe_kernel_after.json", k)])
    for name in ("kernel_tune.json", "kernel_tune_dw_32k.json"):  # the tile sweeps whose winners the tables hold
        d = load(name)
        for c in d["cases"]:
            if c["case"].startswith("moe"):
                rows.append([f"expert GEMM tile sweep, {c['case'][4:]}: the current tiles -> the best",
                             f"{c['current']['us'] / 1000:.2f} -> {c['best']['us'] / 1000:.2f} ms",
                             f"x{c['speedup']:.2f}", "", source(name, d)])
    return _table(["Qwen3-30B-A3B shape, random bf16 weights", "figure", "against its bound", "target",
                   "file, tree, device"], rows)


TABLES = {"families": families, "lora": lora, "episodes": episodes, "moe": moe}
