"""Text generation with the key/value cache of `fivecut.model.decode`, and `fivecut generate`.

    result = generate(model, tokenizer, "Once upon a time", max_new_tokens=32)
    result.text, result.tokens_per_s

Greedy (temperature 0) takes the argmax; otherwise the next token is drawn from
softmax(logits / temperature), restricted to the top_k most likely (0: all), by a
`torch.Generator` seeded with `seed`, so the same seed gives the same text. Generation stops
after max_new_tokens or at the tokenizer's end-of-text id (which is kept in the new ids).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fivecut.model.decode import KVCache, decode, new_cache
from fivecut.model.transformer import Transformer
from fivecut.train.tokenizer import Tokenizer
from fivecut.weights.load import single_model

INCOMPLETE = "\ufffd"  # what a decoder gives for a UTF-8 character cut short


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits of the last position."""

    temperature: float = 0.0  # 0: greedy argmax
    top_k: int = 0  # 0: the whole vocabulary
    seed: int = 0


@dataclass(frozen=True)
class GenerationResult:
    prompt_ids: list[int]
    new_ids: list[int]
    text: str  # the decoded new ids (the prompt not included)
    prefill_s: float  # the prompt's forward and the first token's choice
    decode_s: float  # every later token

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second, prefill included."""
        return len(self.new_ids) / max(self.prefill_s + self.decode_s, 1e-9)


@dataclass
class TextStream:
    """Hands `sink` each new piece of the decoded text, holding back a cut-short character."""

    tokenizer: Tokenizer
    sink: Callable[[str], object]
    ids: list[int] = field(default_factory=list)
    emitted: str = ""

    def push(self, token_id: int) -> None:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith(INCOMPLETE):
            self._emit(text)

    def finish(self) -> None:
        """Emit what was held back (a character that never completed stays a U+FFFD)."""
        self._emit(self.tokenizer.decode(self.ids))

    def _emit(self, text: str) -> None:
        piece = text[len(self.emitted) :]
        self.emitted = text
        if piece:
            self.sink(piece)


# ----------------------------------------------------------------------------
# generation
# ----------------------------------------------------------------------------


def generate(
    model: Transformer,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    stream: Callable[[str], object] | None = None,
) -> GenerationResult:
    """Continue `prompt` by up to `max_new_tokens` tokens; `stream` receives the text as it grows."""
    sampling = Sampling(temperature, top_k, seed)
    prompt_ids = tokenizer.encode(prompt)
    if not prompt_ids:
        raise ValueError("the prompt is empty after tokenization; give at least one character of prompt")
    text_stream = TextStream(tokenizer, stream) if stream is not None else None
    on_token = text_stream.push if text_stream is not None else None
    result = generate_ids(model, prompt_ids, max_new_tokens, sampling, tokenizer.eot_id, on_token)
    if text_stream is not None:
        text_stream.finish()
    return GenerationResult(prompt_ids, result.new_ids, tokenizer.decode(result.new_ids), *result.seconds)


@dataclass(frozen=True)
class IdsResult:
    new_ids: list[int]
    seconds: tuple[float, float]  # (prefill, decode)


def generate_ids(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: Sampling | None = None,
    eot_id: int | None = None,
    on_token: Callable[[int], object] | None = None,
) -> IdsResult:
    """The token loop of `generate`: one prefill, then one cached step per new token; `on_token`
    is called with each new id. Greedy unless `sampling` says otherwise."""
    sampling = sampling or Sampling()
    check_sampling(max_new_tokens, sampling)
    check_length(model, len(prompt_ids), max_new_tokens)
    device = model.rope_cos.device
    cache = new_cache(model, batch=1, max_len=len(prompt_ids) + max_new_tokens)
    pick = _picker(sampling, device)
    t0 = time.perf_counter()
    token = pick(logits_after(model, prompt_ids, cache, device))  # [1, 1]
    new_ids = [int(token)]
    t1 = time.perf_counter()
    _tell(on_token, new_ids[-1])
    while len(new_ids) < max_new_tokens and new_ids[-1] != eot_id:
        token = pick(logits_after(model, prompt_ids + new_ids, cache, device))  # [1, 1]
        new_ids.append(int(token))
        _tell(on_token, new_ids[-1])
    return IdsResult(new_ids, (t1 - t0, time.perf_counter() - t1))


def logits_after(model: Transformer, ids: list[int], cache: KVCache, device: torch.device) -> torch.Tensor:
    """The next token's logits [1, 1, vocab] after `ids`, the cache holding the first cache.length of
    them: the rest through the cache; or every id again, the cache refilled, when the sequence's length
    changes the RoPE tables (LongRoPE past its original context, where transformers' Phi-3 drops its cache)."""
    if model.fit_rope(len(ids)):
        cache.length = 0
    return decode(model, torch.tensor([ids[cache.length :]], device=device), cache, last_only=True)


def _tell(on_token: Callable[[int], object] | None, token_id: int) -> None:
    if on_token is not None:
        on_token(token_id)


def _picker(sampling: Sampling, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """logits [1, s, vocab] -> the next token [1, 1], chosen from the last position."""
    if sampling.temperature == 0.0:
        return lambda logits: logits[:, -1].argmax(dim=-1, keepdim=True)
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    return lambda logits: sample(logits[:, -1], sampling, generator)


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """logits [b, vocab] -> tokens [b, 1] drawn from softmax(logits / T) over the top_k."""
    scaled = logits.float() / sampling.temperature  # [b, vocab]
    if 0 < sampling.top_k < scaled.shape[-1]:
        kth = scaled.topk(sampling.top_k, dim=-1).values[:, -1:]  # [b, 1] the k-th largest
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(dim=-1)  # [b, vocab]
    return torch.multinomial(probs, 1, generator=generator)  # [b, 1]


# ----------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------


def check_sampling(max_new_tokens: int, sampling: Sampling, flags: bool = False) -> None:
    """ValueError for an impossible request; `flags` names the CLI's flags instead of the arguments."""
    name = {"n": "--max-new-tokens", "t": "--temperature", "k": "--top-k"} if flags else {}
    if max_new_tokens < 1:
        raise ValueError(f"{name.get('n', 'max_new_tokens')} is {max_new_tokens}; ask for at least 1 new token")
    if not (math.isfinite(sampling.temperature) and sampling.temperature >= 0.0):
        raise ValueError(
            f"{name.get('t', 'temperature')} is {sampling.temperature}; give 0 for greedy decoding or a positive, "
            "finite value"
        )
    if sampling.top_k < 0:
        raise ValueError(f"{name.get('k', 'top_k')} is {sampling.top_k}; give 0 for the whole vocabulary or k >= 1")


DEVICES = "cpu, cuda (the current GPU) or cuda:N"


def checked_device(text: str) -> torch.device:
    """The device `--device` names, if generation can run on it here; ValueError naming the choices otherwise."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):  # torch's answer to a device string it cannot parse
        raise ValueError(f"--device {text!r} is not a device torch knows; choose {DEVICES}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"--device {text!r}: generate runs on {DEVICES}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        raise ValueError(f"--device {text!r}: this torch sees no CUDA GPU (a CPU-only build, or none visible); use cpu")
    if device.index is not None and device.index >= gpus:
        raise ValueError(f"--device {text!r}: this machine has {gpus} GPU(s), cuda:0 to cuda:{gpus - 1}")
    return device


def check_length(model: Transformer, prompt_len: int, max_new_tokens: int) -> None:
    limit = model.args.max_seq_len
    if prompt_len + max_new_tokens > limit:
        raise ValueError(
            f"a prompt of {prompt_len} tokens + {max_new_tokens} new tokens = {prompt_len + max_new_tokens} "
            f"exceeds the model's max_seq_len {limit}; shorten the prompt or ask for fewer new tokens"
        )


# ----------------------------------------------------------------------------
# fivecut generate
# ----------------------------------------------------------------------------


def cmd_generate(ns: argparse.Namespace) -> int:
    sampling = Sampling(ns.temperature, ns.top_k, ns.seed)
    check_sampling(ns.max_new_tokens, sampling, flags=True)
    if ns.step is not None and ns.checkpoint is None:
        raise ValueError("--step chooses a checkpoint's step; give it with --checkpoint DIR, not --init-from")
    device = checked_device(ns.device)
    model, tokenizer = single_model(init_from=ns.init_from, checkpoint=ns.checkpoint, step=ns.step, device=device)
    if tokenizer is None:
        raise ValueError(f"--init-from {ns.init_from} has no tokenizer (no tokenizer.json), so no text to continue")
    check_length(model, len(tokenizer.encode(ns.prompt)), ns.max_new_tokens)  # before anything is printed
    print(ns.prompt, end="", flush=True)
    result = generate(model, tokenizer, ns.prompt, ns.max_new_tokens, *_fields(sampling), stream=_stdout)
    print(flush=True)
    print(
        f"{len(result.new_ids)} tokens in {result.prefill_s + result.decode_s:.2f} s "
        f"({result.tokens_per_s:.1f} tokens/s; prompt {len(result.prompt_ids)} tokens, "
        f"prefill {result.prefill_s:.3f} s)",
        file=sys.stderr,
    )
    return 0


def _fields(sampling: Sampling) -> tuple[float, int, int]:
    return sampling.temperature, sampling.top_k, sampling.seed


def _stdout(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()
