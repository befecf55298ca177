"""Llama 3.x, Mistral v0.3 and Qwen2.5 tokenizers and chat templates (tiny folders in the families'
published form, tests/support/chat_families.py) against transformers: rendered text and ids equal
`apply_chat_template`'s for single- and multi-turn chats, system prompts, the generation prompt, tools
and tool calls; the template's bos_token is encoded once; the template's own errors come through;
the EOS ids and the stop ids generation uses hold each family's end-of-turn token."""

import json
from types import SimpleNamespace

import pytest
from support import chat_families as cf

from rlcu.data.tokenizer import ChatTemplateError, Tokenizer

FOLDERS = {"llama31": cf.llama3_folder, "llama32_base": cf.llama3_base_folder, "mistral": cf.mistral_folder,
           "mistral_tokenizer": lambda f: cf.mistral_folder(f, model=False),
           "mistral_metaspace": lambda f: cf.mistral_folder(f, legacy=False), "qwen25": cf.qwen25_folder}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add <two> numbers & return",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALL = {"id": "call12345", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
CHATS = {
    "single": [{"role": "user", "content": "What is 12 + 30?"}],
    "system_multi": [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "Ünïcödé 🙂  \"hi\""},
                     {"role": "assistant", "content": " The answer is 42. "},
                     {"role": "user", "content": "And 1 + 2?"}],
    "multi_done": [{"role": "user", "content": "Say the sum."}, {"role": "assistant", "content": "42"},
                   {"role": "user", "content": "Then?"}, {"role": "assistant", "content": "Then 43."}],
    "tool_call": [{"role": "user", "content": "add 1 and 2"},
                  {"role": "assistant", "content": "", "tool_calls": [CALL]},
                  {"role": "tool", "content": "3", "tool_call_id": "call12345"}],
}
END_OF_TURN = {"llama31": "<|eot_id|>", "mistral": "</s>", "mistral_tokenizer": "</s>", "mistral_metaspace": "</s>",
               "qwen25": "<|im_end|>"}
BOS = {"llama31": "<|begin_of_text|>", "llama32_base": "<|begin_of_text|>", "mistral": "<s>",
       "mistral_tokenizer": "<s>", "mistral_metaspace": "<s>", "qwen25": None}


@pytest.fixture(scope="module", params=list(FOLDERS))
def family(request, tmp_path_factory):
    """(name, folder, rlcu's tokenizer, transformers' AutoTokenizer: the class transformers picks for the
    folder, which for Mistral's LlamaTokenizer is not the file read as it is)."""
    from transformers import AutoTokenizer
    folder = FOLDERS[request.param](tmp_path_factory.mktemp(request.param))
    return request.param, folder, Tokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(str(folder))


def _both(ours, hf, chat, **kw):
    """Our text and ids, transformers' text and ids; a template error is returned as its message."""
    try:
        out = (ours.apply_chat_template(chat, **kw), ours.apply_chat_template(chat, tokenize=True, **kw))
    except ChatTemplateError as e:
        out = (f"error: {e}", None)
    try:
        ref = (hf.apply_chat_template(chat, tokenize=False, **kw),
               hf.apply_chat_template(chat, tokenize=True, return_dict=False, **kw))
    except Exception as e:  # jinja2's TemplateError, raised by the template's raise_exception
        ref = (f"error: {e}", None)
    return out, ref


def test_vocab_and_named_tokens(family):
    name, _, ours, hf = family
    assert len(ours) == len(hf)
    assert (ours.bos_token, ours.eos_token) == (hf.bos_token, hf.eos_token)
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    assert ours.bos_token == BOS[name]
    assert ours.pad_token_id == hf.pad_token_id
    if name != "qwen25":
        assert ours.pad_token is None  # Llama and Mistral publish no pad token


@pytest.mark.parametrize("text", cf.CORPUS + ["hello  world", " leading space", "[INST] Hi[/INST] yes</s>",
                                             "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>", ""])
