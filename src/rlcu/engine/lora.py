"""The engine's LoRA adapters: slots the grouped kernels read, and the apply object a step passes
to the layer (model/layer.py's `lora`).

`LoraSlots` holds the n adapters an engine serves, unmerged (the base stays one shared, exact
copy): per adapted module of each layer a stacked A [n, S r, K] and B [n, N, r] (ops/lora.py's
`a` and `b`) and one scale per slot. Two ways to hold them:
- zero-copy, for one adapter whose layout is the slots' (the RL case: the model's own attached
  adapter, model/lora.py `attach`): the stacks are views of the trainer's live buffer with a
  leading dim of 1, so the engine reads the adapter being trained as it reads the base;
- a slab [n, numel] of the slots' layout otherwise (several adapters, or ranks and target sets
  that differ): each adapter is copied in, zero-padded to the largest rank and to the union of
  the target modules (a zero row of A gives h exactly 0, a zero row of B adds exactly 0, so the
  padding changes no bit), once for an adapter the engine loaded, at every `refresh` (each
  generate call) for the model's live one, so that it too is always the trainer's; when the
  adapters already are the rows of one such slab (a LoRA host's jobs, made so), it is read in
  place and nothing is copied.
The kernels take a slot's stride as it is, so a row's bits are those of the trainer's exact
forward (model/lora_run.py: the same kernels over A[None], idx 0) whenever the slot's layout is
the adapter's own (unpadded).

`LoraStep` binds the slots to a step's per-token idx tensor ([N] int32, the sequence's slot or
-1 for the base): the decode and prefill graphs keep it among their static inputs, so a replay
with other sequences' adapters needs only their new idx.

A Qwen3-MoE's expert adapters (model/lora.py `ExpertSpec`) are served for one adapter, read in
place: `LoraStep.experts` hands the layer its A_e, B_e with a per-token switch (idx -1: the base
request's tokens take none), which ops/moe.py applies through the grouped expert GEMMs; several
adapters with expert targets are refused by name (the grouped GEMMs take one A_e, B_e an expert).

`resolve` turns `LLM(lora=...)` (a PEFT folder, a LoraAdapters, or a dict of names to either)
into named adapters on the model's device, refusing by name one that does not fit the base.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlcu.model.lora import HF_TARGETS, LoraAdapters, LoraConfig, LoraLayout
from rlcu.model.lora_run import expert_lora
from rlcu.ops.lora import lora_apply

BASE = "base"  # the request-level name of "no adapter"
DEFAULT = "default"  # the name of the one adapter LLM(lora=PATH or LoraAdapters) serves
MODEL = "model"  # the name of the model's own attached adapter (the trainer's)


class LoraSlots:
    """Named adapters stacked for the grouped kernels (see the module docstring). adapters:
    [(name, LoraAdapters)] on `model`'s device and dtype; live: the names whose buffers a
    trainer updates (copied again at every `refresh` unless read in place)."""

    def __init__(self, model, adapters: list[tuple[str, LoraAdapters]], live: frozenset = frozenset()):
        if not adapters:
            raise ValueError("LoraSlots needs at least one adapter")
        self.names = [n for n, _ in adapters]
        self.sources = [ad for _, ad in adapters]
        self.live = frozenset(live)
        cfgs = [ad.cfg for ad in self.sources]
        targets = tuple(t for t in HF_TARGETS if any(t in c.target_modules for c in cfgs))
        r = max(c.r for c in cfgs)
        self.cfg = LoraConfig(r=r, alpha=r, target_modules=targets)  # the layout's; scales are per slot
        self.layout = LoraLayout(model.cfg, self.cfg)
        dev = model.device
        self.scale = torch.tensor([c.scale for c in cfgs], device=dev, dtype=torch.float32)
        self.slices = {k: sp.slices for k, sp in self.layout.specs.items()}
        self.ptrs = [ad.flat.data_ptr() for ad in self.sources]
        one = self.sources[0]
        self.in_place = (len(adapters) == 1 and one.cfg.r == r and one.cfg.target_modules == targets
                         and one.flat.device == dev and one.flat.dtype == model.dtype)
        self.experts, self.dtype = self.layout.experts, model.dtype
        if self.experts and not self.in_place:
            raise ValueError(f"LLM.lora: adapters on a Qwen3-MoE's experts are served one at a time, read in place "
                             f"(the model's dtype and device); got {len(adapters)} adapter(s) "
                             f"({', '.join(self.names)}): serve one per engine")
        if self.in_place:  # views of the adapter's own buffer
            self.flat = None
            self.a = {k: one.w[sp.A.name][None] for k, sp in self.layout.specs.items()}
            self.b = {k: one.w[sp.B.name][None] for k, sp in self.layout.specs.items()}
            return
        n, L = len(adapters), self.layout.numel
        slab = _shared_slab(self.sources, self.layout, model)
        self.in_place = slab is not None  # the adapters are the rows of one slab already: read in place
        self.flat = slab if slab is not None else torch.zeros(n, L, device=dev, dtype=model.dtype)
        self.a = {k: self.flat[:, sp.A.offset:sp.A.offset + sp.A.numel].view(n, *sp.A.shape)
                  for k, sp in self.layout.specs.items()}
        self.b = {k: self.flat[:, sp.B.offset:sp.B.offset + sp.B.numel].view(n, *sp.B.shape)
                  for k, sp in self.layout.specs.items()}
        for j in range(n if slab is None else 0):
            self._copy_in(j)

    def index(self, name: str) -> int:
        return self.names.index(name)

    def moved(self) -> bool:
        """Whether an adapter's buffer was replaced since (the slots then hold stale views)."""
        return any(ad.flat.data_ptr() != p for ad, p in zip(self.sources, self.ptrs))

    def refresh(self) -> None:
        """Copy the live adapters into their slots again (nothing to do when read in place)."""
        if not self.in_place:
            for j, n in enumerate(self.names):
                if n in self.live:
                    self._copy_in(j)

    def _copy_in(self, j: int) -> None:
        """Adapter j into slot j of the slab (cast to its device and dtype): each targeted
        slice's A rows and B rows where the slots' layout has them (the rest stay zero)."""
        src = self.sources[j]
        r = src.cfg.r
        for k, sp in src.layout.specs.items():
            dst = self.layout.specs[k]
            A, B = src.w[sp.A.name], src.w[sp.B.name]
            a, b = self.a[k][j], self.b[k][j]
            for s, name in enumerate(sp.names):
                d = dst.names.index(name)
                a[d * self.cfg.r:d * self.cfg.r + r] = A[s * r:(s + 1) * r]
                c0, c1 = sp.slices[s]
                b[c0:c1, :r] = B[c0:c1]

    def step(self, idx: torch.Tensor) -> LoraStep:
        return LoraStep(self, idx)


