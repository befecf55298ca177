"""The engine a LoRA host's jobs share (train/lora_host.py): one rlcu.LLM over the one base,
serving every job's live adapter as a slot, and each job's face of it.

`HostEngine` holds the slab of the jobs' adapters and the engine. When every job's adapter has
one layout (rank and target modules) the adapters are made as the rows of one [n, numel] slab
(`adopt` moves each job's freshly made adapter there before its optimizer is made over it), which
the engine's slots read in place (engine/lora.py): no copy per generate. Jobs of different ranks
keep their own buffers and the slots copy them into a zero-padded slab at every generate call
(the adapters' bytes once a call: small beside one decode step's reads of the base).

`serve(requests)` runs the rollouts of every job waiting on the engine as ONE generate call:
each job's prompts tagged with its adapter's slot (`generate(lora=[name per prompt])`), so their
sequences decode in the same engine steps. Jobs with multi-turn episodes (a `multi_turn:`
section) are served likewise by ONE `run_episodes` call: every job's starts with its adapter's
slot and its own limits (max_turns, max_episode_tokens per start), each episode's turns handed to
its job's callback (its environment), so the jobs' episodes decode in the same steps too. When
both kinds wait, the completions' call runs, then the episodes' (each its own engine loop).
Each job keeps its own sampling parameters and seeds (the engine's sampling is counter-based per
(seed, sample, position), so a sequence's tokens do not depend on the batch it ran in; in exact
mode neither do its logprobs). A job's bad request fails that job only (the call runs with
on_error="return", the others' requests as if alone); a bad episode start fails the episodes'
call (run_episodes validates every start before it runs), and so every job in it.

`JobEngine` is what a job's trainer holds as its `llm`: generate and run_episodes hand their
requests to the host (train/lora_host.py parks the job until the host has served everyone's),
sleep and wake are the host's business (no-ops here), anything else is read from the shared
engine.
"""

from __future__ import annotations

import torch

from rlcu.engine import LLM
from rlcu.engine.params import InvalidRequestError, SamplingParams
from rlcu.model.lora import LoraAdapters, LoraConfig, LoraLayout


class HostEngine:
    """The shared engine of `names` (the jobs, in order) on `model` (the base, no adapter attached);
    `lora_cfgs`: each job's LoraConfig (None: not known ahead, e.g. a PEFT folder whose config is read
    later: its adapter keeps its own buffer)."""

    def __init__(self, model, names: list[str], lora_cfgs: list[LoraConfig | None]):
        self.model, self.names = model, list(names)
        self.adapters: dict[str, LoraAdapters] = {}
        self.llm: LLM | None = None
        self.engine_steps = 0  # over every generate call (the host's rollouts share them)
        self.generate_calls = 0
        one = {(c.r, c.target_modules) for c in lora_cfgs if c is not None}
        self.slab = None
        if len(one) == 1 and all(c is not None for c in lora_cfgs):
            layout = LoraLayout(model.cfg, lora_cfgs[0])
            self.slab = torch.zeros(len(names), layout.numel, device=model.device, dtype=model.dtype)

    def adopt(self, name: str, model) -> LoraAdapters:
        """Job `name`'s adapter (attached to its view of the base, `model`) moved into its row of
        the slab when there is one (the same values; re-attached), else kept; returns it."""
        ad = model.lora
        if ad is None:
            raise ValueError(f"job {name!r}: a LoRA host's job needs a lora: section (lora.r > 0 or lora.path)")
        j = self.names.index(name)
        if (self.slab is not None and j < self.slab.shape[0] and self.slab.shape[1] == ad.layout.numel
                and ad.flat.dtype == self.slab.dtype):
            row = self.slab[j]
            row.copy_(ad.flat)
            moved = LoraAdapters(ad.layout.model_cfg, ad.cfg, row)
            moved._forwards = ad._forwards
            model.lora = None
            ad = moved.attach(model)
        self.adapters[name] = ad
        return ad

    def start(self, engine_kw: dict) -> None:
        """The engine, once every job adopted its adapter (the slots are built over all of them)."""
        kw = dict(engine_kw, lora={n: self.adapters[n] for n in self.names if n in self.adapters})
        self.llm = LLM(self.model, **kw)
        self.llm.sleep(keep_graphs=True)  # its pool is taken back by the first rollout

    def add(self, name: str) -> None:
        """A job joining the running engine (LoraHost.join): its name, before its trainer is built
        (its adapter keeps its own buffer: the slab's rows are the first jobs'); `serve_added`
        then serves the adapter it adopted."""
        if name in self.names:
            raise ValueError(f"job {name!r} is already in this host")
        self.names.append(name)

    def serve_added(self, name: str) -> None:
        """The joined job's adopted adapter, served from the next call on (the slots rebuilt)."""
        self.llm.add_lora(name, self.adapters[name])

    @property
    def in_place(self) -> bool:
        """Whether the engine reads the jobs' adapters in place (no copy per generate)."""
        slots = self.llm.runner.lora if self.llm is not None else None
        return bool(slots is not None and slots.in_place)

    def serve(self, requests: list[tuple[str, str, tuple]], generate_kw: dict | None = None) -> list:
        """[(job, "generate" | "episodes", its arguments)] -> [outputs or an exception per job], with
        the engine awake: the completions in one generate call, the episodes in one run_episodes
        call (see the module docstring); generate_kw (the host's preemption callbacks) go to both,
        its on_done to the last."""
        got: list = [None] * len(requests)
        kinds = [[i for i, r in enumerate(requests) if r[1] == k] for k in ("generate", "episodes")]
        calls = [(k, idx) for k, idx in zip((self._generate, self._episodes), kinds) if idx]
        kw = dict(generate_kw or {})
        done = kw.pop("on_done", None)
        self.llm.wake()
        try:
            for c, (call, idx) in enumerate(calls):
                last = {"on_done": done} if done is not None and c == len(calls) - 1 else {}
                try:
                    outs = call([(requests[i][0], *requests[i][2]) for i in idx], {**kw, **last})
                except Exception as e:  # noqa: BLE001 (this call failed: every job in it gets the error)
                    outs = [e] * len(idx)
                self.engine_steps += int(self.llm.stats.get("steps", 0))
                self.generate_calls += 1
                for i, o in zip(idx, outs):
                    got[i] = o
        finally:
            self.llm.sleep(keep_graphs=True)
        return got

    def _generate(self, requests: list[tuple[str, list, list[SamplingParams], str]], kw: dict) -> list:
        """[(job, prompts, sampling params per prompt, on_error)]: one generate call; a job's bad
        requests fail that job only."""
        items, sps, tags, spans = [], [], [], []
        for name, prompts, params, _ in requests:
            spans.append((len(items), len(items) + len(prompts)))
            items += prompts
            sps += params
            tags += [name] * len(prompts)
        outs = self.llm.generate(items, sps, use_tqdm=False, on_error="return", lora=tags, **kw)
        got = []
        for (*_, on_error), (a, b) in zip(requests, spans):
            mine = outs[a:b]
            bad = {i: o.error for i, o in enumerate(mine) if getattr(o, "error", None)}
            got.append(InvalidRequestError(bad, len(mine)) if bad and on_error == "raise" else mine)
        return got

    def _episodes(self, requests: list[tuple], kw: dict) -> list:
        """[(job, starts, sampling params per start, on_turn, max_workers, max_turns,
        max_episode_tokens)]: one run_episodes call over every job's starts, each start with its
        job's adapter and limits, each episode's turns going to its job's on_turn under the job's
        own numbering; returns each job's episodes, numbered as if it ran alone. A bad start
        fails the call (run_episodes validates them all before anything runs)."""
        starts, sps, tags, turns, most, spans, ep_spans, workers = [], [], [], [], [], [], [], 0
        for name, st, params, _, max_workers, max_turns, max_tokens in requests:
            spans.append((len(starts), len(starts) + len(st)))
            first = ep_spans[-1][1] if ep_spans else 0
            ep_spans.append((first, first + sum(sp.n for sp in params)))
            starts += st
            sps += params
            tags += [name] * len(st)
            turns += [max_turns] * len(st)
            most += [max_tokens] * len(st)
            workers += max_workers

        def on_turn(i: int, ids, reason):
            j = next(k for k, (a, b) in enumerate(ep_spans) if a <= i < b)
            return requests[j][3](i - ep_spans[j][0], ids, reason)

        eps = self.llm.run_episodes(starts, sps, on_turn, max_workers=max(1, workers), max_turns=turns,
                                    max_episode_tokens=most, lora=tags, **kw)
        got = []
        for (a, _), (ea, eb) in zip(spans, ep_spans):
            mine = eps[ea:eb]
            for ep in mine:
                ep.index, ep.start_index = ep.index - ea, ep.start_index - a
            got.append(mine)
        return got


