#!/usr/bin/env bash
# make demo: start `punchclock dev` on a fresh embedded store with the example
# agents, apply the example tasks, and print the runs as they happen.
# Stop with Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/debug/punchclock}
DATA=${PUNCHCLOCK_DEMO_DATA:-.punchclock-demo}
# The API on PUNCHCLOCK_DEMO_PORT (default 7700); when that port is taken
# and no port was asked for, on a free one. The health port is the next one
# (or a free one); `punchclock dev` prints both.
PORT=${PUNCHCLOCK_DEMO_PORT:-7700}

rm -rf "$DATA"
mkdir -p "$DATA"
DATA_ABS=$(cd "$DATA" && pwd)
# The bearer token of the demo's webhook task (examples/tasks/events.yaml).
python3 -c 'import secrets; print(secrets.token_hex(16))' > "$DATA/webhook.token"
DEV=
RECEIVER=
cleanup() {
  [ -n "$DEV" ] && { kill -TERM "$DEV" 2>/dev/null || true; wait "$DEV" 2>/dev/null || true; }
  [ -n "$RECEIVER" ] && { kill -TERM "$RECEIVER" 2>/dev/null || true; wait "$RECEIVER" 2>/dev/null || true; }
  return 0
}
trap cleanup EXIT
trap 'exit 0' INT TERM

# A local webhook receiver for the example tasks' notifications
# (examples/notify_receiver.py), on a free port, and the control plane's
# config file naming it as the sinks report-sink and alert.
export PUNCHCLOCK_NOTIFY_SECRET="demo-secret-$$"
python3 examples/notify_receiver.py 0 "$DATA/receiver.port" > "$DATA/notifications.log" 2>&1 &
RECEIVER=$!
for _ in $(seq 1 50); do [ -s "$DATA/receiver.port" ] && break; sleep 0.1; done
RPORT=$(cat "$DATA/receiver.port")
cat > "$DATA/punchclock.yaml" <<YAML
notifications:
  retry_cap_seconds: 30
sinks:
  report-sink:
    url: http://127.0.0.1:$RPORT/report
    secret: $PUNCHCLOCK_NOTIFY_SECRET
  alert:
    url: http://127.0.0.1:$RPORT/alert
    secret: $PUNCHCLOCK_NOTIFY_SECRET
# One model call at a time, shared by the two brief tasks (examples/tasks/briefs.yaml).
resources:
  llm: {concurrency: 1, requests_per_minute: 30}
# What the briefs may spend a day; at 80% the alert sink hears of it once.
budgets:
  - name: briefs-daily
    scope: {agent: brief_agent}
    window: 1d
    limits: {cost: 0.50, runs: 5000}
    soft_percent: 80
    notify: [webhook://alert]
YAML

# Starts dev on port $1; waits until it prints its addresses (returns 0) or
# exits (returns 1).
start_dev() {
  "$BIN" dev --data-dir "$DATA" --agents examples/agents.yaml --listen "127.0.0.1:$1" --config "$DATA/punchclock.yaml" 2> "$DATA.log" &
  DEV=$!
  for _ in $(seq 1 300); do
    grep -q "API on http://" "$DATA.log" 2>/dev/null && return 0
    kill -0 "$DEV" 2>/dev/null || { wait "$DEV" 2>/dev/null || true; DEV=; return 1; }
    sleep 0.1
  done
  echo "punchclock dev did not start in 30 s; log:"; cat "$DATA.log"; exit 1
}
if ! start_dev "$PORT"; then
  if [ -z "${PUNCHCLOCK_DEMO_PORT:-}" ] && grep -q "cannot listen on" "$DATA.log"; then
    echo "== port $PORT is taken; using a free one"
    start_dev 0 || { echo "punchclock dev exited; log:"; cat "$DATA.log"; exit 1; }
  elif grep -q "cannot listen on" "$DATA.log"; then
    echo "port $PORT (PUNCHCLOCK_DEMO_PORT) is taken: choose another, or unset PUNCHCLOCK_DEMO_PORT to take a free one"; exit 1
  else
    echo "punchclock dev exited; log:"; cat "$DATA.log"; exit 1
  fi
fi
API=$(grep -o 'API on http://[0-9.:]*' "$DATA.log" | head -1 | cut -d' ' -f3)
HEALTH=$(grep -o 'health on http://[0-9.:]*/healthz' "$DATA.log" | head -1 | cut -d' ' -f3)
export PUNCHCLOCK_ENDPOINT=$API
for _ in $(seq 1 100); do
  "$BIN" task list >/dev/null 2>&1 && break
  sleep 0.1
done
echo "== punchclock dev is up (API $API, health $HEALTH, log in $DATA.log)"
echo "   notifications go to a local receiver (examples/notify_receiver.py, port $RPORT, log in $DATA/notifications.log)"
echo "   other shells: export PUNCHCLOCK_ENDPOINT=$API"
echo "   dashboard: ${HEALTH%/healthz}/ui/ (every task's last slots, live; open it in a browser)"
# The example tasks check the local health endpoint at its default address;
# they get the one this dev listens on.
for f in examples/tasks/*.json examples/tasks/*.yaml; do
  sed -e "s#http://127.0.0.1:7701/healthz#$HEALTH#g" -e "s#__DEMO_DATA__#$DATA_ABS#g" "$f" > "$DATA/$(basename "$f")"
  "$BIN" task apply -f "$DATA/$(basename "$f")"
done
echo
"$BIN" task list
echo
# The webhook task: one ticket now (and the same again, deduplicated), and
# the line to post more.
HOOK="${HEALTH%/healthz}/hooks/demo-tickets"
post_ticket() {
  python3 - "$HOOK" "$DATA/webhook.token" "$1" "$2" <<'PY'
import json, sys, urllib.request
url, token_file, key, body = sys.argv[1:]
token = open(token_file).read().strip()
req = urllib.request.Request(url, data=body.encode(), method="POST",
                             headers={"Authorization": "Bearer " + token, "Idempotency-Key": key, "Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=10) as r:
    print(f"   POST {url} (Idempotency-Key: {key}) -> {r.status} {r.read().decode()}")
PY
}
echo "== a webhook task (demo_tickets) and a chain (demo_report_digest follows each demo_report that succeeds)"
post_ticket ticket-1 '{"ticket": 1, "text": "disk full on db-2"}' || true
post_ticket ticket-1 '{"ticket": 1, "text": "disk full on db-2"}' || true
echo "   post your own (then: punchclock runs list --task demo_tickets):"
echo "   curl -H \"Authorization: Bearer \$(cat $DATA_ABS/webhook.token)\" -H 'Idempotency-Key: ticket-2' -d '{\"ticket\": 2, \"text\": \"checkout is down\"}' $HOOK"
echo
echo "== runs (refreshing every 10 s; Ctrl-C to stop)"
# Ctrl-C reaches `punchclock dev` too: once it is gone, stop quietly.
while kill -0 "$DEV" 2>/dev/null; do
  sleep 10 & wait $! || true   # `wait` lets the INT trap run at once
  kill -0 "$DEV" 2>/dev/null || break
  echo "--- $(date -u +%FT%TZ)"
  "$BIN" runs list --limit 14 || kill -0 "$DEV" 2>/dev/null || break
  echo "--- shared resources"
  "$BIN" resources list || true
  echo "--- budgets"
  "$BIN" budgets list || true
  echo "--- notifications received (last 3 of $(wc -l < "$DATA/notifications.log"))"
  tail -n 3 "$DATA/notifications.log"
done
echo "== punchclock dev stopped (log in $DATA.log)"
