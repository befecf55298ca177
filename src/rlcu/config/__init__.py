"""Run configuration: plain dataclasses, YAML files and `--set a.b=c` overrides.

One concept a module: fields.py (`opt`, `Section`, `ConfigError`: how a field is declared,
coerced and checked), sections.py (model, data, optim, checkpoint, log, engine, and
`RunConfig`, the sections every trainer's config begins with), sft.py, dpo.py, rm.py (reward
models), rl.py (GRPO, PPO and the critic), demo.py, load.py (YAML + overrides, back to data, `config_help`). This face
re-exports them: `from rlcu.config import GRPOConfig`. The package sits below the engine and
the trainers (it imports the model's config only).
"""

from rlcu.config.demo import MODEL, DemoConfig, DemoTaskConfig
from rlcu.config.dpo import DPO_LOSSES, DPOConfig
from rlcu.config.fields import (
    ConfigError,
    Section,
    UnknownOption,
    field_types,
    opt,
    type_name,
)
from rlcu.config.fields import (
    _build as _build,  # (cls, data, prefix, source): config_from_dict under a dotted prefix (tests use it)
)
from rlcu.config.fields import (
    _leaf_paths as _leaf_paths,
)
from rlcu.config.load import (
    command_config,
    config_from_dict,
    config_help,
    config_to_dict,
    default_text,
    load_config,
    parse_override,
    save_config,
)
from rlcu.config.lora import LoraSection
from rlcu.config.rl import CriticConfig, GRPOConfig, MultiTurnConfig, PPOConfig, RLConfig
from rlcu.config.rm import RMConfig
from rlcu.config.sections import (
    CHECKPOINTING_MODES,
    GPU_MEMORY_UTILIZATION,
    CheckpointConfig,
    DataConfig,
    EngineConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    check_device,
)
from rlcu.config.sft import SFTConfig

__all__ = [
    "CHECKPOINTING_MODES", "CheckpointConfig", "ConfigError", "CriticConfig", "DPO_LOSSES", "DPOConfig", "DataConfig",
    "DemoConfig",
    "DemoTaskConfig", "EngineConfig", "GPU_MEMORY_UTILIZATION", "GRPOConfig", "LogConfig", "LoraSection", "MODEL",
    "ModelConfig", "MultiTurnConfig", "OptimConfig", "PPOConfig", "RLConfig", "RMConfig", "RunConfig", "SFTConfig",
    "Section", "UnknownOption", "check_device", "command_config", "config_from_dict", "config_help", "config_to_dict",
    "default_text", "field_types", "load_config", "opt", "parse_override", "save_config", "type_name"
]
