"""The built-in Python execution tool: `run_python(code)` runs model-written code in a fresh,
confined subprocess and returns what it printed, as data (SandboxResult) and as the text the
model reads (`SandboxResult.text()`). Nothing the code does raises in the caller: a syntax error,
an exception, a limit reached all come back as the result.

The child is `python -I main.py` in a temporary folder removed afterwards, with a minimal
environment (no variable of the caller's: no tokens, no PYTHON*), under the limits of confine.py
(its own process group, RLIMIT_CPU / AS / FSIZE / NPROC / NOFILE, no core dumps, no network,
an unprivileged uid of its own when the caller is root). The parent reads at most
`output_bytes` of each stream and discards the rest, and kills the whole process group (and,
with a uid of its own, every process of that uid) at the wall limit or when the main process ends.

Without a network namespace (network_mode() == "audit"), an audit hook refuses sockets, name
lookups, new programs (exec, spawn, system) and ctypes' dlopen in the child: that stops
Python-level code, not native code already loaded; docs/tools.md lists what is not protected.
"""

from __future__ import annotations

import dataclasses
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from rlcu.tools.confine import count_processes, kill_uid, network_mode, preexec, sandbox_uid

_AUDIT_BOOT = """\
import sys
_BLOCKED = ("socket.", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen",
            "ctypes.dlopen", "pty.spawn")
def _sandbox_hook(event, args):
    if event.startswith(_BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed (no network, no new programs)")
sys.addaudithook(_sandbox_hook)
del _sandbox_hook
import runpy
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
"""


@dataclasses.dataclass
class SandboxResult:
    """One run. `exit_status` is the child's return code (-N: killed by signal N, None: never
    started); `limit` names the limit that ended it ("wall", "cpu", "memory") or is None;
    `*_truncated` say the stream went past `output_bytes` (the rest was discarded)."""

    stdout: str
    stderr: str
    exit_status: int | None
    limit: str | None
    wall_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    network: str = ""  # "netns" or "audit": how the network was closed
    own_uid: bool = False  # the child ran as a fresh uid (root caller, interpreter others can run)

    @property
    def ok(self) -> bool:
        return self.exit_status == 0 and self.limit is None

    def text(self) -> str:
        """What the model reads: stdout, then stderr, then one bracketed line for anything that
        went wrong (a non-zero status, a limit, a truncated stream)."""
        parts = [self.stdout + ("\n[stdout truncated]" if self.stdout_truncated else "")] if self.stdout else []
        if self.stderr:
            parts.append("stderr:\n" + self.stderr + ("\n[stderr truncated]" if self.stderr_truncated else ""))
        if self.limit is not None:
            parts.append(f"[stopped: {self.limit} limit reached]")
        elif self.exit_status != 0:
            parts.append(f"[exit status {self.exit_status}]")
        return "\n".join(parts) if parts else "[no output]"


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """The defaults of run_python (docs/tools.md): generous for a tool call, small for a host."""

    timeout_s: float = 10.0
    cpu_s: float = 5.0
    memory_mb: int = 1024
    output_bytes: int = 16384
    file_mb: int = 16
    nproc: int = 32
    nofile: int = 64

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not v > 0:
                raise ValueError(f"sandbox limit {f.name} must be > 0, got {v!r}")


DEFAULTS = SandboxLimits()


