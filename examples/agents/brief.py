#!/usr/bin/env python3
"""brief.py: punchclock example of an LLM agent that writes a short industry brief.

It shows the three things an LLM agent reports back (see README.md, "Writing
an agent" and "Traces"):
  - its token usage, in the result: {"usage": {"input_tokens", "output_tokens",
    "cache_read_input_tokens", "cost"}}; punchclock puts it on the run's trace
    as gen_ai.usage.* and sums it over the run;
  - its own spans, children of the runner's invoke_agent span, from
    $TRACEPARENT (otel.py; sent when OTEL_EXPORTER_OTLP_TRACES_ENDPOINT and
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/json are set in its env);
  - failure by exit code, so retries, timeouts and the circuit breaker apply,
    and why, with the outcome contract (README "Writing an agent"): a 429
    answers {"outcome": "rate_limited", "retry_after_seconds": <Retry-After>,
    "resource": $LLM_RESOURCE (default "llm"), "class": "http_429"} (an
    OpenAI "insufficient_quota" 429: "quota_exhausted"), another 4xx
    "non_retryable", so a rate limit spends no retries and holds the shared
    resource back for every task until the provider's Retry-After.

Model: an OpenAI-compatible chat completions API when LLM_BASE_URL is set
(e.g. https://api.openai.com/v1), with LLM_API_KEY (give it through the
agent's env_from_file in agents.yaml, so the key stays on the runner host)
and LLM_MODEL (default gpt-4o-mini). Without LLM_BASE_URL it works offline:
the brief comes from a template and the usage is an estimate (4 characters
per token), marked "usage_estimated": true. The usage's cost is the tokens at
LLM_PRICE_INPUT / LLM_PRICE_OUTPUT per million (default 0.15 and 0.60,
gpt-4o-mini's list prices), also offline, so budgets have something to count.

Params (the task's context.params):
  topic           what the brief is about (default "AI agents")
  fail_attempts   attempts 1..N fail with exit 75, as if the model API were
                  down: a way to see retries and the circuit breaker (default 0)
  rate_limit_attempts  attempts 1..N answer rate_limited (retry after
                  params.retry_after_seconds, default 5), as if the provider
                  answered 429: a way to see shared back-pressure (default 0)

Exits 2 on bad params, 75 on a (real or simulated) model API failure.
Uses only the Python standard library.
"""

import json
import os
import sys
import urllib.error
import urllib.request
from datetime import datetime, timezone

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from otel import Tracer  # noqa: E402

EX_TEMPFAIL = 75


class AgentError(Exception):
    def __init__(self, message, code=2, outcome=None):
        super().__init__(message)
        self.code = code
        # The outcome contract's fields for the result file, if any.
        self.outcome = outcome or {}


def resource_name():
    return os.environ.get("LLM_RESOURCE", "llm")


def retry_after_seconds(value, default=5.0):
    """A Retry-After header (RFC 9110 section 10.2.3): seconds or an HTTP date."""
    if not value:
        return default
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        from email.utils import parsedate_to_datetime
        return max(0.0, (parsedate_to_datetime(value) - datetime.now(timezone.utc)).total_seconds())
    except (TypeError, ValueError):
        return default


def priced(usage):
    """usage with its cost: tokens at the per-million prices of the env."""
    pin = float(os.environ.get("LLM_PRICE_INPUT", "0.15"))
    pout = float(os.environ.get("LLM_PRICE_OUTPUT", "0.60"))
    usage["cost"] = round((usage["input_tokens"] * pin + usage["output_tokens"] * pout) / 1e6, 8)
    return usage


def read_context():
    if sys.stdin is None or sys.stdin.isatty():
        return {}
    raw = sys.stdin.read()
    if not raw.strip():
        return {}
    try:
        ctx = json.loads(raw)
    except json.JSONDecodeError as e:
        raise AgentError(f"context on stdin is not JSON: {e}")
    return ctx if isinstance(ctx, dict) else {}


def parse_params(params):
    if not isinstance(params, dict):
        raise AgentError("params: expected a JSON object")
    topic = params.get("topic", "AI agents")
    if not isinstance(topic, str) or not topic.strip() or len(topic) > 200:
        raise AgentError("params.topic: expected a non-empty string of at most 200 characters")
    fail = params.get("fail_attempts", 0)
    if isinstance(fail, bool) or not isinstance(fail, int) or fail < 0:
        raise AgentError("params.fail_attempts: expected an integer >= 0")
    return topic.strip(), fail


