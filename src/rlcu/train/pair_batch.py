"""Preference pairs as packed micro-batches: a pair's chosen and rejected sequences side by side.

A pair is (prompt_ids, chosen_ids, rejected_ids), what rlcu.data.preference tokenises TRL's
rows to. It becomes two sequences, prompt + chosen and prompt + rejected, whose completion
tokens (never the prompt's, nor a sequence's first token, which nothing predicts) are masked
in. A micro-batch packs whole pairs back to back, [c_0, r_0, c_1, r_1, ...] with cu_seqlens
marking them, so that one forward gives both sides of every pair it holds and the pair loss
(rlcu.train.dpo_loss) needs nothing from another micro-batch.
"""

from __future__ import annotations

import dataclasses

import torch

from rlcu.parallel.batch import greedy_batches
from rlcu.train.dpo_loss import seq_sums

Pair = tuple[list[int], list[int], list[int]]  # prompt_ids, chosen_ids, rejected_ids


def pair_len(p: Pair) -> int:
    """The tokens a pair takes in a micro-batch (the prompt twice)."""
    return 2 * len(p[0]) + len(p[1]) + len(p[2])


@dataclasses.dataclass
class PairBatch:
    tokens: torch.Tensor  # [N] long
    cu: torch.Tensor  # [2P + 1] int32
    mask: torch.Tensor  # [N] fp32: 1 on the completion tokens that carry loss
    seq: torch.Tensor  # [N] long: each token's sequence (2k chosen, 2k + 1 rejected of pair k)
    n_completion: torch.Tensor  # [P, 2] completion tokens (chosen, rejected): IPO's averages, as TRL counts them

    @property
    def n_pairs(self) -> int:
        return self.n_completion.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()


def pack_pairs(pairs: list[Pair], idx: list[int], device) -> PairBatch:
    """The pairs `idx` of `pairs` as one packed micro-batch on `device`."""
    ids, mask, lens, counts = [], [], [], []
    for i in idx:
        p, c, r = pairs[i]
        for comp in (c, r):
            m = [0] * len(p) + [1] * len(comp)
            m[0] = 0  # a sequence's first token has no prediction
            ids += p + comp
            mask += m
            lens.append(len(p) + len(comp))
        counts.append((len(c), len(r)))
    lt = torch.tensor(lens, dtype=torch.long)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
    cu[1:] = lt.cumsum(0)
    return PairBatch(tokens=torch.tensor(ids, dtype=torch.long, device=device),
                     cu=cu.to(torch.int32).to(device),
                     mask=torch.tensor(mask, dtype=torch.float32, device=device),
                     seq=torch.repeat_interleave(torch.arange(len(lens)), lt).to(device),
                     n_completion=torch.tensor(counts, dtype=torch.float64, device=device).view(-1, 2))


def seq_logprobs(b: PairBatch, lp: torch.Tensor) -> torch.Tensor:
    """[P, 2] float64 (chosen, rejected): each sequence's masked logprob sum, from `lp` [N]."""
    return seq_sums(lp, b.mask, b.seq, 2 * b.n_pairs).view(-1, 2)


def pair_logprobs(model, pairs: list[Pair], idx: list[int], budget: int) -> torch.Tensor:
    """[len(idx), 2] float64: the sequence logprobs of the pairs `idx` under `model` (no
    gradient), micro-batches of at most `budget` tokens."""
    lengths = {i: pair_len(pairs[i]) for i in idx}
    out = []
    for run in greedy_batches(lengths, idx, budget):
        b = pack_pairs(pairs, run, model.device)
        lp = model.forward(b.tokens, b.cu, grad=False)
        out.append(seq_logprobs(b, lp).cpu())
    return torch.cat(out) if out else torch.zeros(0, 2, dtype=torch.float64)
