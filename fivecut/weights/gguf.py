"""llama.cpp GGUF files as a `WeightSource`: the shape from the metadata, boxes read by rows.

    source = GGUFSource(Path("smollm2.Q4_1.gguf"))
    source.args.n_layers                                      # 30, from llama.block_count
    source.read("layers.0.attention.wq.weight", (slice(0, 64), slice(None)))  # [64, 576] fp32

`gguf.GGUFReader` memory-maps the file, so a read touches only the bytes of the rows it asks for.
A 2-D GGUF tensor is stored row by row ([out, in] in PyTorch order, blocks of a quantized type
running along `in`), so a box is read as: pick its rows (raw bytes), dequantize only those with
`gguf.quants.dequantize`, then narrow the columns.

Two layout differences from fivecut (and Hugging Face) are undone here:
  * shapes: GGUF lists dimensions innermost-first; they are reversed.
  * wq / wk: llama.cpp's converter interleaves the two halves of every head's rows (Meta's RoPE
    layout), so GGUF row h*hd + 2*i + j holds fivecut row h*hd + j*(hd/2) + i. A box of fivecut
    rows reads exactly the GGUF rows that hold them.

What is refused (`WeightsError` naming the file and the key or tensor): an architecture other
than "llama", mixture-of-experts llama files, RoPE scaling of any kind, a RoPE dimension other
than the head size, tensor types `gguf.quants` cannot dequantize, tensors fivecut has no place
for, and shapes that disagree with the metadata. The one tensor ignored is `rope_freqs.weight`
when every factor in it is 1 (it then leaves RoPE unchanged); any other factors are refused.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from fivecut.model.args import ModelArgs
from fivecut.train.tokenizer import FileTokenizer
from fivecut.weights.names import from_gguf
from fivecut.weights.source import Box, Request, WeightsError, expected_shapes, fill_each

ARCHITECTURE = "llama"
ROPE_FREQS = "rope_freqs.weight"  # llama-3.1-style per-frequency RoPE factors, [head_dim / 2]
PERMUTED_ROWS = ("wq.weight", "wk.weight")  # rows interleaved per head by llama.cpp's converter
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values added as special tokens
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> how text is split before byte-level BPE (see `pre_tokenizer`): "gpt2" is GPT-2's regex,
# "digits" every digit alone then GPT-2's regex, "llama3" Llama 3's regex
PRE_TOKENIZERS = {"smollm": "digits", "gpt-2": "gpt2", "default": "gpt2", "llama-bpe": "llama3", "llama3": "llama3"}


class GGUFSource:
    """A llama.cpp file of a dense Llama; see the module docstring for what is read and refused."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._reader = open_reader(self.path)
        self._fields = self._reader.fields
        tensors = {t.name: t for t in self._reader.tensors}
        self.args = self._args(tie_embeddings="output.weight" not in tensors)
        self._tensors = self._mapped(tensors)  # fivecut name -> gguf ReaderTensor
        self._shapes = {name: gguf_shape(t) for name, t in self._tensors.items()}
        self._check_shapes()
        self._tokenizer = None  # FileTokenizer, built on first use

    # ----- metadata ------------------------------------------------------

    def meta(self, key: str, default=None):
        """The value of metadata `key` (a str, number, bool or list), `default` when absent."""
        field = self._fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except (ValueError, IndexError) as err:  # a damaged string (not UTF-8) or array
            raise WeightsError(
                f"{self.path}: metadata {key!r} cannot be decoded ({err}); the file is damaged"
            ) from None

    def need(self, key: str):
        if key not in self._fields:
            raise WeightsError(f"{self.path} has no metadata {key!r}; it is not a complete {ARCHITECTURE} GGUF")
        return self.meta(key)

    def _float(self, key: str, default: float) -> float:
        """A float as its file wrote it: float32 values become the shortest decimal that reads back
        as the same float32 (9.999999747e-06 -> 1e-05)."""
        field = self._fields.get(key)
        if field is None:
            return default
        from gguf import GGUFValueType  # the gguf package only where a GGUF file is read

        value = field.contents()
        return float(str(np.float32(value))) if field.types[0] == GGUFValueType.FLOAT32 else float(value)

    def _args(self, tie_embeddings: bool) -> ModelArgs:
        self._check_architecture()
        dim, heads = self.need("llama.embedding_length"), self.need("llama.attention.head_count")
        self._check_rope(dim // heads)
        return ModelArgs(
            vocab_size=self.meta("llama.vocab_size") or self._token_count(),
            dim=dim,
            n_layers=self.need("llama.block_count"),
            n_heads=heads,
            n_kv_heads=self.meta("llama.attention.head_count_kv") or heads,
            ffn_dim=self.need("llama.feed_forward_length"),
            max_seq_len=self.meta("llama.context_length", 2048),
            rope_theta=self._float("llama.rope.freq_base", 10000.0),
            norm_eps=self._float("llama.attention.layer_norm_rms_epsilon", 1e-5),
            tie_embeddings=tie_embeddings,
        )

    def _token_count(self) -> int:
        field = self._fields.get("tokenizer.ggml.tokens")
        if field is None:
            raise WeightsError(f"{self.path} has neither llama.vocab_size nor tokenizer.ggml.tokens")
        return len(field.data)  # one index per token; no need to decode the strings

    def _check_architecture(self) -> None:
        found = self.meta("general.architecture")
        if found != ARCHITECTURE:
            raise WeightsError(
                f"{self.path}: general.architecture is {found!r}, not {ARCHITECTURE!r}; "
                f"fivecut imports Llama-architecture GGUF files"
            )
        if (self.meta("llama.expert_count") or 0) > 0:
            raise WeightsError(
                f"{self.path}: llama.expert_count is {self.meta('llama.expert_count')}; mixture-of-experts "
                f"llama GGUFs (Mixtral style) are not supported, only dense ones"
            )

    def _check_rope(self, head_dim: int) -> None:
        kind = self.meta("llama.rope.scaling.type", "none")
        if kind != "none":
            raise WeightsError(
                f"{self.path}: llama.rope.scaling.type is {kind!r}; fivecut implements unscaled RoPE only"
            )
        if self._float("llama.rope.scale_linear", 1.0) != 1.0:
            raise WeightsError(f"{self.path}: llama.rope.scale_linear is set; fivecut implements unscaled RoPE only")
        rope_dim = self.meta("llama.rope.dimension_count", head_dim)
        if rope_dim != head_dim:
            raise WeightsError(
                f"{self.path}: llama.rope.dimension_count is {rope_dim}, not the head size {head_dim}; "
                f"fivecut rotates every channel of a head"
            )

    # ----- tensors -------------------------------------------------------

    def _mapped(self, tensors: dict) -> dict:
        """fivecut name -> tensor, after refusing any tensor fivecut cannot place or dequantize."""
        mapped, unplaced = {}, []
        for gguf_name, tensor in tensors.items():
            name = from_gguf(gguf_name)
            if name is not None:
                mapped[name] = tensor
            elif not (gguf_name == ROPE_FREQS and self._neutral_rope_freqs(tensor)):
                unplaced.append(gguf_name)
        if unplaced:
            self._refuse_unplaced(unplaced)
        for tensor in mapped.values():
            self._check_type(tensor)
        return mapped

    def _refuse_unplaced(self, gguf_names: list[str]) -> None:
        rescales = ROPE_FREQS in gguf_names
        why = f" ({ROPE_FREQS} rescales RoPE's frequencies; fivecut's RoPE is unscaled)" if rescales else ""
        listed = ", ".join(gguf_names)
        raise WeightsError(f"{self.path} holds tensors fivecut's Llama has no place for: {listed}{why}")

    def _neutral_rope_freqs(self, tensor) -> bool:
        """Whether `rope_freqs.weight` ([head_dim/2] factors) leaves every frequency as it is."""
        return supported(tensor.tensor_type) and bool(np.all(dequantize(tensor.data, tensor.tensor_type) == 1.0))

    def _check_type(self, tensor) -> None:
        if not supported(tensor.tensor_type):
            raise WeightsError(
                f"{self.path}: tensor {tensor.name} is stored as {tensor.tensor_type.name}, which gguf.quants "
                f"cannot dequantize; supported types: {', '.join(supported_type_names())}"
            )

    def _check_shapes(self) -> None:
        expected = expected_shapes(self.args)
        missing = sorted(set(expected) - set(self._shapes))
        if missing:
            raise WeightsError(f"{self.path} lacks tensors the metadata's model needs: {', '.join(missing)}")
        for name, shape in self._shapes.items():
            if expected.get(name) != shape:
                raise WeightsError(
                    f"{self.path}: tensor {self._tensors[name].name} has shape {shape} (PyTorch order); "
                    f"the metadata's model expects {expected.get(name, 'no such tensor')}"
                )

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def buffer_shapes(self) -> dict[str, tuple[int, ...]]:
        return {}  # a llama GGUF holds parameters only

    def fill(self, requests: list[Request]) -> None:
        fill_each(self, requests)

    def read(self, name: str, box: Box) -> torch.Tensor:
        if name not in self._tensors:
            example = next(iter(self._tensors))
            raise WeightsError(f"{self.path} holds no tensor {name!r}; names are fivecut's, e.g. {example!r}")
        tensor, shape = self._tensors[name], self._shapes[name]
        ranges = box_ranges(box, shape, name)
        if len(shape) == 1:  # a norm: small, read whole
            values = dequantize(tensor.data, tensor.tensor_type)[ranges[0]]
        else:
            rows = self._stored_rows(name, ranges[0])
            values = dequantize(tensor.data[rows], tensor.tensor_type)[:, ranges[1]]  # [rows, in] -> [rows, cols]
        return torch.from_numpy(np.array(values, dtype=np.float32))  # a copy: the file stays read-only

    def _stored_rows(self, name: str, rows: range) -> slice | np.ndarray:
        """Which stored rows hold fivecut's `rows` of tensor `name`: the same ones except for wq/wk."""
        if not name.endswith(PERMUTED_ROWS):
            return slice(rows.start, rows.stop)
        return unpermuted_rows(np.arange(rows.start, rows.stop), self.args.head_dim)

    # ----- tokenizer -----------------------------------------------------

    def tokenizer(self):
        """The byte-level BPE tokenizer the metadata describes, None when it describes none."""
        if self._tokenizer is None and "tokenizer.ggml.model" in self._fields:
            try:
                tok = self._build_tokenizer()
            except WeightsError:
                raise
            except Exception as err:  # tokenizers raises its own exception type for a vocabulary it cannot use
                raise WeightsError(f"{self.path}: its tokenizer cannot be built ({err}); the file is damaged") from None
            template = self.meta("tokenizer.chat_template")  # the model's chat template (Jinja), when it has one
            special = {
                f"{kind}_token": tok.id_to_token(int(self.meta(f"tokenizer.ggml.{kind}_token_id")))
                for kind in ("bos", "eos")
                if self.meta(f"tokenizer.ggml.{kind}_token_id") is not None
            }
            eos = self.meta("tokenizer.ggml.eos_token_id")
            self._tokenizer = FileTokenizer(tok, eos, str(self.path), template, special)
        return self._tokenizer

    def _build_tokenizer(self):
        from tokenizers import Tokenizer, decoders, models, processors

        model = self.meta("tokenizer.ggml.model")
        if model != "gpt2":
            raise WeightsError(
                f"{self.path}: tokenizer.ggml.model is {model!r}; only 'gpt2' (byte-level BPE) is supported"
            )
        split = self._pre_tokenizer_kind()
        tokens = self.meta("tokenizer.ggml.tokens")
        vocab = {token: index for index, token in enumerate(tokens)}
        merges = [tuple(merge.split(" ", 1)) for merge in self.meta("tokenizer.ggml.merges", [])]
        # Llama 3 looks whole words up in the vocabulary before merging (llama.cpp does the same)
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=split == "llama3"))
        tok.pre_tokenizer = pre_tokenizer(split)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        tok.add_special_tokens(self._special_tokens(tokens))
        return tok

    def _pre_tokenizer_kind(self) -> str:
        pre = self.meta("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise WeightsError(f"{self.path}: tokenizer.ggml.pre is {pre!r}; supported: {', '.join(PRE_TOKENIZERS)}")
        return PRE_TOKENIZERS[pre]

    def _special_tokens(self, tokens: list[str]) -> list:
        """Control and user-defined tokens (<|im_start|>, ...), kept whole when encoding."""
        from tokenizers import AddedToken

        kinds = self.meta("tokenizer.ggml.token_type", [])
        return [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, kinds)
            if kind in (CONTROL, USER_DEFINED)
        ]


