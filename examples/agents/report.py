#!/usr/bin/env python3
"""report.py: punchclock example agent that builds a sales report from a CSV file.

Agent protocol (see README.md, "Writing an agent"):
  stdin   the run context JSON: {"task_id", "run_id", "execution_id", "attempt",
          "scheduled_at", "trigger", "params": {...}, "checkpoint": ... | null}
  env     PUNCHCLOCK_TASK_ID, PUNCHCLOCK_RUN_ID, PUNCHCLOCK_EXECUTION_ID,
          PUNCHCLOCK_ATTEMPT, PUNCHCLOCK_SCHEDULED_AT, PUNCHCLOCK_DEADLINE,
          PUNCHCLOCK_PROGRESS_FILE, PUNCHCLOCK_RESULT_FILE,
          PUNCHCLOCK_CHECKPOINT_FILE, TRACEPARENT
  progress  JSON lines appended to $PUNCHCLOCK_PROGRESS_FILE
  result    one JSON document written to $PUNCHCLOCK_RESULT_FILE
  exit      0 = success, anything else = failure

Params (the task's context.params):
  region              "cn-north", ... ; absent or "all" = every region
  output_format       "markdown" (default) or "json"
  data_file           CSV with columns date,region,product,units,revenue_cny;
                      default examples/data/sales.csv relative to the working
                      directory, else ../data/sales.csv next to this script
  step_delay_seconds  pause between steps so progress is visible (default 0.5)

Exits 2 (message on stderr) on bad params, a missing data file, or a region
with no rows. Uses only the Python standard library.
"""

import csv
import json
import os
import signal
import sys
import time
from datetime import datetime, timezone
from decimal import Decimal, InvalidOperation

DEFAULT_DATA = os.path.join("examples", "data", "sales.csv")
SCRIPT_DIR = os.path.dirname(os.path.abspath(__file__))
FALLBACK_DATA = os.path.normpath(os.path.join(SCRIPT_DIR, "..", "data", "sales.csv"))
TOP_DAYS = 5

TITLES = {
    "en": {
        "title": "Sales report",
        "all": "all regions",
        "summary": "Summary",
        "by_region": "Revenue by region",
        "by_product": "Revenue by product",
        "top_days": "Top days by revenue",
        "period": "Period",
        "days_with_sales": "days with sales",
        "rows": "Rows",
        "units": "Units",
        "revenue": "Revenue (CNY)",
        "share": "Share",
        "scheduled": "Scheduled at",
        "generated": "Generated at",
        "run": "Run",
        "attempt": "attempt",
        "region": "Region",
        "product": "Product",
        "date": "Date",
    },
    "zh": {
        "title": "销售报告",
        "all": "全部区域",
        "summary": "概览",
        "by_region": "各区域收入",
        "by_product": "各产品收入",
        "top_days": "收入最高的日期",
        "period": "统计区间",
        "days_with_sales": "天有销售",
        "rows": "行数",
        "units": "销量",
        "revenue": "收入（元）",
        "share": "占比",
        "scheduled": "计划时间",
        "generated": "生成时间",
        "run": "运行",
        "attempt": "尝试",
        "region": "区域",
        "product": "产品",
        "date": "日期",
    },
}


class AgentError(Exception):
    """A failure reported on stderr with exit code 2."""


def utc_now():
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def progress(percent=None, message=None, checkpoint=None):
    """Append one complete JSON line to the progress file (if there is one)."""
    line = {}
    if percent is not None:
        line["percent"] = percent
    if message is not None:
        line["message"] = message
    if checkpoint is not None:
        line["checkpoint"] = checkpoint
    path = os.environ.get("PUNCHCLOCK_PROGRESS_FILE")
    if not path:
        print("progress: " + json.dumps(line, ensure_ascii=False), file=sys.stderr)
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line, ensure_ascii=False) + "\n")
        f.flush()


def write_result(doc):
    text = json.dumps(doc, ensure_ascii=False, indent=2) + "\n"
    path = os.environ.get("PUNCHCLOCK_RESULT_FILE")
    if not path:
        sys.stdout.write(text)
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def read_context():
    """The run context from stdin; an empty stdin (a run by hand) means {}."""
    if sys.stdin is None or sys.stdin.isatty():
        return {}
    raw = sys.stdin.read()
    if not raw.strip():
        return {}
    try:
        ctx = json.loads(raw)
    except json.JSONDecodeError as e:
        raise AgentError(f"context on stdin is not JSON: {e}")
    if not isinstance(ctx, dict):
        raise AgentError("context on stdin is not a JSON object")
    return ctx


