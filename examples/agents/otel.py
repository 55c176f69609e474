"""otel.py: the smallest OpenTelemetry span exporter an example agent needs.

Standard library only. It joins the run's trace through the OpenTelemetry
environment carrier: the runner gives the agent `TRACEPARENT` (and
`TRACESTATE` when the run has one) naming its `invoke_agent` span, and every
span opened here is a child of it (or of the enclosing span). Spans are
sent as OTLP/HTTP JSON (https://opentelemetry.io/docs/specs/otlp/#otlphttp)
when the agent ends, to

  OTEL_EXPORTER_OTLP_TRACES_ENDPOINT   the full URL (e.g. http://collector:4318/v1/traces), else
  OTEL_EXPORTER_OTLP_ENDPOINT          + "/v1/traces" (e.g. http://collector:4318)

and only when the protocol (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else
OTEL_EXPORTER_OTLP_PROTOCOL) is "http/json": the runner's own exporter is
OTLP/gRPC, and an agent inheriting the runner's environment must not post
JSON to a gRPC port. Set them in the agent's `env` in agents.yaml. The
service name is OTEL_SERVICE_NAME, else the default given to Tracer.

Export never fails the agent: an error is one line on stderr.
"""

import json
import os
import secrets
import sys
import time
import urllib.request
from contextlib import contextmanager


def _parse_traceparent(value):
    """(trace_id, span_id) hex from a W3C traceparent, or None."""
    parts = (value or "").strip().split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        int(parts[1], 16), int(parts[2], 16)
    except ValueError:
        return None
    if parts[1] == "0" * 32 or parts[2] == "0" * 16:
        return None
    return parts[1], parts[2]


def _endpoint():
    proto = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "")
    if proto != "http/json":
        return None
    url = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if url:
        return url
    base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if base:
        return base.rstrip("/") + "/v1/traces"
    return None


def _value(v):
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    return {"stringValue": str(v)}


def _attributes(attrs):
    return [{"key": k, "value": _value(v)} for k, v in attrs.items() if v is not None]


class Span:
    """One span: set attributes with `set`, mark it failed with `error`."""

    def __init__(self, trace_id, parent_id, name, attrs):
        self.trace_id = trace_id
        self.span_id = secrets.token_hex(8)
        self.parent_id = parent_id
        self.name = name
        self.attrs = dict(attrs)
        self.start = time.time_ns()
        self.end = None
        self.status = None

    def set(self, key, value):
        self.attrs[key] = value

    def error(self, message):
        self.status = {"code": 2, "message": message}

    def otlp(self):
        span = {
            "traceId": self.trace_id,
            "spanId": self.span_id,
            "parentSpanId": self.parent_id,
            "name": self.name,
            "kind": 1,
            "startTimeUnixNano": str(self.start),
            "endTimeUnixNano": str(self.end or time.time_ns()),
            "attributes": _attributes(self.attrs),
        }
        if self.status:
            span["status"] = self.status
        return span


class Tracer:
    """Spans under $TRACEPARENT; a no-op when there is no trace or endpoint."""

    def __init__(self, default_service):
        self.service = os.environ.get("OTEL_SERVICE_NAME") or default_service
        self.parent = _parse_traceparent(os.environ.get("TRACEPARENT"))
        self.url = _endpoint()
        self.finished = []
        self.stack = []

    @property
    def enabled(self):
        return self.parent is not None and self.url is not None

    @contextmanager
    def span(self, name, **attrs):
        """A child of the enclosing span (or of the runner's invoke_agent span)."""
        if self.parent is None:
            yield Span("0" * 32, "0" * 16, name, attrs)
            return
        parent_id = self.stack[-1].span_id if self.stack else self.parent[1]
        s = Span(self.parent[0], parent_id, name, attrs)
        self.stack.append(s)
        try:
            yield s
        except BaseException as e:
            s.error(f"{type(e).__name__}: {e}")
            raise
        finally:
            s.end = time.time_ns()
            self.stack.pop()
            self.finished.append(s)

    def flush(self, timeout=5):
        """Send the finished spans (one request); errors go to stderr."""
        if not self.enabled or not self.finished:
            return
        body = {"resourceSpans": [{
            "resource": {"attributes": _attributes({"service.name": self.service})},
            "scopeSpans": [{"scope": {"name": "punchclock-example-agent"}, "spans": [s.otlp() for s in self.finished]}],
        }]}
        req = urllib.request.Request(self.url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            urllib.request.urlopen(req, timeout=timeout).read()
            self.finished = []
        except Exception as e:  # noqa: BLE001 - export must never fail the agent
            print(f"otel: span export to {self.url} failed: {e}", file=sys.stderr)
