"""The trainer core SFT, GRPO and PPO share; what differs between them is the step.

`Trainer` owns the run: the config (one coercion, `coerce_config`), the run folder (a fresh
run never writes into a folder that holds another run, `run_dir`), resume (with the checks of
`rlcu.train.resume`: the checkpoint's kind, its model, the settings that changed), the
logger, the step loop and its cadences (a baseline evaluation at step 0, evaluation every
`eval_every` steps and after the last, checkpoints every `checkpoint.every` steps and at the
end), non-finite handling (skipped steps are the optimizer's; after too many the loop saves
the state only if its weights are finite) and signals (`rlcu.train.signals`: the first
SIGTERM/SIGINT finishes the step in flight, checkpoints and stops; a second exits at once).

A subclass implements `train_step(step) -> metrics` and the few methods that say what its
state is (`_trainer_state`, `_load_state`, `_checkpoint_objects`, `_finite_tensors`,
`eval_metrics`). Whoever drives a trainer from outside (the job scheduler) does it through
`Hooks`: the trainer calls `hooks.phase(name)` around each phase of a step ("rollout",
"ref_logprobs", "actor_train", "critic_train", "eval") and hands `hooks.yield_check` /
`hooks.on_yield` / `hooks.on_generate_done` to the engine's generate when `hooks.preemptible`;
the defaults do nothing.
"""

from __future__ import annotations

import abc
import contextlib
import math
import signal
from pathlib import Path

import torch

from rlcu import threads
from rlcu.config import ConfigError, config_from_dict, config_to_dict, load_config, save_config
from rlcu.data.tokenizer import Tokenizer
from rlcu.errors import NO_SPACE_STATUS, NonFiniteError, SetupError, no_space
from rlcu.hub import TOKENIZER_FILES, model_folder
from rlcu.parallel.comm import barrier, print_once, world
from rlcu.rewards import RewardsFailed
from rlcu.train import resume as rs
from rlcu.train import run_dir, sizing
from rlcu.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from rlcu.train.logging import run_logger
from rlcu.train.lora import LoraCheckpoint, attach_lora, save_final
from rlcu.train.signals import SignalGuard


class TrainingInterrupted(Exception):
    """The run stopped on a signal after checkpointing; `signum`, `checkpoint` (a Path)."""

    def __init__(self, signum: int, checkpoint: Path | None, step: int):
        self.signum, self.checkpoint, self.step = signum, checkpoint, step
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name} after step {step}; checkpoint: {checkpoint}")


class TrainingStopped(Exception):
    """The run's driver asked it to stop (`hooks.stop_reason()`, e.g. the scheduler's cancel);
    it stopped as on SIGTERM, after the step in flight and a checkpoint; `reason`,
    `checkpoint` (a Path), `step`."""

    def __init__(self, reason: str, checkpoint: Path | None, step: int):
        self.reason, self.checkpoint, self.step = reason, checkpoint, step
        super().__init__(f"{reason}: stopped after step {step}; checkpoint: {checkpoint}")


def coerce_config(cls, config):
    """A `cls` from None (the defaults), a `cls`, a dict (checked as YAML is) or a YAML path."""
    if config is None:
        return cls()
    if isinstance(config, cls):
        return config
    if isinstance(config, dict):
        return config_from_dict(cls, config)
    if isinstance(config, (str, Path)):
        return load_config(cls, config)
    raise TypeError(f"config must be a {cls.__name__}, a dict or a YAML path, got {type(config).__name__}")


def load_tokenizer(model_cfg, need: str):
    """The tokenizer of a run: model.tokenizer (a folder, or a tokenizer.json whose
    tokenizer_config.json and chat template beside it are read too), else model.path; either
    may be a Hugging Face Hub id (model.revision applies to model.path's)."""
    src = model_cfg.tokenizer or model_cfg.path
    if src is None:
        raise ValueError(f"{need} need a tokenizer: pass tokenizer= to the trainer, or set model.tokenizer "
                         f"(a folder or a tokenizer.json) or model.path")
    if not Path(src).expanduser().exists():  # a Hub id: fetched here, so that an error names the field
        field, rev = ("model.tokenizer", None) if model_cfg.tokenizer else ("model.path", model_cfg.revision)
        src = model_folder(src, rev, field, TOKENIZER_FILES)
    return Tokenizer.from_pretrained(src)


