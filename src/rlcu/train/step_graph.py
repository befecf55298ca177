"""The training step as CUDA graphs: a micro-batch's forward, loss and backward captured once
per (token budget, sequence-slot bucket), and the optimizer step (gradient norm, clipping, the
non-finite gate and AdamW) captured once, then replayed every step with no Python in between.

What it takes to capture:
  - every data-dependent input lives in a buffer whose address never changes (StaticBatch,
    train/static_batch.py): the batch padded to the budget, its cu_seqlens in a fixed number of
    slots, the positions computed on the host; max_seqlen is the budget's, never the data's;
  - nothing in the region reads the device from the host: the model's input checks (`.tolist()`,
    min/max of the ids) and the head's `nonzero` row selection are skipped
    (`Qwen3.hidden_forward_unchecked`, the head over every row with zero weight where a row
    predicts nothing), and the optimizer's step scalars (lr, bias corrections, rounding key) are
    device tensors the host fills before the replay (`adamw_step_device`), its gate (skip the
    update on a non-finite loss or gradient norm) is computed on the device;
  - every kernel is compiled, and cuBLAS has its workspace on the capture stream, before
    capture: `warmup` runs of the region on the capture stream (a side stream, as
    torch.cuda.graph wants), with the optimizer gated off so that they change nothing, and the
    gradients and the loss zeroed after them.

The graphs share one memory pool (they never run at once and hand nothing to each other but the
static buffers, allocated outside the pool), which keeps the activations of one micro-batch for
as long as the graphs live. They are captured again when what they hold an address of moves
(weights, gradients, optimizer state) or the mode they were captured in changes (the model's
exact mode, gradient checkpointing).

With `graphs=False` the same code runs eagerly, op by op (on any device): the reference a
replayed step must match bit for bit, and the CPU-testable half of this file. Bit for bit needs
every kernel of the step to give the same bits whatever order its programs run in, which a
replay and an eager launch do not share: no atomics (the embedding backward's were the one
difference, in the fp32 master and moments; tests/integration/test_step_graph.py runs the step with every
launch's programs reversed).

With LoRA the adapters train and the base is frozen: the optimizer's buffers and the gradient
the graphs write are the adapters' (`model.lora.grad_flat`, kept at its address as the base's
is), and dropout's masks are drawn from a seed in device memory (`lora_seed`, ops/dropout.py)
that the host writes before each micro-batch's replay from the adapters' own count
(`LoraAdapters.next_seed`, which checkpoints save): each replay draws the masks an eager step
with the same seeds draws.

The step's loss is sum_i dlp_i lp_i over the rows (the SFT loss, whose gradient in lp is the
constant dlp), or the critic's clipped value loss (ops/rl_loss.value_loss).
"""

from __future__ import annotations

import math

import torch

from rlcu.ops._backend import use_triton
from rlcu.ops.adamw import adamw_step_device, clip_scale, grad_norm, step_coefs
from rlcu.ops.logprob import logprob_fwd_bwd
from rlcu.ops.rl_loss import value_loss
from rlcu.optim import FlatAdamW, gate
from rlcu.train.static_batch import StaticBatch

WARMUP = 2  # runs of a region before its capture


def _trunk(model):
    return getattr(model, "trunk", model)  # a Critic's Qwen3, or the Qwen3 itself


def why_not(model, optimizer=None) -> str | None:
    """Why the step of `model` (a Qwen3 or a Critic) with `optimizer` cannot be captured (None
    when it can): the reason the caller logs before it goes on eagerly."""
    t = _trunk(model)
    if model.device.type != "cuda":
        return f"CUDA graphs need a CUDA device; the model is on {model.device.type}"
    if not use_triton(model.flat):
        return "the ops run their PyTorch twins here (RLCU_BACKEND=torch)"
    if t.exact:
        return "exact mode is on (its batch-invariant kernels are not captured)"
    if t.cfg.aux_coef:
        return ("a MoE model's load-balancing loss is on (its weight by each micro-batch's tokens and the "
                "budget's padding rows are not captured)")
    if getattr(t, "lora", None) is not None and t is not model:
        return "the critic's trunk has adapters (only a policy's adapters are captured)"
    if t.grad_sink is not None:
        return "data parallel: the gradient goes to reduce-scatter buckets during the backward"
    if t.grad_dtype != torch.float32 or getattr(model, "grad_dtype", torch.float32) != torch.float32:
        return "optim.grad_dtype is bfloat16 (its embedding gradient sums the distinct ids, a host sync)"
    if optimizer is not None and type(optimizer) is not FlatAdamW:
        return f"the optimizer is a {type(optimizer).__name__} (only FlatAdamW's step is captured)"
    return None


