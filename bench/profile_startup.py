"""Where a GRPO job's start-up goes (a diagnostic for bench/sched.py, same job config).

The scheduler benchmark's GPU idle time over a run is mostly start-up: the jobs begin
together, and nothing runs on the GPU until each has built its model, engine and optimizer
(the `init` phase) and got through its first rollout and update, which load the Triton
kernels and capture the decode graph. This runs one such job alone, in this process, and
reports the seconds of: importing rlcu, creating the CUDA context, the trainer's
construction (with its heaviest calls from cProfile), and the first steps (generate / train
each), so that the start-up can be compared with a steady step; the last step's calls by
their own time show where a steady step's host time goes.

    python bench/profile_startup.py [--hidden 1024 --layers 8 --prompts 32 --steps 3] [--top 12]
    python bench/profile_startup.py --cpu --hidden 64 --layers 2 --prompts 2 --new-tokens 8   # smoke run
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))


def _top(prof: cProfile.Profile, n: int, by: str = "cum_s") -> list[dict]:
    """The n calls of rlcu (and torch's built-ins) with the largest cumulative time (by
    "cum_s") or time in the function itself (by "self_s")."""
    st = pstats.Stats(prof)
    rows = []
    for (path, line, fn), (_, ncalls, self_s, cum, _) in st.stats.items():
        if "rlcu" in path or path == "~":
            name = fn if path == "~" else f"{Path(path).name}:{line}({fn})"
            rows.append({"call": name, "cum_s": cum, "self_s": self_s, "calls": ncalls})
    return sorted(rows, key=lambda r: -r[by])[:n]


def _sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--cpu", action="store_true", help="a smoke run on the CPU")
    ap.add_argument("--init", choices=("checkpoint", "random"), default="checkpoint",
                    help="the job model's weights: loaded from a base checkpoint, or drawn at init (as bench/sched.py)")
    a = ap.parse_args()
    a.steps = max(a.steps, 2)

    t0 = time.perf_counter()
    import torch

    import rlcu  # noqa: F401
    from bench.sched import job_config
    from rlcu.config import GRPOConfig, load_config
    from rlcu.data.synthetic import make_tokenizer, sort_rows
    from rlcu.train.grpo import GRPOTrainer

    out = {"import_s": time.perf_counter() - t0}
    cuda = not a.cpu
    if cuda and not torch.cuda.is_available():
        ap.error("no CUDA device: use --cpu for a smoke run")
    t = time.perf_counter()
    if cuda:
        torch.ones(1, device="cuda").add_(1)
        _sync(cuda)
    out["cuda_context_s"] = time.perf_counter() - t

    work = Path(tempfile.mkdtemp(prefix="rlcu-startup-"))
    make_tokenizer().save_pretrained(work / "tok")
    (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sort_rows(512, seed=0)))
    cfg = load_config(GRPOConfig, job_config(0, a, work, work / "tok", work / "prompts.jsonl", eager=a.cpu))

    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    tr = GRPOTrainer(cfg)
    _sync(cuda)
    prof.disable()
    out["init_s"] = time.perf_counter() - t
    out["init_top"] = _top(prof, a.top)

    steps = []
    for s in range(a.steps):
        prof = cProfile.Profile() if s == 0 or (s == a.steps - 1 and a.steps > 2) else None
        t = time.perf_counter()
        if prof:
            prof.enable()
        m = tr.train_step(s)
        _sync(cuda)
        if prof:
            prof.disable()
            if s == 0:
                out["first_step_top"] = _top(prof, a.top)
            else:  # a steady step: where the host's own time goes
                out["steady_step_self"] = _top(prof, a.top, by="self_s")
        steps.append({"step_s": time.perf_counter() - t,
                      **{k[5:] + "_s": m[k] for k in ("time/generate", "time/train") if k in m}})
    out["steps"] = steps
    # the steady reference: the fastest step after the first, the profiled last one left out
    steady = min(st["step_s"] for st in (steps[1:-1] if len(steps) > 2 else steps[1:]))
    out["first_step_excess_s"] = steps[0]["step_s"] - steady
    out["startup_excess_s"] = out["cuda_context_s"] + out["init_s"] + out["first_step_excess_s"]

    print(f"import {out['import_s']:.2f} s  CUDA context {out['cuda_context_s']:.2f} s  init {out['init_s']:.2f} s")
    for i, s in enumerate(steps):
        print(f"step {i}: {s['step_s']:.2f} s  (generate {s.get('generate_s', float('nan')):.2f}, "
              f"train {s.get('train_s', float('nan')):.2f})")
    print(f"start-up beyond a steady step, from the CUDA context on: {out['startup_excess_s']:.2f} s")
    for key, by in (("init_top", "cum_s"), ("first_step_top", "cum_s"), ("steady_step_self", "self_s")):
        if key not in out:  # (no steady step is profiled in a run of 2 steps)
            continue
        print(f"--- {key.rsplit('_', 1)[0]}: largest {'cumulative' if by == 'cum_s' else 'self'} times")
        for r in out[key]:
            print(f"  {r[by]:7.3f} s  {r['calls']:6d}x  {r['call']}")
    if not a.cpu:
        from bench.common import meta, write_json

        write_json("profile_startup.json", {"meta": meta(), "args": vars(a), **out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
