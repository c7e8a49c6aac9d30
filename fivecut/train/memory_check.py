"""The plan's memory checked on one real training step run on fake tensors (`fivecut plan --check`).

One process pretends to be one rank of the layout (the pipeline position the plan says peaks; dp,
cp and tp coordinate 0): torch's "fake" process-group backend stands in for the other ranks (its
collectives return at once, leaving every buffer the real ones would leave), and
`torch._subclasses.FakeTensorMode` gives every tensor its real shape, dtype and storage size and
no data, so fivecut's own code runs unchanged: the model, `parallelize` with every cut, the
pipeline schedule, ZeRO, recomputation, the chunked loss, AdamW and the clipping. Torch's
dispatch-mode tracker (`torch.distributed._tools.mem_tracker.MemTracker`) counts each live storage
once, by kind (parameters, gradients, optimizer state, activations, backward's temporaries);
`StepTracker` adds the step's moments: "forward" (before the head first runs; on a rank without
the head, the whole forward and backward), "loss" (from the head's forward to the gradient of its
input), "blocks" (the rest of the forward and backward), "backward" (what is live when the last
backward and the gradients' reduction are done: the end of the backward) and "optimizer"
(clipping, AdamW, ZeRO's gathers, until the compute copies are dropped). Two steps run; the
second is counted, when the optimizer state of the first exists as it does in every later step.

The device. Fake CUDA tensors need a CUDA build of torch (autograd asks the CUDA runtime for a
device guard even for fake tensors); on a CPU-only build the check runs on fake CPU tensors. The
planned device is a GPU, and two kernel choices there change what a step holds:
  * RMSNorm: CUDA runs `_fused_rms_norm`, whose backward saves the input and the per-token rstd;
    the CPU's composite norm saves the normalized input as well (4 B x h a token a norm). With
    `kernels="cuda"` the check runs the norm as an autograd function that saves what the CUDA
    kernel saves (`KernelRMSNorm`), computing through the same ATen ops.
  * autocast: CPU and CUDA autocast cast different op lists. Every op of fivecut's step whose
    dtype they treat differently gets explicit dtypes in the model (RMSNorm and RoPE compute in
    fp32, the loss upcasts its logits, the router's scores are fp32), and the matmuls and SDPA are
    on both lists as bf16, so the CPU's autocast saves the same dtypes; the check mirrors CPU
    autocast (the only one that runs here) and that is what the plan's closed forms count.
  * the gradient norm: on a GPU one `_foreach_norm` (no temporaries), on the CPU a sum of squares
    a tensor (one temporary of the largest gradient): the check runs the CPU's, which is seen
    only in its optimizer moment.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses import FakeTensorMode
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.distributed._tools.mod_tracker import ModTracker
from torch.testing._internal.distributed.fake_pg import FakeStore

from fivecut.config import Config
from fivecut.mesh import Mesh
from fivecut.model.transformer import build_model
from fivecut.parallel.parallelize import ParallelizeOptions, parallelize
from fivecut.train.optim import adamw_kernel, build_optimizer, clipped_norm
from fivecut.train.run import Context, forward_backward
from fivecut.train.trainer import optimizer_step

MOMENTS = ("forward", "loss", "blocks", "backward", "optimizer")
KINDS = {"PARAM": "params", "GRAD": "grads", "OPT": "optimizer", "ACT": "activations", "TEMP": "temporaries"}


@dataclass
class StepMemory:
    """One rank's step, counted: the peak, the moment it fell in, and each moment's peak and its
    bytes by kind (`KINDS`; "other": buffers and what exists outside modules and the optimizer)."""

    rank: int
    device: str  # what the tensors pretended to live on ("cpu"; "cuda" on a CUDA build)
    kernels: str  # whose kernels' saved tensors the step mirrors ("cuda" or "cpu")
    peak: int = 0
    moment: str = ""
    moments: dict[str, int] = field(default_factory=dict)  # moment -> its peak bytes
    terms: dict[str, dict[str, int]] = field(default_factory=dict)  # moment -> kind -> bytes at its peak
    start: dict[str, int] = field(default_factory=dict)  # kind -> bytes when the counted step began


class ParamClassifier(ModTracker):
    """`ModTracker` reduced to the pre-forward call MemTracker classifies parameters in. The
    original also hooks every module input's gradient (`register_multi_grad_hook`), and that hook's
    closure holds the input's AccumulateGrad: a pipeline stage's received input then outlives its
    backward, and the counted peak grows with the microbatches a step runs."""

    def _fw_pre_hook(self, mod, input) -> None:
        if self._user_pre_fw_hook is not None:
            self._user_pre_fw_hook(mod, input)

    def _fw_post_hook(self, mod, input, output) -> None:
        pass


class StepTracker(MemTracker):
    """`MemTracker` with the step's moments: each moment's peak and the bytes by kind at it."""

    def __init__(self, uniform_rows: int = 0) -> None:
        super().__init__()
        self._mod_tracker = ParamClassifier()  # backward is told by autograd's graph task, not hooks
        self.uniform_rows = uniform_rows  # a fake scalar read on the host: rows an EP rank sends each rank
        self.moment: str | None = None  # None: not counting moments (building, the first step)
        self.peaks: dict[str, int] = {}
        self.snaps: dict[str, dict] = {}

    def _pre_fw_hook(self, module, inputs) -> None:
        """Each module's parameters, buffers and gradients classified once (MemTracker's own hooks
        keep module-wise snapshots and refuse a module called twice: microbatches, micro-steps)."""
        if module not in self.memory_tracking:
            self._track_module_params_and_buffers(module, install_grad_hooks=False)
            self._hook_grads(module)
            self.memory_tracking[module] = None

    def _hook_grads(self, module) -> None:
        """MemTracker's gradient hooks on the parameters that have gradients (a frozen one, [lora],
        takes no hook)."""
        for param in module.parameters():
            if param.requires_grad and param not in self._param_to_grad_hook_handles:
                self._param_to_grad_hook_handles[param] = (
                    param.register_hook(self._count_grad),
                    param.register_post_accumulate_grad_hook(lambda p: self._count_grad(p.grad)),
                )

    def _count_grad(self, grad: torch.Tensor) -> None:
        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

    def _update_peak_stats(self, peak_state) -> None:
        if self.moment is None:
            return  # the module-wise and global peaks of MemTracker are not read: skip their cost
        for device, snap in self._curr_mem_snap.items():
            if str(device) == "meta":
                continue
            total = snap["Total"]
            if total > self.peaks.get(self.moment, -1):
                self.peaks[self.moment] = total
                self.snaps[self.moment] = dict(snap)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """A value read on the host from a fake tensor (expert parallelism's split sizes, once per
        dispatch) is the uniform routing's: every EP rank sends each the same rows."""
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except DataDependentOutputException:  # a fake tensor without a known value (AdamW's steps have one)
            if func is not torch.ops.aten._local_scalar_dense.default or not self.uniform_rows:
                raise
            return self.uniform_rows

    def _track(self, reftype, t: torch.Tensor) -> None:
        for part in dense_parts(t):
            super()._track(reftype, part)

    def _update_and_maybe_create_winfos(self, t: torch.Tensor, reftype, update_existing: bool = False) -> set:
        found = set()
        for part in dense_parts(t):
            found |= super()._update_and_maybe_create_winfos(part, reftype, update_existing)
        return found

    def ended(self, moment: str) -> None:
        """`moment` is an instant, not a span: what is live now."""
        self.snaps[moment] = self.now()
        self.peaks[moment] = self.snaps[moment]["Total"]

    def now(self) -> dict:
        """What is live now on the step's device. A meta tensor holds no memory but gets an entry of
        its own (a frozen weight's meta shell, [lora]), which may come first."""
        held = [snap for device, snap in self._curr_mem_snap.items() if str(device) != "meta"]
        return dict(held[0]) if held else {"Total": 0}


