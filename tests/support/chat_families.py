"""Tiny tokenizer folders in the form Llama 3.x, Mistral v0.3 and Qwen2.5 publish them: a BPE trained
here with the family's special tokens, pre-tokenizer and post-processor (Llama 3's and Mistral's add
their BOS), tokenizer_config.json with the family's tokenizer class and named tokens (no pad token for
Llama and Mistral), generation_config.json / config.json with the family's EOS ids, and chat templates
written here in the shape the families publish (the features they use: bos_token in the template,
date_string / strftime_now, tools in the first user message or the system prompt, raise_exception on
role alternation, single tool calls, <tool_call> / <tool_response>). No download. The templates keep
the published line shapes, some longer than ruff's limit."""
# ruff: noqa: E501

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as Backend

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 30? The answer is 42. Add two numbers, then say the sum.",
    "Environment: ipython\nTools: get_weather, add\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024",
    "You are a helpful assistant. You are Qwen, created by Alibaba Cloud.",
    'Tools return JSON like {"name": "add", "arguments": {"a": 1, "b": 2}, "parameters": {"type": "object"}}.',
    "Ünïcödé text, emoji 🙂 and tabs\tand\nnewlines.  Double  spaces.",
]
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                    "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[control_8]"]
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>"]
QWEN2_PLAIN = ["<tool_call>", "</tool_call>"]  # added tokens that Qwen2.5 marks special: false

# ----------------------------------------------------------------------------- templates

# Llama 3.1 / 3.3 shape: bos_token first, a system header with the knowledge cut-off and date_string
# (a fixed default), tools in the first user message unless tools_in_user_message is false, single
# tool calls only, ipython results, <|eom_id|> after a builtin tool's call.
LLAMA31 = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- the system message, if any, comes out of the loop #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. Respond with a JSON for a function call " }}
    {{- 'in the form {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- tools go in the first user message #}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
            {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Llama 3.2 differs where the date comes from: strftime_now when the caller gives no date_string.
LLAMA32 = LLAMA31.replace(
    '{%- if not date_string is defined %}\n    {%- set date_string = "26 Jul 2024" %}\n{%- endif %}',
    '{%- if not date_string is defined %}\n    {%- if strftime_now is defined %}\n'
    '        {%- set date_string = strftime_now("%d %b %Y") %}\n    {%- else %}\n'
    '        {%- set date_string = "26 Jul 2024" %}\n    {%- endif %}\n{%- endif %}')

# Mistral v0.3 shape: roles must alternate (raise_exception), the system prompt joins the last user
# message, tools go before the last user message, tool call ids are 9 characters, bos_token first.
MISTRAL_V03 = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- roles alternate, tool messages aside #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

# Qwen2.5 shape: ChatML with a default system prompt, tools as <tools> JSON lines in the system turn,
# calls as <tool_call> JSON, consecutive tool results grouped in one user turn of <tool_response>s.
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments " }}
    {{- "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n" }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# ----------------------------------------------------------------------------- tokenizers


def _special(content: str, special: bool = True) -> AddedToken:
    return AddedToken(content, special=special, normalized=False)


def _byte_level_bpe(split: str, specials: list[str], normalizer=None) -> Backend:
    tk = Backend(models.BPE())
    if normalizer is not None:
        tk.normalizer = normalizer
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(CORPUS * 4, trainer)
    tk.add_special_tokens([_special(t) for t in specials])
    return tk


def llama3_backend() -> Backend:
    """Byte-level BPE whose post-processor adds <|begin_of_text|>, as Llama 3's tokenizer.json does."""
    tk = _byte_level_bpe(LLAMA3_SPLIT, LLAMA3_SPECIALS)
    bos = "<|begin_of_text|>"
    tk.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                      special_tokens=[(bos, tk.token_to_id(bos))])])
    return tk


def mistral_backend(legacy: bool = True) -> Backend:
    """SentencePiece-style BPE (▁ for spaces, byte fallback: <0x00>..<0xFF> after the control tokens),
    <s> added by the post-processor: Mistral v0.3's tokenizer.json. legacy: ▁ written by the normalizer
    (before every piece between added tokens, the form Llama 2's and Mistral's files have), else by a
    Metaspace pre-tokenizer before the first piece only (what transformers 5's LlamaTokenizer builds)."""
    tk = Backend(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                           special_tokens=MISTRAL_SPECIALS))
    spec = json.loads(tk.to_str())
    old = spec["model"]["vocab"]
    vocab = {t: i for i, t in enumerate(MISTRAL_SPECIALS + [f"<0x{b:02X}>" for b in range(256)])}
    for t, _ in sorted(old.items(), key=lambda kv: kv[1]):
        vocab.setdefault(t, len(vocab))
    spec["model"]["vocab"] = vocab
    spec["added_tokens"] = []
    tk = Backend.from_str(json.dumps(spec))
    if not legacy:
        tk.normalizer = None
        tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tk.add_special_tokens([_special(t) for t in MISTRAL_SPECIALS])
    tk.post_processor = processors.TemplateProcessing(single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1",
                                                      special_tokens=[("<s>", 1)])
    return tk


