"""What one rank holds at its peak, by part, from the model's shape and the run's precisions:
printed at the start of a run across ranks and checked in tests against the measured one-GPU
peaks (BENCHMARKS.md section 6) and the 8-GPU targets (Qwen3-14B in the default precision,
Qwen3-32B in the bf16 memory mode, on 8 H200s).

Per rank, with P parameters (the flat layout's numel, padding included), N ranks:
    weights          P x weight bytes (every rank keeps the full bf16 weights; the engine reads them)
    reference        the same again when a KL term keeps a frozen reference
    optimizer        (4 if an fp32 master + 2 x state bytes) x P / N
    gradient shard   grad bytes x P / N  (one process: the full P-element gradient buffer)
    gradient buckets the buckets alive at once in the overlapped backward: the LM head's and the
                     embedding's, and MAX_INFLIGHT + 1 decoder layers'
    activations      the training micro-batch's: the kept layer inputs (per the checkpointing
                     mode), one layer recomputed with its backward temporaries, the LM head's
                     hidden rows and logits tiles
    KV pool          kv_tokens x layers x 2 x kv heads x head_dim x kv bytes (rollout only)
The rollout phase (KV pool + the engine's step) and the training phase (gradients +
activations) do not overlap (the pool sleeps through training, the gradients are freed
through the rollout), so the peak is the persistent part plus the larger phase, plus 5% for
the allocator's fragmentation and 1.5 GiB for the CUDA context, cuBLAS and NCCL buffers.
"""

from __future__ import annotations

import types

from rlcu.model.config import Qwen3Config, checkpointed_layers

GiB = 1 << 30
OVERHEAD = int(1.5 * GiB)
FRAGMENTATION = 1.05
H200_GiB = 139.0  # what an H200 offers a process (torch.cuda.mem_get_info on the device machine)


def _layer_act_bytes(cfg: Qwen3Config, T: int, ab: int) -> int:
    """One decoder layer's activations for T tokens (as `_layer_fwd` keeps them)."""
    H, q, kv, F = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return T * ((4 * H + 3 * q + 5 * kv + 3 * F) * ab + cfg.num_attention_heads * 4)


def kept_activation_bytes(cfg: Qwen3Config, T: int, ab: int, checkpointing: str | int) -> int:
    """What the forward keeps for the backward over all layers: checkpointing 'full' (each
    layer's input), 'attention' (+ its attention output and lse), 'none' (every activation),
    or an int k (k layers checkpointed, every activation of the others)."""
    L, H = cfg.num_hidden_layers, cfg.hidden_size
    per = {"full": T * H * ab, "attention": T * (H + cfg.q_size) * ab + T * cfg.num_attention_heads * 4,
           "none": _layer_act_bytes(cfg, T, ab)}
    if checkpointed_layers(checkpointing) is not None:
        if not 0 <= checkpointing <= L:
            raise ValueError(f"checkpointing as a number of layers must be in [0, {L}], got {checkpointing}")
        return checkpointing * per["full"] + (L - checkpointing) * per["none"]
    if checkpointing not in per:
        raise ValueError(f"checkpointing must be 'full', 'attention', 'none' or a number of layers, "
                         f"got {checkpointing!r}")
    return per[checkpointing] * L


def checkpointing_name(mode) -> str | int:
    """The model attribute's value (True/'full', 'attention', False/'none', an int) as
    `estimate` names it."""
    if checkpointed_layers(mode) is not None:
        return mode
    return {True: "full", "full": "full", "attention": "attention"}.get(mode, "none")


def fit_checkpointing(budget_bytes: int, cfg: Qwen3Config, **kw) -> int:
    """The fewest checkpointed layers (an int for `Qwen3.gradient_checkpointing`) whose
    estimated peak (`estimate(cfg, checkpointing=k, **kw)`) is within budget_bytes; every
    layer (the full checkpointing's peak) when none fits, the caller's out-of-memory to meet.
    The peak falls as k grows, so a bisection finds it."""
    lo, hi = 0, cfg.num_hidden_layers
    while lo < hi:
        mid = (lo + hi) // 2
        if estimate(cfg, checkpointing=mid, **kw)["peak"] <= budget_bytes:
            hi = mid
        else:
            lo = mid + 1
    return lo


