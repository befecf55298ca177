"""Adapters in PEFT's format both ways, and merged into the base.

A PEFT LoRA folder is adapter_config.json + adapter_model.safetensors, one A and one B per HF
module: `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight` [r, K] and
`...lora_B.weight` [n, r]. rlcu's fused modules (model/lora.py) stack the A of q, k and v (or gate
and up) by rows and their B likewise, so each PEFT tensor is a row range of one slot: saving and
loading copy row ranges, and `peft.PeftModel.from_pretrained` on the transformers model computes
the logits rlcu does.

A Qwen3-MoE's expert adapters are PEFT's (0.21) over transformers 5's fused expert tensors:
`target_parameters` gate_up_proj and down_proj (a ParamWrapper each, gate_up_proj's with PEFT's
rank_pattern and alpha_pattern of 2r and 2 alpha), saved as `...mlp.experts.lora_A.weight`
[E R, K] (expert e's A_e in rows e R:(e+1) R) and `lora_B.weight` [N, R E] (B_e in the columns j E
+ e: rank-major), gate_up_proj's under `experts.base_layer.` when both are adapted (the inner
wrapper). PEFT's all-linear on such a model also adapts the router (target_parameters
`gate.weight`, `mlp.gate.lora_A.weight` [r, H] and `lora_B.weight` [E, r]): rlcu's target
"gate". A transformers-4 adapter of per-expert modules is refused by name (load it in PEFT on
transformers 5 and save it again: PEFT converts it to this form).

Loading refuses, naming the field, what rlcu does not compute: DoRA, biases, modules_to_save,
per-module ranks or alphas, a subset of layers, fan_in_fan_out, a regex target, targets beside
the seven linears of a decoder layer (the LM head, the embedding), and LoRA variants that
change the product (lora_bias, a target of parameters).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from rlcu.files import atomic_write
from rlcu.model.config import CausalLMConfig
from rlcu.model.lora import HF_TARGETS, LoraAdapters, LoraConfig, LoraLayout

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp", "gate": "mlp"}
# fields whose values other than these change what the adapter computes
_MUST_BE = (("use_dora", False), ("bias", "none"), ("fan_in_fan_out", False), ("lora_bias", False))
_MUST_BE_EMPTY = ("modules_to_save", "layers_to_transform", "layers_pattern", "exclude_modules",
                  "trainable_token_indices")
EXPERT_PARAMS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",), "gate.weight": ("gate",)}
_GU_PATTERN = r".*\.gate_up_proj"  # PEFT's key for the fused pair's rank and alpha
_MLP = ("gate_proj", "up_proj", "down_proj", "gate")  # a MoE's names of parameters in transformers 5


def peft_key(i: int, name: str, ab: str) -> str:
    """PEFT's saved name of layer i's HF module `name`'s lora_A or lora_B ('A' | 'B')."""
    return f"base_model.model.model.layers.{i}.{_PARENT[name]}.{name}.lora_{ab}.weight"


