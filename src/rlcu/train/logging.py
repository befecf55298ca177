"""Run logging: metrics.jsonl, log.txt, the console (a live progress bar on a terminal, one
line per logged step elsewhere), the trackers (TensorBoard, W&B: rlcu.train.trackers) and, at
the end, a PNG of the main curves (the reward, else the loss), each held-out curve beside its
training curve in the same colour, the legend outside the axes.

Every `cfg.every` steps (and at the last step) one JSON object per line goes to
metrics.jsonl ({"step": s, **metrics}, floats written with full precision so runs can be
compared bit for bit), one `STEP` line to log.txt, and the numeric metrics to the trackers.
On resume the rows after the checkpoint's step are dropped, so the file reads as one
uninterrupted run (the trackers do the same: see rlcu.train.trackers).

The console: on a terminal a rich progress bar (step n/N, elapsed, ETA, then the metrics, which
are what a narrow terminal cuts); when the output is not a terminal (a pipe, a file, a batch
job's log) no live display, whose redraws would land as stray lines, and no wrapping at 80
columns: one plain line per logged step instead. Both show the loss and the total reward first. matplotlib is optional:
without it the PNG is skipped with a log line.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from rlcu.config import LogConfig
from rlcu.files import disk_error
from rlcu.parallel.comm import world
from rlcu.train.trackers import open_trackers


def _num(v):
    """A metric as a JSON/TensorBoard number, or None when it is not numeric."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, float)):
        return v
    if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
        return v.item()
    return None


