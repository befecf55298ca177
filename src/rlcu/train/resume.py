"""What resume checks before it loads a checkpoint, each failure one line (SetupError; the
command line exits with status 2):

- the checkpoint exists (`--resume runs/nope` says what it looked for);
- it is a checkpoint of this kind of run (an SFT checkpoint given to `rlcu grpo --resume`:
  starting RL from SFT weights is `model.path=<checkpoint>/model`);
- it holds a model of this run's shape (config.json's sizes against the model's);
- the settings that changed since it was written (trainer_state.json keeps the run's config;
  older checkpoints: the config.yaml of their run folder) are listed in the log, and those
  that change what the remaining steps compute (learning rates, batch and group sizes, seeds,
  the data, the model, the loss...) are refused unless checkpoint.allow_config_change
  (`--allow-config-change`) is set. Logging, checkpointing, evaluation and engine settings
  never change the numbers, nor does `steps` when every learning-rate schedule is constant.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from rlcu.config import config_to_dict
from rlcu.errors import SetupError
from rlcu.model.config import Qwen3Config
from rlcu.train.checkpoint import resolve_resume

# dotted keys (or prefixes ending in '.') whose change leaves the remaining steps exact
SAFE = ("log.", "checkpoint.", "engine.", "eval_every", "eval_max_prompts", "data.eval_path", "data.eval_split",
        "optim.max_nonfinite_in_row", "critic.optim.max_nonfinite_in_row", "model.gradient_checkpointing",
        "model.tokenizer")
MODEL_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "tie_word_embeddings")
RL_KINDS = ("grpo", "ppo")
NOT_SETTINGS = ("checkpoint.resume", "checkpoint.allow_config_change", "log.overwrite")  # how to start, not the run
# recorded as the count a CPU run used (rlcu.threads): unknown in a checkpoint older than it,
# and no change to what a GPU computes
THREADS = "model.threads"


def resolve(resume, ckpt_root) -> Path | None:
    try:
        return resolve_resume(resume, ckpt_root)
    except FileNotFoundError:
        p = Path(str(resume))
        why = "does not exist" if not p.exists() else "is neither a checkpoint (no trainer_state.json) nor a " \
                                                      "folder of step-* checkpoints"
        raise SetupError(f"checkpoint.resume (--resume): {resume} {why}; give a checkpoint folder "
                         f"(.../checkpoints/step-000100), a folder of them, or 'auto'") from None


def read_state(path: Path) -> dict:
    f = Path(path) / "trainer_state.json"
    try:
        return json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SetupError(f"{f}: unreadable checkpoint state ({e})") from None


def _kind_of(state: dict) -> str:
    if state.get("trainer"):
        return str(state["trainer"])
    return "rl" if "data_pos" in state else "unknown"


def check_kind(path: Path, state: dict, kind: str) -> None:
    saved = _kind_of(state)
    if saved == kind or (saved == "rl" and kind in RL_KINDS):
        return
    names = {"sft": "an SFT", "grpo": "a GRPO", "ppo": "a PPO", "rl": "an RL (GRPO or PPO)"}
    what = names.get(saved, "another kind of")
    raise SetupError(f"{path} is {what} checkpoint, and `--resume` continues a {kind.upper()} run; to start "
                     f"{kind.upper()} from its weights set model.path={Path(path) / 'model'} instead")


def check_model(path: Path, model) -> None:
    f = Path(path) / "model" / "config.json"
    try:
        saved = Qwen3Config.from_file(f)
    except (OSError, ValueError, KeyError) as e:
        raise SetupError(f"{f}: unreadable model config ({e})") from None
    diff = [f"{k} {getattr(saved, k)} (this run: {getattr(model.cfg, k)})" for k in MODEL_FIELDS
            if getattr(saved, k, None) != getattr(model.cfg, k, None)]
    if diff:
        raise SetupError(f"{path} holds another model than this run's ({', '.join(diff)}): resume with the model "
                         f"config it was trained with, or start from its weights with "
                         f"model.path={Path(path) / 'model'}")


def flatten(d, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k != "tiny":
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _saved_config(path: Path, state: dict) -> dict | None:
    if isinstance(state.get("config"), dict):
        return state["config"]
    f = Path(path).parent.parent / "config.yaml"  # <out_dir>/checkpoints/step-N: the run's config
    if f.is_file():
        try:
            d = yaml.safe_load(f.read_text())
            return d if isinstance(d, dict) else None
        except yaml.YAMLError:
            return None
    return None


def _safe(key: str, new: dict) -> bool:
    if any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE):
        return True
    if key == "steps":  # only a decaying schedule depends on the number of steps
        return all(v == "constant" for k, v in new.items() if k.endswith("optim.schedule") or k == "optim.schedule")
    return False


def check_config(path: Path, state: dict, cfg, note) -> dict:
    """Log the settings that changed since the checkpoint; refuse those that break an exact
    resume unless checkpoint.allow_config_change. Returns {key: (saved, now)}."""
    saved = _saved_config(path, state)
    if saved is None:
        note(f"{path}: no saved config to compare the run's settings with")
        return {}
    old, new = flatten(saved), flatten(config_to_dict(cfg))
    defaults = flatten(config_to_dict(type(cfg)()))
    # an option the checkpoint's version did not have, now at its default, changes nothing;
    # nor does one this version no longer has
    changed = {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
               if k in new and old.get(k) != new[k] and k not in NOT_SETTINGS
               and not (k not in old and new[k] == defaults.get(k)) and not (k == THREADS and k not in old)}
    if not changed:
        return {}
    listing = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())
    breaking = [k for k in changed if not _safe(k, new) and not (k == THREADS and cfg.model.resolve_device() != "cpu")]
    if breaking and not cfg.checkpoint.allow_config_change:
        raise SetupError(f"resuming {path} with changed settings that break an exact resume: "
                         + "; ".join(f"{k}: {changed[k][0]!r} -> {changed[k][1]!r}" for k in breaking)
                         + (f" (model.threads is the CPU thread count the run used: resume with --set model.threads="
                            f"{changed[THREADS][0]} to go on exactly)" if THREADS in breaking else "")
                         + " (pass --allow-config-change, checkpoint.allow_config_change: true, to resume anyway)")
    note(f"settings changed since {path.name}: {listing}")
    return changed
