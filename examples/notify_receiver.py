#!/usr/bin/env python3
"""A minimal punchclock notification receiver (used by `make demo`).

Listens on 127.0.0.1 (port from argv[1], 0 = a free one, written to
argv[2]), verifies each request's Punchclock-Signature with the secret in
the PUNCHCLOCK_NOTIFY_SECRET environment variable, and prints one line per
notification. Deduplicate by Punchclock-Notification-Id in a real receiver:
a notification is sent again only when the answer to it was lost.
"""
import hashlib
import hmac
import http.server
import json
import os
import sys
import time

SECRET = os.environ.get("PUNCHCLOCK_NOTIFY_SECRET", "").encode()
MAX_AGE_SECONDS = 300


def verify(header, body):
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    t, v1 = parts.get("t", ""), parts.get("v1", "")
    if not t.isdigit() or abs(time.time() - int(t)) > MAX_AGE_SECONDS:
        return False
    want = hmac.new(SECRET, t.encode() + b"." + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(want, v1)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        ok = verify(self.headers.get("Punchclock-Signature", ""), body)
        self.send_response(200 if ok else 401)
        self.send_header("Content-Length", "0")
        self.end_headers()
        try:
            doc = json.loads(body)
        except ValueError:
            doc = {}
        run = doc.get("run") or {}
        print(
            "%s notification %s %s: run %s %s (signature %s)"
            % (
                time.strftime("%H:%M:%S"),
                self.headers.get("Punchclock-Event", "?"),
                self.headers.get("Punchclock-Notification-Id", "?"),
                run.get("run_id", "?"),
                run.get("status", "?"),
                "ok" if ok else "BAD",
            ),
            flush=True,
        )

    def log_message(self, *args):
        pass


def main():
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w", encoding="utf-8") as f:
            f.write(str(server.server_address[1]))
    server.serve_forever()


if __name__ == "__main__":
    main()
