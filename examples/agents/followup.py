#!/usr/bin/env python3
"""followup.py: punchclock example agent for runs that events start.

It reads what started its run from the context on stdin and writes a short
summary as its result:
  context.event     a webhook request, a queue message or a published event
                    ({source, name, key, received_at, headers, body, ...})
  context.upstream  the run it follows ({task, run_id, status, result}) for
                    an `after` trigger

A ticket webhook ({"ticket": 42, "text": "disk full on db-2"}) becomes a
triage line; a finished report run becomes a one-line digest of it. Uses
only the Python standard library.
"""

import json
import os
import sys


def main() -> int:
    ctx = json.loads(sys.stdin.read() or "{}")
    event = ctx.get("event")
    upstream = ctx.get("upstream")
    if event:
        body = event.get("body")
        if isinstance(body, dict) and "ticket" in body:
            text = str(body.get("text", ""))
            urgent = any(w in text.lower() for w in ("down", "full", "outage", "error"))
            summary = f"ticket {body['ticket']}: {'urgent' if urgent else 'normal'} - {text[:80]}"
        else:
            summary = f"{event.get('source')} event {event.get('key')} ({event.get('body_bytes', 0)} bytes)"
        result = {"started_by": event.get("source"), "name": event.get("name"), "key": event.get("key"), "summary": summary}
    elif upstream:
        up = upstream.get("result") or {}
        digest = up.get("summary") if isinstance(up, dict) else None
        if not digest and isinstance(up, dict):
            short = [(k, v) for k, v in up.items() if isinstance(v, (int, float)) or (isinstance(v, str) and len(v) <= 40)]
            digest = ", ".join(f"{k}={v}" for k, v in short[:4])
        result = {
            "started_by": "after",
            "upstream": upstream.get("run_id"),
            "upstream_status": upstream.get("status"),
            "summary": f"{upstream.get('task')} {upstream.get('status')}: {digest or 'no result'}",
        }
    else:
        result = {"started_by": ctx.get("trigger"), "summary": "nothing to follow up"}
    with open(os.environ["PUNCHCLOCK_RESULT_FILE"], "w", encoding="utf-8") as f:
        json.dump(result, f)
    print(result["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
