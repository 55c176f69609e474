//! Rendering API messages for people (tables) and programs (`-o json`).
//! Run JSON uses DESIGN's field names; times are RFC 3339 UTC.

use chrono::SecondsFormat;
use prost_types::Timestamp;
use punchclock_proto::v1 as pb;
use serde_json::{Value, json};

/// Timestamp → RFC 3339 UTC (`null` when absent).
pub fn t(ts: &Option<Timestamp>) -> Value {
    match punchclock_proto::time::from_timestamp_opt(ts.as_ref()) {
        Some(d) => Value::String(d.to_rfc3339_opts(SecondsFormat::AutoSi, true)),
        None => Value::Null,
    }
}

fn json_field(s: &str) -> Value {
    if s.is_empty() { Value::Null } else { serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.to_string())) }
}

fn opt_str(s: &str) -> Value {
    if s.is_empty() { Value::Null } else { Value::String(s.to_string()) }
}

/// `PENDING`, `RUNNING`, ...
pub fn status_name(s: i32) -> &'static str {
    match pb::RunStatus::try_from(s).unwrap_or(pb::RunStatus::Unspecified) {
        pb::RunStatus::Unspecified => "UNSPECIFIED",
        pb::RunStatus::Pending => "PENDING",
        pb::RunStatus::Running => "RUNNING",
        pb::RunStatus::Succeeded => "SUCCEEDED",
        pb::RunStatus::Failed => "FAILED",
        pb::RunStatus::Retrying => "RETRYING",
        pb::RunStatus::Timeout => "TIMEOUT",
        pb::RunStatus::Cancelled => "CANCELLED",
        pb::RunStatus::Skipped => "SKIPPED",
    }
}

/// A runner-reported outcome as a lower-case name.
fn report_outcome_name(o: i32) -> &'static str {
    match pb::Outcome::try_from(o).unwrap_or(pb::Outcome::Unspecified) {
        pb::Outcome::Unspecified => "unspecified",
        pb::Outcome::Succeeded => "succeeded",
        pb::Outcome::Failed => "failed",
        pb::Outcome::Timeout => "timeout",
        pb::Outcome::Cancelled => "cancelled",
        pb::Outcome::Refused => "refused",
        pb::Outcome::Interrupted => "interrupted",
    }
}

