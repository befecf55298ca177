"""The parts of a job's memory: each a function of the job's shape (rlcu.memory.shape) -> bytes
on one rank. The activation parts follow the code that allocates them, tensor by tensor (named
in each docstring), so that a change there is a change here; tests/integration/test_memory_gpu.py
holds them to the peaks an H200 measures.

Notation, per token: H hidden, q = heads x head_dim, kv = kv heads x head_dim, I intermediate,
Hq, Hk heads, ab the activations' bytes (the weights' dtype); fp32 statistics are 4 bytes, int64
indices 8.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from rlcu.memory.shape import JobShape
from rlcu.model.config import Qwen3Config
from rlcu.model.layout import ALIGN, ParamLayout
from rlcu.model.lora import LoraConfig, LoraLayout
from rlcu.ops.logprob import chunk_rows

MAX_INFLIGHT = 2  # overlapped reduce-scatters in flight before the oldest is waited on (parallel/buckets.py)
# cuBLAS's workspace, taken from torch's allocator at a stream's first GEMM and kept: measured as
# what an engine step's probe holds beyond its tensors (bench/results/cold_start.json, 0.6B: 32 MiB)
CUBLAS_WORKSPACE = 32 << 20
FP32, INDEX = 4, 8


_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "tie_word_embeddings", "family",  # the family: which slots
                 "num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
                 "mlp_only_layers")


def _cfg(dims: tuple) -> Qwen3Config:
    return Qwen3Config(**dict(zip(_SHAPE_FIELDS, dims)))


@functools.lru_cache(maxsize=64)
def _layout(dims: tuple) -> tuple[int, list[int]]:
    lay = ParamLayout(_cfg(dims))
    return lay.numel, lay.layer_bounds()


def _dims(cfg: Qwen3Config) -> tuple:
    """What of cfg decides the flat layout, hashable (a cache key)."""
    return tuple(getattr(cfg, f) for f in _SHAPE_FIELDS)


def params(cfg: Qwen3Config) -> int:
    """Elements of the flat layout (model/layout.py), alignment padding included."""
    return _layout(_dims(cfg))[0]


def _buckets(s: JobShape) -> list[int]:
    """The data-parallel buckets' padded sizes (parallel/buckets.py): the flat layout cut at
    layer boundaries, each bucket cut into N chunks of ceil(size / N)."""
    b, N = _layout(_dims(s.cfg))[1], s.world_size
    return [-(-(hi - lo) // N) * N for lo, hi in zip(b, b[1:])]


def shard(s: JobShape) -> int:
    """Elements of one rank's optimizer shard: P alone, the chunks of every bucket across ranks."""
    return params(s.cfg) if s.world_size == 1 else sum(_buckets(s)) // s.world_size


# ---------------------------------------------------------------- what a rank keeps
def weights(s: JobShape) -> int:
    """The flat weights: every rank keeps them whole (the engine reads them in place)."""
    return params(s.cfg) * s.weight_bytes


def master(s: JobShape) -> int:
    """The fp32 master copy of bf16 weights (a 1/N shard across ranks); none of a frozen base."""
    return 4 * shard(s) if s.has_master and s.trains_base else 0


def optimizer_state(s: JobShape) -> int:
    """Adam's m and v (a 1/N shard across ranks); none of a frozen base."""
    return 2 * s.state_bytes * shard(s) if s.trains_base else 0


def gradients(s: JobShape) -> int:
    """The gradient buffer: P elements in one process; across ranks the reduced 1/N shard (the
    overlapped backward's; without overlap `grad_buckets` counts the full buffer); none of a
    frozen base."""
    return s.grad_bytes * shard(s) if s.trains_base else 0


