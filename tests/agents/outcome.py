#!/usr/bin/env python3
# outcome.py: says what the test asks. Writes params.result (any JSON) as its
# result, after params.sleep seconds (default 0), and exits params.exit
# (default 0). The issue-34 tests use it for usage and outcomes.
import json
import os
import sys
import time

raw = sys.stdin.read()
ctx = json.loads(raw) if raw.strip() else {}
params = ctx.get("params") or {}
time.sleep(float(params.get("sleep", 0)))
with open(os.environ["PUNCHCLOCK_RESULT_FILE"], "w", encoding="utf-8") as f:
    json.dump(params.get("result", {"ok": True}), f)
    f.write("\n")
sys.exit(int(params.get("exit", 0)))
