"""Instruction data (issue 36, item 6): conversations rendered with the model's chat template, the
loss on the assistant's replies only, through every form of the loss and every layout.

The tests build their own tiny model: a random `LlamaForCausalLM` saved with save_pretrained, with
a word-level tokenizer (ChatML's special tokens) and a chat template that marks the replies with
`{% generation %}`, so that transformers' `return_assistant_tokens_mask` is the reference for the masks.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

from fivecut.cli import main
from fivecut.config import load_config
from fivecut.data.chat import IGNORE, ChatTemplate, encode_conversation, run_template
from fivecut.data.store import BuildOptions, open_store
from fivecut.launch import spawn
from fivecut.parallel.parallelize import token_loss_sum
from fivecut.train.run import forward_backward, setup

SPECIAL = ["[UNK]", "<|im_start|>", "<|im_end|>"]  # <|im_end|> is id 2: the model's eos, the store's separator
ROLES = ["system", "user", "assistant"]
WORDS = "the a cat dog sat ran on mat log sun moon red blue big small why how what yes no ok".split()
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>\\n' }}"
    "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def word_tokenizer():
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(SPECIAL + ROLES + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL[1:]])
    return tok


def save_model(folder, template: str | None = TEMPLATE) -> None:
    """A random Llama of the tokenizer's vocabulary (64 wide, 2 layers, 4 heads, 2 kv heads), its
    tokenizer.json and (unless None) its chat template."""
    transformers = pytest.importorskip("transformers")
    tok = word_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)  # logits far from uniform, so a token in or out of the loss shows
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)


def sentence(r: random.Random, lo: int, hi: int) -> str:
    return " ".join(r.choice(WORDS) for _ in range(r.randint(lo, hi)))


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """Conversations of 1 to 2 exchanges, some with a system turn; replies longer than questions."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": sentence(r, 2, 4)}] if r.random() < 0.3 else []
        for _ in range(r.randint(1, 2)):
            messages.append({"role": "user", "content": sentence(r, 2, 6)})
            messages.append({"role": "assistant", "content": sentence(r, 3, 10)})
        out.append(messages)
    return out


def write_jsonl(path, chats: list[list[dict]]) -> str:
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    return str(path)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat-model")
    save_model(folder)
    return folder


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("chats") / "chats.jsonl", conversations(300))


def chat_sets(model, source, cache) -> list[str]:
    return [
        f'model.init_from="hf:{model}"',
        'data.tokenizer="auto"',
        'data.format="chat"',
        f'data.source="{source}"',
        f'data.cache_dir="{cache}"',
        "data.val_fraction=0.2",
        "train.seq_len=32",
        "train.global_batch=8",
    ]


# ---------------------------------------------------------------- rendering and masks


def test_masks_are_transformers_assistant_masks(chat_model):
    """Ids and masks of each conversation equal transformers' apply_chat_template with
    return_assistant_tokens_mask (the template marks the replies with {% generation %})."""
    transformers = pytest.importorskip("transformers")
    from fivecut.weights.load import source_of

    ours = source_of(f"hf:{chat_model}").tokenizer()
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=word_tokenizer(), chat_template=TEMPLATE)
    template = ChatTemplate(ours.chat_template, "test")
    for messages in conversations(20, seed=1):
        ids, mask = encode_conversation(ours, template, messages, "test")
        out = theirs.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids == list(out["input_ids"])
        assert mask.tolist() == list(out["assistant_masks"])
        assert 0 < mask.sum() < len(mask)


