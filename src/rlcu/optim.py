"""AdamW over flat buffers, with gradient clipping and non-finite step skipping.

The model's weights live in one flat buffer (`model.flat`), its gradients in another
(`model.grad_flat`, fp32 or bf16). Two precisions of the optimizer state
(`optim.master_weights`, `optim.state_dtype`; bytes per parameter of a bf16 model, weights
+ state):
    master_weights  state_dtype  kept                                   bytes
    true            float32      fp32 master, fp32 m, v (the default)   2 + 12
    false           bfloat16     bf16 weights are the master, bf16 m, v 2 + 4
(and the two mixed ones). `optim.grad_dtype: bfloat16` makes the model's gradient buffer bf16
(2 bytes a parameter instead of 4; the kernels read either). With a master, every update is
written back to the bf16 working weights in the same kernel, rounded to nearest; without,
the bf16 weights are updated in place with stochastic rounding (unbiased: small updates
survive in expectation), and so are bf16 moments; the random bits are a hash of
(rounding_seed, step, element), so a resumed run is exact. An fp32 model is its own master either way.

One step: n = ||g||; if the loss or n is not finite the step is skipped (nothing changes,
a counter of skips in a row grows, and at `max_nonfinite_in_row` the step raises
NonFiniteError so the trainer can checkpoint the last good state and stop); else
g is scaled by c = min(1, max_grad_norm / (n + 1e-6)) inside the AdamW kernel. Works for
any object with `.flat`, `.grad_flat` and `.layout` (the policy, the critic).

Why here, below parallel and train: the trainers step FlatAdamW in one process, and
rlcu.parallel.zero's ShardedAdamW (the same update over 1/N shards across ranks) shares its
state dtypes and its update gate (`STATE_DTYPES`, `gate`); parallel imports nothing of train,
so what both use lives under both.
"""

from __future__ import annotations

import math

import torch

from rlcu.config import OptimConfig
from rlcu.errors import NonFiniteError
from rlcu.ops.adamw import adamw_step, clip_scale, grad_norm

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # optim.state_dtype, optim.grad_dtype


def gate(opt, gn_t: torch.Tensor, loss_bad: bool, lossf: float | None, lr: float) -> tuple[dict, torch.Tensor | None]:
    """The update gate FlatAdamW and the sharded AdamW share: (info, clip scale), the scale None
    when the step is skipped (a non-finite loss or gradient norm), NonFiniteError after
    optim.max_nonfinite_in_row skipped steps in a row. Counts the step on `opt` when it goes on."""
    gn = float(gn_t)
    info = {"grad_norm": gn, "lr": float(lr)}
    if loss_bad or not math.isfinite(gn):
        opt.nonfinite_in_row += 1
        opt.skipped_total += 1
        info.update(clip_scale=0.0, skipped=1, nonfinite_in_row=opt.nonfinite_in_row)
        if opt.nonfinite_in_row >= opt.cfg.max_nonfinite_in_row:
            raise NonFiniteError(
                f"{opt.nonfinite_in_row} optimizer steps in a row had a non-finite "
                f"{'loss' if loss_bad else 'gradient norm'} (loss={lossf}, grad_norm={gn}); aborting "
                f"(optim.max_nonfinite_in_row={opt.cfg.max_nonfinite_in_row}). Lower optim.lr or check the data.",
                info)
        return info, None
    opt.nonfinite_in_row = 0
    if opt.cfg.max_grad_norm > 0:
        scale = clip_scale(gn_t, opt.cfg.max_grad_norm)
    else:
        scale = torch.ones((), device=gn_t.device, dtype=torch.float32)
    opt.step_count += 1
    return info, scale


