#!/usr/bin/env bash
# Interop check: js-libp2p 2.x dials an echo-rl node on 127.0.0.1, runs identify and ping.
# Needs node >= 20 and npm; installs the js packages of package.json here on first use.
set -euo pipefail
cd "$(dirname "$0")"
[ -d node_modules ] || npm install --no-audit --no-fund --silent
out=$(mktemp)
../../.venv/bin/python serve_node.py 30 > "$out" &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -f "$out"' EXIT
for _ in $(seq 50); do [ -s "$out" ] && break; sleep 0.2; done
addr=$(head -1 "$out")
echo "echo-rl node: $addr"
node dial.mjs "$addr"
