#!/usr/bin/env bash
# Creates tests/oracle/.venv with the pinned mlx / mlx-lm used by the Gemma 4 oracle, and points
# the wheel's bundled reference BLAS/LAPACK at Debian's OpenBLAS exactly as scripts/setup.sh does
# for the Rust side (so both sides run the same matmul code).
#
# Idempotent: when the stamp matches (requirements + this script) and the links are in place,
# it only checks and exits. Network: PyPI and Debian's archive only.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VENV=$HERE/.venv
REQS=$HERE/requirements.txt
REQS_DFLASH=$HERE/requirements-dflash.txt   # dflash 0.1.0, --no-deps (see the file)
REQS_DSPARK=$HERE/requirements-dspark.txt   # dspark-mlx 0.1.0, --no-deps (see the file)
STAMP=$VENV/.requirements.sha256
OPENBLAS_DIR=/usr/lib/x86_64-linux-gnu/openblas-pthread

say() { printf 'oracle-venv: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

[ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] || die "this script prepares Linux x86_64"

# --- OpenBLAS (libopenblas0-pthread) -----------------------------------------------------------
if [ ! -e "$OPENBLAS_DIR/libblas.so.3" ] || [ ! -e "$OPENBLAS_DIR/liblapack.so.3" ]; then
  [ "$(id -u)" = 0 ] || die "libopenblas0-pthread missing; run as root or install it"
  say "installing libopenblas0-pthread"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    libopenblas0-pthread >/dev/null
fi
[ -e "$OPENBLAS_DIR/libblas.so.3" ] || die "OpenBLAS not found in $OPENBLAS_DIR"

# --- the virtual environment -------------------------------------------------------------------
want=$(cat "$REQS" "$REQS_DFLASH" "$REQS_DSPARK" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
  fresh=0
else
  fresh=1
  command -v python3 >/dev/null || die "python3 not found"
  if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c 'import ensurepip' 2>/dev/null; then
    [ "$(id -u)" = 0 ] || die "python3-venv missing; run as root or install it"
    say "installing python3-venv"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      python3-venv >/dev/null
  fi
  rm -f "$STAMP"
  [ -x "$VENV/bin/python" ] || { say "creating $VENV"; python3 -m venv "$VENV"; }
  say "installing $(grep -cv '^\s*\(#\|$\)' "$REQS") pinned packages"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
    --only-binary=:all: -r "$REQS"
  say "installing $(grep -cv '^\s*\(#\|$\)' "$REQS_DFLASH") pinned package(s) without dependencies"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
    --only-binary=:all: --no-deps --require-hashes -r "$REQS_DFLASH"
  say "installing $(grep -cv '^\s*\(#\|$\)' "$REQS_DSPARK") pinned package(s) without dependencies"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
    --only-binary=:all: --no-deps --require-hashes -r "$REQS_DSPARK"
fi

# --- reference BLAS/LAPACK -> OpenBLAS (as scripts/setup.sh) -----------------------------------
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
[ -d "$site/mlx_cpu.libs" ] || die "$site/mlx_cpu.libs not found (is mlx-cpu installed?)"
bash "$HERE/../../scripts/openblas-links.sh" "$site"

# --- check -------------------------------------------------------------------------------------
"$VENV/bin/python" - <<'EOF' || die "the venv does not import mlx / mlx_lm / dflash.model_mlx / dspark_mlx"
import mlx.core as mx, mlx_lm
import dflash.model_mlx
import dspark_mlx.arch.gemma4
a = mx.ones((64, 64))
mx.eval(a @ a)
EOF
if [ $fresh = 1 ]; then
  echo "$want" >"$STAMP"
  say "ready: $("$VENV/bin/python" -c 'import mlx.core as mx, mlx_lm, importlib.metadata as m; d = m.version("dflash"); s = m.version("dspark-mlx"); print(f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}, dflash {d}, dspark-mlx {s}")') with OpenBLAS in $VENV"
else
  say "up to date in $VENV"
fi
