#!/usr/bin/env bash
# Type-checks the whole workspace for the platforms CI cannot run: macOS on Apple silicon and
# Windows. Every platform path (kernels/) must compile there; nothing is linked or run. MLX's
# link settings are stubbed for the check (bindings from this checkout's setup, no libraries).
#
#   check-platforms.sh [TARGET...]   (default: aarch64-apple-darwin x86_64-pc-windows-gnu)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BINDINGS=$ROOT/.native/bindings
[ -f "$BINDINGS/bindings.rs" ] || { echo "check-platforms: run scripts/setup.sh first" >&2; exit 1; }
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(aarch64-apple-darwin x86_64-pc-windows-gnu)
for target in "${targets[@]}"; do
  if ! rustup target list --installed | grep -qx "$target" && ! rustup target add "$target" >/dev/null 2>&1; then
    echo "check-platforms: could not install the standard library for $target (offline?); $target NOT checked" >&2
    continue
  fi
  echo "check-platforms: $target" >&2
  cargo check --manifest-path "$ROOT/Cargo.toml" --workspace --all-targets --quiet --target "$target" \
    --target-dir "$ROOT/target/platforms" \
    --config "target.$target.mlx.rustc-env.OUT_DIR='$BINDINGS'" --config "target.$target.mlx.rustc-link-lib=[]"
done
