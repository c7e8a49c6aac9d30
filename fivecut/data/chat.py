"""Instruction data: conversations rendered with the model's chat template, each token marked for the loss.

    [data]
    source = "chats/*.jsonl"   # one conversation a line: {"messages": [{"role": "user", "content": "..."}, ...]}
    format = "chat"            # the tokenizer's own template; data.chat_template = "my.jinja" overrides it

A conversation is rendered with its template (Jinja, as Hugging Face and GGUF files carry it) into one
string, which the tokenizer encodes whole (no special tokens added: the template writes them). The
loss falls on what the assistant says and nothing else. Its characters, the reply spans, come from
one of two rules:

- a template that marks the replies with `{% generation %}` ... `{% endgeneration %}` (transformers'
  markers): each span is the text its markers' body renders to, where it lands in the rendering;
- a template without markers: for each assistant message i the template renders messages[:i] with
  the generation prompt (`add_generation_prompt=True`: the prompt a model answers after) and
  messages[:i+1] without it, and the characters between the two renderings (the reply and whatever
  the template closes it with, e.g. `<|im_end|>`) are the reply's span.

A token is a loss token (mask 1) when its characters overlap a span, even in part (a token that
holds a header's newline and a reply's first space is one); the others are not (mask 0). With
markers, that is transformers' `assistant_masks` (`return_assistant_tokens_mask=True`) token for
token (tests/test_chat_masks.py); a template without markers gives the mask of the same template
with markers around the characters its rendering rule finds.

Without markers, a template must render each conversation as a prefix of the next longer one (true
of ChatML, Llama and Mistral templates; not of one that rewrites earlier turns, e.g. dropping old
reasoning): one that does not is refused on the first conversation where it shows (such a template
needs markers).

Every problem is a `DataError` naming the file and line and a fix (the CLI's exit 2), the template's
own `raise_exception` included. A build counts the conversations with no loss token: a store with
none is refused (`refuse_untrained`), and some are reported (`untrained_note`).
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


MASK_RULE = 2  # 2: markers' spans where there are markers, overlapping tokens (a store built by 1 is rebuilt)
Span = tuple[int, int]  # characters [a, b) of a rendering


class TemplateRefused(Exception):
    """The template's own `raise_exception(message)`: the conversation is not one it accepts."""


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and where it came from (for messages)."""

    text: str
    origin: str  # "the tokenizer of <file>" or a template file's path
    special_tokens: tuple[tuple[str, str], ...] = ()  # (name, text): bos_token and eos_token, as templates read them

    @property
    def digest(self) -> str:
        return hashlib.sha256(repr((MASK_RULE, self.text, self.special_tokens)).encode()).hexdigest()

    @property
    def marked(self) -> bool:
        """The template marks its replies with {% generation %} (their spans are the markers')."""
        return compiled(self.text)[1].marked

    def render(self, messages: list[dict], add_generation_prompt: bool, where: str) -> str:
        return self.rendered(messages, add_generation_prompt, where)[0]

    def rendered(self, messages: list[dict], add_generation_prompt: bool, where: str) -> tuple[str, list[Span]]:
        """(the rendering, the spans of its {% generation %} bodies); the template's refusal as a DataError."""
        import jinja2

        template, tag = compiled(self.text)
        variables = dict(self.special_tokens, messages=messages, add_generation_prompt=add_generation_prompt)
        try:
            with tag.tracking() as (streamed, found):
                for block in template.generate(**variables):  # the tag reads the output so far
                    streamed.append(block)
        except (TemplateRefused, jinja2.TemplateError) as err:
            raise DataError(
                f"{where}: the chat template from {self.origin} refused this conversation: {err}; fix that line "
                "(e.g. roles the template knows, in the order it expects) or set data.chat_template to a template "
                "that accepts it"
            ) from err
        text = "".join(streamed)
        return text, self.placed(text, found, where)

    def placed(self, text: str, found: list[tuple[int, str]], where: str) -> list[Span]:
        """The spans of the bodies found at their offsets, checked to hold them (a body rendered
        inside a macro or a {% set %} block is buffered: its offset is not its place)."""
        spans = [(a, a + len(body)) for a, body in found]
        if any(text[a:b] != body for (a, b), (_, body) in zip(spans, found)):
            raise DataError(
                f"{where}: the chat template from {self.origin} has a {{% generation %}} block inside a macro or "
                "a {% set %} block, so where its text lands is not known; move the markers to the template's top "
                "level (around the expression that writes the reply)"
            )
        return spans


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


_TEMPLATES: dict[str, tuple] = {}  # template text -> (compiled, its generation tag), once per process


def compiled(text: str) -> tuple:
    """(the template compiled in a sandbox with the globals chat templates use, its {% generation %}
    extension); jinja2, which comes with transformers, is imported only when chat data is read."""
    if text not in _TEMPLATES:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        tag = generation_tag()
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[tag, "jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = template_exception
        _TEMPLATES[text] = (env.from_string(text), env.extensions[tag.identifier])
    return _TEMPLATES[text]


def template_exception(message: str):
    raise TemplateRefused(message)


def generation_tag():
    """`{% generation %}...{% endgeneration %}`, transformers' marker of replies: it renders its body
    and, while a rendering is tracked, records (offset, body), the offset being the length of the
    output streamed so far (as transformers' AssistantTracker counts it)."""
    from contextlib import contextmanager

    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            self.marked = False  # the template has the tag
            self.found: list[tuple[int, str]] | None = None  # (offset, body) of each, while tracked
            self.streamed: list[str] = []  # the output so far, while tracked

        def parse(self, parser):
            self.marked = True
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("reply"), [], [], body).set_lineno(lineno)

        def reply(self, caller) -> str:
            body = caller()
            if self.found is not None:
                self.found.append((sum(map(len, self.streamed)), body))
            return body

        @contextmanager
        def tracking(self):
            self.found, self.streamed = [], []
            try:
                yield self.streamed, self.found
            finally:
                self.found, self.streamed = None, []

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


def assistant_spans(template: ChatTemplate, messages: list[dict], where: str) -> tuple[str, list[Span]]:
    """(the rendered conversation, the character spans [a, b) of the assistant's replies): the
    markers' where the template has them, else those found by rendering turn by turn."""
    text, marked = template.rendered(messages, False, where)
    return (text, marked) if template.marked else (text, rendered_spans(template, messages, text, where))


def rendered_spans(template: ChatTemplate, messages: list[dict], text: str, where: str) -> list[Span]:
    """Each reply's span: the characters between messages[:i] with the generation prompt and messages[:i+1]."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != ASSISTANT:
            continue
        prompt = template.render(messages[:i], True, where)
        upto = template.render(messages[: i + 1], False, where)
        if not (upto.startswith(prompt) and text.startswith(upto)):
            raise DataError(
                f"{where}: the chat template from {template.origin} does not render this conversation turn by turn "
                "(a shorter one is not a prefix of it), so its replies cannot be found; give data.chat_template a "
                "template that keeps earlier turns as they are, or mark its replies with {% generation %}"
            )
        spans.append((len(prompt), len(upto)))
    return spans


def overlap_mask(offsets: list[Span], spans: list[Span]) -> np.ndarray:
    """1 for each token whose characters [s, e) overlap a span, as transformers marks them: a token
    is held against the first span that ends after its start, and is in it if it ends after that
    span's start (the spans come in order)."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    if not spans or not offsets:
        return mask
    tokens = np.asarray(offsets, dtype=np.int64)  # [n, 2]
    a, b = np.asarray(spans, dtype=np.int64).T  # [spans] each
    first = np.searchsorted(b, tokens[:, 0], side="right")  # the first span that ends after the token's start
    inside = first < len(b)
    mask[inside] = tokens[inside, 1] > a[first[inside]]
    return mask


def encode_conversation(tokenizer, template: ChatTemplate, messages: list[dict], where: str):
    """(ids, mask): the rendered conversation's ids and, per id, 1 where it overlaps a reply."""
    text, spans = assistant_spans(template, messages, where)
    encoding = tokenizer.tokenizer.encode(text, add_special_tokens=False)
    return encoding.ids, overlap_mask(encoding.offsets, spans)


MESSAGES_FIX = 'give each line a "messages" list of {"role", "content"}, or fix that line'


def encode_chat_unit(unit: Unit, tokenizer, template: ChatTemplate) -> tuple[list, list[np.ndarray], list[str]]:
    """Every conversation of a JSONL unit: (ids of each, loss mask of each, file:line of each with no
    loss token)."""
    ids, masks, untrained = [], [], []
    for path, number, line in jsonl_lines(unit):
        where = f"{path}:{number}"
        messages = conversation(field_value(line, path, number, MESSAGES_FIELD, MESSAGES_FIX), where)
        one, mask = encode_conversation(tokenizer, template, messages, where)
        ids.append(one)
        masks.append(mask)
        if not mask.any():
            untrained.append(where)
    return ids, masks, untrained


# ---------------------------------------------------------------------------- a whole store


@dataclass
class Targets:
    """A build's count of loss tokens and of the conversations that have none."""

    conversations: int = 0
    tokens: int = 0  # loss tokens (mask 1)
    untrained: int = 0  # conversations without one
    first: str | None = None  # the first of those: file:line

    def add(self, conversations: int, mask: np.ndarray | None, untrained: list[str]) -> None:
        self.conversations += conversations
        self.tokens += 0 if mask is None else int(np.count_nonzero(mask))
        self.untrained += len(untrained)
        self.first = self.first or (untrained[0] if untrained else None)


def refuse_untrained(targets: Targets, files: list[str], template: ChatTemplate) -> None:
    """A store in which no token is a loss token trains at loss 0: refused, naming the source and the template."""
    if targets.tokens:
        return
    named = files[0] if len(files) == 1 else f"{files[0]} and the {len(files) - 1} other files of data.source"
    raise DataError(
        f"{named}: the chat template from {template.origin} marks no token of any conversation for the loss (it "
        "renders no assistant reply, or its {% generation %} markers wrap nothing), so a run would train on "
        "nothing; set data.chat_template to a template that writes the assistant's turns"
    )


def untrained_note(targets: Targets, store: str, template: ChatTemplate) -> str | None:
    """The build's warning line when some conversations have no loss token (None when all have one)."""
    if not targets.untrained:
        return None
    return (
        f"fivecut: warning: token store {store}: {targets.untrained:,} of the {targets.conversations:,} "
        f"conversations tokenized have no token the loss trains on (the first: {targets.first}); the chat template "
        f"from {template.origin} renders no reply text in them: fix or drop those lines, or change the template"
    )
