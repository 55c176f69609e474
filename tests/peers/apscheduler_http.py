#!/usr/bin/env python3
"""APScheduler peer of bench-load's HTTP rows (issue 22).

N cron jobs firing every second (`CronTrigger(second="*")`, or with
--every 10 on the seconds divisible by 10: the 10k burst row), each POSTing a
small JSON context to the same HTTP agent the bench serves to punchclock
(keep-alive, one connection per worker thread), for a window of whole
seconds starting at --start (a Unix second). Start lag is measured as
punchclock's is: from the slot (APScheduler's `scheduled_run_time`) to the
moment the job begins, i.e. just before its request is sent. The job
returns that moment; the EVENT_JOB_EXECUTED / EVENT_JOB_ERROR listener
gets it with the slot, which is public API (APScheduler 3.x).

The jobs run as a punchclock run does by default: no misfire skipping
(misfire_grace_time=None), no coalescing, and at most one instance of a
job at a time (a slot whose previous run is still going is counted as
skipped, like an overlap SKIP).

Prints one JSON line: expected, fired, failed, skipped, missed, start lags
(ms, sorted p50/p99/max) and this process's CPU seconds over the window.

Usage: apscheduler_http.py --url URL --tasks N --start UNIX --window S [--every 1|10] [--threads T]
"""

import argparse
import http.client
import json
import logging
import math
import resource
import threading
import time
import urllib.parse
from datetime import datetime, timezone

from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_EXECUTED, EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.cron import CronTrigger


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--tasks", type=int, required=True)
    ap.add_argument("--start", type=int, required=True, help="first slot, a Unix second")
    ap.add_argument("--window", type=int, required=True, help="seconds")
    ap.add_argument("--every", type=int, default=1, help="slots every this many seconds (10: the burst row)")
    ap.add_argument("--threads", type=int, default=64)
    a = ap.parse_args()
    # APScheduler's own per-skip warnings: counted below instead.
    logging.getLogger("apscheduler").setLevel(logging.ERROR)
    url = urllib.parse.urlsplit(a.url)
    local = threading.local()

    def post(body):
        # A kept-alive connection the server has closed meanwhile is opened
        # again once, as HTTP clients' pools do (urllib3, hyper).
        for fresh in (False, True):
            conn = getattr(local, "conn", None)
            reused = conn is not None and not fresh
            if conn is None or fresh:
                conn = local.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
            try:
                conn.request("POST", url.path, body=body, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                local.conn = None
                if reused:
                    continue
                raise
            if not 200 <= resp.status < 300:
                raise RuntimeError(f"HTTP {resp.status}")
            return

    def job(task_id):
        began = time.time()
        post(json.dumps({"task_id": task_id, "agent_id": "http_agent"}).encode())
        return began

    start, until = a.start, a.start + a.window
    lock = threading.Lock()
    lags, failed, skipped, missed, first_error = [], [0], [0], [0], [""]

    def on_event(ev):
        with lock:
            if ev.code == EVENT_JOB_MAX_INSTANCES:
                # A submission event: every run time it was for.
                skipped[0] += sum(1 for t in ev.scheduled_run_times if start <= t.timestamp() < until)
                return
            if not start <= ev.scheduled_run_time.timestamp() < until:
                return
            if ev.code == EVENT_JOB_EXECUTED:
                lags.append((ev.retval - ev.scheduled_run_time.timestamp()) * 1000.0)
            elif ev.code == EVENT_JOB_ERROR:
                failed[0] += 1
                first_error[0] = first_error[0] or repr(ev.exception)
            else:
                missed[0] += 1

    sched = BackgroundScheduler(
        executors={"default": ThreadPoolExecutor(a.threads)},
        job_defaults={"misfire_grace_time": None, "coalesce": False, "max_instances": 1},
        timezone=timezone.utc,
    )
    sched.add_listener(on_event, EVENT_JOB_EXECUTED | EVENT_JOB_ERROR | EVENT_JOB_MAX_INSTANCES | EVENT_JOB_MISSED)
    first = datetime.fromtimestamp(start, timezone.utc)
    last = datetime.fromtimestamp(until + 2, timezone.utc)
    for i in range(a.tasks):
        tid = f"load{i:05}"
        sched.add_job(job, CronTrigger(second="*" if a.every == 1 else f"*/{a.every}", start_date=first, end_date=last, timezone=timezone.utc), args=[tid], id=tid)
    sched.start()
    time.sleep(max(0.0, start - time.time()))
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(max(0.0, until - time.time()))
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    # Let the window's last jobs finish.
    time.sleep(5)
    sched.shutdown(wait=True)
    with lock:
        done = sorted(lags)

    def pct(p):
        if not done:
            return 0
        return round(done[min(len(done), max(1, math.ceil(len(done) * p))) - 1])

    print(
        json.dumps(
            {
                "expected": a.tasks * sum(1 for t in range(start, until) if t % a.every == 0),
                "fired": len(done) + failed[0],
                "failed": failed[0],
                "first_error": first_error[0],
                "skipped": skipped[0],
                "missed": missed[0],
                "start_p50": pct(0.5),
                "start_p99": pct(0.99),
                "start_max": round(done[-1]) if done else 0,
                "cpu_seconds": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
            }
        )
    )


if __name__ == "__main__":
    main()