/// A run as JSON with DESIGN's field names.
pub fn run_json(r: &pb::Run) -> Value {
    let params = json_field(&r.context_json).get("params").cloned().unwrap_or(Value::Null);
    json!({
        "run_id": r.run_id,
        "task_id": r.task_id,
        "agent_id": r.agent_id,
        "trigger": r.trigger_kind,
        "status": status_name(r.status),
        "scheduled_at": t(&r.scheduled_at),
        "dispatched_at": t(&r.dispatched_at),
        "actual_started_at": t(&r.actual_started_at),
        "finished_at": t(&r.finished_at),
        "attempts": r.attempts.iter().map(|a| json!({
            "attempt": a.attempt,
            "execution_id": a.execution_id,
            "runner_id": a.runner_id,
            "dispatched_at": t(&a.dispatched_at),
            "started_at": t(&a.started_at),
            "finished_at": t(&a.finished_at),
            "outcome": opt_str(&a.outcome),
            "error": opt_str(&a.error),
            "exit_code": a.exit_code,
            "class": opt_str(&a.class),
            "resource": opt_str(&a.resource),
            "retry_at": t(&a.retry_at),
            "model": opt_str(&a.model),
            "peak_memory_bytes": a.peak_memory_bytes,
            "cpu_seconds": a.cpu_seconds,
            "usage": a.usage.as_ref().map(|u| json!({
                "input_tokens": u.input_tokens,
                "output_tokens": u.output_tokens,
                "cache_read_input_tokens": u.cache_read_input_tokens,
                "cost": u.cost,
                "cost_priced": u.cost_priced,
            })),
            "holds": a.holds.iter().map(|h| json!({"name": h.name, "units": h.units, "tokens": h.tokens})).collect::<Vec<_>>(),
            "awaiting_runner": a.awaiting_runner,
            "report": a.report.as_ref().map(|rep| json!({
                "outcome": report_outcome_name(rep.outcome),
                "error": opt_str(&rep.error),
                "exit_code": rep.exit_code,
                "result": json_field(&rep.result_json),
                "finished_at": t(&rep.finished_at),
            })),
        })).collect::<Vec<_>>(),
        "result": json_field(&r.result_json),
        "progress": r.progress.as_ref().map(|p| json!({
            "percent": p.percent,
            "message": p.message,
            "checkpoint": json_field(&p.checkpoint_json),
            "updated_at": t(&p.updated_at),
        })),
        "skip_reason": opt_str(&r.skip_reason),
        "missed_count": if r.missed_count == 0 { Value::Null } else { json!(r.missed_count) },
        "missed_from": t(&r.missed_from),
        "missed_until": t(&r.missed_until),
        "pending_reason": opt_str(&r.pending_reason),
        "waiting_for": if r.status == pb::RunStatus::Pending as i32 { opt_str(&r.pending_reason) } else { Value::Null },
        "start_by": t(&r.start_by),
        "interruptions": r.interruptions,
        "elided_attempts": r.elided_attempts,
        "priority": r.priority,
        "event": json_field(&r.event_json),
        "upstream": json_field(&r.upstream_json),
        "next_attempt_at": t(&r.next_attempt_at),
        "fire_at": t(&r.fire_at),
        "rerun_of": opt_str(&r.rerun_of),
        "backfill_id": opt_str(&r.backfill_id),
        "reruns": r.reruns,
        "error": opt_str(&r.error),
        "params": params,
        "stdout_tail": r.stdout_tail,
        "stderr_tail": r.stderr_tail,
        "fencing_token": r.fencing_token,
        "trace_id": opt_str(&r.trace_id),
        "span_id": opt_str(&r.span_id),
        "updated_at": t(&r.updated_at),
    })
}

/// A task as JSON: `spec` is its definition as applied (apply it again:
/// unchanged), `effective` (when the server sent it: `task get`) every
/// field with its value in force.
pub fn task_json(tk: &pb::Task) -> Value {
    let mut v = json!({
        "task_id": tk.task_id,
        "agent_id": tk.agent_id,
        "paused": tk.paused,
        "paused_reason": opt_str(&tk.paused_reason),
        "next_fire_at": t(&tk.next_fire_at),
        "last_slot_at": t(&tk.last_slot_at),
        "ended": opt_str(&tk.ended),
        "breaker": tk.breaker.as_ref().map(|b| json!({
            "phase": b.phase,
            "consecutive_failures": b.consecutive_failures,
            "opened_at": t(&b.opened_at),
            "open_until": t(&b.open_until),
            "trial_run_id": opt_str(&b.trial_run_id),
            "openings": b.openings,
        })),
        "created_at": t(&tk.created_at),
        "updated_at": t(&tk.updated_at),
        "spec": json_field(&tk.spec_json),
    });
    if !tk.effective_json.is_empty() {
        v["effective"] = json_field(&tk.effective_json);
    }
    if !tk.recent_slots.is_empty() {
        v["recent_slots"] = tk
            .recent_slots
            .iter()
            .map(|c| {
                json!({
                    "run_id": c.run_id,
                    "scheduled_at": t(&c.scheduled_at),
                    "status": status_name(c.status),
                    "reason": opt_str(&c.reason),
                    "slots": c.slots,
                    "label": c.label,
                    "start_lag_ms": c.start_lag_ms,
                })
            })
            .collect();
    }
    v
}

/// A task's recent slots as one character each, newest first: `✓`
/// succeeded, `✗` failed, `⏱` timed out, `⊘` cancelled, `·` skipped, `▶`
/// running, `…` waiting; `-` when there are none.
pub fn slot_strip(cells: &[pb::SlotCell]) -> String {
    if cells.is_empty() {
        return "-".into();
    }
    cells
        .iter()
        .map(|c| match pb::RunStatus::try_from(c.status).unwrap_or(pb::RunStatus::Unspecified) {
            pb::RunStatus::Succeeded => '✓',
            pb::RunStatus::Failed => '✗',
            pb::RunStatus::Timeout => '⏱',
            pb::RunStatus::Cancelled => '⊘',
            pb::RunStatus::Skipped => '·',
            pb::RunStatus::Running => '▶',
            pb::RunStatus::Pending | pb::RunStatus::Retrying => '…',
            pb::RunStatus::Unspecified => '?',
        })
        .collect()
}