class Hooks:
    """What a driver outside the trainer may observe and steer; every default does nothing.
    phase(name, **info): a context manager around one phase of a step (info: e.g. work, the
    tokens a rollout may generate). preemptible: when true, generate calls pass
    yield_check() (asked between engine steps: give the device back now?) and
    on_yield(tokens_left) (returns when the rollout may go on) to the engine, and
    on_generate_done() (once that generate's steps are done: where the ranks of a job that
    yield together wait for each other). metrics(): extra metrics merged into each step's.
    stop_reason(): asked before each step (on every rank at the same step); a reason stops the
    run as SIGTERM does (TrainingStopped)."""

    preemptible = False

    @contextlib.contextmanager
    def phase(self, name: str, **info):
        yield

    def yield_check(self) -> bool:
        return False

    def on_yield(self, tokens_left: int) -> None:
        pass

    def on_generate_done(self) -> None:
        pass

    def metrics(self) -> dict:
        return {}

    def stop_reason(self) -> str | None:
        return None


class Trainer(abc.ABC):
    """The run around a step; see the module docstring. Subclasses set `config_cls` and
    `kind` and call `super().__init__(config, hooks)` first."""

    config_cls: type = None
    kind = "trainer"

    def __init__(self, config, hooks: Hooks | None = None):
        self.cfg = cfg = coerce_config(self.config_cls, config)
        self.hooks = hooks if hooks is not None else Hooks()
        self._threads_setting = cfg.model.threads
        if cfg.model.threads != "auto":  # (auto: the command line chose; a library caller owns its threads)
            threads.apply(cfg.model.threads)
        torch.manual_seed(cfg.seed)
        self.out_dir = Path(cfg.log.out_dir)
        self.ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.out_dir / "checkpoints"
        self.step = 0
        self.history: list[dict] = []
        self.logger = None
        self.last_checkpoint: Path | None = None
        self.resumed_from: Path | None = None
        self._notes: list[str] = []  # lines for the log once it is open

    # ---------------------------------------------------------------- what a subclass says
    @abc.abstractmethod
    def train_step(self, step: int) -> dict:
        """One step (0-based `step`); returns its metrics."""

    def eval_metrics(self) -> dict:
        """Metrics of one evaluation ({} when there is nothing to evaluate)."""
        return {}

    @property
    def has_eval(self) -> bool:
        return False

    def _trainer_state(self) -> dict:
        """JSON state saved in trainer_state.json beside 'step', 'trainer' and 'config'."""
        return {"metrics_tail": self.history[-20:]}

    def _load_state(self, state: dict) -> None:
        self.history = list(state.get("metrics_tail", []))

    @abc.abstractmethod
    def _checkpoint_objects(self, loading: bool = False) -> tuple:
        """(model, optimizer, {name: object with state_dict()}) of a checkpoint."""

    def _finite_tensors(self) -> list[torch.Tensor]:
        """The tensors that must be finite for a state to be worth saving (weights, masters)."""
        model, opt, extra = self._checkpoint_objects()
        out = [model.flat]
        if opt is not None and getattr(opt, "master", None) is not None:
            out.append(opt.master)
        return out

    def _start_message(self) -> str:
        return f"{self.kind}: {self.step} of {self.cfg.steps} steps done"

    # ---------------------------------------------------------------- LoRA (rlcu.train.lora)
    def _refuse_unfit(self, model=None) -> None:
        """Full fine-tuning that does not fit the device, refused before the model is built or
        the optimizer made (rlcu.train.sizing.refuse_unfit); `model`: one given, already built."""
        sizing.refuse_unfit(self.cfg, world().size, model_cfg=None if model is None else model.cfg,
                            device=None if model is None else model.device.type)

    def _attach_lora(self, model):
        """The run's `lora:` adapters attached to `model`; returns what its optimizer trains:
        the adapters (the base frozen), else the model itself."""
        ad = attach_lora(model, self.cfg.lora)
        return model if ad is None else ad

    def _ckpt_model(self, model):
        """What a checkpoint saves in the model's place: a LoRA run's adapters, else the model."""
        return model if model.lora is None else LoraCheckpoint(model, self.cfg.model.path)

    def _trainable_note(self, model) -> str:
        if model.lora is None:
            return f"{model.num_params():,} parameters"
        ad = model.lora
        return (f"{model.num_params():,} parameters frozen, LoRA r={ad.cfg.r} over "
                f"{', '.join(ad.cfg.target_modules)}: {ad.num_params():,} trained")

    # ---------------------------------------------------------------- checkpoints
    def _log_info(self, msg: str) -> None:
        if self.logger is not None:
            self.logger.info(msg)
        else:
            self._notes.append(msg)

    def _warn(self, msg: str) -> None:
        if self.logger is not None:
            self.logger.warn(msg)

    def save(self) -> Path:
        model, opt, extra = self._checkpoint_objects()
        state = {**self._trainer_state(), "trainer": self.kind, "config": config_to_dict(self.cfg)}
        if getattr(model, "ad", None) is not None:  # the dropout masks' count (the next forward's seed)
            state["lora_forwards"] = model.ad._forwards
        self.last_checkpoint = save_checkpoint(self.ckpt_root, self.step, model, opt, state,
                                               self.cfg.checkpoint.keep_last, extra=extra,
                                               tokenizer=getattr(self, "tokenizer", None))
        self._log_info(f"checkpoint: {self.last_checkpoint}")
        return self.last_checkpoint

    def resume(self, path=None) -> int:
        """Load a checkpoint (`path`, else checkpoint.resume: 'auto' or a folder) after checking
        that it fits this run (rlcu.train.resume); returns its step (0: nothing to resume)."""
        p = rs.resolve(path or self.cfg.checkpoint.resume, self.ckpt_root)
        if p is None:
            return 0
        state = rs.read_state(p)
        kept = threads.keep_on_resume(self.cfg.model, self._threads_setting, state, p)  # auto: the run's own count
        if kept:
            self._log_info(kept)
        model, opt, extra = self._checkpoint_objects(loading=True)
        rs.check_kind(p, state, self.kind)
        rs.check_model(p, model)
        self._config_changes = rs.check_config(p, state, self.cfg, self._log_info)
        try:
            state = load_checkpoint(p, model, opt, extra=extra)
        except (ValueError, FileNotFoundError) as e:
            raise SetupError(f"checkpoint {p} does not fit this run: {e}") from None
        self.step = int(state["step"])
        if "lora_forwards" in state:
            model.ad._forwards = int(state["lora_forwards"])
        self._load_state(state)
        self.resumed_from = p
        return self.step

    # ---------------------------------------------------------------- the loop
    def _open_run(self) -> bool:
        """Resume or claim the run folder, open the log, write the config; True if resumed."""
        c = self.cfg
        self._config_changes = {}
        self._record_threads()
        resumed = bool(c.checkpoint.resume) and self.resume() > 0
        main = world().is_main  # across ranks, rank 0 alone owns the run folder
        if main:
            run_dir.check_writable(self.out_dir, self.ckpt_root)
        if not resumed and main:
            cleared = run_dir.claim(self.out_dir, self.ckpt_root, overwrite=c.log.overwrite,
                                    auto=c.checkpoint.resume == "auto")
            if cleared:
                self._notes.insert(0, f"{self.out_dir}: replaced the earlier run ({cleared})")
        barrier()  # no rank writes into the folder before rank 0 has claimed it
        self.logger = run_logger(self.out_dir, c.log, c.steps, resume_step=self.step if resumed else None,
                                 run_config=config_to_dict(c))
        if main and not resumed:
            save_config(c, self.out_dir / "config.yaml")  # a resumed run keeps the one it started with
        elif main and self._config_changes:
            save_config(c, self.out_dir / f"config.resume-step-{self.step:06d}.yaml")
        if resumed:
            self.logger.info(f"resumed from {self.resumed_from} at step {self.step}")
        elif c.checkpoint.resume == "auto":
            self.logger.info(f"no checkpoint under {self.ckpt_root}: starting from scratch")
        for n in self._notes:
            self.logger.info(n)
        self._notes = []
        self.logger.info(self._start_message())
        self._log_estimate()
        return resumed

    def _record_threads(self) -> None:
        """CPU results depend on the thread count: a CPU run records it (rlcu.threads.record)."""
        self._notes.append(threads.record(self.cfg.model, getattr(self, "device", "cpu")))

    def _log_estimate(self) -> None:
        """The per-rank memory estimate (rlcu.train.sizing.log_estimate); nothing by default."""
        return None

    def _record(self, step: int, m: dict) -> None:
        m.update(self.hooks.metrics())
        self.history.append({"step": step, **m})
        self.logger.log(step, m)

    def _abort_nonfinite(self, e) -> None:
        """Too many non-finite steps in a row: save the state only if it is finite."""
        self.step += 1
        self.logger.log(self.step, e.info)
        if self._state_finite():
            ck = self.save()  # the skipped steps changed nothing: this is the last good state
            raise RuntimeError(f"{e} The last good state is saved in {ck}.") from e
        prev = latest_checkpoint(self.ckpt_root)
        where = (f"the last checkpoint is {prev}" if prev is not None
                 else "no checkpoint was written before")
        raise RuntimeError(f"{e} The weights are not finite, so nothing was saved; {where}.") from e

    def _state_finite(self) -> bool:
        return all(bool(torch.isfinite(t).all()) for t in self._finite_tensors())

    def _save_if_finite(self) -> Path | None:
        """A checkpoint, unless the weights are not finite (a NaN state is worth nothing and
        keep_last would prune good checkpoints for it)."""
        if self._state_finite():
            return self.save()
        self._warn(f"step {self.step}: the weights are not finite: no checkpoint written")
        return None

    def _eval_due(self) -> bool:
        c = self.cfg
        return self.has_eval and ((c.eval_every and self.step % c.eval_every == 0) or self.step == c.steps)

    def train(self, until: int | None = None):
        """Run to `config.steps` (or stop after step `until`, checkpointing there). Returns
        `self._result()` (the per-step metrics, or the last step's for SFT)."""
        c = self.cfg
        resumed = self._open_run()
        lg = self.logger
        end = c.steps if until is None else min(until, c.steps)
        start, saved_at, stop = self.step, None, None
        stop_reason = getattr(self.hooks, "stop_reason", lambda: None)  # (hooks written before it: none)
        try:
            with SignalGuard() as sig:
                if not resumed and self.has_eval:
                    self._record(0, self.eval_metrics())  # the baseline, before any update
                while self.step < end and not (stop := stop_reason()) and not sig.signum:
                    try:
                        m = self.train_step(self.step)
                    except NonFiniteError as e:
                        self._abort_nonfinite(e)
                    except RewardsFailed as e:  # the run stops (exit 1); the log says why, the state is kept
                        lg.warn(f"step {self.step + 1}: {e}")
                        if self.step > start and saved_at != self.step:
                            self._save_if_finite()  # the steps done so far, for a resume once it is fixed
                        raise
                    self.step += 1
                    if m.get("skipped") and "grad_norm" in m:
                        lg.warn(f"step {self.step}: non-finite loss ({m.get('loss')}) or gradient norm "
                                f"({m['grad_norm']}): update skipped ({m.get('nonfinite_in_row', 1)} in a row)")
                    if self._eval_due():
                        m.update(self.eval_metrics())
                    self._record(self.step, m)
                    if c.checkpoint.every and self.step % c.checkpoint.every == 0:
                        self._save_if_finite()
                        saved_at = self.step
                if (sig.signum or stop) and self.step < end:
                    why = f"received {sig.name}" if sig.signum else stop
                    lg.warn(f"{why} during step {self.step}: the step finished; checkpointing")
                    ck = self.last_checkpoint if saved_at == self.step else self._save_if_finite()
                    if sig.signum:
                        raise TrainingInterrupted(sig.signum, ck, self.step)
                    raise TrainingStopped(stop, ck, self.step)
            if self.step > start and saved_at != self.step and (c.checkpoint.save_at_end or self.step < c.steps):
                self._save_if_finite()
            self._save_adapter(start)
        finally:
            lg.close()
        return self._result()

    def _save_adapter(self, start: int) -> None:
        """A LoRA run's adapters as a PEFT folder under log.out_dir once it trained (finite only)."""
        model = getattr(self, "model", None)
        if model is None or model.lora is None or self.step == start or not world().is_main:
            return
        if self._state_finite():
            self.logger.info(f"LoRA adapter: {save_final(model, self.out_dir, self.cfg.model.path)}")

    def _result(self):
        return self.history


