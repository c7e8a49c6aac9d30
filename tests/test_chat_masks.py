"""Chat loss masks as transformers marks them (issue 42): where a template wraps the replies in
`{% generation %}` ... `{% endgeneration %}`, the spans are the markers' and a token is a loss token
when its characters overlap a span, so fivecut's mask is transformers' `assistant_masks` token for
token; a template without markers gives the spans found by rendering turn by turn, with the same
overlap rule.

The tokenizer is a byte-level BPE trained here, in the test, on replies that begin with spaces, so
that (as in SmolLM2's tokenizer) the newline closing a header and a reply's first space merge into
one token, `ĊĠ`, which straddles the start of the reply.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from fivecut.data.chat import ChatTemplate, encode_conversation
from fivecut.train.tokenizer import FileTokenizer

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = "the a cat dog sat ran on mat log sun moon red blue big small why how what yes no ok".split()
HEADER = "{{ '<|im_start|>' + message['role'] + '\\n' }}"
PROMPT = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"


def chatml(reply: str, other: str = "{{ message['content'] + '<|im_end|>\\n' }}") -> str:
    """A ChatML template whose assistant turn renders `reply` after the header, the others `other`."""
    return (
        "{% for message in messages %}"
        + HEADER
        + "{% if message['role'] == 'assistant' %}"
        + reply
        + "{% else %}"
        + other
        + "{% endif %}{% endfor %}"
        + PROMPT
    )


TEMPLATES = {
    # the markers wrap the reply, <|im_end|> and the newline after it (what fivecut's rule finds)
    "reply-end-newline": chatml("{% generation %}{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"),
    # the newline after <|im_end|> outside the markers: not a loss token
    "newline-outside": chatml("{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"),
    # the reply alone: neither <|im_end|> nor the newline
    "content-only": chatml("{% generation %}{{ message['content'] }}{% endgeneration %}{{ '<|im_end|>\\n' }}"),
    # SmolLM2's shape: a default system turn, whitespace control, the markers inside an expression's line
    "smollm2-like": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are a helpful cat<|im_end|>\\n' }}{% endif %}"
        + HEADER
        + "{%- if message['role'] == 'assistant' -%}{% generation %}{{ message['content'] + '<|im_end|>' }}"
        "{%- endgeneration -%}{%- else -%}{{ message['content'] + '<|im_end|>' }}{%- endif %}{{ '\\n' }}"
        "{% endfor %}" + PROMPT
    ),
}


def sentence(r: random.Random, lo: int, hi: int) -> str:
    return " ".join(r.choice(WORDS) for _ in range(r.randint(lo, hi)))


def reply(r: random.Random) -> str:
    """A reply, a third of them after two or three spaces (the header's newline and a space merge)."""
    return " " * r.choice([0, 0, 1, 2, 3]) + sentence(r, 2, 8)


def conversations(n: int, seed: int) -> list[list[dict]]:
    r = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": sentence(r, 2, 4)}] if r.random() < 0.3 else []
        for _ in range(r.randint(1, 3)):
            messages += [{"role": "user", "content": sentence(r, 1, 5)}, {"role": "assistant", "content": reply(r)}]
        out.append(messages)
    return out


def unmarked(template: str) -> str:
    return template.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def bpe_tokenizer():
    """A byte-level BPE (GPT-2's pre-tokenizer) trained on rendered conversations."""
    from jinja2 import Template
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bare = Template(unmarked(TEMPLATES["reply-end-newline"]))
    corpus = [bare.render(messages=m) for m in conversations(200, seed=9)]
    tok.train_from_iterator(corpus, trainer)
    return tok


@pytest.fixture(scope="module")
def tokenizers():
    """(fivecut's tokenizer, transformers' PreTrainedTokenizerFast) of the same BPE."""
    transformers = pytest.importorskip("transformers")
    tok = bpe_tokenizer()
    special = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    ours = FileTokenizer(tok, eot_id=2, source="test-bpe", special_tokens=special)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    return ours, theirs


def reference(theirs, template: str, messages: list[dict]) -> tuple[list[int], list[int]]:
    out = theirs.apply_chat_template(
        messages, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def straddles(tokenizer, ids: list[int]) -> int:
    """How many tokens hold both the header's newline and a reply's first space (`ĊĠ`)."""
    return sum(tokenizer.tokenizer.id_to_token(i) == "ĊĠ" for i in ids)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_masks_are_transformers_assistant_masks_token_for_token(tokenizers, name):
    """For each template with markers, over 40 conversations: the same ids and the same mask as
    transformers' `return_assistant_tokens_mask`, and the case each template is there for occurs."""
    ours, theirs = tokenizers
    template = ChatTemplate(TEMPLATES[name], "test", tuple(sorted(ours.special_tokens.items())))
    differ, straddling, tokens = [], 0, 0
    for k, messages in enumerate(conversations(40, seed=1)):
        ids, mask = encode_conversation(ours, template, messages, f"chats.jsonl:{k + 1}")
        expected_ids, expected = reference(theirs, TEMPLATES[name], messages)
        assert ids == expected_ids
        differ += [k + 1] * int(np.sum(mask != np.asarray(expected)))
        straddling += straddles(ours, ids)
        tokens += len(ids)
    assert straddling > 5  # the straddling token occurs (a reply after spaces)
    assert not differ, (
        f"{len(differ)} of {tokens} tokens differ from transformers' (conversations {sorted(set(differ))})"
    )


def test_a_template_without_markers_gives_the_marked_templates_mask(tokenizers):
    """The same template without its markers: the spans found by rendering turn by turn are the
    markers' spans, and the overlap rule gives the same masks."""
    ours, theirs = tokenizers
    marked = TEMPLATES["reply-end-newline"]
    bare = unmarked(marked)
    for messages in conversations(20, seed=3):
        _, with_markers = encode_conversation(ours, ChatTemplate(marked, "marked"), messages, "test")
        ids, without = encode_conversation(ours, ChatTemplate(bare, "bare"), messages, "test")
        assert without.tolist() == with_markers.tolist() == reference(theirs, marked, messages)[1]


def test_markers_inside_a_macro_are_refused(tokenizers):
    """A {% generation %} block inside a macro is rendered into the macro's buffer, so its offset in
    the output is not where it lands (transformers then marks the wrong characters): refused, naming
    the line, rather than a mask that is wrong."""
    from fivecut.data.sources import DataError

    ours, _ = tokenizers
    template = (
        "{% macro turn(m) %}" + HEADER.replace("message", "m") + "{% generation %}{{ m['content'] }}{% endgeneration %}"
        "{{ '<|im_end|>\\n' }}{% endmacro %}{% for message in messages %}{{ turn(message) }}{% endfor %}"
    )
    with pytest.raises(DataError, match=r"^chats.jsonl:3: the chat template from macro.jinja has a \{% generation"):
        encode_conversation(ours, ChatTemplate(template, "macro.jinja"), conversations(1, seed=1)[0], "chats.jsonl:3")
