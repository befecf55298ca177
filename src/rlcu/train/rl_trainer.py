"""The machinery GRPO and PPO share: `RLTrainer` (model, tokenizer, engine, frozen reference,
prompt data, rewards, optimizer, logger, checkpoints, evaluation, the step loop) and its pieces.

A subclass implements `train_step(step)`; the shared `_policy_update` is one optimizer step of
the policy over a packed rollout batch, micro-batch by micro-batch through
model.forward_backward, whose LM-head sweep applies the fused policy loss (clipped ratio
against the sampling logprobs, k3 KL to the reference, entropy bonus) chunk by chunk and takes
dlp, dent from it at once -> FlatAdamW.

Memory by phase: the engine's KV pool (sized to one step's sequences) lives only through the
rollout (llm.sleep() / wake()), the gradient buffer only through the updates
(optim.release_grads); what stays across phases is the weights, the optimizer state (fp32
master + m, v, or bf16 m, v with optim.master_weights: false, optim.state_dtype: bfloat16) and,
with a KL term, the frozen reference's weights.

Reproducibility: the data order is a seeded permutation per epoch (`PromptSampler`, whose state
is one integer) and every step's sampling seed is a function of (seed, step), so a run resumed
from a checkpoint makes the same rollouts.
"""

from __future__ import annotations

import abc
import inspect
import math
import time
from pathlib import Path

import torch

from rlcu.ops.rl_loss import POLICY_STATS, policy_loss
from rlcu.train import losses
from rlcu.train import rollout as ro
from rlcu.train.rl_config import RLConfig


