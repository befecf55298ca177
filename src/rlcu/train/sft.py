"""Supervised fine-tuning on packed sequences, loss on completion tokens only.

One optimizer step takes `grad_accum` micro-batches from the packed stream. Each
micro-batch is a packed token stream (examples back to back, `cu_seqlens` marking them, so
attention never crosses examples) of at most `batch_tokens` tokens. With m the completion
mask over all tokens of the step and n = sum(m), the loss is

    L = -(1/n) sum_i m_i lp_i,        so  dL/dlp_i = -m_i / n,

and each micro-batch's backward starts from that dlp: the accumulated gradient equals the
gradient of one big batch. Across N ranks the step is the same global batch: each rank
takes a contiguous block of its examples holding about 1/N of its tokens, repacked under the
same budget (rlcu.parallel.batch.rank_micro_batches), so any grad_accum runs at any N and trains
as one process does up to the order of sums. The data order is a seeded permutation per
epoch, so the data position (epoch, cursor) is the whole data state, and resuming from a
checkpoint replays the remaining steps bit for bit.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import torch

from rlcu.config import SFTConfig
from rlcu.data.datasets import check_sft_row, encode_sft_row, load_sft_items
from rlcu.data.prompt_check import shown_rows
from rlcu.parallel import batch as dp
from rlcu.parallel.comm import all_sum, world
from rlcu.parallel.zero import make_optimizer
from rlcu.train.core import Hooks
from rlcu.train.data_trainer import DataTrainer, row_items
from rlcu.train.moe_aux import AuxShare
from rlcu.train.rows import EpochCursor, load_rows
from rlcu.train.static_batch import misfit, pack, slot_bucket
from rlcu.train.step_graph import StepGraph, why_not


class PackedStream(EpochCursor):
    """Greedy packing of examples (in a seeded per-epoch order) into micro-batches of at
    most `batch_tokens` tokens; an example longer than that is a micro-batch alone. A
    micro-batch never spans two epochs."""

    def __init__(self, lengths: list[int], batch_tokens: int, shuffle: bool, seed: int):
        if not lengths:
            raise ValueError("no training examples left to pack")
        super().__init__(len(lengths), seed, shuffle)
        self.lengths, self.batch_tokens = lengths, batch_tokens

    def order(self) -> list[int]:
        return self._order(self.epoch)

    def next_batch(self) -> list[int]:
        order = self.order()
        out, tok = [], 0
        while self.cursor < len(order):
            i = order[self.cursor]
            if out and tok + self.lengths[i] > self.batch_tokens:
                break
            out.append(i)
            tok += self.lengths[i]
            self.cursor += 1
        if self.cursor >= len(order):
            self.epoch, self.cursor = self.epoch + 1, 0
        return out


class SFTTrainer(DataTrainer):
    """`SFTTrainer(config, dataset=None, model=None, tokenizer=None).train()` on the trainer
    core (rlcu.train.core.Trainer: the loop, checkpoints, resume, signals, logging; what the
    trainers of a data set share: rlcu.train.data_trainer).

    dataset: a list of rows, a file path, or None for `config.data.path`. model: a Qwen3,
    or None to build one from `config.model`. tokenizer: needed for text rows (None: loaded
    from model.tokenizer / model.path when required). hooks: rlcu.train.core.Hooks (each step
    is phase "actor_train", each evaluation "eval")."""

    config_cls = SFTConfig
    kind = "sft"

    def __init__(self, config: SFTConfig | dict | str | Path | None = None, dataset=None, model=None,
                 tokenizer=None, hooks: Hooks | None = None):
        super().__init__(config, hooks, model)
        cfg = self.cfg
        trained = self._attach_lora(self.model)  # the adapters with lora:, else the model
        d = cfg.data
        fields = dict(prompt_field=d.prompt_field, completion_field=d.completion_field,
                      messages_field=d.messages_field)
        load = partial(row_items, load_file=partial(load_sft_items, **fields),
                       check=lambda r, at: check_sft_row(r, at, **fields))
        rows, eval_rows, src = load_rows(d, dataset, None, load, "SFT")
        self.tokenizer = tokenizer
        self._need_tokenizer(rows + eval_rows, "prompt_token_ids", "text SFT rows")
        self.examples = self._encode(rows, src, fields)
        self.eval_examples = self._encode(eval_rows, d.eval_path or f"{src} (held out)", fields) if eval_rows else []
        self.stream = PackedStream([len(e[0]) for e in self.examples], cfg.batch_tokens, d.shuffle, d.seed)
        self._n_mask = [sum(m) for _, m in self.examples]  # completion tokens of each example
        self.optimizer = make_optimizer(trained, cfg.optim)  # ShardedAdamW across ranks
        self.step_graph = self._make_step_graph() if cfg.cuda_graph else None
        self._graph_misfits = 0  # steps that ran eagerly because a micro-batch did not fit the graph

    def _make_step_graph(self):
        reason = why_not(self.model, self.optimizer)
        if reason is None and world().size > 1:
            reason = "data parallel across ranks"
        if reason is not None:
            self._notes.append(f"cuda_graph: eager steps ({reason})")
            return None
        limit = min(self.cfg.max_seq_len, self.model.cfg.max_position_embeddings)
        return StepGraph(self.model, self.optimizer, budget=self.cfg.batch_tokens, max_seqlen=limit)

    def _encode(self, rows: list[tuple[str, dict]], src: str, fields: dict) -> list[tuple[list[int], list[int]]]:
        """Tokenise (location, row) pairs to (ids, mask), dropping too long or empty ones: counted,
        and named by row in the log (as GRPO's dropped prompts are)."""
        cfg, V = self.cfg, self.model.cfg.vocab_size
        if not rows:
            raise ValueError(f"{src}: no rows (an empty data set); SFT needs at least one example")
        out, long, empty = [], [], []
        limit = min(cfg.max_seq_len, self.model.cfg.max_position_embeddings)  # never past the context
        for where, r in rows:
            try:
                ids, mask = encode_sft_row(r, self.tokenizer, **fields, **cfg.data.chat_template_kwargs)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            bad = next((t for t in ids if not 0 <= t < V), None)
            if bad is not None:
                raise ValueError(f"{where}: token id {bad} outside the model's vocabulary [0, {V})")
            if len(ids) > limit:
                long.append(f"{where} ({len(ids)} tokens)")
                continue
            if ids:
                mask[0] = 0  # a sequence's first token has no prediction
            if not any(mask):
                empty.append(where)
                continue
            out.append((ids, mask))
        if long:
            why = (f"max_seq_len={cfg.max_seq_len}" if limit == cfg.max_seq_len else
                   f"the model's context ({limit}; max_seq_len={cfg.max_seq_len})")
            self._notes.append(f"{src}: dropped {len(long)} of {len(rows)} examples longer than {why} tokens: "
                               f"{shown_rows(long)}")
        if empty:
            self._notes.append(f"{src}: dropped {len(empty)} examples with no completion token to train on: "
                               f"{shown_rows(empty)}")
        if not out:
            raise ValueError(f"no SFT examples left from {src} ({len(rows)} rows; {len(long)} too long, "
                             f"{len(empty)} empty)")
        return out

    # ---------------------------------------------------------------- batches
    def _micro_batch(self, idx: list[int], examples=None, device=None):
        examples = self.examples if examples is None else examples
        ids, mask, lens = [], [], []
        for i in idx:
            a, m = examples[i]
            ids += a
            mask += m
            lens.append(len(a))
        dev = self.device if device is None else device
        tokens = torch.tensor(ids, dtype=torch.long, device=dev)
        cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)
        return tokens, cu, torch.tensor(mask, dtype=torch.float32, device=dev), sum(mask)

    def _start_message(self) -> str:
        return (f"SFT: {len(self.examples)} examples, {self._trainable_note(self.model)}, "
                f"{self.cfg.steps} steps on {self.device}")

    # ---------------------------------------------------------------- training
    def _step(self, step: int) -> dict:
        cfg = self.cfg
        t0, lr = self._begin_step(step)
        graph = self.step_graph
        drawn = [self.stream.next_batch() for _ in range(cfg.grad_accum)]  # the global batch
        items = [i for b in drawn for i in b]
        n_tok, n_seq = sum(self._n_mask[i] for i in items), len(items)
        n_all = sum(self.stream.lengths[i] for i in items)
        # across ranks: this rank's block of the step's examples, by tokens (n_tok stays global)
        mine = dp.rank_micro_batches(drawn, self.stream.lengths, cfg.batch_tokens)
        batches = [self._micro_batch(idx, device="cpu" if graph else None) for idx in mine]
        packed = self._graph_batches(batches, n_tok) if graph else None
        if packed is not None:
            loss, info = graph.step(packed, lr)  # may raise NonFiniteError
        else:
            if graph:
                batches = [(t.to(self.device), c.to(self.device), m.to(self.device), n) for t, c, m, n in batches]
            loss, info = self._eager_step(batches, n_tok, lr, n_all)
        dt = time.perf_counter() - t0
        return {"loss": loss, **info, "tokens": n_all, "completion_tokens": n_tok,
                "sequences": n_seq, "epoch": self.stream.epoch,
                "tokens_per_s": n_all / dt, "step_seconds": dt}

    def _eager_step(self, batches, n_tok: int, lr: float, n_all: int) -> tuple[float, dict]:
        """n_tok: the global batch's loss tokens (the loss's mean), n_all: all its tokens (a MoE
        model's load-balancing loss weighs each micro-batch by its share: train/moe_aux.py)."""
        self._zero_grad(len(batches))
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        aux = AuxShare(self.model, n_all)
        for tokens, cu, mask, _ in batches:
            lp = self.model.forward(tokens, cu)
            aux.add(tokens.numel())
            loss_sum += -(lp * mask).sum()
            aux.weigh(tokens.numel())
            self.model.backward(mask * (-1.0 / n_tok))
        aux.done()
        loss = all_sum(float(loss_sum)) / n_tok
        return loss, {**self.optimizer.step(lr, loss), **aux.metrics()}  # may raise NonFiniteError

    def _graph_batches(self, batches, n_tok: int) -> list[dict] | None:
        """The step's micro-batches packed for the step graph (host tensors), or None when one
        does not fit its budget (logged the first time; the step then runs eagerly)."""
        g, out = self.step_graph, []
        for tokens, cu, mask, _ in batches:
            S = cu.numel() - 1
            why = misfit(tokens.numel(), S, int((cu[1:] - cu[:-1]).max()), g.budget, g.max_seqlen)
            if why is not None:
                if not self._graph_misfits:
                    self._log_info(f"cuda_graph: an eager step ({why}); later ones are counted in graph_misfits")
                self._graph_misfits += 1
                return None
            out.append(pack(tokens, cu, mask * (-1.0 / n_tok), g.budget, slot_bucket(S, g.budget)))
        return out

    @property
    def has_eval(self) -> bool:
        return bool(self.eval_examples)

    def eval_metrics(self) -> dict:
        return {"eval/loss": self.evaluate()} if self.eval_examples else {}

    def evaluate(self) -> float | None:
        """Mean completion-token loss over the held-out examples (None when there are none)."""
        if not self.eval_examples:
            return None
        with self.hooks.phase("eval"):
            ev = PackedStream([len(e[0]) for e in self.eval_examples], self.cfg.batch_tokens, False, 0)
            total, n, i = 0.0, 0, 0
            while ev.epoch == 0:
                idx = ev.next_batch()
                i += 1
                if (i - 1) % world().size != world().rank:  # sharded over the ranks, the sums gathered
                    continue
                tokens, cu, mask, n_mask = self._micro_batch(idx, self.eval_examples)
                lp = self.model.forward(tokens, cu, grad=False)
                total += float(-(lp * mask).sum())
                n += n_mask
        return all_sum(total) / all_sum(n)
