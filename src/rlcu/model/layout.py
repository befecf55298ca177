"""The flat parameter layout: every weight of the model is a view into one contiguous buffer.

Attention's q/k/v projections are stored fused as `qkv` and the MLP's gate/up as `gate_up`
(one matmul each). Gradients, fp32 master weights and Adam moments use buffers of the same
layout, so the optimizer is one launch and a checkpoint one copy. Each tensor starts at a
multiple of `ALIGN` elements so that kernels see aligned rows.

HF parameter names map onto row ranges of the fused tensors; a row range of a row-major
matrix is contiguous, so `q_proj.weight` is itself a plain view. The family (model/family.py)
decides which slots exist: `q_norm`/`k_norm` only where it has q/k norms (Qwen3), `qkv_bias`
(q, k and v biases fused as qkv is) only where it has them (Qwen2), `lm_head` only untied.
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
            shapes += [(p + "o", (H, cfg.q_size)), (p + "post_norm", (H,)), (p + "gate_up", (2 * I, H)),
                       (p + "down", (H, I))]
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
                p + "mlp.gate_proj.weight": (s + "gate_up", 0, I),
                p + "mlp.up_proj.weight": (s + "gate_up", I, 2 * I),
                p + "mlp.down_proj.weight": (s + "down", 0, c.hidden_size),
            })
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