def dense_parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A tensor's storages as dense tensors: a sparse one (a split backward's embedding gradient)
    by its indices and values, which MemTracker cannot read through the sparse tensor itself."""
    if isinstance(t, torch.Tensor) and t.layout == torch.sparse_coo:
        return (t._indices(), t._values())
    return (t,)


class KernelRMSNorm(torch.autograd.Function):
    """RMSNorm saving what CUDA's `_fused_rms_norm` saves for backward (input, rstd, weight),
    computed with the same ATen ops (their CPU decompositions here)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float | None) -> torch.Tensor:
        shape = [x.shape[-1]]
        y, rstd = torch.ops.aten._fused_rms_norm(x, shape, weight, eps)  # [..., h], [..., 1] fp32
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1]]
        dx, dw = torch.ops.aten._fused_rms_norm_backward(dy, x, [x.shape[-1]], rstd, weight, mask)
        return dx, dw, None


def kernel_rms_norm(x, normalized_shape, weight=None, eps=None):
    """`F.rms_norm` as CUDA runs it: under autocast, CUDA's policy for `rms_norm` (fp32: a bf16
    input and weight are cast to fp32 first, and the output stays fp32; the CPU's autocast leaves
    the norm alone), then `KernelRMSNorm` (the fused kernel's saved tensors)."""
    if len(normalized_shape) != 1:
        return TORCH_RMS_NORM(x, normalized_shape, weight, eps)
    if not torch.is_autocast_enabled(x.device.type):
        return KernelRMSNorm.apply(x, weight, eps)
    with torch.autocast(x.device.type, enabled=False):
        return KernelRMSNorm.apply(x.float(), None if weight is None else weight.float(), eps)


