#!/bin/sh
# slow.sh: reports "pids <shell pid> <child pid>" as progress, sleeps $SLEEP_SECONDS (default 4) in a child, writes {"slept": N}.
n="${SLEEP_SECONDS:-4}"
sleep "$n" &
child=$!
printf '{"message": "pids %s %s"}\n' "$$" "$child" >> "$PUNCHCLOCK_PROGRESS_FILE"
wait "$child"
printf '{"slept": %s}\n' "$n" > "$PUNCHCLOCK_RESULT_FILE"
