"""Reward-model training (`rlcu rm`, `rlcu.RewardTrainer`): Bradley-Terry on preference pairs.

For P pairs in a step, with r_c, r_r the reward model's scores (model/reward_model.py: the head
at each sequence's last token) of the chosen and rejected sequences, m the pair's margin (0
when the data has none), d = r_c - r_r - m and c the center_rewards_coefficient (TRL's):

    L = (1/P) sum_p -log sigmoid(d_p)  +  c (1/P) sum_p (r_c + r_r)^2
    dL/dr_c = (-sigmoid(-d) + 2c (r_c + r_r)) / P,   dL/dr_r = (sigmoid(-d) + 2c (r_c + r_r)) / P

Each pair's loss depends on its own two scores, so the step's micro-batches (pairs packed under
batch_tokens, a pair's chosen and rejected sequences in the same micro-batch, one varlen batch)
each start their backward from these gradients with the step's P and the accumulated gradient is
the whole batch's. The backward is ours: the head's, then the trunk's hidden_backward (the
machinery PPO's critic shares, model/scalar_head.py). Across ranks each takes a block of the
step's pairs by tokens and the optimizer (ShardedAdamW) reduces the gradient at the step.

With `lora:` the trunk's base is frozen and adapters train on it (model/lora.py), the head fully:
two optimizers, the adapters' and the head's (`HeadParams`), each clipping its own gradient norm;
a checkpoint holds the adapters (PEFT), the head and both optimizers; the final folder has the
adapters merged into the trunk (and the PEFT adapter is written beside it, <log.out_dir>/adapter).

Metrics: loss, accuracy (the share of pairs with r_c > r_r), margin (mean r_c - r_r), the mean
chosen and rejected rewards; the same on the held-out pairs as eval/*. The trained model is saved
as an HF `...ForSequenceClassification` folder in every checkpoint's model/ and, at the end, in
<log.out_dir>/reward_model.
"""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path

import torch

from rlcu.config import RMConfig
from rlcu.data.preference import PreferencePair, check_preference_row, encode_preference_row, load_preference_items
from rlcu.data.prompt_check import shown_rows
from rlcu.hub import model_folder
from rlcu.model.causal_lm import CausalLM
from rlcu.model.lora_peft import merge_into
from rlcu.model.reward_model import RewardModel
from rlcu.parallel import batch as dp
from rlcu.parallel.comm import all_sum, world
from rlcu.parallel.zero import make_optimizer
from rlcu.train.checkpoint import build_model
from rlcu.train.core import Hooks
from rlcu.train.data_trainer import DataTrainer, row_items
from rlcu.train.lora import LoraCheckpoint, save_final
from rlcu.train.rows import EpochCursor, load_rows


def bt_loss(rc: torch.Tensor, rr: torch.Tensor, margin: torch.Tensor, n_pairs: int, center: float | None = None):
    """The Bradley-Terry loss of these pairs as a share of a step of `n_pairs` (module docstring)
    -> (loss summed over these pairs / n_pairs, dL/dr_c, dL/dr_r), fp32."""
    rc, rr = rc.float(), rr.float()
    d = rc - rr - margin.float()
    loss = -torch.nn.functional.logsigmoid(d)
    s = torch.sigmoid(-d)
    drc, drr = -s, s.clone()
    if center:
        tot = rc + rr
        loss = loss + center * tot * tot
        drc, drr = drc + 2 * center * tot, drr + 2 * center * tot
    return loss.sum() / n_pairs, drc / n_pairs, drr / n_pairs


