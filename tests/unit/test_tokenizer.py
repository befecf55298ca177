"""rlcu.data.tokenizer against transformers: a BPE trained here, saved with a Qwen3-like ChatML
template, loaded by transformers (the oracle) and by rlcu; encode/decode and chat rendering must
be identical."""

import json
from datetime import datetime

import pytest
from support.chat_family_templates import QWEN3_LIKE as QWEN_LIKE
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from rlcu.data.tokenizer import ChatTemplateError, Tokenizer, make_word_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 30? The answer is 42.",
    "Qwen3 thinks step by step before it answers: <think> and </think>.",
    "Tools return JSON like {\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}.",
    "Ünïcödé text, emoji 🙂 and tabs\tand\nnewlines.",
]


# Jinja features whose exact output matters: tojson options and its (lack of) HTML escaping,
# special-token variables, trailing-newline and block whitespace handling, strftime_now, None keys.
MISC = """{{ bos_token is defined }}|{{ eos_token }}|{{ pad_token }}|{{ custom_token | default('none') }}
{% for m in messages %}
  {{ m | tojson }} {{ m | tojson(indent=2, sort_keys=true) }} {{ m.keys() | list | tojson(separators=(',', ':')) }}
  {% if m.content is none %}none{% elif m.content is defined %}{{ m.content | length }}{% endif %}
{% endfor %}
{{ strftime_now('%Y') }} {{ tools | tojson }} {{ documents | tojson }} {{ extra | default('no-extra') }}
"""

