"""What the sandbox's child does to itself between fork and exec (run_python's preexec_fn):
its own process group, resource limits, no network, and, when the caller is root, an
unprivileged uid of its own.

No network comes from a new network namespace (unshare(2) through libc; os.unshare is 3.12+):
the child then has no interface at all, not even loopback. As root a network namespace needs no
user namespace; otherwise the kernel must allow unprivileged user namespaces. Where it does not,
`network_mode()` answers "audit" and run_python installs an audit hook instead (see sandbox.py).

Root is not limited by RLIMIT_NPROC (the kernel exempts uid 0), and root reads every file. So a
root caller's child drops to a fresh uid from a high range that no account uses: RLIMIT_NPROC
then counts exactly the sandbox's processes, files readable only by their owner (mode 0600,
0700 folders) are closed to it, and every process it leaves, even one that left the process
group with setsid(), is found by its uid and killed (`kill_uid`). A root caller whose interpreter other
users cannot run (a pyenv under /root) keeps uid 0, and so does a non-root caller, which cannot
change uid: the child then shares the caller's files (and, as root, has no process limit but
the group kill and the wall limit); docs/tools.md says so.
"""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import secrets
import signal
import subprocess
import sys
import time

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
UID_BASE = 1 << 30  # above every account and every subordinate-uid range in common use


class ConfineError(OSError):
    """A step of confining the child failed before exec (the call's message names it)."""


# resolved in the parent at import: dlopen between fork and exec may deadlock on a lock that
# another thread of the parent (a pool running tool calls) held at the fork
_LIBC_UNSHARE = ctypes.CDLL(None, use_errno=True).unshare


def _unshare(flags: int) -> None:
    if _LIBC_UNSHARE(ctypes.c_int(flags)) != 0:
        err = ctypes.get_errno()
        raise ConfineError(err, f"unshare({flags:#x}): {os.strerror(err)}")


def _netns_flags() -> int:
    return CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET


@functools.cache
def network_mode() -> str:
    """"netns" where this kernel lets us make a network namespace (probed once by a child that
    makes one), else "audit"."""
    try:
        r = subprocess.run([sys.executable, "-I", "-c", "pass"], preexec_fn=lambda: _unshare(_netns_flags()),
                           timeout=30, capture_output=True)
    except (subprocess.SubprocessError, OSError):
        return "audit"
    return "netns" if r.returncode == 0 else "audit"


def others_can_run(path: str) -> bool:
    """Whether a uid that owns nothing can execute `path` (o+x on it and every folder above)."""
    real = os.path.realpath(path)
    parts = [real] + [os.path.dirname(real)]
    while parts[-1] != "/":
        parts.append(os.path.dirname(parts[-1]))
    try:
        return all(os.stat(p).st_mode & 0o001 for p in parts)
    except OSError:
        return False


def sandbox_uid(python: str) -> int | None:
    """A fresh uid for one run when the caller is root and that uid can run `python`, else None
    (the child keeps the caller's uid: a root child then has root's files and no process limit
    but the process group kill and the wall limit)."""
    if os.geteuid() != 0 or not others_can_run(python):
        return None
    return UID_BASE + secrets.randbelow(1 << 30)


def count_processes(uid: int) -> int:
    """How many processes the real uid `uid` has now (RLIMIT_NPROC counts them all)."""
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit() and _real_uid(pid) == uid:
            n += 1
    return n


def _real_uid(pid: str, *, live: bool = False) -> int | None:
    """The real uid of `pid`; None if it is gone (or, with `live`, a zombie: killing one does
    nothing, its parent reaps it)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if live and line.startswith("State:") and line.split()[1] in ("Z", "X"):
                    return None
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def kill_uid(uid: int, *, within_s: float = 5.0) -> int:
    """SIGKILL every process of `uid` until none is left (a fork bomb forks while we kill, but
    RLIMIT_NPROC bounds it); returns how many are left (0 unless `within_s` ran out)."""
    deadline = time.monotonic() + within_s
    while True:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _real_uid(p, live=True) == uid]
        if not pids or time.monotonic() > deadline:
            return len(pids)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def preexec(*, cpu_s: float, memory_mb: int, file_mb: int, nproc: int, nofile: int,
            netns: bool, uid: int | None):
    """The function the forked child runs before exec. Order matters: the namespace while still
    privileged, the limits, then the uid (setuid last: nothing after it needs root)."""
    def setup() -> None:
        os.setpgid(0, 0)
        os.umask(0o077)
        if netns:
            _unshare(_netns_flags())
        cpu = max(1, int(cpu_s + 0.999))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft, SIGKILL at the hard
        mem = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        fsize = file_mb << 20
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
    return setup
