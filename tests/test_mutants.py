"""Tests for the hand-made bugs the default suite let through (issue 32): each test names, in its
doc, the mutation it was seen to catch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from test_auto_layout import CPU_RANK, free_port
from test_ddp import TOKENS, one_step_gradients, small_config
from test_plan import planned, with_device
from test_zero import reassemble

from fivecut.checks import schedule_rule_problems
from fivecut.cli import build_parser, layout_config, main, reference_of, run_spawned, same_layout_everywhere
from fivecut.config import Config, ConfigError, load_config, preset_args
from fivecut.launch import spawn
from fivecut.layout import ParallelDims
from fivecut.mesh import Mesh
from fivecut.model.args import divisors
from fivecut.model.presets import get_preset
from fivecut.model.transformer import build_model
from fivecut.parallel.compile import compile_blocks, start_record
from fivecut.parallel.parallelize import ParallelizeOptions, parallelize, token_loss_sum
from fivecut.parallel.recompute import apply_recompute
from fivecut.parallel.saved import SavedActivations
from fivecut.plan.cluster import parse_cluster, preset_cluster
from fivecut.plan.cost import cost_layout
from fivecut.plan.search import SearchResult, batch_splits, fastest_fitting, shape_cuts
from fivecut.train.data import BatchSampler
from fivecut.train.resume import config_keys, resume_changes

# ---------------------------------------------------------------- the planner: ZeRO-1/2's gathers


def gather_exposure(cost, cfg, overlap: float) -> tuple[float, float]:
    """(exposed seconds, window) of the data cut by the cost model's stated rule (`fivecut.plan.cost`):
    the reduce-scatters hide behind the backward (2/3 of the step's compute), the gathers of the
    updated shards behind the next step's first forward, that of its first micro-step and first
    microbatch (a third of the step's compute over accumulate x microbatches), but for one
    bucket's gather, which that forward waits for. On H100 both ops move alike: the gathers are
    half of the cut's seconds."""
    dp = next(c for c in cost.cuts if c.cut == "dp")
    calls = cost.calls["dp"]["all_gather"]
    gather, hiding = dp.seconds / 2, overlap * cost.compute
    microbatches = cfg.parallel.microbatches if cfg.parallel.pp > 1 else 1
    window = hiding / 3 / (cfg.train.accumulate * microbatches)
    first = gather / calls
    reduction = max(0.0, dp.seconds - gather - hiding * 2 / 3)
    return reduction + first + max(0.0, gather - first - window), window


@pytest.mark.parametrize(
    "layout, sets, overlap",
    [
        ("dp=8,zero=1", ("train.accumulate=4",), 1.0),  # a quarter of the forward hides them
        ("dp=8,zero=2", ("train.accumulate=2",), 1.0),
        ("dp=4,pp=2,zero=1,microbatches=4", (), 0.25),  # the first microbatch's forward on stage 0
    ],
)
def test_zero12s_gathers_hide_behind_the_first_microbatchs_forward_only(layout, sets, overlap):
    """Caught: `window` in `data_exposed` without the accumulate factor, or without the
    microbatches factor (`hiding / 3 / cfg.train.accumulate`): the gathers then hide behind the
    whole step's forward. Across 8 nodes the gathers outlast the window, so it is binding."""
    flags = ["--seq", "256", "--global-batch", "32", "--set", "train.bucket_mb=0.25"]
    flags += [f for s in sets for f in ("--set", s)]
    _, cfg, args = planned("tiny", layout, "8x1xH100", *flags)
    cost = cost_layout(args, cfg, with_device(parse_cluster("8x1xH100"), overlap=overlap))
    expected, window = gather_exposure(cost, cfg, overlap)
    dp = next(c for c in cost.cuts if c.cut == "dp")
    gather = dp.seconds / 2
    assert gather - gather / cost.calls["dp"]["all_gather"] > window > 0  # the window decides the exposure
    assert dp.exposed == pytest.approx(expected, rel=1e-9)


# ---------------------------------------------------------------- the search keeps every schedule


def test_the_search_costs_every_schedule_at_each_microbatch_count_it_accepts():
    """tiny on 4 ranks, 16 sequences a step: a 2-rank pipeline runs each of the search's
    schedules. For each, the search costs exactly the microbatch counts of its ladder (the least the
    schedule accepts, x2, x4) that split the rows and that the run's checks accept, and keeps a
    fitting layout of each. Caught: DualPipeV's least count at `shape.pp` (its first split is
    refused and the shape dropped), or at 4 x pp (the ladder loses 2 x pp)."""
    cfg = load_config(None, ["train.seq_len=64", "train.global_batch=16"])
    args = preset_args(cfg.model)
    cluster = parse_cluster("1x4xH100")
    kept: dict[str, set[int]] = {}
    for shape, data in shape_cuts(args, cfg, cluster):
        if shape.pp != 2 or shape.tp != 1 or data != (1, None):
            continue
        rows = cfg.train.global_batch // (4 // (shape.pp * shape.cp))
        least = next(m for m in range(1, rows + 1) if not schedule_rule_problems(shape.schedule, 2, m, shape.virtual))
        ladder = {least, 2 * least, 4 * least} & set(divisors(rows))
        assert {m for m, _ in batch_splits(rows, shape)} == ladder, shape.schedule
        result = SearchResult([])
        found = fastest_fitting(args, cfg, cluster, shape, data, result, capacity=1e18)
        assert result.invalid == 0, shape
        kept.setdefault(shape.schedule, set()).update(c.cfg.parallel.microbatches for c in found)
    every = (("1f1b", 1), ("interleaved", 2), ("zb1p", 1), ("dualpipev", 2))  # GPipe: not searched (1F1B's time)
    assert kept == {name: {m for m in (2, 4, 8) if not schedule_rule_problems(name, 2, m, v)} for name, v in every}


# ---------------------------------------------------------------- what a resume refuses

# Every key whose change a resume refuses (the data a step reads, the model, the optimizer's math,
# the precision); every other key is free. Pinned here whole: moving one key fails.
REFUSED_KEYS = {
    *(f"model.{k}" for k in (
        "preset init_from vocab_size dim n_layers n_heads n_kv_heads ffn_dim max_seq_len rope_theta norm_eps "
        "tie_embeddings init_std n_experts top_k n_shared_experts moe_ffn_dim first_dense_layers gate route_scale "
        "expert_groups route_group_limit q_lora_rank kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim"
    ).split()),
    *(f"model.{k}" for k in "attention_head_dim qkv_bias qk_norm sliding_window full_attention_layers".split()),
    *(f"model.{k}" for k in "qk_norm_whole nope_interval norm_after rope_partial_dim".split()),
    *(f"model.{k}" for k in "attention_sinks wo_bias window_layers moe_bias swiglu_limit swiglu_alpha".split()),
    "model.rope_truncate",  # GPT-OSS's fields
    *(f"model.{k}" for k in (
        "ffn_activation sandwich_norms scale_embeddings rope_local_theta query_scale_dim "
        "attn_softcap logit_softcap"
    ).split()),  # Gemma's
    "model.route_norm",
    *(f"model.rope_{k}" for k in (
        "scaling factor original_context low_freq_factor high_freq_factor beta_fast beta_slow mscale mscale_all_dim"
    ).split()),
    *(f"data.{k}" for k in "source tokenizer val_fraction text_field weights order document_mask".split()),
    "data.format", "data.chat_template",
    *(f"train.{k}" for k in (
        "global_batch seq_len seed lr min_lr warmup weight_decay beta1 beta2 eps grad_clip dtype reduce_dtype"
    ).split()),
    "moe.capacity_factor", "moe.aux_loss_coef", "moe.bias_update_rate",
    *(f"lora.{k}" for k in "rank alpha dropout targets full quantize".split()),
}  # fmt: skip


def changed(value):
    """Another value of the same JSON kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "-other"
    return [1] if isinstance(value, list) else 3  # a list, or an unset key


@pytest.mark.parametrize("key", config_keys())
def test_a_resume_refuses_exactly_the_keys_that_change_the_runs_math(key):
    """The checkpoint saved `key` at another value: the resume refuses it, naming it, iff it is in
    REFUSED_KEYS (train.dtype, train.seed, the model's shape are; the layout keys are free).
    Caught: "dtype" moved from the refused train keys to the free ones (or any key moved)."""
    saved = Config().to_dict()
    section, name = key.split(".")
    saved[section][name] = changed(saved[section][name])
    meta = {"step": 2, "config": saved, "overrides": []}
    if key in REFUSED_KEYS:
        with pytest.raises(ConfigError, match=f"changed run: {key} "):
            resume_changes("ck", meta, Config(), [])
    else:
        assert [c.key for c in resume_changes("ck", meta, Config(), []).changes] == [key]


# ---------------------------------------------------------------- USP's bytes against the ledger


@pytest.mark.multirank
def test_usps_measured_bytes_are_the_planners_closed_form():
    """USP on 4 ranks (Ulysses over U=2, then the ring over R=2), one step: each cut's bytes on the
    wire, as the ledger records them, equal the planner's closed form (floats equal, not a ratio).
    Caught: the ring's blocks cut by c instead of R (`token * train.seq_len // c` in `cp_bytes`)."""
    argv = ["ledger", "--model", "tiny", "--layout", "cp=4,cp_mode=usp,cp_ulysses=2", "--steps", "1"]
    cfg = layout_config(build_parser().parse_args(argv))
    measured = run_spawned(cfg, 120.0, what="ledger usp")[0]
    plan = cost_layout(preset_args(cfg.model), cfg, preset_cluster(1, 4, "H100"))
    wire = {c.cut: c.wire_bytes for c in plan.cuts}
    assert wire["cp"] > 0 and {r.op for r in measured.ledger_rows if r.cut == "cp"} >= {"all_to_all", "send"}
    for cut, planned_bytes in wire.items():
        assert sum(r.wire_bytes for r in measured.ledger_rows if r.cut == cut) == planned_bytes, cut


# ---------------------------------------------------------------- compile under full recomputation


def two_steps(model, compiled: bool, tokens) -> tuple[list[float], list[dict]]:
    """Two SGD steps of `model` on `tokens` [b, s + 1]: the losses and each step's gradients;
    with `compiled`, its blocks fully recomputed and compiled (the order `parallelize` applies)."""
    record = start_record()
    if compiled:
        apply_recompute(model, "full", 1, SavedActivations())
        compile_blocks(model, record)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], []
    for _ in range(2):
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
    if compiled:
        counts = record.counts()
        assert counts["graphs"] >= 1 and counts["graph_breaks"] == 0, counts
    return losses, grads


def test_compiled_blocks_under_full_recomputation_match_eager():
    """One block of tiny, fully recomputed and compiled, against the eager block: losses rtol 1e-5
    and every gradient (rtol 1e-5, atol 1e-6: inductor reorders sums, as `fivecut verify` allows),
    over two steps. Caught: the checkpoint compiled whole (`block.forward = torch.compile(
    block.forward)` for a `BlockCheckpoint` too), which Dynamo breaks at its bookkeeping."""
    args = replace(get_preset("tiny"), n_layers=1)
    tokens = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    eager, eager_grads = two_steps(build_model(args, seed=0), False, tokens)
    compiled, compiled_grads = two_steps(build_model(args, seed=0), True, tokens)
    assert compiled == pytest.approx(eager, rel=1e-5)
    for a, b in zip(eager_grads, compiled_grads, strict=True):
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------- hybrid sharding, bf16 reductions

# A bf16 reduction rounds each gradient to 8 mantissa bits (unit roundoff 2^-9) when it is cast,
# again at the shard group's sum and again at the replicas' sum: 3 x 2^-9 = 5.9e-3 relative
# at worst for an element whose summands do not cancel. The roundings are independent, so over
# the whole gradient's norm they mostly cancel. Measured on a correct run (tiny, dp=4,
# zero_shard=2, ZeRO-1/2/3): 3.8e-3 on the worst tensor, 3.6e-5 on the whole gradient's norm.
# Tolerances 2^-7 (7.8e-3) a tensor and 1e-3 the norm: a lost replica sum is 0.5 off.
HSDP_BF16_TENSOR_RTOL, HSDP_BF16_NORM_RTOL = 2.0**-7, 1e-3


def hybrid_bf16_gradients(stage: int) -> dict[str, torch.Tensor]:
    """One step at dp=4, ZeRO-`stage`, zero_shard=2, gradients reduced in bf16: the full fp32
    gradients reassembled from the shard group's shards."""
    mesh = Mesh(ParallelDims(dp=4, zero=stage, zero_shard=2), "cpu")
    model = build_model(get_preset("tiny"), seed=0)
    names = {id(p): name for name, p in model.named_parameters()}
    par = parallelize(model, mesh, ParallelizeOptions(bucket_mb=0.05, reduce_dtype=torch.bfloat16))
    sampler = BatchSampler(TOKENS, seq_len=32, global_batch=8, seed=3)
    ((inputs, targets),) = sampler.local_batches(1, mesh.coordinate("dp"), 4, 1)
    par.sync.zero_grad()
    (token_loss_sum(par.module(inputs), targets) / sampler.tokens_in_global_batch()).backward()
    return reassemble(par.sync.shards, names, mesh.group("zero_shard"))


def hybrid_bf16_every_stage() -> dict:
    return {stage: hybrid_bf16_gradients(stage) for stage in (1, 2, 3)}


@pytest.mark.multirank
def test_hybrid_sharding_with_bf16_reductions_stays_within_bf16_rounding():
    """Caught: the replicas' bf16 all-reduce not copied back into the fp32 shard gradient
    (`Replicas.finish` without `grad.copy_(wire)`): each rank keeps its shard group's half."""
    ref, _, _ = one_step_gradients(1, 1, 25.0)
    ref_norm = torch.stack([g.norm() for g in ref.values()]).norm()
    for by_stage in spawn(hybrid_bf16_every_stage, 4):
        for stage, grads in by_stage.items():
            for name, g in ref.items():
                rel = float((grads[name] - g).norm() / g.norm())
                assert rel <= HSDP_BF16_TENSOR_RTOL, f"zero={stage} {name}: relative error {rel:.2e}"
            norm = torch.stack([g.norm() for g in grads.values()]).norm()
            assert float(abs(norm - ref_norm) / ref_norm) <= HSDP_BF16_NORM_RTOL, f"zero={stage}"


# ---------------------------------------------------------------- the W pass under bf16

# Both runs compute in bf16 on fp32 masters; what differs is where a weight gradient is rounded:
# the pipeline rounds each microbatch's bf16 dW (2^-9 relative) and sums them in fp32, the single
# process rounds one dW over all rows. Those roundings are independent, so the step-1 gradient
# norm moves ~1e-5; AdamW's first steps (dividing by sqrt(v)) amplify it for the elements near
# zero afterwards. Measured (tiny, pp=2, zb1p, 2 microbatches, 3 steps): losses 8.9e-5 at most,
# gradient norm 8.4e-6 at step 1 and 6.7e-4 later. Tolerances: loss 1e-3, norm 1e-4 at step 1
# and 5e-3 later (a dW in the wrong dtype fails the step; a wrong one is off by bf16's 4e-3 or more).
BF16_PIPELINE_LOSS_RTOL, BF16_FIRST_NORM_RTOL, BF16_LATER_NORM_RTOL = 1e-3, 1e-4, 5e-3


def bf16_pipeline_drift(cache: str, out, *layout: str) -> tuple[list[float], list[float]]:
    """Relative differences of the losses and of the gradient norms (before clipping), step by
    step, of a bf16 run under `layout` against the bf16 single process (`fivecut verify`'s reference)."""
    cfg = small_config(cache, "train.steps=3", 'train.dtype="bf16"', f'log.out_dir="{out}"', *layout)
    reference = run_spawned(reference_of(cfg), 300.0, what="bf16 single process")[0]
    result = run_spawned(cfg, 300.0, what="bf16 pipeline")[0]
    rel = [
        [abs(b - a) / abs(a) for a, b in zip(x, y, strict=True)]
        for x, y in ((reference.losses, result.losses), (reference.grad_norms, result.grad_norms))
    ]
    return rel[0], rel[1]


@pytest.mark.multirank
def test_the_w_pass_in_bf16_matches_the_bf16_single_process(byte_cache, tmp_path):
    """pp=2 under zb1p (B and W split) in bf16, three steps, against one bf16 process. Caught: W's
    dW = dy^T x without casting x to dy's dtype (`Deferred.weight_grad`): bf16 @ fp32 fails."""
    loss, norm = bf16_pipeline_drift(
        byte_cache, tmp_path, "parallel.pp=2", 'parallel.pp_schedule="zb1p"', "parallel.microbatches=2"
    )
    assert max(loss) <= BF16_PIPELINE_LOSS_RTOL, loss
    assert norm[0] <= BF16_FIRST_NORM_RTOL and max(norm[1:]) <= BF16_LATER_NORM_RTOL, norm


# ---------------------------------------------------------------- parallel.layout = "auto"


def auto_cluster(folder, memory_gb: str) -> str:
    """`test_auto_layout`'s fixed CPU cluster with `memory_gb` a rank."""
    path = folder / f"cluster-{memory_gb}.toml"
    path.write_text(CPU_RANK.replace("memory_gb = 8", f"memory_gb = {memory_gb}"))
    return str(path)


@pytest.mark.parametrize(
    "memory_gb, planned",
    [("0.02", {"accumulate": 2, "recompute": "none"}), ("0.0145", {"accumulate": 4, "recompute": "full"})],
)
def test_auto_runs_the_accumulation_and_recomputation_it_planned(memory_gb, planned, byte_cache, tmp_path, capsys):
    """tiny, 8 x 32 tokens a step, on one rank of 20 MB: one step of 8 rows does not fit, two of 4
    do; in 14.5 MB only full recomputation, with four steps of two rows (the loss head's peak
    counted). The run trains with what was planned (its config.json, what its trainer read).
    Caught: `PLANNED_TRAIN_KEYS` without "accumulate" or without "recompute" (the planner's choice
    not applied to the run)."""
    out = tmp_path / "out"
    sets = [
        'parallel.layout="auto"',
        f'parallel.cluster="{auto_cluster(tmp_path, memory_gb)}"',
        "train.steps=1",
        "train.warmup=1",
        "train.seq_len=32",
        "train.global_batch=8",
        "train.eval_every=0",
        'data.tokenizer="byte"',
        f'data.cache_dir="{byte_cache}"',
        f'log.out_dir="{out}"',
        "log.progress=false",
        "log.plot=false",
    ]
    assert main(["train", *[x for s in sets for x in ("--set", s)]]) == 0
    said = capsys.readouterr().out
    assert f"accumulate {planned['accumulate']}, recompute {planned['recompute']}" in said
    used = json.loads((out / "config.json").read_text())["train"]
    assert {key: used[key] for key in planned} == planned


def same_plan_or_why(accumulate: dict) -> str:
    import torch.distributed as dist

    cfg = load_config(None, [f"train.accumulate={accumulate[dist.get_rank()]}", "parallel.dp=2"])
    try:
        same_layout_everywhere(cfg)
    except ConfigError as err:
        return str(err)
    return "agreed"


@pytest.mark.multirank
def test_ranks_whose_plans_differ_only_in_accumulation_are_refused():
    """Caught: the ranks comparing their cuts only (`dims.settings()`): a rank accumulating 2
    micro-steps beside one accumulating 1 would wait on a reduction the other never sends."""
    differ = spawn(same_plan_or_why, 2, {0: 1, 1: 2})
    line = "dp=2 (accumulate 1, recompute none) on rank 0 but dp=2 (accumulate 2, recompute none) on rank 1"
    assert all(line in d for d in differ), differ


def train_as_rank(rank: int, port: int, cluster: str, cache: str, out) -> subprocess.Popen:
    """`fivecut train` as rank `rank` of 2, each on a node of its own (its own cluster file)."""
    env = os.environ | {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": os.getcwd()}
    sets = [
        'parallel.layout="auto"',
        f'parallel.cluster="{cluster}"',
        "train.steps=1",
        "train.warmup=1",
        "train.seq_len=32",
        "train.global_batch=8",
        'data.tokenizer="byte"',
        f'data.cache_dir="{cache}"',
        f'log.out_dir="{out}"',
    ]
    command = [sys.executable, "-m", "fivecut", "train", *[x for s in sets for x in ("--set", s)]]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.multirank
def test_ranks_on_nodes_with_other_cluster_files_stop_in_one_line(byte_cache, tmp_path):
    """Two ranks, each its own node and cluster file (8 GB: dp=2,zero=3; 12 MB: a pipeline): both stop
    at the start, exit 2, rank 0 saying why in one line naming both plans, nothing trained. Caught: `cmd_train`
    without its `same_layout_everywhere` call (the ranks then meet in mismatched collectives)."""
    port = free_port()
    ranks = [
        train_as_rank(r, port, auto_cluster(tmp_path, gb), byte_cache, tmp_path / "out")
        for r, gb in enumerate(("8", "0.012"))
    ]
    errors = []
    for rank in ranks:
        _, err = rank.communicate(timeout=120)
        assert rank.returncode == 2, err[-3000:]
        errors.append(err.strip().splitlines())
    mine = "dp=2,zero=3 (accumulate 1, recompute none) on rank 0 but "  # rank 1's 12 MB plan is another
    assert len(errors[0]) == 1 and mine in errors[0][0] and errors[1] == [], errors  # rank 0 says it
    assert errors[0][0].split(mine)[1].split(" on rank 1")[0] != mine.split(" on rank 0")[0]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