def read_checkpoint(ctx):
    """The last checkpoint of an earlier attempt: from the context, else the file."""
    if ctx.get("checkpoint") is not None:
        return ctx["checkpoint"]
    path = os.environ.get("PUNCHCLOCK_CHECKPOINT_FILE")
    if path and os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError):
            return None
    return None


def seconds_left():
    """Seconds until PUNCHCLOCK_DEADLINE, or None when unknown."""
    raw = os.environ.get("PUNCHCLOCK_DEADLINE", "")
    if not raw:
        return None
    try:
        deadline = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (deadline - datetime.now(timezone.utc)).total_seconds()


def pause(delay):
    """Sleep between steps, but never into the last 5 seconds before the deadline."""
    left = seconds_left()
    if left is not None:
        delay = min(delay, max(0.0, left - 5))
    if delay > 0:
        time.sleep(delay)


def parse_params(params):
    if not isinstance(params, dict):
        raise AgentError("params: expected a JSON object")
    region = params.get("region")
    if region is None or region == "all":
        region = "all"
    elif not isinstance(region, str) or not region:
        raise AgentError("params.region: expected a region name or \"all\"")
    fmt = params.get("output_format", "markdown")
    if fmt not in ("markdown", "json"):
        raise AgentError(f"params.output_format: expected \"markdown\" or \"json\", got {fmt!r}")
    delay = params.get("step_delay_seconds", 0.5)
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) or delay < 0:
        raise AgentError("params.step_delay_seconds: expected a number >= 0")
    data_file = params.get("data_file")
    if data_file is not None and (not isinstance(data_file, str) or not data_file):
        raise AgentError("params.data_file: expected a path")
    return region, fmt, float(delay), data_file


def resolve_data_file(data_file):
    if data_file is not None:
        if os.path.isfile(data_file):
            return data_file
        raise AgentError(f"data file not found: {data_file} (working directory {os.getcwd()})")
    for candidate in (DEFAULT_DATA, FALLBACK_DATA):
        if os.path.isfile(candidate):
            return candidate
    raise AgentError(f"data file not found: tried {DEFAULT_DATA} (in {os.getcwd()}) and {FALLBACK_DATA}")


def read_rows(path):
    rows = []
    try:
        f = open(path, newline="", encoding="utf-8")
    except OSError as e:
        raise AgentError(f"cannot open data file {path}: {e}")
    with f:
        reader = csv.DictReader(f)
        need = {"date", "region", "product", "units", "revenue_cny"}
        missing = need - set(reader.fieldnames or [])
        if missing:
            raise AgentError(f"{path}: missing columns: {', '.join(sorted(missing))}")
        for n, rec in enumerate(reader, start=2):
            try:
                rows.append({
                    "date": rec["date"].strip(),
                    "region": rec["region"].strip(),
                    "product": rec["product"].strip(),
                    "units": int(rec["units"]),
                    "revenue": Decimal(rec["revenue_cny"]),
                })
            except (ValueError, InvalidOperation, AttributeError):
                raise AgentError(f"{path}:{n}: bad row: {rec}")
    return rows


def aggregate(rows):
    def group(key):
        out = {}
        for r in rows:
            g = out.setdefault(r[key], {"units": 0, "revenue": Decimal("0")})
            g["units"] += r["units"]
            g["revenue"] += r["revenue"]
        return out

    total = sum((r["revenue"] for r in rows), Decimal("0"))
    by_day = group("date")
    top = sorted(by_day.items(), key=lambda kv: (-kv[1]["revenue"], kv[0]))[:TOP_DAYS]
    dates = sorted(by_day)
    return {
        "rows": len(rows),
        "units": sum(r["units"] for r in rows),
        "revenue": total,
        "period_from": dates[0],
        "period_to": dates[-1],
        "days_with_sales": len(dates),
        "by_region": sorted(group("region").items(), key=lambda kv: -kv[1]["revenue"]),
        "by_product": sorted(group("product").items(), key=lambda kv: -kv[1]["revenue"]),
        "top_days": top,
    }


def money(d):
    return f"{d:,.2f}"


def share(part, total):
    return f"{(part * 100 / total):.1f}%" if total else "-"


