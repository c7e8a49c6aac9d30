"""What a resume may change: every config key compared with the checkpoint's saved config (torch-free).

A key is FREE when changing it changes no number of the run beyond floating-point rounding (the
layout, accumulation, bucket size) or nothing the run computes (where logs, evaluation and
checkpoints go, timeouts, the fault policy); a changed free key is listed in one line. A key is
REFUSED when changing it changes the data a step reads, the model or the optimizer's math: the
resume stops with one line naming each such key, unless `--override KEY` accepts it. Accepted
changes are recorded as `{"step": N, "overridden": {KEY: [old, new]}}`, in `metrics.jsonl` and, as
a history, in every later checkpoint's `fivecut.json` (`overrides`).

`cmd_train` calls `resume_changes` before any process group is formed; `trainer.resume_from`
calls it again (the same answer) to print the line and record what was accepted.

A checkpoint.dir holds one run: the run its checkpoints' saved config names. `--resume auto`
continues it (a changed run refused, as above); `--resume never` starts a new run, so it is
refused (`check_new_run`) where the folder holds any complete checkpoint, before anything is
written: its first save would replace that run's checkpoint of the same step and leave the other
run's later steps as the newest.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from fivecut.config import Config, ConfigError, ModelConfig, closest, preset_args

FREE, REFUSED = "free", "refused"

# Every key of every Config section, by section; tests/test_resume.py fails on a key missing here.
FREE_ON_RESUME = {
    # the layout: any split of the work computes the same math (the parity tests, `fivecut verify`)
    "parallel": "dp zero reshard_after_forward tp sp pp pp_schedule pp_virtual microbatches pp_layers cp cp_mode ep "
    "cp_ulysses etp zero_shard layout cluster",
    # steps: extending (or shortening) a run; the cosine schedule then decays to min_lr at the new end.
    # accumulate and bucket_mb split the same sums differently. The fault policy decides only what
    # happens after a non-finite value, so a resume may switch to "skip" to get past one.
    "train": "steps launch_steps accumulate eval_every eval_batches bucket_mb collective_timeout on_nonfinite "
    "max_skipped recompute recompute_every compile adamw loss_chunk_tokens",  # when, by which kernel, in what chunks
    "moe": "eplb_slots eplb_move eplb_interval eplb_window",  # EPLB places expert copies; it changes no number
    # the token store is keyed and checked by its tokenizer and sha256; its shard size and builders change no id
    "data": "cache_dir shard_tokens workers record_ids",
    "log": "out_dir progress log_every peak_tflops plot sample_prompt sample_tokens",
    "checkpoint": "dir every keep verify on_error max_failures async_mode",
    "lora": "adapter",  # where the adapters started: a resume takes the checkpoint's
}
REFUSED_ON_RESUME = {
    "model": "preset init_from vocab_size dim n_layers n_heads n_kv_heads ffn_dim max_seq_len rope_theta norm_eps "
    "tie_embeddings init_std n_experts top_k n_shared_experts moe_ffn_dim first_dense_layers gate route_scale "
    "expert_groups route_group_limit q_lora_rank kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim "
    "attention_head_dim qkv_bias qk_norm sliding_window full_attention_layers route_norm rope_scaling rope_factor "
    "rope_original_context rope_low_freq_factor rope_high_freq_factor rope_beta_fast rope_beta_slow rope_mscale "
    "rope_mscale_all_dim qk_norm_whole nope_interval norm_after rope_partial_dim "
    "attention_sinks wo_bias window_layers moe_bias swiglu_limit swiglu_alpha rope_truncate "  # GPT-OSS's
    "ffn_activation sandwich_norms scale_embeddings rope_local_theta query_scale_dim "
    "attn_softcap logit_softcap",  # Gemma's
    # the tokens a step reads, and what each token attends to
    "data": "source tokenizer val_fraction text_field weights order document_mask format chat_template",
    # the batches of step s (global_batch, seq_len, seed), the optimizer and its schedule, the precision
    "train": "global_batch seq_len seed lr min_lr warmup weight_decay beta1 beta2 eps grad_clip dtype reduce_dtype",
    "moe": "capacity_factor aux_loss_coef bias_update_rate",  # which tokens reach which expert; the loss
    # which weights train, and how: the checkpoint's trained tensors are those of its [lora]
    "lora": "rank alpha dropout targets full quantize",
}
RESUME_RULES: dict[str, str] = {
    f"{section}.{name}": rule
    for rule, table in ((FREE, FREE_ON_RESUME), (REFUSED, REFUSED_ON_RESUME))
    for section, names in table.items()
    for name in names.split()
}


@dataclass
class Change:
    key: str
    old: object
    new: object

    def __str__(self) -> str:
        return f"{self.key} {self.old!r} -> {self.new!r}"


@dataclass
class Resume:
    """How a run's config differs from the checkpoint it resumes (nothing, for a fresh start)."""

    step: int = 0
    changes: list[Change] = field(default_factory=list)  # every changed key, in config order
    accepted: list[Change] = field(default_factory=list)  # the refused ones that --override accepted
    notes: list[str] = field(default_factory=list)  # an --override that had nothing to accept

    def lines(self) -> list[str]:
        """What rank 0 prints next to `resumed at step N`."""
        marked = [f"{c} (--override)" if c in self.accepted else str(c) for c in self.changes]
        changed = [f"fivecut: resuming with changed config: {', '.join(marked)}"] if marked else []
        return changed + [f"fivecut: {note}" for note in self.notes]

    def record(self) -> dict | None:
        """The accepted changes as a record of `metrics.jsonl` and of the checkpoints' history."""
        if not self.accepted:
            return None
        return {"step": self.step, "overridden": {c.key: [c.old, c.new] for c in self.accepted}}


