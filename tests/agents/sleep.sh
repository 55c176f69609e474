#!/bin/sh
# sleep.sh: sleeps $SLEEP_SECONDS seconds (default 2), writes result {"slept": N}, exits 0.
n="${SLEEP_SECONDS:-2}"
sleep "$n"
printf '{"slept": %s}\n' "$n" > "$PUNCHCLOCK_RESULT_FILE"
exit 0
