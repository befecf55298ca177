"""How many CPU threads torch uses in one process (`model.threads`; the demo's `threads`).

torch sizes its intra-op pool to the machine's physical cores, whatever this process may
use: under taskset, a container's CPU quota, torchrun's several ranks or a scheduler's CPU
slot its threads then outnumber the cores. OpenMP's threads spin at every barrier, so one
thread without a core of its own stalls each op for a time slice: 20 tiny GRPO steps beside
busy processes on 2 cores took 366 s at torch's default of 2 threads, 25 s on auto's one.
`choose` picks the count from what the process may use, first match:

    model.threads: N                 N
    OMP_NUM_THREADS set              that (an explicit choice; torchrun sets 1 for each of
                                     several ranks when it is not set)
    auto                             min(cores available x share, cores idle) / local ranks,
                                     at least 1

The cores available are the physical cores among the CPUs of the affinity mask
(os.sched_getaffinity), capped by the cgroup's CPU quota (cgroup v2 `cpu.max` of the
process's group and its parents, v1 `cpu.cfs_quota_us`); `share` is a scheduled job's part of
the machine (its CPU slots over the pool's, rlcu.sched.job); the cores idle are those of the
affinity mask left idle by other processes over 0.2 s (/proc/stat), so a run started beside
busy ones takes what they leave; local ranks are torchrun's LOCAL_WORLD_SIZE (its ranks
start together and see the same idle cores). The command lines `apply` it before any work; a
library caller owns its process's threads (a trainer applies only an explicit
`model.threads`, or on resume the count its checkpoint's run used). The inter-op pool is set
to one thread, once: rlcu runs no inter-op parallel work, and that pool, sized to the
machine too, would only compete.

CPU results depend on the count (a reduction is split by thread), so a run on the CPU records
the count it ran with as `model.threads`: a resume under `auto` goes on with that count, and
one given another count is a config change (rlcu.train.core, rlcu.train.resume).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
_last: tuple[int, str] | None = None  # the latest apply's (count, why), for the run's log
_interop_set = False


def parse_setting(v, what: str = "model.threads"):
    """'auto' or an integer >= 1 (a YAML int or its string); ValueError naming `what` otherwise."""
    if isinstance(v, str) and v.strip().lower() == "auto":
        return "auto"
    try:
        n = int(v) if not isinstance(v, bool) and (not isinstance(v, float) or v.is_integer()) else None
    except (TypeError, ValueError):
        n = None
    if n is None or n < 1:
        raise ValueError(f"{what} must be 'auto' or a number of threads >= 1, got {v!r}")
    return n


def physical_cores(cpus, sysfs: Path = Path("/sys/devices/system/cpu")) -> int:
    """The physical cores among the logical CPUs `cpus` (hyper-threads of one core count
    once, as torch's default does); len(cpus) where the topology cannot be read."""
    cores = set()
    try:
        for c in cpus:
            top = sysfs / f"cpu{c}" / "topology"
            cores.add(((top / "physical_package_id").read_text().strip(), (top / "core_id").read_text().strip()))
    except OSError:
        return len(cpus)
    return len(cores) or len(cpus)


def _quota_v2(text: str) -> float | None:
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    return int(parts[0]) / int(parts[1])


def cgroup_cpus(root: Path = CGROUP, proc: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPUs the process's cgroup quota allows (e.g. 1.5), or None when unlimited or unknown.
    v2: the tightest `cpu.max` from the process's group up to the root; v1: the cpu
    controller's cfs quota over its period."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        lines = []
    found = []
    for line in lines:
        _, ctrl, path = (line.split(":", 2) + ["", ""])[:3]
        rel = path.strip().lstrip("/")
        if ctrl == "":  # v2: the unified hierarchy
            d = root / rel if rel else root
            while True:
                try:
                    q = _quota_v2((d / "cpu.max").read_text())
                except (OSError, ValueError, ZeroDivisionError):
                    q = None
                if q is not None:
                    found.append(q)
                if d == root or root not in d.parents:
                    break
                d = d.parent
        elif "cpu" in ctrl.split(","):  # v1 (a container sees its own group at the mount's root)
            for d in (root / ctrl / rel, root / ctrl, root / "cpu"):
                try:
                    q, p = (int((d / f).read_text()) for f in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
                except (OSError, ValueError):
                    continue
                if q > 0 and p > 0:
                    found.append(q / p)
                break
    return min(found) if found else None


def available_cores() -> int:
    """The cores this process may use: the physical cores of its affinity mask, capped by
    its cgroup's CPU quota (rounded down, at least 1)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    n = physical_cores(cpus)
    q = cgroup_cpus()
    if q is not None:
        n = min(n, max(1, math.floor(q + 1e-9)))
    return max(1, n)


def idle_between(before: str, after: str, cpus) -> float | None:
    """The CPUs of `cpus` left idle between two readings of /proc/stat (idle + iowait time over
    all time, per CPU, summed); None when the readings name none of them."""
    def per_cpu(text: str) -> dict[int, tuple[int, int]]:
        out = {}
        for line in text.splitlines():
            f = line.split()
            if f and f[0].startswith("cpu") and f[0][3:].isdigit():
                t = [int(x) for x in f[1:9]]  # user nice system idle iowait irq softirq steal
                out[int(f[0][3:])] = (t[3] + t[4], sum(t))
        return out

    a, b = per_cpu(before), per_cpu(after)
    got = [c for c in cpus if c in a and c in b]
    if not got:
        return None
    idle = 0.0
    for c in got:
        di, dt = b[c][0] - a[c][0], b[c][1] - a[c][1]
        idle += di / dt if dt > 0 else 1.0
    return idle


def idle_cores(sample_s: float = 0.2, stat: Path = Path("/proc/stat")) -> float | None:
    """The CPUs of the affinity mask other processes leave idle, over `sample_s` seconds;
    None where /proc/stat cannot be read."""
    import time

    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        before = stat.read_text()
        time.sleep(sample_s)
        after = stat.read_text()
    except OSError:
        return None
    return idle_between(before, after, os.sched_getaffinity(0))


def _env_int(env, name: str) -> int | None:
    v = env.get(name, "").strip().split(",")[0]  # (OMP_NUM_THREADS may list nested levels: the first)
    try:
        n = int(v)
    except ValueError:
        return None
    return n if n >= 1 else None


def choose(setting="auto", share: float = 1.0, env=None) -> tuple[int, str]:
    """(threads, why) for one process; see the module docstring. `share` in (0, 1]: this
    process's part of the machine (a scheduled job's CPU slots over the pool's)."""
    env = os.environ if env is None else env
    setting = parse_setting(setting)
    if setting != "auto":
        return setting, "model.threads"
    omp = _env_int(env, "OMP_NUM_THREADS")
    if omp is not None:
        return omp, "OMP_NUM_THREADS"
    cores = available_cores()
    room = cores * share
    why = f"auto: {cores} cores available"
    if share < 1.0:
        why += f" x {share:.3g} (this job's CPU slots of the scheduler's pool)"
    idle = idle_cores()
    if idle is not None and idle < room - 0.5:  # other processes hold some: threads beyond the idle ones stall
        room = max(1.0, float(round(idle)))
        why += f", {idle:.1f} idle"
    local = _env_int(env, "LOCAL_WORLD_SIZE") or 1
    if local > 1:
        why += f" / {local} local ranks"
    return max(1, math.floor(room / local + 1e-9)), why


def apply(setting="auto", share: float = 1.0, env=None) -> int:
    """Set torch's intra-op threads to `choose(...)` (and the inter-op pool to one, once);
    returns the count."""
    global _last, _interop_set
    import torch

    n, why = choose(setting, share, env)
    torch.set_num_threads(n)
    if not _interop_set:
        _interop_set = True
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass  # inter-op work already ran in this process: its pool stays as it is
    _last = (n, why)
    return n


def describe() -> str:
    """One line for a run's log: the threads torch uses now, and why."""
    import torch

    n = torch.get_num_threads()
    why = _last[1] if _last is not None and _last[0] == n else "as the process had them"
    return f"CPU threads: {n} ({why})"


def record(model_cfg, device) -> str:
    """A run on the CPU records the count it runs with as model.threads (in its config.yaml
    and checkpoints), so that a resume with another count is a config change; returns the
    line for its log."""
    import torch

    if torch.device(device).type == "cpu":
        model_cfg.threads = torch.get_num_threads()
    return describe()


def keep_on_resume(model_cfg, setting, state: dict, path) -> str | None:
    """Under `auto` (`setting`, the run's model.threads as given) a CPU run resumes on the
    count its checkpoint's run recorded (trainer_state.json's config), so that it goes on
    exactly; returns the line for the log, or None when nothing changed."""
    saved = ((state.get("config") or {}).get("model") or {}).get("threads")
    now = model_cfg.threads  # an int on the CPU (record)
    if setting != "auto" or not isinstance(saved, int) or not isinstance(now, int) or saved == now:
        return None
    model_cfg.threads = apply(saved)
    cores = available_cores()
    more = f" (more than the {cores} cores available here)" if saved > cores else ""
    return (f"CPU threads: {saved}, as the run of {Path(path).name} used{more} (model.threads: auto; give a "
            f"count and --allow-config-change to change it)")
