"""The job's place among its ranks: torchrun's environment, the process group, and the few
collectives the trainers need (sums, maxima, barriers) as plain functions.

`init_from_env()` reads what torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) and, when WORLD_SIZE > 1, initialises torch.distributed: NCCL with one GPU a rank
(cuda:LOCAL_RANK) when CUDA is there, gloo on the CPU (RLCU_DIST_BACKEND overrides). The
process group's timeout (RLCU_DIST_TIMEOUT_S, default 600 s) bounds any collective, and a
watchdog thread (watchdog.py) ends every rank within RLCU_DIST_HEARTBEAT_S (default 60 s) of
another rank raising or dying, and within a second of its launcher's death. A run's error line
is printed once for the job (`print_once`), not once a rank; `ranked(entry, argv)` runs a
command line with all of this around it. Without torchrun (or with one rank) nothing happens:
`world()` is the one-process World, the helpers below return their input, and no process
group exists.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import time

import torch

from rlcu.parallel import watchdog

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str | None = None  # None: no process group (one process)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


_WORLD = World()
_WATCHDOG = None


def world() -> World:
    """The current World (the one-process World unless init_from_env set up a group)."""
    return _WORLD


def env_world(env=None) -> World:
    """The World torchrun's variables describe (no side effects). Raises ValueError naming
    the variable when one is missing or not an integer."""
    env = os.environ if env is None else env
    if "WORLD_SIZE" not in env and "RANK" not in env:
        return World()
    vals = {}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        v = env.get(k, "0" if k == "LOCAL_RANK" else None)
        if v is None:
            raise ValueError(f"{k} is not set (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)")
        try:
            vals[k] = int(v)
        except ValueError:
            raise ValueError(f"{k}={v!r} is not an integer") from None
    r, n = vals["RANK"], vals["WORLD_SIZE"]
    if n < 1 or not 0 <= r < n:
        raise ValueError(f"RANK={r} must lie in [0, WORLD_SIZE={n})")
    return World(rank=r, size=n, local_rank=vals["LOCAL_RANK"])


def _float_env(name: str, default: float) -> float:
    v = os.environ.get(name)
    if v is None:
        return default
    try:
        x = float(v)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not a number of seconds") from None
    if not x > 0:
        raise ValueError(f"{name}={v!r} must be > 0 seconds")
    return x


def init_from_env(backend: str | None = None, timeout_s: float | None = None,
                  heartbeat_s: float | None = None) -> World:
    """Initialise torch.distributed from torchrun's environment (see the module docstring).
    Idempotent; returns the World. One rank (or no torchrun): returns World() untouched."""
    global _WORLD, _WATCHDOG
    if _WORLD.distributed:
        return _WORLD
    w = env_world()
    if not w.distributed:
        return _WORLD
    import torch.distributed as dist

    for k in ("MASTER_ADDR", "MASTER_PORT"):
        if k not in os.environ:
            raise ValueError(f"{k} is not set: launch with torchrun (which sets it), or set it by hand")
    backend = backend or os.environ.get("RLCU_DIST_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"RLCU_DIST_BACKEND={backend!r}: must be nccl or gloo")
    timeout_s = timeout_s or _float_env("RLCU_DIST_TIMEOUT_S", 600.0)
    heartbeat_s = heartbeat_s or _float_env("RLCU_DIST_HEARTBEAT_S", 60.0)
    kw = {}
    if backend == "nccl":
        n_dev = torch.cuda.device_count()
        if w.local_rank >= n_dev:
            raise ValueError(f"rank {w.rank}: LOCAL_RANK={w.local_rank} but this node has {n_dev} GPUs "
                               f"(torchrun --nproc-per-node must not exceed them)")
        torch.cuda.set_device(w.local_rank)
        kw["device_id"] = torch.device("cuda", w.local_rank)
    dist.init_process_group(backend, rank=w.rank, world_size=w.size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kw)
    from torch.distributed.distributed_c10d import _get_default_store

    # the rendezvous store (torchrun's agent holds it, so it outlives a dead rank)
    _WATCHDOG = watchdog.Watchdog(dist.PrefixStore("rlcu/watchdog/", _get_default_store()), w.rank, w.size, heartbeat_s)
    _WORLD = dataclasses.replace(w, backend=backend)
    _WATCHDOG.start()
    return _WORLD


_COMM_HINTS = ("connection closed", "connection reset", "broken pipe", "timed out", "nccl", "gloo", "peer")


def report_failure(exc: BaseException) -> None:
    """Tell every other rank that this one failed with `exc` (their watchdogs end them). A
    collective that failed because a peer died is not the root cause: the watchdog is given
    its heartbeat bound to name the dead rank first (and ends this process with that)."""
    if _WATCHDOG is None:
        return
    import torch.distributed as dist

    msg = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, getattr(dist, "DistError", ())) or any(h in msg.lower() for h in _COMM_HINTS):
        _WATCHDOG.wait_for_peer_failure()
    _WATCHDOG.report(msg)


def watch_launcher() -> None:
    """Under torchrun with one rank (no process group, so no watchdog): end the process within
    a second of its launcher's death all the same (watchdog.watch_launcher). Without torchrun
    (TORCHELASTIC_RUN_ID unset: a shell, a scheduler's worker) nothing happens."""
    if _WATCHDOG is None and "TORCHELASTIC_RUN_ID" in os.environ:
        watchdog.watch_launcher()


def check_launcher() -> None:
    """End this rank at once if its launcher (torchrun) is gone (watchdog.py); a no-op in
    one process."""
    if _WATCHDOG is not None:
        _WATCHDOG.check_parent()


def print_once(line: str, wait_s: float = 1.0) -> None:
    """Print a line for the user (a run's error) on stderr once for the job, not once a rank:
    rank 0 prints its line; another rank prints its own, marked with its rank, only when it
    differs from rank 0's (posted to the rendezvous store first, waited for up to wait_s: the
    ranks of one config fail the same way at about the same time). One process: a print."""
    if _WATCHDOG is None:
        print(line, file=sys.stderr, flush=True)
        return
    store, key = _WATCHDOG.store, "said/0"
    try:
        if _WORLD.is_main:
            store.set(key, line)
        else:
            end = time.monotonic() + wait_s
            while not store.check([key]) and time.monotonic() < end:
                time.sleep(0.02)
            if store.check([key]) and store.get(key).decode(errors="replace") == line:
                return
            line = f"rank {_WORLD.rank}: {line}"
    except Exception:  # no store: say it here
        pass
    print(line, file=sys.stderr, flush=True)


def shutdown() -> None:
    """End the job cleanly: a barrier (every rank has finished), the watchdog stopped, the
    process group destroyed. A no-op without a process group."""
    global _WORLD, _WATCHDOG
    if not _WORLD.distributed:
        return
    import torch.distributed as dist

    if _WATCHDOG is not None:
        _WATCHDOG.finish()  # waits until every rank is done, then stops
        _WATCHDOG = None
    dist.destroy_process_group()
    _WORLD = World()


def ranked(entry, argv: list[str] | None = None) -> int:
    """entry(argv) -> exit status, with the process group around it under torchrun (`python -m
    rlcu`, and `python -m rlcu.sched.job`, the worker of a submitted job of several ranks): set up
    first, torn down at the end; a rank that raises or fails tells the others."""
    try:
        w = env_world()
    except ValueError as e:
        print(f"rlcu: torchrun environment: {e}", file=sys.stderr)
        return 2
    if not w.distributed:
        watch_launcher()  # torchrun with one rank: its launcher may die too
        return entry(argv)
    try:
        init_from_env()
    except ValueError as e:  # a setup that cannot work (more ranks than GPUs, no MASTER_ADDR): one line
        print(f"rlcu: {e}", file=sys.stderr)
        return 2
    try:
        rc = entry(argv)
    except BaseException as e:
        report_failure(e)
        raise
    if rc:
        report_failure(RuntimeError(f"exited with status {rc}"))
        return rc
    shutdown()
    return rc


# ---------------------------------------------------------------- collectives (identity for one process)
def _dev() -> torch.device:
    if _WORLD.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_sum(x):
    """The sum over ranks of a number or tensor (a float64 copy for numbers; a tensor is
    reduced in place and returned). One process: x itself."""
    if not _WORLD.distributed:
        return x
    import torch.distributed as dist

    if isinstance(x, torch.Tensor):
        t = x if x.device == _dev() else x.to(_dev())
        dist.all_reduce(t)
        if t is not x:
            x.copy_(t)
        return x
    t = torch.tensor([float(x)], dtype=torch.float64, device=_dev())
    dist.all_reduce(t)
    return float(t)


def all_max(x: float) -> float:
    if not _WORLD.distributed:
        return x
    import torch.distributed as dist

    t = torch.tensor([float(x)], dtype=torch.float64, device=_dev())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def all_gather_objects(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] (pickled; small objects only)."""
    if not _WORLD.distributed:
        return [obj]
    import torch.distributed as dist

    out = [None] * _WORLD.size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s obj on every rank (pickled; small objects only). One process: obj."""
    if not _WORLD.distributed:
        return obj
    import torch.distributed as dist

    box = [obj if _WORLD.rank == src else None]
    dist.broadcast_object_list(box, src=src, device=_dev() if _WORLD.backend == "nccl" else None)
    return box[0]


def barrier() -> None:
    if _WORLD.distributed:
        import torch.distributed as dist

        if _WORLD.backend == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()
