#!/usr/bin/env bash
# Prepares the native side of MLX so that mlx-rs builds and runs against one shared libmlx, the
# one a Python wheel of MLX ships: host and plugins must share it (the plugin contract's
# ownership rules), while mlx-sys's own build script would link a static MLX into each of them
# (and, off macOS, cannot build at all).
#
# What it does, and why:
#   1. system packages for the native build (Debian: cmake, g++, libclang for bindgen, OpenBLAS
#      and a font; macOS: checks for Xcode's command line tools and cmake, installs nothing);
#   2. bindgen-cli 0.72.1, the version mlx-sys 0.7.0 generates its bindings with;
#   3. the MLX wheel from PyPI (Linux: mlx-cpu by default, MLX_WHEEL selects another, e.g. a
#      CUDA one, its bundled reference BLAS/LAPACK pointed at OpenBLAS; macOS: mlx-metal, whose
#      libmlx.dylib runs on Metal), unpacked into .native/;
#   4. mlx-c from the mlx-sys registry sources, built static against the wheel, with our shims;
#   5. bindings.rs, and cargo settings that override mlx-sys's build script (`links = "mlx"`)
#      and give every binary, test and doctest an rpath to the wheel's libmlx: written to
#      .native/cargo-config.toml and copied to the checkout's .cargo/config.toml.
# It is idempotent: when nothing changed a re-run only checks and touches no file.
#
#   setup.sh                       prepares this checkout
#   setup.sh --drafter-crate DIR   also writes the same settings to DIR/.cargo/config.toml, so
#                                  that a drafter crate outside this checkout (depending on
#                                  plugin-api by path or git) builds with `cargo build` alone
#
# The Linux x86_64 path is what CI runs. The macOS (Apple silicon) branch is written against
# the mlx-metal wheel's layout (mlx/lib/libmlx.dylib beside mlx.metallib, mlx/include,
# mlx/share/cmake/MLX) but has not been run on a Mac.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MLX_VERSION=0.32.2          # the MLX that mlx-c inside mlx-sys 0.7.0 pins
BINDGEN_VERSION=0.72.1
NATIVE=$ROOT/.native
SHIMS=$ROOT/scripts/native
CONFIG_MARK="# Written by scripts/setup.sh"

say() { printf 'setup: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

DRAFTER_CRATE=
while [ $# -gt 0 ]; do
  case "$1" in
    --drafter-crate)
      [ $# -ge 2 ] || die "--drafter-crate needs the crate's directory"
      DRAFTER_CRATE=$2; shift 2 ;;
    *) die "unknown argument '$1' (setup.sh [--drafter-crate DIR])" ;;
  esac
done
if [ -n "$DRAFTER_CRATE" ]; then
  [ -f "$DRAFTER_CRATE/Cargo.toml" ] || die "$DRAFTER_CRATE/Cargo.toml not found: --drafter-crate takes a crate's directory"
  existing=$DRAFTER_CRATE/.cargo/config.toml
  if [ -e "$existing" ] && ! head -n1 "$existing" | grep -qF "$CONFIG_MARK"; then
    die "$existing exists and was not written by this script; move it aside or merge $NATIVE/cargo-config.toml into it"
  fi
fi

case "$(uname -s)-$(uname -m)" in
  Linux-x86_64 | Linux-aarch64)
    PLATFORM=linux
    TRIPLE=$(uname -m)-unknown-linux-gnu
    MLX_WHEEL=${MLX_WHEEL:-mlx-cpu}
    LIBMLX=libmlx.so
    SHIM_LIB=mlxrs_linux_shim
    CXX_RUNTIME=stdc++
    sha256() { sha256sum | cut -d' ' -f1; }
    ;;
  Darwin-arm64)
    PLATFORM=macos
    TRIPLE=aarch64-apple-darwin
    MLX_WHEEL=${MLX_WHEEL:-mlx-metal}
    LIBMLX=libmlx.dylib
    SHIM_LIB=mlxrs_shim
    CXX_RUNTIME=c++
    sha256() { shasum -a 256 | cut -d' ' -f1; }
    ;;
  *) die "no MLX wheel for $(uname -s) $(uname -m): this script prepares Linux (x86_64, aarch64) and macOS on Apple silicon" ;;
esac
command -v cargo >/dev/null || die "cargo not found: install a Rust toolchain (rustup) first"
[ -z "${RUSTFLAGS:-}" ] ||
  say "warning: RUSTFLAGS is set and replaces the rpath in .cargo/config.toml; binaries may not find libmlx.so"

# --- 1. system packages -----------------------------------------------------------------------
if [ $PLATFORM = macos ]; then
  xcode-select -p >/dev/null 2>&1 || die "Xcode's command line tools are missing: run 'xcode-select --install'"
  command -v cmake >/dev/null || die "cmake not found: 'brew install cmake' (or 'python3 -m pip install cmake')"
  python3 -m pip --version >/dev/null 2>&1 || die "python3 with pip is needed to download the MLX wheel"
  # bindgen loads libclang; Xcode's command line tools ship one.
  export LIBCLANG_PATH=${LIBCLANG_PATH:-$(xcode-select -p)/usr/lib}
