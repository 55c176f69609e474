#!/usr/bin/env python3
# traced.py: fails its first attempt; on the next one reports usage in its
# result and sends a span of its own, a child of $TRACEPARENT, as OTLP/HTTP
# JSON to params.otlp_http (the OpenTelemetry environment carrier: the
# runner's invoke_agent span is the parent).
import json
import os
import secrets
import sys
import time
import urllib.request

raw = sys.stdin.read()
ctx = json.loads(raw) if raw.strip() else {}
params = ctx.get("params") or {}
if os.environ.get("PUNCHCLOCK_ATTEMPT") == "1":
    print("first attempt fails", file=sys.stderr)
    sys.exit(1)
start = time.time_ns()
time.sleep(0.05)
tp = os.environ.get("TRACEPARENT", "")
parts = tp.split("-")
if len(parts) == 4 and params.get("otlp_http"):
    span = {
        "traceId": parts[1],
        "spanId": secrets.token_hex(8),
        "parentSpanId": parts[2],
        "name": "agent work",
        "kind": 1,
        "startTimeUnixNano": str(start),
        "endTimeUnixNano": str(time.time_ns()),
    }
    body = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "traced-agent"}}]},
                               "scopeSpans": [{"scope": {"name": "traced.py"}, "spans": [span]}]}]}
    req = urllib.request.Request(params["otlp_http"], data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=5).read()
with open(os.environ["PUNCHCLOCK_RESULT_FILE"], "w", encoding="utf-8") as f:
    json.dump({"ok": True, "traceparent": tp, "usage": {"input_tokens": 100, "output_tokens": 20, "cache_read_input_tokens": 5, "cost": 0.01}}, f)
