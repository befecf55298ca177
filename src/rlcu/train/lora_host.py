"""A LoRA host: several LoRA GRPO jobs that name the same base, in one process over ONE copy of it.

    rlcu grpo a.yaml b.yaml c.yaml                   # the command line (train/cli.py)
    LoraHost(["a.yaml", "b.yaml"]).train()           # -> [HostedJob] with each job's status

Each job is a whole GRPOTrainer of its own config: its data, rewards, hyper-parameters, adapter,
optimizer state, checkpoints, run folder, metrics, trackers and exit status. What they share:
- the base: loaded once; each job's model is a view of its flat buffer (`Qwen3(cfg, base.flat)`)
  with the job's adapter attached, so the base is frozen and counted once;
- the engine (train/host_engine.py): one rlcu.LLM over the base serving every job's adapter as a
  slot; the jobs' rollouts go to it together and their sequences decode in the same steps, the
  multi-turn jobs' episodes (`multi_turn:`, each job its own environment and limits) likewise.

Turns. Each job runs its trainer's own loop in a thread of its own, but only one thread runs at a
time, in the jobs' order: a job runs until it asks the engine for rollouts (or ends), then hands
the turn back. Once every live job has asked (or ended), the host serves all their requests in
one generate call and the jobs take their turns again: each scores, updates its adapter (its
forward and backward over the shared frozen base), logs and checkpoints, then asks for its next
rollouts. Updates thus take turns, the order is fixed, and nothing runs concurrently: a job's
arithmetic is the one it does alone. In exact mode a hosted job's adapters are bit for bit those
of the same job run alone (the engine's kernels are batch invariant and its sampling is seeded
per sequence); in the default mode they are close (the engine's batch-dependent sums).

Joining. `join(config, ...)` (from any thread; under a scheduler, rlcu.sched.host's join channel)
queues a job on the same base; between two rounds the host checks it (check_jobs' rules against
its first job), builds its trainer over the shared base, adds its adapter to the engine (as a
slot of its own: the slab's rows are the first jobs', so the engine copies the adapters once a
call from then on) and gives it turns from the next round on; in exact mode a joined job's
adapters are still bit for bit those of the job run alone. The host ends (and refuses joins:
HostClosed) once its last job ended and none is queued.

A job that ends (done, or failed: a reward that raises, too many non-finite steps, an error)
leaves; the others go on. Its status is the one `rlcu grpo` gives alone (rlcu.train.core
exit_status: 0, 1, 2, 74, 128 + N) and the host's is the worst (the largest) of them. A signal
to the host stops every job after its step in flight, with a checkpoint, as it stops one run;
so does a scheduler's graceful cancel of the host, each job's status then 3 as a cancelled
scheduled job's.

Memory between turns: a hosted job's freed gradients and activations stay in the allocator's
cache for the next job's turn (which takes blocks of the same sizes) and go back to the device
once a round, before the shared rollout, where a job alone gives them back after each update: an
empty_cache waits for the device and the next job's allocations would go to the driver again.

Where the wall time goes: `timeline` (seconds, perf_counter) holds the base's load, each job's
trainer build, the engine's start, and per round each job's turn and the shared serve; a bench
(bench/lora_host.py) reads it to split start-up from the steady state.

Refused by name (ConfigError naming the file and the field) before anything runs: a config
without `lora:`, one naming another base (model.path, revision, tiny, init_seed, dtype, device)
or another exact mode or engine section than the first, and two jobs writing one log.out_dir.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

from rlcu.config import ConfigError, GRPOConfig
from rlcu.errors import SetupError
from rlcu.model.causal_lm import Qwen3
from rlcu.train import sizing
from rlcu.train.checkpoint import build_model
from rlcu.train.core import Hooks, TrainingStopped, coerce_config, exit_status, load_tokenizer
from rlcu.train.grpo import GRPOTrainer
from rlcu.train.host_engine import HostEngine, JobEngine
from rlcu.train.host_jobs import HostedJob, check_jobs, job_names
from rlcu.train.signals import SignalGuard


class HostClosed(RuntimeError):
    """LoraHost.join after the host's last job ended (or it was stopped): start a host of your own."""


