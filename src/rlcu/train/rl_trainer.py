"""The machinery GRPO and PPO share on top of the trainer core (rlcu.train.core.Trainer: the
step loop, checkpoints, resume, signals, logging): `RLTrainer` (model, tokenizer, engine,
frozen reference, prompt data, rewards, optimizer, evaluation) and its pieces.

A subclass implements `train_step(step)`; the shared `_policy_update` is one optimizer step of
the policy over a packed rollout batch, micro-batch by micro-batch through
model.forward_backward, whose LM-head sweep applies the fused policy loss (clipped ratio
against the sampling logprobs, k3 KL to the reference, entropy bonus) chunk by chunk and takes
dlp, dent from it at once -> FlatAdamW.

Phases: each step calls hooks.phase("rollout") around sampling and scoring,
"ref_logprobs" around the frozen reference's forward and "actor_train" around the policy's
updates (PPO adds "critic_train"); a scheduler drives the trainer through these hooks.

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
import math
import time

import torch

from rlcu.config import RLConfig
from rlcu.data.prompt_check import checked_prompts, prompt_limit
from rlcu.engine import LLM
from rlcu.model.causal_lm import Qwen3
from rlcu.ops.rl_loss import POLICY_STATS
from rlcu.parallel import batch as dp
from rlcu.parallel.zero import make_optimizer
from rlcu.rewards import RewardSet, TrainerState, reward_options
from rlcu.rewards.loader import reward_specs
from rlcu.train import episodes, losses, moe_routes, rl_engine, sizing
from rlcu.train import rollout as ro
from rlcu.train.checkpoint import build_model
from rlcu.train.core import Hooks, Trainer, load_tokenizer, nanmean
from rlcu.train.episodes import make_runner
from rlcu.train.moe_aux import AuxShare
from rlcu.train.policy_pass import policy_pass
from rlcu.train.rows import PromptSampler, load_rows
from rlcu.train.schedule import lr_at


class RLTrainer(Trainer):
    """Setup shared by GRPO and PPO on the trainer core (rlcu.train.core.Trainer: the loop,
    checkpoints, resume, signals): model, tokenizer, engine, reference model, data, rewards,
    optimizer, evaluation. Subclasses implement `train_step`. hooks: rlcu.train.core.Hooks.
    llm: an engine shared with other LoRA jobs on this base (rlcu.train.lora_host's `JobEngine`):
    it adopts the job's adapters before the optimizer is made over them (`llm.adopt(model)`)
    and serves the rollouts in place of an engine of the job's own."""

    route_mismatch: moe_routes.RouteMismatch | None = None  # the step's (a MoE policy's routing metric)

    config_cls = RLConfig
    kind = "rl"
    give_back_memory = True  # _end_train_phase's empty_cache; a LoRA host does it once a round instead

    def __init__(self, config, dataset=None, reward_fns=None, *, model=None, tokenizer=None, eval_dataset=None,
                 hooks: Hooks | None = None, environment=None, tools=None, llm=None):
        super().__init__(config, hooks)
        cfg = self.cfg
        self._refuse_unfit(model)
        self.model = model if model is not None else build_model(cfg.model)
        self.model.exact = cfg.exact  # the policy's mode, which its engine reads (ops/exact.py)
        self._model_given = model is not None
        self.device = self.model.device
        trained = self._attach_lora(self.model)  # the adapters with lora: (the base frozen), else the model
        if llm is not None:  # an engine shared with other jobs (train/lora_host.py): it may move them into its slab
            trained = llm.adopt(self.model)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model, "RL prompts")
        specs = reward_specs(reward_fns, cfg.rewards)
        self.episodes = make_runner(cfg, self.tokenizer, self.model, environment, tools, bool(specs))  # None: 1 turn
        self.rewards = RewardSet(specs, **reward_options(cfg), model_kw=dict(  # reward models: on the policy's device
            device=self.device, dtype=self.model.dtype, policy_tokenizer=self.tokenizer,
            max_tokens=cfg.micro_batch_tokens)) if specs or self.episodes is None else None
        self.rows, self.eval_rows, self.n_filtered = self._load_data(dataset, eval_dataset)
        self.sampler = PromptSampler(self.rows, cfg.data.seed, cfg.data.shuffle)
        self.ref = self._make_ref() if self._needs_ref() else None
        self.opt = make_optimizer(trained, cfg.optim)  # ShardedAdamW across ranks
        self.llm = llm if llm is not None else self._make_engine()
        self.llm.sleep(keep_graphs=True)  # its pool is taken back by the first rollout
        for line in sizing.settle_offload(self.rewards, self._memory_shape(), self.device):  # reward models
            self._log_info(line)
        self.stop_ids = ro.stop_ids(self.tokenizer, self.model) if cfg.stop_at_eos else []
        self.last_eval: dict = {}
        self._notes += [rep.message() for rep in self.prompt_reports if rep.message()]  # dropped prompts, by row

    # ---------------------------------------------------------------- setup
    def _memory_shape(self):
        """This rank's job as the memory model sees it (rlcu.train.sizing.run_shape)."""
        return sizing.run_shape(self.model, self.opt, micro_batch_tokens=self.cfg.micro_batch_tokens, fused_head=True,
                                release_grads=self.cfg.optim.release_grads, llm=self.llm,
                                reference=self.ref is not None and self.model.lora is None,
                                critic=hasattr(self.cfg, "critic"),  # PPO's, before its critic is built too
                                reward_models=sizing.reward_model_shapes(self.rewards))

    def _log_estimate(self) -> None:
        sizing.log_estimate(self.logger, self._memory_shape(), self.device)

    def _load_data(self, dataset, eval_dataset):
        d = self.cfg.data
        # every prompt against the context (and max_prompt_tokens): dropped (logged by row) or an error now
        limit = prompt_limit(self.model.cfg.max_position_embeddings, self.cfg.sequence_new_tokens(),
                             d.max_prompt_tokens, d.overlong_prompts)
        self.prompt_reports = []  # the training prompts', then the held-out ones'

        def load(source, name, **where):
            rows, rep = checked_prompts(source, d.prompt_field, self._prompt_len, limit, name, **where)
            self.prompt_reports.append(rep)
            return rows

        rows, eval_rows, _ = load_rows(d, dataset, eval_dataset, load, self.kind.upper())
        return rows, eval_rows, sum(r.n_dropped for r in self.prompt_reports)

    def _prompt_len(self, row) -> int:
        """The prompt's tokens, checked at load (a pre-tokenised id outside the vocabulary is
        named with its row there, not refused by the engine at the first rollout)."""
        ids, V = self._encode(row)[0], self.model.cfg.vocab_size
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V), None)
        if bad is not None:
            raise ValueError(f"token id {bad!r} outside the model's vocabulary [0, {V})")
        return len(ids)

    def _encode(self, row):
        if "prompt_token_ids" in row:  # pre-tokenised
            return list(row["prompt_token_ids"]), ""
        return ro.encode_prompt(self.tokenizer, ro.prompt_text_of(row, self.cfg.data.prompt_field),
                                self.cfg.chat_template, self.cfg.data.chat_template_kwargs)

    def _needs_ref(self) -> bool:
        return self.cfg.kl_coef > 0

    def _make_ref(self):
        """A frozen copy of the initial policy that shares nothing mutable with it, in its exact
        mode (the reference's logprobs are taken by the policy's kernels). With LoRA the base is
        the reference: a model over the policy's own frozen buffer with no adapters (no copy)."""
        if self.model.lora is not None:
            return Qwen3(self.model.cfg, self.model.flat, self.model.exact)
        ref = Qwen3(self.model.cfg, self.model.flat.detach().clone(), self.model.exact)
        ref.gradient_checkpointing = False
        return ref

    def engine_kwargs(self) -> dict:
        """rlcu.LLM's arguments for this job's engine (no adapters; train/rl_engine.py)."""
        return rl_engine.engine_kwargs(self.cfg, self.device, self.prompt_reports, self.eval_rows)

    def _make_engine(self):
        """The rollout engine on the policy's weights (engine_kwargs), given the live adapters;
        `LLM` as this module names it (tests stand a merging engine in its place)."""
        return rl_engine.make_engine(LLM, self.model, self.engine_kwargs())

    def _checkpoint_extra(self, loading: bool = False) -> dict:
        """Objects with state_dict() saved beside the model and optimizer. A reference model
        rebuilt from the config is already the initial weights: it is saved only when the
        model was given (then nothing else can rebuild it)."""
        extra = {}
        if self.ref is not None and self._model_given and self.model.lora is None:  # LoRA's is the base
            extra["ref_model"] = _FlatState(self.ref)
        return extra

    def _checkpoint_objects(self, loading: bool = False) -> tuple:
        return self._ckpt_model(self.model), self.opt, self._checkpoint_extra(loading)

    def _start_message(self) -> str:
        return (f"{self.kind}: {len(self.rows)} prompts, {len(self.eval_rows)} held out, "
                f"{self._trainable_note(self.model)} on {self.device}")

    # ---------------------------------------------------------------- rollouts
    def _step_seed(self, step: int, rnd: int = 0) -> int:
        return (self.cfg.seed * 1_000_003 + step * 7919 + rnd * 104_729) % (1 << 62)

    def rollout(self, rows: list[dict], n: int, seed: int, temperature: float | None = None,
                max_tokens: int | None = None, group_offset: int = 0) -> list[ro.Sample]:
        c = self.cfg
        lo, hi = dp.rank_block(len(rows))  # this rank's prompts; every rank gets every sample back
        rows = rows[lo:hi]
        if self.episodes is not None:
            return dp.gather_samples(self.episodes.sample(
                self.llm, rows, [ro.prompt_text_of(r, c.data.prompt_field) for r in rows], n=n,
                temperature=c.temperature if temperature is None else temperature, top_p=c.top_p, top_k=c.top_k,
                max_tokens=max_tokens or c.max_new_tokens, seed=seed, stop_token_ids=self.stop_ids,
                ignore_eos=not c.stop_at_eos, group_offset=group_offset + lo, seed_offset=lo,
                generate_kw=self._generate_kw()))
        enc = [self._encode(r) for r in rows]
        return dp.gather_samples(ro.sample(self.llm, [e[0] for e in enc], rows, n=n,
                         temperature=c.temperature if temperature is None else temperature,
                         top_p=c.top_p, top_k=c.top_k, max_tokens=max_tokens or c.max_new_tokens, seed=seed,
                         stop_token_ids=self.stop_ids, ignore_eos=not c.stop_at_eos, tokenizer=self.tokenizer,
                         prompt_texts=[e[1] for e in enc], group_offset=group_offset + lo,
                         seed_offset=lo, generate_kw=self._generate_kw()))

    def _generate_kw(self) -> dict:
        """The engine's preemption callbacks when the hooks ask for them (on_done: hooks written
        before it have none)."""
        h = self.hooks
        if not h.preemptible:
            return {}
        return dict(yield_check=h.yield_check, on_yield=h.on_yield, on_done=getattr(h, "on_generate_done", None))

    def score(self, samples: list[ro.Sample], per_function: bool = False) -> dict:
        """Fill sample.reward (nan = masked); returns reward metrics: `reward/NAME`, each
        function's mean, when there are several functions or `per_function`."""
        pf, ep = self.cfg.data.prompt_field, self.episodes is not None
        prompts = [s.prompt_messages if ep else s.row.get(pf) for s in samples]
        comps = [s.messages if ep else s.completion_text for s in samples]
        state = TrainerState(self.step, self.cfg.steps, self.sampler.pos / max(len(self.rows), 1))
        rewards, breakdown, errors = torch.zeros(len(samples)), {}, []
        if self.rewards is not None:
            rewards, breakdown, errors = self.rewards(prompts, comps, [s.row for s in samples], prompt_field=pf,
                                                      completion_ids=[s.completion_ids for s in samples],
                                                      trainer_state=state,
                                                      sequence_ids=[s.prompt_ids + s.completion_ids for s in samples])
        if ep:
            rewards, breakdown = episodes.with_env_rewards(samples, rewards, breakdown)
        for s, r in zip(samples, rewards.tolist()):
            s.reward = r
        for e in errors[:3]:
            self._warn(e)  # names the function, the error and its first sample
        m = {f"reward/{k}": nanmean(v) for k, v in breakdown.items()} if per_function or len(breakdown) > 1 else {}
        m["errors/reward"] = len(errors)
        m.update(self.rewards.last_metrics if self.rewards is not None else {})
        m.update(episodes.episode_metrics(samples))
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
            held = [getattr(model, "grad_flat", None), getattr(getattr(model, "lora", None), "grad_flat", None)]
            if oc.release_grads and any(g is not None for g in held):
                model.release_grads()
                freed = True
        if freed and self.device.type == "cuda" and self.give_back_memory:
            torch.cuda.empty_cache()

    def _engine_phase(self, fn, phase: str = "rollout", work: float | None = None):
        """fn() in hooks.phase(phase) with the engine awake; it sleeps after (its KV pool freed
        for training), keeping its decode graphs, which the next wake reuses if the pool returns
        at the same address (so a scheduled job, whose pool comes and goes with its leases,
        captures them once, not every step)."""
        with self.hooks.phase(phase, work=work):
            self.llm.wake()
            try:
                return fn()
            finally:
                self.llm.sleep(keep_graphs=True)

    def _rollout_work(self) -> float:
        """Tokens one step's rollout may generate (the scheduler's work estimate); episodes:
        their turns' tokens, the environment's prefilled ones and the tools' wait
        (episodes.episode_work)."""
        c = self.cfg
        if self.episodes is not None:
            return self.episodes.work(c.prompts_per_step * c.group_size, c.max_new_tokens)
        return float(c.prompts_per_step * c.group_size * c.max_new_tokens)

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, rows: list[dict] | None = None) -> dict:
        """Greedy completions of the held-out prompts: `eval/reward`, the mean total reward (the
        weighted sum); `eval/reward/NAME`, each function's mean; `eval/accuracy`, the fraction
        of prompts whose total reward is > 0 (a masked one counts as 0). For one 0/1 reward that
        is its accuracy; with a shaped reward or several (a format bonus beside exact match) any
        positive total counts, so each function's own mean is the figure to read."""
        rows = (self.eval_rows if rows is None else rows)[: self.cfg.eval_max_prompts]
        if not rows:
            return {}
        t0 = time.perf_counter()
        samples = self._engine_phase(lambda: self.rollout(rows, 1, seed=0, temperature=0.0),
                                     work=float(len(rows) * self.cfg.max_new_tokens))
        per = self.score(samples, per_function=True)
        r = torch.tensor([s.reward for s in samples])
        ok = ~torch.isnan(r)
        out = {"eval/reward": float(r[ok].mean()) if ok.any() else math.nan,
               "eval/accuracy": float((r[ok] > 0).float().sum() / max(len(samples), 1)),
               "eval/len": sum(len(s.completion_ids) for s in samples) / len(samples),
               **{f"eval/{k}": v for k, v in per.items() if k.startswith("reward/")},
               "time/eval": time.perf_counter() - t0}
        self.last_eval = out
        return out

    @property
    def has_eval(self) -> bool:
        return bool(self.eval_rows)

    def eval_metrics(self) -> dict:
        return self.evaluate()

    # ---------------------------------------------------------------- state
    def _trainer_state(self) -> dict:
        return {"data_pos": self.sampler.pos, "metrics_tail": self.history[-20:]}

    def _load_state(self, state: dict) -> None:
        self.sampler.pos = int(state["data_pos"])
        self.history = list(state.get("metrics_tail", []))

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
        return lr_at(update, optim_cfg or self.cfg.optim, total)

    def _resolve_checkpointing(self) -> None:
        """`gradient_checkpointing: auto` becomes a number of checkpointed layers at the first
        update, when every buffer the run keeps exists (rlcu.train.sizing.resolve_auto)."""
        if self.model.gradient_checkpointing != "auto":
            return
        self._log_info(sizing.resolve_auto(self.model, self._memory_shape()))

    def _pack(self, samples: list[ro.Sample], keep: torch.Tensor) -> ro.RolloutBatch:
        """The step's packed batch; a MoE policy's with the engine's routes (fields "routes", and
        "replay_routes" with moe.routing: replay) and a fresh `route_mismatch` (train/moe_routes.py)."""
        batch = ro.pack(samples, keep, device=self.device)
        routes = moe_routes.pack_routes(samples, self.model.cfg, self.device)
        if routes is not None:
            batch.fields["routes"] = routes
            if self.cfg.moe.routing == "replay":
                batch.fields[moe_routes.REPLAY] = routes
        self.route_mismatch = moe_routes.RouteMismatch(self.model.cfg, self.device)
        return batch

    def _policy_update(self, batch: ro.RolloutBatch, update: int, total_updates: int, agg: str,
                       kl_coef: float, record=None) -> dict:
        """One optimizer step of the policy over the whole batch, micro-batch by micro-batch;
        record(a, b, lp), when given, receives each micro-batch's logprobs (rlcu.train.mismatch)."""
        self._resolve_checkpointing()
        c, model = self.cfg, self.model
        n_tok = float(batch.mask.sum())  # of the global batch: every rank holds all of it
        n_seq = batch.num_masked_in_seqs()
        aux = AuxShare(model, batch.tokens.numel())  # a MoE policy's load-balancing loss, by token share
        s0, s1 = dp.rank_seq_range(batch.num_seqs, c.group_size)
        batch = batch.view(s0, s1)  # the groups this rank trains on
        model.zero_grad()
        stats = torch.zeros(len(POLICY_STATS), dtype=torch.float64)
        spans = batch.micro_batches(c.micro_batch_tokens) if batch.num_seqs else []
        for _ in range(dp.equal_passes(len(spans)) - len(spans)):
            dp.dummy_backward(model)  # overlapped reduce-scatters: as many backward passes as every rank
        for a, b in spans:
            mb = batch.view(a, b)
            w = losses.token_weights(mb.cu_seqlens, mb.mask, agg, n_seqs=n_seq, n_tokens=n_tok,
                                     horizon=c.sequence_new_tokens())
            routes = moe_routes.routes_for(model, mb)  # a MoE policy's record (and replay) of its experts
            aux.weigh(mb.tokens.numel())
            lp_mb, st = policy_pass(model, c, mb, w, kl_coef, routes)
            aux.add(mb.tokens.numel())
            if record is not None:
                record(a + s0, b + s0, lp_mb)  # in the global batch's numbering
                if self.route_mismatch is not None:
                    self.route_mismatch.record(mb, routes)
            stats += st.double().cpu()
        aux.done()
        stats = dp.all_sum(stats)
        info = self.opt.step(self._lr(update, total_updates), loss=float(stats[0]))
        s = dict(zip(POLICY_STATS, stats.tolist()))
        wsum = s.pop("weight") or 1.0
        out = {"loss": s.pop("loss")}
        out.update({k: v / wsum for k, v in s.items()})
        out["clip_frac"] = out["clip_low"] + out["clip_high"]
        out.update(grad_norm=info["grad_norm"], lr=info["lr"], skipped=info["skipped"], **aux.metrics())
        return out


class _FlatState:
    """state_dict()/load_state_dict() of a model's flat weights (the reference model in checkpoints)."""

    def __init__(self, model):
        self.model = model

    def state_dict(self):
        return {"flat": self.model.flat.detach().cpu().clone()}

    def load_state_dict(self, d):
        self.model.flat.copy_(d["flat"])


def _mean_update_metrics(updates: list[dict]) -> dict:
    """The mean over the mu updates of a step (the last for lr)."""
    out = {}
    for k in updates[0]:
        vals = [u[k] for u in updates]
        out[k] = vals[-1] if k == "lr" else sum(vals) / len(vals)
    return out

