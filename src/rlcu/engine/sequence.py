"""A sequence: one sample of one request, its tokens, how many of them have KV in the cache,
and its block table.

Every step treats prefill and decode alike: a running sequence has `num_computed_tokens`
tokens whose K/V are in the cache and computes the next chunk of the rest; when that leaves
nothing uncomputed, the logits of its last token give the next sampled token (decode is the
case of a one-token chunk). A request with n samples enters as one *leader* with
`num_samples = n`; when its prompt is computed it samples n tokens from the same logits and
forks into n sequences that share its blocks (see BlockManager.fork).

With one-step lookahead (see Scheduler) a sampled token enters `token_ids` as a placeholder
(-1) when its step is launched, and gets its value when the step's results are read back.

An episode's sequence (`parks`, engine/episodes.py) lives through several turns: when a turn
ends it is PARKED with its blocks kept, and it resumes with the environment's tokens
appended (`Scheduler.resume`). `max_len` is the length at which the current turn ends with
"length" (a plain sequence's prompt plus max_tokens). Its sample offset keeps counting every
token after the prompt, the environment's included, so no two turns redraw the same numbers.
"""

from __future__ import annotations

import enum
import itertools

from rlcu.engine.params import SamplingParams, sample_seed


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    PARKED = 3  # an episode's turn ended: blocks kept while its environment answers


_ids = itertools.count()


class Sequence:
    def __init__(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams, seed: int,
                 sample_index: int = 0, num_samples: int = 1, stop_ids: frozenset[int] = frozenset()):
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.sample_index = sample_index  # j: which sample of the request this is
        self.num_samples = num_samples  # n for a leader not yet forked, else 1
        self.params = params
        self.seed = seed  # the request's seed; sample j draws from sample_seed(seed, j)
        self.stop_ids = stop_ids  # tokens that finish it: stop_token_ids, plus EOS unless ignore_eos
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache at admission
        self.num_hashed_blocks = 0  # leading full blocks registered in the prefix cache
        self.block_hashes: list[bytes] = []  # prefix keys of its full blocks of tokens (lazy)
        self.block_table: list[int] = []
        self.logprobs: list[float] = []
        self.routes = None  # a MoE engine's experts of its rows, [n, Ls, k] on the device, set as it retires
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        # one-step lookahead: the last num_pending tokens were sampled but their values are
        # still on the device (placeholders -1); the newest is row pending_row of the last step
        self.num_pending = 0
        self.pending_row = -1
        self.num_stale = 0  # rows of steps launched before its stop token was read back, to drop
        self.own_seed = sample_seed(seed, sample_index)
        self.lora = -1  # the engine's adapter slot (engine/lora.py), -1: the base alone; forks inherit it
        self.max_len = self.num_prompt_tokens + params.max_tokens  # the length that ends this turn
        self.parks = False  # an episode's: park at the end of a turn instead of freeing the blocks

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id}.{self.sample_index}, len={len(self)}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table}, {self.status.name})")

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def sample_seeds(self) -> list[int]:
        """Seeds of the tokens this sequence samples when its chunk completes: n of them for
        an unforked leader (samples 0..n-1), else its own."""
        if self.num_samples > 1:
            return [sample_seed(self.seed, j) for j in range(self.num_samples)]
        return [self.own_seed]

    def fork(self, sample_index: int) -> Sequence:
        """A copy that is sample `sample_index`; the caller shares the blocks (BlockManager.fork)."""
        child = Sequence.__new__(Sequence)
        child.__dict__.update(self.__dict__)
        child.seq_id = next(_ids)
        child.sample_index = sample_index
        child.own_seed = sample_seed(self.seed, sample_index)
        child.num_samples = 1
        child.token_ids = list(self.token_ids)
        child.block_table = []
        child.logprobs = list(self.logprobs)
        child.block_hashes = list(self.block_hashes)
        return child

