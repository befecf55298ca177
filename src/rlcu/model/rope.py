"""The rotary embedding's variant: which frequency each pair of a head turns at.

Every variant rlcu runs is a table inv_freq [D/2] (fp32) and a factor on cos and sin: pair i of
a head at position p turns by the angle p * inv_freq[i], and (cos, sin) are scaled by
`mscale` (1.0 but for YaRN). The kernels (ops/rope.py, qkv_prep.py, decode_qkv.py) read the
table the model makes once at construction (`model.inv_freq`), so a variant is host arithmetic
here and nothing in the kernels; the table's device tensor is what a CUDA graph captures.

Types (HF's `rope_type`), with theta^(-2i/D) the default frequency f_i:
- default   f_i
- linear    f_i / factor (positions interpolated)
- llama3    Llama 3.1: f_i where the wavelength 2 pi / f_i is short (< L / high_freq_factor,
            L = original_max_position_embeddings), f_i / factor where it is long
            (> L / low_freq_factor), between them the blend (1 - s) f_i / factor + s f_i with
            s = (L / wavelength - low) / (high - low)
- yarn      YaRN: the blend of f_i / factor and f_i by a ramp over the pairs between the
            correction dimensions of beta_fast and beta_slow rotations in L positions;
            mscale = 0.1 ln(factor) + 1 (or the config's attention_factor)
`dynamic` (dynamic NTK) is refused: HF recomputes the table from the longest sequence of each
forward once it passes max_position_embeddings, so a token's rotation would depend on its batch
(packed training) and on when the engine cached its K; rlcu cannot run that as HF does.

Config forms read (`RopeSpec.from_hf`): a top-level `rope_theta` with an optional `rope_scaling`
(the published checkpoints; `type` or `rope_type`), and transformers 5's `rope_parameters`
(`rope_type`, `rope_theta` and the variant's fields). `to_hf` writes the published form.
"""

from __future__ import annotations

import dataclasses
import math

import torch

