"""GRPO: group-relative advantages on top of the shared RL loop (`rlcu.train.rl_trainer.RLTrainer`).

One step: prompts -> the engine samples G completions each from the policy's own weights
(with their sampling logprobs) -> rewards -> group advantages A = (r - mean) [/ std] ->
a packed rollout batch -> optionally the frozen reference model's logprobs -> mu optimizer
updates over the whole batch, each a sweep of micro-batches through
model.forward_backward, whose LM-head sweep applies the fused policy loss (clipped ratio
against the sampling logprobs, k3 KL to the reference, entropy bonus) chunk by chunk and
takes dlp, dent from it at once -> FlatAdamW.

Estimators (docs/estimators.md): the advantage (`advantage`: GRPO's group-relative one, RLOO's
leave-one-out baseline, REINFORCE++'s batch-whitened returns with the KL in the reward, with or
without the group's mean subtracted first), the ratio (`importance_sampling_level`: per token,
or GSPO's per sequence) and the aggregation (`loss_agg`: token, per-sequence mean, or Dr. GRPO's
constant normaliser).

Options: clip_low != clip_high, std scaling on/off, dynamic sampling (drop groups whose
rewards are all equal, refill from more prompts), overlong completions masked or softly
penalised (an episode by its model's tokens against its own room:
rlcu.train.episodes.overlong_lengths).

Reproducibility: the data order is a seeded permutation per epoch and every step's sampling
seed is a function of (seed, step), so a run resumed from a checkpoint makes the same
rollouts; on the CPU twins, 6 steps equal 3 steps + resume + 3 steps bit for bit.
"""

from __future__ import annotations

import math
import time

import torch

from rlcu.config import GRPOConfig
from rlcu.parallel import batch as dp
from rlcu.train import losses
from rlcu.train import rollout as ro
from rlcu.train.episodes import overlong_lengths
from rlcu.train.mismatch import StepCorrection
from rlcu.train.rl_trainer import RLTrainer, _mean_update_metrics


