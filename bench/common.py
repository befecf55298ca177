"""Shared benchmark plumbing: the machine's two ceilings, run metadata, JSON output."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def meta() -> dict:
    import triton

    commit = os.environ.get("RLCU_COMMIT")  # first: a copied tree's .git may be stale or absent
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                                             stderr=subprocess.DEVNULL).decode().strip()
        except Exception:
            commit = "unknown"
    return {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def measure_ceilings() -> dict:
    """Copy bandwidth (bytes read + written, 4 GiB buffer) and the bf16 matmul rate (8192^3),
    median of repeated CUDA-event timings after warm-up."""
    from triton.testing import do_bench

    n = 1 << 30  # 1 Gi fp32 elements = 4 GiB
    a = torch.empty(n, device="cuda", dtype=torch.float32).uniform_()
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    copy = 2 * a.numel() * 4 / (ms * 1e-3) / 1e9
    a = b = None
    M = 8192
    x = torch.randn(M, M, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(M, M, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: x @ y, warmup=50, rep=300, return_mode="median")
    mm = 2 * M**3 / (ms * 1e-3) / 1e12
    x = y = None
    torch.cuda.empty_cache()
    return {"copy_GBps": copy, "bf16_matmul_TFLOPs": mm}


def event_ms(fn, reps: int, warm: int = 0) -> list[float]:
    """The device time of each of `reps` calls of fn, in ms (CUDA events around each call, the
    device idle before it), after `warm` untimed calls."""
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return ts


def replay_ms(fn, reps: int, warm: int = 0) -> float:
    """The median of `event_ms` (the upper middle one for an even reps)."""
    return sorted(event_ms(fn, reps, warm))[reps // 2]


def capture(fn):
    """fn captured in a CUDA graph, after one eager run on a side stream (its kernels' compiles,
    cuBLAS's workspace) -> (graph, fn's output in the graph's memory)."""
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


def graph_ms(fns, inner: int = 12, reps: int = 7, warm: int = 0) -> float:
    """Median ms of one call, from replays of a CUDA graph (`capture`) of `inner` back-to-back
    calls cycling through fns (no launch gaps between them; fns over different operands: no L2
    reuse)."""
    seq = [fns[i % len(fns)] for i in range(inner)]
    graph, _ = capture(lambda: [f() for f in seq])
    graph.replay()
    torch.cuda.synchronize()
    return replay_ms(graph.replay, reps, warm) / inner


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| (2-norms, in fp32): how far a result is from its reference."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def write_json(name: str, payload: dict) -> Path:
    """Write to $OUT (on the device machine) and bench/results/."""
    payload = {"meta": meta(), **payload}
    text = json.dumps(payload, indent=2, default=float)
    out = os.environ.get("OUT")
    if out:
        Path(out, name).write_text(text)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / name
    path.write_text(text)
    return path


SHAPES = {  # published shapes, by name: Qwen3's (0.6B: Qwen3Config's defaults), and the other families' 7-8B
    "0.6b": {},
    "4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=9728, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=12288, tie_word_embeddings=False),
    "llama3.1-8b": dict(family="llama", vocab_size=128256, hidden_size=4096, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                        rope=dict(type="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=8192),
                        max_position_embeddings=131072, tie_word_embeddings=False,
                        bos_token_id=128000, eos_token_id=128001),
    "qwen2.5-7b": dict(family="qwen2", vocab_size=152064, hidden_size=3584, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, head_dim=128, intermediate_size=18944,
                       rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=False,
                       bos_token_id=151643, eos_token_id=151643),
    # Qwen3-30B-A3B (its published config.json): 128 experts of 768, top 8 renormalised, every layer sparse
    "qwen3-30b-a3b": dict(family="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False),
}
# cut to the layers whose full fine-tuning fits one H200 (train_step.py's 32 x 1024 tokens, full checkpointing, fused
# head, fp32 master and moments): 10 by the memory model (tests/unit/test_bench_shapes.py), 11 do not
SHAPES["qwen3-30b-a3b-cut"] = dict(SHAPES["qwen3-30b-a3b"], num_hidden_layers=10)


def shape_name(shape: str) -> str:
    """A SHAPES key as the published model's name: '8b' -> 'Qwen3-8B', 'llama3.1-8b' -> 'Llama-3.1-8B'."""
    if shape in ("0.6b", "4b", "8b"):
        return f"Qwen3-{shape.upper()}"
    if shape.startswith("qwen3-"):  # 'qwen3-30b-a3b-cut' -> 'Qwen3-30B-A3B (cut)'
        cut = shape.endswith("-cut")
        return f"Qwen3-{shape[6:len(shape) - 4 * cut].upper()}" + (f" (cut to {SHAPES[shape]['num_hidden_layers']} "
                                                                    "layers)" if cut else "")
    fam, size = shape.rsplit("-", 1)
    named = {"llama": "Llama-", "qwen": "Qwen"}
    for k, v in named.items():
        if fam.startswith(k):
            return f"{v}{fam[len(k):]}-{size.upper()}"
    return shape


def matmul_params(cfg) -> int:
    """The matmul weights one token goes through (its FLOPs are twice this): every layer's
    attention projections; a dense layer's gate, up and down; a sparse layer's router and the k
    experts the token is routed to, of its E (the active parameters of a MoE); the LM head."""
    H = cfg.hidden_size
    attn = H * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * H
    sparse = len(cfg.sparse_layers) if cfg.fam.moe else 0
    dense_mlp = 3 * cfg.intermediate_size * H
    moe_mlp = H * cfg.num_experts + cfg.num_experts_per_tok * 3 * cfg.moe_intermediate_size * H if sparse else 0
    return cfg.num_hidden_layers * attn + (cfg.num_hidden_layers - sparse) * dense_mlp + sparse * moe_mlp \
        + cfg.vocab_size * H


def expected_experts(E: int, k: int, T: int) -> float:
    """The expected number of distinct experts T tokens route to when each picks k of E uniformly
    at random: E (1 - (1 - k/E)^T) (each expert is missed by a token with probability 1 - k/E)."""
    return E * (1.0 - (1.0 - k / E) ** T)


# the optimizer's precisions: default (fp32 master, m, v and gradients) and the bf16 memory mode
MEMORY_MODES = {"default": dict(master_weights=True, state_dtype="float32"),
                "bf16": dict(master_weights=False, state_dtype="bfloat16", grad_dtype="bfloat16")}


def random_prompts(rng, vocab_size: int, lens) -> list[list[int]]:
    """One prompt of uniform random token ids per length in `lens`, drawn from the numpy
    Generator `rng` in order (so a bench's prompts depend only on its seed and lengths)."""
    return [rng.integers(0, vocab_size, int(n)).tolist() for n in lens]


def qwen3_06b_config(**kw):
    """The published Qwen3-0.6B shape (rlcu.Qwen3Config's defaults)."""
    from rlcu.model.config import Qwen3Config

    return Qwen3Config(**kw)


def hf_model(cfg, attn: str = "sdpa"):
    """An HF model of cfg's family (transformers' class for its architectures), random weights,
    on the current default device: the peer the benches run beside rlcu's."""
    import transformers

    d = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "torch_dtype")}
    hcfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    hcfg._attn_implementation = attn
    return getattr(transformers, cfg.fam.architecture)(hcfg)


def scale_to_entropy(model, target: float, seed: int = 0, tokens: int = 4096) -> tuple[float, float]:
    """Scale a random model's final norm (bisection on a log scale: the entropy falls as the
    scale grows) until the mean entropy of its next-token distribution over seeded random
    token streams is about `target` nats, as in a trained model (random weights give a nearly
    uniform distribution). Returns (scale, entropy)."""
    g = torch.Generator(device=model.device).manual_seed(seed)
    toks = torch.randint(1, model.cfg.vocab_size, (tokens,), device=model.device, generator=g)
    cu = torch.arange(0, tokens + 1, 1024, dtype=torch.int32, device=model.device)
    w0 = model.w["final_norm"].clone()
    lo, hi = 1.0, 512.0
    for _ in range(12):
        s = (lo * hi) ** 0.5
        model.w["final_norm"].copy_(w0 * s)
        _, ent = model.forward(toks, cu, grad=False, return_entropy=True)
        e = float(ent.mean())
        lo, hi = (s, hi) if e > target else (lo, s)
    return s, e


@contextlib.contextmanager
def overriding(configs: dict, **updates):
    """configs (an op's CONFIGS, say) with `updates` inside the block, its own values after it.
    A CUDA graph captured inside keeps the kernels the updated configs launched."""
    saved = {k: configs[k] for k in updates if k in configs}
    configs.update(updates)
    try:
        yield configs
    finally:
        for k in updates:
            if k in saved:
                configs[k] = saved[k]
            else:
                del configs[k]


def sync() -> None:
    """Wait for the GPU (nothing on the CPU): a step's wall time must hold its kernels."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def trl_step_timer(times: list[float], warmup: int, cuda: bool, logged: list[dict] | None = None):
    """A transformers TrainerCallback that appends each step's seconds after `warmup` steps to
    `times` (the peak memory counter reset as the first timed step begins) and, given `logged`,
    each log line the trainer writes to it: how the benches time a TRL trainer's own loop."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            sync()
            self.t0 = time.perf_counter()
            if state.global_step == warmup and cuda:
                torch.cuda.reset_peak_memory_stats()

        def on_step_end(self, a, state, control, **kw):
            sync()
            if state.global_step > warmup:
                times.append(time.perf_counter() - self.t0)

        def on_log(self, a, state, control, logs=None, **kw):
            if logged is not None:
                logged.append(dict(logs or {}))

    return StepTimer()