fi
# fonts-dejavu-core: the font `host bench --plot` draws its text with.
APT_PACKAGES=(cmake g++ libclang-dev libopenblas0-pthread fonts-dejavu-core)
# A Python that already has pip (e.g. pyenv's) is enough to download the wheel.
python3 -m pip --version >/dev/null 2>&1 || APT_PACKAGES+=(python3 python3-pip)
missing=()
if [ $PLATFORM = linux ]; then
  command -v dpkg-query >/dev/null ||
    die "this script installs Debian's packages (${APT_PACKAGES[*]}); install their equivalents, then rerun"
  for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
  done
fi
if [ ${#missing[@]} -gt 0 ]; then
  say "installing apt packages: ${missing[*]}"
  [ "$(id -u)" = 0 ] || die "apt packages missing (${missing[*]}); run as root or install them"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if [ $PLATFORM = linux ]; then
  OPENBLAS_DIR=/usr/lib/$(uname -m)-linux-gnu/openblas-pthread
  [ -e "$OPENBLAS_DIR/libblas.so.3" ] || die "OpenBLAS not found in $OPENBLAS_DIR"
fi

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
inputs=$( { cat "${BASH_SOURCE[0]}" "$SHIMS"/*; echo "$MLX_WHEEL $MLX_VERSION $MLXC_SRC $ROOT"; } | sha256)
outputs=("$WHEEL_DIR/mlx/lib/$LIBMLX" "$NATIVE/lib/libmlxc.a" "$NATIVE/lib/lib$SHIM_LIB.a"
  "$NATIVE/bindings/bindings.rs" "$NATIVE/cargo-config.toml" "$ROOT/.cargo/config.toml")
up_to_date=1
[ "$(cat "$STAMP" 2>/dev/null)" = "$inputs" ] || up_to_date=0
for f in "${outputs[@]}"; do [ -e "$f" ] || up_to_date=0; done
# The settings a crate needs to build against the native build, in DIR/.cargo/config.toml.
write_cargo_config() {
  mkdir -p "$1/.cargo"
  cp "$NATIVE/cargo-config.toml" "$1/.cargo/config.toml"
}
drafter_crate_config() {
  [ -n "$DRAFTER_CRATE" ] || return 0
  write_cargo_config "$DRAFTER_CRATE"
  say "wrote $DRAFTER_CRATE/.cargo/config.toml: 'cargo build' there links against $NATIVE"
}
if [ $up_to_date = 1 ]; then
  say "native MLX ($MLX_WHEEL $MLX_VERSION) up to date in $NATIVE"
  drafter_crate_config
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
if [ $PLATFORM = linux ]; then bash "$ROOT/scripts/openblas-links.sh" "$WHEEL_DIR"; fi

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

shim_objects=("$NATIVE/build/donation_shim.o")
c++ -O2 -fPIC -std=c++20 $cxx_flags -c "$SHIMS/donation_shim.cpp" -o "$NATIVE/build/donation_shim.o" \
  2>"$NATIVE/build/donation_shim.log" || die "compiling the donation shim failed; see $NATIVE/build/donation_shim.log"
if [ $PLATFORM = linux ]; then
  # macOS has mach_approximate_time itself.
  cc -O2 -fPIC -c "$SHIMS/mach_time_shim.c" -o "$NATIVE/build/mach_time_shim.o"
  shim_objects+=("$NATIVE/build/mach_time_shim.o")
fi
rm -f "$NATIVE/lib/lib$SHIM_LIB.a"
ar rcs "$NATIVE/lib/lib$SHIM_LIB.a" "${shim_objects[@]}"

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
cat >"$NATIVE/cargo-config.toml" <<EOF
$CONFIG_MARK for the checkout at $ROOT; re-run it instead of editing.
# Replaces mlx-sys's build script with the native build in $NATIVE and gives every binary,
# test and doctest an rpath to the wheel's $LIBMLX.
[target.$TRIPLE]
rustflags = ["-C", "$rpath"]
rustdocflags = ["-C", "$rpath"]

[target.$TRIPLE.mlx]
rustc-link-search = ["native=$NATIVE/lib", "native=$WHEEL_DIR/mlx/lib"]
rustc-link-lib = ["static=mlxc", "static=$SHIM_LIB", "dylib=mlx", "dylib=$CXX_RUNTIME"]
rustc-env = { OUT_DIR = "$NATIVE/bindings" }
EOF
write_cargo_config "$ROOT"

# What was installed, for checks that must hold whichever wheel was chosen (host/tests/doctor.rs).
blas=reference
for lib in "$WHEEL_DIR"/*.libs/libblas-*.so*; do [ -L "$lib" ] && blas=OpenBLAS; done
if [ $PLATFORM = macos ]; then blas=Accelerate; fi
device=cpu; [ "$MLX_WHEEL" = mlx-cpu ] || device=gpu
printf '{"mlx_wheel": "%s", "mlx_version": "%s", "blas": "%s", "device": "%s"}\n' \
  "$MLX_WHEEL" "$MLX_VERSION" "$blas" "$device" >"$NATIVE/installed.json"

echo "$inputs" >"$STAMP"
say "native MLX ready: $MLX_WHEEL $MLX_VERSION ($blas), in $NATIVE"
drafter_crate_config
