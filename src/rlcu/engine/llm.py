"""`LLM`: the engine's public face, shaped like vLLM's offline API.

    llm = LLM(model_or_path, device="cuda")
    outs = llm.generate(prompts, SamplingParams(n=8, temperature=1.0, max_tokens=256, logprobs=True))
    outs[i].outputs[j].token_ids / .text / .finish_reason / .logprobs

Given a `Qwen3`, the engine runs on its weight tensors (no copy): after an optimizer step
updates the model in place, the next `generate` uses the new weights. For the same reason
the prefix cache lives for one `generate` call (shared prefixes across its requests, and
recomputation after preemption), never across calls. `sleep()` gives the KV
pool (and CUDA graphs) back so that training can use the memory; `wake()` takes them back.

Bad requests (an empty prompt, a prompt that leaves no room in the context, a token id
outside the vocabulary, invalid sampling parameters such as n < 1 or a negative
temperature) are found at submission, before anything runs. By default (`on_error="raise"`,
as vLLM does) `generate` raises one `InvalidRequestError`, a ValueError naming every bad
request's index and problem, and runs nothing, so the engine is untouched; with
`on_error="return"` the bad requests come back with `.error` set and no outputs, and the
other requests are generated as if they had been submitted alone. Results are in the
order of the prompts.

Yielding the device mid-generate (the job scheduler's preemption): with
`generate(..., yield_check=f, on_yield=g)`, f() is asked between two engine steps (after a
yield, only once a new token was sampled, so that the recompute makes progress). When it is
true, the step in flight is finished, every live sequence is preempted for recompute as
memory pressure does it (its blocks freed, its tokens kept), the engine sleeps (the KV pool
is released), g(tokens_left) runs (an estimate of the tokens still to generate; it returns
when the caller may go on), the engine wakes and the sequences are recomputed from their
tokens. Sampling is counter-based per (seed, sample, tokens generated so far), so the
outputs are those of an uninterrupted call (logprobs up to the rounding of recomputing K/V
in other chunks). If g raises, generate raises it with the engine left asleep. With
`on_done=h`, h() runs once the call's steps are done, before generate returns (not when it
raises): a caller whose yield checks pair with other engines' (one per rank of a job) keeps
answering them there until every engine is done, with this one idle.

LoRA adapters, unmerged (engine/lora.py): `LLM(base, lora=PATH | LoraAdapters | {name: either})`
serves them beside the model's own attached adapter (`model.lora`, named "model": the trainer's,
read in place, so an RL job's rollouts are always its current policy). A request picks one with
`generate(..., lora=name)` (one for all, or one per prompt; "base": none); by default the model's
attached adapter, else the one unnamed adapter given, else the base. One step carries sequences
of any adapters (the grouped kernels); the prefix cache shares blocks only within one adapter.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlcu.engine import episodes, requests
from rlcu.engine import lora as engine_lora
from rlcu.engine.block_manager import BlockManager
from rlcu.engine.episodes import Episode
from rlcu.engine.model_runner import ModelRunner
from rlcu.engine.params import RequestOutput, SamplingParams
from rlcu.engine.progress import Progress
from rlcu.engine.scheduler import Scheduler
from rlcu.engine.step_loop import StepLoop
from rlcu.model.causal_lm import Qwen3

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


def _dtype(x) -> torch.dtype | None:
    if x is None or x == "auto":
        return None
    if isinstance(x, torch.dtype):
        return x
    if isinstance(x, str) and x.lower() in _DTYPES:
        return _DTYPES[x.lower()]
    raise ValueError(f"LLM.dtype must be one of {', '.join(_DTYPES)}, 'auto' or a torch.dtype, got {x!r}")


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _check_int(name: str, v, lo: int, allow_none: bool = False):
    if v is None and allow_none:
        return
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"LLM.{name} must be an integer >= {lo}{' or None' if allow_none else ''}, got {v!r}")


class LLM:
    """model: a `Qwen3` (shared, not copied; device and dtype are the model's), a folder
    with config.json and safetensors, or a Hugging Face Hub id ("Qwen/Qwen3-0.6B", fetched into
    the Hub's cache; at `revision`, or "ID@revision"). device: default the model's, else "cuda" when there is
    one. dtype: default bfloat16 on CUDA, float32 on the CPU. max_num_seqs: sequences in one
    step (also the largest CUDA-graph batch). max_num_batched_tokens: tokens per step (the
    chunked-prefill budget). gpu_memory_utilization: the fraction of the device's total memory
    that this process may use once the KV pool is allocated (weights, trainer state,
    activations and the pool together, as in vLLM); None: rlcu.config.GPU_MEMORY_UTILIZATION,
    the default engine.gpu_memory_utilization shares. block_size: tokens per KV
    block. num_kv_blocks: the pool's size, overriding gpu_memory_utilization (the CPU default
    holds 4 sequences of max_model_len, at most 1 GiB). max_model_len: the longest sequence (default: the model's
    max_position_embeddings, lowered to what the pool holds). enforce_eager: no CUDA graphs.
    async_scheduling: launch step t+1 before reading back step t's tokens, so that the host's
    scheduling overlaps the device's work (outputs are identical; a sequence that samples a
    stop token costs one wasted row in the next step).
    tokenizer: an object with encode(text, add_special_tokens=)/decode/apply_chat_template/
    eos_token_id (rlcu's Tokenizer, or transformers'); default: loaded from the model's folder
    the first time a prompt is text (or a chat). warmup: at construction, compile the kernels
    of every step kind and capture every decode graph the engine can replay (engine/warmup.py),
    so that the first generate does neither; None (the
    default): on CUDA only. `startup` reports the construction's seconds and the warm-up's.
    prefill_graphs: run prefill and mixed steps by CUDA graphs too (engine/prefill_graphs.py;
    with graphs on): their host launch is ~20 ms a step, longer than a 0.6B step's kernels;
    the graphs' pool holds about one full-budget step's activations while the engine is awake.
    exact: exact on-policy mode (ops/exact.py), which is the model's (`Qwen3.exact`, read at
    every step): None (the default) keeps a given model's own mode, and off for a model loaded
    here; True or False sets it on the model, which a trainer sharing it then computes in too.
    lora: LoRA adapters to serve (a PEFT folder or a LoraAdapters, or a dict of names to those;
    engine/lora.py `resolve`), an adapter that does not fit the base refused by name; see the
    module docstring."""

    def __init__(self, model: Qwen3 | str | Path, *, device: str | torch.device | None = None, dtype=None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 gpu_memory_utilization: float | None = None, block_size: int | None = None,
                 num_kv_blocks: int | None = None, max_model_len: int | None = None,
                 enforce_eager: bool = False, enable_prefix_caching: bool = True, async_scheduling: bool = True,
                 tokenizer: Any = None, warmup: bool | None = None, prefill_graphs: bool = True,
                 revision: str | None = None, exact: bool | None = None, lora=None):
        from rlcu.config import GPU_MEMORY_UTILIZATION
        from rlcu.ops.paged_attention import DEFAULT_BLOCK_SIZE

        t_start = time.perf_counter()
        if warmup is not None and not isinstance(warmup, bool):
            raise ValueError(f"LLM.warmup must be True, False or None, got {warmup!r}")
        if exact is not None and not isinstance(exact, bool):
            raise ValueError(f"LLM.exact must be True, False or None, got {exact!r}")

        if gpu_memory_utilization is None:
            gpu_memory_utilization = GPU_MEMORY_UTILIZATION
        block_size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
        _check_int("max_num_seqs", max_num_seqs, 1)
        _check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        _check_int("block_size", block_size, 1)
        if block_size & (block_size - 1):
            raise ValueError(f"LLM.block_size must be a power of two, got {block_size}")
        _check_int("num_kv_blocks", num_kv_blocks, 1, allow_none=True)
        _check_int("max_model_len", max_model_len, 2, allow_none=True)
        if not isinstance(gpu_memory_utilization, (int, float)) or not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"LLM.gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        want_dtype = _dtype(dtype)
        if isinstance(model, Qwen3):
            if device is not None and not _same_device(torch.device(device), model.device):
                raise ValueError(f"LLM.device={device!r} differs from the model's device {model.device}: the engine "
                                 "shares the model's tensors and never copies them; move the model instead")
            if want_dtype is not None and want_dtype != model.dtype:
                raise ValueError(f"LLM.dtype={dtype!r} differs from the model's dtype {model.dtype}: the engine "
                                 "shares the model's tensors and never copies them")
            self.model = model
        elif isinstance(model, (str, Path)):
            dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
            if want_dtype is None:
                want_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
            self.model = Qwen3.from_pretrained(model, device=dev, dtype=want_dtype, revision=revision)
        else:
            raise TypeError(f"LLM(model) takes an rlcu.Qwen3, a model folder or a Hub id, got {type(model).__name__}")
        if exact is not None:
            self.model.exact = exact  # before the runner: its graphs are captured in the model's mode
        cfg = self.model.cfg
        self.source: Path | None = Path(self.model.source) if self.model.source is not None else None
        self._tokenizer = tokenizer
        self.runner = ModelRunner(
            self.model, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings),
            num_kv_blocks=num_kv_blocks, gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
            prefill_graphs=prefill_graphs)
        self.max_model_len = self.runner.max_model_len
        self.adapters, self._lora_default, self._lora_live = engine_lora.resolve(lora, self.model)
        self._lora_model = None  # the model's attached adapter the slots were built with
        self._sync_lora()
        self.block_manager = BlockManager(self.runner.num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens, self.max_model_len)
        if cfg.fam.moe:
            self.scheduler.on_retire = self.runner.keep_routes  # the completions' routes (engine/routes.py)
        self.async_scheduling = async_scheduling
        self.asleep = False
        self.stats: dict = {}
        if warmup is None:
            warmup = self.runner.device.type == "cuda"
        t_warm = time.perf_counter()
        self.startup: dict = {"warmup": self.runner.warm_up() if warmup else None}
        self.startup.update(seconds=time.perf_counter() - t_start, before_warmup_s=t_warm - t_start)

    # ------------------------------------------------------------------ tokenizer
    @property
    def tokenizer(self):
        """The tokenizer (loaded from the model's folder on first use)."""
        if self._tokenizer is None:
            if self.source is None or not (self.source / "tokenizer.json").exists():
                raise ValueError("text prompts and chat need a tokenizer: pass LLM(..., tokenizer=...) or load the "
                                 "model from a folder that has tokenizer.json (token-id prompts need none)")
            from rlcu.data.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_pretrained(self.source)
        return self._tokenizer

    def get_tokenizer(self):
        return self.tokenizer

    # ------------------------------------------------------------------ adapters
    def _sync_lora(self) -> None:
        """The runner's adapter slots: the model's attached adapter (if any) and the engine's
        own (one given that is the attached one is not served twice: its name means the model's
        slot), built again when the attached one changed or a buffer moved, else the live ones
        copied in again where the slots hold copies (engine/lora.py)."""
        live, slots = self.model.lora, self.runner.lora
        if slots is not None and live is self._lora_model and not slots.moved():
            slots.refresh()
            return
        named = [(engine_lora.MODEL, live)] if live is not None else []
        named += [(n, ad) for n, ad in self.adapters.items() if ad is not live]
        self._lora_model = live
        self.runner.set_lora(engine_lora.LoraSlots(self.model, named, self._lora_live | {engine_lora.MODEL})
                             if named else None)

    def add_lora(self, name: str, adapter) -> None:
        """Serve one more named adapter (a PEFT folder or a live LoraAdapters, as LLM(lora=...)
        takes them) from the next call on: the slots are built again (and the graphs with them).
        A LoRA host's job that joins a running host (train/lora_host.py) is added so."""
        if name in self.adapters:
            raise ValueError(f"LLM.add_lora: this engine already serves an adapter named {name!r}")
        added, _, live = engine_lora.resolve({name: adapter}, self.model)
        self.adapters.update(added)
        self._lora_live |= live
        self.runner.set_lora(None)
        self._lora_model = None
        self._sync_lora()

    def lora_names(self) -> list[str]:
        """The adapters a request may name ("base": none)."""
        return [engine_lora.BASE] + (self.runner.lora.names if self.runner.lora is not None else [])

    def _lora_slots(self, lora, n: int) -> list[int | str]:
        """generate(lora=...) -> each request's adapter slot (-1: the base), or its problem (a str)."""
        names = list(lora) if isinstance(lora, (list, tuple)) else [lora] * n
        if len(names) != n:
            raise ValueError(f"generate(lora=...) got {len(names)} adapter names for {n} prompts: pass one, "
                             f"or one per prompt")
        slots, live = self.runner.lora, self.model.lora
        default = (engine_lora.MODEL if self.model.lora is not None else self._lora_default) or engine_lora.BASE
        out = []
        for name in names:
            name = default if name is None else name
            if name == engine_lora.BASE:
                out.append(-1)
            elif slots is not None and isinstance(name, str) and name in slots.names:
                out.append(slots.index(name))
            elif live is not None and isinstance(name, str) and self.adapters.get(name) is live:
                # the attached adapter given by name too: served as the model's
                out.append(slots.index(engine_lora.MODEL))
            else:
                out.append(f"unknown LoRA adapter {name!r}; this engine serves {', '.join(self.lora_names())}")
        return out

    @property
    def eos_token_ids(self) -> set[int]:
        ids = set(self.model.cfg.eos_token_ids)
        if self.source is not None and (self.source / "generation_config.json").exists():
            try:
                e = json.loads((self.source / "generation_config.json").read_text()).get("eos_token_id")
                ids |= set([e] if isinstance(e, int) else (e or []))
            except (json.JSONDecodeError, AttributeError):
                pass
        if self._tokenizer is not None and getattr(self._tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self._tokenizer.eos_token_id))
        return ids

    # ------------------------------------------------------------------ sleep / wake
    def sleep(self, keep_graphs: bool = False) -> None:
        """Free the KV pool and the CUDA graphs (the prefix cache is forgotten). keep_graphs:
        keep the graphs (and their small memory pool) for the next wake, which keeps them if
        the pool comes back at the same address, else captures them again (RL trainers,
        which sleep every step, use this: a capture costs tens of ms a graph)."""
        if not self.asleep:
            self.runner.release(keep_graphs)
            self.block_manager.reset()
            self.asleep = True

    def wake(self) -> None:
        """Take the KV pool (same size) and the graphs back."""
        if self.asleep:
            self.runner.allocate()
            self.asleep = False

    def capture_graphs(self, max_context: int = 4096) -> int:
        """Capture the decode CUDA graphs for contexts up to `max_context` now rather than on
        first use (the warm-up at construction captures them all; this serves an engine built
        with warmup=False, or woken with its graphs dropped). Returns the number of graphs."""
        if self.asleep:
            raise RuntimeError("the engine is asleep: call llm.wake() first")
        return self.runner.capture_graphs(max_context)

    # ------------------------------------------------------------------ submission
    def _resolve(self, i: int, p) -> tuple[list[int] | None, str | None]:
        """A prompt -> (token ids, None) or (None, the problem) (engine/requests.py `resolve_prompt`)."""
        return requests.resolve_prompt(p, lambda text: self.tokenizer.encode(text, add_special_tokens=True),
                                       self.model.cfg.vocab_size, self.max_model_len)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, progress: bool | None = None, on_error: str = "raise",
                 yield_check: Callable[[], bool] | None = None, on_yield: Callable[[int], None] | None = None,
                 on_done: Callable[[], None] | None = None, lora=None) -> list[RequestOutput]:
        """prompts: a str, a {"prompt_token_ids": [...]} (or {"prompt": str}) dict, a list of token
        ids, or a list of those. sampling_params: one for all, or one per prompt. Returns one
        RequestOutput per prompt, in order. on_error: "raise" | "return" (see the module docstring).
        yield_check, on_yield, on_done: preemption between engine steps (see the module docstring).
        lora: the adapter's name, one for all or one per prompt (None: the default; "base": none)."""
        items = requests.as_list(prompts)
        if any(isinstance(p, str) or (isinstance(p, dict) and "prompt_token_ids" not in p) for p in items):
            self.tokenizer  # noqa: B018  (text needs a tokenizer: fail now, for all requests, if there is none)
        resolved = []
        for i, p in enumerate(items):
            try:
                resolved.append((p, *self._resolve(i, p)))
            except (ValueError, TypeError) as e:
                resolved.append((p, None, f"{type(e).__name__}: {e}"))
        return self._run(resolved, sampling_params, use_tqdm if progress is None else progress, on_error,
                         yield_check, on_yield, on_done, lora)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             use_tqdm: bool = True, progress: bool | None = None, on_error: str = "raise",
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
             yield_check: Callable[[], bool] | None = None, on_yield: Callable[[int], None] | None = None,
             on_done: Callable[[], None] | None = None, lora=None) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"} dicts) or a list of them.
        The chat template is applied with add_generation_prompt; chat_template_kwargs are
        template variables (e.g. enable_thinking=False). The rest is as in `generate`."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.tokenizer
        resolved = []
        for i, conv in enumerate(convs):
            try:
                ids = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=True,
                                              **(chat_template_kwargs or {}))
                resolved.append((conv, *self._resolve(i, list(ids))))
            except (ValueError, TypeError, KeyError) as e:
                resolved.append((conv, None, f"chat template failed: {e}"))
        return self._run(resolved, sampling_params, use_tqdm if progress is None else progress, on_error,
                         yield_check, on_yield, on_done, lora)

    def run_episodes(self, starts, sampling_params: SamplingParams | list[SamplingParams], on_turn, *,
                     max_workers: int = 32, use_tqdm: bool = False, max_turns: int | None = None,
                     max_episode_tokens: int | None = None, lora=None, yield_check=None, on_yield=None,
                     on_done=None) -> list[Episode]:
        """Multi-turn generation, token in and token out (engine/episodes.py says it all): each
        start's sequence generates a turn, on_turn(i, turn_ids, finish_reason) runs in a pool of
        max_workers threads while the others keep decoding, and returns the environment's
        tokens to append (the sequence resumes with its KV kept) or None (the episode ends).
        Returns one Episode per start and sample (n per start), in order. lora, yield_check,
        on_yield, on_done: as generate's."""
        return episodes.run_episodes(self, starts, sampling_params, on_turn, max_workers=max_workers,
                                     use_tqdm=use_tqdm, max_turns=max_turns, max_episode_tokens=max_episode_tokens,
                                     lora=lora, yield_check=yield_check, on_yield=on_yield, on_done=on_done)

    # ------------------------------------------------------------------ the loop
    def _yield(self, on_yield, left_of: Callable | None = None) -> None:
        """Give the device back between two steps (no step in flight): preempt every live
        sequence for recompute, sleep, on_yield(tokens left), wake. left_of(seq): a sequence's
        tokens left (run_episodes': its episode's turns left, parked episodes' too); by default
        its completion's rest."""
        live = self.scheduler.preempt_all() + list(self.scheduler.parked.values())
        left_of = left_of or (lambda s: s.num_samples * max(min(s.max_len, self.max_model_len) - len(s), 0))
        left = sum(left_of(s) for s in live)
        self.sleep(keep_graphs=True)  # a pool that comes back at its address keeps them (see sleep)
        if on_yield is not None:
            on_yield(left)  # an exception leaves the engine asleep: the pool may no longer be ours
        self.wake()

    def _run(self, resolved, sampling_params, show: bool, on_error: str, yield_check=None,
             on_yield=None, on_done=None, lora=None) -> list[RequestOutput]:
        """Validate the requests, run the step loop over the good ones, assemble the outputs."""
        requests.check_on_error(on_error)
        for name, fn in (("yield_check", yield_check), ("on_yield", on_yield), ("on_done", on_done)):
            if fn is not None and not callable(fn):
                raise TypeError(f"generate({name}=...) must be a callable or None, got {type(fn).__name__}")
        if self.asleep:
            raise RuntimeError("the engine is asleep (its KV pool is released): call llm.wake() first")
        self._sync_lora()
        slot = self._lora_slots(lora, len(resolved))
        resolved = [(p, None, f"ValueError: {s}") if isinstance(s, str) and err is None else (p, ids, err)
                    for (p, ids, err), s in zip(resolved, slot)]
        checked, errors = requests.validate(resolved, sampling_params, on_error)
        self.block_manager.drop_cache()  # the weights may have changed since the last call
        seqs = requests.make_sequences(resolved, checked, frozenset(self.eos_token_ids))
        for s in seqs:
            s.lora = slot[s.request_id]
            self.scheduler.add(s)
        loop = StepLoop(self.scheduler, self.runner, {i: sp.n for i, sp in checked.items()},
                        lookahead=self.async_scheduling, yield_check=yield_check,
                        do_yield=lambda: self._yield(on_yield))
        with Progress(len(seqs), show) as bar:
            done = loop.run(bar.update)
        self.stats = loop.stats.as_dict()
        decode = self._tokenizer.decode if self._tokenizer is not None else None
        outs = requests.assemble(resolved, errors, done, decode)
        if on_done is not None:
            on_done()
        return outs
