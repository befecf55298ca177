"""Rollouts: prompts to token ids, G samples per prompt from the engine (which reads the
policy's own weight buffer), and the packed rollout batch the trainers step on.

A `RolloutBatch` holds S = prompts x G sequences as one packed token stream, prompt then
completion, with `cu_seqlens`; every per-token array is aligned with the tokens the way
`Qwen3.forward` aligns its logprobs (entry i belongs to token i; the first token of each
sequence has none). `mask` is 1 on the completion tokens of kept samples. Micro-batches
are runs of whole sequences, so their per-token arrays are plain slices.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from rlcu.engine import SamplingParams
from rlcu.parallel.batch import rank_seq_range
from rlcu.parallel.comm import world
from rlcu.train import moe_routes


@dataclasses.dataclass
class Sample:
    group: int  # index of its prompt in the step's batch
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # sampling logprob of each completion token
    finish_reason: str | None
    row: dict
    prompt_text: str = ""
    completion_text: str = ""
    reward: float = math.nan  # nan: masked (reward None or failed)
    # an episode (rlcu.train.episodes): completion_ids are its model and environment tokens
    model_mask: list[int] | None = None  # 1 on the model's tokens; None: all of them
    messages: list[dict] | None = None  # the conversation after the prompt (TRL's completion messages)
    prompt_messages: list[dict] | None = None  # its start (the prompt, or the environment's reset)
    episode: dict | None = None  # turns, tool calls and errors, truncation, env reward (episodes.py)
    routes: Any = None  # a MoE engine's experts of its rows ([P + C - 1, Ls, k], train/moe_routes.py)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


def prompt_text_of(row: dict, field: str) -> str | list:
    if field not in row:
        raise KeyError(f"prompt row has no field {field!r} (fields: {', '.join(map(str, row))}); "
                       f"set data.prompt_field")
    return row[field]


def encode_prompt(tokenizer, prompt, chat_template: bool = True, template_kwargs: dict | None = None
                  ) -> tuple[list[int], str]:
    """A string prompt is encoded as it is; chat messages go through the chat template with
    the generation prompt and `template_kwargs` (data.chat_template_kwargs, e.g.
    enable_thinking=False). Returns (ids, the text the model sees)."""
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, (list, tuple)):
        if not chat_template:
            raise ValueError("a chat-message prompt needs chat_template: true")
        text = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, **(template_kwargs or {}))
    else:
        raise TypeError(f"a prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
    ids = tokenizer.encode(text)
    if not ids:
        raise ValueError(f"prompt {text!r} encodes to no tokens; a prompt needs at least one")
    return ids, text


def stop_ids(tokenizer, model) -> list[int]:
    ids = set(model.cfg.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(i for i in ids if i is not None and i < model.cfg.vocab_size)


def sample(llm, prompts: list[list[int]], rows: list[dict], *, n: int, temperature: float, top_p: float = 1.0,
           top_k: int = -1, max_tokens: int, seed: int, stop_token_ids=(), ignore_eos: bool = False, tokenizer=None,
           prompt_texts: list[str] | None = None, group_offset: int = 0, seed_offset: int = 0,
           generate_kw: dict | None = None) -> list[Sample]:
    """n samples for each prompt (consecutive, grouped), with sampling logprobs. Prompt g draws
    from seed index seed_offset + g (a rank's block of a step's prompts draws what one process
    would). generate_kw: more arguments of llm.generate (the scheduler's yield_check / on_yield)."""
    # one seed per prompt: the sampling noise of prompt i's samples is independent of prompt j's
    sps = [SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                          seed=(seed * 1_000_003 + seed_offset + g) % (1 << 62), logprobs=temperature > 0,
                          stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)
           for g in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False, **(generate_kw or {}))
    samples = []
    for g, (ids, row, out) in enumerate(zip(prompts, rows, outs)):
        if len(out.outputs) != n:
            raise RuntimeError(f"the engine returned {len(out.outputs)} samples for a prompt, expected {n}"
                               + (f": {out.error}" if getattr(out, "error", None) else ""))
        for c in sorted(out.outputs, key=lambda c: c.index):
            toks = list(c.token_ids)
            lps = list(c.logprobs) if c.logprobs is not None else [0.0] * len(toks)
            text = tokenizer.decode(toks, skip_special_tokens=True) if tokenizer is not None else c.text
            samples.append(Sample(group_offset + g, list(ids), toks, lps, c.finish_reason, row,
                                  prompt_texts[g] if prompt_texts else "", text, routes=c.routes))
    return samples


