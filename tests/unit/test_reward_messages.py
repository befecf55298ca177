"""What the rewards say when they cannot run: a function that returns None for the whole batch is
told a list is expected (not that None would do); a module that cannot be found names each folder
searched once, with why it was searched."""

import pytest

from rlcu.rewards import RewardSet, add_import_dir, load_reward, loader


def test_a_bare_none_is_told_a_list_is_expected():
    rs = RewardSet([lambda prompts, completions, **_: None])
    _, _, errors = rs(["a", "b"], ["x", "y"])
    (msg,) = errors
    assert "returned None, expected a list of 2 values, one per sample: a float, or None for a sample" in msg
    assert "floats or None" not in msg


def test_retried_one_sample_at_a_time_the_same():
    def f(prompts, completions, **_):
        if len(completions) > 1:
            raise RuntimeError("batch")
        return None

    _, _, errors = RewardSet([f])(["a", "b"], ["x", "y"])
    assert "returned None for one sample, expected a list of 1 value, one per sample" in errors[0]


@pytest.mark.parametrize("config_here", [True, False])
def test_missing_module_names_each_folder_once(tmp_path, monkeypatch, config_here):
    monkeypatch.setattr(loader, "_DIRS", [])
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    cfg_dir = work if config_here else tmp_path
    add_import_dir(cfg_dir / "run.yaml")
    with pytest.raises(ValueError) as e:
        load_reward("no_such_reward_module:fn")
    msg = str(e.value)
    if config_here:
        assert f"(looked in {work} (beside the config and the working directory) and sys.path)" in msg
    else:
        assert f"(looked in {tmp_path} (beside the config), {work} (the working directory) and sys.path)" in msg
    assert msg.count(str(work)) == 1
