"""The model's configuration (any family of model/family.py), read from and written to HF's
config.json.

The rotary variant is `rope`, a model/rope.py RopeSpec read from every form transformers writes
(a top-level `rope_theta` with `rope_scaling`, or transformers 5's `rope_parameters`) and written
in the published form; `rope_theta` is its base, the shorthand for the default variant. A missing
`tie_word_embeddings` means the family's transformers default (untied for all four).
`Qwen3Config` is the same class (its name before the other families).

Qwen3-MoE (model/family.py `moe`) adds its MLP's fields under transformers' names: `num_experts`
(config.json's `num_experts`, or `num_local_experts` as transformers 5 writes it), the top-k
`num_experts_per_tok`, the experts' `moe_intermediate_size`, `norm_topk_prob`, and which layers
are sparse (`decoder_sparse_step`, `mlp_only_layers`: `sparse_layer`); `router_aux_loss_coef`
weighs the load-balancing loss where `output_router_logits` asks for it (transformers adds it to
the loss only then: `aux_coef`). A dense family refuses experts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from rlcu.model.family import FAMILIES, SUPPORTED_ARCHITECTURES, Family, family_of, refuse_unsupported
from rlcu.model.rope import RopeSpec

__all__ = ["SUPPORTED_ARCHITECTURES", "CausalLMConfig", "Qwen3Config", "checkpointed_layers", "layer_keeps"]


def checkpointed_layers(mode) -> int | None:
    """The number of checkpointed layers when a `gradient_checkpointing` value is one (an int,
    not a bool: True and False are the modes 'full' and 'none'), else None."""
    return mode if isinstance(mode, int) and not isinstance(mode, bool) else None


_KEEPS = {True: "inputs", "full": "inputs", "attention": "attention", False: "all", "none": "all"}


def layer_keeps(mode, num_layers: int) -> tuple[str, ...]:
    """What each layer's forward keeps for the backward under a `gradient_checkpointing` value:
    'inputs' (checkpointed: the layer's input), 'attention' (its input, attention output and
    lse) or 'all' (every activation). An int k checkpoints the first k layers and keeps every
    activation of the others: their backward runs last, once the kept layers' activations are
    freed, so the layer it recomputes adds nothing to the peak. The model's forward and the
    memory model (rlcu.memory) both read it."""
    L = num_layers
    if mode == "auto":
        raise ValueError("gradient_checkpointing 'auto' is decided by the trainers at the first update "
                         "(rlcu.train.sizing.resolve_auto); a bare model needs a mode or a number of layers")
    if checkpointed_layers(mode) is not None:
        if not 0 <= mode <= L:
            raise ValueError(f"gradient_checkpointing as a number of checkpointed layers must be in "
                             f"[0, {L}], got {mode}")
        return ("inputs",) * mode + ("all",) * (L - mode)
    try:
        return (_KEEPS[mode],) * L
    except (KeyError, TypeError):
        raise ValueError(f"gradient_checkpointing must be one of True/'full', 'attention', False/'none', "
                         f"or a number of checkpointed layers in [0, {L}]; got {mode!r}") from None


@dataclasses.dataclass
class CausalLMConfig:
    """One model's shape and family (the defaults: Qwen3-0.6B)."""

    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 40960
    bos_token_id: int | None = 151643
    eos_token_id: int | list[int] | None = 151645
    family: str = "qwen3"  # a key of model/family.py FAMILIES
    # the rotary variant; None: the default one at rope_theta. Given (a RopeSpec, or its fields as a
    # dict: model.tiny in a run's config), it wins and rope_theta becomes its theta
    rope: RopeSpec | dict | None = None
    # Qwen3-MoE (family 'qwen3_moe'); a dense family keeps num_experts 0
    num_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"CausalLMConfig.family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            val = getattr(self, f)
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"CausalLMConfig.{f} must be a positive integer, got {val!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"CausalLMConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"CausalLMConfig.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"CausalLMConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if isinstance(self.rope, dict):
            try:
                self.rope = RopeSpec(**self.rope)
            except TypeError as e:
                raise ValueError(f"CausalLMConfig.rope: {e}") from None
        if self.rope is None:
            if not self.rope_theta > 0:
                raise ValueError(f"CausalLMConfig.rope_theta must be > 0, got {self.rope_theta!r}")
            self.rope = RopeSpec(theta=float(self.rope_theta))
        elif not isinstance(self.rope, RopeSpec):
            raise ValueError(f"CausalLMConfig.rope must be a RopeSpec or a dict of its fields, got {self.rope!r}")
        self.rope_theta = self.rope.theta
        self._check_moe()

    def _check_moe(self) -> None:
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        if not self.fam.moe:
            if self.num_experts:
                raise ValueError(f"CausalLMConfig.num_experts must be 0 for family {self.family!r} (a dense MLP), "
                                 f"got {self.num_experts}; experts are family 'qwen3_moe'")
            return
        for f in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            val = getattr(self, f)
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"CausalLMConfig.{f} must be a positive integer for family 'qwen3_moe', got {val!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"CausalLMConfig.num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                             f"num_experts ({self.num_experts})")
        bad = [i for i in self.mlp_only_layers if not isinstance(i, int) or not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"CausalLMConfig.mlp_only_layers must be layer indices in [0, {self.num_hidden_layers})"
                             f", got {bad}")
        if not self.router_aux_loss_coef >= 0:
            raise ValueError(f"CausalLMConfig.router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef!r}")

    def sparse_layer(self, i: int) -> bool:
        """Layer i's MLP is the experts (transformers' Qwen3MoeDecoderLayer rule), else dense."""
        return (self.fam.moe and i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.sparse_layer(i))

    @property
    def aux_coef(self) -> float:
        """The load-balancing loss's weight in the training loss: router_aux_loss_coef where
        output_router_logits (transformers adds it only then), else 0."""
        return float(self.router_aux_loss_coef) if self.fam.moe and self.output_router_logits else 0.0

    @property
    def fam(self) -> Family:
        """The family description (model/family.py): q/k norm, q/k/v bias, published fields."""
        return FAMILIES[self.family]

    # derived sizes
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def eos_token_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else ([e] if isinstance(e, int) else list(e))

    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json") -> CausalLMConfig:
        """Any config.json form transformers writes for a supported family; a ValueError naming
        the field of any other."""
        fam = family_of(d, source)
        refuse_unsupported(fam, d, source)
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"{source}: missing required field(s) {', '.join(missing)}")
        nh = d["num_attention_heads"]
        kw = dict(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=nh, num_key_value_heads=d.get("num_key_value_heads", nh),
            head_dim=d.get("head_dim") or d["hidden_size"] // nh,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope=RopeSpec.from_hf(d, source),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", fam.tie_default)),
            max_position_embeddings=d.get("max_position_embeddings", 40960),
            bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"), family=fam.name,
        )
        if fam.moe:
            kw.update(_moe_fields(d, source))
        try:
            return cls(**kw)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> CausalLMConfig:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: config.json not found") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
        return cls.from_hf_dict(d, source=str(path))

    def to_hf_dict(self) -> dict:
        """The config.json the family's published checkpoints write."""
        fam = self.fam
        d = {
            "architectures": [fam.architecture], "model_type": fam.model_type,
            "attention_dropout": 0.0, "hidden_act": "silu",
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, **self.rope.to_hf(),
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "use_cache": True, "initializer_range": 0.02, "torch_dtype": "bfloat16",
        }
        if fam.name.startswith("qwen"):
            d["max_window_layers"] = self.num_hidden_layers
        if fam.moe:
            d.update({f: getattr(self, f) for f in _MOE_FIELDS}, mlp_only_layers=list(self.mlp_only_layers))
        d.update(fam.published)
        return d


_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
               "mlp_only_layers", "router_aux_loss_coef", "output_router_logits")
_MOE_DEFAULTS = dict(num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False, decoder_sparse_step=1,
                     mlp_only_layers=(), router_aux_loss_coef=0.001, output_router_logits=False)  # transformers'


def _moe_fields(d: dict, source: str) -> dict:
    """Qwen3-MoE's fields of a config.json: num_experts under either name, transformers' defaults."""
    E = d.get("num_experts", d.get("num_local_experts"))
    if E is None:
        raise ValueError(f"{source}: missing required field num_experts (or num_local_experts)")
    out = {f: d.get(f, v) for f, v in _MOE_DEFAULTS.items()}
    if not isinstance(out["mlp_only_layers"], (list, tuple)):
        raise ValueError(f"{source}: mlp_only_layers must be a list of layer indices, got {out['mlp_only_layers']!r}")
    out.update(num_experts=E, mlp_only_layers=tuple(out["mlp_only_layers"]),
               norm_topk_prob=bool(out["norm_topk_prob"]), output_router_logits=bool(out["output_router_logits"]))
    return out


Qwen3Config = CausalLMConfig  # the name from before the other families
