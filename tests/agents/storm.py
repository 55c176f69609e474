#!/usr/bin/env python3
# storm.py: a provider's 429 storm as the outcome contract says it. While the
# file named by params.storm_file (from the stdin context) exists, answers
# rate_limited with retry_after_seconds (params.retry_after, default 2) on
# resource params.resource (default llm) and exits 1; then succeeds.
import json
import os
import sys

raw = sys.stdin.read()
ctx = json.loads(raw) if raw.strip() else {}
params = ctx.get("params") or {}
path = params.get("storm_file", "")
with open(os.environ["PUNCHCLOCK_RESULT_FILE"], "w", encoding="utf-8") as f:
    if path and os.path.exists(path):
        json.dump({"outcome": "rate_limited", "retry_after_seconds": params.get("retry_after", 2),
                   "resource": params.get("resource", "llm"), "class": "http_429"}, f)
        f.write("\n")
        f.flush()
        print("429 Too Many Requests", file=sys.stderr)
        sys.exit(1)
    json.dump({"ok": True, "usage": {"input_tokens": 100, "output_tokens": 20}}, f)
    f.write("\n")
