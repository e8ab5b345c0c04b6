#!/usr/bin/env bash
# Two `host serve` replicas of the embedded default behind Debian's nginx, all on loopback:
# sends requests through nginx and checks that both replicas answered some (their /metrics).
# `make replicas`; not part of the tests.
set -euo pipefail
cd "$(dirname "$0")/.."

PORT=${PORT:-8090}
PORT_A=${PORT_A:-8091}
PORT_B=${PORT_B:-8092}
REQUESTS=${REQUESTS:-8}

if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
  echo "installing nginx (Debian)"
  apt-get install -y --no-install-recommends nginx-light >/dev/null 2>&1 || apt-get install -y nginx
fi
NGINX=$(command -v nginx || echo /usr/sbin/nginx)

dir=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT

for port in "$PORT_A" "$PORT_B"; do
  ./target/release/host serve --manifest manifests/default.toml --port "$port" -q >"$dir/replica-$port.log" 2>&1 &
  pids+=($!)
done
sed -e "s|@DIR@|$dir|g" -e "s|@PORT@|$PORT|" -e "s|@PORT_A@|$PORT_A|" -e "s|@PORT_B@|$PORT_B|" \
  scripts/nginx-replicas.conf >"$dir/nginx.conf"
"$NGINX" -c "$dir/nginx.conf" -p "$dir" 2>"$dir/nginx.log" &
pids+=($!)

for port in "$PORT_A" "$PORT_B"; do
  for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    sleep 1
  done
  curl -sf "http://127.0.0.1:$port/health" >/dev/null || { echo "replica on port $port did not start:"; cat "$dir/replica-$port.log"; exit 1; }
done

echo "sending $REQUESTS requests, 4 at a time, through nginx on port $PORT"
seq "$REQUESTS" | xargs -P 4 -I{} curl -sf "http://127.0.0.1:$PORT/v1/completions" \
  -H 'Content-Type: application/json' \
  -d '{"prompt": "And God said", "max_tokens": 24, "temperature": 0}' -o /dev/null

ok=0
for port in "$PORT_A" "$PORT_B"; do
  served=$(curl -sf "http://127.0.0.1:$port/metrics" | awk '/^host_requests_total\{outcome="ok"\}/ {print $2}')
  served=${served:-0}
  echo "replica on port $port served $served requests"
  [ "${served%.*}" -gt 0 ] && ok=$((ok + 1))
done
total=$(( $(wc -l <"$dir/access.log") ))
echo "nginx proxied $total requests"
if [ "$ok" -ne 2 ]; then
  echo "error: a replica got no requests" >&2
  exit 1
fi
echo "ok: both replicas served requests"