def _shared_slab(sources: list[LoraAdapters], layout: LoraLayout, model) -> torch.Tensor | None:
    """The [n, numel] tensor whose row j is adapter j's flat buffer, when the adapters were made
    that way (a LoRA host's jobs, train/lora_host.py) and each is laid out as the slots are (same
    rank and targets, the model's dtype and device); else None (the slots copy them)."""
    slab = sources[0].flat._base
    if slab is None or slab.dim() != 2 or tuple(slab.shape) != (len(sources), layout.numel):
        return None
    for j, ad in enumerate(sources):
        if (ad.flat._base is not slab or ad.flat.data_ptr() != slab[j].data_ptr() or ad.cfg.r != layout.cfg.r
                or ad.cfg.target_modules != layout.cfg.target_modules or ad.flat.dtype != model.dtype
                or ad.flat.device != model.device):
            return None
    return slab if slab.is_contiguous() else None


class LoraStep:
    """model/layer.py's `lora` for one engine step: after each adapted linear, y += scale[s]
    (x A_s^T) B_s^T for each row's slot s = idx[row] (none where idx is -1), by the grouped
    kernels in one shrink and one expand launch for the whole mixed batch (ops/lora.py's
    lora_apply).

    With more than one slot the step's rows are grouped by slot once (`order`, a stable argsort
    of idx on the device, inside the graphs), which every module's launches share: a kernel tile
    runs one pass per slot its rows hold, so a batch whose adapters are interleaved (jobs
    submitted together) costs about one pass a tile instead of one per slot (H200, Qwen3-8B's
    modules, 8 slots, 256 rows: 385 us a layer unordered, 138 ordered, 111 for one adapter;
    bench/results/lora_kernel.json). The order changes the speed only, never a row's bits."""

    def __init__(self, slots: LoraSlots, idx: torch.Tensor):
        self.slots, self.idx = slots, idx
        multi = slots.scale.numel() > 1  # fixed while the slots are: new slots drop the graphs
        self.order = torch.argsort(idx, stable=True).to(torch.int32) if multi and idx.numel() > 1 else None
        self.keep = None  # the expert adapters' per-token switch, made at the first sparse layer

    def experts(self, i: int):
        """Sparse layer i's expert adapters (the one slot's, read in place) for the tokens whose
        idx is not -1, or None (model/lora_run.py `experts`)."""
        s = self.slots
        if i not in s.experts:
            return None
        if self.keep is None:
            self.keep = (self.idx >= 0).to(s.dtype)  # once a step, on the device (inside the graphs)
        one = s.sources[0]  # its own layout: the slots' is laid out with alpha = r (scales per slot)
        return expert_lora(one.layout.experts[i], one.w, self.keep)

    def apply(self, i: int, module: str, x: torch.Tensor, y: torch.Tensor) -> None:
        s, key = self.slots, (i, module)
        a = s.a.get(key)
        if a is None:
            return
        lora_apply(x, a, s.b[key], self.idx, y, s.scale, s.slices[key], self.order)


