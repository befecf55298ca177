"""The demo's config (`rlcu demo`): the sort task with its sloppy teacher, the tiny model and
the two phases' knobs (SFT warm-up, then GRPO). rlcu.train.demo runs it."""

from __future__ import annotations

import dataclasses

from rlcu.config.fields import ConfigError, Section, opt

MODEL = dict(hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=24, max_position_embeddings=64, tie_word_embeddings=True,
             rope_theta=10000.0, bos_token_id=None)


@dataclasses.dataclass
class DemoTaskConfig(Section):
    min_len: int = opt(4, "fewest digits in a prompt", ge=1, le=10)
    max_len: int = opt(8, "most digits in a prompt", ge=1, le=10)
    distinct: bool = opt(True, "the digits of a prompt are all different")
    sloppy: float = opt(0.7, "how often the SFT teacher forgets the last digit (of long lists)", ge=0, le=1)
    sloppy_min_len: int = opt(6, "the teacher is sloppy on lists of at least this many digits", ge=0)
    n_train: int = opt(4000, "training prompts (SFT demonstrations and GRPO prompts)", ge=1)
    n_eval: int = opt(200, "held-out prompts (never trained on)", ge=1)

    def check(self):
        if self.min_len > self.max_len:
            raise ConfigError("min_len", f"must be <= max_len ({self.max_len}), got {self.min_len}")


@dataclasses.dataclass
class DemoConfig(Section):
    """The demo's knobs. The defaults keep the CPU run far below 5 minutes on 2 cores, with a
    wide margin on the accuracy gain (measured: about 40 s and +50 points)."""

    out: str = opt("runs/demo", "output folder")
    seed: int = opt(0, "seed of the data, the initial weights and the sampling", ge=0)
    device: str = opt("auto", "where to run (auto: cuda when available)", choices=("auto", "cpu", "cuda"))
    dtype: str = opt("float32", "working precision of the weights", choices=("float32", "bfloat16"))
    threads: int | None = opt(None, "torch CPU threads (null: 1 on the CPU, where the tiny model's ops are too "
                                    "small to split)", ge=1)
    progress: bool = opt(True, "progress bars")
    task: DemoTaskConfig = opt(DemoTaskConfig, "the sort task and its sloppy teacher")
    model: dict = opt(MODEL, "Qwen3Config fields of the tiny model (vocab_size and eos come from the tokenizer)")
    sft_steps: int = opt(60, "SFT warm-up steps", ge=1)
    sft_lr: float = opt(3e-3, "SFT peak learning rate (10 warmup steps, then cosine to 10%)", gt=0)
    sft_batch_tokens: int = opt(1024, "tokens per SFT step", ge=1)
    grpo_steps: int = opt(40, "GRPO steps", ge=1)
    grpo_lr: float = opt(2e-4, "GRPO learning rate (constant)", gt=0)
    prompts_per_step: int = opt(16, "GRPO prompts per step", ge=1)
    group_size: int = opt(8, "GRPO completions per prompt", ge=2)
    temperature: float = opt(1.0, "GRPO sampling temperature", gt=0)
    clip_high: float = opt(0.28, "GRPO ratio clip above (clip_low is 0.2)", ge=0)
    eval_every: int = opt(5, "held-out greedy accuracy every N GRPO steps (0: only before and after)", ge=0)
