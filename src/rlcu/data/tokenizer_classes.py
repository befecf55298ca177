"""What transformers 5 makes of a tokenizer.json before it encodes a word, so that rlcu's ids are the
ids `AutoTokenizer.from_pretrained(folder)` gives (a policy trained on ids its inference stack never
produces learns the wrong thing at every chat turn).

AutoTokenizer picks a class from tokenizer_config.json's tokenizer_class and config.json's model_type
(`transformers_class`): the model type's own class where it has one and the config names another
(Qwen2's always; Mistral's is the file read as it is, unless mistral-common is installed, which rlcu
does not follow), the file as it is for a LlamaTokenizer whose file is byte level (Llama 3 folders
that say LlamaTokenizer), else the named class. The file is read as it is for PreTrainedTokenizerFast
(Llama 3); a named class keeps its vocabulary, merges and post-processor but builds the rest itself:

- `LlamaTokenizer` (Llama 2; Mistral v0.3 in a folder without config.json): no normalizer, a Metaspace
  pre-tokenizer that writes "▁" before the first piece only (prepend_scheme "first"; "always" when the
  config says legacy: true, "never" when add_prefix_space: false). Llama 2's and Mistral's files put
  "▁" in the normalizer, which runs on every piece between added tokens: read as they are, "[INST] Hi"
  encodes as [INST] ▁ ▁Hi, rebuilt as [INST] ▁Hi.
- `Qwen2Tokenizer` (Qwen2, Qwen2.5, Qwen3): NFC, the Qwen2 split and byte level, with the config's
  add_prefix_space (the published files are that already, with add_prefix_space false).

The post-processor (Llama 3's and Mistral's add BOS) is always the file's: transformers 5 drops the
config's add_bos_token / add_eos_token when there is a tokenizer.json, and so does rlcu.
"""

from __future__ import annotations

from collections.abc import Mapping

from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers

_FILE_AS_IS = "TokenizersBackend"
_GENERIC = (_FILE_AS_IS, "PythonBackend", "PreTrainedTokenizerFast", "PreTrainedTokenizer", "MistralCommonBackend")
# transformers 5's tokenizer class of the model types of rlcu's families (none for llama: the config's rules)
_MODEL_TYPE_CLASS = {"mistral": _FILE_AS_IS, "mixtral": _FILE_AS_IS, "qwen2": "Qwen2Tokenizer",
                     "qwen2_moe": "Qwen2Tokenizer", "qwen3": "Qwen2Tokenizer", "qwen3_moe": "Qwen2Tokenizer"}
_CONFIG_CLASS_IGNORED = ("qwen2",)  # model types whose own class wins over tokenizer_config.json's
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _metaspace_scheme(config: Mapping) -> str:
    if config.get("add_prefix_space") is not None and not config["add_prefix_space"]:  # None means true
        return "never"
    return "always" if config.get("legacy", False) else "first"


def _rebuild_llama(backend: Tokenizer, config: Mapping) -> None:
    scheme = _metaspace_scheme(config)
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if scheme != "never":
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)


def _rebuild_qwen2(backend: Tokenizer, config: Mapping) -> None:
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space")), use_regex=False)])
    backend.decoder = decoders.ByteLevel()


def transformers_class(config: Mapping, model_type: str | None, byte_level: bool) -> str:
    """The class AutoTokenizer loads for tokenizer_config.json `config`, config.json's `model_type`
    (None: no config.json) and a tokenizer.json that is (`byte_level`) or is not byte level."""
    named = config.get("tokenizer_class")
    named = None if named is None else named.removesuffix("Fast")
    own = _MODEL_TYPE_CLASS.get(model_type or "")
    if named is None:
        return _FILE_AS_IS if own is None or own in _GENERIC else own
    if named == "LlamaTokenizer" and byte_level and model_type not in _CONFIG_CLASS_IGNORED:
        return _FILE_AS_IS
    if own is not None and own != named:
        if own in _GENERIC:
            return _FILE_AS_IS
        cls = own if model_type in _CONFIG_CLASS_IGNORED else named
        return _FILE_AS_IS if cls in _GENERIC else cls
    return _FILE_AS_IS if named in _GENERIC else named


def as_transformers_builds(backend: Tokenizer, config: Mapping, model_type: str | None = None) -> str:
    """Make `backend` (read from tokenizer.json) encode and decode as transformers 5's AutoTokenizer
    does for tokenizer_config.json `config` and config.json's `model_type` (None: a folder without
    config.json). Changes `backend` in place; returns the class transformers uses."""
    llama = (config.get("tokenizer_class") or "").removesuffix("Fast") == "LlamaTokenizer"
    cls = transformers_class(config, model_type, llama and '"ByteLevel"' in backend.to_str())
    if cls == "LlamaTokenizer":
        _rebuild_llama(backend, config)
    elif cls == "Qwen2Tokenizer":
        _rebuild_qwen2(backend, config)
    return cls