/// A runner as JSON.
pub fn runner_json(r: &pb::Runner) -> Value {
    json!({
        "runner_id": r.runner_id,
        "agents": r.agents,
        "slots": r.slots,
        "busy_slots": r.busy_slots,
        "labels": r.labels,
        "version": r.version,
        "connected_at": t(&r.connected_at),
        "last_seen": t(&r.last_seen),
        "running": r.running,
        "draining": r.draining,
    })
}

/// A shared resource as `resources list -o json` shows it.
pub fn resource_json(r: &pb::Resource) -> Value {
    json!({
        "name": r.name,
        "concurrency": r.concurrency,
        "requests_per_minute": r.requests_per_minute,
        "tokens_per_minute": r.tokens_per_minute,
        "in_use": r.in_use,
        "waiting": r.waiting,
        "requests_available": r.requests_available,
        "tokens_available": r.tokens_available,
        "held_until": t(&r.held_until),
        "held_why": r.held_why,
    })
}

/// A budget as JSON (`budgets list -o json`).
pub fn budget_json(b: &pb::Budget) -> Value {
    let amount = |a: &Option<pb::BudgetAmount>| {
        a.as_ref().map(|a| json!({"cost": a.cost, "input_tokens": a.input_tokens, "output_tokens": a.output_tokens, "runs": a.runs}))
    };
    json!({
        "name": b.name,
        "scope": b.scope,
        "window": b.window,
        "window_start": t(&b.window_start),
        "window_end": t(&b.window_end),
        "used": amount(&b.used),
        "reserved": amount(&b.reserved),
        "limits": amount(&b.limits),
        "soft_percent": b.soft_percent,
        "on_exceeded": b.on_exceeded,
        "state": b.state,
        "timezone": b.timezone,
        "resets_at": in_zone(&b.window_end, &b.timezone),
    })
}

/// `t` in the IANA zone `zone` (RFC 3339 with its offset), else in UTC.
pub fn in_zone(t: &Option<prost_types::Timestamp>, zone: &str) -> Value {
    let Some(ts) = t else { return Value::Null };
    let Some(utc) = chrono::DateTime::from_timestamp(ts.seconds, u32::try_from(ts.nanos).unwrap_or(0)) else { return Value::Null };
    match zone.parse::<chrono_tz::Tz>() {
        Ok(tz) => Value::String(utc.with_timezone(&tz).to_rfc3339()),
        Err(_) => Value::String(utc.to_rfc3339()),
    }
}

/// The limited measures of `used`, each against its limit when
/// `with_limit`: `runs 3/10 cost 0.1200/5`.
pub fn budget_use(used: Option<&pb::BudgetAmount>, limits: Option<&pb::BudgetAmount>, with_limit: bool) -> String {
    let (Some(u), Some(l)) = (used, limits) else { return "-".into() };
    let of = |lim: String| if with_limit { format!("/{lim}") } else { String::new() };
    let mut parts = Vec::new();
    if let Some(lim) = l.runs {
        parts.push(format!("runs {}{}", u.runs.unwrap_or(0), of(lim.to_string())));
    }
    if let Some(lim) = l.input_tokens {
        parts.push(format!("input_tokens {}{}", u.input_tokens.unwrap_or(0), of(lim.to_string())));
    }
    if let Some(lim) = l.output_tokens {
        parts.push(format!("output_tokens {}{}", u.output_tokens.unwrap_or(0), of(lim.to_string())));
    }
    if let Some(lim) = l.cost {
        parts.push(format!("cost {:.4}{}", u.cost.unwrap_or(0.0), of(lim.to_string())));
    }
    parts.join(" ")
}

