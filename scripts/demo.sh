#!/usr/bin/env bash
# The main job: start drafter, verifier and coordinator on loopback with the
# default pair, make one Generate call (streamed, then with stats), stop all.
set -euo pipefail
PORT="${PORT:-50051}"
LOG="$(mktemp)"
specdec up --port "$PORT" "$@" >"$LOG" &
UP=$!
trap 'kill -TERM $UP 2>/dev/null; wait $UP 2>/dev/null || true; rm -f "$LOG"' EXIT
until grep -q "coordinator on" "$LOG"; do
  kill -0 $UP 2>/dev/null || { echo "specdec up failed" >&2; exit 1; }
  sleep 0.5
done
cat "$LOG"
specdec generate --addr "127.0.0.1:$PORT" --messages '[{"role": "user", "content": "Write a Python function that reverses a string."}]' \
  --max-new-tokens 64 --stream
specdec generate --addr "127.0.0.1:$PORT" --prompt "def fibonacci(n):" --max-new-tokens 64 --json
