"""The model's configuration (any family of model/family.py), read from and written to HF's
config.json.

The rotary variant is `rope`, a model/rope.py RopeSpec read from every form transformers writes
(a top-level `rope_theta` with `rope_scaling`, or transformers 5's `rope_parameters`) and written
in the published form; `rope_theta` is its base, the shorthand for the default variant. A missing
`tie_word_embeddings` means the family's transformers default (untied for all four).
`Qwen3Config` is the same class (its name before the other families).
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
        d.update(fam.published)
        return d


Qwen3Config = CausalLMConfig  # the name from before the other families