@dataclasses.dataclass
class RolloutBatch:
    tokens: torch.Tensor  # [N] int64
    cu_seqlens: torch.Tensor  # [S+1] int32
    mask: torch.Tensor  # [N] fp32: 1 on completion tokens of kept samples
    old_lp: torch.Tensor  # [N] fp32: sampling logprobs on completion tokens, 0 elsewhere
    prompt_lens: list[int]
    completion_lens: list[int]
    fields: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # more [N] arrays: adv, ref_lp, ...

    @property
    def num_seqs(self) -> int:
        return len(self.prompt_lens)

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    def num_masked_in_seqs(self) -> int:
        """Sequences with at least one token of mask 1."""
        lens = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        seq = torch.repeat_interleave(torch.arange(self.num_seqs, device=lens.device), lens)
        per = torch.zeros(self.num_seqs, device=lens.device).index_add_(0, seq, self.mask)
        return int((per > 0).sum())

    def per_token(self, values_per_seq: torch.Tensor) -> torch.Tensor:
        """[S] -> [N]: each sequence's value on its tokens."""
        lens = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        return torch.repeat_interleave(values_per_seq.to(self.tokens.device).float(), lens)

    def completion_slice(self, s: int) -> slice:
        """Token positions of sequence s's completion."""
        end = int(self.cu_seqlens[s + 1])
        return slice(end - self.completion_lens[s], end)

    def completion_index(self) -> torch.Tensor:
        """[sum(completion_lens)] positions of all completion tokens, sequence after sequence."""
        ends = self.cu_seqlens[1:].long()
        cl = torch.tensor(self.completion_lens, device=ends.device)
        starts = ends - cl
        first = torch.repeat_interleave(starts, cl)
        offs = torch.arange(int(cl.sum()), device=ends.device) - torch.repeat_interleave(cl.cumsum(0) - cl, cl)
        return first + offs

    def micro_batches(self, max_tokens: int) -> list[tuple[int, int]]:
        """Consecutive sequence ranges [a, b) of at most max_tokens tokens (a longer sequence
        alone)."""
        cu = self.cu_seqlens.tolist()
        out, a = [], 0
        for b in range(1, self.num_seqs + 1):
            if cu[b] - cu[a] > max_tokens and b - 1 > a:
                out.append((a, b - 1))
                a = b - 1
        if a < self.num_seqs:
            out.append((a, self.num_seqs))
        return out

    def view(self, a: int, b: int) -> RolloutBatch:
        """Sequences [a, b) as a batch of their own (slices, no copies)."""
        t0, t1 = int(self.cu_seqlens[a]), int(self.cu_seqlens[b])
        return RolloutBatch(self.tokens[t0:t1], (self.cu_seqlens[a : b + 1] - t0).to(torch.int32),
                            self.mask[t0:t1], self.old_lp[t0:t1], self.prompt_lens[a:b],
                            self.completion_lens[a:b], {k: v[t0:t1] for k, v in self.fields.items()})


def pack(samples: list[Sample], keep: torch.Tensor | None = None, device="cpu") -> RolloutBatch:
    """Pack samples (prompt + completion each) into one stream. keep: [S] bool, False masks a
    sample out of the loss (its tokens stay, with mask 0)."""
    toks, lps, msk, cu, pl, cl = [], [], [], [0], [], []
    for i, s in enumerate(samples):
        P, C = len(s.prompt_ids), len(s.completion_ids)
        k = 1.0 if keep is None or bool(keep[i]) else 0.0
        toks += s.prompt_ids + s.completion_ids
        lps += [0.0] * P + [float(x) for x in s.logprobs]
        msk += [0.0] * P + ([k] * C if s.model_mask is None else [k * float(m) for m in s.model_mask])
        cu.append(cu[-1] + P + C)
        pl.append(P)
        cl.append(C)
    return RolloutBatch(torch.tensor(toks, dtype=torch.long, device=device),
                        torch.tensor(cu, dtype=torch.int32, device=device),
                        torch.tensor(msk, dtype=torch.float32, device=device),
                        torch.tensor(lps, dtype=torch.float32, device=device), pl, cl)


def batch_logprobs(model, batch: RolloutBatch, temperature: float, max_tokens: int) -> torch.Tensor:
    """[N] logprobs of the batch's tokens under `model` (no gradient), micro-batch by micro-batch;
    a MoE model replays the batch's routes where it holds them (train/moe_routes.py)."""
    out = torch.zeros(batch.num_tokens, device=batch.tokens.device, dtype=torch.float32)
    for a, b in batch.micro_batches(max_tokens):
        mb = batch.view(a, b)
        t0 = int(batch.cu_seqlens[a])
        routes = moe_routes.routes_for(model, mb)
        kw = {} if routes is None else {"routes": routes}  # (a dense model's forward needs none)
        out[t0 : t0 + mb.num_tokens] = model.forward(mb.tokens, mb.cu_seqlens, temperature=temperature, grad=False,
                                                     **kw)
    return out


def local_logprobs(model, batch, temperature: float, max_tokens: int, group_size: int) -> torch.Tensor:
    """batch_logprobs on the sequences this rank trains on only (rlcu.parallel.batch.rank_seq_range;
    0 elsewhere): the reference model's logprobs, which only that rank needs. One process: all."""
    if not world().distributed:
        return batch_logprobs(model, batch, temperature, max_tokens)
    a, b = rank_seq_range(batch.num_seqs, group_size)
    out = torch.zeros(batch.num_tokens, device=batch.tokens.device, dtype=torch.float32)
    if b > a:
        t0, t1 = int(batch.cu_seqlens[a]), int(batch.cu_seqlens[b])
        out[t0:t1] = batch_logprobs(model, batch.view(a, b), temperature, max_tokens)
    return out
