#!/usr/bin/env bash
# make demo: start `punchclock dev` on a fresh embedded store with the example
# agents, apply the example tasks, and print the runs as they happen.
# Stop with Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/debug/punchclock}
DATA=${PUNCHCLOCK_DEMO_DATA:-.punchclock-demo}
export PUNCHCLOCK_ENDPOINT=${PUNCHCLOCK_ENDPOINT:-http://127.0.0.1:7700}

rm -rf "$DATA"
"$BIN" dev --data-dir "$DATA" --agents examples/agents.yaml 2> "$DATA.log" &
DEV=$!
cleanup() { kill -TERM "$DEV" 2>/dev/null || true; wait "$DEV" 2>/dev/null || true; }
trap cleanup EXIT
trap 'exit 0' INT TERM

for _ in $(seq 1 100); do
  "$BIN" task list >/dev/null 2>&1 && break
  kill -0 "$DEV" 2>/dev/null || { echo "punchclock dev exited; log:"; cat "$DATA.log"; exit 1; }
  sleep 0.1
done
echo "== punchclock dev is up (API $PUNCHCLOCK_ENDPOINT, log in $DATA.log)"
for f in examples/tasks/*.json examples/tasks/*.yaml; do
  "$BIN" task apply -f "$f"
done
echo
"$BIN" task list
echo
echo "== runs (refreshing every 10 s; Ctrl-C to stop)"
# Ctrl-C reaches `punchclock dev` too: once it is gone, stop quietly.
while kill -0 "$DEV" 2>/dev/null; do
  sleep 10 & wait $! || true   # `wait` lets the INT trap run at once
  kill -0 "$DEV" 2>/dev/null || break
  echo "--- $(date -u +%FT%TZ)"
  "$BIN" runs list --limit 12 || kill -0 "$DEV" 2>/dev/null || break
done
echo "== punchclock dev stopped (log in $DATA.log)"