TYPES = ("default", "linear", "llama3", "yarn")
_REFUSED = {
    "dynamic": "HF recomputes inv_freq from each forward's longest sequence past max_position_embeddings, which "
               "packed training and the paged engine cannot reproduce token for token",
    "longrope": "not implemented",
}
# each type's fields beside theta (those without a default are required)
_FIELDS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
             "truncate"),
}
_OPTIONAL = {"beta_fast", "beta_slow", "attention_factor", "truncate"}


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """A rotary variant (see the module docstring); the fields a type does not use stay None."""

    type: str = "default"
    theta: float = 10000.0
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None  # yarn: 32 when None
    beta_slow: float | None = None  # yarn: 1 when None
    attention_factor: float | None = None  # yarn: 0.1 ln(factor) + 1 when None
    truncate: bool | None = None  # yarn: round the correction range outwards (True when None)

    def __post_init__(self):
        if self.type in _REFUSED:
            raise ValueError(f"rope_type {self.type!r} is not supported: {_REFUSED[self.type]}; "
                             f"allowed: {', '.join(TYPES)}")
        if self.type not in TYPES:
            raise ValueError(f"rope_type must be one of {', '.join(TYPES)}, got {self.type!r}")
        if not _positive(self.theta):
            raise ValueError(f"rope_theta must be a number > 0, got {self.theta!r}")
        used = _FIELDS[self.type]
        for f in dataclasses.fields(self)[2:]:
            v = getattr(self, f.name)
            if f.name not in used:
                if v is not None:
                    raise ValueError(f"rope {f.name} is not a field of rope_type {self.type!r} "
                                     f"(its fields: {', '.join(used) or 'none beside rope_theta'})")
            elif v is None and f.name not in _OPTIONAL:
                raise ValueError(f"rope {f.name} is required for rope_type {self.type!r}")
            elif f.name == "truncate":
                if v is not None and not isinstance(v, bool):
                    raise ValueError(f"rope truncate must be true or false, got {v!r}")
            elif f.name == "original_max_position_embeddings":
                if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
                    raise ValueError(f"rope original_max_position_embeddings must be a positive integer, got {v!r}")
            elif v is not None and not _positive(v):
                raise ValueError(f"rope {f.name} must be a number > 0, got {v!r}")
        if self.factor is not None and self.factor < 1:
            raise ValueError(f"rope factor must be >= 1 (a context extension), got {self.factor!r}")
        if self.type == "llama3" and not self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"rope low_freq_factor ({self.low_freq_factor}) must be < high_freq_factor "
                             f"({self.high_freq_factor})")

    @classmethod
    def from_hf(cls, d: dict, source: str = "config.json") -> RopeSpec:
        """The variant of an HF config.json dict d (every form, see the module docstring); errors name
        the file and the field."""
        params = d.get("rope_parameters")
        scaling = d.get("rope_scaling")
        where = "rope_parameters" if params else "rope_scaling"
        p = params or scaling or {}
        if not isinstance(p, dict):
            raise ValueError(f"{source}: {where} must be an object, got {p!r}")
        if params and any(isinstance(v, dict) for v in params.values()):
            raise ValueError(f"{source}: rope_parameters per layer type is not supported")
        rtype = p.get("rope_type", p.get("type", "default"))
        theta = d.get("rope_theta")
        if theta is None:
            theta = p.get("rope_theta", 10000.0)
        if p.get("mscale") or p.get("mscale_all_dim") or p.get("partial_rotary_factor", 1.0) != 1.0:
            bad = next(k for k in ("mscale", "mscale_all_dim", "partial_rotary_factor") if k in p)
            raise ValueError(f"{source}: {where}.{bad} is not supported")
        if rtype not in TYPES and rtype not in _REFUSED:
            raise ValueError(f"{source}: {where}.rope_type must be one of {', '.join(TYPES)}, got {rtype!r}")
        kw = {k: p.get(k) for k in _FIELDS.get(rtype, ())}
        if rtype == "yarn" and kw["original_max_position_embeddings"] is None:
            kw["original_max_position_embeddings"] = d.get("max_position_embeddings")  # HF's fallback
        try:
            return cls(type=rtype, theta=theta, **kw)
        except ValueError as e:
            raise ValueError(f"{source}: {where}: {e}") from None

    def to_hf(self) -> dict:
        """The keys the published checkpoints write: rope_theta, and rope_scaling (None for default)."""
        if self.type == "default":
            return {"rope_theta": self.theta, "rope_scaling": None}
        scaling = {"rope_type": self.type}
        for k in _FIELDS[self.type]:
            if getattr(self, k) is not None:
                scaling[k] = getattr(self, k)
        return {"rope_theta": self.theta, "rope_scaling": scaling}


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def inv_freq(spec: RopeSpec, head_dim: int, device=None) -> torch.Tensor:
    """The frequency table [head_dim / 2] (fp32) on `device`. Formed on the CPU in fp32, as HF forms
    it, so that every device reads the same bits."""
    D = head_dim
    if D < 2 or D % 2:
        raise ValueError(f"rope: head_dim must be even and >= 2, got {D}")
    f = 1.0 / (spec.theta ** (torch.arange(0, D, 2, dtype=torch.int64, device="cpu").float() / D))  # [D/2]
    if spec.type == "linear":
        f = f / spec.factor
    elif spec.type == "llama3":
        f = _llama3(spec, f)
    elif spec.type == "yarn":
        f = _yarn(spec, D)
    return f.to(device)


def _llama3(s: RopeSpec, f: torch.Tensor) -> torch.Tensor:
    L = s.original_max_position_embeddings
    wavelen = 2 * math.pi / f
    long = wavelen > L / s.low_freq_factor  # low frequencies: interpolated
    short = wavelen < L / s.high_freq_factor  # high frequencies: kept
    scaled = torch.where(long, f / s.factor, f)
    smooth = (L / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blend = (1 - smooth) * scaled / s.factor + smooth * scaled
    return torch.where(~long & ~short, blend, scaled)


def _yarn(s: RopeSpec, D: int) -> torch.Tensor:
    # the pair whose frequency makes r rotations in L positions: D ln(L / (2 pi r)) / (2 ln theta)
    def pair_of(r: float) -> float:
        return D * math.log(s.original_max_position_embeddings / (r * 2 * math.pi)) / (2 * math.log(s.theta))

    lo, hi = pair_of(s.beta_fast or 32), pair_of(s.beta_slow or 1)
    if s.truncate is not False:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, D - 1)
    if lo == hi:
        hi += 0.001
    base = s.theta ** (torch.arange(0, D, 2, device="cpu").float() / D)  # 1 / f_i
    ramp = ((torch.arange(D // 2, dtype=torch.float32, device="cpu") - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp  # 1: f_i, 0: f_i / factor
    return (1.0 / (s.factor * base)) * (1 - keep) + (1.0 / base) * keep


def mscale(spec: RopeSpec) -> float:
    """The factor on cos and sin: YaRN's attention factor, else 1.0."""
    if spec.type != "yarn":
        return 1.0
    if spec.attention_factor is not None:
        return float(spec.attention_factor)
    return 0.1 * math.log(spec.factor) + 1.0 if spec.factor > 1 else 1.0
