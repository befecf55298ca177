"""A LoRA host's jobs (train/lora_host.py): `HostedJob`, what the host holds of each, and the
checks every job of a host passes before anything runs (`check_jobs`: the refusals the host's
docstring lists, each a ConfigError naming the field and the file)."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

from rlcu.config import ConfigError, GRPOConfig, config_to_dict
from rlcu.train.grpo import GRPOTrainer

BASE_FIELDS = ("path", "revision", "tiny", "init_seed", "dtype", "device")  # model.* that make the base


@dataclasses.dataclass
class HostedJob:
    """One job of a host: its name, config (and the file it came from), trainer, and once it
    ended its exit status, metrics history and error (None when it ran to its end)."""

    name: str
    cfg: GRPOConfig
    source: str | None = None
    trainer: GRPOTrainer | None = None
    status: int | None = None
    error: BaseException | None = None
    history: list = dataclasses.field(default_factory=list)
    pending: tuple | None = None  # ("generate" | "episodes", arguments) it waits on the engine for
    result: object = None
    thread: threading.Thread | None = None
    on_end: object = None  # a joined job's callback, called with the job once it ended (LoraHost.join)

    @property
    def done(self) -> bool:
        return self.status is not None


def _where(job: HostedJob) -> str:
    return job.source or f"job {job.name!r}"


def check_jobs(jobs: list[HostedJob]) -> None:
    """The refusals of the module docstring, each a ConfigError naming the field and the file."""
    first = jobs[0]
    outs = {}
    for job in jobs:
        c = job.cfg
        if not c.lora.enabled:
            raise ConfigError("lora", "must be set in every job of a LoRA host (lora.r > 0 or lora.path): the base "
                                      "is shared and frozen", _where(job))
        for f in BASE_FIELDS:
            if getattr(c.model, f) != getattr(first.cfg.model, f):
                raise ConfigError(f"model.{f}", f"is {getattr(c.model, f)!r}, and {_where(first)} has "
                                                f"{getattr(first.cfg.model, f)!r}: a LoRA host's jobs name one base",
                                  _where(job))
        if c.exact != first.cfg.exact:
            raise ConfigError("exact", f"is {c.exact}, {_where(first)}'s {first.cfg.exact}: the shared engine runs "
                                       f"in one mode", _where(job))
        mine, theirs = config_to_dict(c)["engine"], config_to_dict(first.cfg)["engine"]
        diff = next((k for k in mine if mine[k] != theirs.get(k)), None)
        if diff is not None:
            raise ConfigError(f"engine.{diff}", f"is {mine[diff]!r}, {_where(first)}'s {theirs.get(diff)!r}: the "
                                                f"jobs share one engine", _where(job))
        out = Path(c.log.out_dir).expanduser().resolve()
        if out in outs:
            raise ConfigError("log.out_dir", f"{out} is also {_where(outs[out])}'s: each job needs a run folder "
                                             f"of its own", _where(job))
        outs[out] = job


def job_names(configs: list) -> list[str]:
    """Each config file's stem (a stem two files share gets the file's index), else job<i>."""
    stems = [Path(c).stem if isinstance(c, (str, Path)) else None for c in configs]
    return [f"job{i}" if s is None else s if stems.count(s) == 1 else f"{s}{i}" for i, s in enumerate(stems)]
