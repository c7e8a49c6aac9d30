"""Document masks (data.document_mask) on the CPU: which masked attention is fastest.

    python benchmarks/document_mask.py [--batch 4] [--seq 1024] [--heads 8] [--head-dim 64]
                                       [--doc 128] [--steps 3] [--repeats 3] [--warmup 1] [--flex-compiled]

Attention over [b, H, s, hd] (fp32, one thread) whose windows hold documents of about `doc`
tokens (the lengths drawn from a seed), forward + backward (training) for each candidate, and
forward only as well (FlexAttention has no backward on the CPU: torch 2.13 raises
NotImplementedError, so on the CPU it can serve inference only):

    causal        SDPA, is_causal (no documents: the floor a mask can reach)
    sdpa-bool     SDPA with the boolean [b, 1, s, s] mask (causal within each document): fivecut's
                  core on one device, under TP/SP/PP and inside Ulysses (`CausalSDPA`)
    sdpa-float    SDPA with the same mask as an additive 0 / -inf float (what the ring's pairs pass
                  to the CPU flash kernel)
    flex          FlexAttention with a block mask from the document ids, eager
    flex-compiled the same under torch.compile (--flex-compiled: Inductor's CPU template;
                  its compile time is not counted)

Each candidate's output (and, where it has a backward, q, k, v gradients) is checked against
sdpa-bool first (rtol 1e-4). Timing is interleaved (benchmarks/common.py); the median step of
each is reported, and the last line is `fastest=<name>` among the masked candidates that train.
On CUDA the choice would be FlexAttention's block masks (compiled to a Triton kernel that
skips the blocks outside every document), since the flash kernel takes no mask and SDPA with a
mask falls back to the memory-efficient kernel over every block.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import add_common_arguments, interleave, markdown_table, median, parse_options, run
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from fivecut.model.documents import Documents

DOC = """Document masks on the CPU: SDPA with a boolean or float mask against FlexAttention."""


def document_tokens(batch: int, seq: int, doc: int) -> torch.Tensor:
    """Token ids [b, s] with an end-of-text id (0) closing documents of 1 to 2*doc - 1 tokens."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.ones(batch, seq, dtype=torch.long)
    for row in range(batch):
        at = 0
        while True:
            at += int(torch.randint(1, 2 * doc, (1,), generator=g))
            if at >= seq:
                break
            tokens[row, at] = 0
    return tokens


def candidates(opts: dict):
    b, s, h, d = opts["batch"], opts["seq"], opts["heads"], opts["head_dim"]
    g = torch.Generator().manual_seed(1)
    q, k, v, grad = (torch.randn(b, h, s, d, generator=g) for _ in range(4))
    docs = Documents.of(document_tokens(b, s, opts["doc"]), 0)
    at = torch.arange(s)
    mask = docs.visible(at, at)  # [b, 1, s, s]
    bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    ids = docs.ids

    def keep(bi, hi, qi, ki):
        return (ids[bi, qi] == ids[bi, ki]) & (qi >= ki)

    block = create_block_mask(keep, b, None, s, s, device="cpu")
    compiled = torch.compile(flex_attention, dynamic=False) if opts["flex_compiled"] else None
    kernels = {
        "causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "sdpa-bool": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        "sdpa-float": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
        "flex": lambda q, k, v: flex_attention(q, k, v, block_mask=block),
    }
    if compiled is not None:
        kernels["flex-compiled"] = lambda q, k, v: compiled(q, k, v, block_mask=block)

    def step(kernel):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = kernel(*leaves)
        out.backward(grad)
        return out.detach(), *(t.grad for t in leaves)

    @torch.no_grad()
    def forward(kernel):
        return (kernel(q, k, v),)

    return kernels, step, forward


TRAINS = ("causal", "sdpa-bool", "sdpa-float")  # the candidates with a CPU backward


def rank_main(opts: dict) -> dict:
    torch.set_num_threads(1)
    kernels, step, forward = candidates(opts)
    reference = step(kernels["sdpa-bool"])
    for name, kernel in kernels.items():
        got = step(kernel) if name in TRAINS else forward(kernel)
        if name != "causal":
            for a, want in zip(got, reference):
                torch.testing.assert_close(a, want, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    timed = {}
    for label, run_one, names in (("train", step, TRAINS), ("forward", forward, list(kernels))):
        runs = interleave(
            {name: (lambda kernel=kernels[name], run_one=run_one: run_one(kernel)) for name in names},
            opts["steps"],
            opts["repeats"],
            opts["warmup"],
        )
        timed[label] = {name: median([median(r) for r in per]) for name, per in runs.items()}
    return timed


def report(opts: dict, results: list[dict], elapsed: float, before: str) -> str:
    train, fwd = results[0]["train"], results[0]["forward"]
    rows = [
        [name, f"{train[name] * 1e3:.1f} ms" if name in train else "no CPU backward", f"{t * 1e3:.1f} ms"]
        for name, t in fwd.items()
    ]
    shape = f"b={opts['batch']}, H={opts['heads']}, s={opts['seq']}, hd={opts['head_dim']}, documents ~{opts['doc']}"
    masked = {name: t for name, t in train.items() if name != "causal"}
    return "\n".join(
        [
            f"attention, fp32, 1 thread, {shape} ({elapsed:.0f} s; {before})",
            markdown_table(["candidate", "forward + backward", "forward"], rows),
            f"fastest={min(masked, key=masked.get)}",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=DOC)
    add_common_arguments(parser, steps=3, repeats=3)
    parser.set_defaults(batch=4, seq=1024, warmup=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--doc", type=int, default=128, help="mean document length in tokens")
    parser.add_argument("--flex-compiled", action="store_true", help="also time FlexAttention under torch.compile")
    opts = parse_options(parser)
    run("document_mask", rank_main, report, opts, 1)


if __name__ == "__main__":
    main()
