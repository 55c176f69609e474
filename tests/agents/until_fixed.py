#!/usr/bin/env python3
# until_fixed.py: exits 1 ("downstream is down") until the file named by
# params.fixed_file (from the stdin context) exists, then writes a result and exits 0.
import json
import os
import sys

raw = sys.stdin.read()
ctx = json.loads(raw) if raw.strip() else {}
path = (ctx.get("params") or {}).get("fixed_file", "")
if not path or not os.path.exists(path):
    print("downstream unavailable", file=sys.stderr)
    sys.exit(1)
with open(os.environ["PUNCHCLOCK_RESULT_FILE"], "w", encoding="utf-8") as f:
    json.dump({"fixed": True}, f)
    f.write("\n")