class GRPOTrainer(RLTrainer):
    """GRPOTrainer(config, dataset, reward_fns).train(): see the module docstring."""

    config_cls = GRPOConfig
    kind = "grpo"

    def _collect(self, step: int) -> tuple[list[ro.Sample], torch.Tensor, dict]:
        """Sample, score and (with dynamic sampling) filter groups; returns (samples, keep [S]
        bool, metrics). Samples are grouped by prompt, G consecutive."""
        c = self.cfg
        G, P = c.group_size, c.prompts_per_step
        kept: list[ro.Sample] = []
        all_rewards, metrics, rounds, n_groups = [], {}, 0, 0
        while True:
            rows = self.sampler.next(P)
            ss = self.rollout(rows, G, seed=self._step_seed(step, rounds), group_offset=n_groups)
            n_groups += len(rows)
            m = self.score(ss)
            for k, v in m.items():
                metrics.setdefault(k, []).append(v)
            if c.overlong == "penalty":
                L, limit = overlong_lengths(ss, c.max_new_tokens)  # an episode's model tokens only
                pen = losses.overlong_penalty(L, limit, c.overlong_buffer)
                for s, p in zip(ss, pen.tolist()):
                    s.reward += p
            r = torch.tensor([s.reward for s in ss], dtype=torch.float32)
            all_rewards.append(r)
            if not c.dynamic_sampling:
                kept = ss
                break
            good = losses.informative_groups(r, G)
            for gi in good.nonzero()[:, 0].tolist():
                kept += ss[gi * G : (gi + 1) * G]
            rounds += 1
            if len(kept) >= P * G or rounds > c.dynamic_sampling_max_rounds:
                kept = kept[: P * G]
                break
        r_all = torch.cat(all_rewards)
        out = {k: sum(v) / len(v) for k, v in metrics.items()}
        out["errors/reward"] = sum(metrics.get("errors/reward", [0]))
        out.update(losses.reward_metrics(r_all, torch.isnan(r_all)))
        if c.dynamic_sampling:
            out.update(groups_kept=len(kept) // G, sampling_rounds=rounds)
        keep = torch.tensor([not math.isnan(s.reward) for s in kept], dtype=torch.bool)
        if c.overlong == "mask":
            keep &= torch.tensor([not s.truncated for s in kept], dtype=torch.bool)
        return kept, keep, out

    def advantages(self, batch: ro.RolloutBatch, r: torch.Tensor) -> dict:
        """The advantage estimator's per-token advantages into batch.fields["adv"] (docs/estimators.md);
        r: [S] rewards (nan = masked), groups of G consecutive. Returns metrics."""
        c, G = self.cfg, self.cfg.group_size
        centred, gstd = losses.group_advantages(r, G, scale=c.scales_rewards)  # (scales for grpo only)
        if c.advantage in ("grpo", "rloo"):
            adv = centred if c.advantage == "grpo" else losses.rloo_advantages(r, G)
            batch.fields["adv"] = batch.per_token(adv) * batch.mask
            ok = ~torch.isnan(r)
            m = {"adv_abs": float(adv[ok].abs().mean()) if ok.any() else 0.0}
        else:  # REINFORCE++: token-level returns with the KL in the reward, whitened over the batch
            scores = centred if c.advantage == "reinforce++_baseline" else r
            kl_tok = batch.old_lp - batch.fields["ref_lp"] if "ref_lp" in batch.fields else None
            adv, m = losses.reinforce_pp_advantages(scores, batch.cu_seqlens, batch.mask, kl_tok, c.kl_coef)
            batch.fields["adv"] = adv
            live = batch.mask > 0
            m["adv_abs"] = float(adv[live].abs().mean()) if live.any() else 0.0
        if G > 1:
            m["groups_all_equal"] = float(torch.isnan(gstd).sum() + (gstd == 0).sum()) / max(gstd.numel(), 1)
        return m

    def train_step(self, step: int) -> dict:
        c = self.cfg
        t0 = time.perf_counter()
        samples, keep, m = self._engine_phase(lambda: self._collect(step), work=self._rollout_work())
        t1 = time.perf_counter()
        G = c.group_size
        m.update(self._length_metrics(samples))
        if not samples:
            self._warn(f"step {step + 1}: no informative group after dynamic sampling; no update")
            m.update({"time/generate": t1 - t0, "time/step": time.perf_counter() - t0, "skipped": 1})
            return m
        r = torch.tensor([s.reward if k else math.nan for s, k in zip(samples, keep.tolist())])
        batch = self._pack(samples, keep)
        if self.ref is not None:
            with self.hooks.phase("ref_logprobs"):  # this rank's sequences only (all of them for a KL reward)
                ref_lp = ro.local_logprobs(self.ref, batch, c.temperature, c.micro_batch_tokens, G)
                batch.fields["ref_lp"] = dp.all_sum(ref_lp) if c.kl_in_reward else ref_lp
        sc = StepCorrection(c, self.model, batch)  # old_logprobs, behaviour correction, mismatch metrics
        m.update(self.advantages(batch, r))
        pb = sc.policy_batch()
        t2 = time.perf_counter()
        if float(pb.mask.sum()) == 0:
            self._warn(f"step {step + 1}: every sample is masked; no update")
            m["skipped"] = 1
            upd = []
        else:
            with self.hooks.phase("actor_train"):
                kl_loss = 0.0 if c.kl_in_reward else c.kl_coef  # REINFORCE++'s KL is in its reward
                upd = [self._policy_update(pb, step * c.mu + u, c.steps * c.mu, c.loss_agg, kl_loss,
                                           record=sc.record if u == 0 else None)
                       for u in range(c.mu)]
        self._end_train_phase()
        t3 = time.perf_counter()
        if upd:
            m.update(_mean_update_metrics(upd))
        m.update(sc.metrics())
        m.update(self.route_mismatch.metrics())
        gen_tokens = sum(len(s.completion_ids) for s in samples)
        m.update({"time/generate": t1 - t0, "time/logprobs": t2 - t1, "time/train": t3 - t2,
                  "time/step": t3 - t0, "time/gen_tokens_per_s": gen_tokens / max(t1 - t0, 1e-9),
                  "time/train_tokens_per_s": batch.num_tokens * max(len(upd), 1) / max(t3 - t2, 1e-9)})
        return m