class FlatAdamW:
    def __init__(self, model, cfg: OptimConfig):
        self.model = model
        self.cfg = cfg
        flat = model.flat
        if flat.dtype == torch.float32 or not cfg.master_weights:
            if flat.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"optim.master_weights: false needs bfloat16 (or float32) weights: stochastic "
                                 f"rounding is written for bf16; got {flat.dtype}")
            self.master = flat  # updated in place (stochastic rounding when bf16)
        else:
            self.master = flat.detach().float().clone()
        gd = STATE_DTYPES[cfg.grad_dtype] if flat.dtype == torch.bfloat16 else torch.float32
        if getattr(model, "grad_dtype", gd) != gd:
            model.release_grads()  # reallocated in the new dtype at the next backward
        model.grad_dtype = gd
        sd = STATE_DTYPES[cfg.state_dtype]
        self.m = torch.zeros(flat.numel(), device=flat.device, dtype=sd)
        self.v = torch.zeros(flat.numel(), device=flat.device, dtype=sd)
        self.step_count = 0  # applied updates (the 1-based AdamW step of the next one is +1)
        self.nonfinite_in_row = 0
        self.skipped_total = 0

    @property
    def master_is_model(self) -> bool:
        return self.master is self.model.flat

    def zero_grad(self) -> None:
        self.model.zero_grad()

    def state_bytes(self) -> dict:
        """Bytes held by the optimizer's own buffers (the master only when it is a copy)."""
        out = {"m": self.m.numel() * self.m.element_size(), "v": self.v.numel() * self.v.element_size()}
        out["master"] = 0 if self.master_is_model else self.master.numel() * self.master.element_size()
        return out

    def step(self, lr: float, loss: float | torch.Tensor | None = None) -> dict:
        """Apply one update with learning rate `lr` from `model.grad_flat`. Returns
        {grad_norm, clip_scale, skipped (0/1), nonfinite_in_row, lr}."""
        g = self.model.grad_flat
        if g is None:
            raise RuntimeError("optimizer step without gradients: call model.backward first")
        lossf = None if loss is None else float(loss)
        info, scale = gate(self, grad_norm(g), lossf is not None and not math.isfinite(lossf), lossf, lr)
        if scale is None:
            return info
        b1, b2 = self.cfg.betas
        adamw_step(self.master, g, self.m, self.v, None if self.master_is_model else self.model.flat,
                   lr=float(lr), beta1=b1, beta2=b2, eps=self.cfg.eps, weight_decay=self.cfg.weight_decay,
                   step=self.step_count, grad_scale=scale, seed=self.cfg.rounding_seed)
        info.update(clip_scale=float(scale), skipped=0, nonfinite_in_row=0)
        return info

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """CPU copies of the state (m, v in their storage dtype). The master weights are
        included only when they are a separate fp32 copy (otherwise they are the model's
        weights, saved with the model folder)."""
        d = {"step_count": self.step_count, "nonfinite_in_row": self.nonfinite_in_row,
             "skipped_total": self.skipped_total, "m": self.m.cpu().clone(), "v": self.v.cpu().clone()}
        if not self.master_is_model:
            d["master"] = self.master.cpu().clone()
        return d

    def load_state_dict(self, d: dict) -> None:
        for k in ("m", "v"):
            if d[k].shape != self.m.shape:
                raise ValueError(f"optimizer state {k} has shape {list(d[k].shape)}, this model's layout "
                                 f"needs {list(self.m.shape)} (a checkpoint of another model?)")
        self.m.copy_(d["m"])  # a checkpoint of the other state_dtype is converted (rounded to nearest)
        self.v.copy_(d["v"])
        if "master" in d:  # the fp32 master of a bf16 run (also the best weights for an fp32 model)
            self.master.copy_(d["master"])
            if not self.master_is_model:
                self.model.flat.copy_(self.master)
        elif not self.master_is_model:
            self.master.copy_(self.model.flat)  # a checkpoint of an fp32 run loaded into bf16
        self.step_count = int(d["step_count"])
        self.nonfinite_in_row = int(d.get("nonfinite_in_row", 0))
        self.skipped_total = int(d.get("skipped_total", 0))
