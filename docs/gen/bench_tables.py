"""The benchmark tables of the documentation, rendered at build time from bench/results/*.json.

A figure on the page is read from the JSON file its benchmark wrote, never typed in, and shows
the tree and device it was measured on, so the page says what the files say. Which files are
the current ones is chosen here (a newer run replaces a file, or this list names the new
file); the history of what was tried lives in bench/results and the git log.

A file that names no tree (`meta.commit`) is shown with the commit that added it, from git
when the build runs in a clone, and "not recorded" otherwise.
"""

from __future__ import annotations

import tables_models
import tables_rlhf
from results import RESULTS, _k, _pct, _table, device, load, source

__all__ = ["RESULTS", "IMAGES", "TABLES", "render"]


# ---------------------------------------------------------------- generation
def _case(data: dict, prefix: str) -> dict:
    return next(r for r in data["rlcu"] if r["case"].startswith(prefix))


def generation() -> str:
    rows = []
    for name, shape in (("generate.json", "Qwen3-0.6B"), ("generate_8b.json", "Qwen3-8B")):
        d = load(name)
        r = _case(d, "protocol")
        rows.append([f"{shape}, 256 x [100, 1024]", f"{_k(r['tok_per_s'])} tok/s", _pct(r["bound_fraction"]),
                     _pct(r["decode"]["bound_fraction"]), f"{r['prefill_time_s']:.2f} s", source(name, d)])
        for b in (64, 256):
            r = _case(d, f"fixed B={b}")
            rows.append([f"{shape}, B={b}, prompt 128 / new 256", f"{_k(r['tok_per_s'])} tok/s",
                         _pct(r["bound_fraction"]), "", "", source(name, d)])
    return _table(["case", "output tokens/s", "of the bandwidth bound", "decode steps, of their bound",
                   "prefill", "file, tree, device"], rows)


def generation_peers() -> str:
    d = load("generate_split_cap.json")
    rows = [[f"HF transformers `generate`, {r['case'].removeprefix('fixed ')}", f"{_k(r['tok_per_s'])} tok/s",
             source("generate_split_cap.json", d)] for r in d["hf"]]
    return _table(["peer", "output tokens/s", "file, tree, device"], rows)


def cold_start() -> str:
    d = load("cold_start.json")
    what = {"fresh": "empty Triton cache", "cached": "Triton's disk cache warm", "off": "no warm-up"}
    rows = [[what.get(c["case"], c["case"]), f"{c['engine_start_s']:.1f} s", f"{c['first_over_warm']:.2f}x"]
            for c in d["cases"]]
    return _table(["first process", "engine start", "first generate / a warm one"], rows) + \
        f"\n\nSource: {source('cold_start.json', d)}."


# ---------------------------------------------------------------- training
def _train_row(label: str, r: dict, name: str, d: dict) -> list[str]:
    return [label, f"{r['ms']:.0f} ms", f"{_k(r['tok_s'])}", _pct(r["mfu"]), f"{r['peak_GiB']:.1f} GiB",
            source(name, d) if "measured_at" not in r else f"`{name}`, {r['measured_at']}, {device(d)}"]


def training() -> str:
    rows = []
    d = load("train_step.json")
    rows.append(_train_row("0.6B, 32 x 1024, checkpointing auto", d["rlcu_auto"], "train_step.json", d))
    rows.append(_train_row("0.6B, same, checkpointing that keeps attention outputs", d["rlcu_fast"],
                           "train_step.json", d))
    rows.append(_train_row("0.6B, HF transformers + PyTorch, no checkpointing", d["hf"], "train_step.json", d))
    d = load("train_step_4b.json")
    rows.append(_train_row("4B, 8 x 2048, bf16 memory mode, checkpointing auto", d["rlcu_auto"],
                           "train_step_4b.json", d))
    rows.append(_train_row("4B, HF transformers + PyTorch, gradient checkpointing", d["hf_ckpt"],
                           "train_step_4b.json", d))
    d = load("train_step_8b.json")
    rows.append(_train_row("8B, 8 x 2048, bf16 memory mode, checkpointing auto", d["rlcu_auto"],
                           "train_step_8b.json", d))
    rows.append(_train_row("8B, same, full checkpointing", d["rlcu"], "train_step_8b.json", d))
    return _table(["case", "step", "tokens/s", "MFU", "peak memory", "file, tree, device"], rows)


def train_graph() -> str:
    d = load("train_graph.json")
    rows = [[case.replace("critic:", "PPO critic, ").replace("x", " x "), f"{c['eager']['ms']:.1f} ms",
             f"{c['graph']['ms']:.1f} ms", f"{c['speedup_graph_vs_eager']:.2f}x"] for case, c in d["cases"].items()]
    return _table(["micro-batch (sequences x tokens)", "eager step", "CUDA-graph step", "speed-up"], rows) + \
        f"\n\nSource: {source('train_graph.json', d)}."


