"""The global batch across ranks: which part of a step's work a rank does, and the statistics
that must be taken over the whole batch rather than a rank's share.

* Prompts: rank r rolls out the contiguous block `rank_block(P)` of a step's P prompts (each
  prompt is one group of G samples, so a group is never split), and prompt i draws from seed
  index i whatever rank it lands on (`rollout.sample(seed_offset=lo)`), so N ranks draw the
  samples one process draws.
* SFT micro-batches: every rank draws the step's micro-batches (example indices: cheap,
  host-side), takes the contiguous block of the step's examples that holds about 1/N of its
  tokens and packs it again into micro-batches of the same budget (`rank_micro_batches`), and
  normalises by the global token count it already knows. So any `grad_accum` works at any N,
  like GRPO's global batch; a rank may get fewer micro-batches than another, or none.
* Normalisers and statistics (token / sequence counts of the loss, reward mean and std,
  PPO's whitening and running reward moments) are sums over ranks (`world.all_sum`), so they
  equal one process's up to the order of the sums.
* With overlapped gradient reduction every rank must run the same number of backward passes
  in a step: `equal_passes` agrees on the largest count, and a rank with fewer runs
  `dummy_backward` (two tokens, zero gradient) for the rest.
One process: every helper is the identity (or the local statistic).
"""

from __future__ import annotations

import bisect
import math

import torch

from rlcu.parallel.comm import all_gather_objects, all_max, all_sum, world


def rank_block(n: int, w=None) -> tuple[int, int]:
    """[lo, hi): this rank's contiguous share of n items (sizes differ by at most one)."""
    w = w or world()
    return n * w.rank // w.size, n * (w.rank + 1) // w.size


def token_block(lengths: list[int], w=None) -> tuple[int, int]:
    """[lo, hi): this rank's contiguous share of items `lengths` tokens long, by tokens: item i
    goes to the rank whose 1/N of the total holds its middle (on a boundary: the lower rank;
    blocks may be empty)."""
    w = w or world()
    total, owners, c = sum(lengths), [], 0
    for n in lengths:  # item i's middle sits at c + n/2: rank ceil(N (2c + n) / (2 total)) - 1
        owners.append(min(max(w.size * (2 * c + n) - 1, 0) // max(2 * total, 1), w.size - 1))
        c += n
    return bisect.bisect_left(owners, w.rank), bisect.bisect_left(owners, w.rank + 1)


def rank_micro_batches(batches: list[list[int]], lengths, budget: int, w=None) -> list[list[int]]:
    """This rank's micro-batches (lists of item indices) of a step drawn as `batches` (SFT's
    `grad_accum` micro-batches; item i is lengths[i] tokens long). One process: `batches`
    itself. N ranks: the step's items in order, cut by `token_block`, this rank's block packed
    greedily into micro-batches of at most `budget` tokens (an item longer than that alone)."""
    w = w or world()
    if not w.distributed:
        return batches
    items = [i for b in batches for i in b]
    lo, hi = token_block([lengths[i] for i in items], w)
    return greedy_batches(lengths, items[lo:hi], budget)


def greedy_batches(lengths, idx: list[int], budget: int) -> list[list[int]]:
    """`idx` in order, cut into runs of at most `budget` tokens (item i is lengths[i] tokens; a
    longer item alone): a rank's block here, a step's pairs and held-out sets in the trainers."""
    out, tok = [], 0
    for i in idx:
        if not out or tok + lengths[i] > budget:
            out.append([])
            tok = 0
        out[-1].append(i)
        tok += lengths[i]
    return out


def equal_passes(n_local: int) -> int:
    """The number of backward passes every rank runs this step (the largest over ranks)."""
    return int(all_max(n_local))


def dummy_backward(model) -> None:
    """One backward pass that adds nothing to the gradient (a rank short of micro-batches
    keeps the overlapped reduce-scatters of the other ranks company). A MoE model's
    load-balancing loss is weighted 0 through it: its gradient does not depend on the head's."""
    dev = model.device
    tokens = torch.zeros(2, dtype=torch.long, device=dev)
    cu = torch.tensor([0, 2], dtype=torch.int32, device=dev)
    weight, model.aux_weight = model.aux_weight, 0.0
    try:
        model.forward_backward(tokens, cu, lambda lp_c, ent_c, idx: (torch.zeros_like(lp_c), None))
    finally:
        model.aux_weight = weight


def global_mean_std(x: torch.Tensor) -> tuple[float, float]:
    """Mean and unbiased std over every rank's non-nan entries of x (nan, 0 when undefined)."""
    x = x.double().flatten()
    x = x[~torch.isnan(x)]
    s = torch.tensor([x.numel(), float(x.sum()) if x.numel() else 0.0], dtype=torch.float64)
    s = all_sum(s)
    n, tot = float(s[0]), float(s[1])
    if n == 0:
        return math.nan, 0.0
    mean = tot / n
    ss = all_sum(float(((x - mean) ** 2).sum()) if x.numel() else 0.0)
    return mean, math.sqrt(ss / (n - 1)) if n > 1 else 0.0


def global_whiten(x: torch.Tensor, w: torch.Tensor | None = None, eps: float = 1e-8) -> torch.Tensor:
    """rlcu.train.losses.whiten over the whole batch: (x - mean) / (std + eps), the moments over
    every rank's entries with w > 0 (all entries when w is None), summed in float64."""
    sel = x if w is None else x[w > 0]
    mean, std = global_mean_std(sel)
    n = all_sum(float(sel.numel()))
    if n < 2:
        return x - (mean if n else 0.0)
    return (x - mean) / (std + eps)


def update_moments(moments, x: torch.Tensor) -> None:
    """RunningMoments.update with the whole batch's scores (every rank gets the same state)."""
    if not world().distributed:
        moments.update(x)
        return
    x = x[~torch.isnan(x)].double()
    s = all_sum(torch.tensor([x.numel(), float(x.sum()) if x.numel() else 0.0], dtype=torch.float64))
    n = float(s[0])
    if n == 0:
        return
    bm = float(s[1]) / n
    bv = all_sum(float(((x - bm) ** 2).sum()) if x.numel() else 0.0) / n
    moments.merge(n, bm, bv)


def gather_samples(samples: list) -> list:
    """Every rank's rollout samples, in rank order (the one-process order when each rank
    rolled out its `rank_block` of the prompts): every rank then scores, normalises and
    filters the same global batch, and trains on its block of it (`rank_seq_range`)."""
    if not world().distributed:
        return samples
    return [s for part in all_gather_objects(samples) for s in part]


def rank_seq_range(n_seqs: int, group_size: int) -> tuple[int, int]:
    """[a, b): the sequences of the global batch this rank trains on (whole groups)."""
    lo, hi = rank_block(n_seqs // group_size)
    return lo * group_size, (hi * group_size if hi < n_seqs // group_size else n_seqs)
