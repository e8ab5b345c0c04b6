#!/usr/bin/env bash
# The GPU check (`make gpu-check`): the route CUDA takes, measured on an NVIDIA GPU. It writes
# one JSON ($OUT/gpu-check.json) and a short table ($OUT/gpu-check.md) with:
#   - plain decoding against mlx-lm 0.32.2 (both on the GPU) on the demo target and on the
#     262,144-token bench model;
#   - every demo drafter's speed-up over plain decoding on the demo target, greedy and sampled
#     (temperature 0.7, top-p 0.95; `match`, and `rejection` where the drafter gives its
#     probabilities), with how many prompts gave exactly plain decoding's output.
#
# How it gets there:
#   1. a Python whose MLX runs on CUDA, with mlx-lm: $GPU_PYTHON if set, else a venv under $OUT
#      with mlx[$CUDA_EXTRA]==0.32.2 and mlx-lm==0.32.2 from PyPI (or, offline, from the wheels
#      in $GPU_WHEELS);
#   2. the host and its plugins: target/release as built, else `make build` with
#      MLX_WHEEL=mlx-cuda-13 or -12 (scripts/setup.sh fetches the CUDA wheel and builds against it);
#   3. that Python's libmlx.so and the CUDA libraries beside it first on LD_LIBRARY_PATH, so
#      that binaries built against mlx-cpu run on the GPU (docs/gpu.md, "Running on CUDA").
#
# Sized to finish in about 8 minutes on a fresh machine with the binaries built (GPU_CHECK_PAIRS,
# GPU_CHECK_PROMPTS and GPU_CHECK_TOKENS trade time for confidence).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${GPU_CHECK_OUT:-$ROOT/target/gpu-check}
CUDA_EXTRA=${CUDA_EXTRA:-cuda13}          # cuda12 for a driver older than CUDA 13's
PAIRS=${GPU_CHECK_PAIRS:-3}
PROMPTS=${GPU_CHECK_PROMPTS:-6}
TOKENS=${GPU_CHECK_TOKENS:-128}
DRAFT_TOKENS=${GPU_CHECK_DRAFT_TOKENS:-4}
MLX_VERSION=0.32.2

say() { printf 'gpu-check: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

command -v nvidia-smi >/dev/null || die "nvidia-smi not found: this check runs on a machine with an NVIDIA GPU"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1)
[ -n "$card" ] || die "nvidia-smi lists no GPU"
mkdir -p "$OUT"
started=$(date +%s)

# --- 1. a Python with MLX on CUDA and mlx-lm --------------------------------------------------
if [ -n "${GPU_PYTHON:-}" ]; then
  py=$GPU_PYTHON
else
  venv=$OUT/venv
  if [ ! -x "$venv/bin/python" ]; then
    say "making $venv (mlx[$CUDA_EXTRA]==$MLX_VERSION, mlx-lm==$MLX_VERSION)"
    python3 -m venv "$venv" || die "python3 -m venv failed (Debian: apt-get install python3-venv)"
  fi
  source=()
  [ -z "${GPU_WHEELS:-}" ] || source=(--no-index --find-links "$GPU_WHEELS")
  "$venv/bin/python" -m pip install --quiet "${source[@]}" "mlx[$CUDA_EXTRA]==$MLX_VERSION" "mlx-lm==$MLX_VERSION" ||
    die "installing MLX for CUDA failed (offline? put the wheels in a directory and set GPU_WHEELS)"
  py=$venv/bin/python
fi
"$py" -c 'import mlx.core as mx, mlx_lm; assert mx.default_device() == mx.gpu, mx.default_device()' ||
  die "$py: MLX does not run on the GPU there, or mlx-lm is missing"

# The wheel's libmlx.so, and every CUDA library directory of the `nvidia` packages beside it.
libs=$("$py" - <<'EOF'
import glob, os, sys
import mlx.core
dirs = [os.path.join(os.path.dirname(mlx.core.__file__), "lib")]
for site in sys.path:
    dirs += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib")))
print(":".join(d for d in dict.fromkeys(dirs) if os.path.isdir(d)))
EOF
)
export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

# --- 2. the binaries --------------------------------------------------------------------------
host=$ROOT/target/release/host
if [ ! -x "$host" ]; then
  say "building the host (MLX_WHEEL=mlx-cuda-${CUDA_EXTRA#cuda})"
  make -C "$ROOT" build MLX_WHEEL="mlx-cuda-${CUDA_EXTRA#cuda}"
fi
"$host" doctor --json >"$OUT/doctor.json" || die "host doctor failed with the CUDA libmlx (see above)"
grep -q '"device": *"Device(gpu' "$OUT/doctor.json" || die "the host's MLX does not compute on the GPU: $(cat "$OUT/doctor.json")"

# --- 3. the measurements ----------------------------------------------------------------------
cd "$ROOT"
if [ ! -f target/bench-model-262k/config.json ]; then
  say "writing the 262,144-token bench model"
  "$py" tests/oracle/gemma4_oracle.py --bench target/bench-model-262k --bench-vocab 262144
fi
head -n "$PROMPTS" models/kjv-gemma4/bench-prompts.jsonl >"$OUT/prompts.jsonl"
drafters=$(ls manifests/demo-*.toml | grep -v demo-plain | paste -sd, -)

for target in demo-plain bench-262k; do
  say "plain decoding against mlx-lm: $target"
  "$host" bench --manifest "manifests/$target.toml" --mlx-lm-python "$py" --pairs "$PAIRS" \
    --max-tokens "$TOKENS" --json >"$OUT/plain-$target.json"
done
say "the demo drafters against plain decoding, greedy and sampled"
"$host" bench --sweep "$drafters" --prompts-file "$OUT/prompts.jsonl" --draft-tokens "$DRAFT_TOKENS" \
  --max-tokens "$TOKENS" --temperature 0.7 --json >"$OUT/drafters.json"

python3 "$ROOT/scripts/gpu_check_report.py" --out "$OUT" --card "$card" --seconds $(($(date +%s) - started))
cat "$OUT/gpu-check.md"
