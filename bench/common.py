"""Shared benchmark plumbing: the machine's two ceilings, run metadata, JSON output."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def meta() -> dict:
    import triton

    commit = os.environ.get("RLCU_COMMIT")  # first: a copied tree's .git may be stale or absent
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                                             stderr=subprocess.DEVNULL).decode().strip()
        except Exception:
            commit = "unknown"
    return {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def measure_ceilings() -> dict:
    """Copy bandwidth (bytes read + written, 4 GiB buffer) and the bf16 matmul rate (8192^3),
    median of repeated CUDA-event timings after warm-up."""
    from triton.testing import do_bench

    n = 1 << 30  # 1 Gi fp32 elements = 4 GiB
    a = torch.empty(n, device="cuda", dtype=torch.float32).uniform_()
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    copy = 2 * a.numel() * 4 / (ms * 1e-3) / 1e9
    a = b = None
    M = 8192
    x = torch.randn(M, M, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(M, M, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: x @ y, warmup=50, rep=300, return_mode="median")
    mm = 2 * M**3 / (ms * 1e-3) / 1e12
    x = y = None
    torch.cuda.empty_cache()
    return {"copy_GBps": copy, "bf16_matmul_TFLOPs": mm}


def write_json(name: str, payload: dict) -> Path:
    """Write to $OUT (on the device machine) and bench/results/."""
    payload = {"meta": meta(), **payload}
    text = json.dumps(payload, indent=2, default=float)
    out = os.environ.get("OUT")
    if out:
        Path(out, name).write_text(text)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / name
    path.write_text(text)
    return path


def qwen3_06b_config(**kw):
    """The published Qwen3-0.6B shape (rlcu.Qwen3Config's defaults)."""
    from rlcu.model.config import Qwen3Config

    return Qwen3Config(**kw)