fn short(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

/// Prints rows as an aligned table.
pub fn table(header: &[&str], rows: Vec<Vec<String>>) {
    let mut w: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let s: Vec<String> = cells.iter().enumerate().map(|(i, c)| format!("{c:<width$}", width = w[i])).collect();
        println!("{}", s.join("  ").trim_end());
    };
    line(header.iter().map(|s| s.to_string()).collect());
    for r in rows {
        line(r);
    }
}

/// One table row of a run.
pub fn run_row(r: &pb::Run) -> Vec<String> {
    let j = run_json(r);
    let info = if !r.skip_reason.is_empty() {
        format!("{}{}", r.skip_reason, if r.missed_count > 1 { format!(" ({} slots)", r.missed_count) } else { String::new() })
    } else if !r.error.is_empty() {
        r.error.chars().take(60).collect()
    } else if !r.pending_reason.is_empty() {
        format!("waiting_for: {}", r.pending_reason).chars().take(80).collect()
    } else if let Some(p) = &r.progress {
        format!("{}% {}", p.percent.unwrap_or(0.0), p.message).chars().take(60).collect()
    } else {
        String::new()
    };
    vec![
        short(&j["run_id"]),
        short(&j["status"]),
        short(&j["scheduled_at"]),
        (r.attempts.len() + r.elided_attempts as usize).to_string(),
        short(&j["finished_at"]),
        info,
    ]
}

/// Prints a JSON value, pretty.
pub fn print_json(v: &Value) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

/// `task get` as rows of (label, text): the definition's trigger(s) with
/// their zone, execution, history, and the next fire times in the
/// trigger's zone and in UTC (`next`: a preview of the task).
pub fn task_details(tk: &pb::Task, next: &pb::PreviewScheduleResponse) -> Vec<(&'static str, String)> {
    // The values in force (a server that sends no effective definition
    // sends its stored one, defaults filled, as spec_json).
    let text = if tk.effective_json.is_empty() { &tk.spec_json } else { &tk.effective_json };
    let spec: Value = serde_json::from_str(text).unwrap_or(Value::Null);
    let trigger = |t: &Value| match t["type"].as_str() {
        Some("cron") => format!("cron {} in {}", t["expr"], t["timezone"].as_str().unwrap_or("UTC")),
        Some("interval") => {
            let every =
                if t["every"].is_string() { t["every"].as_str().unwrap_or("").to_string() } else { format!("{}s", t["every_seconds"]) };
            format!("every {every}{}", t["start_at"].as_str().map(|s| format!(" from {s}")).unwrap_or_default())
        }
        Some("once") => format!("once at {}", t["at"].as_str().unwrap_or("?")),
        Some("webhook") => {
            let auth = match &t["auth"] {
                Value::String(s) => s.clone(),
                Value::Object(o) => o.keys().next().cloned().unwrap_or_default(),
                _ => "?".into(),
            };
            format!("webhook POST {} (auth {auth})", t["path"].as_str().unwrap_or("?"))
        }
        Some("queue") => match (t["queue"].as_str(), t["subject"].as_str()) {
            (Some(q), _) => format!("queue {} of broker {}", q, t["broker"].as_str().unwrap_or("?")),
            (None, Some(subj)) => {
                format!(
                    "subject {subj} of stream {} on broker {}",
                    t["stream"].as_str().unwrap_or("?"),
                    t["broker"].as_str().unwrap_or("?")
                )
            }
            _ => t.to_string(),
        },
        Some("event") => format!("event on topic {}", t["topic"].as_str().unwrap_or("?")),
        Some("after") => {
            format!("after each run of {} that ends {}", t["task"].as_str().unwrap_or("?"), t["status"].as_str().unwrap_or("succeeded"))
        }
        _ => t.to_string(),
    };
    let mut triggers: Vec<String> = Vec::new();
    if spec["trigger"].is_object() {
        triggers.push(trigger(&spec["trigger"]));
    }
    if let Some(list) = spec["triggers"].as_array() {
        triggers.extend(list.iter().map(trigger));
    }
    let ex = &spec["execution"];
    let execution = format!(
        "timeout {} s, retries {}, concurrency {}, overlap {}, misfire {} (grace {} s), priority {}",
        ex["timeout_seconds"],
        ex["max_retries"],
        ex["concurrency_limit"],
        ex["overlap_policy"].as_str().unwrap_or("skip"),
        ex["misfire_policy"].as_str().unwrap_or("run_once"),
        ex["misfire_grace_seconds"],
        ex["priority"]
    );
    let fires: Vec<String> = next
        .fire_times
        .iter()
        .zip(&next.local_times)
        .map(|(utc, local)| {
            let utc = t(&Some(*utc)).as_str().unwrap_or("").to_string();
            if &utc == local { utc } else { format!("{local} ({utc})") }
        })
        .collect();
    let j = task_json(tk);
    let mut rows = vec![
        ("task", tk.task_id.clone()),
        ("agent", tk.agent_id.clone()),
        ("paused", tk.paused.to_string()),
        ("trigger", if triggers.is_empty() { "none (manual only)".into() } else { triggers.join("; ") }),
        ("execution", execution),
    ];
    if spec["history"].is_object() {
        rows.push(("history", spec["history"].to_string()));
    }
    if let Some(b) = &tk.breaker {
        let cb = &ex["circuit_breaker"];
        rows.push((
            "breaker",
            format!("{}; opens after {} failed run(s) in a row for {} s", breaker_text(b), cb["failure_threshold"], cb["cooldown_seconds"]),
        ));
    }
    let fires: Vec<String> = if next.jittered_times.len() == fires.len() {
        fires.into_iter().zip(&next.jittered_times).map(|(f, j)| format!("{f} fires {}", t(&Some(*j)).as_str().unwrap_or(""))).collect()
    } else {
        fires
    };
    rows.push(("next fires", if fires.is_empty() { "-".into() } else { fires.join(", ") }));
    if !tk.ended.is_empty() {
        rows.push(("ended", tk.ended.clone()));
    }
    // The `ended` row says it already.
    for n in next.notes.iter().filter(|n| tk.ended.is_empty() || !n.starts_with("no slot left")) {
        rows.push(("time", n.clone()));
    }
    rows.push(("last slot", j["last_slot_at"].as_str().unwrap_or("-").to_string()));
    rows.push(("updated", j["updated_at"].as_str().unwrap_or("-").to_string()));
    rows
}

