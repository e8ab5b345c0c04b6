#!/usr/bin/env bash
# Creates tests/oracle/.venv-hf with the pinned transformers 5.23.0 + CPU-run torch used by
# tests/oracle/assistant_oracle.py (the Gemma 4 "-assistant" drafter oracle).
#
# Idempotent: when the stamp matches (requirements + this script) it only checks and exits.
# Network: PyPI only. About 3 GB downloaded (torch's CUDA runtime wheels, needed to import
# torch at all), 5.6 GB installed; nothing else of the project depends on it.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VENV=$HERE/.venv-hf
REQS=$HERE/requirements-hf.txt
STAMP=$VENV/.requirements.sha256

say() { printf 'oracle-venv-hf: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

[ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] || die "this script prepares Linux x86_64"

want=$(cat "$REQS" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)
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
  say "installing $(grep -cv '^\s*\(#\|$\)' "$REQS") pinned packages (~3 GB download)"
  # --no-deps: the file is the complete, pinned closure.
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
    --only-binary=:all: --no-deps -r "$REQS"
fi

"$VENV/bin/python" - <<'PY' || die "the venv does not import torch / transformers"
import torch, transformers
from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM  # noqa: F401
assert transformers.__version__ == "5.23.0", transformers.__version__
a = torch.ones(64, 64)
assert float((a @ a).sum()) == 64.0 ** 3
PY
if [ $fresh = 1 ]; then
  echo "$want" >"$STAMP"
  say "ready: $("$VENV/bin/python" -c 'import torch, transformers; print(f"transformers {transformers.__version__}, torch {torch.__version__} (CPU)")') in $VENV"
else
  say "up to date in $VENV"
fi
