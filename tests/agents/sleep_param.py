#!/usr/bin/env python3
# sleep_param.py: sleeps params.sleep_seconds (default 2) from the stdin context, writes result {"slept": N, "run_id": ...}, exits 0.
import json
import os
import sys
import time

raw = sys.stdin.read()
ctx = json.loads(raw) if raw.strip() else {}
n = (ctx.get("params") or {}).get("sleep_seconds", 2)
time.sleep(n)
doc = {"slept": n, "run_id": ctx.get("run_id") or os.environ.get("PUNCHCLOCK_RUN_ID")}
with open(os.environ["PUNCHCLOCK_RESULT_FILE"], "w", encoding="utf-8") as f:
    json.dump(doc, f)
    f.write("\n")
sys.exit(0)