class StepGraph:
    """The captured training step of `model` (a Qwen3: the LM head with per-token dlp weights;
    or a Critic: the value head with `value_clip`) at `budget` tokens a micro-batch and
    sequences of at most `max_seqlen` tokens. optimizer: a FlatAdamW whose step is captured
    too, or None (then `step` returns after the backward). graphs=False: the same step eagerly."""

    def __init__(self, model, optimizer=None, *, budget: int, max_seqlen: int, graphs: bool = True,
                 warmup: int = WARMUP, value_clip: float = 0.2, temperature: float = 1.0):
        if graphs and (reason := why_not(model, optimizer)):
            raise ValueError(f"cannot capture this training step: {reason}")
        self.model, self.opt, self.trunk = model, optimizer, _trunk(model)
        self.critic = self.trunk is not model
        self.lora = getattr(self.trunk, "lora", None)  # adapters train, the base frozen
        self.trained = self.lora if self.lora is not None else model  # whose grad_flat the backward writes
        self.budget, self.max_seqlen, self.graphs, self.warmup = budget, min(max_seqlen, budget), graphs, warmup
        self.value_clip, self.temperature = value_clip, temperature
        dev = model.device
        self.sb = StaticBatch(budget, dev)
        f32 = dict(device=dev, dtype=torch.float32)
        # the critic's row-aligned old values and returns
        self.v_old = torch.zeros(budget, **f32) if self.critic else None
        self.returns = torch.zeros(budget, **f32) if self.critic else None
        self.loss_sum = torch.zeros((), **f32)  # the step's loss, accumulated over its micro-batches
        self.gn, self.scale = torch.zeros((), **f32), torch.zeros((), **f32)  # the update's norm and clip
        self.coef = torch.zeros(4, **f32)  # adamw_step_device's (decay, step_size, inv_bc2_sqrt, gate)
        self.key = torch.zeros(1, device=dev, dtype=torch.int32)
        self.enable = torch.ones((), **f32)  # 0 while warming up: the update changes nothing
        # the adapters' dropout seed, written before each micro-batch (the adapters' next_seed)
        drop = self.lora is not None and self.lora.cfg.dropout > 0
        self.lora_seed = torch.zeros(1, device=dev, dtype=torch.int64) if drop else None
        self._micro_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # sequence slots -> graph
        self._update_graph = None
        self._pool = self._stream = self._state = None
        self.captures = 0

    # ---------------------------------------------------------------- the captured regions
    def _micro(self, slots: int) -> None:
        """Forward, loss and backward of the micro-batch in the static buffers; gradients and
        the loss accumulate."""
        sb, t = self.sb, self.trunk
        h = t.hidden_forward_unchecked(sb.tokens, sb.cu_view(slots), self.max_seqlen, pos=sb.pos,
                                       lora_seed=self.lora_seed)
        if self.critic:
            dh = self._value_head(h)
        else:
            w = sb.weights
            lp, _, dh = logprob_fwd_bwd(h, t.lm_head, sb.targets, lambda lp_c, ent_c, r: (w[r], None),
                                        t._head_grad(), self.temperature, False, exact=t.exact)
            self.loss_sum.add_((lp * w).sum())
        del h
        t.hidden_backward(dh)

    def _value_head(self, h: torch.Tensor) -> torch.Tensor:
        """The critic's head over every row (as Critic.forward/backward, on the shifted rows)."""
        c = self.model
        hs = h.float()
        v = hs @ c.head_w.float() + c.head_b.float()
        _, dv, st = value_loss(v, self.v_old, self.returns, self.sb.weights, clip=self.value_clip)
        self.loss_sum.add_(st[0])
        c.dhead_w += dv @ hs
        c.dhead_b += dv.sum()
        return (dv[:, None] * c.head_w.float()[None, :]).to(h.dtype)

    def _update(self) -> None:
        """The optimizer step from device scalars: norm, gate, clip scale, AdamW."""
        opt, cfg = self.opt, self.opt.cfg
        g = self.trained.grad_flat
        gn = grad_norm(g)
        ok = torch.isfinite(gn) & torch.isfinite(self.loss_sum)
        scale = clip_scale(gn, cfg.max_grad_norm) if cfg.max_grad_norm > 0 else torch.ones_like(gn)
        self.coef[3:].copy_((ok.float() * self.enable).view(1))
        b1, b2 = cfg.betas
        adamw_step_device(opt.master, g, opt.m, opt.v, None if opt.master_is_model else self.trained.flat,
                          self.coef, self.key,
                          beta1=b1, beta2=b2, eps=cfg.eps, grad_scale=scale)
        self.gn.copy_(gn)
        self.scale.copy_(scale)

    # ---------------------------------------------------------------- capture
    def _state_key(self) -> tuple:
        """What the graphs hold an address of, and the modes they were captured in. A graph's
        kernels read and write raw addresses, so an equal address is the same buffer: after
        `release_grads` the next step's zero_grad allocates a gradient buffer of the same size,
        which the caching allocator hands back at the freed block's address unless something
        took the block in between -- then the graphs write the live buffer and are kept; at
        another address they are captured again (test_step_graph_gpu.py does both)."""
        m, o, tr = self.model, self.opt, self.trained
        ptrs = (m.flat.data_ptr(), tr.flat.data_ptr(), tr.grad_flat.data_ptr())
        if o is not None:
            ptrs += (o.master.data_ptr(), o.m.data_ptr(), o.v.data_ptr())
        return ptrs + (self.trunk.exact, self.trunk._keep_mode())

    def _record(self, fn) -> torch.cuda.CUDAGraph:
        dev = self.model.device
        torch.cuda.synchronize(dev)
        if self._stream is None:
            self._stream = torch.cuda.Stream(dev)
            self._pool = torch.cuda.graph_pool_handle()
        s = self._stream
        self.enable.zero_()
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):  # compile every kernel, set cuBLAS up on this stream
            for _ in range(self.warmup):
                fn()
        torch.cuda.current_stream(dev).wait_stream(s)
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()  # the warm-up's activations: the pool takes its own
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool, stream=s):
            fn()
        torch.cuda.synchronize(dev)
        self.enable.fill_(1.0)
        self.captures += 1
        return g

    def _ensure(self, slot_set) -> None:
        """Capture what this step needs and is missing (after a state change, everything)."""
        key = self._state_key()
        if key != self._state:
            self._micro_graphs, self._update_graph, self._pool, self._stream = {}, None, None, None
            self._state = key
        for s in sorted(slot_set):
            if s not in self._micro_graphs:
                self._micro_graphs[s] = self._record(lambda s=s: self._micro(s))
        if self.opt is not None and self._update_graph is None:
            self._update_graph = self._record(self._update)

    # ---------------------------------------------------------------- one step
    def load(self, packed: dict) -> int:
        """One micro-batch (`static_batch.pack`) into the static buffers -> its sequence slots.
        A critic's batch also carries `v_old` and `returns` (row-aligned as `weights`)."""
        self.sb.load(packed)
        if self.critic:
            self.v_old.copy_(packed["v_old"])
            self.returns.copy_(packed["returns"])
        return packed["cu"].numel() - 1

    def step(self, packed: list[dict], lr: float | None = None) -> tuple[float, dict]:
        """One optimizer step over micro-batches packed at this budget -> (loss, the optimizer's
        info: grad_norm, clip_scale, skipped, nonfinite_in_row, lr; {} without an optimizer).
        Gradients are zeroed first; the loss is the sum over the micro-batches."""
        slots = [p["cu"].numel() - 1 for p in packed]  # one graph per distinct count (slot_bucket)
        self.model.zero_grad()  # allocates the gradient buffer the graphs write
        if self.graphs:
            self._ensure(set(slots))
            self.model.zero_grad()  # the warm-up runs added to it
        self.loss_sum.zero_()
        if self.opt is not None and self.graphs:
            cfg = self.opt.cfg
            vals, key = step_coefs(float(lr), cfg.betas[0], cfg.betas[1], cfg.weight_decay, self.opt.step_count + 1,
                                   cfg.rounding_seed)
            self.coef.copy_(vals)
            self.key.copy_(key)
        for p in packed:
            s = self.load(p)
            if self.lora_seed is not None:  # a forward's seed, as an eager forward draws it
                self.lora_seed.fill_(self.lora.next_seed())
            if self.graphs:
                self._micro_graphs[s].replay()
            else:
                self._micro(s)
        if self.opt is None:
            return float(self.loss_sum), {}
        if not self.graphs:
            loss = float(self.loss_sum)
            return loss, self.opt.step(lr, loss)
        self._update_graph.replay()
        loss = float(self.loss_sum)
        info, scale = gate(self.opt, self.gn, not math.isfinite(loss), loss, lr)
        if scale is not None:
            info.update(clip_scale=float(self.scale), skipped=0, nonfinite_in_row=0)
        return loss, info
