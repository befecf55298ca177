"""A scheduled GRPO job across the ranks of a data-parallel run (torchrun, rlcu.parallel).

    torchrun --nproc-per-node N -m rlcu grpo CONFIG --scheduler ADDR

Rank 0 alone talks to the scheduler: it registers the job with one cluster of N devices
(`actor`, `devices: N`) and holds its leases, each spanning N devices, one a rank; it
heartbeats (JobHandle's thread). Every phase is entered by all ranks together: rank 0
releases the lease of the phase before once every rank is done with it (a barrier), asks for
the next, and broadcasts the grant; a refusal or a job ended by the scheduler is broadcast too,
so every rank raises the same error. On a GPU each rank keeps its LOCAL_RANK device (the
process group is bound to it): rank 0 pins the job's leases to the ranks' own GPUs (`only=`,
from the pool's device names "cuda:K" or "HOST/cuda:K") and each rank checks that the grant
holds its device; CPU slots ("cpu0", ...) are taken as they come.

Yields. Between two engine steps (the engine's yield_check) the ranks take part in one
collective tick: rank 0 contributes whether the scheduler asks the rollout lease back
(`should_yield`), every rank whether its engine is still generating. A yield therefore
reaches every rank at the same tick: each engine preempts its live sequences and sleeps,
the ranks sum their remaining tokens, rank 0 gives the lease back and asks again with that
work, and all wait for the re-grant together. A rank whose generate has finished keeps
ticking (and yields with its engine asleep) until every rank's has, so that the collectives
after the generate (gathering the samples) pair up: the engine calls the hooks'
`on_generate_done` at the end of each generate (its `on_done`). Ticks happen only in the
rollout phase. The lease moves are rlcu.sched.lease's LeaseHolder, over `RankZero`.

Cancel. Before each step every rank asks `stop_reason`, answered by rank 0 from its view of
the job: after a graceful cancel all ranks stop after the same step and checkpoint together.

Failure. A rank that raises or dies ends every rank through the parallel watchdog; rank 0's
watchdog finishes the job as failed before it ends its process (`rlcu.parallel.watchdog.at_die`),
and an exception on rank 0 itself finishes it in run_grpo.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import socket
import threading
import time

import torch

from rlcu.parallel import comm as W
from rlcu.parallel import watchdog
from rlcu.sched.client import JobHandle, LeaseInfo, SchedError, pool_devices
from rlcu.sched.hooks import JobHooks
from rlcu.sched.lease import PREEMPTIBLE, Lessor

_ERROR_FLAG = 1e6  # rank 0's tick value when asking the scheduler failed


def _portable(e: BaseException) -> tuple:
    return type(e).__module__, type(e).__qualname__, str(e), getattr(e, "code", None)


def _rebuild(info: tuple) -> BaseException:
    mod, name, msg, code = info
    try:
        cls = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError):
        cls = None
    if isinstance(cls, type) and issubclass(cls, SchedError):
        return cls(msg, code)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(msg)
        except Exception:
            pass
    return RuntimeError(f"rank 0: {name}: {msg}")


_SEQ = itertools.count(1)  # on_main calls, the same sequence on every rank


def _store():
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    return dist.PrefixStore("rlcu/sched/", _get_default_store())


def _wait_for_main(seq: int) -> None:
    """Until rank 0 has done on_main call `seq`: polled on the rendezvous store, without a
    deadline (a grant may wait for hours in a busy pool; a collective would time out after
    RLCU_DIST_TIMEOUT_S), so the watchdog alone ends a wait whose rank 0 is gone."""
    st, pause = _store(), 0.001
    while not (st.check(["done"]) and int(st.get("done")) >= seq):
        time.sleep(pause)
        pause = min(0.05, pause * 2)


def on_main(fn, share: bool = True):
    """fn() on rank 0, its result broadcast to every rank (share=False: None to the others);
    an exception on rank 0 is raised on every rank (the same class where it can be rebuilt).
    The other ranks wait for it however long fn takes."""
    out = err = None
    seq = next(_SEQ)
    if W.world().is_main:
        try:
            out = fn()
        except Exception as e:
            err = e
        if W.world().distributed:
            _store().set("done", str(seq))
    elif W.world().distributed:
        _wait_for_main(seq)
    msg = W.broadcast_object(("error", _portable(err)) if err is not None else ("ok", out if share else None))
    if err is not None:
        raise err
    if msg[0] == "error":
        raise _rebuild(msg[1])
    return out if W.world().is_main else msg[1]


def _my_device() -> str:
    if W.world().backend == "nccl":
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def pin_devices(handle: JobHandle | None, ranks: list[tuple[str, str]]) -> list[int] | None:
    """The pool devices of the ranks' GPUs ((host, "cuda:K") a rank), for `only=`; None when
    the ranks run on the CPU or the pool is of CPU slots, or when the pool's names cannot be
    read (a worker holding only its job's secret may not call `status`: the leases are then
    not pinned, and a grant without a rank's GPU raises on that rank). Raises SchedError
    when a rank's GPU is not in the pool."""
    if all(d == "cpu" for _, d in ranks):
        return None
    devices = pool_devices(handle.client)
    if devices is None:
        return None
    pool = {dv["name"]: int(dv["index"]) for dv in devices}
    if not any("cuda:" in n for n in pool):
        return None  # CPU slots: each rank keeps its device
    out, missing = [], []
    for host, dev in ranks:
        i = pool.get(f"{host}/{dev}", pool.get(dev))
        (missing if i is None else out).append(i if i is not None else f"{host}/{dev}")
    if missing:
        raise SchedError(f"the ranks' GPUs {missing} are not devices of the scheduler's pool "
                         f"({', '.join(sorted(pool))}): serve the GPUs the job runs on", "invalid")
    if len(set(out)) != len(out):
        raise SchedError(f"two ranks name the same pool device ({ranks})", "invalid")
    return sorted(out)


class RankZero(Lessor):
    """The service as every rank sees it: rank 0 asks (its JobHandle; None on the others) and
    broadcasts the answer, so each rank gets the same grant or raises the same error. A grant
    spans the job's ranks (`size` devices, pinned to `only`); each rank checks that it holds
    its own device. A lease goes back once every rank is done with it (a barrier)."""

    def __init__(self, handle: JobHandle | None, rank: int, size: int, only: list[int] | None = None):
        super().__init__(handle)
        self.rank, self.size, self.only = rank, size, only

    def acquire(self, phase: str, cluster: str, **kw) -> LeaseInfo:
        kw.update(devices=self.size, only=self.only)
        if phase == PREEMPTIBLE:
            kw["min_devices"] = self.size  # every rank rolls out its share
        lease = on_main(lambda: self.handle.acquire(phase, cluster, **kw))
        self.check(lease)
        return lease

    def check(self, lease: LeaseInfo) -> None:
        if len(lease.devices) != self.size:
            raise SchedError(f"lease {lease.id} ({lease.phase}) spans {len(lease.devices)} devices; the job has "
                             f"{self.size} ranks", "invalid")
        mine = _my_device()
        if mine != "cpu" and any("cuda:" in n for n in lease.names) and \
                not any(n.rsplit("/", 1)[-1] == mine for n in lease.names):
            raise SchedError(f"rank {self.rank}: lease {lease.id} ({lease.phase}) holds {list(lease.names)}, "
                             f"not this rank's {mine}", "invalid")

    def release(self, lease: LeaseInfo) -> None:
        W.barrier()  # every rank is done with the phase before its lease goes back
        on_main(lambda: self.handle.release(lease), share=False)

    def drop(self, lease: LeaseInfo) -> None:
        """No collective: after an error the other ranks may be anywhere."""
        if self.handle is not None:
            super().drop(lease)

    @property
    def stopping(self) -> bool:
        """Rank 0's view on every rank (all ask at the same step), so all stop together."""
        return on_main(lambda: self.handle.stopping)


class DistJobHooks(JobHooks):
    """rlcu.sched.hooks.JobHooks across ranks (see the module docstring): `sched` is the
    JobHandle on rank 0 and None on the others; the lease moves are a LeaseHolder's over
    `RankZero`, the yield checks collective ticks. `attach(llm)` gives the engine that sleeps
    through an idle yield."""

    def __init__(self, sched: JobHandle | None, cluster: str, mem: dict | None = None):
        w = W.world()
        self.rank, self.size, self.main = w.rank, w.size, w.is_main
        if self.main and sched is None:
            raise ValueError("rank 0 of a scheduled job needs the job's JobHandle")
        ranks = W.all_gather_objects((socket.gethostname(), _my_device()))
        only = on_main(lambda: pin_devices(sched, ranks))
        super().__init__(sched, cluster, mem, lessor=RankZero(sched, self.rank, self.size, only))
        self._pending = False  # yield_check said yield but the engine had nothing left to preempt
        self._llm = None
        self.ticks = 0  # collective ticks in rollouts (the same count on every rank)
        self.yield_ticks: list[int] = []  # the tick of each yield (tests: equal on every rank)
        self._undo_at_die = None
        if self.main:
            self._undo_at_die = watchdog.at_die(self._fail_job)

    def attach(self, llm) -> None:
        self._llm = llm

    def _fail_job(self, msg: str) -> None:
        """The watchdog ends rank 0 (another rank failed): finish the job as failed, bounded."""
        h = self.sched

        def tell():
            with contextlib.suppress(Exception):
                h.client.call("finish", job=h.name, failed=True, retry_s=3.0)

        t = threading.Thread(target=tell, daemon=True)
        t.start()
        t.join(5.0)

    def close(self) -> None:
        if self._undo_at_die is not None:
            self._undo_at_die()
            self._undo_at_die = None

    # ---------------------------------------------------------------- yields
    def _tick(self, active: bool) -> tuple[bool, bool]:
        """One collective tick: (yield now, every rank's generate done)."""
        flag, err = 0.0, None
        if self.main:
            try:
                flag = 1.0 if self.lease.yield_due() else 0.0
            except SchedError as e:
                flag, err = _ERROR_FLAG, e
        t = W.all_sum(torch.tensor([flag, float(active)], dtype=torch.float64))
        self.ticks += 1
        if t[0] >= _ERROR_FLAG:
            def fail():
                raise err

            on_main(fail)
        return bool(t[0] >= 1.0), bool(t[1] == 0)

    def yield_check(self) -> bool:
        self._count_step()
        if not self.lease.preemptible:
            return False
        y, _ = self._tick(active=True)
        if y:
            self._pending = True
            self.yield_ticks.append(self.ticks)
        return y

    def on_yield(self, tokens_left: int) -> None:
        self._pending = False
        self._together(tokens_left)

    def _together(self, tokens_left: int) -> None:
        """Every rank: the lease goes back, and all wait for the re-grant (the work left summed)."""
        self.lease.yield_and_wait(W.all_sum(float(tokens_left)))

    def _idle_yield(self) -> None:
        """A yield on a rank whose generate is done: its engine sleeps through it too."""
        llm = self._llm
        if llm is not None:
            llm.sleep(keep_graphs=True)
        self._together(0)
        if llm is not None:
            llm.wake()

    def on_generate_done(self) -> None:
        """After this rank's generate (the engine's on_done): tick until every rank's is done,
        yielding with them, so that the collectives after the generate pair up across ranks."""
        if self._pending:
            self._pending = False
            self._idle_yield()
        while self.lease.preemptible:
            y, done = self._tick(active=False)
            if done:
                return
            if y:
                self.yield_ticks.append(self.ticks)
                self._idle_yield()