def estimate(cfg: Qwen3Config, world_size: int = 1, *, weight_bytes: int = 2, master_weights: bool = True,
             state_bytes: int = 4, grad_bytes: int = 4, micro_batch_tokens: int = 8192, kv_tokens: int = 0,
             kv_bytes: int = 2, engine_tokens: int = 8192, checkpointing: str | int = "full", ref_model: bool = False,
             overlap: bool = True) -> dict:
    """Bytes per rank by part (see the module docstring); 'peak' is the total."""
    import torch

    from rlcu.model.layout import ParamLayout
    from rlcu.ops.logprob import chunk_rows
    from rlcu.parallel.buckets import MAX_INFLIGHT, Buckets, bucket_bounds

    lay = ParamLayout(cfg)
    P, N, L = lay.numel, world_size, cfg.num_hidden_layers
    H, V, T = cfg.hidden_size, cfg.vocab_size, micro_batch_tokens
    ab = weight_bytes
    bk = Buckets(bucket_bounds(types.SimpleNamespace(layout=lay, cfg=cfg)), 0, N)
    out = {"parameters": P, "world_size": N}
    out["weights"] = P * weight_bytes
    out["reference"] = P * weight_bytes if ref_model else 0
    per_param_state = (4 if master_weights and weight_bytes != 4 else 0) + 2 * state_bytes
    out["optimizer"] = per_param_state * (bk.shard_numel if N > 1 else P)
    if N > 1 and overlap:
        sizes = [c * N for c in bk.chunk]  # padded bucket buffers
        layers = sorted(sizes[1:-1], reverse=True)[: MAX_INFLIGHT + 1]
        out["gradient_shard"] = grad_bytes * bk.shard_numel
        out["gradient_buckets"] = grad_bytes * (sizes[0] + sizes[-1] + sum(layers))
    else:
        out["gradient_shard"] = grad_bytes * (bk.shard_numel if N > 1 else P)
        out["gradient_buckets"] = grad_bytes * P if N > 1 else 0  # the full buffer, reduce-scattered at the step
    keep = kept_activation_bytes(cfg, T, ab, checkpointing)
    layer = 2 * _layer_act_bytes(cfg, T, ab)  # the recomputed layer and its backward's temporaries
    C = chunk_rows(V, torch.bfloat16 if ab == 2 else torch.float32)
    head = 3 * T * H * ab + 2 * C * V * 4 + 4 * T * 4
    out["activations"] = keep + layer + head
    out["kv_pool"] = kv_tokens * L * 2 * cfg.kv_size * kv_bytes
    engine = _layer_act_bytes(cfg, engine_tokens, ab) + min(engine_tokens, 1024) * V * 4
    train = out["gradient_shard"] + out["gradient_buckets"] + out["activations"]
    rollout = out["kv_pool"] + engine
    persistent = out["weights"] + out["reference"] + out["optimizer"]
    out["train_phase"], out["rollout_phase"] = train, rollout
    out["peak"] = int((persistent + max(train, rollout)) * FRAGMENTATION) + OVERHEAD
    return out


def _estimate_kwargs(model, opt, world_size: int, micro_batch_tokens: int, kv_tokens: int = 0,
                     ref_model: bool = False) -> dict:
    """`estimate`'s keywords for a run's model and optimizer (their dtypes and modes)."""
    import torch

    has_master = getattr(opt, "master", None) is not None and not getattr(opt, "master_is_model", True)
    grad_dtype = getattr(opt, "grad_dtype", getattr(model, "grad_dtype", torch.float32))
    return dict(world_size=world_size, weight_bytes=model.flat.element_size(), master_weights=has_master,
                state_bytes=opt.m.element_size(), grad_bytes=torch.empty((), dtype=grad_dtype).element_size(),
                micro_batch_tokens=micro_batch_tokens, kv_tokens=kv_tokens, ref_model=ref_model,
                overlap=getattr(opt, "sink", None) is not None)