def flat(table: dict, prefix: str = "") -> dict[str, object]:
    """A nested config dict as {"section.key": value}."""
    out: dict[str, object] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out |= flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_keys() -> list[str]:
    return list(flat(Config().to_dict()))


def config_changes(saved: dict, cfg: Config) -> list[Change]:
    """The keys whose value differs from the checkpoint's saved config, in config order. Both are
    compared as JSON values (the saved config went through JSON)."""
    new, old = flat(json.loads(json.dumps(cfg.to_dict()))), saved_values(saved)
    changes = [Change(key, old[key], value) for key, value in new.items() if old[key] != value]
    if same_shape(saved.get("model", {}), cfg.model):
        changes = [c for c in changes if not c.key.startswith("model.")]
    return changes


def same_shape(saved_model: dict, model: ModelConfig) -> bool:
    """Two model sections written differently that name the same architecture (the preset left
    unset and named "tiny"; a field set to its preset's own value). A model from a file
    (`init_from`) is compared as written: its shape is read above this module."""
    if saved_model.get("init_from") or model.init_from:
        return False
    try:
        return preset_args(ModelConfig(**saved_model)) == preset_args(model)
    except (TypeError, ValueError):  # a key or a preset this fivecut does not know: compare as written
        return False


def saved_values(saved: dict) -> dict[str, object]:
    """The saved config's values by key; a key it lacks (written by a fivecut without it) at its default."""
    return flat(json.loads(json.dumps(Config().to_dict()))) | flat(saved)


def check_override_keys(accept: list[str]) -> None:
    """Each --override names a config key; a typo is refused, naming the closest keys."""
    keys = config_keys()
    for key in accept:
        if key in keys:
            continue
        if key in {k.split(".")[0] for k in keys}:
            raise ConfigError(
                f"--override {key}: a config section, not a key; name each key (e.g. --override {key}.KEY)"
            )
        leaves = closest(key.rsplit(".", 1)[-1], sorted({k.rsplit(".", 1)[-1] for k in keys}))
        close = closest(key, keys) or [k for k in keys if k.rsplit(".", 1)[-1] in leaves]
        hint = f"did you mean {' or '.join(close)}?" if close else "give a key like train.lr (section.key)"
        raise ConfigError(f"--override {key}: not a config key; {hint}")


def frozen_base(cfg: Config) -> dict | None:
    """[lora]: what a checkpoint records of the frozen weights it does not hold (the run's
    model.init_from, or the seed's model) and their fingerprint, which a resume compares."""
    if cfg.lora.rank is None:
        return None
    spec = cfg.model.init_from
    return {"init_from": spec, "fingerprint": fingerprint(spec) if spec else f"seed {cfg.train.seed}"}


SAMPLES, SAMPLE_BYTES = 16, 1 << 16  # a weights file is fingerprinted by its size and 16 slices of 64 KiB