def test_encode_decode(family, text):
    _, _, ours, hf = family
    for special in (False, True):
        ids = ours.encode(text, add_special_tokens=special)
        assert ids == hf.encode(text, add_special_tokens=special)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize("gen", [False, True])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_matches_transformers(family, chat, gen, tools):
    _, _, ours, hf = family
    (text, ids), (ref_text, ref_ids) = _both(ours, hf, CHATS[chat], add_generation_prompt=gen, tools=tools)
    assert text == ref_text
    assert ids == ref_ids
    if ids is not None:
        assert ids == ours.encode(text)


def test_bos_once_and_generation_prompt(family):
    """The template writes bos_token and the tokenizer's post-processor would add it too: the chat's ids
    are encoded without special tokens (transformers' rule), so BOS comes once; plain text encoded with
    special tokens gets the post-processor's BOS, as transformers' tokenizer(text) does."""
    name, _, ours, hf = family
    ids = ours.apply_chat_template(CHATS["single"], add_generation_prompt=True, tokenize=True)
    bos = ours.bos_token_id
    if BOS[name] is None:
        assert bos is None
    else:
        assert ids[0] == bos and ids.count(bos) == 1
        assert ours.encode("hello world", add_special_tokens=True)[0] == bos
    text = ours.apply_chat_template(CHATS["single"], add_generation_prompt=True)
    head = {"llama31": "<|start_header_id|>assistant<|end_header_id|>\n\n", "mistral": "[/INST]",
            "qwen25": "<|im_start|>assistant\n"}
    assert text.endswith(head.get(name.split("_")[0] if name.startswith("mistral") else name, ""))


def test_template_variables_and_features(family):
    """Llama's date_string, tools_in_user_message, builtin_tools and custom_tools reach the template as
    transformers passes them; Llama 3.2's strftime_now gives today's date."""
    name, _, ours, hf = family
    if not name.startswith("llama"):
        pytest.skip("Llama 3's template variables")
    for kw in ({"date_string": "01 Jan 2025"}, {"tools": TOOLS, "tools_in_user_message": False},
               {"builtin_tools": ["brave_search", "wolfram_alpha"], "tools": TOOLS}, {"custom_tools": TOOLS}):
        for chat in ("single", "system_multi", "tool_call"):
            (text, ids), (ref_text, ref_ids) = _both(ours, hf, CHATS[chat], add_generation_prompt=True, **kw)
            assert (text, ids) == (ref_text, ref_ids)
    text = ours.apply_chat_template(CHATS["single"], date_string="01 Jan 2025")
    assert "Today Date: 01 Jan 2025" in text
    if name == "llama32_base":
        from datetime import datetime
        assert f"Today Date: {datetime.now().strftime('%d %b %Y')}" in ours.apply_chat_template(CHATS["single"])


def test_template_errors(family):
    """raise_exception in the templates: Llama's one tool call at a time, Mistral's role alternation and
    9-character call ids; rlcu raises ChatTemplateError with the template's message where transformers raises."""
    name, _, ours, hf = family
    cases = {"llama": ([{"role": "user", "content": "x"},
                        {"role": "assistant", "tool_calls": [CALL, CALL]}], "only supports single tool-calls"),
             "mistral": ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                         "roles must alternate user/assistant"),
             "qwen25": None}
    case = cases[next(k for k in cases if name.startswith(k))]
    if case is None:
        pytest.skip("Qwen2.5's template raises nothing")
    chat, message = case
    (text, _), (ref_text, _) = _both(ours, hf, chat)
    assert text.startswith("error: ") and ref_text.startswith("error: ")
    assert message in text and message in ref_text
    if name.startswith("mistral"):
        bad_id = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [dict(CALL, id="c1")]}]
        with pytest.raises(ChatTemplateError, match="length 9"):
            ours.apply_chat_template(bad_id)