def estimate_for(model, opt, world_size: int, micro_batch_tokens: int, kv_tokens: int = 0,
                 ref_model: bool = False) -> dict:
    """`estimate` for a run's model and optimizer (their dtypes and modes); a checkpointing
    still 'auto' is estimated at the number of layers it will become (`auto_layers`)."""
    kw = _estimate_kwargs(model, opt, world_size, micro_batch_tokens, kv_tokens, ref_model)
    mode = model.gradient_checkpointing
    ckpt = auto_layers(model, kw)[0] if mode == "auto" else checkpointing_name(mode)
    return estimate(model.cfg, checkpointing=ckpt, **kw)


def _kv_tokens(llm) -> int:
    runner = getattr(llm, "runner", None)
    return getattr(runner, "num_blocks", 0) * getattr(runner, "block_size", 0) if runner is not None else 0


def auto_layers(model, kw: dict, extra_bytes: int = 0) -> tuple[int, int, int]:
    """(k, its estimated peak, the budget): the fewest checkpointed layers whose estimated
    peak (`estimate(model.cfg, **kw)`) fits what this process may hold on its GPU (the free
    memory plus what it has reserved already), less extra_bytes held outside the estimate.
    Every layer on the CPU (peak and budget 0)."""
    import torch

    if model.device.type != "cuda":
        return model.cfg.num_hidden_layers, 0, 0
    free, _ = torch.cuda.mem_get_info(model.device)
    budget = free + torch.cuda.memory_reserved(model.device) - extra_bytes
    k = fit_checkpointing(budget, model.cfg, **kw)
    return k, estimate(model.cfg, checkpointing=k, **kw)["peak"], budget


def resolve_auto(model, opt, micro_batch_tokens: int, llm=None, ref_model: bool = False,
                 extra_bytes: int = 0) -> str:
    """`gradient_checkpointing: auto` made a number (`auto_layers`): sets
    model.gradient_checkpointing and returns a line for the log."""
    from rlcu.parallel.comm import world

    L = model.cfg.num_hidden_layers
    kw = _estimate_kwargs(model, opt, world().size, micro_batch_tokens, _kv_tokens(llm), ref_model)
    k, peak, budget = auto_layers(model, kw, extra_bytes)
    model.gradient_checkpointing = k
    if model.device.type != "cuda":
        return f"gradient checkpointing auto: all {L} layers checkpointed (on the CPU)"
    return (f"gradient checkpointing auto: {k} of {L} layers checkpointed, every activation of the others kept "
            f"(estimated peak {(peak + extra_bytes) / GiB:.1f} GiB of {(budget + extra_bytes) / GiB:.1f} GiB "
            f"this process may hold)")


def summary(est: dict) -> str:
    """One line: the peak and its parts, GiB."""
    parts = ("weights", "reference", "optimizer", "gradient_shard", "gradient_buckets", "activations", "kv_pool")
    body = ", ".join(f"{k.replace('_', ' ')} {est[k] / GiB:.2f}" for k in parts if est[k])
    return (f"memory per rank (estimate, {est['world_size']} ranks): peak {est['peak'] / GiB:.1f} GiB = {body} "
            f"(+ fragmentation and {OVERHEAD / GiB:.1f} GiB of context; rollout and training phases apart)")


def log_estimate(log, model, opt, micro_batch_tokens: int, llm=None, ref_model: bool = False) -> dict | None:
    """Log the per-rank estimate at a run's start across ranks (nothing in one process)."""
    from rlcu.parallel.comm import world

    w = world()
    if not w.distributed:
        return None
    est = estimate_for(model, opt, w.size, micro_batch_tokens, kv_tokens=_kv_tokens(llm), ref_model=ref_model)
    log.info(summary(est))
    return est
