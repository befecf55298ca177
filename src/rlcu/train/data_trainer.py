"""`DataTrainer`: what the trainers of a fixed data set (SFT, DPO, reward models) share on the core.

Their run is the same around a different step: a model built or taken (and refused if it cannot
fit), rows loaded and checked by the trainer's own row format (`row_items`), a data stream whose
(epoch, cursor) is the checkpoint's data state, one optimizer step a `train_step` inside one
phase, `gradient_checkpointing: auto` resolved at the first step from the memory model, the
per-rank estimate logged from the same shape, and train() returning the last step's metrics. A
subclass sets `step_phase`, builds `self.stream` and `self.optimizer`, and writes `_step`; the
reward trainer sizes its trunk (`_sized_model`) and checkpoints its head beside it.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from pathlib import Path

from rlcu.parallel import batch as dp
from rlcu.train import sizing
from rlcu.train.checkpoint import build_model
from rlcu.train.core import Hooks, Trainer, load_tokenizer
from rlcu.train.schedule import lr_at


def row_items(source, name: str, load_file: Callable[..., list], check: Callable[[dict, str], None],
              **where) -> list[tuple[str, dict]]:
    """Rows with their locations ('file:line' from `load_file`, else 'name[i]'), each checked by
    `check(row, location)`, so that every message names the row it is about."""
    if isinstance(source, (str, Path)):
        return load_file(source, **where)
    items = [(f"{name}[{i}]", r) for i, r in enumerate(source)]
    for at, r in items:
        if not isinstance(r, dict):
            raise ValueError(f"{at}: a row must be a dict, got {type(r).__name__}")
        check(r, at)
    return items


class DataTrainer(Trainer):
    """The core's run for a trainer over a fixed data set (module docstring). `__init__` takes
    the model given (None: `_build_model`), after the fit check that must come before it."""

    step_phase = "actor_train"

    def __init__(self, config, hooks: Hooks | None, model):
        super().__init__(config, hooks)
        self._refuse_unfit(model)
        self.model = self._build_model(model)
        self.device = self.model.device

    def _build_model(self, model):
        """The model given, else one built from `config.model`."""
        return model if model is not None else build_model(self.cfg.model)

    def _sized_model(self):
        """The model the memory model sizes (a reward model: its trunk)."""
        return self.model

    def _need_tokenizer(self, rows: list[tuple[str, dict]], ids_field: str, what: str) -> None:
        """Load the tokenizer (model.tokenizer / model.path) when a row is text, not `ids_field`."""
        if self.tokenizer is None and any(ids_field not in r for _, r in rows):
            self.tokenizer = load_tokenizer(self.cfg.model, what)

    # ---------------------------------------------------------------- checkpoints
    def _trainer_state(self) -> dict:
        return {"data": self.stream.state_dict(), "metrics_tail": self.history[-20:]}

    def _load_state(self, state: dict) -> None:
        self.stream.load_state_dict(state["data"])
        self.history = list(state.get("metrics_tail", []))

    def _checkpoint_objects(self, loading: bool = False) -> tuple:
        return self._ckpt_model(self.model), self.optimizer, {}

    # ---------------------------------------------------------------- training
    def train_step(self, step: int | None = None) -> dict:
        with self.hooks.phase(self.step_phase):
            return self._step(self.step if step is None else step)

    @abc.abstractmethod
    def _step(self, step: int) -> dict:
        """One optimizer step (0-based `step`) -> its metrics."""

    def _begin_step(self, step: int) -> tuple[float, float]:
        """(start time, lr) of a step; `auto` checkpointing resolved first (its first step only)."""
        t0 = time.perf_counter()
        if self.model.gradient_checkpointing == "auto":  # a number of layers from the memory model
            self._log_info(sizing.resolve_auto(self._sized_model(), self._memory_shape()))
        return t0, lr_at(step, self.cfg.optim, self.cfg.steps)

    def _zero_grad(self, n_local: int) -> None:
        """Zero the gradient, then run the dummy backward passes that bring this rank's `n_local`
        micro-batches to every rank's count (the model's overlapped reduce-scatters pair up)."""
        self.model.zero_grad()
        for _ in range(dp.equal_passes(n_local) - n_local):
            dp.dummy_backward(self.model)

    # ---------------------------------------------------------------- memory, result
    def _memory_shape(self):
        """This rank's job as the memory model sees it (rlcu.train.sizing.run_shape): a
        micro-batch of batch_tokens, the head's forward and backward apart."""
        return sizing.run_shape(self._sized_model(), self.optimizer, micro_batch_tokens=self.cfg.batch_tokens,
                                fused_head=False)

    def _log_estimate(self) -> None:
        sizing.log_estimate(self.logger, self._memory_shape(), self.device)

    def _result(self) -> dict:
        """train() returns the last step's metrics."""
        return {k: v for k, v in self.history[-1].items() if k != "step"} if self.history else {}