def exit_status(prog: str, fn, *args, **kw) -> int:
    """fn(*args, **kw) for a command line, its end as an exit status with the reason on one
    line of stderr: fn's own status when it returns an int, else 0; 1 a run stopped by failing
    rewards or by non-finite steps (after its checkpoint); 2 a run that cannot start as asked;
    NO_SPACE_STATUS a write of the run failed for want of disk space (the last checkpoint
    intact); 128 + N stopped by signal N (after its checkpoint). Anything else propagates."""
    try:
        rc = fn(*args, **kw)
    except (SetupError, ConfigError) as e:
        status, why = 2, e
    except OSError as e:
        if not no_space(e):
            raise
        status, why = NO_SPACE_STATUS, e.strerror + (f": {e.filename}" if e.filename else "")
    except TrainingInterrupted as e:
        status, why = 128 + e.signum, e
    except RewardsFailed as e:
        status, why = 1, e
    except RuntimeError as e:
        if not isinstance(e.__cause__, NonFiniteError):
            raise
        status, why = 1, e  # a clean abort, with its checkpoint
    else:
        return rc if isinstance(rc, int) and not isinstance(rc, bool) else 0
    print_once(f"{prog}: {why}")  # under torchrun: once, not once a rank
    return status


def nanmean(x) -> float:
    t = torch.as_tensor(x, dtype=torch.float64)
    ok = ~torch.isnan(t)
    return float(t[ok].mean()) if ok.any() else math.nan
