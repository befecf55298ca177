"""LoRA adapters beside the frozen flat base: their config, their flat layout and their buffers.

An adapted linear computes y = x W^T + scale * (dropout(x) A^T) B^T with A [r, K] and B [n, r]
(PEFT's LoRA: scale = alpha / r, or alpha / sqrt(r) with rslora). The base's q/k/v and gate/up
are fused (model/layout.py), so an adapter is laid out per fused module: its targeted slices'
A stacked [S r, K] (one shrink GEMM for all of them) and B [N, r] with its rows on the fused
output's N columns; slice j's output columns (c0, c1) take h[:, j r:(j+1) r] B[c0:c1]^T, and the
rows of a slice that is not targeted stay zero (never read, never given a gradient). That is the
grouped kernel's layout (ops/lora.py: `a [n, R, K]`, `b [n, N, r]`, `slices`), so the trainer's
exact mode passes its slots as they are and an engine stacks adapter sets of one config without
reshaping them.

Every A and B of every layer is a view into ONE flat buffer (`LoraAdapters.flat`, the model's
dtype), with one flat gradient buffer of the same layout: the optimizer (optim.FlatAdamW takes
any object with flat, grad_flat, grad_dtype and release_grads) keeps its fp32 master and
moments over that buffer alone, and the base, frozen, has neither gradients nor optimizer state.

Qwen3-MoE: the attention of every layer, and each sparse layer's experts, one adapter an expert,
as PEFT (0.21) gives a transformers-5 user: gate_proj and up_proj name the fused gate_up_proj
(both or neither), adapted at rank 2r and alpha 2 alpha (PEFT's conversion of the two rank-r
modules), down_proj the experts' down_proj at rank r; slots A [E, R, K] and B [E, N, R]
(`ExpertSpec`, ops/moe.py `ExpertLora`). The MLP of the dense layers (mlp_only_layers) is
not adapted: PEFT's conversion of those names to the experts leaves it out too. The router takes
an adapter when named ("gate": a plain [E, H] linear; PEFT's all-linear on such a model adds it
as target_parameters gate.weight), never through all-linear here, which keeps it frozen as load
balancing was trained. PEFT's adapters of parameters (experts, router) take no dropout.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from rlcu.model.config import CausalLMConfig
from rlcu.model.layout import ALIGN, Slot

# HF module name -> (rlcu's fused module, the slice of it), in HF's order; "gate" is a Qwen3-MoE's
# router (named, never in all-linear: module docstring)
HF_TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
              "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0), "gate": ("router", 0)}
LINEAR = tuple(n for n in HF_TARGETS if n != "gate")  # all-linear: the decoder layer's seven linears
MODULES = ("qkv", "o", "gate_up", "down", "router")  # the layer's linears, in its order (the router last)
INITS = ("default", "gaussian")  # PEFT's init_lora_weights true / "gaussian": B zero either way


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """r: the rank; alpha: scale = alpha / r (alpha / sqrt(r) with rslora); target_modules: HF
    names (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, and a Qwen3-MoE's router gate)
    or 'all-linear' (the seven linears, never the LM head nor the router), kept as a tuple in
    HF's order; dropout: on the adapter's input while training (never in the engine); init:
    'default' (PEFT's: A kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(K), 1/sqrt(K)), B
    zero) or 'gaussian' (A normal, std 1/r, B zero); seed: A's draw and the dropout masks'."""

    r: int = 16
    alpha: float = 32.0
    rslora: bool = False
    target_modules: tuple[str, ...] | str = "all-linear"
    dropout: float = 0.0
    init: str = "default"
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 1:
            raise ValueError(f"lora.r must be an integer >= 1, got {self.r!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"lora.alpha must be a number > 0, got {self.alpha!r}")
        if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        if self.init not in INITS:
            raise ValueError(f"lora.init must be one of {', '.join(INITS)}, got {self.init!r}")
        t = self.target_modules
        names = LINEAR if t == "all-linear" else (t,) if isinstance(t, str) else tuple(t or ())
        bad = [n for n in names if n not in HF_TARGETS]
        if bad or not names:
            raise ValueError(f"lora.target_modules must be 'all-linear' or a list of {', '.join(HF_TARGETS)}; "
                             f"got {t!r}" + (f" ({bad[0]!r} is not one)" if bad else ""))
        object.__setattr__(self, "target_modules", tuple(n for n in HF_TARGETS if n in names))
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "dropout", float(self.dropout))

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)


@dataclasses.dataclass(frozen=True)
class ModuleSpec:
    """One adapted fused module of one layer: K its input width, slices the (c0, c1) output
    columns of each targeted slice, names their HF module names, A [S r, K] and B [N, r] (N: the
    fused output's width) its slots; slice j's rows of B are its columns slices[j]."""

    module: str
    K: int
    slices: tuple[tuple[int, int], ...]
    names: tuple[str, ...]
    A: Slot
    B: Slot


@dataclasses.dataclass(frozen=True)
class ExpertSpec:
    """A sparse layer's expert adapters: gate_up (A [E, Rg, H], B [E, 2I, Rg]) and down (A [E, r,
    I], B [E, H, r]) slot pairs, None where not targeted; their scales."""

    gate_up: tuple[Slot, Slot] | None
    down: tuple[Slot, Slot] | None
    scale_gu: float
    scale_d: float

    def slots(self) -> list[Slot]:
        return [t for pair in (self.gate_up, self.down) if pair is not None for t in pair]


def module_slices(cfg: CausalLMConfig) -> dict[str, tuple[int, tuple[tuple[int, int], ...]]]:
    """Each fused module -> (its input width K, the output columns of each of its slices)."""
    H, q, kv, I = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"qkv": (H, ((0, q), (q, q + kv), (q + kv, q + 2 * kv))), "o": (q, ((0, H),)),
            "gate_up": (H, ((0, I), (I, 2 * I))), "down": (I, ((0, H),)), "router": (H, ((0, cfg.num_experts),))}


class LoraLayout:
    """The flat layout of one adapter set: per layer, per adapted module, A then B, each slot at
    a multiple of ALIGN elements (as the base's)."""

    def __init__(self, model_cfg: CausalLMConfig, cfg: LoraConfig):
        self.model_cfg, self.cfg = model_cfg, cfg
        r, dims = cfg.r, module_slices(model_cfg)
        self.specs: dict[tuple[int, str], ModuleSpec] = {}
        off = 0
        self.experts: dict[int, ExpertSpec] = {}
        moe = model_cfg.fam.moe
        for i in range(model_cfg.num_hidden_layers):
            if moe and model_cfg.sparse_layer(i):
                off = self._experts(i, off)
            for module in MODULES:
                if module in ("gate_up", "down") and moe:
                    continue  # a MoE's MLP names are its experts' (module docstring)
                if module == "router" and not (moe and model_cfg.sparse_layer(i)):
                    continue
                picked = [(n, j) for n, (m, j) in HF_TARGETS.items() if m == module and n in cfg.target_modules]
                if not picked:
                    continue
                K, all_slices = dims[module]
                slices = tuple(all_slices[j] for _, j in picked)
                A = Slot(f"layers.{i}.{module}.A", (len(slices) * r, K), off)
                off += -(-A.numel // ALIGN) * ALIGN
                B = Slot(f"layers.{i}.{module}.B", (all_slices[-1][1], r), off)
                off += -(-B.numel // ALIGN) * ALIGN
                self.specs[(i, module)] = ModuleSpec(module, K, slices, tuple(n for n, _ in picked), A, B)
        self.numel = off
        if "gate" in cfg.target_modules and not moe:
            raise ValueError("lora.target_modules: 'gate' names a Qwen3-MoE's router; this model has none")
        if cfg.dropout and any(m == "router" for _, m in self.specs):
            raise ValueError(f"lora.dropout must be 0 with an adapter on the router (PEFT's adapters of parameters "
                             f"take none), got {cfg.dropout}")

    def _experts(self, i: int, off: int) -> int:
        """Layer i's ExpertSpec (module docstring) from offset off -> the next offset."""
        c, t, mc = self.cfg, self.cfg.target_modules, self.model_cfg
        if ("gate_proj" in t) != ("up_proj" in t):
            raise ValueError("lora.target_modules: gate_proj and up_proj are one fused tensor in a Qwen3-MoE's "
                             "experts (gate_up_proj): target both or neither, as PEFT requires")
        E, H, I = mc.num_experts, mc.hidden_size, mc.moe_intermediate_size
        pairs = {}
        for name, R, K, N in (("gate_up", 2 * c.r, H, 2 * I), ("down", c.r, I, H)):
            if name == "gate_up" and "gate_proj" not in t or name == "down" and "down_proj" not in t:
                pairs[name] = None
                continue
            A = Slot(f"layers.{i}.experts_{name}.A", (E, R, K), off)
            off += -(-A.numel // ALIGN) * ALIGN
            B = Slot(f"layers.{i}.experts_{name}.B", (E, N, R), off)
            off += -(-B.numel // ALIGN) * ALIGN
            pairs[name] = (A, B)
        if any(pairs.values()):
            if c.dropout:
                raise ValueError(f"lora.dropout must be 0 with adapters on a Qwen3-MoE's experts (PEFT's expert "
                                 f"adapters take none), got {c.dropout}")
            # gate_up: rank 2r, alpha 2 alpha (PEFT's rank_pattern and alpha_pattern for the fused pair)
            gu = 2 * c.alpha / (math.sqrt(2 * c.r) if c.rslora else 2 * c.r)
            self.experts[i] = ExpertSpec(pairs["gate_up"], pairs["down"], gu, c.scale)
        return off

    def spec(self, i: int, module: str) -> ModuleSpec | None:
        return self.specs.get((i, module))

    def all_slots(self) -> list[Slot]:
        return [s for sp in self.specs.values() for s in (sp.A, sp.B)] + \
            [s for ex in self.experts.values() for s in ex.slots()]

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Slot name ('layers.3.qkv.A') -> view of `buf`."""
        if buf.numel() != self.numel:
            raise ValueError(f"adapter buffer has {buf.numel()} elements, this LoRA layout needs {self.numel}")
        return {s.name: buf[s.offset : s.offset + s.numel].view(s.shape) for s in self.all_slots()}

    def num_params(self) -> int:
        """The adapter's parameters as PEFT counts them: A, and B's rows of targeted slices."""
        return (sum(sp.A.numel + sum(c1 - c0 for c0, c1 in sp.slices) * self.cfg.r for sp in self.specs.values())
                + sum(s.numel for ex in self.experts.values() for s in ex.slots()))


class LoraAdapters:
    """One adapter set: its weights in one flat buffer (`flat`, the model's dtype; `w` its views)
    and, once a backward needs it, a flat gradient buffer (`grad_flat`, fp32 or bf16 per
    optim.grad_dtype; `g` its views). `attach` puts it on a model, whose base then stays frozen."""

    def __init__(self, model_cfg: CausalLMConfig, cfg: LoraConfig, flat: torch.Tensor):
        self.cfg = cfg
        self.layout = LoraLayout(model_cfg, cfg)
        self.flat = flat
        self.w = self.layout.views(flat)
        self.grad_flat: torch.Tensor | None = None
        self.grad_dtype = torch.float32
        self.g: dict[str, torch.Tensor] = {}
        self._forwards = 0  # training forwards so far: each one's dropout masks have a seed of their own

    @classmethod
    def create(cls, model_cfg: CausalLMConfig, cfg: LoraConfig, device="cpu", dtype=torch.float32) -> LoraAdapters:
        """PEFT's initialisation (cfg.init), drawn in fp32 on the CPU from cfg.seed (the same
        adapter on any device), then cast: B zero, so the adapted model starts as the base."""
        lay = LoraLayout(model_cfg, cfg)
        flat = torch.zeros(lay.numel, dtype=torch.float32)
        gen = torch.Generator().manual_seed(cfg.seed)
        As = [(sp.A, sp.K, cfg.r) for sp in lay.specs.values()]
        As += [(pair[0], pair[0].shape[2], pair[0].shape[1]) for ex in lay.experts.values()
               for pair in (ex.gate_up, ex.down) if pair is not None]
        for A, K, R in As:
            a = flat[A.offset : A.offset + A.numel]
            if cfg.init == "default":  # kaiming_uniform_(a=sqrt(5)): bound = sqrt(6 / (1 + 5) / fan_in)
                a.uniform_(-1 / math.sqrt(K), 1 / math.sqrt(K), generator=gen)
            else:
                a.normal_(0.0, 1 / R, generator=gen)
        return cls(model_cfg, cfg, flat.to(device=device, dtype=dtype))

    @property
    def device(self) -> torch.device:
        return self.flat.device

    def num_params(self) -> int:
        return self.layout.num_params()

    def attach(self, model) -> LoraAdapters:
        """Adapt `model` (its forward, backward and engine read model.lora): the base is frozen
        from now on, so its gradient buffer is released and none is allocated again."""
        if self.layout.model_cfg != model.cfg:
            raise ValueError("this adapter set was laid out for another model config (layers, widths)")
        if self.flat.device != model.device or self.flat.dtype != model.dtype:
            raise ValueError(f"the adapters are {self.flat.dtype} on {self.flat.device}, the model "
                             f"{model.dtype} on {model.device}: make them with the model's dtype and device")
        model.release_grads()
        model.lora = self
        return self

    def next_seed(self) -> int:
        """The dropout seed of the next training forward (cfg.seed, the forward's count)."""
        self._forwards += 1
        return (self.cfg.seed * 1_000_003 + self._forwards) % (1 << 62)

    # ---------------------------------------------------------------- gradients (the optimizer's face)
    def ensure_grads(self) -> None:
        if self.grad_flat is None:
            self.grad_flat = torch.zeros(self.layout.numel, device=self.device, dtype=self.grad_dtype)
            self.g = self.layout.views(self.grad_flat)

    def zero_grad(self) -> None:
        self.ensure_grads()
        self.grad_flat.zero_()

    def release_grads(self) -> None:
        self.grad_flat, self.g = None, {}
