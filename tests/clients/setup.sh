#!/usr/bin/env bash
# Creates tests/clients/.venv with the official `openai` Python package (every package pinned),
# which host/tests/openai_client.rs drives against `host serve`. Idempotent: a stamp holds the
# hash of the requirements and this script.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VENV=$HERE/.venv
STAMP=$VENV/.requirements.sha256
want=$(cat "$HERE/requirements.txt" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
if ! python3 -c 'import ensurepip' 2>/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
  --only-binary=:all: -r "$HERE/requirements.txt"
echo "$want" > "$STAMP"
printf 'client-venv: ready in %s\n' "$VENV" >&2
