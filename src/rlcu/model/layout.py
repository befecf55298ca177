"""The flat parameter layout: every weight of the model is a view into one contiguous buffer.

Attention's q/k/v projections are stored fused as `qkv` and the MLP's gate/up as `gate_up`
(one matmul each). Gradients, fp32 master weights and Adam moments use buffers of the same
layout, so the optimizer is one launch and a checkpoint one copy. Each tensor starts at a
multiple of `ALIGN` elements so that kernels see aligned rows.

HF parameter names map onto row ranges of the fused tensors; a row range of a row-major
matrix is contiguous, so `q_proj.weight` is itself a plain view. The family (model/family.py)
decides which slots exist: `q_norm`/`k_norm` only where it has q/k norms (Qwen3), `qkv_bias`
(q, k and v biases fused as qkv is) only where it has them (Qwen2), `lm_head` only untied.
A sparse layer of Qwen3-MoE has `router` [E, H], `experts_gate_up` [E, 2I, H] (gate rows first)
and `experts_down` [E, H, I] (I: moe_intermediate_size) in place of gate_up and down: transformers
5's parameters (`mlp.gate.weight`, `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, the names
of `hf`). Checkpoints on disk hold the experts one by one (`mlp.experts.{e}.gate_proj.weight`, ...:
what transformers writes and the published ones hold); `file_views` names those views.
"""

from __future__ import annotations

import dataclasses

import torch

from rlcu.model.config import CausalLMConfig

ALIGN = 64