def render_markdown(agg, region, meta, t):
    title_region = t["all"] if region == "all" else region
    lines = [
        f"# {t['title']}: {title_region}",
        "",
        f"- {t['period']}: {agg['period_from']} .. {agg['period_to']} "
        f"({agg['days_with_sales']} {t['days_with_sales']})",
        f"- {t['rows']}: {agg['rows']}",
        f"- {t['scheduled']}: {meta['scheduled_at'] or '-'}",
        f"- {t['generated']}: {meta['generated_at']}",
        f"- {t['run']}: {meta['run_id'] or '-'} ({t['attempt']} {meta['attempt']})",
        "",
        f"## {t['summary']}",
        "",
        f"| {t['units']} | {t['revenue']} |",
        "|---:|---:|",
        f"| {agg['units']:,} | {money(agg['revenue'])} |",
        "",
    ]
    for key, heading, col in (("by_region", t["by_region"], t["region"]),
                              ("by_product", t["by_product"], t["product"])):
        lines += [f"## {heading}", "", f"| {col} | {t['units']} | {t['revenue']} | {t['share']} |",
                  "|---|---:|---:|---:|"]
        for name, g in agg[key]:
            lines.append(f"| {name} | {g['units']:,} | {money(g['revenue'])} | "
                         f"{share(g['revenue'], agg['revenue'])} |")
        lines.append("")
    lines += [f"## {t['top_days']}", "", f"| {t['date']} | {t['units']} | {t['revenue']} |", "|---|---:|---:|"]
    for day, g in agg["top_days"]:
        lines.append(f"| {day} | {g['units']:,} | {money(g['revenue'])} |")
    lines.append("")
    return "\n".join(lines)


def render_json(agg, region, meta):
    def groups(items):
        return [{"name": k, "units": g["units"], "revenue_cny": float(g["revenue"])} for k, g in items]

    return {
        "region": region,
        "period": {"from": agg["period_from"], "to": agg["period_to"],
                   "days_with_sales": agg["days_with_sales"]},
        "units": agg["units"],
        "revenue_cny": float(agg["revenue"]),
        "by_region": groups(agg["by_region"]),
        "by_product": groups(agg["by_product"]),
        "top_days": [{"date": d, "units": g["units"], "revenue_cny": float(g["revenue"])}
                     for d, g in agg["top_days"]],
        "scheduled_at": meta["scheduled_at"],
        "generated_at": meta["generated_at"],
        "run_id": meta["run_id"],
        "attempt": meta["attempt"],
    }


def on_sigterm(signum, frame):
    # The runner sends SIGTERM at the deadline or on cancel, then SIGKILL
    # after a grace period: leave a last progress line and stop.
    try:
        progress(message="terminated by SIGTERM")
    finally:
        os._exit(143)


def main():
    signal.signal(signal.SIGTERM, on_sigterm)
    ctx = read_context()
    region, fmt, delay, data_file = parse_params(ctx.get("params") or {})
    locale = os.environ.get("REPORT_LOCALE", "en")
    t = TITLES.get(locale, TITLES["en"])
    meta = {
        "run_id": ctx.get("run_id") or os.environ.get("PUNCHCLOCK_RUN_ID", ""),
        "attempt": ctx.get("attempt") or int(os.environ.get("PUNCHCLOCK_ATTEMPT") or 1),
        "scheduled_at": ctx.get("scheduled_at") or os.environ.get("PUNCHCLOCK_SCHEDULED_AT", ""),
    }
    checkpoint = read_checkpoint(ctx)
    if checkpoint is not None:
        print(f"report: attempt {meta['attempt']} resumes after checkpoint {json.dumps(checkpoint)}")

    path = resolve_data_file(data_file)
    progress(5, f"reading {path}")
    rows = read_rows(path)
    pause(delay)
    if region != "all":
        rows = [r for r in rows if r["region"] == region]
        if not rows:
            raise AgentError(f"region {region!r} matches no rows in {path}")
    if not rows:
        raise AgentError(f"{path} has no data rows")
    progress(30, f"read {len(rows)} rows for {region}")
    pause(delay)

    progress(50, "aggregating", checkpoint={"stage": "aggregating", "rows": len(rows)})
    agg = aggregate(rows)
    pause(delay)

    progress(80, f"rendering {fmt}")
    meta["generated_at"] = utc_now()
    if fmt == "markdown":
        report = render_markdown(agg, region, meta, t)
    else:
        report = render_json(agg, region, meta)
    pause(delay)

    total = float(agg["revenue"])
    write_result({
        "format": fmt,
        "report": report,
        "rows": agg["rows"],
        "region": region,
        "total_revenue_cny": total,
    })
    progress(100, "done")
    print(f"report: region={region} rows={agg['rows']} period={agg['period_from']}..{agg['period_to']} "
          f"total_revenue_cny={total:.2f} format={fmt} run={meta['run_id'] or '-'} attempt={meta['attempt']}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except AgentError as e:
        print(f"report: error: {e}", file=sys.stderr)
        sys.exit(2)
