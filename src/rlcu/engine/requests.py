"""A `generate` call's requests before and after the engine runs them: each prompt resolved to
its token ids or its problem, validation of the sampling parameters, the `Sequence`s submitted,
and the `RequestOutput`s assembled in prompt order (LLM._run calls these around the step loop,
engine/step_loop.py).

`resolved` is the list `LLM.generate` and `LLM.chat` build: one (prompt as given, token ids
or None, the problem or None) per request; `token_ids` is the check of a prompt's ids.
"""

from __future__ import annotations

import dataclasses
import numbers

import torch

from rlcu.engine.params import CompletionOutput, InvalidRequestError, RequestOutput, SamplingParams
from rlcu.engine.sequence import Sequence


def token_ids(ids) -> list[int] | None:
    """A list or tuple of integers (bools excluded) -> a new list of Python ints; else None. By
    the set of the elements' types, at C speed: the protocol's 146k prompt tokens, checked one
    at a time, took 195 ms of a generate call's host time (9 ms so)."""
    if not isinstance(ids, (list, tuple)):
        return None
    types = set(map(type, ids))
    if types <= {int}:
        return list(ids)
    if all(issubclass(t, numbers.Integral) and not issubclass(t, bool) for t in types):
        return [int(t) for t in ids]  # numpy ints and the like
    return None


def as_list(prompts) -> list:
    """generate's prompts -> a list of prompts (one str, dict or list of token ids is one prompt)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    prompts = list(prompts)
    if prompts and token_ids(prompts) is not None:
        return [prompts]  # one prompt of token ids
    return prompts


def resolve_prompt(p, encode, vocab_size: int, max_model_len: int) -> tuple[list[int] | None, str | None]:
    """A prompt -> (token ids, None) or (None, the problem). encode(text): the tokenizer's ids of
    a text prompt, called only for one (token-id prompts need no tokenizer)."""
    # a text prompt is encoded as vLLM encodes it: with the tokenizer's special tokens (the BOS
    # of Llama's and Mistral's post-processors; Qwen's adds none); chat() renders the template,
    # which writes its own BOS, and adds none
    if isinstance(p, str):
        ids = encode(p)
    elif isinstance(p, dict):
        if "prompt_token_ids" in p:
            ids = p["prompt_token_ids"]
        elif isinstance(p.get("prompt"), str):
            ids = encode(p["prompt"])
        else:
            return None, "a dict prompt needs 'prompt_token_ids' (a list of ints) or 'prompt' (a str)"
    elif isinstance(p, (list, tuple)):
        ids = p
    else:
        return None, (f"a prompt is a str, {{'prompt_token_ids': [...]}} or a list of token ids, "
                      f"got {type(p).__name__}")
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    ids = token_ids(ids)
    if ids is None:
        return None, "prompt_token_ids must be a list of integers"
    V = vocab_size
    if not ids:
        return None, "empty prompt (it has no tokens)"
    if min(ids) < 0 or max(ids) >= V:
        bad = next(t for t in ids if not 0 <= t < V)
        return None, f"token id {bad} is outside the vocabulary [0, {V})"
    if len(ids) >= max_model_len:
        return None, (f"the prompt has {len(ids)} tokens but the context holds {max_model_len} "
                      f"(max_model_len), with room for at least one new token")
    return ids, None


def check_on_error(on_error: str) -> None:
    if on_error not in ("raise", "return"):
        raise ValueError(f"generate(on_error=...) must be 'raise' or 'return', got {on_error!r}")


def validate(resolved: list[tuple], sampling_params, on_error: str) -> tuple[dict[int, SamplingParams], dict[int, str]]:
    """-> (checked: request index -> its SamplingParams, re-validated; errors: request index ->
    its problem). sampling_params: None (the defaults), one for all, or one per request.
    Raises InvalidRequestError when a request is bad and on_error is "raise"; ValueError for a
    bad on_error or a per-request list of the wrong length."""
    check_on_error(on_error)
    R = len(resolved)
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        plist = [sampling_params] * R
    else:
        plist = list(sampling_params)
        if len(plist) != R:
            raise ValueError(f"got {len(plist)} SamplingParams for {R} prompts: pass one, or one per prompt")
    errors = {i: err for i, (_, _, err) in enumerate(resolved) if err is not None}
    checked = {}
    for i, sp in enumerate(plist):
        if i in errors:
            continue
        if not isinstance(sp, SamplingParams):
            errors[i] = f"sampling parameters must be a SamplingParams, got {type(sp).__name__}"
            continue
        try:  # re-validate: fields may have been changed after construction
            checked[i] = dataclasses.replace(sp)
        except ValueError as e:
            errors[i] = str(e)
    if errors and on_error == "raise":
        raise InvalidRequestError(errors, R)
    return checked, errors


def make_sequences(resolved: list[tuple], checked: dict[int, SamplingParams], eos: frozenset) -> list[Sequence]:
    """One leader Sequence per valid request, in request order (a request without a seed draws
    one from torch's generator, in that order)."""
    seqs = []
    for i, (_, ids, _) in enumerate(resolved):
        if i not in checked:
            continue
        sp = checked[i]
        seed = sp.seed if sp.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        stop = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else eos)
        seqs.append(Sequence(i, ids, sp, seed, num_samples=sp.n, stop_ids=stop))
    return seqs


def assemble(resolved: list[tuple], errors: dict[int, str], done: dict[int, list[Sequence]],
             decode=None) -> list[RequestOutput]:
    """One RequestOutput per request, in request order: a bad request's carries its error; a
    good one's its samples in sample order. decode: the tokenizer's decode, or None (no text)."""
    outs = []
    for i, (p, ids, _) in enumerate(resolved):
        if i in errors:
            outs.append(RequestOutput(i, p, ids or [], [], True, errors[i]))
            continue
        comps = []
        for s in sorted(done[i], key=lambda s: s.sample_index):
            tids = s.completion_ids
            text = decode(tids, skip_special_tokens=True) if decode else ""
            comps.append(CompletionOutput(s.sample_index, tids, text, s.finish_reason,
                                          list(s.logprobs) if s.params.logprobs else None, s.routes))
        outs.append(RequestOutput(i, p, ids, comps))
    return outs
