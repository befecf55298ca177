"""A reward model in the reward set (rewards/model_reward.py): its scores against transformers'
for the same samples (the policy's ids read as they are; its own tokenizer's chat template and
text rendering through transformers' tokenizer), batched by tokens, weighted beside a function
reward, masked where it cannot score, offloaded and woken, and the config's errors by field."""

import math

import pytest
import torch
from support.hf_util import hf_scores, make_seq_cls_model

from rlcu.config import ConfigError, GRPOConfig, _build
from rlcu.data.tokenizer import make_word_tokenizer
from rlcu.rewards import RewardSet, RewardsFailed
from rlcu.rewards.model_reward import ModelReward

WORDS = ["hello", "there", "how", "are", "you", "fine", "good", "bad", "ok"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{% endif %}")


@pytest.fixture(scope="module")
def rm(tmp_path_factory):
    """(transformers' model, its folder with a chat-template tokenizer of its own)."""
    tmp = tmp_path_factory.mktemp("rm")
    hf, folder = make_seq_cls_model(tmp, "qwen3", seed=1)
    tok = make_word_tokenizer(WORDS + ["system", "user", "assistant"], ["<|im_start|>", "<|im_end|>"],
                              chat_template=TEMPLATE)
    tok.save_pretrained(folder)
    return hf, folder


def length_reward(prompts, completions, **_):
    return [float(len(str(c))) for c in completions]


def test_scores_equal_transformers_ids_template_and_text(rm):
    """One set holds the model three ways: the policy's ids (its tokenizer is the policy's), its
    own chat template over messages, and plain text; each score equals HF's for the same ids
    (transformers' tokenizer rendering the template), weighted beside a function reward."""
    import transformers

    hf, folder = rm
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    own = ModelReward.load(str(folder), "m", device="cpu", dtype=torch.float32)
    assert own.tokenizer is not None  # a tokenizer of its own, not the policy's (None)
    same = ModelReward.load(str(folder), "m", device="cpu", dtype=torch.float32, policy_tokenizer=own.tokenizer)
    assert same.tokenizer is None  # the policy's own tokenizer: its ids are read as they are
    rs = RewardSet([{"model": same, "name": "ids", "weight": 2.0}, {"fn": length_reward, "weight": 0.5}])
    seqs = [[5, 6, 7, 8, 9], [9, 10, 11], [3] * 40, [4, 4]]
    total, parts, errors = rs(["p"] * 4, ["a", "bb", "ccc", "dddd"], sequence_ids=seqs)
    want = hf_scores(hf, seqs).detach()
    torch.testing.assert_close(parts["ids"], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(total, 2.0 * want + 0.5 * torch.tensor([1.0, 2.0, 3.0, 4.0]), rtol=1e-5, atol=1e-5)
    assert errors == []

    chat = [[{"role": "user", "content": "hello how are you"}], [{"role": "user", "content": "hello there"}]]
    comps = ["fine ok", "bad"]
    own.max_tokens = 12  # two forwards: the batching by tokens changes no score
    assert own.batches([10, 9, 3]) == [[0], [1, 2]]
    got, fails = own(chat, [[{"role": "assistant", "content": c}] for c in comps])
    ids = [hf_tok.apply_chat_template(p + [{"role": "assistant", "content": c}], tokenize=True)
           for p, c in zip(chat, comps)]
    ids = [list(i["input_ids"]) if isinstance(i, dict) or hasattr(i, "keys") else list(i) for i in ids]
    assert fails == {}
    torch.testing.assert_close(torch.tensor(got), hf_scores(hf, ids).detach(), rtol=1e-5, atol=1e-5)
    got, fails = own(["hello there", "how are"], [" fine", " you good"])
    ids = [hf_tok("hello there fine")["input_ids"], hf_tok("how are you good")["input_ids"]]
    torch.testing.assert_close(torch.tensor(got), hf_scores(hf, ids).detach(), rtol=1e-5, atol=1e-5)


def test_failures_are_masked_and_counted(rm):
    """A sample the model cannot read (outside its vocabulary, past its context) fails alone; a
    forward that raises fails its samples; every sample failing for max_failed_steps calls stops."""
    _, folder = rm
    m = ModelReward.load(str(folder), "m", device="cpu", dtype=torch.float32)
    m.tokenizer = None  # read the policy's ids
    rs = RewardSet([{"model": m, "name": "rm"}, length_reward], max_failed_steps=2)
    seqs = [[5, 6], [5, 999], [1] * 600, [7]]
    total, parts, errors = rs(["p"] * 4, ["a", "b", "c", "d"], sequence_ids=seqs)
    ok = ~torch.isnan(total)
    assert ok.tolist() == [True, False, False, True] and parts["length_reward"].tolist() == [1.0] * 4
    assert len(errors) == 1 and "reward 'rm' failed on 2 of 4 samples" in errors[0]
    assert "outside the reward model's vocabulary" in errors[0] and rs.last_metrics["reward_failed/rm"] == 2.0

    def boom(seqs, max_tokens=None):
        raise RuntimeError("device lost")

    m.rm.score = boom
    for step in range(2):
        if step == 1:
            with pytest.raises(RewardsFailed, match="device lost"):
                rs(["p"], ["a"], sequence_ids=[[5]])
        else:
            total, _, errors = rs(["p"], ["a"], sequence_ids=[[5]])
            assert math.isnan(total[0]) and "RuntimeError: device lost" in errors[0]


def test_offload_frees_the_weights_between_scorings(rm):
    _, folder = rm
    m = ModelReward.load(str(folder), "m", device="cpu", dtype=torch.float32, offload=True)
    m.tokenizer = None
    want, _ = m([0, 0], [0, 0], [[5, 6, 7], [8]])
    m.sleep()
    assert m.asleep and m.rm.flat.untyped_storage().nbytes() == 0
    got, _ = m([0, 0], [0, 0], [[5, 6, 7], [8]])  # woken to score, asleep after
    assert got == want and m.asleep and m.rm.flat.untyped_storage().nbytes() == 0
    m.wake()
    assert m.rm.flat.untyped_storage().nbytes() == m.rm.flat.numel() * 4


def test_config_errors_name_the_field(rm, tmp_path):
    _, folder = rm

    def cfg(*rewards):
        return _build(GRPOConfig, {"rewards": [{"name": "math"}, *rewards]})

    cfg({"model": str(folder), "weight": 0.5, "batch_size": 8, "max_tokens": 4096, "offload": True,
         "kwargs": {"enable_thinking": False}})
    # the Python API: a folder (a string naming one, or a Path) or a model object is a reward model
    from rlcu.rewards.loader import reward_specs

    m = ModelReward.load(str(folder), "m", device="cpu", dtype=torch.float32)
    assert reward_specs([str(folder), folder, m.rm, m, "math"], []) == [
        {"model": str(folder)}, {"model": folder}, {"model": m.rm}, {"model": m}, {"name": "math"}]
    # the memory model reads it from the config (the scheduler's request: auto kept; the fit check: offloaded)
    from rlcu.train.sizing import config_shape, train_shape

    c = cfg({"model": str(folder), "max_tokens": 4096})
    (r,) = config_shape(c).reward_models
    assert (r.cfg.hidden_size, r.tokens, r.offload) == (96, 4096, False) and train_shape(c).reward_models[0].offload
    (tmp_path / "lm").mkdir()
    (tmp_path / "lm" / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "config.json").write_text(
        '{"architectures": ["Qwen3ForSequenceClassification"], "id2label": {"0": "a", "1": "b"}}')
    cases = [({"model": str(tmp_path / "nowhere")}, "rewards[1].model", "is not a folder"),
             ({"model": str(tmp_path / "lm")}, "rewards[1].model", "is not a sequence-classification model"),
             ({"model": str(tmp_path / "two")}, "rewards[1].model", "has num_labels 2"),
             ({"model": str(folder), "max_tokens": 0}, "rewards[1].max_tokens", "positive integer"),
             ({"model": str(folder), "offload": "sometimes"}, "rewards[1].offload", "auto, true or false"),
             ({"model": str(folder), "temperature": 1}, "rewards[1].temperature", "not an option"),
             ({"model": str(folder), "fn": "m:f"}, "rewards[1].fn", "not an option")]
    for spec, field, words in cases:
        with pytest.raises(ConfigError, match=words) as e:
            cfg(spec)
        assert e.value.path.endswith(field), (e.value.path, field)


def test_policy_ids_get_the_templates_turn_end(rm):
    """Reading the policy's ids, a chat sample that ends at the end-of-turn token is scored with
    what the chat template renders after it (as the conversations a reward model trains on end);
    a cut one (no end-of-turn) and a text sample are scored as they are."""
    _, folder = rm
    tok = make_word_tokenizer(WORDS, ["<|im_start|>", "<|im_end|>", "<|sep|>"],
                              chat_template=TEMPLATE.replace("<|im_end|>", "<|im_end|><|sep|>"))
    end, sep = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|sep|>")
    m = ModelReward.load(str(folder), "m", device="cpu", dtype=torch.float32, policy_tokenizer=tok)
    m.tokenizer = None  # read the policy's ids
    assert m.turn_end == (end, [sep])
    chat = [{"role": "user", "content": "hi"}]
    seqs = [[5, 6, end], [5, 6, 7], [5, 6, end]]
    got, _ = m([chat, chat, "text"], ["", "", ""], seqs)
    want = m.rm.score([[5, 6, end, sep], [5, 6, 7], [5, 6, end]])
    torch.testing.assert_close(torch.tensor(got), want)
