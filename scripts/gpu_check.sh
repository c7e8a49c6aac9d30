#!/usr/bin/env bash
# One GPU machine, a few minutes: does fivecut run there, and how fast?
#   1. `fivecut verify` of dp, tp, pp, cp and ep layouts. A layout of one rank runs on the GPU
#      (NCCL); a layout of more ranks than GPUs runs on the machine's CPUs with gloo (NCCL needs a
#      GPU per rank; see fivecut/launch.py choose_backend), which the summary says.
#   2. bf16 training of `small` and `llama-1b`: tokens/s and MFU against the data-sheet peak.
# Nothing is installed: the machine's python3 and PyTorch, fivecut from this tree (PYTHONPATH),
# a text corpus generated here, the byte tokenizer. Figures and the summary go to $OUT if set.
#
#   scripts/gpu_check.sh [--cpu-smoke] [--python PATH]
#   --cpu-smoke: every command with a tiny model and a few steps, to check the commands on a CPU.
set -euo pipefail
cd "$(dirname "$0")/.."

SMOKE=0
PY=python3
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-smoke) SMOKE=1 ;;
    --python) PY="$2"; shift ;;
    *) echo "unknown argument $1; use --cpu-smoke or --python PATH" >&2; exit 2 ;;
  esac
  shift
done

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
WORK=$(mktemp -d -t fivecut-gpu-check-XXXXXX)
RESULTS="${OUT:-$WORK}"
mkdir -p "$RESULTS"
SUMMARY="$WORK/summary.tsv"
: > "$SUMMARY"
trap 'rm -rf "$WORK/cache"' EXIT

# the corpus: ~4 MB of pseudo-English from a fixed seed (the byte tokenizer needs no files)
CORPUS="$WORK/corpus.txt"
"$PY" - "$CORPUS" <<'EOF'
import random, sys
rng = random.Random(0)
words = "the of and to in is was he for it with as his on be at by had are but from or have an they".split()
words += "which one you were her all she there would their we him been has when who will more no if out".split()
lines = (" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))).capitalize() + "." for _ in range(120_000))
open(sys.argv[1], "w").write("\n".join(lines))
EOF
DATA=(--set "data.source=\"$CORPUS\"" --set 'data.tokenizer="byte"' --set "data.cache_dir=\"$WORK/cache\"")

if [ "$SMOKE" = 1 ]; then
  VERIFY_STEPS=2; MODELS=(tiny tiny); NAMES=(smoke-small smoke-1b); TRAIN_STEPS=3; SEQ=(32 32); BATCH=(4 4)
else
  VERIFY_STEPS=6; MODELS=(small llama-1b); NAMES=(small llama-1b); TRAIN_STEPS=30; SEQ=(512 1024); BATCH=(32 8)
fi

"$PY" -c "import torch; n = torch.cuda.device_count(); print('torch', torch.__version__, \
'|', ', '.join(torch.cuda.get_device_name(i) for i in range(n)) or 'no GPU')"

# 1. verify: name, model, layout, extra settings
verify() {
  local name=$1 model=$2 layout=$3; shift 3
  local log="$WORK/verify-$name.txt"
  echo "== verify $name: --model $model --layout $layout $*"
  if timeout 90 "$PY" -m fivecut verify --model "$model" --layout "$layout" --steps "$VERIFY_STEPS" \
    "${DATA[@]}" "$@" > "$log" 2>&1; then :; fi
  local device line
  device=$(sed -n 's/.* on \([a-z]*\) (\([a-z]*\)).*/\1\/\2/p' "$log" | head -1)
  line=$(grep -E '^(PASS|FAIL)' "$log" | tail -1 || true)
  [ -n "$line" ] || { line="ERROR (see below)"; tail -20 "$log"; }
  echo "$line"
  printf 'verify\t%s\t%s\t%s\t-\t-\n' "$name" "${device:-?}" "$line" >> "$SUMMARY"
}
# one rank, the same run twice: on a GPU machine this is spawn -> NCCL -> CUDA end to end (and repeatable);
# with one GPU the layouts below get more ranks than GPUs, so they run on the CPUs
verify one-rank tiny dp=1 --set train.accumulate=2
verify dp tiny dp=2
verify tp tiny tp=2,sp=true
verify pp tiny pp=2,microbatches=4
verify cp tiny cp=2,cp_mode=ulysses
verify ep tiny-moe dp=2,ep=2

# 2. bf16 training throughput: name, preset, seq_len, global batch
throughput() {
  local name=$1 model=$2 seq=$3 batch=$4
  local out="$WORK/train-$name"
  echo "== train $name: $model, bf16, ${batch}x$seq tokens per step, $TRAIN_STEPS steps"
  if ! timeout 180 "$PY" -m fivecut train --set "model.preset=\"$model\"" --set 'train.dtype="bf16"' \
    --set "train.steps=$TRAIN_STEPS" --set "train.seq_len=$seq" --set "train.global_batch=$batch" \
    --set train.warmup=5 --set train.eval_every=0 --set log.progress=false --set log.log_every=10 \
    --set "log.out_dir=\"$out\"" "${DATA[@]}" > "$out.txt" 2>&1; then
    tail -20 "$out.txt"
    printf 'train\t%s\t-\tERROR\t-\t-\n' "$name" >> "$SUMMARY"
    return
  fi
  grep -E '^(fivecut:|step )' "$out.txt" | tail -4 || true
  if [ -f "$out/loss.png" ]; then cp "$out/loss.png" "$RESULTS/loss-$name.png"; fi
  "$PY" - "$out/metrics.jsonl" "$name" "$SUMMARY" <<'EOF'
import json, statistics, sys
records = [json.loads(line) for line in open(sys.argv[1])]
steady = records[len(records) // 3 :] or records  # skip the first steps (allocation, autotuning)
tok = statistics.median(r["tokens_per_s"] for r in steady)
mfu = statistics.median(r["mfu"] for r in steady)
line = f"loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}"
open(sys.argv[3], "a").write(f"train\t{sys.argv[2]}\tbf16\t{line}\t{tok:,.0f}\t{100 * mfu:.1f}%\n")
EOF
}
for i in 0 1; do
  throughput "${NAMES[$i]}" "${MODELS[$i]}" "${SEQ[$i]}" "${BATCH[$i]}"
done

# the table, and a figure of throughput and MFU
"$PY" - "$SUMMARY" "$RESULTS" <<'EOF'
import sys
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1])]
widths = [max(len(r[i]) for r in rows + [["check", "name", "device", "result", "tokens/s", "MFU"]]) for i in range(6)]
for r in [["check", "name", "device", "result", "tokens/s", "MFU"]] + rows:
    print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)))
open(f"{sys.argv[2]}/summary.txt", "w").write("\n".join("\t".join(r) for r in rows) + "\n")
train = [r for r in rows if r[0] == "train" and r[4] != "-"]
if train:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3))
    names = [r[1] for r in train]
    a.bar(names, [float(r[4].replace(",", "")) for r in train]); a.set_title("tokens/s (bf16)")
    b.bar(names, [float(r[5].rstrip("%")) for r in train]); b.set_title("MFU % of data-sheet peak")
    fig.tight_layout(); fig.savefig(f"{sys.argv[2]}/throughput.png", dpi=120)
EOF
echo "results in $RESULTS"
! grep -qE $'\t(FAIL|ERROR)' "$SUMMARY"
