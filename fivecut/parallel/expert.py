"""Expert parallelism (EP): cut the experts of each MoE layer over ranks, move the tokens.

The `ep` ranks of a group are borrowed from the data-parallel ranks (dp x cp): each holds
E/ep of the E routed experts of every MoE layer and its own slice of the batch. A MoE
layer then runs, on every rank of the group at once:

    route      router scores [T, E] -> top-k experts and weights per token   [T, k]
    capacity   (optional) per sequence, slots beyond an expert's capacity are dropped
    permute    the kept (token, slot) rows sorted by destination rank and slot
    counts     all-to-all of the rows per (rank, slot): every rank learns what it receives
    dispatch   all-to-all of the rows themselves (uneven splits)                [N, dim]
    experts    each local slot's SwiGLU on the rows it received, from every source
    combine    all-to-all back (the reverse splits)
    unpermute  rows back to their (token, slot), weighted sum over the k slots; the
               residual connection is added by the block, after the combine

Both all-to-alls are differentiable (backward sends the gradients the reverse way), so
the experts' gradients sum the contributions of every token that reached them, on any
rank. Non-expert parameters stay data-parallel over dp x cp; an expert's copies live on
the (dp x cp) / ep ranks with the same place in their ep group (`expert_dp`).

Under tensor parallelism the MoE layer runs on the tp rank's own slice of the sequence
(sequence parallelism gives it that slice; without SP it is cut out and gathered back),
so the router, the shared experts and the experts are data-parallel over tp as well.

Expert tensor parallelism (`parallel.etp` = T, Megatron's ETP): each routed expert's w1/w3
are cut by columns and w2 by rows (the hidden size) over T neighbouring ranks of the tp group
(the `etp` group; `cut_expert_hidden`, applied by the tensor step of `parallelize`). Each
rank routes its own tokens (so the router, the load statistics, capacity and the auxiliary
loss see every token once), then around the experts:

    f   all-gather over etp of the tokens and their combine weights [T_loc, dim + k] -> [T*T_loc, ...]
        (and of the chosen experts and kept slots), backward reduce-scatter
    ... dispatch, each slot's expert shard (a partial sum over hidden/T), combine, unpermute
    g   reduce-scatter over etp of the partial outputs [T*T_loc, dim] -> [T_loc, dim], backward all-gather

The T ranks dispatch the same rows, each over its own ep group (the ranks with its tp
coordinate, which hold the same shard), so EPLB's copies and moves carry each rank's own
shard. An expert's shard is replicated on the ranks with the same place in ep and in etp:
`expert_dp` is (dp x cp) / ep x tp / T ranks.

Balancing: the Switch/GShard auxiliary loss (computed per sequence, so that any layout
gives the same number) and DeepSeek-V3's auxiliary-loss-free balancing (a per-expert bias
added to the scores for selection only, moved by +-gamma towards the mean load after each
step). EPLB: from a window of per-expert loads, experts move between ranks (weights, ZeRO
master shards and Adam moments, after an optimizer step), the hottest get copies on extra
slots and each expert's tokens are shared among its copies, so that the busiest rank
approaches the mean; a copy's weights are sent from the expert's owner every step through
a differentiable all-to-all, so its gradient flows back to the owner and training is the
unplaced model's.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from dataclasses import dataclass

import torch
from torch import nn

from fivecut import comm
from fivecut.comm import Group
from fivecut.layout import MoEOptions
from fivecut.model.transformer import MoE, count_ids, group_ends
from fivecut.parallel.placement import Change, Slice
from fivecut.parallel.precision import master

# ---------------------------------------------------------------- placement (EPLB)


class SlotMap:
    """Which logical expert each physical slot of each EP rank computes, and the share of
    that expert's tokens it takes. The first n slots of a rank hold the experts it owns (their
    parameters and optimizer state live there; at first rank r owns [r*n, (r+1)*n), and EPLB
    may move an expert to another rank's slot of the same index); `extra` more slots hold
    copies."""

    def __init__(self, n_experts: int, ep: int, extra: int, owned: list[list[int]] | None = None):
        self.n_experts, self.ep, self.extra = n_experts, ep, extra
        self.n_local = n_experts // ep
        self.slots = self.n_local + extra
        owned = owned or [[r * self.n_local + j for j in range(self.n_local)] for r in range(ep)]
        self.expert = [list(row) + [-1] * extra for row in owned]
        self.share = [[1.0] * self.n_local + [0.0] * extra for _ in range(ep)]
        self.home = {row[j]: (r, j) for r, row in enumerate(owned) for j in range(self.n_local)}

    def owned(self) -> list[list[int]]:
        return [row[: self.n_local] for row in self.expert]

    def owner(self, e: int) -> int:
        return self.home[e][0]

    def replicas(self, e: int) -> list[tuple[int, int, float]]:
        """(rank, slot, share) of every copy of expert `e`, the owner's first."""
        return [(r, j, self.share[r][j]) for r in range(self.ep) for j in range(self.slots) if self.expert[r][j] == e]

    def rank_loads(self, load: list[float]) -> list[float]:
        """Tokens each rank computes when expert e receives load[e] tokens."""
        return [sum(load[e] * s for e, s in zip(self.expert[r], self.share[r]) if e >= 0) for r in range(self.ep)]

    def destinations(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for routing: dest [E, R] global slot ids (rank * slots + slot) of each expert's copies,
        cum [E, R] the cumulative share up to and including each copy (padding: +inf)."""
        copies = [self.replicas(e) for e in range(self.n_experts)]
        width = max(len(c) for c in copies)
        dest = torch.zeros(self.n_experts, width, dtype=torch.long)
        cum = torch.full((self.n_experts, width), math.inf)
        for e, reps in enumerate(copies):
            total = 0.0
            for i, (r, j, share) in enumerate(reps):
                total += share
                dest[e, i], cum[e, i] = r * self.slots + j, total
            cum[e, len(reps) - 1] = 2.0  # the last copy takes whatever rounding leaves
        return dest.to(device), cum.to(device)


def plan_placement(
    load: list[float], ep: int, extra: int, current: SlotMap | None = None, move: bool = False
) -> SlotMap:
    """EPLB: move experts between ranks (`move`), give the hottest ones copies on the `extra`
    slots of each rank and share each expert's tokens among its copies, so that the maximum
    rank load approaches the mean.

    0. with `move`: longest-processing-time packing -- experts by decreasing load, each to the
       least loaded rank whose slot of the expert's index is still free (an expert keeps its
       slot index, so that its weights and optimizer state move as one block between ranks);
    1. ep * extra times: the expert with the most tokens per copy (among those that some
       rank with a free slot does not hold yet) gets a copy on the least loaded such rank;
    2. a few rounds of water-filling: each replicated expert's tokens are spread over its
       copies' ranks to level them (a copy may end up with no tokens).
    A move is kept only if it lowers the busiest rank's load by more than 2%."""
    owned = current.owned() if current is not None else None
    staying = _with_copies(load, ep, extra, owned)
    if not move:
        return staying
    moved = _with_copies(load, ep, extra, _pack_owners(load, ep, owned or SlotMap(len(load), ep, 0).owned()))
    return moved if max(moved.rank_loads(load)) < 0.98 * max(staying.rank_loads(load)) else staying


