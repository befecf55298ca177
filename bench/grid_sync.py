"""What one device-wide synchronisation costs on the GPU, against what it would replace: the
boundary between two dependent kernels of a CUDA graph. A decode step at Qwen3-0.6B is ~280
launches of 2-6 us (bench/decode_step.py's `rest`); a persistent kernel a layer would separate
its phases by grid barriers instead, and this is the price of one.

Cases, each one CUDA graph timed by CUDA events (median of 15 replays after 3), N = 1000:
  launches  N back-to-back launches of P programs that each load, add one and store one int32
            (each launch depends on the one before, as a layer's kernels do: drain, flush, launch);
  barrier   one launch of the same P programs doing the same N times, with a grid barrier after
            each (an arrival counter: every program's stores, a CTA barrier, a release add; then
            acquire reads until all P have arrived), the counter zeroed by the graph first;
at P = 1, 2 and 4 programs an SM (all co-resident: the barrier needs it). Per boundary =
the graph's time / N. Both are checked: every program's value ends at N (the barrier's counter
at N x P).

    python bench/grid_sync.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import capture, replay_ms, write_json  # noqa: E402

N = 1000


@triton.jit
def _touch_kernel(X):
    p = tl.program_id(0)
    tl.store(X + p, tl.load(X + p) + 1)


@triton.jit
def _barrier_kernel(X, CNT, n, P):
    p = tl.program_id(0)
    v = tl.load(X + p)
    for i in range(n):
        v += 1
        tl.store(X + p, v)
        tl.debug_barrier()  # every thread's stores before the release
        tl.atomic_add(CNT, 1, sem="release", scope="gpu")
        target = (i + 1) * P
        seen = tl.atomic_add(CNT, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(CNT, 0, sem="acquire", scope="gpu")


def case(P: int) -> dict:
    x = torch.zeros(P, device="cuda", dtype=torch.int32)
    cnt = torch.zeros(1, device="cuda", dtype=torch.int32)

    def launches():
        for _ in range(N):
            _touch_kernel[(P,)](x, num_warps=4)

    def barrier():
        cnt.zero_()
        _barrier_kernel[(P,)](x, cnt, N, P, num_warps=4)

    out = {"programs": P}
    for name, fn in (("launches", launches), ("barrier", barrier)):
        g, _ = capture(fn)
        x.zero_()
        g.replay()
        torch.cuda.synchronize()
        ok = bool((x == N).all()) and (name == "launches" or int(cnt) == N * P)
        ms = replay_ms(g.replay, 15, warm=3)
        out[name] = {"us_per_boundary": 1e3 * ms / N, "graph_ms": ms, "checked": ok}
        del g
    return out


def main() -> int:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for k in (1, 2, 4):
        r = case(k * sms)
        rows.append(r)
        print(f"P = {r['programs']:>4} ({k} an SM): a launch boundary {r['launches']['us_per_boundary']:.2f} us, "
              f"a grid barrier {r['barrier']['us_per_boundary']:.2f} us  (checked: "
              f"{r['launches']['checked']} / {r['barrier']['checked']})", flush=True)
    write_json("grid_sync.json", {"sms": sms, "n": N, "rows": rows})
    return 0 if all(r[c]["checked"] for r in rows for c in ("launches", "barrier")) else 1


if __name__ == "__main__":
    sys.exit(main())
