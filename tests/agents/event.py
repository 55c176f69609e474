#!/usr/bin/env python3
# event.py: writes what started it (context.event, context.upstream) as its
# result; sleeps EVENT_AGENT_SLEEP seconds first when set in params.sleep.
import json
import os
import sys
import time

ctx = json.loads(sys.stdin.read() or "{}")
sleep = (ctx.get("params") or {}).get("sleep")
if sleep:
    time.sleep(float(sleep))
with open(os.environ["PUNCHCLOCK_RESULT_FILE"], "w", encoding="utf-8") as f:
    json.dump({"event": ctx.get("event"), "upstream": ctx.get("upstream"), "trigger": ctx.get("trigger")}, f)