def test_stop_ids_hold_the_end_of_turn_token(family):
    """The end-of-turn token the template writes after an assistant message is an EOS of the tokenizer or
    of config.json / generation_config.json, so the engine's stop ids (LLM.eos_token_ids: the model's,
    generation_config's and the tokenizer's) and a rollout's (train.rollout.stop_ids) end the turn."""
    from rlcu.engine.llm import LLM
    from rlcu.train.rollout import stop_ids

    name, folder, ours, _ = family
    if name not in END_OF_TURN or not (folder / "config.json").is_file():
        pytest.skip("a base checkpoint's EOS is <|end_of_text|>; its template's turns end with <|eot_id|>")
    text = ours.apply_chat_template(CHATS["multi_done"])
    eot = END_OF_TURN[name]
    assert text.rstrip("\n").endswith("Then 43." + eot)
    eot_id = ours.token_to_id(eot)
    config_eos = json.loads((folder / "config.json").read_text())["eos_token_id"]
    cfg = SimpleNamespace(eos_token_ids=[config_eos] if isinstance(config_eos, int) else config_eos,
                          vocab_size=len(ours))
    model = SimpleNamespace(cfg=cfg)
    engine = SimpleNamespace(model=model, source=folder, _tokenizer=ours)
    assert eot_id in LLM.eos_token_ids.fget(engine)
    assert eot_id in stop_ids(ours, model)
    if name == "llama31":  # <|end_of_text|>, <|eom_id|> and <|eot_id|> all stop
        assert {ours.token_to_id(t) for t in ("<|end_of_text|>", "<|eom_id|>")} <= LLM.eos_token_ids.fget(engine)


def test_save_and_reload(family, tmp_path):
    """A folder rlcu saves (beside the model's config.json, as a checkpoint has it) encodes the same in
    rlcu and in transformers (a rebuilt LlamaTokenizer is saved rebuilt: the Metaspace form)."""
    from transformers import AutoTokenizer

    _, folder, ours, hf = family
    ours.save_pretrained(tmp_path)
    if (folder / "config.json").is_file():
        (tmp_path / "config.json").write_bytes((folder / "config.json").read_bytes())
    again, hf_again = Tokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    for chat in CHATS.values():
        ids = hf.apply_chat_template(chat, tokenize=True, return_dict=False, add_generation_prompt=True)
        assert again.apply_chat_template(chat, tokenize=True, add_generation_prompt=True) == ids
        assert hf_again.apply_chat_template(chat, tokenize=True, return_dict=False, add_generation_prompt=True) == ids


def test_class_rebuild_options(tmp_path):
    """tokenizer_config.json options transformers 5 rebuilds from: legacy: true writes ▁ before every
    piece, add_prefix_space: false before none (null: as true), Qwen2's add_prefix_space: true a space
    first; add_bos_token / add_eos_token change nothing (the post-processor of tokenizer.json rules)."""
    from transformers import AutoTokenizer

    mistral, qwen = cf.mistral_folder(tmp_path / "mistral"), cf.qwen25_folder(tmp_path / "qwen")
    texts = ["Hello world", "<s>[INST] Hi there[/INST] yes</s>", "  two  spaces", "<|im_start|>user\nHi<|im_end|>"]
    for i, (base, change) in enumerate([(mistral, {"legacy": True}), (mistral, {"add_prefix_space": False}),
                                        (mistral, {"add_eos_token": True, "add_bos_token": False}),
                                        (mistral, {"add_prefix_space": None}), (qwen, {"add_prefix_space": True})]):
        config = json.loads((base / "tokenizer_config.json").read_text())
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / "tokenizer.json").write_bytes((base / "tokenizer.json").read_bytes())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
        ours, hf = Tokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(str(folder))
        for text in texts:
            for special in (False, True):
                assert ours.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
            ids = hf.encode(text)
            assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("chat", list(CHATS))
def test_sft_ids_are_the_templates(family, chat):
    """An SFT conversation's ids are transformers' apply_chat_template ids (the whole text encoded at
    once), and its mask covers each assistant message and the end-of-turn token after it, also where the
    template moves the system prompt (Mistral: to the last user message) or trims the content."""
    from rlcu.data.datasets import encode_sft_row

    name, _, ours, hf = family
    msgs = CHATS[chat] + ([{"role": "assistant", "content": " Fine. "}] if CHATS[chat][-1]["role"] != "assistant"
                          else [])
    ids, mask = encode_sft_row({"messages": msgs}, ours)
    assert ids == hf.apply_chat_template(msgs, tokenize=True, return_dict=False)
    trained = ours.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    last = msgs[-1]["content"].strip()
    assert last in trained and "add 1 and 2" not in trained and "What is" not in trained
    if name in END_OF_TURN:
        eot = END_OF_TURN[name]
        trained = trained.rstrip("\n")
        assert trained.endswith(eot) and trained[:-len(eot)].strip().endswith(last)
    assert mask[0] == 0