@dataclasses.dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class ParamLayout:
    def __init__(self, cfg: CausalLMConfig):
        self.cfg = cfg
        H, D, I, V = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
        QKV, fam = cfg.q_size + 2 * cfg.kv_size, cfg.fam
        shapes: list[tuple[str, tuple[int, ...]]] = [("embed", (V, H))]
        for i in range(cfg.num_hidden_layers):
            p = f"layers.{i}."
            shapes += [(p + "input_norm", (H,)), (p + "qkv", (QKV, H))]
            shapes += [(p + "qkv_bias", (QKV,))] if fam.qkv_bias else []
            shapes += [(p + "q_norm", (D,)), (p + "k_norm", (D,))] if fam.qk_norm else []
            shapes += [(p + "o", (H, cfg.q_size)), (p + "post_norm", (H,))]
            if cfg.sparse_layer(i):
                E, Im = cfg.num_experts, cfg.moe_intermediate_size
                shapes += [(p + "router", (E, H)), (p + "experts_gate_up", (E, 2 * Im, H)),
                           (p + "experts_down", (E, H, Im))]
            else:
                shapes += [(p + "gate_up", (2 * I, H)), (p + "down", (H, I))]
        shapes.append(("final_norm", (H,)))
        if not cfg.tie_word_embeddings:
            shapes.append(("lm_head", (V, H)))
        self.slots: dict[str, Slot] = {}
        off = 0
        for name, shape in shapes:
            slot = Slot(name, shape, off)
            self.slots[name] = slot
            off += -(-slot.numel // ALIGN) * ALIGN
        self.numel = off
        self.hf = self._hf_map()

    def layer_bounds(self) -> list[int]:
        """[0, start of layer 0, ..., start of the last layer, start of final_norm, numel]: the
        flat cut at layer boundaries (the embedding, each decoder layer, the final norm with
        the LM head); the data-parallel gradient buckets (parallel/buckets.py) and the memory
        model (rlcu.memory) cut it so."""
        L = self.cfg.num_hidden_layers
        b = [0] + [self.slots[f"layers.{i}.input_norm"].offset for i in range(L)]
        return sorted(set(b + [self.slots["final_norm"].offset, self.numel]))

    def _hf_map(self) -> dict[str, tuple[str, int, int]]:
        """HF name -> (slot name, first row, end row) of the fused tensor."""
        c = self.cfg
        q, kv, I = c.q_size, c.kv_size, c.intermediate_size
        fam = c.fam
        m = {"model.embed_tokens.weight": ("embed", 0, c.vocab_size)}
        for i in range(c.num_hidden_layers):
            p, s = f"model.layers.{i}.", f"layers.{i}."
            m.update({
                p + "input_layernorm.weight": (s + "input_norm", 0, c.hidden_size),
                p + "self_attn.q_proj.weight": (s + "qkv", 0, q),
                p + "self_attn.k_proj.weight": (s + "qkv", q, q + kv),
                p + "self_attn.v_proj.weight": (s + "qkv", q + kv, q + 2 * kv),
                p + "self_attn.o_proj.weight": (s + "o", 0, c.hidden_size),
                p + "post_attention_layernorm.weight": (s + "post_norm", 0, c.hidden_size),
            })
            if c.sparse_layer(i):
                E = c.num_experts
                m.update({p + "mlp.gate.weight": (s + "router", 0, E),
                          p + "mlp.experts.gate_up_proj": (s + "experts_gate_up", 0, E),
                          p + "mlp.experts.down_proj": (s + "experts_down", 0, E)})
            else:
                m.update({p + "mlp.gate_proj.weight": (s + "gate_up", 0, I),
                          p + "mlp.up_proj.weight": (s + "gate_up", I, 2 * I),
                          p + "mlp.down_proj.weight": (s + "down", 0, c.hidden_size)})
            if fam.qk_norm:
                m[p + "self_attn.q_norm.weight"] = (s + "q_norm", 0, c.head_dim)
                m[p + "self_attn.k_norm.weight"] = (s + "k_norm", 0, c.head_dim)
            if fam.qkv_bias:
                m[p + "self_attn.q_proj.bias"] = (s + "qkv_bias", 0, q)
                m[p + "self_attn.k_proj.bias"] = (s + "qkv_bias", q, q + kv)
                m[p + "self_attn.v_proj.bias"] = (s + "qkv_bias", q + kv, q + 2 * kv)
        m["model.norm.weight"] = ("final_norm", 0, c.hidden_size)
        if not c.tie_word_embeddings:
            m["lm_head.weight"] = ("lm_head", 0, c.vocab_size)
        return m

    def hf_shape(self, hf_name: str) -> tuple[int, ...]:
        slot_name, r0, r1 = self.hf[hf_name]
        shape = self.slots[slot_name].shape
        return (r1 - r0,) + shape[1:]

    def empty(self, device, dtype) -> torch.Tensor:
        return torch.empty(self.numel, device=device, dtype=dtype)

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Slot name -> view of `buf` with the slot's shape."""
        if buf.numel() != self.numel:
            raise ValueError(f"flat buffer has {buf.numel()} elements, layout needs {self.numel}")
        return {n: buf[s.offset : s.offset + s.numel].view(s.shape) for n, s in self.slots.items()}

    def hf_views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """HF parameter name -> view of `buf` (row ranges of the fused tensors)."""
        v = self.views(buf)
        return {hf: v[slot][r0:r1] for hf, (slot, r0, r1) in self.hf.items()}

    def file_views(self, buf: torch.Tensor, fused: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name -> view of `buf`: `hf_views`, but each sparse layer's experts one
        by one (`mlp.experts.{e}.gate_proj.weight` [I, H] and up_proj's: rows of gate_up [e];
        down_proj's [H, I]), as transformers writes them, except the fused names in `fused` (a
        checkpoint that holds transformers 5's fused tensors)."""
        out = {}
        for name, v in self.hf_views(buf).items():
            if name in fused or not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                out[name] = v
                continue
            p = name.rsplit(".", 1)[0]
            for e in range(v.shape[0]):
                if name.endswith("gate_up_proj"):
                    Im = v.shape[1] // 2
                    out[f"{p}.{e}.gate_proj.weight"], out[f"{p}.{e}.up_proj.weight"] = v[e, :Im], v[e, Im:]
                else:
                    out[f"{p}.{e}.down_proj.weight"] = v[e]
        return out
