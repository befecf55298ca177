"""PPO with a critic: a value head on a Qwen3 trunk (rlcu.train.critic) with its own flat
buffers and optimizer; with `lora:` the critic is an adapter of its own and the head over the
policy's frozen base (rlcu.train.lora_critic: one base, no second copy).

One step: sample completions (the policy's weights, through the engine) -> scores from the
reward functions, normalised by their running mean/std -> per-token rewards
    r_t = -beta (old_lp_t - ref_lp_t)  (+ the score on the last token)
-> the critic's values V_t of the states the tokens were chosen in -> GAE(gamma, lambda)
advantages and returns (advantages whitened over the batch) -> mu epochs, each one policy
update (the fused clipped loss, entropy bonus; no KL term: it is in the reward) and one
critic update (the fused clipped value loss) over the whole batch.

Multi-turn episodes (multi_turn: an environment or tools; rlcu.train.episodes, as GRPO's): a
trajectory is the model's tokens interleaved with the environment's, and the environment's
tokens are not actions. GAE runs over each trajectory's model tokens only, as one sequence of
time steps with the environment's tokens skipped: the step after model token t is the next
model token t' (perhaps after an environment reply), so delta_t = r_t + gamma V_t' - V_t, where
V_t' is the critic's value of the state after the reply (its forward reads the whole
trajectory); gamma and lambda discount per model token, never per environment token. The score
(the reward functions' and the environment's, at the episode's end) lands on the last model
token; environment tokens get no advantage, no return (no value target) and no loss.
"""

from __future__ import annotations

import math
import time

import torch

from rlcu.config import ConfigError, PPOConfig
from rlcu.hub import model_folder
from rlcu.ops.rl_loss import VALUE_STATS, value_loss
from rlcu.parallel import batch as dp
from rlcu.parallel.zero import make_optimizer
from rlcu.train import losses
from rlcu.train import rollout as ro
from rlcu.train.critic import Critic
from rlcu.train.episodes import overlong_lengths
from rlcu.train.lora_critic import LoraCritic
from rlcu.train.mismatch import StepCorrection
from rlcu.train.moe_aux import AuxShare
from rlcu.train.rl_trainer import RLTrainer, _mean_update_metrics


