"""The causal LM of every supported family (model/family.py: Qwen3, Qwen2/2.5, Llama 3.x, Mistral)
with a hand-written backward over packed sequences. `Qwen3` is the same class (its name before
the other families); what differs between families is its config's `fam`, read by the layout
and the layer.

The decoder layer is model/layer.py's, the one the engine runs too: `_layer_fwd` runs it over
packed sequences (varlen attention over the tokens' own K/V) and keeps what the checkpointing
mode asks for; layer.layer_bwd walks those activations in reverse. With gradient checkpointing
(the default) the forward keeps only each layer's input and the backward recomputes the layer
before differentiating it; the recompute runs the same ops on the same inputs, so gradients are
bit-identical either way.

Weights are views into one flat buffer (see layout.py); gradients accumulate into a flat
buffer of the same layout (fp32, or bf16 with optim.grad_dtype). The LM head never
materialises [tokens, vocab] logits in training: `forward` goes through the fused logprob
op. When the loss's gradient is an elementwise function of each token's lp (and entropy),
`forward_backward` does both passes in one sweep of the head, which then skips the logits
recompute (3 vocabulary GEMMs, not 4).

The q/k norm and rope are the engine's kernel (ops/qkv_prep.py). Exact mode is the
model's own (`exact`, ops/exact.py), read by the engine on its weights too: with it on, the
forward's matmuls and attention are the batch-invariant ones the engine runs too, so
`forward`'s lp of a token is bit for bit the engine's sampling logprob of it; the backward is
the default mode's, its recompute of a checkpointed layer included (a gradient needs no batch
invariance, and the recompute in cuBLAS and the default attention costs what it costs in the
default mode).
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlcu.model import io, layer, moe
from rlcu.model.config import CausalLMConfig, layer_keeps
from rlcu.model.inputs import check_cu, check_ids
from rlcu.model.layout import ParamLayout
from rlcu.model.lora_run import LoraRun
from rlcu.model.rope import inv_freq, mscale
from rlcu.ops.embedding import embedding_bwd, embedding_fwd
from rlcu.ops.logprob import logprob_bwd, logprob_fwd, logprob_fwd_bwd
from rlcu.ops.matmul_invariant import mm as mm_invariant
from rlcu.ops.moe import aux_dprobs
from rlcu.ops.rmsnorm import rmsnorm_bwd, rmsnorm_fwd
from rlcu.ops.rope import positions_from_cu_seqlens


class CausalLM:
    """A causal LM of any supported family whose weights live in one flat buffer (`self.flat`)."""

    def __init__(self, cfg: CausalLMConfig, flat: torch.Tensor, exact: bool = False):
        self.cfg = cfg
        self.exact = exact  # exact on-policy mode (ops/exact.py), this model's and its engine's
        self.layout = ParamLayout(cfg)
        self.flat = flat
        self.w = self.layout.views(flat)  # slot name -> view
        self.params = self.layout.hf_views(flat)  # HF name -> view
        # the rope's frequency table [D/2] (fp32) and factor on cos/sin, made once: every rotating
        # kernel reads this tensor (a CUDA graph captures its address)
        self.inv_freq = inv_freq(cfg.rope, cfg.head_dim, flat.device)
        self.rope_mscale = mscale(cfg.rope)
        self.grad_flat: torch.Tensor | None = None
        self.grad_dtype = torch.float32  # bf16 halves the buffer (optim.grad_dtype)
        self.grads: dict[str, torch.Tensor] = {}
        self._g: dict[str, torch.Tensor] = {}
        # data parallel (rlcu.parallel.zero.GradSink): gradients go into the sink's per-layer buckets,
        # which it reduce-scatters as each layer's backward ends; None: one flat gradient buffer
        self.grad_sink = None
        # True / "full": keep each layer's input, recompute the layer in backward;
        # "attention": also keep attention's output and lse (recompute skips the attention
        # kernel, +4 bytes x q_size per token and layer); False / "none": keep everything;
        # an int k: checkpoint the first k layers, keep everything of the others
        self.gradient_checkpointing: bool | str | int = True
        self.source: Path | None = None
        self._ctx: dict | None = None  # the LM head's saved tensors
        self._trunk_ctx: dict | None = None  # the trunk's
        self.lora = None  # model/lora.py LoraAdapters (attach): applied in every forward, the base frozen
        # Qwen3-MoE's load-balancing loss: the last training forward's (a 0-dim fp32 tensor, None for a
        # dense model), and its weight in the loss the backward differentiates (None: cfg.aux_coef,
        # transformers' router_aux_loss_coef where output_router_logits; a trainer scales it per micro-batch)
        self.aux_loss: torch.Tensor | None = None
        self.aux_weight: float | None = None

    # ---------------------------------------------------------------- construction / I/O
    @property
    def device(self) -> torch.device:
        return self.flat.device

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype

    @property
    def exact(self) -> bool:
        """Exact on-policy mode (ops/exact.py): batch-invariant forward ops, shared with the engine
        that runs on this model (which drops CUDA graphs captured in the other mode)."""
        return self._exact

    @exact.setter
    def exact(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise TypeError(f"CausalLM.exact must be True or False, got {on!r}")
        self._exact = on

    @property
    def lm_head(self) -> torch.Tensor:
        return self.w["embed"] if self.cfg.tie_word_embeddings else self.w["lm_head"]

    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype=torch.float32, revision: str | None = None,
                        exact: bool = False) -> CausalLM:
        """A model folder here, or a Hugging Face Hub id ('Qwen/Qwen3-0.6B', 'ID@revision'), fetched
        into the Hub's cache (rlcu.hub); its config.json's architectures pick the family. exact:
        exact on-policy mode (ops/exact.py)."""
        from rlcu.hub import model_folder

        path = model_folder(path, revision)
        m = cls(*io.load_flat(path, device, dtype), exact)
        m.source = path
        return m

    @classmethod
    def from_config(cls, cfg: CausalLMConfig, device="cpu", dtype=torch.float32, seed: int = 0,
                    init_std: float = 0.02, exact: bool = False) -> CausalLM:
        """Random initialisation as HF does it: N(0, init_std) matrices, unit norms. exact: exact
        on-policy mode (ops/exact.py)."""
        return cls(cfg, io.random_flat(cfg, device, dtype, seed, init_std), exact)

    def save_pretrained(self, path, dtype: torch.dtype | None = None) -> None:
        """Write an HF-loadable folder: the weights and config.json, each file replaced
        atomically (temp file, fsync, rename) with the umask's mode; other files in `path`
        are kept. The tokenizer and generation files of the folder the model was loaded
        from are copied in where `path` has none."""
        io.save_folder(path, self.layout, self.flat, dtype=dtype)
        if self.source is not None:
            io.copy_side_files(self.source, path)

    def num_params(self) -> int:
        return sum(v.numel() for v in self.params.values())

    # ---------------------------------------------------------------- gradients
    @property
    def trains_base(self) -> bool:
        """False with adapters attached: the base is frozen (no gradient buffer, no weight gradients)."""
        return self.lora is None

    def _ensure_grads(self):
        if self.lora is not None:
            if self.grad_sink is not None:
                raise ValueError("a gradient sink reduces the base's buffer, which a model with adapters does not "
                                 "train: across ranks make the optimizer over the adapters (make_optimizer(model.lora"
                                 ", ...): their gradient is reduced at the step)")
            return self.lora.ensure_grads()
        if self.grad_sink is not None:
            self._g = self.grad_sink.grads
            return
        if self.grad_flat is None:
            self.grad_flat = torch.zeros(self.layout.numel, device=self.device, dtype=self.grad_dtype)
            self._g = self.layout.views(self.grad_flat)
            self.grads = self.layout.hf_views(self.grad_flat)

    def zero_grad(self) -> None:
        if self.grad_sink is not None:
            return self.grad_sink.zero_grad()
        if self.lora is not None:
            return self.lora.zero_grad()
        self._ensure_grads()
        self.grad_flat.zero_()

    def release_grads(self) -> None:
        """Free the gradient buffer and its views (between RL steps, so that the rollout
        phase does not hold it); the next zero_grad or backward allocates a zeroed one."""
        self.grad_flat, self._g, self.grads = None, {}, {}
        if self.lora is not None:
            self.lora.release_grads()
        if self.grad_sink is not None:
            self.grad_sink.release()

    def _grads_done(self, part) -> None:
        if self.grad_sink is not None:  # part: 'final_norm' (with the head), a layer index, 'embed'
            self.grad_sink.done(part)

    # ---------------------------------------------------------------- one layer
    def _layer_fwd(self, i: int, x: torch.Tensor, pos, cu, max_seqlen: int, keep: str = "none", attn=None,
                   exact: bool | None = None, lora_seed: int | None = None, router_logits=None, routes=None):
        """Decoder layer i (model/layer.py) over packed sequences -> (y, what `keep` keeps). `attn` =
        (o, lse) saved by a selective-checkpointing forward skips the attention kernel when the layer
        is recomputed. exact: the batch-invariant GEMMs and attention (None: the model's mode); the
        backward's recompute passes False. The norms and SwiGLU follow the model's mode either way.
        lora_seed: the adapters' dropout seed of a training forward (None: no dropout). router_logits:
        a sparse MoE layer's kept logits, which route the recompute as the forward (model/moe.py);
        routes: model/routes.py `Routes` (the forward's record and replay), or None."""
        ex = self.exact if exact is None else exact
        return layer.layer_fwd(self, i, x, pos, layer.Packed(self, cu, max_seqlen, ex, attn),
                               layer.Kernels(self.exact, ex), keep, lora=self._lora_run(ex, lora_seed),
                               router_logits=router_logits, routes=routes)

    def _lora_run(self, exact: bool, seed: int | None):
        return None if self.lora is None else LoraRun(self.lora, exact, seed)

    # ---------------------------------------------------------------- trunk
    def _trunk_fwd(self, tokens, cu_seqlens, max_seqlen, keep: str | tuple[str, ...], pos=None, lora_seed=None,
                   routes=None):
        """Embedding + layers. keep, one for all layers or one per layer: 'none' | 'inputs'
        (checkpointed) | 'attention' (layer input + attention output and lse) | 'all' (every
        activation). pos: the tokens' positions, or None to derive them from cu_seqlens."""
        if pos is None:
            pos = positions_from_cu_seqlens(cu_seqlens, tokens.numel())
        L = self.cfg.num_hidden_layers
        keeps = (keep,) * L if isinstance(keep, str) else keep
        x = embedding_fwd(tokens, self.w["embed"])
        saved = []
        for i in range(L):
            x, kept = self._layer_fwd(i, x, pos, cu_seqlens, max_seqlen, keeps[i], lora_seed=lora_seed, routes=routes)
            if kept is not None:
                saved.append(kept)
        aux = moe.trunk_aux(saved, tokens.numel())  # the load-balancing loss, (C, rows) for its gradient
        self.aux_loss, self._aux_grad_args = (None, None) if aux is None else (aux[0], aux[1:])
        return x, pos, saved

    def _keep_mode(self) -> tuple[str, ...]:
        """What each layer's forward keeps, per `gradient_checkpointing` (model/config.py
        `layer_keeps`)."""
        return layer_keeps(self.gradient_checkpointing, self.cfg.num_hidden_layers)

    # ---------------------------------------------------------------- public API
    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """LongTensor[B, T] -> FloatTensor[B, T, V]: logits[b, t] scores token t+1."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {list(input_ids.shape)}")
        check_ids(input_ids, self.cfg.vocab_size, "input_ids")
        B, T = input_ids.shape
        tokens = input_ids.reshape(-1).to(self.device)
        cu = torch.arange(0, (B + 1) * T, T, device=self.device, dtype=torch.int32)
        x, _, _ = self._trunk_fwd(tokens, cu, T, keep="none")
        h, _ = rmsnorm_fwd(x, self.w["final_norm"], self.cfg.rms_norm_eps, exact=self.exact)
        z = mm_invariant(h, self.lm_head) if self.exact else h @ self.lm_head.t()
        return z.float().view(B, T, -1)

    def hidden_forward(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, *, grad: bool = True, routes=None):
        """The trunk: tokens [N], cu_seqlens [S+1] int32 -> final-normed hidden states h [N, H].
        With grad=True the activations `hidden_backward` needs are kept (per the
        checkpointing mode). The critic's value head and the LM head both start here.
        routes: a Qwen3-MoE forward's model/routes.py `Routes` (its record, and replay), or None."""
        max_seqlen = check_cu(tokens, cu_seqlens, self.cfg.max_position_embeddings)
        check_ids(tokens, self.cfg.vocab_size, "tokens")
        return self.hidden_forward_unchecked(tokens, cu_seqlens, max_seqlen, grad=grad, routes=routes)

    def hidden_forward_unchecked(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, *,
                                 pos: torch.Tensor | None = None, grad: bool = True, routes=None,
                                 lora_seed: torch.Tensor | None = None):
        """`hidden_forward` without its input checks, which read the data on the host: for a
        CUDA-graph capture (train/step_graph.py), where nothing may. The caller guarantees valid
        token ids, cu_seqlens non-decreasing from 0 (empty sequences and rows past cu_seqlens[-1],
        a padded budget, are allowed: attention gives those rows zeros) and max_seqlen >= the
        longest sequence; pos [N] int32, when given, are the tokens' positions. lora_seed: the
        adapters' dropout seed as an int64 device tensor the caller fills (a captured step's, read at
        every replay); None: the adapters' next seed (LoraAdapters.next_seed), with dropout on."""
        keep = self._keep_mode() if grad else "none"
        seed = lora_seed
        if seed is None and grad and self.lora is not None and self.lora.cfg.dropout:
            seed = torch.tensor([self.lora.next_seed()], device=self.device, dtype=torch.int64)
        x, pos, saved = self._trunk_fwd(tokens, cu_seqlens, max_seqlen, keep, pos, seed, routes)
        h, rstd = rmsnorm_fwd(x, self.w["final_norm"], self.cfg.rms_norm_eps, exact=self.exact)
        self._trunk_ctx = (dict(tokens=tokens, cu=cu_seqlens, max_seqlen=max_seqlen, pos=pos, saved=saved,
                                x=x, rstd=rstd, lora_seed=seed, aux=self.aux_loss is not None, routes=routes)
                           if grad else None)
        return h

    def hidden_backward(self, dh: torch.Tensor) -> None:
        """Accumulate d(sum(dh * h))/dθ into `self.grads` for the h of the last
        `hidden_forward`. Frees the saved activations."""
        if self._trunk_ctx is None:
            raise RuntimeError("backward() needs a preceding forward(..., grad=True)")
        s, self._trunk_ctx = self._trunk_ctx, None
        self._ensure_grads()
        c, g = self.cfg, self._g
        dx, dw = rmsnorm_bwd(dh, s["x"], self.w["final_norm"], s["rstd"])
        if self.trains_base:
            g["final_norm"] += dw
        self._grads_done("final_norm")
        pos, cu, ms, seed = s["pos"], s["cu"], s["max_seqlen"], s["lora_seed"]
        lora = self._lora_run(False, seed)
        daux = self._daux() if s["aux"] else None
        for i in reversed(range(c.num_hidden_layers)):
            acts = s["saved"][i]
            if "h1" not in acts:  # checkpointed: recompute the layer from its input, in the
                # default mode's kernels even in exact mode: a gradient needs no batch invariance
                _, acts = self._layer_fwd(i, acts["x"], pos, cu, ms, "all", attn=acts.get("attn"), exact=False,
                                          lora_seed=seed, router_logits=acts.get("router_logits"),
                                          routes=s["routes"])
            acts["daux"] = daux
            s["saved"][i] = None
            dx = layer.layer_bwd(self, i, dx, acts, pos, cu, ms, lora)
            self._grads_done(i)
        if self.trains_base:
            embedding_bwd(dx, s["tokens"], g["embed"])
        self._grads_done("embed")

    def _daux(self) -> torch.Tensor | None:
        """The load-balancing loss's gradient at each row's router probabilities, weighted by
        `aux_weight` (None: cfg.aux_coef); None where the weight is 0."""
        coef = self.cfg.aux_coef if self.aux_weight is None else self.aux_weight
        return aux_dprobs(*self._aux_grad_args, coef) if coef else None

    def head_rows(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor):
        """(tgt, rows): the positions that have a predicted token, and the hidden rows
        (tgt - 1) that predict them; a sequence's first token has none."""
        has_prev = torch.ones(tokens.numel(), dtype=torch.bool, device=tokens.device)
        has_prev[cu_seqlens[:-1].long()] = False
        tgt = has_prev.nonzero()[:, 0]
        return tgt, tgt - 1

    @staticmethod
    def _per_token(N: int, tgt: torch.Tensor, lp_r: torch.Tensor, ent_r: torch.Tensor | None):
        """The head's per-row lp (and ent) at token positions, 0 at each sequence's first
        token: lp, or (lp, ent) when the head computed the entropy."""
        out = [torch.zeros(N, device=tgt.device, dtype=torch.float32).index_copy_(0, tgt, v)
               for v in (lp_r, ent_r) if v is not None]
        return tuple(out) if ent_r is not None else out[0]

    def _head_grad(self) -> torch.Tensor | None:
        if not self.trains_base:
            return None
        return self._g["embed"] if self.cfg.tie_word_embeddings else self._g["lm_head"]

    def _rows_backward(self, N: int, rows: torch.Tensor, dhs: torch.Tensor) -> None:
        """hidden_backward from the head rows' gradient dhs [R, H] (zero on the rows that
        predict nothing: each sequence's last)."""
        dh = torch.zeros(N, self.cfg.hidden_size, device=dhs.device, dtype=dhs.dtype)
        self.hidden_backward(dh.index_copy_(0, rows, dhs))

    def forward(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, *, temperature: float = 1.0,
                return_entropy: bool = False, grad: bool = True, routes=None):
        """Packed log-probabilities.

        tokens: LongTensor[N], cu_seqlens: IntTensor[S+1] (int32 offsets into tokens).
        Returns lp: FloatTensor[N] with lp[i] = log p(tokens[i] | earlier tokens of its own
        sequence) at `temperature`, 0 at each sequence's first token; with
        `return_entropy=True`, (lp, ent) where ent[i] is the entropy of the same
        distribution. With grad=True the activations `backward` needs are kept. routes: as
        `hidden_forward`'s.
        """
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        h = self.hidden_forward(tokens, cu_seqlens, grad=grad, routes=routes)
        N = tokens.numel()
        tgt, rows = self.head_rows(tokens, cu_seqlens)
        hs = h.index_select(0, rows)
        targets = tokens.index_select(0, tgt)
        lp_r, ent_r, lse = logprob_fwd(hs, self.lm_head, targets, temperature, return_entropy, exact=self.exact)
        self._ctx = (dict(N=N, hs=hs, rows=rows, tgt=tgt, targets=targets, lse=lse, temperature=temperature)
                     if grad else None)
        return self._per_token(N, tgt, lp_r, ent_r)

    def backward(self, dlp: torch.Tensor, dentropy: torch.Tensor | None = None) -> None:
        """Accumulate d(sum(dlp * lp) + sum(dentropy * ent))/dθ into `self.grads`, for the
        lp (and ent) of the last `forward`. Frees the saved activations."""
        if self._ctx is None:
            raise RuntimeError("backward() needs a preceding forward(..., grad=True)")
        s, self._ctx = self._ctx, None
        N = s["N"]
        if dlp.shape != (N,) or (dentropy is not None and dentropy.shape != (N,)):
            raise ValueError(f"dlp (and dentropy) must have shape [{N}], got {list(dlp.shape)}")
        self._ensure_grads()
        tgt = s["tgt"]
        dlp_r = dlp.float().index_select(0, tgt)
        dent_r = None if dentropy is None else dentropy.float().index_select(0, tgt)
        dhs = logprob_bwd(dlp_r, dent_r, s["hs"], self.lm_head, s["targets"], s["lse"], self._head_grad(),
                          s["temperature"])
        self._rows_backward(N, s["rows"], dhs)

    def forward_backward(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, grad_fn, *,
                         temperature: float = 1.0, return_entropy: bool = False, routes=None):
        """`forward` then `backward` with one sweep of the LM head, for a loss whose gradient
        at each token is a function of that token's own lp (and ent) and fixed per-token data:
        SFT's weights, the GRPO/PPO clipped surrogate against the rollout's logprobs, a KL to
        a reference, an entropy bonus. Each chunk's gradient is taken while its logits are in
        memory (logprob_fwd_bwd), so the head's logits are never recomputed.

        grad_fn(lp_c, ent_c, idx) -> (dlp_c, dent_c) is called once per chunk of the head:
        idx is a LongTensor[n] of token positions (never a sequence's first token), lp_c and
        ent_c are FloatTensor[n] at those positions (ent_c None unless return_entropy;
        read-only), and dlp_c, dent_c are FloatTensor[n] -- what backward's dlp[idx],
        dentropy[idx] would be -- or None. Gradients accumulate into `self.grads`; returns
        what `forward` returns. routes: as `hidden_forward`'s.
        """
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self._ctx = None  # a pending forward's head does not belong to this trunk
        h = self.hidden_forward(tokens, cu_seqlens, grad=True, routes=routes)
        N = tokens.numel()
        tgt, rows = self.head_rows(tokens, cu_seqlens)
        hs = h.index_select(0, rows)
        del h
        self._ensure_grads()
        lp_r, ent_r, dhs = logprob_fwd_bwd(hs, self.lm_head, tokens.index_select(0, tgt),
                                           lambda lp_c, ent_c, r: grad_fn(lp_c, ent_c, tgt[r]),
                                           self._head_grad(), temperature, return_entropy, exact=self.exact)
        del hs
        self._rows_backward(N, rows, dhs)
        return self._per_token(N, tgt, lp_r, ent_r)


Qwen3 = CausalLM  # the name from before the other families
