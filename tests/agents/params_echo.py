#!/usr/bin/env python3
# params_echo.py: fails attempt 1; from attempt 2 on writes a small result
# {"attempt": N, "params_sha256": ..., "params_bytes": ...} of the params it
# got. Both attempts write 64 KiB of control characters to stdout and
# stderr (6 bytes each once stored as JSON), so the run record must be
# trimmed to fit the store.
import hashlib
import json
import os
import sys

ctx = json.loads(sys.stdin.read() or "{}")
noise = "\x01" * (64 * 1024)
sys.stdout.write(noise)
sys.stderr.write(noise)
params = ctx.get("params") or {}
canon = json.dumps(params, sort_keys=True, separators=(",", ":")).encode()
if ctx.get("attempt") == 1:
    sys.exit(1)
with open(os.environ["PUNCHCLOCK_RESULT_FILE"], "w", encoding="utf-8") as f:
    json.dump({"attempt": ctx.get("attempt"), "params_sha256": hashlib.sha256(canon).hexdigest(), "params_bytes": len(canon)}, f)
