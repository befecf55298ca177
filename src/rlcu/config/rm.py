"""Reward-model training's config (`rlcu rm`): the run's sections (RunConfig) and the pair step."""

from __future__ import annotations

import dataclasses

from rlcu.config.fields import opt
from rlcu.config.sections import RunConfig


@dataclasses.dataclass
class RMConfig(RunConfig):
    """`rlcu rm`: the shared sections, then the Bradley-Terry step over preference pairs.
    model.path is a causal LM (a fresh score head) or a `...ForSequenceClassification` folder
    (its head trained on)."""

    steps: int = opt(100, "optimizer steps", ge=1)
    batch_pairs: int = opt(32, "preference pairs per optimizer step (across all ranks)", ge=1)
    batch_tokens: int = opt(4096, "tokens per packed micro-batch, a pair's chosen and rejected sequences together "
                                  "(a pair longer than this gets a micro-batch of its own)", ge=2)
    max_seq_len: int = opt(1024, "drop pairs whose chosen or rejected sequence is longer than this many tokens "
                                 "(the count is logged)", ge=2)
    center_rewards_coefficient: float | None = opt(
        None, "TRL's: add coef * mean((r_chosen + r_rejected)^2) to the loss, which keeps rewards centred on 0; "
              "null: off", ge=0)
    head_init_std: float = opt(0.02, "std of the fresh score head's normal initialisation when model.path is a "
                                     "causal LM (transformers' initializer_range)", ge=0)
    eval_every: int = opt(0, "held-out loss, accuracy and margin (data.eval_path or data.eval_size) every N steps; "
                             "0: at the end only", ge=0)
    seed: int = opt(0, "global seed", ge=0)