def peft_tensors(ad: LoraAdapters) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT's module path -> (A [r, K], B [n, r]) views of the adapter's flat buffer."""
    r, out = ad.cfg.r, {}
    for (i, _), sp in ad.layout.specs.items():
        A, B = ad.w[sp.A.name], ad.w[sp.B.name]
        for j, (name, (c0, c1)) in enumerate(zip(sp.names, sp.slices)):
            out[(i, name)] = (A[j * r : (j + 1) * r], B[c0:c1])
    return out


def expert_tensors(ad: LoraAdapters) -> dict[str, tuple[torch.Tensor, str]]:
    """PEFT's saved name of each expert adapter tensor -> (its slot's view [E, ., .], 'A' | 'B')."""
    out = {}
    for i, ex in ad.layout.experts.items():
        both = ex.gate_up is not None and ex.down is not None
        for name, pair in (("gate_up", ex.gate_up), ("down", ex.down)):
            if pair is not None:
                pre = f"base_model.model.model.layers.{i}.mlp.experts." + ("base_layer." if name == "gate_up" and both
                                                                           else "")
                out[pre + "lora_A.weight"] = (ad.w[pair[0].name], "A")
                out[pre + "lora_B.weight"] = (ad.w[pair[1].name], "B")
    return out


def to_peft(t: torch.Tensor, ab: str) -> torch.Tensor:
    """A slot [E, R, K] -> lora_A [E R, K]; B [E, N, R] -> lora_B [N, R E] (rank-major columns)."""
    E, N, R = t.shape
    return t.reshape(E * N, R) if ab == "A" else t.permute(1, 2, 0).reshape(N, R * E)


def from_peft(p: torch.Tensor, ab: str, shape) -> torch.Tensor:
    E, N, R = shape
    return p.view(E, N, R) if ab == "A" else p.view(N, R, E).permute(2, 0, 1)


def save_adapter(ad: LoraAdapters, path, base_model: str | None = None, dtype: torch.dtype | None = None) -> None:
    """Write `ad` as a PEFT LoRA folder (each file atomically; other files kept). base_model:
    the config's base_model_name_or_path; dtype: the tensors' (default the adapter's)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = ad.cfg
    tensors = {}
    for (i, name), (A, B) in peft_tensors(ad).items():
        for ab, t in (("A", A), ("B", B)):
            tensors[peft_key(i, name, ab)] = (t.to(dtype) if dtype else t).detach().contiguous().cpu()
    for k, (t, ab) in expert_tensors(ad).items():
        tensors[k] = to_peft(t.to(dtype) if dtype else t, ab).detach().contiguous().cpu()
    atomic_write(path / WEIGHTS, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    alpha = int(c.alpha) if float(c.alpha).is_integer() else c.alpha
    modules, extra = list(c.target_modules), {}
    if ad.layout.model_cfg.fam.moe:  # the MLP names are the experts', PEFT's target_parameters
        modules = [n for n in modules if n not in _MLP] or None
        params = [p for p, names in EXPERT_PARAMS.items() if names[0] in c.target_modules]  # router: gate.weight
        extra = {"target_parameters": params or None}
        if "gate_up_proj" in params:
            extra.update(rank_pattern={_GU_PATTERN: 2 * c.r}, alpha_pattern={_GU_PATTERN: 2 * alpha})
    d = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": c.r,
         "lora_alpha": alpha, "use_rslora": c.rslora, "target_modules": modules,
         "lora_dropout": c.dropout, "bias": "none", "use_dora": False, "fan_in_fan_out": False,
         "init_lora_weights": True if c.init == "default" else c.init, "modules_to_save": None,
         "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None, "inference_mode": True, **extra}
    text = json.dumps(d, indent=2)
    atomic_write(path / CONFIG, lambda p: p.write_text(text))


def read_adapter_config(path) -> LoraConfig:
    """The LoraConfig of a PEFT folder's adapter_config.json, refusing what rlcu does not compute."""
    f = Path(path) / CONFIG
    if not f.is_file():
        raise FileNotFoundError(f"{path}: no {CONFIG} (not a PEFT adapter folder)")
    try:
        d = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{f}: not valid JSON ({e})") from None
    if d.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{f}: peft_type {d.get('peft_type')!r} is not supported (only 'LORA')")
    for k, ok in _MUST_BE:
        if d.get(k, ok) not in (ok, None):
            raise ValueError(f"{f}: {k} {d[k]!r} is not supported (only {ok!r})")
    for k in _MUST_BE_EMPTY:
        if d.get(k):
            raise ValueError(f"{f}: {k} {d[k]!r} is not supported (rlcu adapts every layer's targets with one "
                             f"r and alpha, and saves no other modules): it must be empty or null")
    t = d.get("target_modules")
    experts = _expert_targets(d, f)
    if experts and isinstance(t, list):
        if any(n in _MLP for n in t):
            raise ValueError(f"{f}: target_modules {[n for n in t if n in _MLP]} beside target_parameters: the "
                             f"MLP names of a Qwen3-MoE are its experts' (model/lora.py)")
        t = t + list(experts)
    elif experts and t is None:
        t = list(experts)
    elif experts:
        raise ValueError(f"{f}: target_modules {t!r} beside target_parameters is not supported; give a list")
    if isinstance(t, str) and t != "all-linear":
        raise ValueError(f"{f}: target_modules {t!r} (a regular expression) is not supported; give a list of "
                         f"{', '.join(HF_TARGETS)} or 'all-linear'")
    bad = [n for n in (t or []) if n not in HF_TARGETS] if isinstance(t, list) else []
    if bad:
        raise ValueError(f"{f}: target_modules {bad[0]!r} is not supported; rlcu adapts {', '.join(HF_TARGETS)}")
    init = d.get("init_lora_weights", True)
    try:
        return LoraConfig(r=d.get("r", 8), alpha=d.get("lora_alpha", 8), rslora=bool(d.get("use_rslora", False)),
                          target_modules=t, dropout=d.get("lora_dropout", 0.0),
                          init="gaussian" if init == "gaussian" else "default")
    except ValueError as e:
        raise ValueError(f"{f}: {e}") from None


def _expert_targets(d: dict, f) -> tuple[str, ...]:
    """The HF MLP names (gate_proj, up_proj, down_proj) that PEFT's target_parameters over a
    Qwen3-MoE's experts amount to, checking its rank and alpha patterns; () without any."""
    tp, r, alpha = d.get("target_parameters") or [], d.get("r", 8), d.get("lora_alpha", 8)
    names = []
    for p in tp:
        leaf = p.rpartition(".")[2] if p.endswith("_proj") else p.rpartition(".mlp.")[2]
        if leaf not in EXPERT_PARAMS:
            raise ValueError(f"{f}: target_parameters {p!r} is not supported; rlcu adapts a Qwen3-MoE's "
                             f"{', '.join(EXPERT_PARAMS)}")
        names += EXPERT_PARAMS[leaf]
    gu = "gate_proj" in names
    for k, exp in (("rank_pattern", {_GU_PATTERN: 2 * r} if gu else {}),
                   ("alpha_pattern", {_GU_PATTERN: 2 * alpha} if gu else {})):
        got = d.get(k) or {}
        if got != exp:
            raise ValueError(f"{f}: {k} {got!r} is not supported (rlcu adapts every target with one r and alpha, "
                             f"the experts' gate_up_proj at PEFT's {exp or 'none'})")
    return tuple(n for n in _MLP if n in names)


def load_adapter(path, model_cfg: CausalLMConfig, device="cpu", dtype=torch.float32) -> LoraAdapters:
    """A PEFT LoRA folder -> LoraAdapters for a model of `model_cfg` (every tensor checked: name,
    shape, finite)."""
    path = Path(path)
    cfg = read_adapter_config(path)
    ad = LoraAdapters(model_cfg, cfg, torch.zeros(LoraLayout(model_cfg, cfg).numel))
    f = path / WEIGHTS
    if not f.is_file():
        found = ("adapter_model.bin is pickled, not read: save it as safetensors"
                 if (path / "adapter_model.bin").exists() else "no weights")
        raise FileNotFoundError(f"{path}: no {WEIGHTS} ({found})")
    if ad.layout.experts and not model_cfg.fam.moe:
        raise ValueError(f"{path}: target_parameters name experts, and the base model has none")
    if model_cfg.fam.moe and not ad.layout.experts and any(n in _MLP[:3] for n in cfg.target_modules):
        raise ValueError(f"{path}: target_modules {list(cfg.target_modules)} name per-expert modules (a "
                         f"transformers-4 adapter): load it in PEFT on transformers 5 and save it again")
    want = {peft_key(i, n, ab): t for (i, n), AB in peft_tensors(ad).items() for ab, t in zip("AB", AB)}
    shaped = {k: (v, ab) for k, (v, ab) in expert_tensors(ad).items()}
    want.update({k: to_peft(v, ab) for k, (v, ab) in shaped.items()})
    try:
        with safe_open(str(f), framework="pt") as st:
            have = set(st.keys())
            extra, missing = sorted(have - set(want)), sorted(set(want) - have)
            if extra or missing:
                raise ValueError(f"{f}: " + (f"unexpected tensor(s) {', '.join(extra[:3])}" if extra else
                                             f"missing tensor(s) {', '.join(missing[:3])}")
                                 + f" for target_modules {list(cfg.target_modules)} over "
                                 f"{model_cfg.num_hidden_layers} layers")
            for k, v in want.items():
                t = st.get_tensor(k)
                if tuple(t.shape) != tuple(v.shape):
                    raise ValueError(f"{f}: tensor {k} has shape {list(t.shape)}, r={cfg.r} and the base "
                                     f"model imply {list(v.shape)}")
                if not bool(torch.isfinite(t).all()):
                    raise ValueError(f"{f}: tensor {k} holds non-finite values; refusing to load it")
                if k in shaped:
                    shaped[k][0].copy_(from_peft(t, shaped[k][1], shaped[k][0].shape))
                else:
                    v.copy_(t)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{f}: not a valid safetensors file ({type(e).__name__}: {e})") from None
    return LoraAdapters(model_cfg, cfg, ad.flat.to(device=device, dtype=dtype))


def merge_into(model, ad: LoraAdapters | None = None) -> None:
    """W += scale * B A for every adapted slice of `model`'s base (fp32 products, rounded once to
    the weights' dtype), and detach the adapters (`ad`: model.lora when None), which would
    otherwise count twice."""
    ad = model.lora if ad is None else ad
    if ad is None:
        raise ValueError("merge_into: the model has no adapters attached and none were given")
    s = ad.cfg.scale
    for i, ex in ad.layout.experts.items():  # W_e += scale B_e A_e, every expert at once
        for name, pair, sc in (("gate_up", ex.gate_up, ex.scale_gu), ("down", ex.down, ex.scale_d)):
            if pair is not None:
                W = model.w[f"layers.{i}.experts_{name}"]
                W.copy_((W.float() + sc * torch.bmm(ad.w[pair[1].name].float(), ad.w[pair[0].name].float()))
                        .to(W.dtype))
    for (i, module), sp in ad.layout.specs.items():
        W, r = model.w[f"layers.{i}.{module}"], ad.cfg.r
        A, B = ad.w[sp.A.name].float(), ad.w[sp.B.name].float()
        for j, (c0, c1) in enumerate(sp.slices):
            W[c0:c1] = (W[c0:c1].float() + s * (B[c0:c1] @ A[j * r : (j + 1) * r])).to(W.dtype)
    if model.lora is ad:
        model.lora = None


def save_merged(model, path, dtype: torch.dtype | None = None) -> None:
    """Write `model` with its attached adapters merged as a full HF folder (model/io.py's save,
    the tokenizer files of its source folder along), leaving the model itself unmerged."""
    if model.lora is None:
        raise ValueError("save_merged: the model has no adapters attached")
    merged = type(model)(model.cfg, model.flat.clone(), model.exact)
    merged.source = model.source
    merge_into(merged, model.lora)
    merged.save_pretrained(path, dtype=dtype)