def per_prompt(prompts, sampling_params) -> tuple[list, list[SamplingParams]]:
    """generate's (prompts, sampling_params) as lists of one per prompt (a trainer passes a list of
    prompts; one SamplingParams, a list or None as rlcu.LLM takes them)."""
    items = list(prompts) if isinstance(prompts, list) else [prompts]
    if sampling_params is None:
        sampling_params = SamplingParams()
    sps = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(items)
    if len(sps) != len(items):
        raise ValueError(f"generate got {len(sps)} sampling params for {len(items)} prompts: pass one, or one per "
                         f"prompt")
    return items, sps


class JobEngine:
    """A job's `llm` in a LoRA host: `request(name, prompts, sps, on_error)` is the host's (it
    parks the job until its rollouts are served with everyone's); the rest is the shared engine's."""

    def __init__(self, host, engine: HostEngine, name: str):
        self._host, self._engine, self.name = host, engine, name

    def adopt(self, model) -> LoraAdapters:
        return self._engine.adopt(self.name, model)

    def generate(self, prompts, sampling_params=None, *, on_error: str = "raise", **_ignored):
        """The job's requests, served in the host's next shared generate call. The per-call
        preemption callbacks are the host's (one engine, one lease), not the job's."""
        items, sps = per_prompt(prompts, sampling_params)
        return self._host.request(self.name, "generate", items, sps, on_error)

    def run_episodes(self, starts, sampling_params, on_turn, *, max_workers: int = 32, max_turns: int | None = None,
                     max_episode_tokens: int | None = None, **_ignored):
        """The job's episodes (LLM.run_episodes' arguments), run in the host's next shared
        run_episodes call with every other job's, under this job's limits; as generate's, the
        preemption callbacks are the host's."""
        items, sps = per_prompt(starts, sampling_params)
        return self._host.request(self.name, "episodes", items, sps, on_turn, max_workers, max_turns,
                                  max_episode_tokens)

    def sleep(self, keep_graphs: bool = False) -> None:
        """The host's engine sleeps and wakes around each shared call, not a job's phase."""

    def wake(self) -> None:
        pass

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        llm = self._engine.llm
        if llm is None:
            raise AttributeError(f"{name}: the host's engine starts once every job is built")
        return getattr(llm, name)