def run_python(code: str, *, timeout_s: float = DEFAULTS.timeout_s, cpu_s: float = DEFAULTS.cpu_s,
               memory_mb: int = DEFAULTS.memory_mb, output_bytes: int = DEFAULTS.output_bytes,
               file_mb: int = DEFAULTS.file_mb, nproc: int = DEFAULTS.nproc, nofile: int = DEFAULTS.nofile,
               network: str = "auto", python: str = sys.executable) -> SandboxResult:
    """Run `code` in a fresh confined interpreter (see the module docstring) and return its
    output. `network`: "auto" (a network namespace where the kernel allows, else the audit hook)
    or "audit" (the hook even where a namespace is possible)."""
    lim = SandboxLimits(timeout_s, cpu_s, memory_mb, output_bytes, file_mb, nproc, nofile)
    if network not in ("auto", "audit"):
        raise ValueError(f"run_python network must be 'auto' or 'audit', got {network!r}")
    mode = network_mode() if network == "auto" else "audit"
    uid = sandbox_uid(python)
    workdir = tempfile.mkdtemp(prefix="rlcu-sandbox-")
    t0 = time.monotonic()
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        if uid is not None:
            os.chown(workdir, uid, uid)
            os.chown(os.path.join(workdir, "main.py"), uid, uid)
        # RLIMIT_NPROC counts every process of the real uid: a caller who keeps its uid adds its own
        nproc_max = lim.nproc if uid is not None else count_processes(os.getuid()) + lim.nproc
        argv = [python, "-I", "-c", _AUDIT_BOOT] if mode == "audit" else [python, "-I", "main.py"]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
               "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        try:
            proc = subprocess.Popen(
                argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, close_fds=True,
                preexec_fn=preexec(cpu_s=lim.cpu_s, memory_mb=lim.memory_mb, file_mb=lim.file_mb,
                                   nproc=nproc_max, nofile=lim.nofile, netns=mode == "netns", uid=uid))
        except (OSError, subprocess.SubprocessError) as e:
            return SandboxResult("", f"sandbox: could not start python: {e}", None, None,
                                 time.monotonic() - t0, network=mode, own_uid=uid is not None)
        out, err, wall_hit = _collect(proc, lim, uid, t0 + lim.timeout_s)
        status = proc.returncode
        return SandboxResult(out[0], err[0], status, _limit(status, wall_hit, err[0]), time.monotonic() - t0,
                             out[1], err[1], network=mode, own_uid=uid is not None)
    finally:
        if uid is not None:
            kill_uid(uid)
        shutil.rmtree(workdir, ignore_errors=True)


def _limit(status: int | None, wall_hit: bool, stderr: str) -> str | None:
    if wall_hit:
        return "wall"
    if status in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu"  # the soft limit's SIGXCPU, or the hard limit's SIGKILL (only we and it send one)
    if status not in (0, None) and stderr.rstrip().endswith("MemoryError"):
        return "memory"
    return None


def _kill(proc: subprocess.Popen, uid: int | None) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid is not None:
        kill_uid(uid)


def _collect(proc: subprocess.Popen, lim: SandboxLimits, uid: int | None,
             deadline: float) -> tuple[tuple[str, bool], tuple[str, bool], bool]:
    """Read both pipes until they close, keeping `output_bytes` of each; kill everything at the
    deadline, or once the main process has exited (its leftover children would hold the pipes)."""
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    truncated = {proc.stdout: False, proc.stderr: False}
    sel = selectors.DefaultSelector()
    for f in bufs:
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    wall_hit = killed = False
    while sel.get_map():
        now = time.monotonic()
        if not killed and now >= deadline:
            wall_hit = killed = True
            _kill(proc, uid)
        if not killed and proc.poll() is not None:
            killed = True
            _kill(proc, uid)
        elif killed:  # again until the pipes close: a fork bomb's children forked while its group was
            _kill(proc, uid)  # being killed escape one killpg and would hold the pipes past the deadline
        for key, _ in sel.select(timeout=0.05):
            chunk = os.read(key.fileobj.fileno(), 1 << 16)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            buf = bufs[key.fileobj]
            room = lim.output_bytes - len(buf)
            buf += chunk[:max(room, 0)]
            truncated[key.fileobj] |= len(chunk) > room
        if killed and time.monotonic() > deadline + 5.0:
            break  # a descendant we could not kill holds a pipe: stop reading, do not hang
    sel.close()
    if not killed:
        _kill(proc, uid)
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()) + 5.0)
    except subprocess.TimeoutExpired:
        _kill(proc, uid)
        proc.wait(timeout=5.0)
    for f in bufs:
        f.close()

    def text(f) -> tuple[str, bool]:
        return bufs[f].decode("utf-8", errors="replace"), truncated[f]
    return text(proc.stdout), text(proc.stderr), wall_hit


def python(code: str) -> str:
    """Run a Python program in a sandbox (no network, limited time and memory) and return what it printed.

    Args:
        code: A complete Python program; print the values you want to see.
    """
    return run_python(code).text()