class _HostHooks(Hooks):
    """A hosted job's hooks: its training phases are the host's (`LoraHost.hooks.phase`: under a
    scheduler, the host's one lease), its rollouts the host's shared call (which holds the
    rollout phase itself); the host's signal, or its driver's stop, stops it after its step."""

    def __init__(self, host: LoraHost):
        self.host = host

    def phase(self, name: str, **info):
        if name == "rollout":  # the job only parks its requests; the host's serve is the phase
            return contextlib.nullcontext()
        return self.host.hooks.phase(name, **info)

    def stop_reason(self) -> str | None:
        return self.host.stop or self.host.hooks.stop_reason()


class LoraHost:
    """configs: GRPO configs (GRPOConfig, dicts or YAML paths) of LoRA jobs on one base. Per job
    (lists in the configs' order, or None): datasets, reward_fns and tokenizers as GRPOTrainer
    takes them; names (default: the file's stem, else job0, job1, ...); sources (the files the
    configs came from, for errors; default: the paths given); hooks: the host's as a whole
    (rlcu.train.core.Hooks; a scheduler's: rlcu.sched.host), whose phases the jobs' training
    phases and the shared rollouts run in. See the module docstring."""

    def __init__(self, configs: list, datasets: list | None = None, reward_fns: list | None = None, *,
                 tokenizers: list | None = None, names: list[str] | None = None, sources: list[str] | None = None,
                 hooks: Hooks | None = None):
        if len(configs) < 1:
            raise ValueError("a LoRA host needs at least one job config")
        n = len(configs)
        if names is None:
            names = job_names([s if s is not None else c for s, c in zip(sources or [None] * n, configs)])
        self.jobs = [HostedJob(names[i], coerce_config(GRPOConfig, c),
                               sources[i] if sources is not None else _source(c))
                     for i, c in enumerate(configs)]
        if len({j.name for j in self.jobs}) != n:
            raise ValueError(f"job names must differ, got {[j.name for j in self.jobs]}")
        check_jobs(self.jobs)
        self.hooks = hooks if hooks is not None else Hooks()
        self.stop: str | None = None
        self.signum: int | None = None
        self._cv = threading.Condition()
        self._turn: str | None = None
        self._jlock = threading.Lock()
        self._joins: list[tuple[HostedJob, tuple]] = []  # jobs queued by join, taken between steps
        self._tokenizers: dict[tuple, object] = {}  # loaded once per source (_tokenizer)
        self.closed = False  # no more joins: the last job ended
        self.timeline: dict = {"builds_s": {}, "rounds": []}  # see the module docstring
        c0 = self.jobs[0].cfg
        t = time.perf_counter()
        self.base = build_model(c0.model)
        self.base.exact = c0.exact
        self.timeline["base_s"] = time.perf_counter() - t
        self.engine = HostEngine(self.base, [j.name for j in self.jobs], [_lora_cfg(j.cfg) for j in self.jobs])
        for i, job in enumerate(self.jobs):
            self._build(job, _at(datasets, i), _at(reward_fns, i), _at(tokenizers, i))
        built = [j for j in self.jobs if j.trainer is not None]
        t = time.perf_counter()
        if built:
            self.engine.start(self._engine_kwargs(built))
        self.timeline["engine_start_s"] = time.perf_counter() - t

    # ---------------------------------------------------------------- setup
    def _view(self, cfg: GRPOConfig) -> Qwen3:
        """A job's model: the base's buffer (no copy) under the job's own settings."""
        m = Qwen3(self.base.cfg, self.base.flat, cfg.exact)
        m.source = self.base.source
        cfg.model.check_layers(m.cfg.num_hidden_layers)
        m.gradient_checkpointing = cfg.model.gradient_checkpointing
        return m

    def _build(self, job: HostedJob, dataset, reward_fns, tokenizer) -> None:
        """The job's trainer; one that cannot be built ends with status 2 and its reason."""
        t = time.perf_counter()
        try:
            tokenizer = tokenizer if tokenizer is not None else self._tokenizer(job.cfg)
            job.trainer = GRPOTrainer(job.cfg, dataset, reward_fns, model=self._view(job.cfg), tokenizer=tokenizer,
                                      hooks=_HostHooks(self), llm=JobEngine(self, self.engine, job.name))
            job.trainer.give_back_memory = False  # the next job takes the same blocks: _serve gives them back
        except (SetupError, ConfigError, ValueError, FileNotFoundError) as e:
            job.status, job.error = 2, e
            print(f"rlcu grpo [{job.name}]: {e}", file=sys.stderr)
        self.timeline["builds_s"][job.name] = time.perf_counter() - t

    def _tokenizer(self, cfg: GRPOConfig):
        """The job's tokenizer, loaded once for every job naming the same one (a tokenizer is read,
        never changed, and a large one's load is most of a job's build); None when it does not load,
        so that the job's trainer loads it and fails with its own error."""
        key = (cfg.model.tokenizer, cfg.model.path, cfg.model.revision)
        if key not in self._tokenizers:
            try:
                self._tokenizers[key] = load_tokenizer(cfg.model, "RL prompts")
            except Exception:  # noqa: BLE001 (the trainer's own load raises it, for that job only)
                return None
        return self._tokenizers[key]

    @staticmethod
    def _engine_kwargs(jobs: list[HostedJob]) -> dict:
        """The shared engine's arguments: the first job's engine section, a KV pool that holds every
        job's step (the sum of their default pools) and room for all their sequences in a step."""
        kws = [j.trainer.engine_kwargs() for j in jobs]
        kw = dict(kws[0])
        if all(k["num_kv_blocks"] is not None for k in kws) and jobs[0].cfg.engine.num_kv_blocks is None:
            kw["num_kv_blocks"] = sum(k["num_kv_blocks"] for k in kws)
        kw["max_num_seqs"] = min(sum(k["max_num_seqs"] for k in kws), sizing.HOST_MAX_SEQS)
        return kw

    # ---------------------------------------------------------------- joining
    def join(self, config, dataset=None, reward_fns=None, *, tokenizer=None, name: str | None = None,
             source: str | None = None, on_end=None) -> HostedJob:
        """Queue a job (a GRPO config, a dict or a YAML path, and what GRPOTrainer takes) to join
        this host between two steps; from any thread. The host checks it as check_jobs does
        (against its first job: the same base, exact mode and engine section; a run folder of its
        own), builds its trainer over the shared base (in an `init` phase), adds its adapter to the
        engine, and runs it from the next round on; `on_end(job)` is called once it ended (its
        status as `rlcu grpo` gives it alone: 2 when refused). Raises HostClosed once the host's
        last job ended."""
        cfg = coerce_config(GRPOConfig, config)
        with self._jlock:
            if self.closed:
                raise HostClosed("this LoRA host has ended: its jobs are done")
            taken = {j.name for j in self.jobs} | {j.name for j, _ in self._joins}
            name = name or job_names([source if source is not None else config])[0]
            while name in taken:
                name += "+"
            job = HostedJob(name, cfg, source if source is not None else _source(config), on_end=on_end)
            self._joins.append((job, (dataset, reward_fns, tokenizer)))
        return job

    def _take_joins(self) -> list[HostedJob]:
        """The jobs queued by join, each checked, built and started (module docstring)."""
        with self._jlock:
            todo, self._joins = self._joins, []
        out = []
        for job, (dataset, reward_fns, tokenizer) in todo:
            if self.stop is not None:
                job.status, job.error = (128 + self.signum) if self.signum else 3, HostClosed(f"the host {self.stop}")
                self._ended(job)
                continue
            try:
                check_jobs([*self.jobs, job])
            except ConfigError as e:
                job.status, job.error = 2, e
                print(f"rlcu grpo [{job.name}]: {e}", file=sys.stderr)
                self._ended(job)
                continue
            self.jobs.append(job)
            self.engine.add(job.name)
            with self.hooks.phase("init"):
                self._build(job, dataset, reward_fns, tokenizer)
                if job.trainer is not None:
                    self.engine.serve_added(job.name)
            if job.trainer is None:
                self._ended(job)
                continue
            self._start(job)
            out.append(job)
        return out

    def _ended(self, job: HostedJob) -> None:
        cb, job.on_end = job.on_end, None
        if cb is not None:
            cb(job)

    def _close(self) -> bool:
        """No more joins once none is queued; False when one is (the loop takes it first)."""
        with self._jlock:
            if self._joins:
                return False
            self.closed = True
            return True

    # ---------------------------------------------------------------- turns
    def request(self, name: str, kind: str, *args):
        """A job's generate or run_episodes (`kind`, with its arguments as HostEngine.serve takes
        them; from the job's thread): park with the request, hand the turn back, and return (or
        raise) what the host's shared call gave it once the turn comes back."""
        job = next(j for j in self.jobs if j.name == name)
        job.pending, job.result = (kind, args), None
        self._hand_back(name)
        res, job.result = job.result, None
        if isinstance(res, BaseException):
            raise res
        return res

    def _hand_back(self, name: str) -> None:
        with self._cv:
            self._turn = None
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._turn == name)

    def _give_turn(self, job: HostedJob) -> None:
        with self._cv:
            self._turn = job.name
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._turn is None)

    def _body(self, job: HostedJob) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._turn == job.name)
        if self.base.device.type == "cuda":  # a thread's current device is its own: the base's, as the host's
            torch.cuda.set_device(self.base.device)
        try:
            job.status = exit_status(f"rlcu grpo [{job.name}]", job.trainer.train)
        except TrainingStopped as e:  # after its step, with a checkpoint: the host's signal, or its scheduler's cancel
            job.status, job.error = (128 + self.signum) if self.signum else 3, e
            print(f"rlcu grpo [{job.name}]: {e}", file=sys.stderr)
        except BaseException as e:  # noqa: BLE001 (a job's failure is its own: the others go on)
            job.status, job.error = 1, e
            print(f"rlcu grpo [{job.name}]: {type(e).__name__}: {e}", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
        finally:
            job.history = list(job.trainer.history)
            with self._cv:
                self._turn = None
                self._cv.notify_all()

    def _serve(self, waiting: list[HostedJob]) -> None:
        reqs = [(j.name, *j.pending) for j in waiting]
        h = self.hooks
        kw = dict(yield_check=h.yield_check, on_yield=h.on_yield, on_done=h.on_generate_done) if h.preemptible else {}
        work = float(sum(sp.n * sp.max_tokens for _, _, args in reqs for sp in args[1]))
        if self.base.device.type == "cuda":  # the turns' freed gradients and activations, once, not after each job
            torch.cuda.empty_cache()
        try:
            with h.phase("rollout", work=work):
                got = self.engine.serve(reqs, kw)
        except Exception as e:  # noqa: BLE001 (the engine failed: every job that waited on it gets the error)
            got = [e] * len(waiting)
        for j, res in zip(waiting, got):
            j.pending, j.result = None, res

    # ---------------------------------------------------------------- the run
    def train(self) -> list[HostedJob]:
        """Run every built job to its end (see the module docstring); returns the jobs, each with
        its status, history and error."""
        live = [j for j in self.jobs if j.trainer is not None and j.status is None]
        for j in live:
            self._start(j)
        with SignalGuard() as sig:
            while True:
                live += self._take_joins()
                if not live:
                    if self._close():
                        break
                    continue
                turns = {}
                for j in live:
                    t = time.perf_counter()
                    self._give_turn(j)
                    turns[j.name] = time.perf_counter() - t
                    if sig.signum and self.stop is None:
                        self.stop, self.signum = f"received {sig.name}", sig.signum
                for j in live:
                    if j.done:
                        self._ended(j)
                live = [j for j in live if not j.done]
                waiting = [j for j in live if j.pending is not None]
                t = time.perf_counter()
                if waiting:
                    self._serve(waiting)
                self.timeline["rounds"].append({"turns_s": turns, "serve_s": time.perf_counter() - t})
        for j in self.jobs:
            if j.thread is not None:
                j.thread.join()
        return self.jobs

    def _start(self, job: HostedJob) -> None:
        job.thread = threading.Thread(target=self._body, args=(job,), name=f"lora-host:{job.name}", daemon=True)
        job.thread.start()

    @property
    def status(self) -> int:
        """The host's exit status: the worst (largest) of its jobs'."""
        return max((j.status or 0) for j in self.jobs)


def _source(config) -> str | None:
    return str(config) if isinstance(config, (str, Path)) else None


def _at(xs, i):
    return None if xs is None else xs[i]


def _lora_cfg(cfg: GRPOConfig):
    """The job's LoraConfig when its section makes the adapter (None: read from lora.path later)."""
    return cfg.lora.lora_config() if cfg.lora.path is None else None