CHATS = [
    [{"role": "user", "content": "What is 12 + 30?"}],
    [{"role": "system", "content": "You are a careful <assistant> & friend."},
     {"role": "user", "content": "Ünïcödé 🙂 \"quoted\""},
     {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nThe answer is 42."},
     {"role": "user", "content": "And 1 + 2?"}],
    [{"role": "user", "content": "add 1 and 2"},
     {"role": "assistant", "content": "", "reasoning_content": "use the tool",
      "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
                     {"type": "function", "function": {"name": "add", "arguments": "{\"a\": 3, \"b\": 4}"}}]},
     {"role": "tool", "content": "3"},
     {"role": "tool", "content": "7"},
     {"role": "assistant", "content": "3 and 7", "thinking": "done"}],
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add <two> numbers & return",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def _train_backend():
    tk = Backend(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(CORPUS * 4, trainer)
    return tk


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f = tmp_path_factory.mktemp("tok")
    _train_backend().save(str(f / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "unk_token": None, "custom_token": "<|custom|>",
              "clean_up_tokenization_spaces": False, "model_max_length": 4096,
              "chat_template": [{"name": "default", "template": QWEN_LIKE}, {"name": "misc", "template": MISC}]}
    (f / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return f


@pytest.fixture(scope="module")
def pair(folder):
    from transformers import AutoTokenizer
    return Tokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(str(folder))


def test_vocab_and_special_tokens(pair):
    ours, hf = pair
    assert ours.vocab_size == len(hf)
    assert ours.eos_token == hf.eos_token == "<|im_end|>"
    assert ours.eos_token_id == hf.eos_token_id
    assert ours.pad_token_id == hf.pad_token_id
    assert ours.bos_token_id is None and hf.bos_token_id is None
    # <|custom|> was only in the config: both add it as a special token with the same id
    assert ours.token_to_id("<|custom|>") == hf.convert_tokens_to_ids("<|custom|>") == ours.vocab_size - 1
    assert ours.special_tokens == hf.special_tokens_map | {"custom_token": "<|custom|>"}


def test_encode_decode(pair):
    ours, hf = pair
    texts = CORPUS + ["<|im_start|>user\nhi<|im_end|>\n", "  leading spaces, unseen wörds ✓", ""]
    for text in texts:
        for special in (False, True):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special)
            for skip in (False, True):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    assert ours.encode_batch(texts) == [hf.encode(t, add_special_tokens=False) for t in texts]
    assert ours.decode(hf.eos_token_id, skip_special_tokens=False) == hf.decode(hf.eos_token_id) == "<|im_end|>"
    assert ours.decode(hf.eos_token_id) == ""  # rlcu skips special tokens by default


@pytest.mark.parametrize("chat", range(len(CHATS)))
@pytest.mark.parametrize("gen", [False, True])
@pytest.mark.parametrize("extra", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_chat_template_matches_transformers(pair, chat, gen, extra):
    ours, hf = pair
    for tools in (None, TOOLS):
        kw = dict(add_generation_prompt=gen, tools=tools, **extra)
        text = ours.apply_chat_template(CHATS[chat], **kw)
        assert text == hf.apply_chat_template(CHATS[chat], tokenize=False, **kw)
        ids = ours.apply_chat_template(CHATS[chat], tokenize=True, **kw)
        assert ids == hf.apply_chat_template(CHATS[chat], tokenize=True, return_dict=False, **kw)
        assert ids == ours.encode(text)


def test_chat_template_shape(pair):
    ours, _ = pair
    text = ours.apply_chat_template(CHATS[1], add_generation_prompt=True, enable_thinking=False)
    assert text.startswith("<|im_start|>system\nYou are a careful <assistant> & friend.<|im_end|>\n")
    assert "<think>" not in text.split("<|im_start|>assistant\n")[1]  # reasoning before the last query dropped
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with_tools = ours.apply_chat_template(CHATS[0], tools=TOOLS)
    assert '"description": "Add <two> numbers & return"' in with_tools  # tojson: no HTML escaping


def test_misc_template_and_batches(pair):
    ours, hf = pair
    msgs = [{"role": "user", "content": "é <b>", "name": None, "n": 3}, {"role": "assistant", "content": None}]
    for kw in ({}, {"extra": {"k": [1, 2]}, "custom_token": "override"}):
        kw = dict(chat_template="misc", tools=TOOLS, documents=[{"title": "t", "text": "x"}], **kw)
        assert ours.apply_chat_template(msgs, **kw) == hf.apply_chat_template(msgs, tokenize=False, **kw)
    assert str(datetime.now().year) in ours.apply_chat_template(msgs, chat_template="misc")
    batch = [CHATS[0], CHATS[1]]
    assert ours.apply_chat_template(batch, add_generation_prompt=True) == hf.apply_chat_template(
        batch, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(batch, tokenize=True) == hf.apply_chat_template(
        batch, tokenize=True, return_dict=False)
    inline = "{% for m in messages %}[{{ m.role }}]{% endfor %}{{ eos_token }}"
    assert ours.apply_chat_template(CHATS[1], chat_template=inline) == "[system][user][assistant][user]<|im_end|>"


def test_round_trip_and_jinja_file(pair, tmp_path):
    ours, hf = pair
    ours.save_pretrained(tmp_path / "a")
    again = Tokenizer.from_pretrained(tmp_path / "a")
    assert again.chat_template == ours.chat_template and again.special_tokens == ours.special_tokens
    assert again.apply_chat_template(CHATS[2], tokenize=True) == ours.apply_chat_template(CHATS[2], tokenize=True)
    by_file = Tokenizer.from_pretrained(tmp_path / "a" / "tokenizer.json")  # a file: config read beside it
    assert by_file.chat_template == ours.chat_template and by_file.encode(CORPUS[3]) == ours.encode(CORPUS[3])
    from transformers import PreTrainedTokenizerFast
    hf2 = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "a"))
    assert hf2.apply_chat_template(CHATS[1], tokenize=False) == ours.apply_chat_template(CHATS[1])
    assert hf2.encode(CORPUS[2]) == ours.encode(CORPUS[2])

    # a standalone chat_template.jinja wins over the config's template, as in transformers
    (tmp_path / "a" / "chat_template.jinja").write_text("J{% for m in messages %}{{ m.content }}{% endfor %}\n")
    jinja = Tokenizer.from_pretrained(tmp_path / "a")
    assert jinja.chat_template == "J{% for m in messages %}{{ m.content }}{% endfor %}\n"
    assert jinja.apply_chat_template(CHATS[0]) == "JWhat is 12 + 30?"  # trailing newline dropped by jinja
    assert jinja.apply_chat_template(CHATS[0]) == hf.apply_chat_template(
        CHATS[0], chat_template=jinja.chat_template, tokenize=False)
    jinja.save_pretrained(tmp_path / "a")  # the stale .jinja is removed; the config holds the template
    assert not (tmp_path / "a" / "chat_template.jinja").exists()
    assert Tokenizer.from_pretrained(tmp_path / "a").chat_template == jinja.chat_template


def test_word_tokenizer(tmp_path):
    from transformers import AutoTokenizer
    template = "{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}" \
               "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
    words = ["user", "assistant", "what", "is", "1", "2", "+", "=", "?"]
    tok = make_word_tokenizer(words, SPECIALS, chat_template=template)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.vocab_size == 1 + len(words) + len(SPECIALS)
    ids = tok.apply_chat_template([{"role": "user", "content": "what is 1 + 2 ?"}], add_generation_prompt=True,
                                  tokenize=True)
    assert tok.decode(ids) == "user what is 1 + 2 ? assistant"
    assert tok.encode("what is 3") == [3, 4, 0]  # unknown word -> <unk>, id 0
    tok.save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    msgs = [{"role": "user", "content": "1 + 1 = 2"}]
    ids2 = tok.apply_chat_template(msgs, tokenize=True)
    assert ids2 == hf.apply_chat_template(msgs, tokenize=True, return_dict=False)
    assert hf.decode(ids, skip_special_tokens=False) == tok.decode(ids, skip_special_tokens=False)
    with pytest.raises(ValueError, match="'a b'"):
        make_word_tokenizer(["a b"], SPECIALS)
    with pytest.raises(ValueError, match="eos_token"):
        make_word_tokenizer(words, SPECIALS, eos_token="<eos>")


def test_errors(folder, tmp_path, pair):
    ours, _ = pair
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=f"no tokenizer.json in {tmp_path}"):
        Tokenizer.from_pretrained(tmp_path)

    bad = tmp_path / "bad"
    bad.mkdir()
    good_json = (folder / "tokenizer.json").read_text()
    (bad / "tokenizer.json").write_text(good_json)
    (bad / "tokenizer_config.json").write_text('{\n  "eos_token": "<|im_end|>",\n  oops\n}\n')
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: invalid JSON at line 3"):
        Tokenizer.from_pretrained(bad)
    (bad / "tokenizer_config.json").write_text("{}")
    (bad / "tokenizer.json").write_text(good_json[:-40])
    with pytest.raises(ValueError, match=r"tokenizer\.json: invalid JSON at line \d+"):
        Tokenizer.from_pretrained(bad)
    (bad / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a valid tokenizers file"):
        Tokenizer.from_pretrained(bad)

    with pytest.raises(ChatTemplateError, match="raised an exception.*unknown role: robot"):
        ours.apply_chat_template([{"role": "robot", "content": "beep"}])
    with pytest.raises(ChatTemplateError, match="failed to compile.*line 2"):
        ours.apply_chat_template(CHATS[0], chat_template="ok\n{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="failed to render.*line 3.*TypeError"):
        ours.apply_chat_template([{"role": "user", "content": ["a", "list"]}],
                                 chat_template="\n\n{{ messages[0].content + 'x' }}")
    with pytest.raises(ChatTemplateError, match="SecurityError"):  # the sandbox: no mutating lists
        ours.apply_chat_template(CHATS[0], chat_template="{{ messages.append(1) }}")
    with pytest.raises(ValueError, match="empty conversation"):
        ours.apply_chat_template([])
    with pytest.raises(TypeError, match="continue_final_message"):
        ours.apply_chat_template(CHATS[0], continue_final_message=True)
    no_template = make_word_tokenizer(["a"], SPECIALS)
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template(CHATS[0])