def open_reader(path: Path):
    from gguf import GGUFReader

    if not path.is_file():
        raise WeightsError(f"{path} is not a file; give a llama.cpp .gguf file")
    try:
        return GGUFReader(path, "r")
    except Exception as err:  # a cut or damaged file fails inside numpy in many ways (IndexError, ValueError, ...)
        raise WeightsError(f"{path} cannot be read as GGUF ({type(err).__name__}: {err}); is it whole?") from None


def gguf_shape(tensor) -> tuple[int, ...]:
    """PyTorch-order shape ([out, in]) of a tensor whose GGUF shape is listed innermost-first."""
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


def box_ranges(box: Box, shape: tuple[int, ...], name: str) -> tuple[range, ...]:
    """One range per dimension of `shape`; dimensions `box` leaves out are taken whole."""
    if len(box) > len(shape):
        raise WeightsError(f"box {box} has more dimensions than {name}'s shape {shape}")
    box = tuple(box) + (slice(None),) * (len(shape) - len(box))
    ranges = tuple(range(*part.indices(n)) for part, n in zip(box, shape))
    if any(r.step != 1 for r in ranges):
        raise WeightsError(f"box {box} of {name} has a step; boxes are contiguous")
    return ranges


def unpermuted_rows(rows: np.ndarray, head_dim: int) -> np.ndarray:
    """Stored rows [n] of llama.cpp's permuted wq/wk that hold fivecut's (rotate-half) rows [n].

    fivecut row h*hd + j*(hd/2) + i (head h, half j, pair i) is stored at h*hd + 2*i + j."""
    head, within = np.divmod(rows, head_dim)
    half, pair = np.divmod(within, head_dim // 2)
    return head * head_dim + 2 * pair + half


def dequantize(data: np.ndarray, qtype) -> np.ndarray:
    """fp32 values [..., n] of stored rows [..., bytes or n] of type `qtype`."""
    from gguf.quants import dequantize as gguf_dequantize

    return gguf_dequantize(data, qtype)


@functools.cache
def supported_type_names() -> tuple[str, ...]:
    """Names of the tensor types this gguf library can dequantize (found by trying one block)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    names = []
    for qtype in GGMLQuantizationType:
        if qtype in GGML_QUANT_SIZES and _dequantizes(qtype, GGML_QUANT_SIZES[qtype][1]):
            names.append(qtype.name)
    return tuple(names)


def _dequantizes(qtype, block_bytes: int) -> bool:
    try:
        dequantize(np.zeros((1, block_bytes), dtype=np.uint8), qtype)
    except NotImplementedError:  # gguf.quants' answer for a type it has no dequantizer for
        return False
    return True


def supported(qtype) -> bool:
    return qtype.name in supported_type_names()


def pre_tokenizer(kind: str):
    """The `tokenizers` pre-tokenizer of a kind in `PRE_TOKENIZERS`' values."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=kind != "llama3")
    if kind == "digits":  # SmolLM: every digit its own piece, then GPT-2's regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if kind == "llama3":
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"), byte_level])
    return byte_level