def fingerprint(spec: str) -> str:
    """sha256 over a weights source's files (hf: its safetensors and index, gguf: the file, dcp: the
    checkpoint's recorded checksums): each file's name, size and 16 evenly spaced 64 KiB slices, so
    that another model, or the same one saved again with other values, differs; a file of a few
    MiB is read whole."""
    scheme, _, rest = spec.partition(":")
    path = Path(rest).expanduser()
    if rest.startswith("pkg:") or not path.exists():  # a file in a pinned package: its name stands for it
        return hashlib.sha256(spec.encode()).hexdigest()
    if scheme == "dcp":
        return hashlib.sha256((path / "fivecut.json").read_bytes() if path.is_dir() else b"").hexdigest()
    files = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.index.json")) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            for k in range(SAMPLES):
                f.seek(k * max(size - SAMPLE_BYTES, 0) // max(SAMPLES - 1, 1))
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def check_base(path: Path, meta: dict, cfg: Config) -> None:
    """A [lora] checkpoint resumed over other frozen weights than it trained against: refused."""
    saved, now = meta.get("base"), frozen_base(cfg)
    if saved is None or now is None or saved["fingerprint"] == now["fingerprint"]:
        return
    raise ConfigError(
        f"resuming {path}: its adapters trained over {saved['init_from'] or saved['fingerprint']}, and "
        f"model.init_from={now['init_from']!r} is another model now (its files differ); point model.init_from at "
        "the weights the run started from"
    )


def resume_changes(path: Path | None, meta: dict | None, cfg: Config, accept: list[str]) -> Resume:
    """Compare `cfg` with the config saved in the checkpoint at `path` (`meta`: its fivecut.json;
    None: a fresh start). A changed refused key that `accept` does not name raises ConfigError
    naming each with its old and new value and the fix."""
    check_override_keys(accept)
    if meta is None:
        return Resume(notes=[f"--override {key}: no checkpoint to resume; nothing to accept" for key in accept])
    changes = config_changes(meta["config"], cfg)
    check_base(path, meta, cfg)
    refused = [c for c in changes if RESUME_RULES.get(c.key, REFUSED) == REFUSED]  # unlisted: refused
    denied = [c for c in refused if c.key not in accept]
    if denied:
        them = "it" if len(denied) == 1 else "them"
        raise ConfigError(
            f"resuming {path} with a changed run: {', '.join(map(str, denied))}; restore {them}, or accept each "
            f"with --override KEY (e.g. --override {denied[0].key})"
        )
    accepted = [c for c in refused if c.key in accept]
    notes = [note for key in accept if (note := idle_override(key, changes, meta))]
    return Resume(meta["step"], changes, accepted, notes)


def check_new_run(root: Path, newest: Path | None, meta: dict | None, cfg: Config) -> None:
    """`--resume never` into checkpoint.dir `root`, whose newest complete checkpoint is `newest`
    (`meta`: its fivecut.json; None: the folder holds none): refused, naming the folder, that step,
    whose run it is, and the ways out."""
    if newest is None:
        return
    changed = [c for c in config_changes(meta["config"], cfg) if RESUME_RULES.get(c.key, REFUSED) == REFUSED]
    whose = f"another run ({', '.join(map(str, changed[:3]))})" if changed else "an earlier run of this config"
    resume = "" if changed else ", or continue that run with --resume auto"
    raise ConfigError(
        f"--resume never starts a new run, but checkpoint.dir={str(root)!r} holds the checkpoints of {whose}, "
        f"newest step {meta['step']} ({newest.name}), which this run would overwrite; give this run another "
        f"checkpoint.dir (--set checkpoint.dir=...), or remove {root} first{resume}"
    )


def idle_override(key: str, changes: list[Change], meta: dict) -> str | None:
    """Why an --override accepts nothing: its key may change freely, or did not change (on a
    restarted attempt, because the checkpoint already holds the accepted value)."""
    if RESUME_RULES.get(key) == FREE:
        return f"--override {key}: {key} may change on a resume without --override; nothing to accept"
    if any(c.key == key for c in changes):
        return None
    value = saved_values(meta["config"])[key]
    when = [r["step"] for r in meta.get("overrides", []) if key in r["overridden"]]
    since = f" (accepted at step {when[-1]})" if when else ""
    return f"--override {key}: {key} is {value!r} in the checkpoint too{since}; nothing to accept"


# what decides the rows of a step: with one of these accepted by --override, other data is expected
DATA_DECIDING = ("data.source", "data.tokenizer", "data.val_fraction", "data.text_field", "data.weights", "data.order")
DATA_DECIDING += ("train.global_batch", "train.seq_len", "train.seed", "data.format", "data.chat_template")


def check_data_position(meta: dict, now: dict, accept: list[str]) -> None:
    """The data after the checkpoint's step, as the checkpoint saved it (`BatchSampler.position`: the
    order, samples read, epoch and index, each source's sequences and store content) against what this
    config reads at that step. Other data under the same keys (a corpus edited since) is refused, naming
    both, unless --override names a key that decides the data (then it was asked for)."""
    saved = meta.get("data")
    if saved is None or saved == now or any(key in DATA_DECIDING for key in accept):
        return  # a checkpoint from before positions were saved; the same data; other data accepted
    raise ConfigError(
        f"resuming at step {meta['step']} with other data: the checkpoint read {describe_position(saved)}, this "
        f"config reads {describe_position(now)} there (a source's files changed since); restore them, or accept "
        "the new data with --override data.source"
    )


def describe_position(p: dict) -> str:
    where = f"epoch {p['epoch']} index {p['index']}" if p.get("epoch") is not None else f"sample {p['samples']}"
    stores = ", ".join(c[:12] for c in p.get("content", []))
    return f"{where} ({p['order']} order) of {p['sequences']} sequences in stores [{stores}]"