def _pack_owners(load: list[float], ep: int, owned: list[list[int]]) -> list[list[int]]:
    """Experts to ranks, heaviest first onto the least loaded rank with that slot index free."""
    n_local = len(owned[0])
    column = {e: j for row in owned for j, e in enumerate(row)}
    packed: list[list[int | None]] = [[None] * n_local for _ in range(ep)]
    rank_load = [0.0] * ep
    for e in sorted(column, key=lambda e: (-load[e], e)):
        free = [r for r in range(ep) if packed[r][column[e]] is None]
        r = min(free, key=lambda r: (rank_load[r], r))
        packed[r][column[e]] = e
        rank_load[r] += load[e]
    return packed


def _with_copies(load: list[float], ep: int, extra: int, owned: list[list[int]] | None) -> SlotMap:
    """Steps 1-2 of `plan_placement` for fixed owners; no copies if they do not help."""
    placement = SlotMap(len(load), ep, extra, owned)
    for _ in range(ep * extra):
        options = [
            (e, r)
            for r in range(ep)
            if -1 in placement.expert[r]
            for e in range(len(load))
            if e not in placement.expert[r]
        ]
        if not options:
            break
        copies = [len(placement.replicas(e)) for e in range(len(load))]
        hottest = max({e for e, _ in options}, key=lambda e: (load[e] / copies[e], -e))
        rank_load = placement.rank_loads(load)
        r = min((r for e, r in options if e == hottest), key=lambda r: (rank_load[r], r))
        j = placement.expert[r].index(-1)
        placement.expert[r][j] = hottest
        for rank, slot, _ in placement.replicas(hottest):
            placement.share[rank][slot] = 1.0 / (copies[hottest] + 1)
    for _ in range(4):
        for e in range(len(load)):
            if len(placement.replicas(e)) > 1:
                _level(placement, e, load)
    owners = SlotMap(len(load), ep, extra, owned)
    return placement if max(placement.rank_loads(load)) < max(owners.rank_loads(load)) else owners


def _level(placement: SlotMap, e: int, load: list[float]) -> None:
    """Re-share expert e's tokens over its copies so that their ranks' loads are as level as possible."""
    reps = placement.replicas(e)
    if load[e] <= 0:
        return
    ranks = placement.rank_loads(load)
    base = [ranks[r] - load[e] * s for r, _, s in reps]  # each rank's load without expert e
    lo, hi = min(base), max(base) + load[e]
    for _ in range(60):  # bisection for the water level L: sum(max(0, L - base)) = load[e]
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(max(0.0, mid - b) for b in base) < load[e] else (lo, mid)
    fills = [max(0.0, hi - b) for b in base]
    total = sum(fills)
    for (r, j, _), fill in zip(reps, fills):
        placement.share[r][j] = fill / total


# ---------------------------------------------------------------- capacity and auxiliary loss


def sequence_counts(topk_idx: torch.Tensor, rows: int, n_experts: int) -> torch.Tensor:
    """topk_idx [b*s, k] -> slots per (sequence, expert) [b, E]."""
    flat = topk_idx.view(rows, -1)  # [b, s*k]
    return torch.zeros(rows, n_experts, dtype=torch.long, device=flat.device).scatter_add_(
        1, flat, torch.ones_like(flat)
    )


def capacity_keep(
    topk_idx: torch.Tensor, rows: int, n_experts: int, capacity: int, earlier: torch.Tensor
) -> torch.Tensor:
    """Token-order priority: within a sequence, an expert keeps its first `capacity` slots.
    topk_idx [b*s, k]; earlier [b, E] slots the same sequence already gave each expert on
    the ranks holding its earlier tokens. Returns keep [b*s, k] bool."""
    t, k = topk_idx.shape
    one_hot = (topk_idx.view(rows, -1, 1) == torch.arange(n_experts, device=topk_idx.device)).long()  # [b, s*k, E]
    before = one_hot.cumsum(1) - one_hot + earlier.unsqueeze(1)  # slots of the same expert before each slot
    position = (before * one_hot).sum(-1)  # [b, s*k]
    return (position < capacity).view(t, k)