@pytest.mark.parametrize("kind", ["llama3", "mistral", "qwen25"])
@pytest.mark.parametrize("named", ["LlamaTokenizerFast", "PreTrainedTokenizerFast", "Qwen2Tokenizer", None])
@pytest.mark.parametrize("model_type", [None, "llama", "mistral", "qwen2", "qwen3"])
def test_the_class_transformers_picks(tmp_path, kind, named, model_type):
    """AutoTokenizer's class comes from tokenizer_config.json's tokenizer_class and config.json's
    model_type (Qwen2's own class always wins, Mistral's reads the file as it is, a byte-level file said
    to be a LlamaTokenizer is read as it is): rlcu picks the same and encodes the same."""
    from transformers import AutoTokenizer

    if model_type == "qwen2" and kind != "qwen25":
        pytest.skip("Qwen2Tokenizer forced onto another family's vocabulary")
    if kind == "mistral" and (named == "Qwen2Tokenizer" and model_type in (None, "llama", "qwen3")
                              or named is None and model_type == "qwen3"):
        pytest.skip("a byte-level pre-tokenizer over a ▁ vocabulary")
    folder = {"llama3": cf.llama3_folder, "mistral": cf.mistral_folder, "qwen25": cf.qwen25_folder}[kind](tmp_path)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config = {k: v for k, v in config.items() if k != "tokenizer_class"} | ({} if named is None else
                                                                          {"tokenizer_class": named})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if model_type is None:
        (folder / "config.json").unlink()
    else:
        model = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**model, "model_type": model_type}))
    ours, hf = Tokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(str(folder))
    assert ours.hf_class == type(hf).__name__
    for text in ["Hello  world", "<s>[INST] Hi there[/INST] yes</s>", "<|im_start|>user\nHi<|im_end|>", " x"]:
        ids = hf.encode(text, add_special_tokens=False)
        assert ours.encode(text) == ids
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_prompt_ids_are_the_templates(family):
    """A chat prompt's ids where rlcu makes them (data.datasets.encode_prompt for the length checks,
    train.rollout.encode_prompt for GRPO / PPO rollouts, the engine's LLM.chat through
    apply_chat_template) are transformers' apply_chat_template ids with the generation prompt."""
    from rlcu.data.datasets import encode_prompt
    from rlcu.train import rollout

    _, _, ours, hf = family
    for chat in (CHATS["single"], CHATS["system_multi"]):
        ref = hf.apply_chat_template(chat, tokenize=True, return_dict=False, add_generation_prompt=True)
        assert encode_prompt(ours, chat) == ref
        assert rollout.encode_prompt(ours, chat)[0] == ref


def test_text_prompt_takes_the_bos_as_vllm_encodes_it(family):
    """LLM.generate("text") encodes a text prompt as vLLM does (tokenizer(text): the post-processor's
    special tokens, Llama 3's <|begin_of_text|> and Mistral's <s>; Qwen2.5's adds none), so a base model
    sees the BOS it was trained with; the ids equal transformers' tokenizer(text)."""
    from rlcu.engine.llm import LLM

    name, folder, ours, hf = family
    engine = SimpleNamespace(tokenizer=ours, model=SimpleNamespace(cfg=SimpleNamespace(vocab_size=len(ours))),
                             max_model_len=4096)
    text = "What is 12 + 30?"
    want = hf(text)["input_ids"]
    for prompt in (text, {"prompt": text}):
        ids, problem = LLM._resolve(engine, 0, prompt)
        assert problem is None and ids == want, (name, ids, want)
    if name.startswith(("llama", "mistral")):
        assert ids[0] == ours.token_to_id("<|begin_of_text|>" if name.startswith("llama") else "<s>")