class PPOTrainer(RLTrainer):
    """PPOTrainer(config, dataset, reward_fns).train()."""

    config_cls = PPOConfig
    kind = "ppo"

    def __init__(self, config, dataset=None, reward_fns=None, *, model=None, tokenizer=None, eval_dataset=None,
                 critic: Critic | None = None, hooks=None, environment=None, tools=None):
        super().__init__(config, dataset, reward_fns, model=model, tokenizer=tokenizer, eval_dataset=eval_dataset,
                         hooks=hooks, environment=environment, tools=tools)
        cc = self.cfg.critic
        if critic is None:
            if self.model.lora is not None:  # lora: the critic's own adapter on the policy's base (lora_critic.py)
                if cc.path is not None:
                    raise ConfigError("critic.path", "is set with lora:, whose critic is an adapter on the policy's "
                                                     "base (no second base): leave critic.path null")
                critic = LoraCritic.for_policy(self.model, cc.head_init_std, seed=self.cfg.seed)
            elif cc.path is not None:
                critic = Critic.from_pretrained(model_folder(cc.path, None, "critic.path"), device=self.device,
                                                dtype=self.model.dtype,
                                                head_init_std=cc.head_init_std, seed=self.cfg.seed)
            else:
                critic = Critic.from_trunk(self.model, cc.head_init_std, seed=self.cfg.seed)
        critic.gradient_checkpointing = self.model.gradient_checkpointing
        critic.trunk.exact = self.model.exact  # the policy's mode on every trainer forward
        self.critic = critic
        self.critic.zero_grad()
        self.critic_opt = make_optimizer(self.critic, cc.optim)  # ShardedAdamW across ranks
        self.score_stats = losses.RunningMoments()

    def _resolve_checkpointing(self) -> None:
        super()._resolve_checkpointing()
        self.critic.gradient_checkpointing = self.model.gradient_checkpointing  # the same trunk shape

    def _grad_holders(self) -> list:
        return [*super()._grad_holders(), (self.critic, self.cfg.critic.optim)]

    def _checkpoint_extra(self, loading: bool = False) -> dict:
        return {**super()._checkpoint_extra(loading), "critic": self.critic, "critic_optim": self.critic_opt,
                "score_stats": self.score_stats}

    def _finite_tensors(self) -> list[torch.Tensor]:
        out = [*super()._finite_tensors(), self.critic.flat]
        return out if self.critic_opt.master_is_model else [*out, self.critic_opt.master]

    # ---------------------------------------------------------------- the step
    def _values(self, batch: ro.RolloutBatch) -> torch.Tensor:
        out = torch.zeros(batch.num_tokens, device=batch.tokens.device, dtype=torch.float32)
        s0, s1 = dp.rank_seq_range(batch.num_seqs, self.cfg.group_size)  # this rank's sequences ...
        local, base = batch.view(s0, s1), int(batch.cu_seqlens[s0])
        for a, b in (local.micro_batches(self.cfg.micro_batch_tokens) if s1 > s0 else []):
            mb = local.view(a, b)
            t0 = base + int(local.cu_seqlens[a])
            out[t0 : t0 + mb.num_tokens] = self.critic.forward(mb.tokens, mb.cu_seqlens, grad=False)
        return dp.all_sum(out)  # ... and every other rank's (zero elsewhere): the whole batch's values

    def advantages(self, batch: ro.RolloutBatch, scores: torch.Tensor) -> dict:
        """Per-token rewards (KL penalty + the score at the last model token), GAE advantages and
        returns into batch.fields; returns metrics. scores: [S] (masked samples: any value).
        GAE runs over the tokens of mask 1 only (a completion's, or an episode's model tokens:
        the module docstring), each sequence's in order."""
        c = self.cfg
        idx, lens = losses.masked_index(batch.cu_seqlens, batch.mask)  # [M] model tokens of kept samples
        r = torch.zeros(batch.num_tokens, device=batch.tokens.device, dtype=torch.float32)
        kl_tok = torch.zeros_like(r)
        if self.ref is not None:
            kl_tok = (batch.old_lp - batch.fields["ref_lp"]) * (batch.mask > 0)
            r -= c.kl_coef * kl_tok
        has = lens > 0
        last = idx[lens.cumsum(0)[has] - 1]  # each kept sequence's last model token
        r.index_add_(0, last, torch.nan_to_num(scores.to(r.device).float()[has]))
        adv_c, ret_c = losses.gae(r[idx], batch.fields["values"][idx], lens.tolist(), c.gamma, c.lam)
        adv = torch.zeros_like(r).index_copy_(0, idx, adv_c)
        ret = torch.zeros_like(r).index_copy_(0, idx, ret_c)
        if c.whiten_advantages:
            adv = losses.whiten(adv, batch.mask) * batch.mask
        batch.fields["adv"] = adv * batch.mask
        batch.fields["returns"] = ret
        live = batch.mask > 0
        n = max(int(live.sum()), 1)
        v = batch.fields["values"][live]
        rt = ret[live]
        ev = 1 - float((rt - v).var() / rt.var().clamp_min(1e-8)) if n > 1 else math.nan
        return {"kl_penalty": float(kl_tok[live].sum()) / max(batch.num_masked_in_seqs(), 1),
                "values": float(v.mean()) if n else 0.0, "returns": float(rt.mean()) if n else 0.0,
                "explained_var": ev}

    def _critic_update(self, batch: ro.RolloutBatch, update: int, total: int) -> dict:
        c = self.cfg
        n_tok = float(batch.mask.sum())  # of the global batch
        n_seq = batch.num_masked_in_seqs()
        aux = AuxShare(self.critic.trunk, batch.num_tokens)  # a MoE trunk's load-balancing loss, by token share
        batch = batch.view(*dp.rank_seq_range(batch.num_seqs, c.group_size))  # the groups this rank trains on
        clip = c.critic.value_clip if c.critic.value_clip > 0 else math.inf
        self._resolve_checkpointing()
        self.critic.zero_grad()
        stats = torch.zeros(len(VALUE_STATS), dtype=torch.float64)
        for a, b in (batch.micro_batches(c.micro_batch_tokens) if batch.num_seqs else []):
            mb = batch.view(a, b)
            w = losses.token_weights(mb.cu_seqlens, mb.mask, c.loss_agg, n_seqs=n_seq, n_tokens=n_tok,
                                     horizon=c.sequence_new_tokens())
            v = self.critic.forward(mb.tokens, mb.cu_seqlens)
            _, dv, st = value_loss(v, mb.fields["values"], mb.fields["returns"], w, clip=clip)
            aux.weigh(mb.num_tokens)
            self.critic.backward(dv)
            stats += st.double().cpu()
        aux.done()
        stats = dp.all_sum(stats)
        info = self.critic_opt.step(self._lr(update, total, c.critic.optim), loss=float(stats[0]))
        s = dict(zip(VALUE_STATS, stats.tolist()))
        wsum = s["weight"] or 1.0
        return {"vf_loss": s["loss"], "vf_clip_frac": s["clip_frac"] / wsum, "vf_grad_norm": info["grad_norm"],
                "vf_lr": info["lr"], "vf_skipped": info["skipped"]}

    def train_step(self, step: int) -> dict:
        c = self.cfg
        t0 = time.perf_counter()

        def collect():
            ss = self.rollout(self.sampler.next(c.prompts_per_step), c.group_size, seed=self._step_seed(step))
            return ss, self.score(ss)

        samples, m = self._engine_phase(collect, work=self._rollout_work())
        t1 = time.perf_counter()
        m.update(self._length_metrics(samples))
        scores = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        if c.overlong == "penalty":
            L, limit = overlong_lengths(samples, c.max_new_tokens)  # an episode's model tokens only
            scores = scores + losses.overlong_penalty(L, limit, c.overlong_buffer)
        keep = ~torch.isnan(scores)
        if c.overlong == "mask":
            keep &= torch.tensor([not s.truncated for s in samples], dtype=torch.bool)
        m.update(losses.reward_metrics(scores, ~keep))
        if c.reward_norm:
            self.score_stats.update(scores[keep])
            scores = self.score_stats.normalise(scores)
        batch = self._pack(samples, keep)
        sc = StepCorrection(c, self.model, batch)  # old_logprobs (the KL reward reads them), correction
        if self.ref is not None:
            with self.hooks.phase("ref_logprobs"):  # each rank its sequences, then all of them
                batch.fields["ref_lp"] = dp.all_sum(ro.local_logprobs(self.ref, batch, c.temperature,
                                                                      c.micro_batch_tokens, c.group_size))
        with self.hooks.phase("critic_values"):
            batch.fields["values"] = self._values(batch)
        m.update(self.advantages(batch, scores))
        t2 = time.perf_counter()
        upd = []
        if float(batch.mask.sum()) == 0:
            self._warn(f"step {step + 1}: every sample is masked; no update")
            m["skipped"] = 1
        else:
            pb = sc.policy_batch()
            # the policy's and the critic's updates read the same fixed batch and touch
            # disjoint state, so all of one then all of the other computes what interleaving would
            upd = [{} for _ in range(c.mu)]
            if step >= c.critic.warmup_steps and float(pb.mask.sum()) > 0:
                with self.hooks.phase("actor_train"):
                    for u in range(c.mu):
                        upd[u].update(self._policy_update(pb, step * c.mu + u, c.steps * c.mu, c.loss_agg, 0.0,
                                                          record=sc.record if u == 0 else None))
            with self.hooks.phase("critic_train"):
                for u in range(c.mu):
                    upd[u].update(self._critic_update(batch, step * c.mu + u, c.steps * c.mu))
            m.update(_mean_update_metrics(upd))
        m.update(sc.metrics())
        m.update(self.route_mismatch.metrics())
        self._end_train_phase()
        t3 = time.perf_counter()
        gen_tokens = sum(len(s.completion_ids) for s in samples)
        m.update({"time/generate": t1 - t0, "time/logprobs": t2 - t1, "time/train": t3 - t2, "time/step": t3 - t0,
                  "time/gen_tokens_per_s": gen_tokens / max(t1 - t0, 1e-9)})
        return m

