"""Experiment trackers behind RunLogger: TensorBoard and Weights & Biases, each through the
field's own package (optional extras: `pip install 'rlcu[tensorboard]'`, `'rlcu[wandb]'`).

TensorBoard goes through `tensorboard.summary.writer.event_file_writer.EventFileWriter`, the
writer torch's `SummaryWriter` wraps, so that neither torch's wrapper nor TensorFlow is needed.
A run keeps one event file: on resume at step s the new file first carries a SessionLog START
at step 0 (readers purge every earlier event from the view, as for torch's `purge_step`), then
the old files' events of steps <= s, copied, and the old files are deleted. So after any number
of resumes the run reads as one uninterrupted run, without duplicate points, in every reader
(and, should the process die between the copy and the deletion, EventAccumulator's purge still
hides the stale files). A fresh run drops an old run's event files, as it starts metrics.jsonl anew.

W&B: one run per out_dir. Its id is kept in `<out_dir>/wandb_run_id`; a resumed run calls
`wandb.init(id=..., resume="allow")` and so continues the same run. The steps that the crashed
process logged after its last checkpoint (metrics.jsonl says which) are not sent again: W&B's
steps only increase, so the run keeps their first values (the same values, the resume being
bit-exact) and the resumed process goes on from the next step, online and offline alike.
"""

from __future__ import annotations

import os
import secrets
import string
from pathlib import Path

WANDB_ID_FILE = "wandb_run_id"
_TB_GLOB = "events.out.tfevents.*"


class TensorBoardTracker:
    """Scalars to `<out_dir>/events.out.tfevents.*` (see the module docstring for resume)."""

    def __init__(self, out_dir, resume_step: int | None = None):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        out_dir = Path(out_dir)
        old = sorted(out_dir.glob(_TB_GLOB))
        self._w = EventFileWriter(str(out_dir))
        self._w.add_event(event_pb2.Event(step=0, session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
        if resume_step is not None:
            for p in old:
                for ev in _read_events(p):
                    if ev.HasField("summary") and ev.step <= resume_step:
                        self._w.add_event(ev)
        self._w.flush()
        for p in old:
            p.unlink(missing_ok=True)

    def log(self, step: int, scalars: dict[str, float], wall_time: float) -> None:
        if not scalars:
            return
        S = self._summary
        summ = S(value=[S.Value(tag=k, simple_value=float(v)) for k, v in scalars.items()])
        self._w.add_event(self._event(wall_time=wall_time, step=int(step), summary=summ))
        self._w.flush()  # a step is seconds of work: keep the file current for a live TensorBoard

    def close(self) -> None:
        self._w.close()


def _read_events(path: Path):
    """The Event protos of one event file, as written (the loader stops at a truncated last
    record, which a killed writer may leave)."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    yield from LegacyEventFileLoader(str(path)).Load()


class WandbTracker:
    """Metrics to a W&B run (mode, key and directory from the usual WANDB_* variables; without
    WANDB_DIR the run's files go under out_dir)."""

    def __init__(self, out_dir, project: str, entity: str | None = None, name: str | None = None,
                 resume_step: int | None = None, run_config: dict | None = None, logged_through: int = 0):
        import wandb

        out_dir = Path(out_dir)
        id_file = out_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resume_step is not None and id_file.exists() else ""
        continuing = bool(run_id)
        if not continuing:
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
            tmp = id_file.with_suffix(".tmp")
            tmp.write_text(run_id + "\n")
            os.replace(tmp, id_file)
        self.run = wandb.init(project=project, entity=entity, name=name or out_dir.resolve().name, id=run_id,
                              resume="allow", config=run_config,
                              dir=None if os.environ.get("WANDB_DIR") else str(out_dir))
        self.id = run_id
        # a continued run has every step up to the previous process's last (online: the server says too)
        self._first = max(int(logged_through) + 1 if continuing else 0, int(getattr(self.run, "step", 0) or 0))

    def log(self, step: int, metrics: dict[str, float], wall_time: float) -> None:
        if step < self._first:
            return  # the run already has this step (logged before the crash)
        self.run.log(dict(metrics), step=int(step))

    def close(self) -> None:
        self.run.finish()


def open_trackers(out_dir, cfg, resume_step: int | None, run_config: dict | None, warn,
                  logged_through: int = 0) -> list:
    """The trackers `cfg` (a LogConfig) asks for. TensorBoard, on by default, is skipped with a
    one-line warning when its package is missing; W&B, asked for explicitly, raises instead.
    `logged_through`: on resume, the last step the previous process logged."""
    out = []
    if cfg.tensorboard:
        try:
            out.append(TensorBoardTracker(out_dir, resume_step))
        except ImportError:
            warn("log.tensorboard is on but the tensorboard package is not installed: no event file "
                 "(pip install 'rlcu[tensorboard]', or set log.tensorboard=false)")
    if getattr(cfg, "wandb", False):
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise RuntimeError("log.wandb is on but the wandb package is not installed "
                               "(pip install 'rlcu[wandb]', or set log.wandb=false)") from None
        out.append(WandbTracker(out_dir, cfg.wandb_project, cfg.wandb_entity, cfg.wandb_name, resume_step,
                                run_config, logged_through if resume_step is not None else 0))
    return out