/// A circuit breaker in words: `closed (1 failed run in a row)`, `open
/// until 2026-12-01T08:00:10Z after 3 failed runs in a row (opening 2)`,
/// `half_open: trial run RUN`.
pub fn breaker_text(b: &pb::Breaker) -> String {
    let at = |ts: &Option<prost_types::Timestamp>| t(ts).as_str().unwrap_or("-").to_string();
    match b.phase.as_str() {
        "open" => format!(
            "open until {} after {} failed run(s) in a row (opening {}; the next run after it is a trial)",
            at(&b.open_until),
            b.consecutive_failures,
            b.openings
        ),
        "half_open" => format!("half_open: trial run {} (opening {})", b.trial_run_id, b.openings),
        phase => format!("{phase} ({} failed run(s) in a row, {} opening(s) so far)", b.consecutive_failures, b.openings),
    }
}

fn lag_json(l: &Option<pb::LagStats>) -> Value {
    let l = (*l).unwrap_or_default();
    json!({"count": l.count, "p50_ms": l.p50_ms, "p99_ms": l.p99_ms, "max_ms": l.max_ms})
}

fn task_stats_json(s: &pb::TaskStats) -> Value {
    json!({
        "task_id": s.task_id,
        "fired": s.fired,
        "succeeded": s.succeeded,
        "failed": s.failed,
        "timed_out": s.timed_out,
        "cancelled": s.cancelled,
        "in_progress": s.in_progress,
        "retried": s.retried,
        "attempts": s.attempts,
        "skipped": s.skipped.iter().collect::<std::collections::BTreeMap<_, _>>(),
        "dispatch_lag": lag_json(&s.dispatch_lag),
        "start_lag": lag_json(&s.start_lag),
    })
}

/// `stats -o json`.
pub fn stats_json(s: &pb::SchedulingStats) -> Value {
    json!({
        "window_start": t(&s.window_start),
        "window_end": t(&s.window_end),
        "tasks": s.tasks.iter().map(task_stats_json).collect::<Vec<_>>(),
        "total": s.total.as_ref().map(task_stats_json),
    })
}