@functools.lru_cache(maxsize=64)
def _adapter_layout(dims: tuple, r: int, targets: tuple[str, ...]) -> tuple[int, int, int]:
    """(elements, the widest stacked rank S r, the widest input K) of the adapters' layout; a
    MoE's expert adapters (their A_e, B_e counted in the elements) at k rows a token, gate_up's
    rank 2r."""
    cfg = _cfg(dims)
    lay = LoraLayout(cfg, LoraConfig(r=r, target_modules=targets))
    ex = [cfg.num_experts_per_tok * s.shape[1] for e in lay.experts.values() for s in e.slots()
          if s.name.endswith(".A")]
    return (lay.numel, max([len(sp.slices) * r for sp in lay.specs.values()] + ex, default=0),
            max([sp.K for sp in lay.specs.values()] + [s.shape[2] for e in lay.experts.values()
                                                        for s in e.slots() if s.name.endswith(".A")], default=0))


def adapter_params(s: JobShape) -> int:
    """Elements of the adapters' flat layout (model/lora.py LoraLayout), alignment included."""
    a = s.adapter
    return 0 if a is None else _adapter_layout(_dims(s.cfg), a.r, a.target_modules)[0]


def adapters(s: JobShape) -> int:
    """The adapters' weights (the model's dtype), their fp32 master beside narrower weights and
    Adam's m and v (optim.FlatAdamW over LoraAdapters' flat buffer, whole on every rank)."""
    if s.adapter is None:
        return 0
    P = adapter_params(s)
    return P * s.weight_bytes + (4 * P if s.has_master else 0) + (2 * s.state_bytes * P if s.optimizer else 0)


def adapter_gradients(s: JobShape) -> int:
    """The adapters' gradient buffer (LoraAdapters.grad_flat)."""
    return s.grad_bytes * adapter_params(s) if s.adapter is not None and s.optimizer else 0


def grad_buckets(s: JobShape) -> int:
    """Across ranks, what the backward holds beside the shard: with overlap the buckets alive at
    once (the embedding's, the final norm's with the head, and MAX_INFLIGHT + 1 layers': the
    one written and those in flight); without, the full gradient buffer."""
    if s.world_size == 1 or not s.trains_base:
        return 0
    if not s.overlap:
        return s.grad_bytes * params(s.cfg)
    sizes = _buckets(s)
    layers = sorted(sizes[1:-1], reverse=True)[: MAX_INFLIGHT + 1]
    return s.grad_bytes * (sizes[0] + sizes[-1] + sum(layers))


def reference(s: JobShape) -> int:
    """A frozen copy of the weights for the KL term; none with adapters (the base is the reference)."""
    return params(s.cfg) * s.weight_bytes if s.reference and s.adapter is None else 0


