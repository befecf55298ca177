"""DPO's config (`rlcu dpo`): SFT's packed-batch step over preference pairs, and the loss."""

from __future__ import annotations

import dataclasses

from rlcu.config.fields import ConfigError, opt
from rlcu.config.sections import RunConfig

DPO_LOSSES = ("sigmoid", "ipo")


@dataclasses.dataclass
class DPOConfig(RunConfig):
    """`rlcu dpo`: the shared sections, the packed-batch step (as SFT's), then the loss and its
    reference. A pair's chosen and rejected sequences always share a micro-batch."""

    steps: int = opt(100, "optimizer steps", ge=1)
    batch_tokens: int = opt(4096, "tokens per packed micro-batch, a pair's two sequences counted together (a pair "
                                  "longer than this gets a micro-batch of its own)", ge=1)
    grad_accum: int = opt(1, "micro-batches per optimizer step (gradient accumulation); the loss is the mean "
                             "over the step's pairs", ge=1)
    max_seq_len: int = opt(1024, "drop pairs whose prompt + chosen or prompt + rejected is longer than this many "
                                 "tokens (the count is logged)", ge=2)
    eval_every: int = opt(0, "held-out metrics (data.eval_path or data.eval_size) every N steps; 0: at the end only",
                          ge=0)
    seed: int = opt(0, "global seed", ge=0)
    loss_type: str = opt("sigmoid", "sigmoid: DPO, -log sigmoid(beta h) with h the chosen's log-ratio to the "
                                    "reference less the rejected's (cDPO with label_smoothing); ipo: "
                                    "(h' - 1/(2 beta))^2 with h' of per-token mean log-ratios (TRL's IPO)",
                         choices=DPO_LOSSES)
    beta: float = opt(0.1, "the KL strength beta (IPO's tau): larger stays closer to the reference", gt=0)
    label_smoothing: float = opt(0.0, "sigmoid: the probability eps that a label is flipped (cDPO: "
                                      "-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h))", ge=0, lt=0.5)
    ref_model: str | None = opt(None, "the reference model's HF folder or Hub id; null: the initial policy (with "
                                      "LoRA: the base with the adapters off). Its logprobs are taken once, before "
                                      "training, and kept in log.out_dir/ref_logprobs.pt")

    def check(self):
        if self.loss_type == "ipo" and self.label_smoothing:
            raise ConfigError("label_smoothing", f"applies to loss_type sigmoid only, got {self.label_smoothing} "
                                                 f"with ipo")