TORCH_RMS_NORM = F.rms_norm


@contextlib.contextmanager
def cuda_norms():
    """`F.rms_norm` is `kernel_rms_norm` inside: every norm of the model (and of SP, and those a
    recomputation runs again in backward) reads it from `torch.nn.functional` when it runs."""
    F.rms_norm = kernel_rms_norm
    try:
        yield
    finally:
        F.rms_norm = TORCH_RMS_NORM


class FakeBatches:
    """The sampler's two calls with random token ids of the step's shapes (fake under fake tensors)."""

    def __init__(self, cfg: Config, vocab: int):
        self.cfg, self.vocab = cfg, vocab

    def local_batches(self, step: int, dp_rank: int, dp_size: int, accumulate: int):
        t = self.cfg.train
        rows = t.global_batch // (dp_size * accumulate)
        return [self.pair(rows, t.seq_len) for _ in range(accumulate)]

    def pair(self, rows: int, seq: int):
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.vocab, (rows, seq + 1), generator=g)  # [b, s + 1]
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def tokens_in_global_batch(self, step: int | None = None) -> int:
        return self.cfg.train.global_batch * self.cfg.train.seq_len


def global_rank(cfg: Config, pp_rank: int) -> int:
    """The global rank at pipeline position `pp_rank`, dp, cp and tp coordinates 0 ([pp, dp, cp, tp] grid)."""
    d = cfg.parallel
    return pp_rank * d.dp * d.cp * d.tp


def fake_device() -> torch.device:
    """CUDA where this torch is built with it (fake CUDA tensors then work), else the CPU."""
    return torch.device("cuda", 0) if torch.backends.cuda.is_built() else torch.device("cpu")


def step_memory(
    args, cfg: Config, pp_rank: int = 0, fake: bool = True, kernels: str = "cuda", device=None
) -> StepMemory:
    """Two training steps of `cfg` as the rank at pipeline position `pp_rank`, the second counted.
    `fake`: on fake tensors (no memory is allocated); else real ones (a check of the check)."""
    device = device or (fake_device() if fake else torch.device("cpu"))
    rank = global_rank(cfg, pp_rank)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cfg.parallel.world_size)
    try:
        mesh = Mesh(cfg.parallel, device.type, moe=args.is_moe)
        meta = build_model(args, device="meta")  # outside the fake mode: meta tensors stay meta
        faking = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
        norms = cuda_norms() if kernels == "cuda" and device.type != "cuda" else contextlib.nullcontext()
        with warnings.catch_warnings(), faking, norms:
            warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
            tracker = StepTracker(uniform_rows(args, cfg))
            with tracker:
                ctx = context(args, cfg, mesh, meta, device)
                tracker.track_external(ctx.par.module, *ctx.par.state_tensors()[0])
                one_step(ctx, 1, tracker)
                tracker.track_external(ctx.optimizer)
                start = tracker.now()
                one_step(ctx, 2, tracker)
    finally:
        dist.destroy_process_group()
    return counted(tracker, start, rank, device.type, kernels)


