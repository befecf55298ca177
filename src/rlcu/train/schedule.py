"""Learning-rate schedule: linear warmup, then constant or cosine decay.

For 0-based step s of `total` steps, warmup w, peak lr and floor r = min_lr_ratio:
    s < w:      lr (s + 1) / w
    constant:   lr
    cosine:     lr (r + (1 - r) (1 + cos(pi p)) / 2),  p = (s - w) / max(1, total - w)
"""

from __future__ import annotations

import math

from rlcu.config import OptimConfig


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """The learning rate of 0-based optimizer step `step`."""
    w = cfg.warmup_steps
    if step < w:
        return cfg.lr * (step + 1) / w
    if cfg.schedule == "constant":
        return cfg.lr
    p = min(1.0, (step - w) / max(1, total_steps - w))
    r = cfg.min_lr_ratio
    return cfg.lr * (r + (1 - r) * 0.5 * (1 + math.cos(math.pi * p)))
