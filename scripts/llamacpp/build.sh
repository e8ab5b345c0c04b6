#!/usr/bin/env bash
# Builds llama.cpp for `make bench-llamacpp`, once, into target/llamacpp: the llama.cpp that
# the llama-cpp-python 0.3.36 sdist on PyPI vendors (commit 0c1e570), checked by its sha256,
# built with cmake (Release, GGML_NATIVE: for this CPU), and llama.cpp's own converter in a
# pinned environment (requirements-convert.txt). Prints nothing but progress; idempotent.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$ROOT/scripts/llamacpp
OUT=$ROOT/target/llamacpp
SDIST=llama_cpp_python-0.3.36.tar.gz
URL=https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/$SDIST
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
SRC=$OUT/llama_cpp_python-0.3.36/vendor/llama.cpp

say() { printf 'llama.cpp: %s\n' "$*" >&2; }
mkdir -p "$OUT"

if [ ! -f "$SRC/CMakeLists.txt" ]; then
  command -v cmake >/dev/null && command -v g++ >/dev/null || {
    say "installing cmake and g++"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends cmake g++ >/dev/null
  }
  say "downloading $SDIST"
  curl -sSfLo "$OUT/$SDIST" "$URL"
  echo "$SHA256  $OUT/$SDIST" | sha256sum -c --quiet
  tar -xzf "$OUT/$SDIST" -C "$OUT"
fi

if [ ! -x "$OUT/build/bin/llama-bench" ] || [ ! -x "$OUT/build/bin/llama-quantize" ]; then
  say "building llama-bench and llama-quantize (several minutes)"
  cmake -S "$SRC" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null
  cmake --build "$OUT/build" --target llama-bench llama-quantize -j "$(nproc)" >/dev/null
fi

# `build.sh noamx`: a second llama-bench without AMX (its AVX-512 kernels, repacking on), for
# machines where llama.cpp's AMX code crashes (docs/performance.md); bench.py --llama-bench
# target/llamacpp/build-noamx/bin/llama-bench runs it.
if [ "${1:-}" = noamx ] && [ ! -x "$OUT/build-noamx/bin/llama-bench" ]; then
  say "building llama-bench without AMX (several minutes)"
  cmake -S "$SRC" -B "$OUT/build-noamx" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
    -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON \
    -DGGML_AVX512_BF16=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF >/dev/null
  cmake --build "$OUT/build-noamx" --target llama-bench -j "$(nproc)" >/dev/null
fi

# `build.sh avx2`: a llama-bench with AVX2, FMA and F16C only, to time the host's AVX2 loops
# (`HOST_SIMD=avx2`) against llama.cpp's on the same machine: bench.py --llama-bench
# target/llamacpp/build-avx2/bin/llama-bench.
if [ "${1:-}" = avx2 ] && [ ! -x "$OUT/build-avx2/bin/llama-bench" ]; then
  say "building llama-bench for AVX2 (several minutes)"
  cmake -S "$SRC" -B "$OUT/build-avx2" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
    -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null
  cmake --build "$OUT/build-avx2" --target llama-bench -j "$(nproc)" >/dev/null
fi

want=$(sha256sum "$HERE/requirements-convert.txt" | cut -d' ' -f1)
if [ "$(cat "$OUT/convert-venv/.requirements.sha256" 2>/dev/null)" != "$want" ]; then
  say "installing the converter's environment (torch, transformers)"
  rm -rf "$OUT/convert-venv"
  python3 -m venv "$OUT/convert-venv"
  "$OUT/convert-venv/bin/pip" install -q -r "$HERE/requirements-convert.txt"
  echo "$want" > "$OUT/convert-venv/.requirements.sha256"
fi
