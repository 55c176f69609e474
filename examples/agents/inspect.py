#!/usr/bin/env python3
"""inspect.py: punchclock example agent that inspects the host it runs on.

Checks disk usage of a path and the health of HTTP endpoints, reports one
progress line per check to $PUNCHCLOCK_PROGRESS_FILE, writes
{"checks": [{"name", "ok", "detail"}, ...], "ok": bool} to
$PUNCHCLOCK_RESULT_FILE, and exits 0 when every check passes, 1 when any
fails (the failures are listed on stderr), 2 on bad params.

Params (the task's context.params):
  disk_path             path whose file system is checked (default "/")
  max_disk_percent      highest acceptable used percentage (default 95)
  urls                  URLs fetched with GET, each must answer 2xx
                        (default ["http://127.0.0.1:7701/healthz"])
  http_timeout_seconds  per-request timeout (default 3)

Uses only the Python standard library.
"""

import os
import sys

# This file shares its name with the standard library's `inspect` module:
# keep the script's directory off sys.path so that any library importing
# `inspect` gets the real one.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import json  # noqa: E402
import urllib.error  # noqa: E402
import urllib.parse  # noqa: E402
import urllib.request  # noqa: E402

DEFAULT_URLS = ["http://127.0.0.1:7701/healthz"]
LOOPBACK_HOSTS = {"localhost", "127.0.0.1", "::1"}


class ParamError(Exception):
    pass


def progress(percent=None, message=None):
    line = {}
    if percent is not None:
        line["percent"] = percent
    if message is not None:
        line["message"] = message
    path = os.environ.get("PUNCHCLOCK_PROGRESS_FILE")
    if not path:
        print("progress: " + json.dumps(line), file=sys.stderr)
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()


def write_result(doc):
    text = json.dumps(doc, indent=2) + "\n"
    path = os.environ.get("PUNCHCLOCK_RESULT_FILE")
    if not path:
        sys.stdout.write(text)
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def read_context():
    if sys.stdin is None or sys.stdin.isatty():
        return {}
    raw = sys.stdin.read()
    if not raw.strip():
        return {}
    try:
        ctx = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ParamError(f"context on stdin is not JSON: {e}")
    if not isinstance(ctx, dict):
        raise ParamError("context on stdin is not a JSON object")
    return ctx


def number(params, key, default, minimum=0):
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= minimum:
        raise ParamError(f"params.{key}: expected a number > {minimum}")
    return value


def parse_params(params):
    if not isinstance(params, dict):
        raise ParamError("params: expected a JSON object")
    disk_path = params.get("disk_path", "/")
    if not isinstance(disk_path, str) or not disk_path:
        raise ParamError("params.disk_path: expected a path")
    max_disk = number(params, "max_disk_percent", 95)
    if max_disk > 100:
        raise ParamError("params.max_disk_percent: expected a number in (0, 100]")
    urls = params.get("urls", DEFAULT_URLS)
    if not isinstance(urls, list) or not all(isinstance(u, str) and u for u in urls):
        raise ParamError("params.urls: expected a list of URLs")
    timeout = number(params, "http_timeout_seconds", 3)
    return disk_path, float(max_disk), urls, float(timeout)


def check_disk(path, max_percent):
    name = f"disk:{path}"
    try:
        st = os.statvfs(path)
    except OSError as e:
        return {"name": name, "ok": False, "detail": f"statvfs failed: {e.strerror or e}"}
    # Same arithmetic as df(1): used / (used + available to unprivileged users).
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    avail = st.f_bavail * st.f_frsize
    if used + avail == 0:
        return {"name": name, "ok": False, "detail": "file system reports zero size"}
    percent = used * 100.0 / (used + avail)
    ok = percent <= max_percent
    detail = (f"{percent:.1f}% used (limit {max_percent:g}%), "
              f"{avail / 2**30:.1f} GiB available")
    return {"name": name, "ok": ok, "detail": detail}


def opener_for(url):
    """Loopback URLs bypass any configured HTTP proxy; others honour it."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host in LOOPBACK_HOSTS:
        return urllib.request.build_opener(urllib.request.ProxyHandler({}))
    return urllib.request.build_opener()


def check_url(url, timeout):
    name = f"http:{url}"
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme not in ("http", "https"):
        return {"name": name, "ok": False, "detail": f"unsupported URL scheme {scheme!r}"}
    req = urllib.request.Request(url, method="GET", headers={"User-Agent": "punchclock-inspect/1"})
    try:
        with opener_for(url).open(req, timeout=timeout) as resp:
            status = resp.status
            resp.read(4096)
    except urllib.error.HTTPError as e:
        return {"name": name, "ok": False, "detail": f"HTTP {e.code} {e.reason}"}
    except urllib.error.URLError as e:
        return {"name": name, "ok": False, "detail": f"request failed: {e.reason}"}
    except (OSError, ValueError) as e:  # timeouts, resets, malformed URLs
        return {"name": name, "ok": False, "detail": f"request failed: {e}"}
    ok = 200 <= status < 300
    return {"name": name, "ok": ok, "detail": f"HTTP {status}"}


def main():
    ctx = read_context()
    disk_path, max_disk, urls, timeout = parse_params(ctx.get("params") or {})
    total = 1 + len(urls)
    checks = []

    progress(0, f"checking disk usage of {disk_path}")
    checks.append(check_disk(disk_path, max_disk))
    progress(round(100 * len(checks) / total), f"{checks[-1]['name']}: {checks[-1]['detail']}")

    for url in urls:
        checks.append(check_url(url, timeout))
        progress(round(100 * len(checks) / total), f"{checks[-1]['name']}: {checks[-1]['detail']}")

    all_ok = all(c["ok"] for c in checks)
    write_result({"checks": checks, "ok": all_ok})
    failed = [c for c in checks if not c["ok"]]
    print(f"inspect: {len(checks) - len(failed)}/{len(checks)} checks passed")
    for c in failed:
        print(f"inspect: FAILED {c['name']}: {c['detail']}", file=sys.stderr)
    return 0 if all_ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ParamError as e:
        print(f"inspect: error: {e}", file=sys.stderr)
        sys.exit(2)