def qwen25_backend() -> Backend:
    tk = _byte_level_bpe(QWEN2_SPLIT, QWEN2_SPECIALS, normalizers.NFC())
    tk.add_tokens([_special(t, special=False) for t in QWEN2_PLAIN])
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    return tk


def _added(tk: Backend) -> dict:
    return {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                     "single_word": t.single_word, "special": t.special}
            for i, t in sorted(tk.get_added_tokens_decoder().items())}


def _write(folder: Path, tk: Backend, tok_config: dict, eos_ids, gen_eos, bos_id) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tk.save(str(folder / "tokenizer.json"))
    tok_config = {"added_tokens_decoder": _added(tk), **tok_config}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": bos_id, "eos_token_id": gen_eos}))
    (folder / "config.json").write_text(json.dumps({"bos_token_id": bos_id, "eos_token_id": eos_ids}))
    return folder


def llama3_folder(folder: Path, template: str = LLAMA31) -> Path:
    """Llama 3.1 Instruct: eos_token <|eot_id|>, the ids <|end_of_text|>, <|eom_id|>, <|eot_id|> as EOS in
    config.json and generation_config.json, no pad token."""
    tk = llama3_backend()
    eos = [tk.token_to_id(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]
    cfg = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": template,
           "clean_up_tokenization_spaces": True, "model_input_names": ["input_ids", "attention_mask"],
           "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"}
    return _write(folder, tk, cfg, eos, eos, tk.token_to_id("<|begin_of_text|>"))


def llama3_base_folder(folder: Path) -> Path:
    """Llama 3.2 base: eos_token <|end_of_text|> (the only EOS id of its configs), a chat template all the
    same, whose turns end with <|eot_id|>."""
    tk = llama3_backend()
    cfg = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "chat_template": LLAMA32,
           "clean_up_tokenization_spaces": True, "model_max_length": 131072,
           "tokenizer_class": "PreTrainedTokenizerFast"}
    eos = tk.token_to_id("<|end_of_text|>")
    return _write(folder, tk, cfg, eos, eos, tk.token_to_id("<|begin_of_text|>"))


def mistral_folder(folder: Path, legacy: bool = True) -> Path:
    """Mistral 7B Instruct v0.3: LlamaTokenizer class, add_bos_token true, eos </s>, no pad token."""
    tk = mistral_backend(legacy)
    cfg = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
           "unk_token": "<unk>", "chat_template": MISTRAL_V03, "clean_up_tokenization_spaces": False,
           "legacy": False, "model_max_length": 1000000000000000019884624838656, "pad_token": None,
           "sp_model_kwargs": {}, "spaces_between_special_tokens": False, "tokenizer_class": "LlamaTokenizer",
           "use_default_system_prompt": False}
    return _write(folder, tk, cfg, 2, 2, 1)


def qwen25_folder(folder: Path) -> Path:
    """Qwen2.5 Instruct: Qwen2Tokenizer class, no BOS, eos <|im_end|>, pad <|endoftext|>; its configs'
    EOS ids are <|im_end|> and <|endoftext|>."""
    tk = qwen25_backend()
    im_end, eot = tk.token_to_id("<|im_end|>"), tk.token_to_id("<|endoftext|>")
    cfg = {"add_prefix_space": False, "additional_special_tokens": QWEN2_SPECIALS[1:], "bos_token": None,
           "chat_template": QWEN25, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>",
           "errors": "replace", "model_max_length": 131072, "pad_token": "<|endoftext|>",
           "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}
    return _write(folder, tk, cfg, im_end, [im_end, eot], None)