# ---------------------------------------------------------------- GRPO
def grpo() -> str:
    d = load("grpo.json")
    rows = []
    for proto in ("A", "B"):
        p = d[proto]
        for key, label in (("rlcu", "rlcu, default precision"), ("rlcu_bf16", "rlcu, bf16 memory mode"),
                           ("trl", f"TRL {p['trl'].get('trl', '')} GRPOTrainer")):
            r = p[key]
            ratio = "" if key == "trl" else f"{p['trl']['s_per_step'] / r['s_per_step']:.1f}x faster"
            rows.append([f"{proto}: completions of {d['protocol'][proto]['completion_len']}", label,
                         f"{r['s_per_step']:.2f} s", f"{r['peak_GiB']:.1f} GiB", ratio])
    meta_b = d.get("meta_B", {}).get("commit")
    return _table(["protocol", "who", "step", "peak memory", "against TRL"], rows) + \
        f"\n\nSource: {source('grpo.json', d)}" + (f" (protocol B's rlcu rows: `{meta_b}`)." if meta_b else ".")


def grpo_8b() -> str:
    rows = []
    for name, label in (("dp_8b_1gpu_ckpt-auto.json", "checkpointing auto"), ("dp_8b_1gpu.json", "full checkpointing")):
        d = load(name)
        g = d["n1"]["grpo_step"]
        rows.append([label, f"{g['s_per_step']:.2f} s", f"{g['phases_s']['generate']:.2f} s",
                     f"{g['phases_s']['train']:.2f} s", f"{g['peak_GiB_per_rank']:.1f} GiB", source(name, d)])
    return _table(["Qwen3-8B, 32 x 8, 128 + 256, bf16 memory mode", "step", "generate", "train", "peak memory",
                   "file, tree, device"], rows)


# ---------------------------------------------------------------- exact mode and the mismatch
def exact() -> str:
    g = load("exact_gpu.json")
    rows = [[mode, f"{r['tokens']:,}", _pct(r["exact_frac"]), f"{r['abs_mean']:.3f}", f"{r['abs_max']:.2f}",
             f"{r['ratio_p01']:.2f} - {r['ratio_p99']:.2f}"] for mode, r in (("default", g["default"]),
                                                                          ("exact", g["exact"]))]
    out = _table(["mode", "sampled tokens", "bit-equal", "mean abs diff", "max abs diff", "ratio p01 - p99"], rows)
    out += f"\n\nSource: {source('exact_gpu.json', g)}.\n\n"
    d = load("exact.json")
    meta = d["meta"]
    rows = []
    cases = (("generate", "generation protocol (tokens/s)"), ("train_step", "training step 32 x 1024 (tokens/s)"),
             ("grpo", "GRPO protocol A (s a step)"))
    for key, label in cases:
        r = d[key]["ratio"]
        rows.append([label, f"{r['exact_over_default']:.2f}x", r["target"], "met" if r["met"] else "missed",
                     f"`{meta.get(key + '_commit', '?')}`"])
    return out + _table(["exact mode against the default, same call", "ratio", "target", "", "tree"], rows) + \
        f"\n\nSource: `exact.json`, {device(d)}."


def mismatch() -> str:
    d = load("mismatch.json")
    rows = []
    for mode in ("engine/none", "recompute/none", "recompute/tis", "recompute/mis_token", "recompute/mis_seq"):
        steps = d["modes"][mode]
        first = steps[-1]
        rej = first.get("correction/rejected_frac")
        rows.append([f"`old_logprobs: {mode.split('/')[0]}`, correction `{mode.split('/')[1]}`",
                     f"{first['mismatch/abs_mean']:.3f}", f"{first['mismatch/kl_k3']:.4f}",
                     f"{first['mismatch/ratio_p01']:.2f} - {first['mismatch/ratio_p99']:.2f}",
                     _pct(first["clip_frac"]), _pct(rej) if rej is not None else "",
                     f"{d['modes'][mode + '_median_step_s']:.2f} s"])
    return _table(["mode", "mean abs diff", "kl_k3", "rho p01 - p99", "clipped", "rejected", "median step"],
                  rows) + f"\n\nSource: {source('mismatch.json', d)} (the last of {len(steps)} steps of each mode)."


