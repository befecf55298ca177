"""The `lora:` section of SFT, GRPO and PPO: train LoRA adapters (model/lora.py) over a frozen base.

Off unless `r` or `path` is set, so a run's YAML without it is a full fine-tuning run. Its
fields are model/lora.py LoraConfig's (r, alpha, rslora, target_modules, dropout, init), checked
by it and reported under `lora.`; `path` starts from a PEFT adapter folder instead, whose
adapter_config.json then gives the shape: a field set beside it must agree with the folder
(the folder is read when the trainer builds the adapters, rlcu.train.lora)."""

from __future__ import annotations

import dataclasses

from rlcu.config.fields import ConfigError, Section, opt
from rlcu.model.lora import HF_TARGETS, INITS, LoraConfig

# the fields that shape the adapter, as LoraConfig names them
SHAPE_FIELDS = ("r", "alpha", "rslora", "target_modules", "dropout", "init")


@dataclasses.dataclass
class LoraSection(Section):
    r: int = opt(0, "the adapters' rank; 0 (with path null): no LoRA, every weight trains. With LoRA the base "
                    "stays frozen (no gradient, no optimizer state) and only the adapters train", ge=0)
    alpha: float = opt(32.0, "the adapters' scale is alpha / r (alpha / sqrt(r) with rslora)", gt=0)
    rslora: bool = opt(False, "rank-stabilised scale alpha / sqrt(r) (PEFT's use_rslora)")
    target_modules: list[str] | str = opt("all-linear", "the adapted linears by HF name ("
                                          + ", ".join(HF_TARGETS) + "; gate: a Qwen3-MoE's router) or all-linear (the "
                                          "seven linears; never the LM head nor the router)")
    dropout: float = opt(0.0, "dropout on the adapters' input while training (never in the engine)", ge=0, lt=1)
    init: str = opt("default", "A's initialisation (B is zero, so training starts at the base): default (PEFT's "
                               "kaiming-uniform) or gaussian (normal, std 1/r)", choices=INITS)
    seed: int = opt(0, "seed of A's initialisation and of the dropout masks", ge=0)
    path: str | None = opt(None, "start from a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors); "
                                 "its config gives r, alpha, rslora, target_modules (a field set here must agree)")

    @property
    def enabled(self) -> bool:
        return self.r > 0 or self.path is not None

    def check(self):
        if self.path is None and self.r == 0:
            changed = [f.name for f in dataclasses.fields(self) if f.name not in ("r", "seed")
                       and getattr(self, f.name) != _default(f)]
            if changed:
                raise ConfigError(changed[0], "is set but LoRA is off: set lora.r (the rank) or lora.path "
                                              "(a PEFT adapter folder)")
            return
        if self.path is None:
            self.lora_config()  # LoraConfig's own checks, named under lora.

    def lora_config(self) -> LoraConfig:
        """The LoraConfig these fields make (without `path`: with it, the folder's)."""
        t = self.target_modules
        try:
            return LoraConfig(r=self.r, alpha=self.alpha, rslora=self.rslora,
                              target_modules=tuple(t) if isinstance(t, list) else t, dropout=self.dropout,
                              init=self.init, seed=self.seed)
        except ValueError as e:
            field = next((f for f in SHAPE_FIELDS if f"lora.{f} " in str(e)), "")
            raise ConfigError(field, str(e).split(" ", 1)[1] if field else str(e)) from None

    def agrees_with(self, saved: LoraConfig, where: str) -> LoraConfig:
        """The folder's LoraConfig `saved` with this section's seed and dropout (training settings,
        not the adapter's shape; dropout 0 keeps the folder's); a shape field set here to another
        value than the folder's is an error naming it."""
        for f in dataclasses.fields(self):
            if f.name not in SHAPE_FIELDS or f.name == "dropout" or getattr(self, f.name) == _default(f):
                continue
            mine, theirs = getattr(self, f.name), getattr(saved, f.name)
            if f.name == "target_modules":
                mine = LoraConfig(target_modules=tuple(mine) if isinstance(mine, list) else mine).target_modules
            if mine != theirs:
                raise ConfigError(f"lora.{f.name}", f"is {getattr(self, f.name)!r}, but the adapter in {where} has "
                                                    f"{theirs!r} (leave it unset to take the folder's)")
        return dataclasses.replace(saved, dropout=self.dropout or saved.dropout, seed=self.seed)


def _default(f):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default