def critic_params(cfg: Qwen3Config) -> int:
    """The critic's flat layout (train/critic.py): the trunk, then the value head's H + 1."""
    return params(cfg) + -(-(cfg.hidden_size + 1) // ALIGN) * ALIGN


def critic_flat(s: JobShape) -> int:
    """The critic's trained buffer: a full trunk and head (critic_params), or with adapters
    (train/lora_critic.py) its own adapters' layout and the head, over the policy's base (no
    second copy of the base is counted)."""
    if s.adapter is None:
        return critic_params(s.cfg)
    return adapter_params(s) + -(-(s.cfg.hidden_size + 1) // ALIGN) * ALIGN


def critic(s: JobShape) -> int:
    """PPO's critic: its weights, and its optimizer's master and moments (1/N shards)."""
    if not s.critic:
        return 0
    Pc = critic_flat(s)
    Sc = -(-Pc // s.world_size)
    return Pc * s.weight_bytes + (4 * Sc if s.has_master else 0) + 2 * s.state_bytes * Sc


def critic_gradients(s: JobShape) -> int:
    """The critic's gradient buffer (whole on every rank)."""
    return critic_flat(s) * s.grad_bytes if s.critic else 0


def _rm_weights(rm) -> int:
    """A reward model's flat buffer (model/scalar_head.py: the trunk with no LM head slot, its
    config made tied as model/reward_model.py makes it, then the head's H + 1)."""
    return critic_params(dataclasses.replace(rm.cfg, tie_word_embeddings=True))


def reward_model(s: JobShape) -> int:
    """The reward models kept on the device (their flat weights, in the policy's dtype)."""
    return sum(_rm_weights(r) for r in s.reward_models if not r.offload) * s.weight_bytes


def reward_model_offloaded(s: JobShape) -> int:
    """The offloaded reward models' weights, on the device only while they score (the rollout
    phase); their host copy is not device memory."""
    return sum(_rm_weights(r) for r in s.reward_models if r.offload) * s.weight_bytes


def reward_work(s: JobShape) -> int:
    """The widest scoring forward (rlcu.model.reward_model `score`, no gradient) of the reward
    models: over its tokens T, a layer's input, its activations and output, then the final-normed
    rows; the scores themselves are one float a sequence."""
    ab = s.weight_bytes
    return max((r.tokens * (2 * ab * r.cfg.hidden_size + max(layer_acts(r.cfg, ab, sp) for sp in _kinds(r.cfg)))
                for r in s.reward_models), default=0)


def init_staging(s: JobShape) -> int:
    """What building the job holds beside the weights: a random initialisation's fp32 copy
    (Qwen3.from_config). Weights read from a checkpoint come in their dtype; the master's
    `.float()` before its clone stays below the moments allocated after it."""
    return 4 * params(s.cfg) if s.random_init else 0


# ---------------------------------------------------------------- activations, per token
def _kinds(cfg: Qwen3Config) -> tuple[bool, ...]:
    """The layer kinds the model has: False dense, True sparse (Qwen3-MoE's experts)."""
    return tuple(sorted({cfg.sparse_layer(i) for i in range(cfg.num_hidden_layers)}))


def moe_acts(cfg: Qwen3Config, ab: int) -> int:
    """What model/moe.py `mlp_fwd(keep="all")` keeps a token: router logits E, probs E fp32, ids,
    weights and the layout's pos and pairs (k each, 4 bytes), and its k rows of gu 2I, a I and y H
    (I: moe_intermediate_size). Not counted: the layout's padding, at most E x BM rows a layer."""
    E, k, Im = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    return ab * (E + k * (3 * Im + cfg.hidden_size)) + FP32 * (E + 4 * k)


def layer_acts(cfg: Qwen3Config, ab: int, sparse: bool = False) -> int:
    """What model/layer.py `layer_fwd(keep="all")` keeps beside its input x: h1, qkv, q, k, v, o, x2, h2 (H, q+2kv,
    q, kv, kv, q, H, H), gu 2I, a I; fp32 r1, r2, rq Hq, rk Hk, lse Hq. A family without q/k norm
    (model/family.py) keeps neither qkv (the norms' input) nor rq, rk. A sparse layer keeps the
    experts' (`moe_acts`) in place of gu and a."""
    H, q, kv, I = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    Hq, Hk = cfg.num_attention_heads, cfg.num_key_value_heads
    mlp = moe_acts(cfg, ab) if sparse else ab * 3 * I
    if not cfg.fam.qk_norm:
        return ab * (3 * H + 2 * q + 2 * kv) + mlp + FP32 * (2 + Hq)
    return ab * (3 * H + 3 * q + 4 * kv) + mlp + FP32 * (2 + 2 * Hq + Hk)


def kept(cfg: Qwen3Config, ab: int, keep: str, sparse: bool = False) -> int:
    """What one layer's forward keeps for the backward (`layer_keeps`): its input ('inputs');
    + attention's output and lse ('attention'); + every activation ('all'). A checkpointed
    sparse layer keeps its router logits too (E, model/moe.py)."""
    x = ab * cfg.hidden_size + (ab * cfg.num_experts if sparse and keep != "all" else 0)
    if keep == "inputs":
        return x
    if keep == "attention":
        return x + ab * cfg.q_size + FP32 * cfg.num_attention_heads
    return x + layer_acts(cfg, ab, sparse)


def recompute(cfg: Qwen3Config, ab: int, keep: str, sparse: bool = False) -> int:
    """What the backward allocates recomputing a checkpointed layer (`_layer_fwd` again, its
    output dropped; the kept attention's o and lse, and router logits, reused)."""
    if keep == "all":
        return 0
    return layer_acts(cfg, ab, sparse) - (kept(cfg, ab, keep, sparse) - ab * cfg.hidden_size)


def backward_work(cfg: Qwen3Config, ab: int) -> int:
    """model/layer.py `layer_bwd`'s locals, alive until it returns: da I, dgu 2I, dh2, dx2 (H), do, dq
    (q), dk, dv (kv), dqn q, dkn kv, dq0 q, dk0 kv, dqkv q+2kv, dh1, dx (H); and dy, the
    gradient it was given. A sparse layer's MLP (model/moe.py `mlp_bwd`) holds its k rows' dy,
    dxr (H), da I and dgu 2I, dweights k and dlogits E (fp32, then in ab) in place of da and dgu;
    the wider of the model's layer kinds."""
    H, q, kv, I = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    E, k, Im = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    mlp = max((ab * (k * (2 * H + 3 * Im) + E) + FP32 * (E + k)) if sp else ab * 3 * I for sp in _kinds(cfg))
    return ab * (4 * H + 5 * q + 6 * kv) + mlp + ab * H


def _head_rows(s: JobShape) -> int:
    """Per token, what the LM head's pass leaves alive through the trunk's backward: the last
    layer's output x and the final norm's rstd (the trunk's context), dh (the rows scattered
    back), dhs (the head's gradient), the head's row indices (tgt, rows) and lp; the separate
    backward (SFT) also its saved hs, lse, targets and upstream dlp, the fused one the entropy."""
    ab, H = s.weight_bytes, s.cfg.hidden_size
    out = 3 * ab * H + FP32 + 2 * INDEX + FP32
    return out + (FP32 if s.fused_head else ab * H + FP32 + INDEX + FP32)


def head_tile(s: JobShape) -> int:
    """The fused LM head's logits tile (ops/logprob.py): C = chunk_rows(V) rows of V logits."""
    V, T = s.cfg.vocab_size, s.micro_batch_tokens
    return min(T, chunk_rows(V, torch.bfloat16 if s.weight_bytes == 2 else torch.float32)) * V * s.weight_bytes


# ---------------------------------------------------------------- activations of a micro-batch
def kept_activations(s: JobShape) -> int:
    """What the forward of one micro-batch keeps over all layers (per the checkpointing)."""
    cfg, ab = s.cfg, s.weight_bytes
    return s.micro_batch_tokens * sum(kept(cfg, ab, k, cfg.sparse_layer(i)) for i, k in enumerate(s.keeps()))


def adapter_work(s: JobShape) -> int:
    """Per token, the adapters' share of a layer's backward (model/lora_run.py `backward`) at its
    widest module: h recomputed, the slices' dh and their concatenation dH (S r each); with
    dropout, a slice's mask (bool, then in the activations' dtype) and the masked input (K)."""
    a = s.adapter
    if a is None:
        return 0
    _, SR, K = _adapter_layout(_dims(s.cfg), a.r, a.target_modules)
    ab = s.weight_bytes
    return 3 * ab * SR + ((1 + 2 * ab) * K if a.dropout else 0)


def layer_work(s: JobShape) -> int:
    """The backward's peak above `kept_activations`: at layer i, the kept activations of layers
    0..i (the later ones are freed), the layer recomputed, its backward's locals and the head's
    leftovers (and the adapters' backward); the largest over i (the last layer's, or with k
    checkpointed layers the k-th's)."""
    cfg, ab, T = s.cfg, s.weight_bytes, s.micro_batch_tokens
    keeps = s.keeps()
    held, best = 0, 0
    for i, k in enumerate(keeps):
        held += kept(cfg, ab, k, cfg.sparse_layer(i))
        best = max(best, held + recompute(cfg, ab, k, cfg.sparse_layer(i)))
    total = held
    return T * (best - total + backward_work(cfg, ab) + adapter_work(s) + _head_rows(s))


def head_work(s: JobShape) -> int:
    """The LM head's pass above `kept_activations`: the last layer's output and rstd, the normed
    rows (h or dh) and hs, lp, lse and ent, tgt and rows, and the logits tile."""
    ab, H, T = s.weight_bytes, s.cfg.hidden_size, s.micro_batch_tokens
    return T * (3 * ab * H + FP32 + 3 * FP32 + 2 * INDEX) + head_tile(s)


def ref_forward(s: JobShape) -> int:
    """The frozen reference's forward of one micro-batch, no gradient: a layer's input, its
    activations and output; then the final rows, hs and the head's tile."""
    if not s.reference:
        return 0
    ab, H, T = s.weight_bytes, s.cfg.hidden_size, s.micro_batch_tokens
    acts = max(layer_acts(s.cfg, ab, sp) for sp in _kinds(s.cfg))
    return max(T * (2 * ab * H + acts), T * (3 * ab * H + 3 * FP32 + 2 * INDEX) + head_tile(s))


def critic_work(s: JobShape) -> int:
    """PPO's critic update of one micro-batch: the trunk's kept activations and backward (a
    value head, no LM head)."""
    return kept_activations(s) + layer_work(s) if s.critic else 0


# ---------------------------------------------------------------- the engine
def kv_token_bytes(cfg: Qwen3Config, kv_bytes: int) -> int:
    """One token's K and V in every layer, and a Qwen3-MoE engine's routes of it (route_token_bytes)."""
    return 2 * cfg.num_hidden_layers * cfg.kv_size * kv_bytes + route_token_bytes(cfg)


def route_token_bytes(cfg: Qwen3Config) -> int:
    """A KV slot's routes in a MoE engine's route log (engine/routes.py): the top-k expert ids of
    every sparse layer, one byte each for E <= 256 (else two); 0 for a dense model."""
    if not cfg.fam.moe:
        return 0
    return len(cfg.sparse_layers) * cfg.num_experts_per_tok * (1 if cfg.num_experts <= 256 else 2)


def kv_block_bytes(cfg: Qwen3Config, block_size: int, kv_bytes: int) -> int:
    """One KV block: block_size tokens' K and V in every layer."""
    return block_size * kv_token_bytes(cfg, kv_bytes)


def kv_pool(s: JobShape) -> int:
    return s.engine.kv_tokens * kv_token_bytes(s.cfg, s.engine.kv_bytes) if s.engine else 0


def trunk_step(cfg: Qwen3Config, ab: int, tokens: int) -> int:
    """An engine step's layers over `tokens` new tokens (engine/paged_forward.py, at the MLP:
    x, q, o (H, q, q), h H, gu 2I, a I, the post norm's rstd); a sparse layer's MLP (model/moe.py)
    holds what `moe_acts` counts and the combined output H in place of gu and a."""
    H, q, I = cfg.hidden_size, cfg.q_size, cfg.intermediate_size
    mlp = max(moe_acts(cfg, ab) + ab * H if sp else ab * 3 * I for sp in _kinds(cfg))
    return tokens * (ab * (2 * H + 2 * q) + mlp + FP32)


def head_step(cfg: Qwen3Config, ab: int, rows: int) -> int:
    """An engine step's sampled rows: their final hidden states, logits and the sampled
    tokens and logprobs."""
    return rows * (ab * (cfg.hidden_size + cfg.vocab_size) + INDEX + FP32)


def engine_step(s: JobShape) -> int:
    """The widest engine step: a full token budget through the layers, or max_num_seqs rows
    through the head (the larger)."""
    if s.engine is None:
        return 0
    e, ab = s.engine, s.weight_bytes
    return max(trunk_step(s.cfg, ab, e.budget), head_step(s.cfg, ab, min(e.max_num_seqs, e.budget)))


def decode_graphs(s: JobShape) -> int:
    """The decode graphs' private pool: about the widest decode step (captured first; the others
    reuse its memory), which is its head's rows."""
    e = s.engine
    return head_step(s.cfg, s.weight_bytes, e.max_num_seqs) if e is not None and e.decode_graphs else 0


def prefill_graphs(s: JobShape, step_bytes: int | None = None) -> int:
    """The prefill graphs' private pool: one full-budget trunk step (`step_bytes` when measured)
    and the hidden-state outputs every smaller bucket's graph keeps."""
    e = s.engine
    if e is None or e.prefill_graph_rows is None:
        return 0
    step = trunk_step(s.cfg, s.weight_bytes, e.budget) if step_bytes is None else step_bytes
    return step + e.prefill_graph_rows * s.cfg.hidden_size * s.weight_bytes