_SHAPE = ("family", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
          "num_key_value_heads", "head_dim")


def _fit(name: str, ad: LoraAdapters, model) -> LoraAdapters:
    """ad itself (a live buffer, which the slots copy from with a cast where its device or dtype
    is not the model's), refused by name if laid out for another base (family, layers, widths)."""
    c, m = ad.layout.model_cfg, model.cfg
    diff = next((f for f in _SHAPE if getattr(c, f) != getattr(m, f)), None)
    if diff is not None:
        raise ValueError(f"LLM.lora[{name!r}]: the adapter was laid out for another base model ({diff} "
                         f"{getattr(c, diff)!r}, the model's {getattr(m, diff)!r})")
    return ad


def _load(name: str, spec, model) -> LoraAdapters:
    from rlcu.model.lora_peft import load_adapter

    if isinstance(spec, LoraAdapters):
        return _fit(name, spec, model)
    if not isinstance(spec, (str, Path)):
        raise TypeError(f"LLM.lora[{name!r}] must be a PEFT adapter folder or a LoraAdapters, "
                        f"got {type(spec).__name__}")
    try:
        return load_adapter(spec, model.cfg, device=model.device, dtype=model.dtype)
    except (ValueError, FileNotFoundError) as e:
        raise type(e)(f"LLM.lora[{name!r}] ({spec}) does not fit the base model: {e}") from None


def resolve(lora, model) -> tuple[dict[str, LoraAdapters], str | None, frozenset]:
    """LLM(lora=...) -> ({name: adapter}, the default name or None, the live names). A folder or
    a LoraAdapters is one adapter named 'default', which requests use unless they name another;
    a dict names each (no default: requests take the base unless they name one). The names
    'base' and 'model' are reserved (the base; the model's attached adapter). A folder is loaded
    onto the model's device and dtype; a LoraAdapters is live (a trainer's, or a job's beside
    others on one base): the slots read it in place or copy it again every generate call."""
    if lora is None:
        return {}, None, frozenset()
    if isinstance(lora, dict):
        out = {}
        for name, spec in lora.items():
            if not isinstance(name, str) or not name or name in (BASE, MODEL):
                raise ValueError(f"LLM.lora: adapter names must be non-empty strings other than {BASE!r} and "
                                 f"{MODEL!r}, got {name!r}")
            out[name] = _load(name, spec, model)
    else:
        out = {DEFAULT: _load(DEFAULT, lora, model)}
    live = frozenset(n for n, spec in (lora.items() if isinstance(lora, dict) else [(DEFAULT, lora)])
                     if isinstance(spec, LoraAdapters))
    return out, (None if isinstance(lora, dict) else DEFAULT), live