def aux_loss_part(
    scores: torch.Tensor, counts_full: torch.Tensor, rows: int, seq_full: int, k: int, sigmoid: bool
) -> torch.Tensor:
    """Switch/GShard load-balancing loss per sequence, summed over this rank's sequences:
        sum_b  sum_e  f[b,e] * P[b,e],   f = E * slots[b,e] / (k * s),   P = mean_t p[t,e]
    (1 at perfect balance). scores [b*s_local, E]; counts_full [b, E] slots of the whole
    sequence; P sums only the local tokens (divided by the full s), so the parts of a
    sequence cut over ranks add up to its loss, and the gradient is exact."""
    e = scores.shape[-1]
    probs = scores / scores.sum(-1, keepdim=True) if sigmoid else scores  # [T, E]
    p = probs.view(rows, -1, e).sum(1) / seq_full  # [b, E]
    f = counts_full.to(p.dtype) * e / (k * seq_full)  # [b, E]
    return (f * p).sum()


class _AttachLoss(torch.autograd.Function):
    """Return `out` unchanged; in backward, also give `loss` the gradient 1: `loss` joins the
    training objective without being threaded to the final loss (works inside any stage)."""

    @staticmethod
    def forward(ctx, out, loss):
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.loss_meta
        return grad, torch.ones(shape, dtype=dtype, device=device)


# ---------------------------------------------------------------- the layer's runtime


@dataclass
class LayerStats:
    """One MoE layer's counts over the current optimizer step (all micro-steps)."""

    selected: torch.Tensor  # [E] slots routed to each expert (before capacity)
    kept: torch.Tensor  # [E] slots computed
    slot_rows: torch.Tensor  # [ep, slots] rows each physical slot computed (this rank's row only)
    aux: torch.Tensor  # [] this rank's part of the auxiliary loss (already scaled)
    sent: torch.Tensor  # [ep] rows this rank dispatched to each ep rank (local, not summed over ranks)
    received: torch.Tensor  # [ep] rows this rank received from each ep rank (local)
    copies: torch.Tensor  # [2] EPLB expert copies this rank sent to others, received from owners (per forward, summed)


