"""Direct preference optimisation on packed pairs, with a reference taken once.

`DPOTrainer` is SFT's step over preference pairs: one optimizer step takes `grad_accum`
micro-batches of at most `batch_tokens` tokens from a seeded per-epoch order of the pairs, a
pair's chosen and rejected sequences always in one micro-batch (rlcu.train.pair_batch). Each
micro-batch runs the policy's packed forward, sums each sequence's completion logprobs, takes
the pair loss and its gradient by hand (rlcu.train.dpo_loss: sigmoid / cDPO, IPO) and hands
the per-token dlp to model.backward, the LM-head sweep every trainer's gradient starts from.
The step's loss is the mean over its pairs, whatever the micro-batching and the ranks (each
rank takes a block of the step's pairs by tokens, as SFT's examples).

The reference's sequence logprobs are computed once, before the first update, and kept in
log.out_dir/ref_logprobs.pt with the data's fingerprint (rlcu.train.dpo_ref): a resume reads
them back, so no reference model is held while training (16 bytes a pair, which the memory
model leaves out: SFT's shape, rlcu.train.data_trainer). The metrics are TRL's
(rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen,
logps/rejected), on the held-out pairs too (eval/...).
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from pathlib import Path

import torch

from rlcu.config import DPOConfig
from rlcu.data.preference import check_preference_row, encode_preference_row, load_preference_items
from rlcu.data.prompt_check import shown_rows
from rlcu.model.causal_lm import CausalLM
from rlcu.parallel import batch as dp
from rlcu.parallel.comm import all_sum, world
from rlcu.parallel.zero import make_optimizer
from rlcu.train import dpo_ref
from rlcu.train.checkpoint import build_model
from rlcu.train.core import Hooks
from rlcu.train.data_trainer import DataTrainer, row_items
from rlcu.train.dpo_loss import PAIR_STATS, pair_loss, pair_stats, token_grads
from rlcu.train.pair_batch import Pair, pack_pairs, pair_len, seq_logprobs
from rlcu.train.rows import load_rows
from rlcu.train.sft import PackedStream

# Checked preference rows with their locations ('file:line', 'dataset[i]'), which the messages
# name (rlcu.data.preference); the reward trainer reads the same rows.
load_preference_rows = partial(row_items, load_file=load_preference_items, check=check_preference_row)


class DPOTrainer(DataTrainer):
    """`DPOTrainer(config, dataset=None, model=None, tokenizer=None).train()` on the trainer
    core (the loop, checkpoints, resume, signals, logging; rlcu.train.data_trainer).

    dataset, eval_dataset: lists of rows or a path (None: config.data.path / eval_path) in TRL's
    preference format (rlcu.data.preference: prompt / chosen / rejected as text or messages, or
    token ids; a margin is read and not used, as TRL's DPO). model: a CausalLM, or None to build
    one from `config.model`.
    tokenizer: for text rows (None: loaded from model.tokenizer / model.path when required).
    hooks: rlcu.train.core.Hooks (phases "ref_logprobs", "actor_train", "eval")."""

    config_cls = DPOConfig
    kind = "dpo"

    def __init__(self, config: DPOConfig | dict | str | Path | None = None, dataset=None, model=None,
                 tokenizer=None, eval_dataset=None, hooks: Hooks | None = None):
        super().__init__(config, hooks, model)
        cfg = self.cfg
        trained = self._attach_lora(self.model)  # the adapters with lora:, else the model
        self.tokenizer = tokenizer
        rows, eval_rows, src = load_rows(cfg.data, dataset, eval_dataset, load_preference_rows, "DPO")
        self.pairs = self._encode(rows, src)
        self.eval_pairs = self._encode(eval_rows, cfg.data.eval_path or f"{src} (held out)") if eval_rows else []
        self.stream = PackedStream([pair_len(p) for p in self.pairs], cfg.batch_tokens, cfg.data.shuffle,
                                   cfg.data.seed)
        self.ref_lp: dict[str, torch.Tensor] | None = None  # {"train", "eval"}: [P, 2] (chosen, rejected)
        self._ref_fresh: str | None = None  # the fingerprint of logprobs computed here, not yet saved
        if cfg.ref_model is not None:  # its weights live for the pass only, before the optimizer's state exists
            self.reference_logprobs()
        self.optimizer = make_optimizer(trained, cfg.optim)  # ShardedAdamW across ranks

    # ---------------------------------------------------------------- data
    def _encode(self, rows: list[tuple[str, dict]], src: str) -> list[Pair]:
        """Tokenised pairs, dropping those too long for max_seq_len (or the context) and those
        with an empty side: counted, and named by row in the log."""
        if not rows:
            raise ValueError(f"{src}: no rows (an empty data set); DPO needs at least one pair")
        self._need_tokenizer(rows, "chosen_token_ids", "text preference rows")
        V = self.model.cfg.vocab_size
        limit = min(self.cfg.max_seq_len, self.model.cfg.max_position_embeddings)
        out, long, empty = [], [], []
        for where, r in rows:
            try:
                e = encode_preference_row(r, self.tokenizer, **self.cfg.data.chat_template_kwargs)
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
            pair = (e.prompt_ids, e.chosen_ids, e.rejected_ids)
            bad = next((t for ids in pair for t in ids if isinstance(t, bool) or not 0 <= t < V), None)
            if bad is not None:
                raise ValueError(f"{where}: token id {bad} outside the model's vocabulary [0, {V})")
            p, c, rj = pair
            n = max(len(p) + len(c), len(p) + len(rj))
            if n > limit:
                long.append(f"{where} ({n} tokens)")
            elif not c or not rj or len(p) + min(len(c), len(rj)) < 2:
                empty.append(where)
            else:
                out.append(pair)
        if long:
            self._notes.append(f"{src}: dropped {len(long)} of {len(rows)} pairs longer than {limit} tokens: "
                               f"{shown_rows(long)}")
        if empty:
            self._notes.append(f"{src}: dropped {len(empty)} pairs with an empty chosen or rejected completion: "
                               f"{shown_rows(empty)}")
        if not out:
            raise ValueError(f"no DPO pairs left from {src} ({len(rows)} rows; {len(long)} too long, "
                             f"{len(empty)} empty)")
        return out

    # ---------------------------------------------------------------- the reference
    def _reference(self) -> tuple[CausalLM, str]:
        """(model, source) of the reference pass: ref_model, the base under LoRA (a model over
        the same frozen buffer, adapters off), else the policy itself while still initial."""
        cfg = self.cfg
        if cfg.ref_model is not None:
            mc = dataclasses.replace(cfg.model, path=cfg.ref_model, tiny=None, revision=None,
                                     gradient_checkpointing=True)
            ref = build_model(mc, device=str(self.device), dtype=self.model.dtype)
            if ref.cfg.vocab_size != self.model.cfg.vocab_size:
                raise ValueError(f"ref_model {cfg.ref_model}: vocabulary of {ref.cfg.vocab_size} tokens, the policy "
                                 f"has {self.model.cfg.vocab_size}")
            return ref, f"ref_model:{cfg.ref_model}"  # (the trainer's constructor runs its pass, then drops it)
        if self.model.lora is not None:
            return CausalLM(self.model.cfg, self.model.flat, self.model.exact), "base (adapters off)"
        return self.model, "initial policy"

    def reference_logprobs(self) -> dict[str, torch.Tensor]:
        """{"train", "eval"}: [P, 2] float64 reference sequence logprobs (chosen, rejected),
        read from log.out_dir/ref_logprobs.pt when its fingerprint is this run's, else computed
        by one pass of the reference now (so: before the first update) and saved there."""
        if self.ref_lp is not None:
            return self.ref_lp
        sets = {"train": self.pairs, "eval": self.eval_pairs}
        ref, source = self._reference()
        path = self.out_dir / dpo_ref.FILE
        fp = dpo_ref.fingerprint(sets, source, ref)
        got = dpo_ref.load(path, fp)
        if got is not None:
            self._log_info(f"reference logprobs: read from {path} ({source})")
        else:
            t0 = time.perf_counter()
            with self.hooks.phase("ref_logprobs"):
                got = dpo_ref.compute(ref, sets, self.cfg.batch_tokens)
            self._log_info(f"reference logprobs: {len(self.pairs) + len(self.eval_pairs)} pairs of the {source} "
                           f"in {time.perf_counter() - t0:.1f} s")
            self._ref_fresh = fp
        self.ref_lp = got
        return got

    def _open_run(self) -> bool:
        """The reference pass first (the model is still the initial policy: a resume loads its
        checkpoint inside the core's _open_run), its file written once the folder is claimed."""
        self.reference_logprobs()
        resumed = super()._open_run()
        if self._ref_fresh is not None:
            dpo_ref.save(self.out_dir / dpo_ref.FILE, self._ref_fresh, self.ref_lp)
            self._ref_fresh = None
        return resumed

    def _start_message(self) -> str:
        return (f"DPO ({self.cfg.loss_type}, beta {self.cfg.beta}): {len(self.pairs)} pairs, "
                f"{len(self.eval_pairs)} held out, {self._trainable_note(self.model)}, {self.cfg.steps} steps on "
                f"{self.device}")

    # ---------------------------------------------------------------- the loss
    def _pair_terms(self, b, lp: torch.Tensor, ref: torch.Tensor, scale: float):
        """(stats [len(PAIR_STATS)] float64 sums, dlp [N]) of one micro-batch; `scale` = 1 / the
        step's pair count."""
        c = self.cfg
        pi = seq_logprobs(b, lp)
        ref = ref.to(pi.device)
        loss, dc, dr = pair_loss(pi[:, 0], pi[:, 1], ref[:, 0], ref[:, 1], b.n_completion[:, 0],
                                 b.n_completion[:, 1], loss_type=c.loss_type, beta=c.beta,
                                 label_smoothing=c.label_smoothing)
        stats = pair_stats(loss, pi[:, 0], pi[:, 1], ref[:, 0], ref[:, 1], c.beta)
        dseq = torch.stack([dc, dr], 1).view(-1) * scale
        return stats.cpu(), token_grads(dseq, b.mask, b.seq)

    # ---------------------------------------------------------------- training
    def train_step(self, step: int | None = None) -> dict:
        self.reference_logprobs()  # (a library caller stepping without train(): taken now)
        return super().train_step(step)

    def _step(self, step: int) -> dict:
        cfg = self.cfg
        t0, lr = self._begin_step(step)
        drawn = [self.stream.next_batch() for _ in range(cfg.grad_accum)]  # the global batch
        P = sum(len(b) for b in drawn)
        n_all = sum(self.stream.lengths[i] for b in drawn for i in b)
        mine = dp.rank_micro_batches(drawn, self.stream.lengths, cfg.batch_tokens)  # this rank's, by tokens
        ref = self.ref_lp["train"]
        self._zero_grad(len(mine))
        stats = torch.zeros(len(PAIR_STATS), dtype=torch.float64)
        for idx in mine:
            b = pack_pairs(self.pairs, idx, self.device)
            lp = self.model.forward(b.tokens, b.cu)
            s, dlp = self._pair_terms(b, lp, ref[idx], 1.0 / P)
            self.model.backward(dlp)
            stats += s
        stats = all_sum(stats) / P
        m = dict(zip(PAIR_STATS, stats.tolist()))
        info = self.optimizer.step(lr, m["loss"])  # may raise NonFiniteError
        dt = time.perf_counter() - t0
        return {**m, **info, "pairs": P, "tokens": n_all, "epoch": self.stream.epoch, "pairs_per_s": P / dt,
                "tokens_per_s": n_all / dt, "step_seconds": dt}

    @property
    def has_eval(self) -> bool:
        return bool(self.eval_pairs)

    def eval_metrics(self) -> dict:
        return {f"eval/{k}": v for k, v in self.evaluate().items()} if self.eval_pairs else {}

    def evaluate(self) -> dict:
        """TRL's metrics (and the loss) over the held-out pairs, {} when there are none."""
        if not self.eval_pairs:
            return {}
        ref = self.reference_logprobs()["eval"]
        with self.hooks.phase("eval"):
            lengths = [pair_len(p) for p in self.eval_pairs]
            runs = dp.greedy_batches(lengths, list(range(len(self.eval_pairs))), self.cfg.batch_tokens)
            stats = torch.zeros(len(PAIR_STATS), dtype=torch.float64)
            for k, idx in enumerate(runs):
                if k % world().size != world().rank:  # sharded over the ranks, the sums gathered
                    continue
                b = pack_pairs(self.eval_pairs, idx, self.device)
                lp = self.model.forward(b.tokens, b.cu, grad=False)
                stats += self._pair_terms(b, lp, ref[idx], 1.0)[0]
        stats = all_sum(stats) / len(self.eval_pairs)
        return dict(zip(PAIR_STATS, stats.tolist()))
