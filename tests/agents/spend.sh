#!/bin/sh
# spend.sh: an agent that reports what it spent (usage in its result file),
# for the budget tests.
sleep "${SLEEP_SECONDS:-0.2}"
printf '{"ok": true, "usage": {"input_tokens": 10, "output_tokens": %s, "cost": 0.01}}\n' "${OUTPUT_TOKENS:-1000}" > "$PUNCHCLOCK_RESULT_FILE"