class PromptSampler:
    """Rows in a seeded random order, epoch after epoch; the state is one integer."""

    def __init__(self, rows: list[dict], seed: int, shuffle: bool = True, pos: int = 0):
        if not rows:
            raise ValueError("the prompt dataset is empty")
        self.rows, self.seed, self.shuffle, self.pos = rows, seed, shuffle, pos
        self._epoch, self._perm = -1, None

    def _order(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            n = len(self.rows)
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perm = torch.randperm(n, generator=g).tolist()
            else:
                self._perm = list(range(n))
            self._epoch = epoch
        return self._perm

    def next(self, k: int) -> list[dict]:
        out = []
        n = len(self.rows)
        for _ in range(k):
            e, i = divmod(self.pos, n)
            out.append(self.rows[self._order(e)[i]])
            self.pos += 1
        return out


def _config(cls, config):
    from rlcu.config import _build, load_config

    if config is None:
        return cls()
    if isinstance(config, cls):
        return config
    if isinstance(config, dict):
        return _build(cls, config)
    if isinstance(config, (str, Path)):
        return load_config(cls, config)
    raise TypeError(f"config must be a {cls.__name__}, a dict or a YAML path, got {type(config).__name__}")


def _reward_specs(reward_fns, cfg_specs: list[dict]) -> list[dict]:
    """reward_fns (Python API): None (use the config), one callable, or a list of callables,
    'module:function' strings, built-in names or spec dicts."""
    if reward_fns is None:
        return cfg_specs
    if callable(reward_fns) or isinstance(reward_fns, (str, dict)):
        reward_fns = [reward_fns]
    specs = []
    for r in reward_fns:
        if isinstance(r, dict):
            specs.append(r)
        elif isinstance(r, str):
            specs.append({"fn": r} if ":" in r else {"name": r})
        elif callable(r):
            specs.append({"fn": r})
        else:
            raise TypeError(f"a reward must be a callable, a 'module:function' string, a built-in name or a spec "
                            f"dict, got {r!r}")
    return specs


class RLTrainer(abc.ABC):
    """Setup and loop shared by GRPO and PPO: model, tokenizer, engine, reference model, data,
    rewards, optimizer, logger, checkpoints, evaluation. Subclasses implement `train_step`."""

    config_cls = RLConfig
    kind = "rl"

    def __init__(self, config, dataset=None, reward_fns=None, *, model=None, tokenizer=None, eval_dataset=None):
        from rlcu.dist.zero import make_optimizer
        from rlcu.rewards import RewardSet
        from rlcu.train.checkpoint import build_model

        self.cfg = cfg = _config(self.config_cls, config)
        torch.manual_seed(cfg.seed)
        self.model = model if model is not None else build_model(cfg.model)
        self._model_given = model is not None
        self.device = self.model.device
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer()
        self.rewards = RewardSet(_reward_specs(reward_fns, cfg.rewards))
        self.rows, self.eval_rows, self.n_filtered = self._load_data(dataset, eval_dataset)
        self.sampler = PromptSampler(self.rows, cfg.data.seed, cfg.data.shuffle)
        self.ref = self._make_ref() if self._needs_ref() else None
        self.opt = make_optimizer(self.model, cfg.optim)  # ShardedAdamW across ranks
        self.llm = self._make_engine()
        self.stop_ids = ro.stop_ids(self.tokenizer, self.model) if cfg.stop_at_eos else []
        self.out_dir = Path(cfg.log.out_dir)
        self.ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.out_dir / "checkpoints"
        self.step = 0
        self.history: list[dict] = []
        self.logger = None
        self.last_eval: dict = {}

    # ---------------------------------------------------------------- setup
    def _load_tokenizer(self):
        from rlcu.data.tokenizer import Tokenizer

        src = self.cfg.model.tokenizer or self.cfg.model.path
        if src is None:
            raise ValueError("model.tokenizer must be set for a model made from scratch (model.tiny), "
                             "or pass tokenizer= to the trainer")
        p = Path(src)
        if p.is_file():
            from tokenizers import Tokenizer as Backend

            return Tokenizer(Backend.from_file(str(p)))
        return Tokenizer.from_pretrained(p)

    def _load_data(self, dataset, eval_dataset):
        from rlcu.data.datasets import load_prompts

        d = self.cfg.data
        if dataset is None:
            if d.path is None:
                raise ValueError("data.path must be set (or pass a dataset to the trainer)")
            dataset = d.path
        rows = load_prompts(dataset, d.prompt_field) if isinstance(dataset, (str, Path)) else [dict(r) for r in dataset]
        if eval_dataset is None and d.eval_path is not None:
            eval_dataset = d.eval_path
        if isinstance(eval_dataset, (str, Path)):
            eval_rows = load_prompts(eval_dataset, d.prompt_field)
        elif eval_dataset is not None:
            eval_rows = [dict(r) for r in eval_dataset]
        elif d.eval_size > 0:
            g = torch.Generator().manual_seed(d.seed + 7919)
            perm = torch.randperm(len(rows), generator=g).tolist()
            held = set(perm[: d.eval_size])
            eval_rows = [r for i, r in enumerate(rows) if i in held]
            rows = [r for i, r in enumerate(rows) if i not in held]
        else:
            eval_rows = []
        n_dropped = 0
        if d.max_prompt_tokens is not None:
            kept = [r for r in rows if self._prompt_len(r) <= d.max_prompt_tokens]
            rows, n_dropped = kept, len(rows) - len(kept)
            if not rows:
                raise ValueError(f"every prompt is longer than data.max_prompt_tokens={d.max_prompt_tokens}")
        return rows, eval_rows, n_dropped

    def _prompt_len(self, row) -> int:
        return len(self._encode(row)[0])

    def _encode(self, row):
        if "prompt_token_ids" in row:  # pre-tokenised
            return list(row["prompt_token_ids"]), ""
        return ro.encode_prompt(self.tokenizer, ro.prompt_text_of(row, self.cfg.data.prompt_field),
                                self.cfg.chat_template)

    def _needs_ref(self) -> bool:
        return self.cfg.kl_coef > 0

    def _make_ref(self):
        """A frozen copy of the initial policy that shares nothing mutable with it."""
        from rlcu.model.qwen3 import Qwen3

        ref = Qwen3(self.model.cfg, self.model.flat.detach().clone())
        ref.gradient_checkpointing = False
        return ref

    def _make_engine(self):
        from rlcu.engine import LLM

        c, e = self.cfg, self.cfg.engine
        kw = dict(device=str(self.device), max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
                  num_kv_blocks=e.num_kv_blocks, block_size=e.block_size, enforce_eager=e.enforce_eager,
                  gpu_memory_utilization=e.gpu_memory_utilization)
        if kw["num_kv_blocks"] is None:
            # RL knows its batch: a pool that holds one step's sequences (or one evaluation's),
            # and no more, so that the generation phase's peak memory stays small
            sample = self.rows[:256] + self.eval_rows[:256]
            longest = max([self._prompt_len(r) for r in sample] + [c.data.max_prompt_tokens or 0, 1])
            per_seq = -(-(longest + c.max_new_tokens + 1) // e.block_size)
            from rlcu.dist.comm import world

            n = world().size  # across ranks each engine rolls out its block of the prompts
            n_eval = -(-min(len(self.eval_rows), c.eval_max_prompts) // n)
            seqs = min(e.max_num_seqs, max(-(-c.prompts_per_step // n) * c.group_size, n_eval))
            kw["num_kv_blocks"] = per_seq * (seqs + 1) + 16
        params = inspect.signature(LLM).parameters
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            kw = {k: v for k, v in kw.items() if k in params}
        return LLM(self.model, **kw)

    def _checkpoint_extra(self) -> dict:
        """Objects with state_dict() saved beside the model and optimizer."""
        extra = {}
        if self.ref is not None and self._model_given:
            extra["ref_model"] = _FlatState(self.ref)
        return extra

    # ---------------------------------------------------------------- rollouts
    def _step_seed(self, step: int, rnd: int = 0) -> int:
        return (self.cfg.seed * 1_000_003 + step * 7919 + rnd * 104_729) % (1 << 62)

    def rollout(self, rows: list[dict], n: int, seed: int, temperature: float | None = None,
                max_tokens: int | None = None, group_offset: int = 0) -> list[ro.Sample]:
        from rlcu.dist import batch as dp

        c = self.cfg
        lo, hi = dp.rank_block(len(rows))  # this rank's prompts; every rank gets every sample back
        rows = rows[lo:hi]
        enc = [self._encode(r) for r in rows]
        return dp.gather_samples(ro.sample(self.llm, [e[0] for e in enc], rows, n=n,
                         temperature=c.temperature if temperature is None else temperature,
                         top_p=c.top_p, top_k=c.top_k, max_tokens=max_tokens or c.max_new_tokens, seed=seed,
                         stop_token_ids=self.stop_ids, ignore_eos=not c.stop_at_eos, tokenizer=self.tokenizer,
                         prompt_texts=[e[1] for e in enc], group_offset=group_offset + lo, seed_offset=lo))

    def score(self, samples: list[ro.Sample]) -> dict:
        """Fill sample.reward (nan = masked); returns reward metrics."""
        pf = self.cfg.data.prompt_field
        prompts = [s.row.get(pf) for s in samples]
        comps = [s.completion_text for s in samples]
        rewards, breakdown, errors = self.rewards(prompts, comps, [s.row for s in samples])
        for s, r in zip(samples, rewards.tolist()):
            s.reward = r
        for e in errors[:3]:
            self._warn(f"reward function error (its samples are masked): {e}")
        m = {f"reward/{k}": _nanmean(v) for k, v in breakdown.items()} if len(breakdown) > 1 else {}
        m["errors/reward"] = len(errors)
        return m

    def _grad_holders(self) -> list:
        """(model, its OptimConfig) pairs whose gradient buffers live only through a step's updates."""
        return [(self.model, self.cfg.optim)]

    def _end_train_phase(self) -> None:
        """After a step's updates, free the gradient buffers (optim.release_grads: fp32
        gradients are as large as two bf16 models) so that the rollout phase, which takes the KV
        pool back, does not hold them too; on CUDA the blocks go back to the device, as the
        engine's sleep() does with the pool. The next zero_grad reallocates them."""
        freed = False
        for model, oc in self._grad_holders():
            if oc.release_grads and getattr(model, "grad_flat", None) is not None:
                model.release_grads()
                freed = True
        if freed and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _engine_phase(self, fn):
        """fn() with the engine awake; it sleeps after (its KV pool freed for training), keeping
        its decode graphs, which the next wake reuses if the pool returns at the same address."""
        from rlcu.engine import LLM

        if hasattr(self.llm, "wake"):
            self.llm.wake()
        try:
            return fn()
        finally:
            if isinstance(self.llm, LLM):
                self.llm.sleep(keep_graphs=True)
            elif hasattr(self.llm, "sleep"):
                self.llm.sleep()

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, rows: list[dict] | None = None) -> dict:
        """Greedy completions of the held-out prompts: mean reward, and the fraction with a
        positive reward (accuracy for 0/1 rewards)."""
        rows = (self.eval_rows if rows is None else rows)[: self.cfg.eval_max_prompts]
        if not rows:
            return {}
        t0 = time.perf_counter()
        samples = self._engine_phase(lambda: self.rollout(rows, 1, seed=0, temperature=0.0))
        self.score(samples)
        r = torch.tensor([s.reward for s in samples])
        ok = ~torch.isnan(r)
        out = {"eval/reward": float(r[ok].mean()) if ok.any() else math.nan,
               "eval/accuracy": float((r[ok] > 0).float().sum() / max(len(samples), 1)),
               "eval/len": sum(len(s.completion_ids) for s in samples) / len(samples),
               "time/eval": time.perf_counter() - t0}
        self.last_eval = out
        return out

    # ---------------------------------------------------------------- the loop
    def _warn(self, msg: str) -> None:
        if self.logger is not None:
            self.logger.warn(msg)

    def _trainer_state(self) -> dict:
        return {"data_pos": self.sampler.pos, "metrics_tail": self.history[-20:]}

    def _load_state(self, state: dict) -> None:
        self.sampler.pos = int(state["data_pos"])
        self.history = list(state.get("metrics_tail", []))

    def save(self) -> Path:
        from rlcu.train.checkpoint import save_checkpoint

        path = save_checkpoint(self.ckpt_root, self.step, self.model, self.opt, self._trainer_state(),
                               self.cfg.checkpoint.keep_last, extra=self._checkpoint_extra(), tokenizer=self.tokenizer)
        if self.logger is not None:
            self.logger.info(f"checkpoint: {path}")
        return path

    def resume(self, path=None) -> int:
        """Load a checkpoint (path, or checkpoint.resume: 'auto' / a folder); returns its step."""
        from rlcu.train.checkpoint import load_checkpoint, resolve_resume

        p = resolve_resume(path or self.cfg.checkpoint.resume, self.ckpt_root)
        if p is None:
            return 0
        extra = self._checkpoint_extra()
        if self.ref is not None and not self._model_given:
            extra.pop("ref_model", None)  # rebuilt from the config: already the initial weights
        state = load_checkpoint(p, self.model, self.opt, extra=extra)
        self.step = int(state["step"])
        self._load_state(state)
        return self.step

    def train(self) -> list[dict]:
        """Run the remaining steps; returns the per-step metrics (after a resume: the
        checkpoint's last 20 steps, then the new ones)."""
        from rlcu.dist.comm import run_logger, world
        from rlcu.train.optimizer import NonFiniteError

        c = self.cfg
        resumed = self.resume() if c.checkpoint.resume else 0
        self.logger = run_logger(self.out_dir, c.log, c.steps, resume_step=resumed if resumed else None)
        lg = self.logger
        try:
            from rlcu.config import save_config

            if world().is_main:
                save_config(c, self.out_dir / "config.yaml")
            if resumed:
                lg.info(f"resumed from step {resumed} ({self.ckpt_root})")
            if self.n_filtered:
                lg.info(f"dropped {self.n_filtered} prompts longer than "
                        f"data.max_prompt_tokens={c.data.max_prompt_tokens}")
            lg.info(f"{self.kind}: {len(self.rows)} prompts, {len(self.eval_rows)} held out, "
                    f"{self.model.num_params() / 1e6:.2f}M parameters on {self.device}")
            from rlcu.dist.memory import log_estimate

            log_estimate(lg, self.model, self.opt, c.micro_batch_tokens, self.llm, self.ref is not None)
            while self.step < c.steps:
                try:
                    m = self.train_step(self.step)
                except NonFiniteError as e:
                    lg.log(self.step + 1, e.info)
                    ck = self.save()  # the skipped steps changed nothing: this is the last good state
                    raise RuntimeError(f"{e} The last good state is saved in {ck}.") from e
                self.step += 1
                if m.get("skipped") and "grad_norm" in m:
                    lg.warn(f"step {self.step}: non-finite loss or gradient norm (grad_norm {m['grad_norm']}): "
                            f"update skipped")
                if self.eval_rows and ((c.eval_every and self.step % c.eval_every == 0) or self.step == c.steps):
                    m.update(self.evaluate())
                self.history.append({"step": self.step, **m})
                lg.log(self.step, m)
                if c.checkpoint.every and self.step % c.checkpoint.every == 0 and self.step < c.steps:
                    self.save()
            if c.checkpoint.save_at_end and resumed < c.steps:
                self.save()
        finally:
            lg.close()
        return self.history

    @abc.abstractmethod
    def train_step(self, step: int) -> dict:
        """One step of the concrete subclass."""

    # ---------------------------------------------------------------- shared step pieces
    @staticmethod
    def _length_metrics(samples: list[ro.Sample]) -> dict:
        if not samples:
            return {}
        L = [len(s.completion_ids) for s in samples]
        return {"completion_len": sum(L) / len(L), "completion_len_max": max(L),
                "truncated_frac": sum(s.truncated for s in samples) / len(samples)}

    def _lr(self, update: int, total: int, optim_cfg=None) -> float:
        from rlcu.train.schedule import lr_at

        return lr_at(update, optim_cfg or self.cfg.optim, total)

    def _policy_update(self, batch: ro.RolloutBatch, update: int, total_updates: int, agg: str,
                       kl_coef: float) -> dict:
        """One optimizer step of the policy over the whole batch, micro-batch by micro-batch."""
        from rlcu.dist import batch as dp

        c, model = self.cfg, self.model
        n_tok = float(batch.mask.sum())  # of the global batch: every rank holds all of it
        n_seq = batch.num_masked_in_seqs()
        batch = batch.view(*dp.rank_seq_range(batch.num_seqs, c.group_size))  # the groups this rank trains on
        model.zero_grad()
        stats = torch.zeros(len(POLICY_STATS), dtype=torch.float64)
        spans = batch.micro_batches(c.micro_batch_tokens) if batch.num_seqs else []
        for _ in range(dp.equal_passes(len(spans)) - len(spans)):
            dp.dummy_backward(model)  # overlapped reduce-scatters: as many backward passes as every rank
        for a, b in spans:
            mb = batch.view(a, b)
            w = losses.token_weights(mb.cu_seqlens, mb.mask, agg, n_seqs=n_seq, n_tokens=n_tok)
            ref, adv = mb.fields.get("ref_lp"), mb.fields["adv"]
            parts = []

            def grad_fn(lp_c, ent_c, idx, mb=mb, w=w, ref=ref, adv=adv, parts=parts):
                # the loss is elementwise, so each chunk of the LM head takes its gradient
                # while its logits are in memory (no second sweep of the head)
                _, dlp, dent, st = policy_loss(lp_c, mb.old_lp[idx], None if ref is None else ref[idx], adv[idx],
                                               w[idx], ent_c, clip_low=c.clip_low, clip_high=c.clip_high,
                                               kl_coef=kl_coef, entropy_coef=c.entropy_coef)
                parts.append(st)
                return dlp, (dent if c.entropy_coef > 0 else None)

            model.forward_backward(mb.tokens, mb.cu_seqlens, grad_fn, temperature=c.temperature,
                                   return_entropy=True)
            stats += torch.stack(parts).sum(0).double().cpu()
        stats = dp.all_sum(stats)
        info = self.opt.step(self._lr(update, total_updates), loss=float(stats[0]))
        s = dict(zip(POLICY_STATS, stats.tolist()))
        wsum = s.pop("weight") or 1.0
        out = {"loss": s.pop("loss")}
        out.update({k: v / wsum for k, v in s.items()})
        out["clip_frac"] = out["clip_low"] + out["clip_high"]
        out.update(grad_norm=info["grad_norm"], lr=info["lr"], skipped=info["skipped"])
        return out


class _FlatState:
    """state_dict()/load_state_dict() of a model's flat weights (the reference model in checkpoints)."""

    def __init__(self, model):
        self.model = model

    def state_dict(self):
        return {"flat": self.model.flat.detach().cpu().clone()}

    def load_state_dict(self, d):
        self.model.flat.copy_(d["flat"])


def _nanmean(x) -> float:
    t = torch.as_tensor(x, dtype=torch.float64)
    ok = ~torch.isnan(t)
    return float(t[ok].mean()) if ok.any() else math.nan


def _mean_update_metrics(updates: list[dict]) -> dict:
    """The mean over the mu updates of a step (the last for lr)."""
    out = {}
    for k in updates[0]:
        vals = [u[k] for u in updates]
        out[k] = vals[-1] if k == "lr" else sum(vals) / len(vals)
    return out

