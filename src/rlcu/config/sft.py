"""SFT's config (`rlcu sft`): the run's sections (RunConfig) and the packed-batch step."""

from __future__ import annotations

import dataclasses

from rlcu.config.fields import opt
from rlcu.config.sections import RunConfig


@dataclasses.dataclass
class SFTConfig(RunConfig):
    """`rlcu sft`: the shared sections, then the packed-batch step."""

    steps: int = opt(100, "optimizer steps", ge=1)
    batch_tokens: int = opt(4096, "tokens per packed micro-batch (an example longer than this gets a "
                                  "micro-batch of its own)", ge=1)
    grad_accum: int = opt(1, "micro-batches per optimizer step (gradient accumulation)", ge=1)
    cuda_graph: bool = opt(False, "replay each step as CUDA graphs (micro-batch forward + backward padded to "
                                  "batch_tokens, and the optimizer step), captured at the first step; eager, "
                                  "with the reason logged, on the CPU, in exact mode, with several ranks or "
                                  "bf16 gradients, and for a micro-batch past batch_tokens. Pays where "
                                  "launches, not the GPU, bound the step: small micro-batches and the PPO "
                                  "critic (bench/results/train_graph.json). Off by default: past ~8k tokens "
                                  "a micro-batch gains little, every micro-batch is padded to batch_tokens, "
                                  "and the first step captures (~1 s); turn it on for small micro-batches")
    max_seq_len: int = opt(1024, "drop examples longer than this many tokens (the count is logged)", ge=2)
    eval_every: int = opt(0, "held-out loss (data.eval_path or data.eval_size) every N steps; 0: at the end only",
                          ge=0)
    seed: int = opt(0, "global seed", ge=0)

