"""One packed micro-batch at a fixed token budget, in buffers whose addresses never change: what
a captured training step (train/step_graph.py) reads.

A batch of n tokens in S sequences (cu_seqlens [S+1]) goes into `budget` rows and `slots`
sequence slots (S <= slots): rows n.. are padding (token 0, position 0) and slots S.. are empty
sequences, so cu_seqlens[S:] all equal n. Attention gives the padding rows zero output and zero
gradient (they lie past cu_seqlens[-1]); everything else in a layer is row by row, so padding
changes no real row's value.

The LM head runs over every row, shifted: row i scores targets[i] = tokens[i + 1], and weights[i]
is the upstream gradient dL/dlp of that token (`dlp[i + 1]`, in `Qwen3.backward`'s numbering).
Rows that predict nothing -- each sequence's last token and the padding -- get target 0 and
weight 0, so their head gradient is exactly zero and they add exact zeros to every weight
gradient. Against the unpadded step only the order of the sums differs (the GEMMs' K is the
budget, the head's chunks fall elsewhere): the same loss and gradients up to rounding.
"""

from __future__ import annotations

import torch


def slot_bucket(n_seqs: int, budget: int) -> int:
    """The sequence slots of a graph for n_seqs sequences: the next power of two (at most the
    budget), so that a few graphs serve every batch."""
    return min(1 << max(n_seqs - 1, 0).bit_length(), budget)


def misfit(n_tokens: int, n_seqs: int, longest: int, budget: int, max_seqlen: int) -> str | None:
    """Why a batch cannot go through the static buffers (None when it can)."""
    if n_tokens > budget:
        return f"the micro-batch has {n_tokens} tokens, more than the graph's budget of {budget}"
    if longest > max_seqlen:
        return f"a sequence of {longest} tokens is longer than the graph's max_seqlen {max_seqlen}"
    if n_seqs < 1:
        return "the micro-batch has no sequence"
    return None


def pack(tokens: torch.Tensor, cu_seqlens: torch.Tensor, dlp: torch.Tensor, budget: int, slots: int) -> dict:
    """Host tensors of one batch at the budget: tokens [n] int, cu_seqlens [S+1] int, dlp [n] float
    (CPU) -> {tokens, targets [budget] int64, weights [budget] fp32, pos [budget] int32,
    cu [slots+1] int32} (see the module docstring)."""
    tokens, cu, dlp = tokens.cpu().long(), cu_seqlens.cpu().long(), dlp.cpu().float()
    n, S = tokens.numel(), cu.numel() - 1
    if n > budget or S > slots or S < 1:
        raise ValueError(f"a batch of {n} tokens in {S} sequences does not fit {budget} rows and {slots} slots")
    out = {"tokens": torch.zeros(budget, dtype=torch.int64), "targets": torch.zeros(budget, dtype=torch.int64),
           "weights": torch.zeros(budget, dtype=torch.float32), "pos": torch.zeros(budget, dtype=torch.int32),
           "cu": torch.full((slots + 1,), n, dtype=torch.int32)}
    out["tokens"][:n] = tokens
    out["targets"][: n - 1] = tokens[1:]
    out["weights"][: n - 1] = dlp[1:]
    last = cu[1:] - 1  # each sequence's last row predicts nothing
    out["targets"][last] = 0
    out["weights"][last] = 0.0
    out["cu"][: S + 1] = cu.to(torch.int32)
    lens = cu[1:] - cu[:-1]
    out["pos"][:n] = (torch.arange(n) - torch.repeat_interleave(cu[:-1], lens)).to(torch.int32)
    return out


class StaticBatch:
    """The device buffers of `pack`'s fields, allocated once: tokens, targets, weights, pos
    [budget] and cu [budget + 1] (a graph of s slots reads `cu_view(s)`)."""

    FIELDS = ("tokens", "targets", "weights", "pos")

    def __init__(self, budget: int, device):
        self.budget = budget
        self.tokens = torch.zeros(budget, dtype=torch.int64, device=device)
        self.targets = torch.zeros(budget, dtype=torch.int64, device=device)
        self.weights = torch.zeros(budget, dtype=torch.float32, device=device)
        self.pos = torch.zeros(budget, dtype=torch.int32, device=device)
        self.cu = torch.zeros(budget + 1, dtype=torch.int32, device=device)

    def cu_view(self, slots: int) -> torch.Tensor:
        return self.cu[: slots + 1]

    def load(self, packed: dict) -> None:
        """Copy a `pack` result in (cu into the first slots + 1 entries)."""
        for k in self.FIELDS:
            getattr(self, k).copy_(packed[k])
        self.cu[: packed["cu"].numel()].copy_(packed["cu"])
