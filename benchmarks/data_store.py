"""The token store (issue 36): its build rate, its size on disk, the loader's time per step, and the
memory a build holds.

    .venv/bin/python benchmarks/data_store.py --tokens 50000000 --memory-cap-mb 128

1. A corpus of about `--tokens` GPT-2 tokens of generated English-like text (Zipf-distributed
   pseudo-words, documents of 100-3000 words) is written as 8 JSONL shards.
2. Build rate: the store built from those files with 1 and with 2 worker processes, against
   `datasets.load_dataset("json")` then `.map(batched=True, num_proc=2)` calling the same tokenizer's
   batch encoding (timed alone, and with the load); the 2-worker build and the map alternate
   `--repeats` times and the best of each counts. Tokens/s over the documents' own tokens.
3. Size on disk: every file of the store's folder against the ids' own bytes (n_tokens x 2).
4. Loader: `BatchSampler.local_batches` over that store at `small`'s shape (8 x 128, and 8 x 512),
   in both orders, against a training step of `small` (forward, backward, AdamW) on this machine.
5. Memory: a corpus of 4 x `--memory-cap-mb` bytes (byte tokenizer: one id per byte) built by one
   process in a child, whose peak resident memory (VmHWM) is reported against the cap.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fivecut.data.store import BuildOptions, open_store  # noqa: E402
from fivecut.train.tokenizer import get_tokenizer  # noqa: E402

SHARDS = 8


def pseudo_words(rng: np.random.Generator, n: int) -> np.ndarray:
    syllables = np.array(["ka", "lo", "mi", "ter", "an", "the", "ro", "us", "ing", "el", "on", "st", "pa", "re", "do"])
    lengths = rng.integers(1, 4, n)
    return np.array(["".join(rng.choice(syllables, k)) for k in lengths])


def write_corpus(folder: Path, tokens: int, seed: int = 0) -> list[Path]:
    """About `tokens` GPT-2 tokens of text in SHARDS JSONL files (measured on a sample, then scaled)."""
    rng = np.random.default_rng(seed)
    words = pseudo_words(rng, 4000)
    p = 1.0 / np.arange(1, len(words) + 1)
    p /= p.sum()
    sample = " ".join(rng.choice(words, 20000, p=p))
    per_word = len(get_tokenizer("gpt2").encode(sample)) / 20000
    n_words = int(tokens / per_word)
    folder.mkdir(parents=True, exist_ok=True)
    files = [folder / f"part-{i:02d}.jsonl" for i in range(SHARDS)]
    handles = [f.open("w") for f in files]
    written, doc = 0, 0
    longest = max(10, min(3000, n_words // (4 * SHARDS)))  # a small corpus still fills every shard
    while written < n_words:
        length = int(min(rng.integers(longest // 30 + 1, longest), n_words - written))
        text = " ".join(rng.choice(words, length, p=p)) + "."
        handles[doc % SHARDS].write(json.dumps({"text": text}) + "\n")
        written, doc = written + length, doc + 1
    for h in handles:
        h.close()
    return files


def build_rate(corpus: Path, cache: Path, workers: int) -> tuple[float, object]:
    shutil.rmtree(cache, ignore_errors=True)
    began = time.perf_counter()
    store = open_store(str(corpus / "*.jsonl"), "gpt2", cache, BuildOptions(workers=workers, progress=False))
    return time.perf_counter() - began, store


def gpt2_batch(batch: dict) -> dict:
    return {"ids": get_tokenizer("gpt2").encode_batch(batch["text"])}


def datasets_rate(files: list[Path], cache: Path) -> tuple[float, float, int]:
    """(seconds of load + map, seconds of map alone, tokens) with datasets."""
    import datasets

    shutil.rmtree(cache, ignore_errors=True)
    datasets.disable_progress_bars()
    began = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=[str(f) for f in files], split="train", cache_dir=str(cache))
    loaded = time.perf_counter()
    mapped = ds.map(gpt2_batch, batched=True, num_proc=2, remove_columns=["text"], load_from_cache_file=False)
    done = time.perf_counter()
    tokens = sum(len(ids) for ids in mapped.data.column("ids").to_pylist()) if len(mapped) < 50_000 else None
    if tokens is None:  # a big corpus: count without Python lists
        import pyarrow.compute as pc

        tokens = int(pc.sum(pc.list_value_length(mapped.data.column("ids"))).as_py())
    return done - began, done - loaded, tokens


def step_seconds(preset: str, batch: int, seq: int, steps: int = 2) -> float:
    """A forward, backward and AdamW step of `preset` on this machine's CPU (after one warm-up)."""
    import torch
    import torch.nn.functional as F

    from fivecut.model.presets import PRESETS
    from fivecut.model.transformer import build_model

    model = build_model(PRESETS[preset])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, PRESETS[preset].vocab_size, (batch, seq + 1))
    times = []
    for i in range(steps + 1):
        began = time.perf_counter()
        logits = model(x[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        if i:
            times.append(time.perf_counter() - began)
    return float(np.median(times))


def loader_seconds(tokens, batch: int, seq: int, order: str, steps: int) -> float:
    from fivecut.train.data import BatchSampler

    sampler = BatchSampler(tokens, seq, batch, 0, order=order)
    sampler.local_batches(1, 0, 1, 1)  # each shard hashed on first touch: once per run, not per step
    began = time.perf_counter()
    for step in range(2, steps + 2):
        sampler.local_batches(step, 0, 1, 1)
    return (time.perf_counter() - began) / steps


# VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so it would report this parent's peak
MEMORY_CHILD = """
import re, sys, time
sys.path.insert(0, {root!r})
from fivecut.data.store import BuildOptions, open_store
began = time.perf_counter()
store = open_store({source!r}, "byte", {cache!r}, BuildOptions(workers=1, progress=False))
peak = re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)
print(store.n_tokens, peak, time.perf_counter() - began)
"""


def memory_check(folder: Path, cap_mb: float) -> dict:
    """Build a store from a corpus of 4 x cap bytes in a child process; its peak resident memory."""
    rng = np.random.default_rng(1)
    words = pseudo_words(rng, 2000)
    chunk = "".join(json.dumps({"text": " ".join(rng.choice(words, 400))}) + "\n" for _ in range(200))
    target = int(4 * cap_mb * 2**20)
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "big.jsonl"
    with source.open("w") as f:
        written = 0
        while written < target:
            f.write(chunk)
            written += len(chunk)
    child = MEMORY_CHILD.format(root=str(ROOT), source=str(source), cache=str(folder / "cache"))
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True)
    out = run.stdout.splitlines()[-1].split()  # after the store's own line
    n_tokens, peak_kb, seconds = int(out[0]), int(out[1]), float(out[2])
    return {"corpus_mb": source.stat().st_size / 2**20, "tokens": n_tokens, "peak_mb": peak_kb / 1024, "s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=50_000_000, help="GPT-2 tokens in the generated corpus")
    parser.add_argument("--memory-cap-mb", type=float, default=128.0, help="the cap; the corpus is 4x as big")
    parser.add_argument("--loader-steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2, help="builds with 2 workers and datasets maps, alternated")
    parser.add_argument("--step-preset", default="small")
    parser.add_argument("--shapes", default="8x128,8x512", help="global batch x seq_len of the loader and the step")
    parser.add_argument("--dir", help="working folder (default: a temporary one, removed)")
    ns = parser.parse_args()
    work = Path(ns.dir) if ns.dir else Path(tempfile.mkdtemp(prefix="fivecut-data-bench-"))
    try:
        report(ns, work)
    finally:
        if not ns.dir:
            shutil.rmtree(work, ignore_errors=True)


def report(ns, work: Path) -> None:
    corpus = work / "corpus"
    began = time.perf_counter()
    files = write_corpus(corpus, ns.tokens)
    text_mb = sum(f.stat().st_size for f in files) / 2**20
    print(f"corpus: {len(files)} JSONL files, {text_mb:.1f} MiB, written in {time.perf_counter() - began:.1f} s")
    one_s, store = build_rate(corpus, work / "store1", 1)
    two, hf = [], []
    for _ in range(ns.repeats):  # alternated, the best of each: a busy machine slows either side in turn
        two.append(build_rate(corpus, work / "store2", 2)[0])
        hf.append(datasets_rate(files, work / "hf"))
    two_s = min(two)
    both_s, map_s, hf_tokens = min(h[0] for h in hf), min(h[1] for h in hf), hf[0][2]
    n = store.n_tokens - (store.n_docs - 1)  # the documents' own tokens, as datasets counts them (no separators)
    print(f"2 workers: {', '.join(f'{t:.1f}' for t in two)} s; datasets map: {', '.join(f'{h[1]:.1f}' for h in hf)} s")
    print("\n| build | seconds | tokens/s |")
    print("|---|---|---|")
    print(f"| fivecut store, 1 worker | {one_s:.1f} | {n / one_s:,.0f} |")
    print(f"| fivecut store, 2 workers | {two_s:.1f} | {n / two_s:,.0f} |")
    print(f"| datasets load_dataset + map(num_proc=2) | {both_s:.1f} | {hf_tokens / both_s:,.0f} |")
    print(f"| datasets map(num_proc=2) alone | {map_s:.1f} | {hf_tokens / map_s:,.0f} |")
    print(f"\ntokens: store {store.n_tokens:,} ({store.n_docs - 1:,} of them separators), datasets {hf_tokens:,}")
    disk, ids = sum(p.stat().st_size for p in store.folder.iterdir()), store.n_tokens * 2
    print(f"size on disk: {disk:,} bytes for {ids:,} bytes of ids: {disk / ids:.4f}x")
    tokens = store.tokens()
    rows = []
    for batch, seq in (tuple(int(v) for v in shape.split("x")) for shape in ns.shapes.split(",")):
        step = step_seconds(ns.step_preset, batch, seq)
        for order in ("epoch", "random"):
            load = loader_seconds(tokens, batch, seq, order, ns.loader_steps)
            rows.append((batch, seq, order, load, step))
    print(f"\n| shape | order | loader ms/step | {ns.step_preset} step ms (CPU) | loader share |")
    print("|---|---|---|---|---|")
    for batch, seq, order, load, step in rows:
        print(f"| {batch}x{seq} | {order} | {load * 1e3:.3f} | {step * 1e3:.0f} | {load / step:.4%} |")
    memory = memory_check(work / "memory", ns.memory_cap_mb)
    under = memory["peak_mb"] < ns.memory_cap_mb
    print(
        f"\nmemory: a {memory['corpus_mb']:.1f} MiB corpus ({memory['tokens']:,} byte tokens) built in "
        f"{memory['s']:.1f} s with a peak resident memory of {memory['peak_mb']:.1f} MiB against a cap of "
        f"{ns.memory_cap_mb:.0f} MiB: {'under' if under else 'OVER'} the cap"
    )
    print(f"ratio_two_workers_vs_datasets_map={(n / two_s) / (hf_tokens / map_s):.3f}")


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    main()