def test_templates_read_the_tokenizers_bos_and_eos_tokens(tmp_path):
    """`{{ bos_token }}` and `{{ eos_token }}` (Llama 3's and Mistral's templates use them) render as the
    folder's tokenizer_config.json names them, as in transformers, not as empty strings."""
    transformers = pytest.importorskip("transformers")
    from fivecut.weights.load import source_of

    template = "{{ bos_token }}" + TEMPLATE.replace("'<|im_end|>\\n'", "eos_token + '\\n'")
    save_model(tmp_path, template)
    special = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(special))
    ours = source_of(f"hf:{tmp_path}").tokenizer()
    assert ours.special_tokens == special
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_object=word_tokenizer(), chat_template=template, bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    messages = conversations(1, seed=2)[0]
    ids, _ = encode_conversation(ours, run_template("chat", None, ours), messages, "test")
    assert ids == list(theirs.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
    assert ids[0] == 1 and ids.count(2) == len(messages)  # the bos, and an eos closing every turn


def test_the_store_keeps_masks_beside_the_ids_checked_by_sha256(chat_model, chats, tmp_path):
    from fivecut.weights.load import source_of

    tok = source_of(f"hf:{chat_model}").tokenizer()
    template = ChatTemplate(tok.chat_template, "test")
    store = open_store(chats, tok, tmp_path, BuildOptions(chat=template, progress=False))
    record = store.meta["shards"][0]
    assert store.meta["format"] == "chat" and record["mask"] == "shard-00000.mask"
    ids, mask = np.asarray(store.tokens()), np.asarray(store.tokens().loss_mask())
    expected_ids, expected_mask = [], []
    for i, messages in enumerate(conversations(300)):
        one, keep = encode_conversation(tok, template, messages, "test")
        expected_ids += ([] if i == 0 else [tok.eot_id]) + list(one)
        expected_mask += ([] if i == 0 else [0]) + keep.tolist()
    assert ids.tolist() == expected_ids and mask.tolist() == expected_mask
    options = BuildOptions(chat=template, progress=False, workers=2, unit_bytes=4096, shard_tokens=3000)
    parallel = open_store(chats, tok, tmp_path / "parallel", options)  # two worker processes, several shards
    assert len(parallel.meta["shards"]) > 1
    assert np.asarray(parallel.tokens().loss_mask()).tolist() == expected_mask
    (store.folder / record["mask"]).write_bytes(bytes(len(mask)))  # every token out of the loss
    with pytest.raises(ValueError, match="shard-00000.mask does not match the sha256"):
        open_store(chats, tok, tmp_path, BuildOptions(chat=template, progress=False))


def test_a_template_file_stands_in_for_the_tokenizers(tmp_path, chats):
    """data.chat_template: a tokenizer without a template reads chat data with the file's, to the
    same store as a tokenizer that carries that template."""
    from fivecut.train.data import load_sources
    from fivecut.weights.load import run_tokenizer

    (tmp_path / "bare").mkdir()
    save_model(tmp_path / "bare", template=None)
    (tmp_path / "template.jinja").write_text(TEMPLATE)
    sets = chat_sets(tmp_path / "bare", chats, tmp_path / "cache") + [
        f'data.chat_template="{tmp_path / "template.jinja"}"'
    ]
    cfg = load_config(None, sets)
    (split,) = load_sources(cfg.data, run_tokenizer(cfg.data.tokenizer, cfg.model.init_from))
    assert split.train_mask is not None and 0 < np.asarray(split.train_mask).mean() < 1
    (tmp_path / "own").mkdir()
    save_model(tmp_path / "own")
    cfg = load_config(None, chat_sets(tmp_path / "own", chats, tmp_path / "cache-own"))  # built again
    (own,) = load_sources(cfg.data, run_tokenizer(cfg.data.tokenizer, cfg.model.init_from))
    assert own.content == split.content


# ---------------------------------------------------------------- the loss


def first_step(cfg):
    """The trainer's step-1 loss on one process, and the same from the model's logits by hand:
    the cross-entropy of the replies' tokens over their number; and that of every token."""
    ctx = setup(cfg)
    inputs, targets = ctx.sampler.global_batch(1)
    with torch.no_grad():
        logits = ctx.par.module(inputs)
        kept = targets != IGNORE
        replies = float(token_loss_sum(logits, targets)) / int(kept.sum())
        unmasked = ctx.sampler.rows(1)[:, 1:]  # the same targets, none left out
        every = float(token_loss_sum(logits, torch.from_numpy(unmasked))) / unmasked.size
    return float(forward_backward(ctx, 1)), replies, every, int(kept.sum()), kept.numel()


@pytest.mark.multirank
def test_the_loss_is_the_replies_own(chat_model, chats, tmp_path):
    """The trainer's loss is the replies' mean token loss: it fails when a masked token leaks into
    the loss or into the normaliser."""
    sets = chat_sets(chat_model, chats, tmp_path / "cache") + ["train.eval_every=0", "train.loss_chunk_tokens=0"]
    for chunk in (0, 16):  # the full logits and the chunked head
        sets[-1] = f"train.loss_chunk_tokens={chunk}"
        loss, replies, every, kept, total = spawn(first_step, 1, load_config(None, sets))[0]
        assert 0 < kept < total
        assert loss == pytest.approx(replies, rel=1e-5)
        assert abs(loss - every) > 1e-3 * every  # far beyond the tolerance: the mask shows


LAYOUTS = [
    ("dp=2", ["train.accumulate=2"]),
    ("tp=2", []),  # the vocabulary-parallel loss, chunked
    ("pp=2,pp_schedule=1f1b,microbatches=2", []),  # the loss on the last stage
    pytest.param("tp=2,sp=true", ["train.loss_chunk_tokens=0"], marks=pytest.mark.sweep),
    pytest.param("cp=2,cp_mode=ring", [], marks=pytest.mark.sweep),
    pytest.param("dp=2,zero=3", ["train.accumulate=2"], marks=pytest.mark.sweep),
]


@pytest.mark.multirank
@pytest.mark.parametrize(("layout", "extra"), LAYOUTS)
def test_verify_passes_with_loss_masks(capsys, chat_model, chats, tmp_path, layout, extra):
    """Every layout gives the single process's losses, gradient norms and validation loss (held-out
    conversations, same masks): the normaliser is the global batch's, not a rank's."""
    argv = ["verify", "--model", f"hf:{chat_model}", "--layout", layout, "--steps", "3"]
    sets = chat_sets(chat_model, chats, tmp_path / "cache")[2:] + extra
    code = main(argv + [arg for s in sets for arg in ("--set", s)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert code == 0 and last.startswith("PASS"), last


# ---------------------------------------------------------------- bad input


def refused(capsys, tmp_path, model, *sets: str) -> str:
    argv = ["train"]
    base = chat_sets(model, "", tmp_path / "cache")[:3] + [
        f'data.cache_dir="{tmp_path / "cache"}"',
        f'log.out_dir="{tmp_path / "out"}"',
        "train.steps=1",
        "train.warmup=0",
        "log.progress=false",
    ]
    for item in (*base, *sets):
        argv += ["--set", item]
    capsys.readouterr()
    assert main(argv) == 2
    assert not dist.is_initialized()  # refused before any process group
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def test_a_chat_with_no_assistant_turn(capsys, chat_model, tmp_path):
    chats = conversations(3)
    chats[1] = [m for m in chats[1] if m["role"] != "assistant"]
    path = write_jsonl(tmp_path / "bad.jsonl", chats)
    err = refused(capsys, tmp_path, chat_model, f'data.source="{path}"')
    assert f"{path}:2: the conversation has no assistant turn" in err and "add one" in err


def test_a_message_without_role_or_content(capsys, chat_model, tmp_path):
    chats = conversations(3)
    chats[2][0] = {"role": "user", "text": "the cat"}
    path = write_jsonl(tmp_path / "bad.jsonl", chats)
    err = refused(capsys, tmp_path, chat_model, f'data.source="{path}"')
    assert f"{path}:3: message 0 has no string 'role' and 'content'" in err


def test_a_line_without_messages(capsys, chat_model, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": conversations(1)[0]}) + "\n" + json.dumps({"text": "hi"}) + "\n")
    err = refused(capsys, tmp_path, chat_model, f'data.source="{path}"')
    assert f"{path}:2 has no field 'messages' (it has: text)" in err and '"messages" list' in err


def test_a_template_the_tokenizer_does_not_have(capsys, tmp_path):
    folder = tmp_path / "model"
    save_model(folder, template=None)
    path = write_jsonl(tmp_path / "chats.jsonl", conversations(3))
    err = refused(capsys, tmp_path, folder, f'data.source="{path}"')
    assert f"the tokenizer of {folder / 'tokenizer.json'} has no chat template" in err
    assert "set data.chat_template" in err


def test_a_chat_template_file_that_does_not_exist(capsys, chat_model, tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", conversations(3))
    err = refused(capsys, tmp_path, chat_model, f'data.source="{path}"', f'data.chat_template="{tmp_path / "no.j2"}"')
    assert "data.chat_template=" in err and "is not a file" in err


# ---------------------------------------------------------------- the SmolLM2 example


def instruction_set(n: int) -> list[list[dict]]:
    """Small arithmetic and spelling exchanges in English, one or two a conversation."""
    r = random.Random(0)
    out = []
    for _ in range(n):
        messages = []
        for _ in range(r.randint(1, 2)):
            a, b = r.randint(1, 20), r.randint(1, 20)
            if r.random() < 0.5:
                messages += [
                    {"role": "user", "content": f"What is {a} plus {b}?"},
                    {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
                ]
            else:
                word = r.choice(WORDS)
                messages += [
                    {"role": "user", "content": f"Spell the word {word}."},
                    {"role": "assistant", "content": "-".join(word.upper())},
                ]
        out.append(messages)
    return out


def test_the_smollm2_chat_config_trains_on_the_replies(tmp_path, monkeypatch):
    """configs/smollm2-chat.toml, as a user runs it, on the instruction set it expects where it
    expects it; the store's loss tokens are exactly the replies and what the template closes them with."""
    from pathlib import Path

    from fivecut.train.data import load_sources
    from fivecut.weights.load import run_tokenizer

    config = Path(__file__).resolve().parents[1] / "configs" / "smollm2-chat.toml"
    monkeypatch.chdir(tmp_path)
    chats = instruction_set(400)
    (tmp_path / "instructions").mkdir()
    write_jsonl(tmp_path / "instructions" / "chats.jsonl", chats)
    sets = [f'data.cache_dir="{tmp_path / "cache"}"', "train.steps=1", "train.seq_len=64", "train.global_batch=2"]
    sets += ["train.eval_every=0", "train.warmup=0", "log.progress=false", "log.plot=false"]
    assert main(["train", "--config", str(config)] + [a for s in sets for a in ("--set", s)]) == 0

    cfg = load_config(str(config), sets)
    tokenizer = run_tokenizer(cfg.data.tokenizer, cfg.model.init_from)
    (split,) = load_sources(cfg.data, tokenizer)
    ids = np.concatenate([np.asarray(split.train), np.asarray(split.val)])
    mask = np.concatenate([np.asarray(split.train_mask), np.asarray(split.val_mask)])
    replies = "".join(m["content"] + "<|im_end|>\n" for c in chats for m in c if m["role"] == "assistant")
    assert tokenizer.decode(ids[mask == 1].tolist()) == replies


def test_chat_data_needs_a_models_own_tokenizer(capsys, chat_model, tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", conversations(3))
    err = refused(capsys, tmp_path, chat_model, f'data.source="{path}"', 'data.tokenizer="byte"')
    assert "data.format=\"chat\" needs a model's own tokenizer, not 'byte'" in err


# ---------------------------------------------------------------- templates that train on nothing (issue 42)

NO_REPLIES = (  # renders the user and system turns only: every token's mask is 0
    "{% for message in messages %}{% if message['role'] != 'assistant' %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
)
EMPTY_MARKERS = TEMPLATE.replace(  # marks the replies with an empty {% generation %} block
    "{% generation %}{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}",
    "{{ message['content'] + '<|im_end|>\\n' }}{% generation %}{% endgeneration %}",
)


@pytest.mark.parametrize("template", [NO_REPLIES, EMPTY_MARKERS], ids=["no-replies", "empty-markers"])
def test_a_template_that_trains_on_nothing_is_refused(capsys, chat_model, tmp_path, template):
    """Not a run at loss 0.0 that exits 0: refused before any process, naming the data and the template."""
    path = write_jsonl(tmp_path / "chats.jsonl", conversations(40))
    (tmp_path / "t.jinja").write_text(template)
    sets = f'data.source="{path}"', f'data.chat_template="{tmp_path / "t.jinja"}"', "train.seq_len=16"
    err = refused(capsys, tmp_path, chat_model, *sets, "train.global_batch=2", "train.eval_every=0")
    assert err.startswith(f"error: {path}: the chat template from {tmp_path / 't.jinja'} marks no token"), err
    assert "set data.chat_template" in err
    again = refused(capsys, tmp_path, chat_model, *sets, "train.global_batch=2", "train.eval_every=0")
    assert again == err  # the next try resumes from the shards written: refused the same


def test_conversations_without_a_loss_token_are_counted(capsys, tmp_path):
    """A template whose markers wrap the reply alone: an empty reply has no loss token. The build
    says how many conversations have none and where the first is, and goes on."""
    folder = tmp_path / "model"
    save_model(
        folder,
        TEMPLATE.replace(
            "message['content'] + '<|im_end|>\\n' }}{% endgeneration %}",
            "message['content'] }}{% endgeneration %}{{ '<|im_end|>\\n' }}",
        ),
    )
    chats = conversations(12)
    for k in (3, 7, 8):  # lines 4, 8 and 9
        chats[k] = [m | {"content": ""} if m["role"] == "assistant" else m for m in chats[k]]
    path = write_jsonl(tmp_path / "chats.jsonl", chats)
    sets = chat_sets(folder, path, tmp_path / "cache")
    capsys.readouterr()
    assert main(["data", "build"] + [a for s in sets for a in ("--set", s)]) == 0
    out = capsys.readouterr().out
    (note,) = [line for line in out.splitlines() if "warning" in line]
    assert "3 of the 12 conversations tokenized have no token the loss trains on" in note
    assert f"(the first: {path}:4)" in note and f"the tokenizer of {folder}" in note, note


# ---------------------------------------------------------------- the template's own refusals (issue 42)

STRICT = (  # Mistral's and Llama 2's check, and an unknown role
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}{% endif %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([{"role": "user", "content": "the cat"}, {"role": "user", "content": "a dog"}], "roles must alternate"),
        ([{"role": "user", "content": "the"}, {"role": "robot", "content": "a"}], "Unknown role: robot"),
    ],
    ids=["not-alternating", "unknown-role"],
)
def test_the_templates_own_refusal_names_the_file_and_line(capsys, tmp_path, bad, message):
    folder = tmp_path / "model"
    save_model(folder, STRICT)
    chats = [[{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "a dog sat"}]] * 2
    path = write_jsonl(tmp_path / "chats.jsonl", chats + [bad + [{"role": "assistant", "content": "ok"}]])
    err = refused(capsys, tmp_path, folder, f'data.source="{path}"')
    assert err.startswith(f"error: {path}:3: the chat template from the tokenizer of {folder}"), err
    assert message in err and "fix that line" in err
