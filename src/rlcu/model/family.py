"""The model families rlcu runs, each a small description rather than a copy of the model.

Every supported family is the same decoder (model/layer.py): RMSNorm, GQA attention with rotary
embeddings, SwiGLU MLP. What differs is stated here and read by the layout (which slots exist),
the layer (q/k norm or rope alone, a q/k/v bias), the config reader (which fields it must refuse)
and the writer (the published config.json form). The rope variant is the config's, any family's
(model/rope.py: Llama 3.1's llama3 scaling, Qwen2.5's YaRN for long contexts, ...):
- Qwen3: per-head q/k RMSNorm, no bias.
- Qwen2 (Qwen2 and Qwen2.5): q/k/v biases, no q/k norm.
- Llama (3, 3.1, 3.2, 3.3): neither; `attention_bias` / `mlp_bias` true is refused.
- Mistral (7B v0.3 and later): as Llama; a sliding window is refused (the attention kernels are
  full causal).
- Qwen3-MoE: Qwen3's attention; the MLP of a sparse layer is a router and experts (model/moe.py),
  the others (`mlp_only_layers`, `decoder_sparse_step`) Qwen3's dense MLP.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # rlcu's name, also HF's model_type
    architecture: str  # HF's architectures[0]
    qk_norm: bool  # per-head RMSNorm of q and k before rope
    qkv_bias: bool  # biases on the q, k and v projections
    tie_default: bool  # tie_word_embeddings when config.json omits it (transformers' default)
    moe: bool = False  # mixture-of-experts MLPs on the sparse layers (model/moe.py)
    published: tuple[tuple[str, object], ...] = ()  # fixed fields its config.json carries

    @property
    def model_type(self) -> str:
        return self.name


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen3", "Qwen3ForCausalLM", qk_norm=True, qkv_bias=False, tie_default=False,
           published=(("attention_bias", False), ("use_sliding_window", False), ("sliding_window", None))),
    Family("qwen2", "Qwen2ForCausalLM", qk_norm=False, qkv_bias=True, tie_default=False,
           published=(("use_sliding_window", False), ("sliding_window", None))),
    Family("llama", "LlamaForCausalLM", qk_norm=False, qkv_bias=False, tie_default=False,
           published=(("attention_bias", False), ("mlp_bias", False), ("pretraining_tp", 1))),
    Family("mistral", "MistralForCausalLM", qk_norm=False, qkv_bias=False, tie_default=False,
           published=(("sliding_window", None),)),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, qkv_bias=False, tie_default=False, moe=True,
           published=(("attention_bias", False), ("use_sliding_window", False), ("sliding_window", None))),
)}
BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES.values()}
SUPPORTED_ARCHITECTURES = tuple(BY_ARCHITECTURE)


def family_of(d: dict, source: str) -> Family:
    """The family a config.json dict names (architectures, else model_type), or a ValueError
    naming what is supported."""
    archs = d.get("architectures") or []
    if not isinstance(archs, list):
        raise ValueError(f"{source}: architectures must be a list, got {archs!r}")
    for a in archs:  # a reward model's ...ForSequenceClassification is its family's trunk
        a = a.replace("ForSequenceClassification", "ForCausalLM") if isinstance(a, str) else a
        if a in BY_ARCHITECTURE:
            return BY_ARCHITECTURE[a]
    mt = d.get("model_type")
    if not archs and mt in FAMILIES:
        return FAMILIES[mt]
    raise ValueError(f"{source}: unsupported architecture {archs or mt!r}; rlcu supports "
                     f"{', '.join(SUPPORTED_ARCHITECTURES)} (model_type {', '.join(map(repr, FAMILIES))})")


def refuse_unsupported(fam: Family, d: dict, source: str) -> None:
    """A ValueError naming the first field of config.json whose value this family's rlcu model
    does not compute as transformers would."""
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
    if not fam.qkv_bias and d.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias true is not supported for {fam.architecture} "
                         f"(biases on q/k/v/o); only attention_bias false")
    if d.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias true is not supported (the MLP has no biases)")
    if fam.name == "mistral":
        if "sliding_window" not in d or d["sliding_window"] is not None:
            raise ValueError(f"{source}: sliding_window is {d.get('sliding_window', 'missing (4096)')!r}; "
                             f"rlcu supports MistralForCausalLM only with sliding_window null (full attention, "
                             f"Mistral 7B v0.3 and later)")
    elif d.get("use_sliding_window"):
        raise ValueError(f"{source}: use_sliding_window true is not supported (full attention only)")