class ExpertParallelMoE:
    """Forward of one `MoE` module under expert (and tensor) parallelism, with capacity,
    balancing and load statistics. Installed as `moe.runtime`."""

    def __init__(
        self,
        moe: MoE,
        options: MoEOptions,
        ep: Group,
        tp: Group,
        sp: bool,
        aux_scale: float,
        cp: Group | None = None,
        etp: Group | None = None,
    ):
        self.moe, self.options = moe, options
        self.ep, self.tp, self.sp = ep, tp, sp
        self.etp = etp if etp is not None else Group("etp", (0,), None, ep.ledger, index=0)  # expert shards
        self.cp = (
            cp if cp is not None else Group("cp", (0,), None, ep.ledger, index=0)
        )  # sequence chunks (context parallelism)
        self.aux_scale = aux_scale  # 1 / sequences in the global batch: the loss is a mean over sequences
        self.n_experts = moe.router.weight.shape[0]
        self.set_placement(SlotMap(self.n_experts, ep.size, options.eplb_slots))
        self.stats = self._zero_stats()
        self.first_rows: torch.Tensor | None = None  # [2] (sent, received) rows of the step's first forward
        self.recording = False  # whether the current forward is a training one (its loads are counted)
        self.replaying = False  # a forward recomputed in backward (fivecut.parallel.recompute): not counted again
        self.recompute_product = False  # the experts' SwiGLU product computed again in backward (selective recompute)

    def eager_reason(self) -> str | None:
        """Why `train.compile` must leave this layer eager, in one line; None when the layer compiles
        into its block's graph (it then never waits for the host nor calls a collective)."""
        if self.ep.size > 1:
            return f"ep={self.ep.size}: the all-to-all split sizes are read on the host at every dispatch"
        if self.etp.size > 1:
            return f"etp={self.etp.size}: the tokens are gathered and reduce-scattered over etp (collectives)"
        if self.tp.size > 1 and not self.sp:
            return f"tp={self.tp.size} without sp: the layer cuts out and gathers back its tp slice (collectives)"
        per_sequence = self.options.capacity_factor is not None or self.options.aux_loss_coef > 0
        if per_sequence and self.chunks > 1:
            return "capacity or auxiliary loss over tp/cp chunks: the per-sequence counts are all-gathered"
        return None

    def on_device(self) -> None:
        """The routing tables and statistics again, on the device the weights now live on (they
        were made beside the weights on the meta device, before `parallelize` materialized them)."""
        self.set_placement(self.placement)
        self.stats = self._zero_stats()

    def set_placement(self, placement: SlotMap) -> None:
        """Use `placement`; its routing tables get one more row, for a sentinel expert E that
        dropped slots are given: its rows go past the last physical slot (rank * slots + slot)."""
        self.placement = placement
        dest, cum = placement.destinations(self.moe.router.weight.device)  # [E, R] each
        past_the_end = dest.new_full((1, dest.shape[1]), placement.ep * placement.slots)
        self.dest = torch.cat([dest, past_the_end])  # [E + 1, R]
        self.cum = torch.cat([cum, cum.new_full((1, cum.shape[1]), math.inf)])  # [E + 1, R]

    def _zero_stats(self) -> LayerStats:
        e, p = self.n_experts, self.placement

        def zeros(*shape):
            return torch.zeros(shape, dtype=torch.float32, device=self.moe.router.weight.device)

        return LayerStats(zeros(e), zeros(e), zeros(p.ep, p.slots), zeros(), zeros(p.ep), zeros(p.ep), zeros(2))

    def take_stats(self) -> tuple[LayerStats, torch.Tensor | None]:
        """The step's statistics, and the rows (sent, received) of its first training forward."""
        stats, self.stats = self.stats, self._zero_stats()
        first, self.first_rows = self.first_rows, None
        return stats, first

    # ------------------------------------------------------------ forward

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        sliced = self.tp.size > 1 and not self.sp
        x = comm.scatter_along(x, 1, self.tp) if sliced else x  # [b, s/tp, dim]: this tp rank's tokens
        training = torch.is_grad_enabled()
        self.recording = training and not self.replaying  # a first training forward counts loads
        b, s, dim = x.shape
        x_flat = x.reshape(b * s, dim)  # [T, dim]
        topk_idx, topk_weight, scores = moe.route(x_flat)  # [T, k], [T, k], [T, E]
        keep, counts_full = self._capacity(topk_idx, b, s, training)
        out = self._sharded_experts(x_flat, topk_idx, topk_weight, keep)  # [T, dim]
        if self.options.aux_loss_coef > 0 and training:
            aux = self._aux_loss(scores, counts_full, b, s)
            out = _AttachLoss.apply(out, aux)
        if moe.shared is not None:
            out = out + moe.shared(x_flat)
        if self.recording:
            self._count(topk_idx, keep)
        out = out.view(b, s, dim)
        return comm.gather_along(out, 1, self.tp) if sliced else out

    def _sharded_experts(self, x_flat, topk_idx, topk_weight, keep) -> torch.Tensor:
        """The routed experts on this rank's tokens x_flat [T, dim] -> [T, dim]; with expert tensor
        parallelism on the etp group's tokens, each rank's expert shards giving partial sums."""
        etp, k = self.etp, topk_idx.shape[1]
        if etp.size == 1:
            return self._dispatch_combine(x_flat, topk_idx, topk_weight, keep)
        rows = torch.cat([x_flat, topk_weight.to(x_flat.dtype)], 1)  # [T, dim + k]
        rows = comm.gather_along(rows, 0, etp, grad_reduce=True)  # [etp*T, dim + k]
        choice = topk_idx if keep is None else torch.cat([topk_idx, keep.long()], 1)  # [T, k] or [T, 2k]
        choice = comm.all_gather(choice, etp)  # [etp*T, k or 2k]
        x_all, weight_all = rows.split([x_flat.shape[1], k], 1)
        weight_all = weight_all.contiguous()  # its own storage: the combine keeps [etp*T, k], not all the rows
        keep_all = None if keep is None else choice[:, k:].bool()
        partial = self._dispatch_combine(x_all, choice[:, :k], weight_all.to(topk_weight.dtype), keep_all)
        return comm.reduce_scatter_along(partial, 0, etp)  # [T, dim]: the shards' partial sums added

    def _sequence_parts(self, counts: torch.Tensor) -> torch.Tensor:
        """[b, E] this rank's slots per sequence -> [cp*tp, b, E] every chunk's, in sequence order
        (cp chunks, each cut over tp)."""
        parts = counts.unsqueeze(0).contiguous()
        for group in (self.tp, self.cp):
            if group.size > 1:
                parts = comm.all_gather(parts, group, dim=0)
        return parts

    @property
    def chunks(self) -> int:
        """Ranks a sequence is cut over in this layer (tp slices within cp chunks)."""
        return self.tp.size * self.cp.size

    def _capacity(self, topk_idx: torch.Tensor, b: int, s: int, training: bool):
        """keep [T, k] (None when dropless) and the slots per (sequence, expert) of whole sequences."""
        need_counts = self.options.capacity_factor is not None or (self.options.aux_loss_coef > 0 and training)
        if not need_counts:
            return None, None
        parts = self._sequence_parts(sequence_counts(topk_idx, b, self.n_experts))  # [tp, b, E]
        if self.options.capacity_factor is None:
            return None, parts.sum(0)
        seq_full = s * self.chunks
        capacity = math.ceil(self.options.capacity_factor * seq_full * self.moe.top_k / self.n_experts)
        earlier = parts[: self.cp.rank * self.tp.size + self.tp.rank].sum(
            0
        )  # [b, E] slots of this sequence's earlier chunks
        return capacity_keep(topk_idx, b, self.n_experts, capacity, earlier), parts.sum(0)

    def _aux_loss(self, scores, counts_full, b: int, s: int) -> torch.Tensor:
        part = aux_loss_part(scores, counts_full, b, s * self.chunks, self.moe.top_k, self.moe.gate == "sigmoid")
        aux = part * (self.options.aux_loss_coef * self.aux_scale)
        if self.recording:
            self.stats.aux += aux.detach()
        return aux

    def _count(self, topk_idx: torch.Tensor, keep: torch.Tensor | None) -> None:
        selected = count_ids(topk_idx, self.n_experts)  # [E]
        kept = selected if keep is None else count_ids(self._kept_ids(topk_idx, keep), self.n_experts + 1)[:-1]
        self.stats.selected += selected
        self.stats.kept += kept
        self.moe.tokens_per_expert.copy_(kept)

    def _kept_ids(self, topk_idx: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """[T, k] chosen experts -> [T*k], a dropped slot's expert replaced by the sentinel E."""
        return torch.where(keep, topk_idx, self.n_experts).reshape(-1)

    def _destinations(self, experts: torch.Tensor) -> torch.Tensor:
        """Global physical slot (rank * slots + slot) for each row of logical expert `experts` [N]
        (the sentinel E: ep * slots, past every slot). An expert with copies gives its i-th of
        n rows to the copy whose cumulative share first exceeds (i + 1/2) / n."""
        if self.dest.shape[1] == 1:
            return self.dest[experts, 0]
        n = experts.shape[0]
        by_expert = torch.argsort(experts, stable=True)
        counts = count_ids(experts, self.n_experts + 1)
        starts = counts.cumsum(0) - counts
        position = torch.empty_like(experts)
        position[by_expert] = torch.arange(n, device=experts.device) - starts[experts[by_expert]]
        fraction = (position.float() + 0.5) / counts[experts].float()
        copy = (fraction.unsqueeze(1) >= self.cum[experts]).sum(1)  # [N]
        return self.dest[experts, copy]

    def _dispatch_combine(self, x_flat, topk_idx, topk_weight, keep) -> torch.Tensor:
        """Permute, dispatch, compute, combine, unpermute: x_flat [T, dim] -> [T, dim].
        A dropped slot (capacity) sorts after every kept one: at ep = 1 it stays in the experts'
        input as a row past the last group (giving zero), at ep > 1 it is not sent."""
        t, k = topk_idx.shape
        p, ep = self.placement, self.ep
        n_slots = p.ep * p.slots
        experts = topk_idx.reshape(-1) if keep is None else self._kept_ids(topk_idx, keep)  # [T*k]
        dest = self._destinations(experts)  # [T*k] global physical slot; dropped: n_slots
        order = torch.argsort(dest, stable=True)  # [T*k] flat (token, slot) indices grouped by (rank, slot)
        send_counts = count_ids(dest, n_slots + 1)[:n_slots].view(p.ep, p.slots)  # [ep, slots]
        x_send = x_flat[order // k]  # [T*k, dim]
        if ep.size == 1:  # nothing to move: the rows stay where they are, dropped ones last
            recv_counts, y_back = send_counts, self._experts(x_send, send_counts, tail=keep is not None)
        else:
            recv_counts = comm.all_to_all_single(send_counts, ep)  # [ep, slots] rows from each source per local slot
            in_splits, out_splits = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()  # the host sync
            x_recv = comm.all_to_all(x_send[: sum(in_splits)], ep, out_splits, in_splits)  # dispatch [N_recv, dim]
            y_recv = self._experts(x_recv, recv_counts, tail=False)
            y_back = comm.all_to_all(y_recv, ep, in_splits, out_splits)  # combine: [N, dim] in sent order
        if self.recording:
            self.stats.sent += send_counts.sum(1)
            self.stats.received += recv_counts.sum(1)
            if self.first_rows is None:
                self.first_rows = torch.stack([send_counts.sum(), recv_counts.sum()])
        row = torch.empty_like(order)
        row[order] = torch.arange(t * k, device=order.device)  # where each (token, slot)'s output sits
        row = row.clamp(max=y_back.shape[0])  # dropped slots that were not sent: the zero row
        y_slots = torch.cat([y_back, y_back.new_zeros(1, y_back.shape[-1])])[row]  # [T*k, dim] (saves only `row`)
        weight = topk_weight if keep is None else topk_weight.masked_fill(~keep, 0.0)
        return (y_slots.view(t, k, -1) * weight.to(y_slots.dtype).unsqueeze(-1)).sum(1)  # [T, dim]

    def _experts(self, x_recv: torch.Tensor, recv_counts: torch.Tensor, tail: bool) -> torch.Tensor:
        """x_recv [N_recv, dim] in (source, slot) blocks of recv_counts [ep, slots] rows -> each
        slot's expert applied, same order: one grouped GEMM over the slots, its offsets on the
        device. `tail`: rows past the blocks (dropped slots), which give zero."""
        p = self.placement
        if self.recording and self.etp.rank == 0:  # the etp ranks compute the same rows: count them once
            self.stats.slot_rows[self.ep.rank] += recv_counts.sum(0)
        x, by_slot = x_recv, None
        if p.ep > 1:  # source-major blocks -> slot-major rows
            n = x_recv.shape[0]
            blocks = torch.arange(p.ep * p.slots, device=x.device)
            block = torch.repeat_interleave(blocks, recv_counts.flatten(), output_size=n)  # [N_recv]
            by_slot = torch.argsort(block % p.slots, stable=True)  # [N_recv]
            x = x_recv[by_slot]
        ends = group_ends(recv_counts.sum(0))  # [slots]
        inside = (torch.arange(x.shape[0], device=x.device) < ends[-1]).unsqueeze(1)  # [N, 1]
        if tail:  # rows past the last group are left undefined by the kernels: zero, with zero gradient
            x = torch.where(inside, x, 0)
        y = self.moe.experts.run(x, self._slot_tensors(), ends, self.recompute_product)  # [N_recv, dim]
        if tail:
            y = torch.where(inside, y, 0)
        if by_slot is None:
            return y
        inverse = torch.empty_like(by_slot).scatter_(0, by_slot, torch.arange(n, device=x.device))
        return y[inverse]  # back to (source, slot) blocks

    def _slot_tensors(self) -> dict[str, torch.Tensor]:
        """Every expert tensor by name (w1, w3 [slots, dim, hidden], w2 [slots, hidden, dim], the
        adapters of `LoRAExperts`): the owned experts, then the copies sent by their owners (an
        empty slot: zeros; it receives no rows)."""
        owned = self.moe.experts.expert_tensors()
        if self.placement.extra == 0:
            return owned
        return {name: torch.cat([w, copies]) for (name, w), copies in zip(owned.items(), self._fetch_copies())}

    def _fetch_copies(self) -> list[torch.Tensor]:
        """EPLB copies: every owner sends the tensors of its experts that other ranks' extra slots
        hold, adapters included (a differentiable all-to-all: the copies' gradients come back to the
        owner). Returns this rank's extra slots' tensors [extra, ...], in `expert_tensors` order."""
        p, me = self.placement, self.ep.rank
        ex = self.moe.experts
        # the fp32 masters travel (bf16: not the step's copies), as the ledger counts them
        masters = [master(ex, name) for name in ex.EXPERT_TENSORS]
        flat = torch.cat([w.flatten(1) for w in masters], 1)  # [n_local, elements of one expert]
        wanted = [[e for e in p.expert[r][p.n_local :] if e >= 0] for r in range(p.ep)]  # per rank, slot order
        rows = [p.home[e][1] for r in range(p.ep) for e in wanted[r] if p.owner(e) == me]  # my slots of those experts
        in_splits = [sum(p.owner(e) == me for e in wanted[r]) for r in range(p.ep)]
        out_splits = [sum(p.owner(e) == s for e in wanted[me]) for s in range(p.ep)]
        recv = comm.all_to_all(flat[rows], self.ep, out_splits, in_splits)  # [copies here, 3*dim*hidden] by owner
        if self.recording:
            self.stats.copies += torch.tensor(
                [len(rows) - in_splits[me], sum(out_splits) - out_splits[me]],
                dtype=torch.float32,
                device=self.stats.copies.device,
            )
        row_of = {e: i for i, e in enumerate(sorted(wanted[me], key=lambda e: (p.owner(e), wanted[me].index(e))))}
        picks = [row_of[e] if e >= 0 else len(row_of) for e in p.expert[me][p.n_local :]]  # an empty slot: zeros
        recv = torch.cat([recv, recv.new_zeros(1, recv.shape[1])])[torch.tensor(picks, device=recv.device)]
        parts = recv.split([w[0].numel() for w in masters], 1)  # [extra, one expert's elements] each
        return [part.view(-1, *w.shape[1:]) for part, w in zip(parts, masters)]


# ---------------------------------------------------------------- moving experts between ranks (EPLB)


def move_experts(rt: ExpertParallelMoE, new: SlotMap, optimizer: torch.optim.Optimizer, sync) -> int:
    """Send each owned expert whose rank changes -- every tensor holding its slot: parameter
    rows, ZeRO master shard, Adam moments -- to its new owner. An expert keeps its slot index,
    so the ranks of an ep group (which share one data-parallel layout) exchange equal blocks.
    Returns the elements this rank sent to others."""
    old, me, ep = rt.placement.owned(), rt.ep.rank, rt.ep.size
    dest = [next(r for r in range(ep) if new.expert[r][j] == old[me][j]) for j in range(rt.placement.n_local)]
    src = [next(r for r in range(ep) if old[r][j] == new.expert[me][j]) for j in range(rt.placement.n_local)]
    views = [slot_views(rt.moe, j, optimizer, sync) for j in range(rt.placement.n_local)]
    blocks = [torch.cat([v.reshape(-1) for v in vs]) for vs in views]  # [elements of slot j]
    order = sorted(range(len(blocks)), key=lambda j: (dest[j], j))  # by destination, then slot
    in_splits = [sum(blocks[j].numel() for j in order if dest[j] == r) for r in range(ep)]
    out_splits = [sum(blocks[j].numel() for j in range(len(blocks)) if src[j] == r) for r in range(ep)]
    recv = comm.all_to_all_single(torch.cat([blocks[j] for j in order]), rt.ep, out_splits, in_splits)
    incoming = sorted(range(len(blocks)), key=lambda j: (src[j], j))  # each source sends its blocks in slot order
    for j, block in zip(incoming, torch.split(recv, [blocks[j].numel() for j in incoming])):
        offset = 0
        for v in views[j]:
            v.copy_(block[offset : offset + v.numel()].view_as(v))
            offset += v.numel()
    return sum(in_splits) - in_splits[me]


def slot_views(moe: MoE, j: int, optimizer: torch.optim.Optimizer, sync) -> list[torch.Tensor]:
    """Every tensor on this rank that holds local expert slot `j` of `moe`, as the data cut
    reports them (`GradSync.held`): the parameters' rows or the ZeRO master shard's part of
    them, and the optimizer's per-element state (Adam's moments) of what it updates for them."""
    views = []
    with torch.no_grad():
        for p in (master(moe.experts, name) for name in moe.experts.EXPERT_TENSORS):
            row = p.shape[1:].numel()
            held = sync.held(p, j * row, (j + 1) * row)
            views += [v for v, _ in held.values] + [
                m for t, lo, hi, _ in held.optimized for m in _moments(optimizer, t, lo, hi)
            ]
    return views


def _moments(optimizer, t: torch.Tensor, lo: int, hi: int) -> list[torch.Tensor]:
    """The optimizer's per-element state of elements [lo, hi) of the flattened `t` (Adam's moments)."""
    state = optimizer.state.get(t, {})
    return [state[key].view(-1)[lo:hi] for key in ("exp_avg", "exp_avg_sq") if key in state]


# ---------------------------------------------------------------- installing, and the step's bookkeeping


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def expert_slice(n_experts: int, ep: int, experts: list[int]) -> Slice:
    """Where a rank's expert weights sit in the logical [E, ...] tensor: the experts it owns, by slot."""
    return Slice("ep", 0, experts[0], n_experts // ep, n_experts, experts=tuple(experts))


def shard_experts(moe: MoE, ep: Group) -> Slice:
    """Keep this rank's E/ep experts (cut from the seeded full weights, so any layout starts equal)."""
    ex = moe.experts
    n_experts = ex.w1.shape[0]
    n_local = n_experts // ep.size
    lo = ep.rank * n_local
    for name in ex.EXPERT_TENSORS:  # the weights and their adapters ([lora])
        full = master(ex, name)
        local = full.detach()[lo : lo + n_local].clone()
        setattr(ex, name, nn.Parameter(local, requires_grad=full.requires_grad))  # frozen ([lora]) stays frozen
    return expert_slice(n_experts, ep.size, list(range(lo, lo + n_local)))


def cut_expert_hidden(moe: MoE, etp: Group) -> dict[str, Change]:
    """Expert tensor parallelism: this rank keeps its etp slice of every local expert's hidden
    size -- w1, w3 [E_loc, dim, hidden/etp] (columns), w2 [E_loc, hidden/etp, dim] (rows) -- cut
    from the (EP-cut) weights. [lora]: the adapters' hidden sides are cut alike (w1's and w3's B,
    w2's A); the others (the shared gate/up A, w2's B) stay whole, their gradients partial sums
    that autograd adds over etp (`LoRAExperts.grad_summed`). Returns the slices and sums, by path
    inside the MoE module."""
    ex, out = moe.experts, {}
    hidden = ex.w1.shape[2]
    length = hidden // etp.size
    for name, dim in ex.EXPERT_TENSORS.items():
        if dim is None:
            out[f"experts.{name}"] = Change(summed_over="etp")
            continue
        full = master(ex, name)
        local = full.detach().narrow(dim, etp.rank * length, length).clone()
        setattr(ex, name, nn.Parameter(local, requires_grad=full.requires_grad))  # frozen ([lora]) stays frozen
        out[f"experts.{name}"] = Change(slice=Slice("etp", dim, etp.rank * length, length, hidden))
    if hasattr(ex, "grad_summed"):
        ex.grad_summed = functools.partial(comm.copy_to, group=etp)
    if hasattr(ex, "adds_down_bias"):  # GPT-OSS's down bias: added once to the shards' partial sums
        ex.adds_down_bias = etp.rank == 0
    return out


def reduce_groups(moe: MoE, ep: int, tp: int, cut: Slice | None) -> dict[str, Change]:
    """Which group sums each gradient of `moe` (see `fivecut.mesh.Mesh._expert_groups`), by path
    inside the MoE module: experts over `expert_dp`, the router and shared experts over
    dp x cp x tp under tp (each tp rank routes its own tokens)."""
    out = {}
    expert_group = "expert_dp" if ep > 1 or tp > 1 else None
    for name in moe.experts.EXPERT_TENSORS:
        out[f"experts.{name}"] = Change(slice=cut, reduce=expert_group)
    if tp > 1:
        for prefix, module in (("router", moe.router), ("shared", moe.shared)):
            for path, _ in module.named_parameters() if module is not None else ():
                out[f"{prefix}.{path}"] = Change(reduce="dp_cp_tp")
    return out


class ExpertBalancer:
    """All MoE layers of this rank: installs their runtime, and after each step's backward
    sums the load statistics over the ranks, moves the balancing biases, re-plans EPLB
    placements and returns the step's MoE metrics."""

    def __init__(
        self,
        runtimes: dict[int, ExpertParallelMoE],
        options: MoEOptions,
        moe_layer_ids: list[int],
        stats_groups: list[Group],
        n_experts: int,
        ep: int,
        device,
    ):
        self.runtimes, self.options = runtimes, options
        self.layer_ids = moe_layer_ids  # every MoE layer of the model, on any pipeline rank
        self.stats_groups = stats_groups  # where the statistics are summed (the same on every rank)
        self.n_experts, self.device = n_experts, device
        self.slot_shape = (ep, n_experts // ep + options.eplb_slots)
        self.history = {i: deque(maxlen=options.eplb_window) for i in runtimes}
        self.pending: dict[int, SlotMap] = {}  # placements that move experts, applied after the optimizer step

    def end_step(self, step: int) -> dict:
        """Reduce the step's statistics, update biases and placements; return the metrics."""
        e, slot_shape = self.n_experts, self.slot_shape
        per_layer = 2 * e + 1 + slot_shape[0] * slot_shape[1]  # a fixed layout: every rank sends the same vector
        vec = torch.zeros(len(self.layer_ids) * per_layer, device=self.device)
        taken = {i: rt.take_stats() for i, rt in self.runtimes.items()}
        stats = {i: st for i, (st, _) in taken.items()}
        for i, st in stats.items():
            at = self.layer_ids.index(i) * per_layer
            vec[at : at + per_layer] = torch.cat([st.selected, st.kept, st.aux.view(1), st.slot_rows.flatten()])
        for group in self.stats_groups:
            comm.all_reduce(vec, group)
        rows = vec.view(len(self.layer_ids), per_layer).cpu()
        self._balance(step, rows, e)
        metrics = self._metrics(rows, e, slot_shape)
        metrics["local"] = {
            i: {
                "sent": st.sent.tolist(),
                "received": st.received.tolist(),
                "copies_sent": st.copies[0].item(),
                "copies_received": st.copies[1].item(),
                "first_forward_rows": None if first is None else tuple(int(v) for v in first.tolist()),
                "moved_elements": 0,
            }  # set by the trainer after `apply_moves`
            for i, (st, first) in taken.items()
        }
        return metrics

    def _balance(self, step: int, rows: torch.Tensor, e: int) -> None:
        for i, rt in self.runtimes.items():
            row = rows[self.layer_ids.index(i)]
            selected, kept = row[:e], row[e : 2 * e]
            if self.options.bias_update_rate > 0:  # auxiliary-loss-free: overloaded experts get less bias
                step_sign = torch.sign(selected.mean() - selected).to(rt.moe.expert_bias.device)
                rt.moe.expert_bias += self.options.bias_update_rate * step_sign
            if self.options.eplb:
                self.history[i].append(kept)
                if step % self.options.eplb_interval == 0:
                    load = torch.stack(list(self.history[i])).sum(0).tolist()
                    new = plan_placement(
                        load, rt.ep.size, self.options.eplb_slots, rt.placement, self.options.eplb_move
                    )
                    if new.owned() == rt.placement.owned():
                        rt.set_placement(new)
                    else:  # experts change ranks: after the optimizer step (`apply_moves`)
                        self.pending[i] = new

    def apply_moves(self, optimizer: torch.optim.Optimizer, sync) -> dict[int, int]:
        """Move the experts whose owner changed -- weights, master shards and optimizer state --
        to their new ranks (one all-to-all per layer over ep), then use the new placement.
        Called after the optimizer step, when gradients are spent. Returns, per layer, the
        elements this rank sent."""
        moved = {}
        for i, new in sorted(self.pending.items()):
            moved[i] = move_experts(self.runtimes[i], new, optimizer, sync)
            self.runtimes[i].set_placement(new)
        self.pending.clear()
        return moved

    def _metrics(self, rows: torch.Tensor, e: int, slot_shape: tuple[int, int]) -> dict:
        """Per layer: expert loads, max/mean expert load, max/mean rank load (and what it would
        have been without EPLB: expert e on rank e // (E/ep), no copies); over all: dropped
        fraction, auxiliary loss."""
        out: dict = {"layers": {}}
        selected_all = kept_all = 0.0
        for n, layer in enumerate(self.layer_ids):
            row = rows[n]
            selected, kept, aux = row[:e], row[e : 2 * e], float(row[2 * e])
            slot_rows = row[2 * e + 1 :].view(slot_shape)
            rank_rows = slot_rows.sum(1)
            owners = kept.view(slot_shape[0], -1).sum(1)  # ranks' loads without EPLB (the initial placement)
            out["layers"][layer] = {
                "load": [int(v) for v in selected.tolist()],
                "max_mean": float(selected.max() / selected.mean()) if selected.sum() > 0 else 1.0,
                "rank_max_mean": float(rank_rows.max() / rank_rows.mean()) if rank_rows.sum() > 0 else 1.0,
                "rank_max_mean_no_eplb": float(owners.max() / owners.mean()) if owners.sum() > 0 else 1.0,
                "aux_loss": aux,
            }
            selected_all += float(selected.sum())
            kept_all += float(kept.sum())
        layers = out["layers"].values()
        out["max_mean"] = sum(v["max_mean"] for v in layers) / max(len(layers), 1)
        out["rank_max_mean"] = sum(v["rank_max_mean"] for v in layers) / max(len(layers), 1)
        out["rank_max_mean_no_eplb"] = sum(v["rank_max_mean_no_eplb"] for v in layers) / max(len(layers), 1)
        out["dropped"] = 1.0 - kept_all / selected_all if selected_all else 0.0
        out["aux_loss"] = sum(v["aux_loss"] for v in layers)
        return out


def apply_expert_parallel(
    model: nn.Module,
    options: MoEOptions,
    ep: Group,
    tp: Group,
    sp: bool,
    global_batch: int,
    cp: Group | None = None,
    etp: Group | None = None,
) -> tuple[dict[int, ExpertParallelMoE], dict[str, Change]]:
    """Cut the experts of every MoE layer of `model` (a model or a pipeline stage) over `ep` and
    install their runtime. Returns the runtimes by layer id, and what was done to each
    parameter, by path in `model`."""
    runtimes, changes = {}, {}
    for path, block in model.layers.items():
        if not isinstance(block.feed_forward, MoE):
            continue
        moe = block.feed_forward
        cut = shard_experts(moe, ep) if ep.size > 1 else None
        for name, change in reduce_groups(moe, ep.size, tp.size, cut).items():
            changes[f"layers.{path}.feed_forward.{name}"] = change
        moe.runtime = runtimes[block.layer_id] = ExpertParallelMoE(
            moe, options, ep, tp, sp, 1.0 / global_batch, cp, etp
        )
    return runtimes, changes


def apply_expert_tensor_parallel(model: nn.Module, etp: Group) -> dict[str, Change]:
    """Cut the hidden size of the routed experts of every MoE layer of `model` over `etp`
    (their runtimes, installed by `apply_expert_parallel`, already gather and reduce over it)."""
    changes = {}
    for path, block in model.layers.items():
        if isinstance(block.feed_forward, MoE):
            for name, change in cut_expert_hidden(block.feed_forward, etp).items():
                changes[f"layers.{path}.feed_forward.{name}"] = change
    return changes