/// `stats` as a table: one row per task, then the total.
pub fn stats_table(s: &pb::SchedulingStats) {
    let lag = |l: &Option<pb::LagStats>| match l {
        Some(l) if l.count > 0 => format!("{}/{}/{}", l.p50_ms, l.p99_ms, l.max_ms),
        _ => "-".into(),
    };
    let row = |name: &str, x: &pb::TaskStats| {
        let skipped: Vec<String> =
            x.skipped.iter().collect::<std::collections::BTreeMap<_, _>>().iter().map(|(k, v)| format!("{k}:{v}")).collect();
        vec![
            name.to_string(),
            x.fired.to_string(),
            x.succeeded.to_string(),
            x.failed.to_string(),
            x.timed_out.to_string(),
            x.cancelled.to_string(),
            x.in_progress.to_string(),
            x.retried.to_string(),
            if skipped.is_empty() { "-".into() } else { skipped.join(",") },
            lag(&x.dispatch_lag),
            lag(&x.start_lag),
        ]
    };
    let mut rows: Vec<Vec<String>> = s.tasks.iter().map(|x| row(&x.task_id, x)).collect();
    if s.tasks.len() > 1
        && let Some(total) = &s.total
    {
        rows.push(row("(all)", total));
    }
    let at = |ts: &Option<Timestamp>| {
        punchclock_proto::time::from_timestamp_opt(ts.as_ref()).map_or("?".into(), |d| d.to_rfc3339_opts(SecondsFormat::Secs, true))
    };
    println!("runs with slots from {} to {}; lag in ms as p50/p99/max", at(&s.window_start), at(&s.window_end));
    table(&["TASK", "FIRED", "OK", "FAILED", "TIMEOUT", "CANCELLED", "ACTIVE", "RETRIED", "SKIPPED", "DISPATCH_LAG", "START_LAG"], rows);
}

/// A notification as JSON.
pub fn notification_json(n: &pb::Notification) -> Value {
    json!({
        "id": n.id,
        "event": n.event,
        "sink": n.sink,
        "task_id": n.task_id,
        "run_id": opt_str(&n.run_id),
        "status": n.status,
        "attempts": n.attempts,
        "next_attempt_at": t(&n.next_attempt_at),
        "last_error": opt_str(&n.last_error),
        "created_at": t(&n.created_at),
        "delivered_at": t(&n.delivered_at),
        "updated_at": t(&n.updated_at),
    })
}

/// A backfill as JSON (`-o json`).
pub fn backfill_json(b: &pb::Backfill) -> Value {
    json!({
        "id": b.id, "task_id": b.task_id, "from": t(&b.from), "to": t(&b.to),
        "reprocess": b.reprocess, "max_concurrent": b.max_concurrent, "order": b.order, "on_failure": b.on_failure,
        "state": b.state, "cursor": t(&b.cursor),
        "planned": b.planned, "created": b.created, "left": b.left, "succeeded": b.succeeded, "failed": b.failed,
        "other": b.other, "remaining": b.remaining, "in_flight": b.in_flight, "reason": b.reason,
        "created_at": t(&b.created_at), "updated_at": t(&b.updated_at),
    })
}

/// A backfill in a line: `bf-nightly-1765 nightly running: 120/720 planned
/// created, 100 left, 118 succeeded, 0 failed, 500 remaining (cursor ...)`.
pub fn backfill_text(b: &pb::Backfill) -> String {
    let reason = if b.reason.is_empty() { String::new() } else { format!(" — {}", b.reason) };
    format!(
        "{} {} {}: {} planned, {} created, {} left alone, {} succeeded, {} failed, {} other, {} remaining, {} live (cursor {}){reason}",
        b.id,
        b.task_id,
        b.state,
        b.planned,
        b.created,
        b.left,
        b.succeeded,
        b.failed,
        b.other,
        b.remaining,
        b.in_flight.len(),
        t(&b.cursor).as_str().unwrap_or("-"),
    )
}
