#!/usr/bin/env bash
# Creates training/.venv from training/requirements.txt (every package pinned) and points the
# MLX wheel's reference BLAS at OpenBLAS, as the host and the oracle venv do: the reference
# BLAS is unoptimized code, far too slow for training's matmuls on the CPU. Idempotent: a stamp
# holds the hash of the requirements and this script.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VENV=$HERE/.venv
STAMP=$VENV/.requirements.sha256
say() { printf 'training-venv: %s\n' "$*" >&2; }

if [ ! -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 ]; then
  say "installing libopenblas0-pthread"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libopenblas0-pthread >/dev/null
fi
# dflash 0.1.0 and dspark-mlx 0.1.0 (the DFlash and DeepSpec DSpark model classes the drafter
# trainers train) install without their dependencies, as in the oracle venv: see
# tests/oracle/requirements-dflash.txt and requirements-dspark.txt.
REQS_DRAFTERS=("$HERE/../tests/oracle/requirements-dflash.txt" "$HERE/../tests/oracle/requirements-dspark.txt")
want=$(cat "$HERE/requirements.txt" "$HERE/../tests/oracle/requirements.txt" "${REQS_DRAFTERS[@]}" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
if ! python3 -c 'import ensurepip' 2>/dev/null; then
  say "installing python3-venv"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
say "installing pinned packages into $VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
  --only-binary=:all: -r "$HERE/requirements.txt"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
  --only-binary=:all: --no-deps --require-hashes -r "${REQS_DRAFTERS[0]}" -r "${REQS_DRAFTERS[1]}"
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
bash "$HERE/../scripts/openblas-links.sh" "$site"
"$VENV/bin/python" -c 'import mlx.core as mx, mlx_lm, tokenizers, matplotlib, dflash.model_mlx, dspark_mlx.arch.gemma4; mx.eval(mx.ones((8, 8)) @ mx.ones((8, 8)))'
echo "$want" >"$STAMP"
say "ready in $VENV"