def estimate_tokens(text):
    return max(1, (len(text) + 3) // 4)


def chat_offline(prompt, topic, day):
    text = (f"# Brief: {topic} ({day})\n\n"
            f"- What moved: nothing was fetched; this brief was written offline.\n"
            f"- Why it matters: set LLM_BASE_URL and LLM_API_KEY to ask a model.\n"
            f"- What to watch: the next scheduled run.\n")
    usage = priced({"input_tokens": estimate_tokens(prompt), "output_tokens": estimate_tokens(text),
                    "cache_read_input_tokens": 0})
    return text, usage, "offline", True


def chat_api(prompt, base_url, api_key, model):
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}]}).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(base_url.rstrip("/") + "/chat/completions", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            doc = json.load(resp)
    except urllib.error.HTTPError as e:
        # Never echo the request (it carries the key); the status is enough.
        if e.code == 429:
            try:
                err = (json.loads(e.read() or b"{}").get("error") or {})
            except (ValueError, AttributeError, OSError):
                err = {}
            if err.get("code") == "insufficient_quota":
                raise AgentError("model API quota exhausted (HTTP 429 insufficient_quota)", EX_TEMPFAIL,
                                 {"outcome": "quota_exhausted", "resource": resource_name(), "class": "insufficient_quota"})
            after = retry_after_seconds(e.headers.get("Retry-After"))
            raise AgentError(f"model API rate limited (HTTP 429, retry after {after:.0f} s)", EX_TEMPFAIL,
                             {"outcome": "rate_limited", "retry_after_seconds": after, "resource": resource_name(),
                              "class": "http_429"})
        if 400 <= e.code < 500 and e.code not in (408, 425):
            raise AgentError(f"model API refused the request (HTTP {e.code})", 2,
                             {"outcome": "non_retryable", "class": f"http_{e.code}"})
        raise AgentError(f"model API answered HTTP {e.code}", EX_TEMPFAIL)
    except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:
        raise AgentError(f"model API unreachable: {e}", EX_TEMPFAIL)
    try:
        text = doc["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise AgentError("model API answer has no choices[0].message.content", EX_TEMPFAIL)
    u = doc.get("usage") or {}
    usage = priced({"input_tokens": int(u.get("prompt_tokens", 0)), "output_tokens": int(u.get("completion_tokens", 0)),
                    "cache_read_input_tokens": int((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0))})
    return text, usage, doc.get("model", model), False


def main():
    tracer = Tracer("brief-agent")
    try:
        return run(tracer)
    finally:
        tracer.flush()


def run(tracer):
    ctx = read_context()
    params = ctx.get("params") or {}
    topic, fail_attempts = parse_params(params)
    limited = params.get("rate_limit_attempts", 0) if isinstance(params, dict) else 0
    attempt = int(ctx.get("attempt") or os.environ.get("PUNCHCLOCK_ATTEMPT") or 1)
    day = (ctx.get("scheduled_at") or datetime.now(timezone.utc).isoformat())[:10]
    base_url = os.environ.get("LLM_BASE_URL", "")
    model = os.environ.get("LLM_MODEL", "gpt-4o-mini") if base_url else "offline"

    with tracer.span("brief prompt", **{"brief.topic": topic}):
        prompt = (f"Write a five-line industry brief on {topic} for {day}: "
                  f"what moved, why it matters, what to watch. Plain markdown.")

    with tracer.span(f"chat {model}", **{"gen_ai.operation.name": "chat", "gen_ai.request.model": model,
                                        "gen_ai.provider.name": "openai" if base_url else "offline"}) as span:
        if attempt <= fail_attempts:
            span.error("simulated model API outage")
            raise AgentError(f"model API unavailable (simulated: params.fail_attempts={fail_attempts}, attempt {attempt})",
                             EX_TEMPFAIL)
        if isinstance(limited, int) and attempt <= limited:
            after = params.get("retry_after_seconds", 5)
            span.error("simulated HTTP 429")
            raise AgentError(f"model API rate limited (simulated: params.rate_limit_attempts={limited}, attempt {attempt})",
                             EX_TEMPFAIL, {"outcome": "rate_limited", "retry_after_seconds": after,
                                           "resource": resource_name(), "class": "http_429"})
        if base_url:
            text, usage, used_model, estimated = chat_api(prompt, base_url, os.environ.get("LLM_API_KEY", ""), model)
        else:
            text, usage, used_model, estimated = chat_offline(prompt, topic, day)
        span.set("gen_ai.response.model", used_model)
        span.set("gen_ai.usage.input_tokens", usage["input_tokens"])
        span.set("gen_ai.usage.output_tokens", usage["output_tokens"])

    result = {"topic": topic, "brief": text, "model": used_model, "usage": usage, "usage_estimated": estimated,
              "traceparent": os.environ.get("TRACEPARENT", "")}
    path = os.environ.get("PUNCHCLOCK_RESULT_FILE")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, ensure_ascii=False)
    else:
        json.dump(result, sys.stdout, ensure_ascii=False, indent=2)
    print(f"brief: topic={topic!r} model={used_model} tokens={usage['input_tokens']}+{usage['output_tokens']}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except AgentError as e:
        print(f"brief: error: {e}", file=sys.stderr)
        path = os.environ.get("PUNCHCLOCK_RESULT_FILE")
        if path and e.outcome:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(dict(e.outcome, error=str(e)), f)
        sys.exit(e.code)
