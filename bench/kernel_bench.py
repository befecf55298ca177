"""Kernel benchmarks (BENCHMARKS.md section 4): each rlcu kernel against its PyTorch
equivalent and against the ceilings measured in the same run.

    python bench/kernel_bench.py [--only attention,elementwise]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import measure_ceilings, write_json  # noqa: E402
from bench.kernel_suites import SUITES  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated suites (default: all)")
    args = ap.parse_args()
    ceil = measure_ceilings()
    print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    rows, errors = [], {}
    for s in (args.only.split(",") if args.only else SUITES):
        try:
            mod = importlib.import_module(f"bench.kernel_suites.{s}")
            got = mod.run(ceil)
            for r in got:
                r["suite"] = s
            rows += got
        except Exception:
            errors[s] = traceback.format_exc()
            print(f"suite {s} failed:\n{errors[s]}", file=sys.stderr)
    write_json("kernels.json", {"ceilings": ceil, "results": rows, "errors": errors})
    print(f"\n{'kernel':<40} {'ms':>9} {'peer ms':>9}  notes")
    for r in rows:
        peer = r.get("ms_sdpa") or r.get("ms_eager") or r.get("ms_peer") or r.get("ms_torch")
        notes = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                         if k not in ("name", "ms", "suite", "ms_sdpa", "ms_eager") and not isinstance(v, (list, dict)))
        print(f"{r['name']:<40} {r['ms']:>9.3f} {peer if peer is None else f'{peer:9.3f}'}  {notes}")


if __name__ == "__main__":
    main()
