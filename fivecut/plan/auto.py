"""`parallel.layout = "auto"`: the planner's fastest fitting layout for the world a run starts with.

`fivecut train` resolves it on every rank before anything else reads the layout: the world is
torchrun's (`WORLD_SIZE`, with `LOCAL_WORLD_SIZE` ranks a node), the cluster is
`parallel.cluster` (a cluster TOML, `fivecut plan calibrate`'s for this machine by default, or
`NODESxGPUSxDEVICE`) cut to that world, and the run's model, global batch, sequence and dtype
are planned as given. The search (`fivecut.plan.search`) is arithmetic on the meta device, so
every rank reaches the same layout from the same inputs; the run checks that they did.

What the planner chooses: every `parallel.*` cut and `train.accumulate` and `train.recompute`
(the batch split and the recomputation a layout needs to fit). The resolved config is an
ordinary one (`layout = "manual"`, the cuts written out): it is what the checkpoint saves, so a
resume on another world size, planned again, shows the changed cuts as free changes of the
layout and DCP reshards the state into them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path

from fivecut.config import Config, ConfigError
from fivecut.layout import ParallelDims
from fivecut.model.args import ModelArgs
from fivecut.plan.cluster import Cluster, ClusterError, parse_cluster
from fivecut.plan.search import Candidate, search

LOCAL_CALIBRATION = "cluster-local.toml"  # where `fivecut plan calibrate` writes this machine's cluster
PLANNED_TRAIN_KEYS = ("accumulate", "recompute")  # the train.* keys the planner sets with the cuts


@dataclass
class AutoLayout:
    """The planner's answer for one world: the resolved config and what it was chosen over."""

    cfg: Config
    chosen: Candidate
    runner_up: Candidate | None
    cluster: Cluster
    tried: int

    def lines(self) -> list[str]:
        """What rank 0 prints before training."""
        c, world = self.chosen, self.cluster.world_size
        first = (
            f"fivecut: parallel.layout=auto chose {c.layout} (accumulate {c.cfg.train.accumulate}, recompute "
            f"{c.recompute}) for {world} rank{'s' if world > 1 else ''} on {self.cluster.name}: predicted "
            f"{c.cost.step * 1e3:.1f} ms a step, {c.cost.memory['total'] / 2**20:.1f} MiB a rank, of "
            f"{self.tried} layouts costed"
        )
        if self.runner_up is None:
            return [first]
        r = self.runner_up
        return [first, f"fivecut: the next best: {r.layout} ({r.cost.step * 1e3:.1f} ms a step)"]


def cluster_for_world(spec: str | None, world: int, per_node: int) -> Cluster:
    """The cluster `spec` names, with `world` ranks in nodes of `per_node`: its device and links,
    the run's own shape."""
    spec = spec or LOCAL_CALIBRATION
    if spec == LOCAL_CALIBRATION and not Path(spec).is_file():
        raise ConfigError(
            f"parallel.layout='auto' plans on this machine's calibration, {spec}, which does not exist here; write "
            f"it with `fivecut plan calibrate`, or set parallel.cluster to a cluster TOML or NODESxGPUSxDEVICE"
        )
    if per_node < 1 or world % per_node:
        raise ConfigError(f"{world} ranks do not fill nodes of {per_node}; start the same number of ranks on each node")
    try:
        cluster = parse_cluster(spec)
    except ClusterError as err:
        raise ConfigError(f"parallel.cluster: {err}") from None
    return replace(cluster, nodes=world // per_node, gpus_per_node=per_node)


def planned_layout(cfg: Config, args: ModelArgs, world: int, per_node: int) -> AutoLayout:
    """`cfg` under the planner's fastest fitting layout for `world` ranks, `per_node` to a node."""
    cluster = cluster_for_world(cfg.parallel.cluster, world, per_node)
    base = copy.deepcopy(cfg)
    base.parallel = ParallelDims()
    result = search(args, base, cluster, top=2, workers=1)  # every rank plans: one process each
    if not result.tried:
        raise ConfigError(
            f"parallel.layout='auto': no layout of {world} ranks can run this model and batch (dp must divide "
            f"train.global_batch={cfg.train.global_batch}, tp the {args.n_heads} heads, pp the {args.n_layers} "
            f"layers); start another number of ranks, or set train.global_batch to a multiple of {world}"
        )
    if not result.ranked:
        raise ConfigError(
            f"parallel.layout='auto': no layout of {world} ranks fits {cluster.device.memory_gb:g} GB a rank "
            f"({result.tried} costed, {result.invalid} refused by the layout checks); `fivecut plan --cluster "
            f"{cfg.parallel.cluster or LOCAL_CALIBRATION}` shows what each needs; start more ranks or a smaller batch"
        )
    chosen = result.ranked[0]
    resolved = copy.deepcopy(cfg)
    resolved.parallel = chosen.cfg.parallel
    for key in PLANNED_TRAIN_KEYS:
        setattr(resolved.train, key, getattr(chosen.cfg.train, key))
    runner_up = result.ranked[1] if len(result.ranked) > 1 else None
    return AutoLayout(resolved, chosen, runner_up, cluster, result.tried)


def plan_line(cfg: Config) -> str:
    """What the planner chose, in one line the ranks compare: the cuts and the planned train keys."""
    return f"{cfg.parallel.settings()} ({', '.join(f'{k} {getattr(cfg.train, k)}' for k in PLANNED_TRAIN_KEYS)})"


def auto_problems(cfg: Config) -> list[str]:
    """What may not be given beside `parallel.layout = "auto"`: the cuts and the keys it chooses."""
    if cfg.parallel.layout != "auto":
        return []
    train = Config().train
    given = [
        f"train.{k}={getattr(cfg.train, k)!r}" for k in PLANNED_TRAIN_KEYS if getattr(cfg.train, k) != getattr(train, k)
    ]
    cuts = replace(cfg.parallel, layout=ParallelDims.layout, cluster=None).settings()
    given = ([] if cuts == "single" else [f"parallel.{c}" for c in cuts.split(",")]) + given
    if not given:
        return []
    return [
        f"parallel.layout='auto' chooses the layout itself, but {', '.join(given)} is given too; remove "
        f"{'it' if len(given) == 1 else 'them'}, or set parallel.layout='manual' and give every cut"
    ]
