"""Config: YAML + --set overrides, coercion, and errors that name the field."""

from pathlib import Path

import pytest

from rlcu.config import ConfigError, LogConfig, OptimConfig, SFTConfig, config_help, config_to_dict, load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_defaults_and_overrides(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("steps: 7\noptim:\n  lr: 1e-4\n  betas: [0.8, 0.9]\nmodel:\n  tiny: {hidden_size: 64}\n")
    cfg = load_config(SFTConfig, f, ["optim.schedule=cosine", "log.progress=false", "model.tiny.vocab_size=33",
                                     "checkpoint.resume=auto"])
    assert cfg.steps == 7
    assert cfg.optim.lr == 1e-4  # YAML 1.1 reads 1e-4 as a string; float fields accept it
    assert cfg.optim.betas == (0.8, 0.9)
    assert cfg.optim.schedule == "cosine" and cfg.log.progress is False
    assert cfg.model.tiny == {"hidden_size": 64, "vocab_size": 33}
    assert cfg.checkpoint.resume == "auto"
    assert load_config(SFTConfig) == SFTConfig()
    d = config_to_dict(cfg)
    assert d["optim"]["betas"] == [0.8, 0.9] and SFTConfig(**d) == cfg  # round trip through plain data


def test_example_loads():
    cfg = load_config(SFTConfig, EXAMPLES / "sft.yaml")
    assert cfg.optim.schedule == "cosine"


@pytest.mark.parametrize("override, needle", [
    ("optim.lr=-1", "optim.lr must be > 0, got -1.0 (in --set optim.lr=-1)"),
    ("optim.schedule=linear", "optim.schedule must be one of 'constant', 'cosine'; got 'linear'"),
    ("optim.betas=[0.9]", "optim.betas must have 2 values"),
    ("optim.betas=[0.9, 1.5]", "optim.betas[1] must be < 1.0"),
    ("steps=abc", "steps must be an integer, got 'abc'"),
    ("log.tensorboard=maybe", "log.tensorboard must be true or false"),
    ("optim.lrr=1", "unknown option 'optim.lrr'; did you mean 'optim.lr'?"),
    ("nope.x=1", "unknown option 'nope'"),
    ("optim.lr.x=1", "optim.lr is not a section"),
    ("model.dtype=float16", "model.dtype must be one of 'auto', 'float32', 'bfloat16'"),
    ("lr", "must look like key.path=value"),
])
def test_override_errors(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(SFTConfig, None, [override])
    assert needle in str(e.value)


def test_file_errors(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("optim:\n  lr: 0\n")
    with pytest.raises(ConfigError, match=r"optim.lr must be > 0, got 0.0 \(in .*bad.yaml\)"):
        load_config(SFTConfig, f)
    f.write_text("optim:\n  warmup: 3\n")
    with pytest.raises(ConfigError, match=r"unknown option 'optim.warmup'.*warmup_steps.*bad.yaml"):
        load_config(SFTConfig, f)
    f.write_text("optim: [1, 2]\n")
    with pytest.raises(ConfigError, match="optim must be a mapping"):
        load_config(SFTConfig, f)
    f.write_text("steps: [1\n")
    with pytest.raises(ConfigError, match="bad.yaml:.*invalid YAML"):
        load_config(SFTConfig, f)
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        load_config(SFTConfig, tmp_path / "missing.yaml")
    f.write_text("model:\n  path: a\n  tiny: {hidden_size: 8}\n")
    with pytest.raises(ConfigError, match="model.tiny must be null when path is set"):
        load_config(SFTConfig, f)


def test_python_construction():
    assert OptimConfig(lr="3e-4").lr == 3e-4
    with pytest.raises(ConfigError, match="max_grad_norm must be >= 0"):
        OptimConfig(max_grad_norm=-1)
    cfg = SFTConfig(optim={"lr": 2e-3}, log=LogConfig(progress=False))
    assert isinstance(cfg.optim, OptimConfig) and cfg.optim.lr == 2e-3
    with pytest.raises(ConfigError, match="optim.lr must be > 0"):
        SFTConfig(optim={"lr": 0})


def test_help_lists_every_option():
    h = config_help(SFTConfig)
    for name in ("steps = 100", "optim.lr = 1.0e-05", "optim.betas = [0.9, 0.999]", "checkpoint.resume = null",
                 "log.plot_keys = null", "model.dtype = auto", "data.max_prompt_tokens = null"):
        assert name in h, name
    assert "one of: constant, cosine" in h
    # every leaf field has a help string
    import dataclasses

    def leaves(c):
        for f in dataclasses.fields(c):
            if dataclasses.is_dataclass(f.type) or (isinstance(f.default_factory, type)):
                yield from leaves(f.default_factory)
            else:
                yield f
    assert all(f.metadata.get("help") for f in leaves(SFTConfig))


@pytest.mark.parametrize("cls_name, key, ours", [
    ("GRPOConfig", "learning_rate", "optim.lr"),
    ("GRPOConfig", "num_generations", "group_size"),
    ("GRPOConfig", "max_completion_length", "max_new_tokens"),
    ("GRPOConfig", "max_steps", "steps"),
    ("GRPOConfig", "beta", "kl_coef"),
    ("PPOConfig", "beta", "kl_coef"),
    ("PPOConfig", "cliprange_value", "critic.value_clip"),
    ("SFTConfig", "max_length", "max_seq_len"),
    ("SFTConfig", "learning_rate", "optim.lr"),
])
def test_trl_names_get_ours(tmp_path, cls_name, key, ours):
    import rlcu.config

    cls = getattr(rlcu.config, cls_name)
    f = tmp_path / "trl.yaml"
    f.write_text(f"{key}: 1\n")
    for src in ({"path": f}, {"overrides": [f"{key}=1"]}):
        with pytest.raises(ConfigError) as e:
            load_config(cls, **src)
        assert f"unknown option '{key}'; TRL's '{key}' is rlcu's '{ours}'" in str(e.value)
    if ours.startswith("optim."):  # inside the section, too
        with pytest.raises(ConfigError, match=f"'optim.{key}'; TRL's '{key}' is rlcu's '{ours}'"):
            load_config(cls, None, [f"optim.{key}=1"])


def test_trl_names_point_at_real_options():
    """Every TRL name's target is an option of at least one trainer's config."""
    from rlcu.config import GRPOConfig, PPOConfig, _leaf_paths
    from rlcu.config_hints import TRL_NAMES

    leaves = set().union(*(_leaf_paths(c) for c in (SFTConfig, GRPOConfig, PPOConfig)))
    assert {k: v for k, v in TRL_NAMES.items() if v not in leaves} == {}
    assert "kl_coef" not in _leaf_paths(SFTConfig)
    with pytest.raises(ConfigError) as e:  # SFT has no KL: no hint at all rather than a wrong one
        load_config(SFTConfig, None, ["beta=1"])
    assert "TRL" not in str(e.value) and "did you mean" not in str(e.value)


@pytest.mark.parametrize("cls_name, override, needle", [
    ("SFTConfig", "lr=1", "unknown option 'lr'; did you mean 'optim.lr'?"),
    ("SFTConfig", "warmup=1", "unknown option 'warmup'; did you mean 'optim.warmup_steps'?"),
    ("GRPOConfig", "group_sise=4", "unknown option 'group_sise'; did you mean 'group_size'?"),
    ("GRPOConfig", "engine.max_num_seq=4", "unknown option 'engine.max_num_seq'; did you mean 'engine.max_num_seqs'?"),
    ("PPOConfig", "critic.optim.lrr=1", "unknown option 'critic.optim.lrr'; did you mean 'critic.optim.lr'?"),
    ("GRPOConfig", "rewards=[{func: math}]", "rewards[0].func is not a reward option; did you mean 'rewards[0].fn'?"),
])
def test_near_miss_did_you_mean(cls_name, override, needle):
    import rlcu.config

    cls = getattr(rlcu.config, cls_name)
    with pytest.raises(ConfigError) as e:
        load_config(cls, None, [override])
    assert needle in str(e.value)


def test_nested_unknown_key_in_a_file_names_its_whole_path(tmp_path):
    from rlcu.config import PPOConfig

    f = tmp_path / "ppo.yaml"
    f.write_text("critic:\n  optim:\n    lrr: 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(PPOConfig, f)
    assert str(e.value).startswith("unknown option 'critic.optim.lrr'; did you mean 'critic.optim.lr'?")