class PairStream(EpochCursor):
    """Pairs in a seeded per-epoch order, `batch_pairs` at a time (a step may cross an epoch's
    end); the state is (epoch, cursor)."""

    def __init__(self, n: int, shuffle: bool, seed: int):
        super().__init__(n, seed, shuffle)
        self.n = n

    def next(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            out.append(self._order(self.epoch)[self.cursor])
            self.cursor += 1
            if self.cursor == self.n:
                self.epoch, self.cursor = self.epoch + 1, 0
        return out


class HeadParams:
    """A reward model's head slots (w, and the unused bias) as an optimizer's model, when adapters
    train the trunk: `flat` a view of the model's, `grad_flat` the model's head-only gradient."""

    def __init__(self, rm: RewardModel):
        self.rm = rm
        self.flat = rm.flat[rm.layout.head_offset :]
        self.layout = type("HeadLayout", (), {"numel": self.flat.numel()})()

    @property
    def grad_flat(self):
        return self.rm.grad_flat

    @property
    def grad_dtype(self):
        return self.rm.grad_dtype

    @grad_dtype.setter
    def grad_dtype(self, dt) -> None:
        self.rm.grad_dtype = dt

    def zero_grad(self) -> None:
        self.rm.zero_grad()

    def release_grads(self) -> None:
        self.rm.release_grads()

    def state_dict(self) -> dict:
        return {"flat": self.flat.detach().cpu().clone()}

    def load_state_dict(self, d: dict) -> None:
        if d["flat"].shape != self.flat.shape:
            raise ValueError(f"head state has {d['flat'].numel()} elements, this model's head {self.flat.numel()}")
        self.flat.copy_(d["flat"])


def build_reward_model(cfg: RMConfig) -> RewardModel:
    """model.path as a sequence-classification folder (its head kept) or a causal LM (a fresh
    head), or model.tiny from scratch (a fresh head)."""
    m = cfg.model
    device, dtype = m.resolve_device(), m.resolve_dtype()
    if m.path is not None:
        folder = model_folder(m.path, m.revision, "model.path")
        archs = json.loads((Path(folder) / "config.json").read_text()).get("architectures") or []
        if any(str(a).endswith("ForSequenceClassification") for a in archs):
            rm = RewardModel.from_pretrained(folder, device=device, dtype=dtype)
            m.check_layers(rm.cfg.num_hidden_layers)
            rm.gradient_checkpointing = m.gradient_checkpointing
            return rm
    return RewardModel.from_causal_lm(build_model(m, device, dtype), head_init_std=cfg.head_init_std, seed=cfg.seed)


class RewardTrainer(DataTrainer):
    """`RewardTrainer(config, dataset=None, eval_dataset=None, model=None, tokenizer=None).train()`
    on the trainer core (the loop, checkpoints, resume, signals, logging).

    dataset / eval_dataset: lists of rows, file paths or Hub ids, or None for data.path /
    data.eval_path (else data.eval_size rows held out). model: a RewardModel, a CausalLM (a fresh
    head on it), or None to build one from `config.model`. tokenizer: for text rows (None: loaded
    from model.tokenizer / model.path when needed). hooks: each step is phase "rm_train", each
    evaluation "eval"."""

    config_cls = RMConfig
    kind = "rm"
    step_phase = "rm_train"

    def __init__(self, config: RMConfig | dict | str | Path | None = None, dataset=None, eval_dataset=None,
                 model=None, tokenizer=None, hooks: Hooks | None = None):
        super().__init__(config, hooks, model)
        cfg = self.cfg
        load = partial(row_items, load_file=load_preference_items, check=check_preference_row)
        rows, eval_rows, src = load_rows(cfg.data, dataset, eval_dataset, load, "reward-model training")
        self.tokenizer = tokenizer
        self._need_tokenizer(rows + eval_rows, "chosen_token_ids", "text preference rows")
        if self.model.pad_token_id is None and getattr(self.tokenizer, "pad_token_id", None) is not None:
            self.model.pad_token_id = self.tokenizer.pad_token_id  # what HF pads a batch with when it scores
        self.pairs = self._encode(rows, src)
        self.eval_pairs = self._encode(eval_rows, cfg.data.eval_path or f"{src} (held out)") if eval_rows else []
        self.lengths = [len(p.chosen) + len(p.rejected) for p in self.pairs]
        self.stream = PairStream(len(self.pairs), cfg.data.shuffle, cfg.data.seed)
        ad = self._attach_lora(self.model.trunk)  # the adapters with lora:, else the trunk
        self.lora = None if ad is self.model.trunk else ad
        # ShardedAdamW across ranks; with adapters, theirs and the head's
        self.optimizer = make_optimizer(self.lora or self.model, cfg.optim)
        self.head = HeadParams(self.model) if self.lora is not None else None
        self.head_optimizer = make_optimizer(self.head, cfg.optim) if self.head is not None else None

    def _build_model(self, model) -> RewardModel:
        """The reward model given; a CausalLM given gets a fresh head; None: build_reward_model."""
        cfg = self.cfg
        if isinstance(model, CausalLM):
            return RewardModel.from_causal_lm(model, head_init_std=cfg.head_init_std, seed=cfg.seed)
        return model if model is not None else build_reward_model(cfg)

    def _sized_model(self):
        """The trunk (no LM head slot): the memory model counts an LM head's chunked work where the
        scalar head has next to none, so it errs high."""
        return self.model.trunk

    def _encode(self, rows: list[tuple[str, dict]], src: str) -> list[PreferencePair]:
        """Tokenise (location, row) pairs, dropping (counted, named in the log) those too long."""
        cfg, V = self.cfg, self.model.cfg.vocab_size
        if not rows:
            raise ValueError(f"{src}: no rows (an empty data set); reward-model training needs preference pairs")
        limit = min(cfg.max_seq_len, self.model.cfg.max_position_embeddings)
        out, long = [], []
        for where, r in rows:
            try:
                p = encode_preference_row(r, self.tokenizer, **cfg.data.chat_template_kwargs)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            bad = next((t for t in p.chosen + p.rejected if not 0 <= t < V), None)
            if bad is not None:
                raise ValueError(f"{where}: token id {bad} outside the model's vocabulary [0, {V})")
            n = max(len(p.chosen), len(p.rejected))
            if n > limit:
                long.append(f"{where} ({n} tokens)")
                continue
            out.append(p)
        if long:
            self._notes.append(f"{src}: dropped {len(long)} of {len(rows)} pairs longer than {limit} tokens: "
                               f"{shown_rows(long)}")
        if not out:
            raise ValueError(f"no preference pairs left from {src} ({len(rows)} rows, {len(long)} too long)")
        return out

    # ---------------------------------------------------------------- batches
    def _micro_batch(self, idx: list[int], pairs: list[PreferencePair]):
        """The chosen sequences then the rejected ones, packed: (tokens, cu_seqlens, margins)."""
        seqs = [pairs[i].chosen for i in idx] + [pairs[i].rejected for i in idx]
        tokens = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=self.device)
        cu = torch.tensor([0] + [len(s) for s in seqs], dtype=torch.int64).cumsum(0).to(torch.int32).to(self.device)
        margin = torch.tensor([pairs[i].margin for i in idx], dtype=torch.float32, device=self.device)
        return tokens, cu, margin

    def _pass(self, idx, pairs, n_pairs: int, grad: bool) -> torch.Tensor:
        """One micro-batch's forward (and backward with grad) -> sums [loss, correct, margin, r_c, r_r]."""
        tokens, cu, margin = self._micro_batch(idx, pairs)
        r = self.model.forward(tokens, cu, grad=grad)
        n = len(idx)
        rc, rr = r[:n], r[n:]
        loss, drc, drr = bt_loss(rc, rr, margin, n_pairs, self.cfg.center_rewards_coefficient)
        if grad:
            self.model.backward(torch.cat([drc, drr]))
        return torch.stack([loss * n_pairs, (rc > rr).float().sum(), (rc - rr).sum(), rc.sum(), rr.sum()]).detach()

    # ---------------------------------------------------------------- checkpoints
    def _checkpoint_objects(self, loading: bool = False) -> tuple:
        if self.lora is None:
            return self.model, self.optimizer, {}
        return (LoraCheckpoint(self.model.trunk, self.cfg.model.path), self.optimizer,
                {"head": self.head, "head_optim": self.head_optimizer})

    def _finite_tensors(self) -> list[torch.Tensor]:
        out = super()._finite_tensors()
        return out if self.head is None else [*out, self.head.flat]

    def _start_message(self) -> str:
        return (f"reward model: {len(self.pairs)} pairs, {self._trainable_note(self.model.trunk)} and a head of "
                f"{self.model.cfg.hidden_size}, {self.cfg.steps} steps on {self.device}")

    # ---------------------------------------------------------------- training
    def _step(self, step: int) -> dict:
        cfg = self.cfg
        t0, lr = self._begin_step(step)
        drawn = self.stream.next(cfg.batch_pairs)  # the global batch
        P = len(drawn)
        mine = dp.rank_micro_batches(dp.greedy_batches(self.lengths, drawn, cfg.batch_tokens), self.lengths,
                                     cfg.batch_tokens)
        self.model.zero_grad()
        sums = torch.zeros(5, dtype=torch.float32, device=self.device)
        for idx in mine:
            sums += self._pass(idx, self.pairs, P, grad=True)
        s = all_sum(sums.cpu().double()) / P
        info = self.optimizer.step(lr, float(s[0]))  # may raise NonFiniteError
        if self.head_optimizer is not None:
            info["head_grad_norm"] = self.head_optimizer.step(lr, float(s[0]))["grad_norm"]
        dt = time.perf_counter() - t0
        n_tok = sum(self.lengths[i] for i in drawn)
        return {"loss": float(s[0]), "accuracy": float(s[1]), "margin": float(s[2]), "reward_chosen": float(s[3]),
                "reward_rejected": float(s[4]), **info, "pairs": P, "tokens": n_tok, "epoch": self.stream.epoch,
                "pairs_per_s": P / dt, "tokens_per_s": n_tok / dt, "step_seconds": dt}

    @property
    def has_eval(self) -> bool:
        return bool(self.eval_pairs)

    def eval_metrics(self) -> dict:
        """eval/loss, eval/accuracy, eval/margin, eval/reward_chosen, eval/reward_rejected over the held-out
        pairs (their micro-batches sharded over the ranks, the sums gathered)."""
        if not self.eval_pairs:
            return {}
        with self.hooks.phase("eval"):
            lengths = [len(p.chosen) + len(p.rejected) for p in self.eval_pairs]
            sums = torch.zeros(5, dtype=torch.float64)
            w = world()
            runs = dp.greedy_batches(lengths, list(range(len(self.eval_pairs))), self.cfg.batch_tokens)
            for k, idx in enumerate(runs):
                if k % w.size == w.rank:
                    sums += self._pass(idx, self.eval_pairs, 1, grad=False).cpu().double()
            s = all_sum(sums) / len(self.eval_pairs)
        return {f"eval/{k}": float(v) for k, v in zip(("loss", "accuracy", "margin", "reward_chosen",
                                                        "reward_rejected"), s)}

    def evaluate(self) -> dict:
        """The held-out metrics now (eval_metrics)."""
        return self.eval_metrics()

    def _save_adapter(self, start: int) -> None:
        """At the end of a run that trained: the reward model as an HF sequence-classification folder
        (with the tokenizer) in <log.out_dir>/reward_model, if its weights are finite."""
        if self.step == start or not world().is_main:
            return
        if self._state_finite():
            out, rm = self.out_dir / "reward_model", self.model
            if self.lora is not None:
                self.logger.info(f"LoRA adapter: {save_final(rm.trunk, self.out_dir, self.cfg.model.path)}")
                rm = RewardModel(rm.cfg, rm.flat.clone(), rm.pad_token_id, rm.tie_word_embeddings)
                rm.source = self.model.source
                merge_into(rm.trunk, self.lora)  # a copy: the live trunk keeps its adapters
            rm.save_pretrained(out)
            if self.tokenizer is not None and hasattr(self.tokenizer, "save_pretrained"):
                self.tokenizer.save_pretrained(out)
            self.logger.info(f"reward model: {out}")
