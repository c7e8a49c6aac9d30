"""Cached decoding against the full forward and Hugging Face Llama; sampling, streaming, limits, the CLI glue."""

import argparse

import pytest
import torch

import fivecut.generate as generation
from fivecut.generate import (
    Sampling,
    TextStream,
    cmd_generate,
    generate,
    generate_ids,
    sample,
)
from fivecut.model.decode import decode, new_cache
from fivecut.model.presets import get_preset
from fivecut.model.transformer import apply_rope, build_model
from fivecut.train.tokenizer import ByteTokenizer, get_tokenizer
from fivecut.weights import names
from fivecut.weights.hf import llama_config

RTOL, ATOL = 1e-5, 1e-5
PRESET_NAMES = ["tiny", "tiny-gpt2", "tiny-moe"]  # GQA, tied GPT-2 vocabulary, MoE


def model_of(name: str):
    return build_model(get_preset(name), seed=0)


def random_tokens(vocab: int, b: int, s: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))  # [b, s]


def full_logits(model, tokens):
    with torch.inference_mode():
        return model(tokens)  # [b, s, vocab]


def greedy_by_reforward(model, prompt_ids: list[int], n: int) -> list[int]:
    """The reference: the whole sequence through the plain forward for every new token."""
    ids = list(prompt_ids)
    for _ in range(n):
        ids.append(int(full_logits(model, torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt_ids) :]


def assert_same_greedy(got: list[int], expected: list[int], next_logits) -> None:
    """`got` is `expected`, token for token; except that where the reference's logits of the two
    tokens differ by less than two roundings (2 * ATOL: the two computations may order them either
    way), either is right and the sequences part there (the rest is not compared).
    `next_logits(ids)`: the reference's logits [vocab] of the token after new ids `ids`."""
    for i, (mine, theirs) in enumerate(zip(got, expected)):
        if mine != theirs:
            logits = next_logits(expected[:i])
            gap = float(logits[theirs] - logits[mine])
            assert gap <= 2 * ATOL, f"new token {i}: {mine} instead of {theirs}, whose logit is {gap:.3g} higher"
            return
    assert len(got) == len(expected)


# ----- cached decoding equals the full forward ---------------------------------


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_prefill_then_steps_match_full_forward(name):
    model = model_of(name)
    tokens = random_tokens(model.args.vocab_size, 2, 24)  # [2, 24]
    full = full_logits(model, tokens)
    cache = new_cache(model, batch=2, max_len=24)
    prefill = decode(model, tokens[:, :10], cache)
    torch.testing.assert_close(prefill, full[:, :10], rtol=RTOL, atol=ATOL)
    for i in range(10, 24):
        step = decode(model, tokens[:, i : i + 1], cache)  # [2, 1, vocab]
        torch.testing.assert_close(step, full[:, i : i + 1], rtol=RTOL, atol=ATOL, msg=f"position {i}")
    assert cache.length == 24


def test_chunked_prefill_after_cached_prefix():
    """s > 1 new positions after a filled prefix: causal within the chunk, all of the prefix seen."""
    model = model_of("tiny")
    tokens = random_tokens(256, 1, 20)
    cache = new_cache(model, max_len=20)
    decode(model, tokens[:, :7], cache)
    chunk = decode(model, tokens[:, 7:15], cache)
    torch.testing.assert_close(chunk, full_logits(model, tokens)[:, 7:15], rtol=RTOL, atol=ATOL)


def test_cached_keys_are_rotated_at_their_absolute_positions():
    """A shift of every position by the same offset leaves all logits unchanged (RoPE sees only
    distances), so the logit tests cannot see it; the cached keys can."""
    model = model_of("tiny")
    tokens = random_tokens(256, 1, 12)
    cache = new_cache(model, max_len=12)
    decode(model, tokens[:, :5], cache)
    for i in range(5, 12):
        decode(model, tokens[:, i : i + 1], cache)
    block = model.layers["0"]
    with torch.inference_mode():
        k = block.attention.wk(block.attention_norm(model.tok_embeddings(tokens)))  # [1, 12, n_kv * hd]
        k = k.view(1, 12, -1, block.attention.head_dim).transpose(1, 2)  # [1, n_kv, 12, hd]
        expected = apply_rope(k, model.rope_cos[:12], model.rope_sin[:12])
    torch.testing.assert_close(cache.keys[0], expected, rtol=RTOL, atol=ATOL)


def test_last_only_prefill_gives_the_last_position():
    model = model_of("tiny-gpt2")
    tokens = random_tokens(model.args.vocab_size, 2, 9)
    last = decode(model, tokens, new_cache(model, batch=2, max_len=9), last_only=True)  # [2, 1, vocab]
    torch.testing.assert_close(last, full_logits(model, tokens)[:, -1:], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_greedy_equals_argmax_of_reforward_loop(name):
    model = model_of(name)
    prompt = random_tokens(model.args.vocab_size, 1, 6, seed=1)[0].tolist()
    got = generate_ids(model, prompt, 12).new_ids
    reforward = lambda ids: full_logits(model, torch.tensor([prompt + ids]))[0, -1]  # noqa: E731
    assert_same_greedy(got, greedy_by_reforward(model, prompt, 12), reforward)


# ----- against Hugging Face Llama --------------------------------------------


def hf_twin(model):
    """transformers' Llama with `model`'s weights (a tied head: only the embedding copied)."""
    transformers = pytest.importorskip("transformers")
    args = model.args
    config = transformers.LlamaConfig(**llama_config(args, eos=50256 if args.vocab_size == 50257 else None))
    hf = transformers.LlamaForCausalLM(config).eval()
    ours = {k: v for k, v in model.state_dict().items() if not (args.tie_embeddings and k == "output.weight")}
    missing, unexpected = hf.load_state_dict({names.to_hf(k): v for k, v in ours.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return hf


@pytest.mark.parametrize(
    "name, tokenizer, prompt", [("tiny", "byte", "The quick brown"), ("tiny-gpt2", "gpt2", "Once upon a time, a")]
)
def test_same_logits_and_greedy_tokens_as_transformers(name, tokenizer, prompt):
    model, tok = model_of(name), get_tokenizer(tokenizer)
    hf = hf_twin(model)
    ids = torch.tensor([tok.encode(prompt)])  # [1, p]
    with torch.inference_mode():
        theirs = hf(ids).logits
        torch.testing.assert_close(full_logits(model, ids), theirs, rtol=RTOL, atol=ATOL)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, pad_token_id=0)
    ours = generate(model, tok, prompt, 16)
    assert ours.prompt_ids == ids[0].tolist()
    with torch.inference_mode():
        hf_next = lambda new: hf(torch.tensor([ours.prompt_ids + new])).logits[0, -1]  # noqa: E731
        assert_same_greedy(ours.new_ids, out[0, ids.shape[1] :].tolist(), hf_next)


# ----- sampling ---------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    model, tok = model_of("tiny-gpt2"), get_tokenizer("gpt2")
    run = lambda seed: generate(model, tok, "Hello", 20, temperature=1.0, top_k=50, seed=seed).new_ids  # noqa: E731
    assert run(1) == run(1)
    assert run(1) != run(2)


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """softmax(logits / T) [b, vocab], computed apart from fivecut: with top_k, the k largest
    logits' probabilities renormalized, every other id 0."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_k:
        best = logits.topk(top_k, dim=-1).indices  # [b, k] (T > 0 keeps the order)
        probs = torch.zeros_like(probs).scatter(1, best, probs.gather(1, best))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs.float()


@pytest.fixture
def drawn(monkeypatch):
    """Every probability tensor handed to torch.multinomial, in order (the draw itself unchanged)."""
    seen, real = [], torch.multinomial

    def spy(probs, *args, **kwargs):
        seen.append(probs.detach().clone())
        return real(probs, *args, **kwargs)

    monkeypatch.setattr(torch, "multinomial", spy)
    return seen


SAMPLINGS = [(0.5, 0), (2.0, 0), (0.5, 5), (2.0, 5)]  # (temperature, top_k): T = 1 would hide 1/T vs T


@pytest.mark.parametrize("temperature, top_k", SAMPLINGS)
def test_sample_draws_from_softmax_of_logits_over_temperature(drawn, temperature, top_k):
    logits = 3 * torch.randn(3, 40, generator=torch.Generator().manual_seed(0))  # [b, vocab]
    tokens = sample(logits, Sampling(temperature, top_k), torch.Generator().manual_seed(7))  # [b, 1]
    (probs,) = drawn
    torch.testing.assert_close(probs, reference_probs(logits, temperature, top_k), rtol=1e-5, atol=1e-7)
    again = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(7))  # the given generator's draw
    assert torch.equal(tokens, again)


@pytest.mark.parametrize("temperature, top_k", SAMPLINGS)
def test_generation_samples_each_token_from_the_models_distribution(drawn, monkeypatch, temperature, top_k):
    """Each new token is the seeded generator's draw from softmax(logits / T) over the top k, where
    the logits are those of the text so far (the full forward's, to rounding). The probabilities are
    checked against the very logits the sampler got: a top-k cut between two logits that rounding
    orders either way is not this test's business."""
    seen, real_sample = [], generation.sample

    def noted(logits, *rest):
        seen.append(logits)
        return real_sample(logits, *rest)

    monkeypatch.setattr(generation, "sample", noted)
    model, tok = model_of("tiny"), get_tokenizer("byte")
    result = generate(model, tok, "To be", 8, temperature=temperature, top_k=top_k, seed=5)
    assert len(seen) == len(drawn) == len(result.new_ids) == 8
    generator = torch.Generator().manual_seed(5)
    for i, (logits, probs) in enumerate(zip(seen, drawn[:8])):  # (the replayed draws below are appended)
        text_so_far = torch.tensor([result.prompt_ids + result.new_ids[:i]])
        torch.testing.assert_close(logits, full_logits(model, text_so_far)[:, -1], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(probs, reference_probs(logits, temperature, top_k), rtol=1e-5, atol=1e-7)
        assert int(torch.multinomial(probs, 1, generator=generator)) == result.new_ids[i]


def test_top_k_one_is_greedy():
    model, tok = model_of("tiny"), get_tokenizer("byte")
    assert generate(model, tok, "abc", 10, temperature=0.7, top_k=1).new_ids == generate(model, tok, "abc", 10).new_ids


class ByteTokenizerWithEnd(ByteTokenizer):
    """Bytes, with one of them declared the end-of-text id."""

    def __init__(self, eot_id: int):
        self.eot_id = eot_id


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_stops_at_an_end_of_text_in_the_middle(temperature):
    """The first new token that did not come before, at position 4 or later, is made the end-of-text
    id: generation gives the same tokens up to it, keeps it, and produces nothing after it."""
    model = model_of("tiny")
    prompt = "Good morrow"
    free = generate(model, get_tokenizer("byte"), prompt, 16, temperature=temperature, seed=2).new_ids
    at = next(i for i in range(3, 16) if free[i] not in free[:i])
    tok, pieces, told = ByteTokenizerWithEnd(free[at]), [], []
    result = generate(model, tok, prompt, 16, temperature=temperature, seed=2, stream=pieces.append)
    assert result.new_ids == free[: at + 1]
    assert result.text == "".join(pieces) == tok.decode(free[: at + 1])
    ids = generate_ids(model, tok.encode(prompt), 16, Sampling(temperature, 0, 2), tok.eot_id, told.append)
    assert ids.new_ids == told == free[: at + 1]


def test_stops_at_end_of_text():
    """Greedy on a model whose head always prefers the end-of-text id stops after one token."""
    model, tok = model_of("tiny-gpt2"), get_tokenizer("gpt2")
    with torch.no_grad():
        model.tok_embeddings.weight[tok.eot_id] *= 500  # tied head: the eot row dominates every logit
    result = generate(model, tok, "Hello there", 10)
    assert result.new_ids == [tok.eot_id]
    assert result.tokens_per_s > 0


# ----- streaming --------------------------------------------------------------


def test_stream_holds_back_a_character_split_across_tokens():
    pieces = []
    stream = TextStream(get_tokenizer("byte"), pieces.append)
    for byte in "café é!".encode():
        stream.push(byte)
    stream.finish()
    assert "".join(pieces) == "café é!"
    assert "é" in pieces and all("\ufffd" not in p for p in pieces)  # é came whole, once complete


@pytest.mark.parametrize("name, tokenizer", [("tiny", "byte"), ("tiny-gpt2", "gpt2")])
def test_streamed_pieces_concatenate_to_the_text(name, tokenizer):
    """Random weights give random bytes, so partial UTF-8 characters occur."""
    pieces = []
    model, tok = model_of(name), get_tokenizer(tokenizer)
    result = generate(model, tok, "Voilà, é", 40, temperature=1.0, seed=3, stream=pieces.append)
    assert "".join(pieces) == result.text == tok.decode(result.new_ids)
    assert len(pieces) > 1


# ----- limits and arguments -----------------------------------------------------


def test_over_long_requests_raise():
    model, tok = model_of("tiny"), get_tokenizer("byte")  # max_seq_len 256
    with pytest.raises(ValueError, match="250 tokens.*10 new tokens.*max_seq_len 256"):
        generate(model, tok, "x" * 250, 10)
    cache = new_cache(model, max_len=8)
    decode(model, random_tokens(256, 1, 6), cache)
    with pytest.raises(ValueError, match="6 cached.*3 new.*8"):
        decode(model, random_tokens(256, 1, 3), cache)
    with pytest.raises(ValueError, match="300.*256"):
        new_cache(model, max_len=300)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=0), "max_new_tokens is 0"),
        (dict(temperature=-1.0), "temperature is -1.0"),
        (dict(top_k=-2), "top_k is -2"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    model, tok = model_of("tiny"), get_tokenizer("byte")
    with pytest.raises(ValueError, match=match):
        generate(model, tok, "abc", **{"max_new_tokens": 4, **kwargs})
    with pytest.raises(ValueError, match="empty"):
        generate(model, tok, "", 4)


def parse(*argv: str) -> argparse.Namespace:
    from fivecut.cli import build_parser

    return build_parser().parse_args(["generate", *argv])


@pytest.mark.parametrize("flag, value", [("--max-new-tokens", "0"), ("--temperature", "-0.5"), ("--top-k", "-1")])
def test_cli_rejects_bad_values_naming_the_flag(flag, value):
    ns = parse("--init-from", "somewhere", "--prompt", "hi", flag, value)
    with pytest.raises(ValueError, match=flag):
        cmd_generate(ns)
    with pytest.raises(ValueError, match="--step"):
        cmd_generate(parse("--init-from", "somewhere", "--prompt", "hi", "--step", "3"))


def test_cli_needs_exactly_one_source():
    with pytest.raises(SystemExit):
        parse("--prompt", "hi")
    with pytest.raises(SystemExit):
        parse("--checkpoint", "a", "--init-from", "b", "--prompt", "hi")
    assert parse("--checkpoint", "a", "--prompt", "hi").max_new_tokens == 32


def test_cli_streams_the_continuation(monkeypatch, capsys):
    model, tok = model_of("tiny"), get_tokenizer("byte")
    monkeypatch.setattr(generation, "single_model", lambda **kw: (model, tok))
    assert cmd_generate(parse("--init-from", "x", "--prompt", "Hi", "--temperature", "0", "--max-new-tokens", "8")) == 0
    out, err = capsys.readouterr()
    assert out == "Hi" + generate(model, tok, "Hi", 8).text + "\n"
    assert "8 tokens" in err and "tokens/s" in err
    with pytest.raises(ValueError, match="max_seq_len 256"):
        cmd_generate(parse("--init-from", "x", "--prompt", "Hi", "--max-new-tokens", "300"))
    assert capsys.readouterr().out == ""  # refused before the prompt is echoed


def test_sampling_record_defaults_to_greedy():
    assert Sampling() == Sampling(temperature=0.0, top_k=0, seed=0)
