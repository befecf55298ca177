"""What a caller asks of the engine and what it gets back, shaped like vLLM's offline API.

`SamplingParams` is validated when it is made, and every error names the field. Sampling is
reproducible per sample: sample j of a request with seed s draws from the counter-based
stream `sample_seed(s, j) = (s * SEED_PRIME + j) mod 2^63` at offset = the number of tokens
that sample has generated so far, so a sample's tokens do not depend on what else is in the
batch, on chunking, or on preemption (a recomputed sequence redraws the same numbers).
"""

from __future__ import annotations

import dataclasses
from typing import Any

SEED_PRIME = 1_000_003
_SEED_MOD = 1 << 63


def sample_seed(seed: int, j: int) -> int:
    """The seed of sample j of a request seeded with `seed`."""
    return (seed * SEED_PRIME + j) % _SEED_MOD


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclasses.dataclass
class SamplingParams:
    """n: samples per prompt (they share the prompt's KV cache). temperature: 0 is greedy.
    top_k: keep the k most likely tokens (<= 0: all). top_p: keep the smallest set whose
    probability reaches top_p. min_p: drop tokens below min_p * p_max. max_tokens: new tokens
    per sample. stop_token_ids: tokens that end a sample (kept in its token_ids, like EOS).
    ignore_eos: keep going past the model's EOS. seed: per-request seed (None: drawn from
    torch's global generator). logprobs: return the logprob of each sampled token under the
    temperature-scaled, unfiltered distribution (what a policy-gradient loss needs)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = False

    def __post_init__(self):
        def bad(field, value, allowed):
            raise ValueError(f"SamplingParams.{field} must be {allowed}, got {value!r}")

        if not _is_int(self.n) or self.n < 1:
            bad("n", self.n, "an integer >= 1")
        if not _is_num(self.temperature) or not self.temperature >= 0 or self.temperature == float("inf"):
            bad("temperature", self.temperature, "a finite number >= 0 (0 is greedy)")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "a number in (0, 1]")
        if not _is_int(self.top_k):
            bad("top_k", self.top_k, "an integer (<= 0 disables it)")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", self.min_p, "a number in [0, 1]")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", self.max_tokens, "an integer >= 1")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            ids = list(self.stop_token_ids)
            if not all(_is_int(t) and t >= 0 for t in ids):
                bad("stop_token_ids", self.stop_token_ids, "a list of non-negative token ids")
            self.stop_token_ids = ids
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", self.ignore_eos, "True or False")
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", self.seed, "an integer or None")
        if isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool) and self.logprobs in (0, 1):
            self.logprobs = bool(self.logprobs)  # vLLM's logprobs=1 means "the sampled token's"
        if not isinstance(self.logprobs, bool):
            bad("logprobs", self.logprobs, "True or False (the logprob of each sampled token)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass
class CompletionOutput:
    """One sample: `index` j of its request, the generated token ids (a stop token included),
    the decoded text ("" when no tokenizer is at hand), "stop" or "length", and the logprob
    of each token (None unless SamplingParams.logprobs). routes: a Qwen3-MoE engine's experts of
    the prompt's and completion's tokens but the last ([n, Ls, k] on the device: engine/routes.py),
    else None."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float] | None = None
    routes: Any = None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else float(sum(self.logprobs))


@dataclasses.dataclass
class RequestOutput:
    """The result of one prompt. `error` is set (and `outputs` empty) only for a request
    refused at submission under generate(..., on_error="return")."""

    request_id: int
    prompt: Any
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    error: str | None = None


class InvalidRequestError(ValueError):
    """Requests refused at submission; `errors` maps each bad request's index to its problem."""

    def __init__(self, errors: dict[int, str], total: int):
        self.errors = dict(errors)
        lines = [f"request {i}: {msg}" for i, msg in sorted(self.errors.items())]
        super().__init__(f"{len(self.errors)} of {total} request(s) refused, nothing was run:\n  "
                         + "\n  ".join(lines))