def uniform_rows(args, cfg: Config) -> int:
    """Rows a rank's MoE dispatch sends each EP rank (and receives from each) under uniform
    routing, as the plan assumes: top_k per token of the tokens it sees (a microbatch's, / tp x etp)."""
    d, t = cfg.parallel, cfg.train
    rows = t.global_batch // (d.dp * t.accumulate * (d.microbatches if d.pp > 1 else 1))
    tokens = rows * t.seq_len // d.cp // d.tp * d.etp
    return tokens * args.top_k // d.ep if args.is_moe else 0


def context(args, cfg: Config, mesh: Mesh, meta, device: torch.device) -> Context:
    """What `fivecut.train.run.setup` builds, less the corpus and the tokenizer."""
    t = cfg.train
    par = parallelize(meta, mesh, ParallelizeOptions.from_train(t, cfg.moe, t.seed, device, lora=cfg.lora))
    kernel, _ = adamw_kernel(t.adamw, device)
    optimizer = build_optimizer(par.pieces, t.lr, t.weight_decay, (t.beta1, t.beta2), t.eps, kernel)
    metrics = mesh.group("dp_cp")
    return Context(
        cfg, mesh, device, par, optimizer, FakeBatches(cfg, args.vocab_size), [], metrics, metrics, 0.0, args
    )


def one_step(ctx: Context, step: int, tracker: StepTracker) -> None:
    """The trainer's `run_step` less what reads values (the loss's all-reduce, the stop flags, the
    experts' balancing and EPLB's moves: small tensors, whole experts moved between ranks):
    zero_grad, every micro-step's forward and backward, clipping, AdamW, ZeRO's gathers. Step 1
    is whole too: what a step makes and keeps for the next (the optimizer state, a split
    backward's dW buffers) is there when step 2 is counted."""
    counting = step > 1
    ctx.mesh.ledger.begin_step(step)
    ctx.par.sync.zero_grad()
    tracker.moment = "forward" if counting else None
    with head_moments(ctx, tracker) if counting else contextlib.nullcontext():
        forward_backward(ctx, step)
    if counting:
        tracker.ended("backward")
    tracker.moment = "optimizer" if counting else None
    clipped_norm(ctx.par.pieces, ctx.cfg.train.grad_clip, ctx.par.norm_groups)
    if ctx.par.experts is None:
        optimizer_step(ctx, 1)  # the schedule's first rate: a decayed rate of 0 divides foreach AdamW by 0
    else:  # the balancing reads the loads (metrics, EPLB's moves): values fake tensors have not
        ctx.optimizer.step()
        ctx.par.sync.after_step()
        ctx.par.compute.invalidate()
    tracker.moment = None


@contextlib.contextmanager
def head_moments(ctx: Context, tracker: StepTracker):
    """ "loss" from the head's forward to the gradient of its input, "blocks" after the first."""
    stages = ctx.par.pipeline.stages.values() if ctx.par.pipeline is not None else [ctx.par.module]
    heads = [stage.output for stage in stages if getattr(stage, "output", None) is not None]

    def starts(_module, args) -> None:
        if torch.is_grad_enabled():
            tracker.moment = "loss"
            if args[0].requires_grad:
                args[0].register_hook(ends)

    def ends(_grad) -> None:
        tracker.moment = "blocks"

    hooks = [head.register_forward_pre_hook(starts) for head in heads]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def counted(tracker: StepTracker, start: dict, rank: int, device: str, kernels: str) -> StepMemory:
    result = StepMemory(rank, device, kernels, start=by_kind(start))
    for moment in MOMENTS:
        if moment in tracker.peaks:
            result.moments[moment] = tracker.peaks[moment]
            result.terms[moment] = by_kind(tracker.snaps[moment])
    result.moment = max(result.moments, key=result.moments.get)
    result.peak = result.moments[result.moment]
    return result


def by_kind(snap: dict) -> dict[str, int]:
    """MemTracker's snapshot (reference kind -> bytes) by `KINDS`, the rest as "other"."""
    out = dict.fromkeys((*KINDS.values(), "other"), 0)
    for key, value in snap.items():
        name = getattr(key, "name", str(key))
        if name == "Total" or key == "Total":
            continue
        out[KINDS.get(name, "other")] += value
    return out
