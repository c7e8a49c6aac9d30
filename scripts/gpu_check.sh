#!/usr/bin/env bash
# One GPU machine, one call of a few minutes: does fivecut run there, is it right, how fast?
#   1. benchmarks/gpu_step.py: dense llama-1b (eager, the full-logits loss, compiled) and the MoE
#      shape of issue 33, each beside Hugging Face transformers at the same settings (tokens/s,
#      MFU of the data-sheet peak, peak allocated GiB), and AdamW fused vs foreach.
#   2. `fivecut verify` of one rank on the GPU (spawn -> NCCL -> CUDA end to end).
#   3. with --calibrate: `fivecut plan calibrate --device cuda` of the GPU (its probes sized for
#      llama-1b at 2048 tokens; under 2 minutes), then benchmarks/plan_gpu.py: the plan with that
#      file, and with the GPU's preset, beside step 1's measured tokens/s (issue 34: within 10%).
# Nothing is installed: the machine's python3 and PyTorch (a bare image with torch, transformers,
# tokenizers, tiktoken and safetensors is enough; gguf is not needed), fivecut from this tree
# (PYTHONPATH), a text corpus generated here, the byte tokenizer. Results go to $OUT if set.
#
#   scripts/gpu_check.sh [--cpu-smoke] [--python PATH] [--cases a,b,...] [--calibrate]
#   --cpu-smoke: every command with the tiny model and a few steps, to check the script on a CPU.
set -euo pipefail
cd "$(dirname "$0")/.."

SMOKE=0
CALIBRATE=0
PY=python3
CASES=fivecut-eager,hf-eager,fivecut-moe,fivecut-full-logits,adamw,hf-moe,fivecut-compiled,hf-compiled
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-smoke) SMOKE=1 ;;
    --python) PY="$2"; shift ;;
    --cases) CASES="$2"; shift ;;
    --calibrate) CALIBRATE=1 ;;
    *) echo "gpu_check: unknown argument $1; use --cpu-smoke, --python PATH, --cases a,b or --calibrate" >&2; exit 2 ;;
  esac
  shift
done

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
WORK=$(mktemp -d -t fivecut-gpu-check-XXXXXX)
RESULTS="${OUT:-$WORK}"
mkdir -p "$RESULTS"
trap 'rm -rf "$WORK/cache"' EXIT

"$PY" -c "import torch; n = torch.cuda.device_count(); print('torch', torch.__version__, \
'|', ', '.join(torch.cuda.get_device_name(i) for i in range(n)) or 'no GPU')"

"$PY" - "$WORK/corpus.txt" <<'EOF'
import random, sys
rng = random.Random(0)
words = "the of and to in is was he for it with as his on be at by had are but from or have an they".split()
lines = (" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))).capitalize() + "." for _ in range(120_000))
open(sys.argv[1], "w").write("\n".join(lines))
EOF
DATA=(--set "data.source=\"$WORK/corpus.txt\"" --set 'data.tokenizer="byte"' --set "data.cache_dir=\"$WORK/cache\"")

STATUS=0
STEP=(--out "$RESULTS" --corpus "$WORK/corpus.txt" --cases "$CASES")
[ "$SMOKE" = 1 ] && STEP+=(--smoke) || STEP+=(--steps 8 --case-timeout 150)
echo "== benchmarks/gpu_step.py ${STEP[*]}"
"$PY" benchmarks/gpu_step.py "${STEP[@]}" | tee "$RESULTS/gpu_step.txt" || STATUS=1

echo "== verify: one rank on the device, fp32, two accumulation steps"
if timeout 120 "$PY" -m fivecut verify --model tiny --layout dp=1 --steps 4 "${DATA[@]}" --set train.accumulate=2 \
  > "$WORK/verify.txt" 2>&1; then
  grep -E '^(verify|PASS|FAIL)' "$WORK/verify.txt" | tee "$RESULTS/verify.txt"
else
  STATUS=1; tail -20 "$WORK/verify.txt" | tee "$RESULTS/verify.txt"
fi
if [ "$CALIBRATE" = 1 ]; then
  echo "== plan calibrate on the device, then the plan beside the measured steps"
  if [ "$SMOKE" = 1 ]; then  # a CPU's probes take no model; the tiny model's steps
    CAL=(--device cpu); VS=(--model tiny --seq 32 --batch 2)
  else
    CAL=(--device cuda --model llama-1b --seq 2048); VS=(--model llama-1b --seq 2048 --batch 8 --preset-too)
  fi
  if timeout 300 "$PY" -m fivecut plan calibrate --ranks 1 "${CAL[@]}" --out "$RESULTS/cluster-gpu.toml" --force \
    > "$RESULTS/calibrate.txt" 2>&1; then
    tail -3 "$RESULTS/calibrate.txt"
    "$PY" benchmarks/plan_gpu.py --steps "$RESULTS/gpu_step.json" --cluster "$RESULTS/cluster-gpu.toml" "${VS[@]}" \
      | tee "$RESULTS/plan_gpu.txt" || STATUS=1
  else
    STATUS=1; tail -20 "$RESULTS/calibrate.txt"
  fi
fi
exit $STATUS
