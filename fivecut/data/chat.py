"""Instruction data: conversations rendered with the model's chat template, each token marked for the loss.

    [data]
    source = "chats/*.jsonl"   # one conversation a line: {"messages": [{"role": "user", "content": "..."}, ...]}
    format = "chat"            # the tokenizer's own template; data.chat_template = "my.jinja" overrides it

A conversation is rendered with its template (Jinja, as Hugging Face and GGUF files carry it) into one
string, which the tokenizer encodes whole (no special tokens added: the template writes them). The
loss falls on what the assistant says and nothing else: for each assistant message i the template
renders messages[:i] with the generation prompt (`add_generation_prompt=True`: the prompt a model
answers after) and messages[:i+1] without it, and the characters between the two renderings (the
reply and whatever the template closes it with, e.g. `<|im_end|>`) are the reply's span. A token
whose first character lies in a span is a loss token (mask 1); the system, user and tool turns and
the template's headers are not (mask 0). That is what transformers' `return_assistant_tokens_mask`
marks for a template that wraps the same characters in `{% generation %}` (tests/test_chat.py
compares the two); templates without that tag, such as SmolLM2's, need no change here.

A template must render each conversation as a prefix of the next longer one (true of ChatML,
Llama and Mistral templates; not of one that rewrites earlier turns, e.g. dropping old reasoning):
one that does not is refused on the first conversation where it shows.

Every problem is a `DataError` naming the file and line and a fix (the CLI's exit 2).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fivecut.data.sources import DataError, Unit, field_value, jsonl_lines
from fivecut.train.tokenizer import FileTokenizer

FORMATS = ("text", "chat")
MESSAGES_FIELD = "messages"  # the JSONL field of a chat line: a list of {"role", "content"}
ASSISTANT = "assistant"
IGNORE = -100  # a target the loss skips (torch's ignore_index)


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and where it came from (for messages)."""

    text: str
    origin: str  # "the tokenizer of <file>" or a template file's path
    special_tokens: tuple[tuple[str, str], ...] = ()  # (name, text): bos_token and eos_token, as templates read them

    @property
    def digest(self) -> str:
        return hashlib.sha256(repr((self.text, self.special_tokens)).encode()).hexdigest()

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        variables = dict(self.special_tokens)
        return compiled(self.text).render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)


def run_template(data_format: str, template_file: str | None, tokenizer) -> ChatTemplate | None:
    """The template a run renders its conversations with (None: text data): `data.chat_template`'s
    file, else the tokenizer's own."""
    if data_format not in FORMATS:
        raise DataError(f"data.format={data_format!r}; choose one of {', '.join(FORMATS)}")
    if data_format == "text":
        if template_file:
            raise DataError('data.chat_template is set but data.format is "text"; set data.format="chat" or drop it')
        return None
    if not isinstance(tokenizer, FileTokenizer):  # a model's own (tokenizers) tokenizer gives each token's characters
        raise DataError(
            f'data.format="chat" needs a model\'s own tokenizer, not {tokenizer.name!r}; set data.tokenizer="auto" '
            "with model.init_from naming a Hugging Face folder or GGUF file"
        )
    special = tuple(sorted(tokenizer.special_tokens.items()))  # {{ bos_token }}, {{ eos_token }}
    if template_file:
        path = Path(template_file).expanduser()
        if not path.is_file():
            raise DataError(f"data.chat_template={template_file!r} is not a file; give the path of a Jinja template")
        return checked(ChatTemplate(path.read_text(), str(path), special))
    if not tokenizer.chat_template:
        raise DataError(
            f"the tokenizer of {tokenizer.source} has no chat template; set data.chat_template to a Jinja template "
            "file, or use a model whose tokenizer carries one"
        )
    return checked(ChatTemplate(tokenizer.chat_template, f"the tokenizer of {tokenizer.source}", special))


def checked(template: ChatTemplate) -> ChatTemplate:
    import jinja2

    try:
        compiled(template.text)
    except jinja2.TemplateError as err:
        raise DataError(f"chat template from {template.origin} is not valid Jinja ({err}); fix the template") from err
    return template


_TEMPLATES: dict[str, object] = {}  # template text -> compiled, once per process


def compiled(text: str):
    """The template compiled in a sandbox, with the globals chat templates use (jinja2, which comes
    with transformers, is imported only when chat data is read)."""
    if text not in _TEMPLATES:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[generation_tag(), "jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = template_exception
        _TEMPLATES[text] = env.from_string(text)
    return _TEMPLATES[text]


def template_exception(message: str):
    raise DataError(f"the chat template refused the conversation: {message}")


def generation_tag():
    """`{% generation %}...{% endgeneration %}` (transformers' marker of replies) renders its body;
    the replies' spans come from the prefixes here."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body)

    return Generation


# ---------------------------------------------------------------------------- one conversation


def conversation(value, where: str) -> list[dict]:
    """A JSONL line's messages, checked: a list of {role, content} strings with an assistant turn."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {MESSAGES_FIELD!r} is not a non-empty list of messages; fix that line")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(
                f"{where}: message {i} has no string 'role' and 'content'; give each message both, e.g. "
                '{"role": "user", "content": "..."}'
            )
    if not any(m["role"] == ASSISTANT for m in value):
        raise DataError(f"{where}: the conversation has no assistant turn (nothing to learn); add one or drop the line")
    return value


def assistant_spans(template: ChatTemplate, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, the character spans [a, b) of the assistant's replies)."""
    text = template.render(messages, add_generation_prompt=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != ASSISTANT:
            continue
        prompt = template.render(messages[:i], add_generation_prompt=True)
        upto = template.render(messages[: i + 1], add_generation_prompt=False)
        if not (upto.startswith(prompt) and text.startswith(upto)):
            raise DataError(
                f"{where}: the chat template from {template.origin} does not render this conversation turn by turn "
                "(a shorter one is not a prefix of it), so its replies cannot be found; give data.chat_template a "
                "template that keeps earlier turns as they are"
            )
        spans.append((len(prompt), len(upto)))
    return text, spans


def encode_conversation(tokenizer, template: ChatTemplate, messages: list[dict], where: str):
    """(ids, mask): the rendered conversation's ids and, per id, 1 where it belongs to a reply."""
    text, spans = assistant_spans(template, messages, where)
    encoding = tokenizer.tokenizer.encode(text, add_special_tokens=False)
    starts = np.fromiter((a for a, _ in encoding.offsets), dtype=np.int64, count=len(encoding.ids))  # [n]
    mask = np.zeros(len(encoding.ids), dtype=np.uint8)
    for a, b in spans:
        mask[(starts >= a) & (starts < b)] = 1
    return encoding.ids, mask


MESSAGES_FIX = 'give each line a "messages" list of {"role", "content"}, or fix that line'


def encode_chat_unit(unit: Unit, tokenizer, template: ChatTemplate) -> tuple[list[list[int]], list[np.ndarray]]:
    """Every conversation of a JSONL unit: (ids of each, loss mask of each)."""
    ids, masks = [], []
    for path, number, line in jsonl_lines(unit):
        where = f"{path}:{number}"
        messages = conversation(field_value(line, path, number, MESSAGES_FIELD, MESSAGES_FIX), where)
        one, mask = encode_conversation(tokenizer, template, messages, where)
        ids.append(one)
        masks.append(mask)
    return ids, masks