def _clock(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _bar_columns() -> list:
    """The live bar's columns: name, bar, step n/N, elapsed, ETA, then the metrics. A terminal
    too narrow for all of it cuts the metrics (with an ellipsis), never the step count or the
    clocks: rich's table first shrinks the columns that may wrap, so only the bar and the
    metrics may, and the metrics' text itself never wraps to a second line."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.table import Column
    from rich.text import Text

    class Metrics(ProgressColumn):
        def render(self, task) -> Text:
            return Text(task.fields.get("metrics", ""), no_wrap=True, overflow="ellipsis")

    def fixed():
        return Column(no_wrap=True)

    return [TextColumn("[bold]{task.description}", table_column=fixed()),
            BarColumn(bar_width=20, table_column=Column(no_wrap=False)),
            MofNCompleteColumn(table_column=fixed()), TimeElapsedColumn(table_column=fixed()),
            TimeRemainingColumn(table_column=fixed()), Metrics(table_column=Column(no_wrap=False))]


def _append(fh, text: str) -> None:
    """text to an open file, flushed; a full disk says so with the file's path (one line,
    exit status rlcu.errors.NO_SPACE_STATUS on the command line)."""
    try:
        fh.write(text)
        fh.flush()
    except OSError as e:
        err = disk_error(e, fh.name)
        if err is e:
            raise
        raise err from e


def _close(fh) -> None:
    try:
        fh.close()
    except OSError:
        pass  # a flush that failed already raised when the text was written (_append)


class RunLogger:
    """`run_config` (the run's whole config as plain data) goes to W&B as the run's config.
    `console`: a rich Console for the messages and the bar (default: stderr's)."""

    def __init__(self, out_dir, cfg: LogConfig | None = None, total_steps: int | None = None, *,
                 resume_step: int | None = None, run_config: dict | None = None, console=None):
        self.cfg = cfg or LogConfig()
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.history: list[dict] = []
        logged_through = 0  # the last step the previous process logged (past the checkpoint: lost)
        if resume_step is not None and self.metrics_path.exists():
            for line in self.metrics_path.read_text().splitlines():
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:  # a line torn by a kill mid-write
                        continue
                    logged_through = max(logged_through, int(row.get("step", 0)))
                    if row.get("step", 0) <= resume_step:
                        self.history.append(row)
        self._jsonl = open(self.metrics_path, "w")
        for row in self.history:
            self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        self._log_txt = open(self.out_dir / "log.txt", "a")
        self._closed = False
        if console is None:
            from rich.console import Console

            console = Console(stderr=True)
            if not console.is_terminal:
                console = Console(stderr=True, soft_wrap=True)  # no wrapping of long lines in a log file
        self.console = console
        self._t0, self._step0 = time.perf_counter(), resume_step or 0
        self._progress = None
        if self.cfg.progress and self.console.is_terminal:
            from rich.progress import Progress

            self._progress = Progress(*_bar_columns(), console=self.console, transient=False)
            self._progress.start()
            self._task = self._progress.add_task("train", total=total_steps, metrics="",
                                                 completed=resume_step or 0)
        try:
            self.trackers = open_trackers(self.out_dir, self.cfg, resume_step, run_config, self.warn,
                                          logged_through)
        except BaseException:
            self.close(plot=False)
            raise

    # ---------------------------------------------------------------- messages
    def _write_txt(self, level: str, msg: str) -> None:
        _append(self._log_txt, f"{time.strftime('%Y-%m-%d %H:%M:%S')} {level} {msg}\n")

    def info(self, msg: str) -> None:
        self._write_txt("INFO", msg)
        self.console.print(msg, highlight=False, markup=False)

    def warn(self, msg: str) -> None:
        self._write_txt("WARN", msg)
        self.console.print(f"warning: {msg}", style="yellow", highlight=False, markup=False)

    # ---------------------------------------------------------------- metrics
    def log(self, step: int, metrics: dict) -> None:
        """Record one step's metrics (numbers or 0-d tensors; other values go to JSONL only)."""
        due = step % self.cfg.every == 0 or (self.total_steps is not None and step >= self.total_steps)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, metrics=self._short(metrics))
        if not due:
            return
        row = {"step": int(step)}
        for k, v in metrics.items():
            n = _num(v)
            row[k] = n if n is not None else v
        self.history.append(row)
        _append(self._jsonl, json.dumps(row) + "\n")
        scalars = {k: float(v) for k, v in row.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        now = time.time()
        for t in self.trackers:
            t.log(step, scalars, now)
        head = f"step {step}/{self.total_steps}" if self.total_steps else f"step {step}"
        self._write_txt("STEP", f"{head}  " + "  ".join(f"{k} {v:.6g}" for k, v in scalars.items()))
        if self._progress is None:
            self.console.print(f"{head}  {self._short(metrics)}{self._eta(step)}", highlight=False, markup=False)

    def _eta(self, step: int) -> str:
        done, dt = step - self._step0, time.perf_counter() - self._t0
        if not self.total_steps or done <= 0:
            return ""
        left = max(self.total_steps - step, 0) * dt / done
        return f"  [{_clock(dt)} elapsed, {_clock(left)} left]"

    @staticmethod
    def _short(metrics: dict, n: int = 5, first=("loss", "reward", "eval/loss", "eval/reward"),
               pinned=("mismatch/abs_mean", "mismatch/exact_frac")) -> str:
        """The `first` metrics present (the total reward and the loss, wherever a step put them:
        PPO's come after the per-function rewards and the lengths), the next numeric ones up to
        n, then the `pinned` ones present (the RL steps' mismatch)."""
        nums = {k: x for k, v in metrics.items() if (x := _num(v)) is not None and not isinstance(x, bool)}
        keys = [k for k in first if k in nums] + [k for k in nums if k not in first]
        shown = keys[:n] + [k for k in pinned if k in keys[n:]]
        return "  ".join(f"{k} {nums[k]:.4g}" if isinstance(nums[k], float) else f"{k} {nums[k]}" for k in shown)

    # ---------------------------------------------------------------- end
    def _plot_keys(self) -> list[str]:
        """log.plot_keys, else the training reward (the total and each function's), else the
        loss; then each one's held-out counterpart (eval/...) where the run evaluated."""
        if self.cfg.plot_keys:
            return list(self.cfg.plot_keys)
        seen = list(dict.fromkeys(k for row in self.history for k in row))
        train = ([k for k in ("reward",) if k in seen] + [k for k in seen if k.startswith("reward/")]
                 or [k for k in ("loss",) if k in seen])
        return train + [f"eval/{k}" for k in train if f"eval/{k}" in seen]

    @staticmethod
    def plot_name(keys: list[str]) -> str:
        """The PNG is named for what it shows: reward_curve.png when a reward is drawn,
        loss_curve.png for losses only (an SFT run), else curves.png."""
        if any(k.startswith("reward") for k in keys):
            return "reward_curve.png"
        if keys and all("loss" in k for k in keys):
            return "loss_curve.png"
        return "curves.png"

    def plot(self, path=None) -> Path | None:
        """Write the reward curves (or the loss when there is no reward) to a PNG: each training
        curve with its held-out one beside it in the same colour (dashed, a dot per evaluation),
        the legend outside the axes so that it never hides a line."""
        keys = self._plot_keys()
        curves = {k: pts for k in keys if (pts := [(r["step"], r[k]) for r in self.history
                                                   if isinstance(r.get(k), (int, float)) and math.isfinite(r[k])])}
        if not curves:
            return None
        path = Path(path) if path else self.out_dir / self.plot_name(keys)
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            self.info(f"matplotlib is not installed: skipping {path.name} (pip install matplotlib)")
            return None
        fig, ax = plt.subplots(figsize=(8, 4), layout="constrained")
        colour = {}
        for k, pts in curves.items():
            base = k.removeprefix("eval/")
            c = colour.setdefault(base, f"C{len(colour) % 10}")
            held = k.startswith("eval/")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o--" if held else "-", color=c, markersize=4,
                    label=f"{k} (held out)" if held else k)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        fig.legend(loc="outside right upper", fontsize=8)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def close(self, plot: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        if self._progress is not None:
            self._progress.stop()
        for t in getattr(self, "trackers", []):
            t.close()
        _close(self._jsonl)
        if plot and self.cfg.plot:
            self.plot()
        _close(self._log_txt)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class NullLogger:
    """RunLogger's interface doing nothing: the logger of every rank but rank 0."""

    def __init__(self):
        self.history: list = []

    def info(self, *a, **k):
        pass

    warn = log = close = info


def run_logger(*args, **kw):
    """RunLogger(*args, **kw) on rank 0, a NullLogger elsewhere (metrics and logs written once)."""
    return RunLogger(*args, **kw) if world().is_main else NullLogger()
