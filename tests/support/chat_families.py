"""Tiny tokenizer folders in the form Llama 3.x, Mistral v0.3 and Qwen2.5 publish them: a BPE trained
here with the family's special tokens, pre-tokenizer and post-processor (Llama 3's and Mistral's add
their BOS), tokenizer_config.json with the family's tokenizer class and named tokens (no pad token for
Llama and Mistral), generation_config.json / config.json with the family's EOS ids, and the chat
templates of support.chat_family_templates. No download."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as Backend

from support.chat_family_templates import LLAMA31, LLAMA32, MISTRAL_V03, QWEN25

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


def _write(folder: Path, tk: Backend, tok_config: dict, eos_ids, gen_eos, bos_id, arch: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tk.save(str(folder / "tokenizer.json"))
    tok_config = {"added_tokens_decoder": _added(tk), **tok_config}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": bos_id, "eos_token_id": gen_eos}))
    model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}[arch]
    (folder / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": model_type,
                                                    "bos_token_id": bos_id, "eos_token_id": eos_ids}))
    return folder


def llama3_folder(folder: Path, template: str = LLAMA31) -> Path:
    """Llama 3.1 Instruct: eos_token <|eot_id|>, the ids <|end_of_text|>, <|eom_id|>, <|eot_id|> as EOS in
    config.json and generation_config.json, no pad token."""
    tk = llama3_backend()
    eos = [tk.token_to_id(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]
    cfg = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": template,
           "clean_up_tokenization_spaces": True, "model_input_names": ["input_ids", "attention_mask"],
           "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"}
    return _write(folder, tk, cfg, eos, eos, tk.token_to_id("<|begin_of_text|>"), "LlamaForCausalLM")


def llama3_base_folder(folder: Path) -> Path:
    """Llama 3.2 base: eos_token <|end_of_text|> (the only EOS id of its configs), a chat template all the
    same, whose turns end with <|eot_id|>."""
    tk = llama3_backend()
    cfg = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "chat_template": LLAMA32,
           "clean_up_tokenization_spaces": True, "model_max_length": 131072,
           "tokenizer_class": "PreTrainedTokenizerFast"}
    eos = tk.token_to_id("<|end_of_text|>")
    return _write(folder, tk, cfg, eos, eos, tk.token_to_id("<|begin_of_text|>"), "LlamaForCausalLM")


def mistral_folder(folder: Path, legacy: bool = True, model: bool = True) -> Path:
    """Mistral 7B Instruct v0.3: LlamaTokenizer class, add_bos_token true, eos </s>, no pad token.
    model: with config.json and generation_config.json (model_type mistral: transformers 5 reads
    tokenizer.json as it is), else the tokenizer's files alone (transformers rebuilds a LlamaTokenizer)."""
    tk = mistral_backend(legacy)
    cfg = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
           "unk_token": "<unk>", "chat_template": MISTRAL_V03, "clean_up_tokenization_spaces": False,
           "legacy": False, "model_max_length": 1000000000000000019884624838656, "pad_token": None,
           "sp_model_kwargs": {}, "spaces_between_special_tokens": False, "tokenizer_class": "LlamaTokenizer",
           "use_default_system_prompt": False}
    _write(folder, tk, cfg, 2, 2, 1, "MistralForCausalLM")
    if not model:
        (folder / "config.json").unlink()
        (folder / "generation_config.json").unlink()
    return folder


def qwen25_folder(folder: Path) -> Path:
    """Qwen2.5 Instruct: Qwen2Tokenizer class, no BOS, eos <|im_end|>, pad <|endoftext|>; its configs'
    EOS ids are <|im_end|> and <|endoftext|>."""
    tk = qwen25_backend()
    im_end, eot = tk.token_to_id("<|im_end|>"), tk.token_to_id("<|endoftext|>")
    cfg = {"add_prefix_space": False, "additional_special_tokens": QWEN2_SPECIALS[1:], "bos_token": None,
           "chat_template": QWEN25, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>",
           "errors": "replace", "model_max_length": 131072, "pad_token": "<|endoftext|>",
           "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}
    return _write(folder, tk, cfg, im_end, [im_end, eot], None, "Qwen2ForCausalLM")
