#!/usr/bin/env bash
# Points an MLX wheel's bundled reference BLAS/LAPACK at Debian's OpenBLAS (libopenblas0-pthread).
# The wheel's libmlx.so finds them by name through RPATH $ORIGIN/../../<pkg>.libs; those names
# become links, and the originals stay beside them as *.reference so the difference can be
# measured (LD_PRELOAD one of them; `host doctor` reports what is mapped). Idempotent.
#
#   openblas-links.sh DIR...   (each DIR an unpacked wheel's or a venv's site-packages)
set -euo pipefail
OPENBLAS_DIR=/usr/lib/$(uname -m)-linux-gnu/openblas-pthread
[ -e "$OPENBLAS_DIR/libblas.so.3" ] || { echo "openblas-links: OpenBLAS not found in $OPENBLAS_DIR" >&2; exit 1; }
for dir in "$@"; do
  for lib in "$dir"/*.libs/libblas-*.so* "$dir"/*.libs/liblapack-*.so*; do
    case "$lib" in *.reference) continue ;; esac
    [ -L "$lib" ] && continue          # already a link to OpenBLAS
    [ -f "$lib" ] || continue
    mv "$lib" "$lib.reference"
    case "$(basename "$lib")" in
      libblas-*) ln -s "$OPENBLAS_DIR/libblas.so.3" "$lib" ;;
      liblapack-*) ln -s "$OPENBLAS_DIR/liblapack.so.3" "$lib" ;;
    esac
    echo "openblas-links: $(basename "$lib") -> OpenBLAS (original kept as $(basename "$lib").reference)" >&2
  done
done
