#!/bin/sh
# hang.sh: starts a background `sleep 3600`, reports "pids <shell pid> <child pid>" as progress, then waits (for timeout/cancel tests).
sleep 3600 &
child=$!
printf '{"message": "pids %s %s"}\n' "$$" "$child" >> "$PUNCHCLOCK_PROGRESS_FILE"
wait
