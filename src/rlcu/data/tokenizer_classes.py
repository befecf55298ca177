"""What transformers 5 makes of a tokenizer.json before it encodes a word, so that rlcu's ids are the
ids transformers gives (a policy trained on ids its inference stack never produces learns the wrong
thing at every chat turn).

transformers 5 loads tokenizer.json as it is only for `PreTrainedTokenizerFast` (Llama 3). A named class
keeps the file's vocabulary, merges and post-processor but builds the rest itself:

- `LlamaTokenizer` (Llama 2, Mistral v0.1-v0.3): no normalizer, a Metaspace pre-tokenizer that writes
  "▁" before the first piece only (prepend_scheme "first"; "always" when the config says legacy: true,
  "never" when add_prefix_space: false). Mistral's and Llama 2's files put "▁" in the normalizer, which
  runs on every piece between added tokens: read as they are, "[INST] Hi" would encode as
  [INST] ▁ ▁Hi, where transformers (and mistral-common) give [INST] ▁Hi.
- `Qwen2Tokenizer` (Qwen2, Qwen2.5, Qwen3): NFC, the Qwen2 split and byte level, with the config's
  add_prefix_space; the published files are that already, so only add_prefix_space matters.

The post-processor (Llama 3's and Mistral's add BOS) is always the file's: transformers 5 drops the
config's add_bos_token / add_eos_token when there is a tokenizer.json, and so does rlcu.
"""

from __future__ import annotations

from collections.abc import Mapping

from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers

_LLAMA = ("LlamaTokenizer", "LlamaTokenizerFast")
_QWEN2 = ("Qwen2Tokenizer", "Qwen2TokenizerFast")
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
    """The published files already are what Qwen2Tokenizer builds with add_prefix_space false."""
    if not config.get("add_prefix_space"):
        return
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False)])
    backend.decoder = decoders.ByteLevel()


def as_transformers_builds(backend: Tokenizer, config: Mapping) -> None:
    """Make `backend` (read from tokenizer.json) encode and decode as transformers 5 does for
    tokenizer_config.json `config`. Changes `backend` in place."""
    cls = config.get("tokenizer_class")
    if cls in _LLAMA:
        _rebuild_llama(backend, config)
    elif cls in _QWEN2:
        _rebuild_qwen2(backend, config)
