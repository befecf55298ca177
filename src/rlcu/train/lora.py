"""LoRA in the trainers: the adapters a run's `lora:` section makes, what a checkpoint holds of
them, and the PEFT folder a run writes at its end.

The base stays frozen in its flat buffer; the adapters (model/lora.py LoraAdapters) carry their
own flat weights and gradient buffer, so the optimizer (FlatAdamW, or ShardedAdamW across ranks)
is made over them and keeps its fp32 master and moments of the adapters alone.

A checkpoint of a LoRA run does not copy the base (it is model.path's, unchanged): its model/
folder holds the base's config.json (resume's model check reads it) and the adapters as a PEFT
folder (adapter_config.json + adapter_model.safetensors); optim.pt holds the adapters' master
and moments as it holds a full run's. `LoraCheckpoint` is the object the checkpoint machinery
(train/checkpoint.py) saves and loads in the model's place, so saves stay atomic and pruned.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlcu import files
from rlcu.config import ConfigError
from rlcu.model.lora import LoraAdapters
from rlcu.model.lora_peft import load_adapter, read_adapter_config, save_adapter

ADAPTER_DIR = "adapter"  # the run's final PEFT folder, under log.out_dir


def attach_lora(model, section) -> LoraAdapters | None:
    """The adapters of a run (None: full fine-tuning), attached to `model` in its dtype and on
    its device: fresh ones from the section's fields, or a PEFT folder's (lora.path). A model
    passed in with adapters attached trains those (the section must then be off)."""
    if not section.enabled:
        return model.lora
    if model.lora is not None:
        raise ConfigError("lora", "is set, and the model passed in already has adapters attached: give one of them")
    if section.path is None:
        ad = LoraAdapters.create(model.cfg, section.lora_config(), model.device, model.dtype)
    else:
        path = Path(section.path).expanduser()
        try:
            cfg = section.agrees_with(read_adapter_config(path), str(path))
            loaded = load_adapter(path, model.cfg, model.device, model.dtype)
        except (OSError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError("lora.path", f"{section.path}: {e}") from None
        ad = LoraAdapters(model.cfg, cfg, loaded.flat)
    return ad.attach(model)


class LoraCheckpoint:
    """The model's place in a checkpoint of a LoRA run (module docstring): `flat` and `cfg` as a
    model's (the finiteness check reads the adapters, resume's check the base's config), and
    the model/ folder written and read as the base's config.json plus a PEFT adapter folder."""

    def __init__(self, model, base_model: str | None = None):
        self.model, self.ad, self.cfg = model, model.lora, model.cfg
        self.base_model = base_model

    @property
    def flat(self):
        return self.ad.flat

    def save_pretrained(self, path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_adapter(self.ad, path, base_model=self.base_model)
        cfg = self.cfg.to_hf_dict()
        cfg["torch_dtype"] = str(self.model.dtype).replace("torch.", "")
        text = json.dumps(cfg, indent=2)
        files.atomic_write(path / "config.json", lambda p: p.write_text(text))

    def load_pretrained(self, path) -> None:
        """The adapter weights of a checkpoint's model/ folder into the live adapters (their
        shape must be this run's)."""
        saved = read_adapter_config(path)
        if (saved.r, saved.target_modules) != (self.ad.cfg.r, self.ad.cfg.target_modules):
            raise ValueError(f"{path}: the checkpoint's adapters have r={saved.r}, target_modules="
                             f"{list(saved.target_modules)}; this run's r={self.ad.cfg.r}, "
                             f"target_modules={list(self.ad.cfg.target_modules)}")
        self.ad.flat.copy_(load_adapter(path, self.cfg, self.ad.device, self.ad.flat.dtype).flat)


def save_final(model, out_dir, base_model: str | None = None) -> Path:
    """The run's adapters as a PEFT folder, out_dir/adapter (each file atomic); `rlcu merge BASE
    out_dir/adapter OUT` makes a full HF folder of it."""
    out = Path(out_dir) / ADAPTER_DIR
    save_adapter(model.lora, out, base_model=base_model)
    return out