def learning() -> str:
    d = load("learning.json")
    rows = []
    for task, modes in d["summary"].items():
        if not isinstance(modes, dict):  # the summary's legend
            continue
        for mode, r in modes.items():
            if not isinstance(r, dict):
                continue
            fr, acc = r["final_reward"], r["accuracy_after"]
            rows.append([task, mode, f"{fr[0]:.3f} ± {fr[1]:.3f}", f"{acc[0]:.3f} ± {acc[1]:.3f}", str(r["seeds"])])
    return _table(["task", "mode", "final reward", "held-out accuracy after", "seeds"], rows) + \
        f"\n\nSource: {source('learning.json', d)}; {d['steps']} GRPO steps."


# ---------------------------------------------------------------- scheduler
SCHED_RUNS = (
    ("sched_1gpu_warm_ckpt_h1024p32_steps36.json", "4 jobs, 1 GPU, warm workers, jobs from one checkpoint"),
    ("sched_1gpu_warm_ckpt_h1024p32_steps36_rep2.json", "same, second run"),
    ("sched_2gpu_warm_ckpt_jobs8_h1024p32_steps36.json", "8 jobs, 2 GPUs, warm workers, one checkpoint"),
    ("sched_1gpu_h1024p32_steps36.json", "4 jobs, 1 GPU, a fresh process per job"),
    ("sched_2gpu_jobs8_h1024p32_steps36.json", "8 jobs, 2 GPUs, a fresh process per job"),
)


def scheduler() -> str:
    rows = []
    for name, label in SCHED_RUNS:
        d = load(name)
        s = d["summary"]["procs"]
        rows.append([label, f"{s['jobs_per_hour_ratio']:.2f}x", _pct(s["idle_phase"]), _pct(s["idle_phase_steady"]),
                     _pct(s["idle_fifo"]), source(name, d)])
    return _table(["jobs (hidden 1024, 8 layers, 32 x 8 samples, 36 steps)", "jobs/hour against FIFO",
                   "GPU idle, phase-aware", "idle in steady state", "GPU idle, FIFO", "file, tree, device"], rows)


def sched_service() -> str:
    rows = []
    for name, label in (("sched_service.json", "persistent connections (the default)"),
                        ("sched_service_per_call.json", "a connection per call")):
        d = load(name)
        p = d["polled"]
        rows.append([label, f"{p['cycles_per_s']:,.0f}", f"{p['acquire_p50_ms']:.1f} / {p['acquire_p99_ms']:.1f} ms",
                     f"{d['status_idle_p99_ms']:.1f} ms", f"{p['status_p99_ms']:.1f} ms",
                     f"{p['service_cpu_us_per_cycle']:.0f} us", f"{d['loadavg_1m']:.1f}", source(name, d)])
    return _table(["client connections", "cycles/s", "acquire p50 / p99", "status p99 idle", "status p99 under load",
                   "service CPU a cycle", "load average", "file, tree, host"], rows)


# ---------------------------------------------------------------- kernels
def kernels() -> str:
    d = load("kernels.json")
    rows = []
    for r in d["results"]:
        peer = r.get("ms_sdpa") or r.get("ms_peer") or r.get("ms_eager") or r.get("ms_torch")
        frac = r.get("frac_copy_bw") or r.get("frac") or r.get("frac_matmul_peak")
        rows.append([r["name"], f"{r['ms']:.3f}", f"{peer:.3f}" if peer else "",
                     f"{peer / r['ms']:.2f}x" if peer else "", _pct(frac) if frac else ""])
    c = d["ceilings"]
    return _table(["kernel", "ms", "peer ms", "peer / ours", "of the ceiling"], rows) + \
        (f"\n\nCeilings measured in the same run: copy {c['copy_GBps'] / 1000:.2f} TB/s, bf16 matmul "
         f"{c['bf16_matmul_TFLOPs']:.0f} TFLOP/s. Peers: SDPA for attention, eager PyTorch for the element-wise ops "
         f"and the head, torch's fused AdamW. Source: {source('kernels.json', d)}.")


TABLES = {
    "generation": generation, "generation-peers": generation_peers, "cold-start": cold_start,
    "training": training, "train-graph": train_graph, "grpo": grpo, "grpo-8b": grpo_8b, "exact": exact,
    "mismatch": mismatch, "learning": learning, "scheduler": scheduler, "sched-service": sched_service,
    "kernels": kernels, **tables_models.TABLES, **tables_rlhf.TABLES,
}

# the figures the page shows beside the tables (copied into the site by the build)
IMAGES = ("learning.png", "sched_timeline_1gpu_warm_ckpt_h1024p32_steps36.png")


def render(name: str) -> str:
    """The Markdown of one table, by its name in TABLES."""
    if name not in TABLES:
        raise KeyError(f"no benchmark table {name!r} (known: {', '.join(TABLES)})")
    return TABLES[name]()
