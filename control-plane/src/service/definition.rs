//! The typed task definition (`pb::TaskDefinition`) ⇄ the task file's
//! document. A typed definition becomes the same JSON a task file holds and
//! goes through the one validation path ([`crate::model::TaskSpec::from_json`]),
//! so both forms have the same defaults, rules and error paths. A stored
//! task becomes two typed definitions: as applied (`Task.definition`:
//! the fields written, [`applied_definition`]) and effective
//! (`Task.effective`: every default filled, [`effective_definition`]).
//!
//! The round trip is exact: for a valid typed definition `d`,
//! `applied_definition` of the spec and written fields of
//! `definition_json(d)` is `d` again, and a task file's document and the
//! typed definition made of it have the same written fields
//! ([`TaskSpec::written_fields`]), so applying either after the other is
//! `unchanged`.

use chrono::{DateTime, Utc};
use punchclock_proto::time::{from_timestamp, to_timestamp};
use punchclock_proto::v1 as pb;
use serde_json::{Map, Value, json};

use crate::error::{Error, Result};
use crate::model::TaskSpec;
use crate::model::task::{MisfirePolicy, OnResourceBusy, OverlapPolicy, TriggerSpec};

/// The task file document of a typed definition (only what is set).
///
/// Errors: [`Error::InvalidArgument`] naming `triggers[i]` for a trigger
/// with no kind, and a timestamp's field when it is malformed.
pub fn definition_json(d: &pb::TaskDefinition) -> Result<Value> {
    let mut o = Map::new();
    o.insert("task_id".into(), d.task_id.clone().into());
    o.insert("agent_id".into(), d.agent_id.clone().into());
    if !d.description.is_empty() {
        o.insert("description".into(), d.description.clone().into());
    }
    if !d.triggers.is_empty() {
        let mut list = Vec::with_capacity(d.triggers.len());
        for (i, t) in d.triggers.iter().enumerate() {
            let path = |f: &str| format!("triggers[{i}].{f}");
            let v = match &t.kind {
                None => {
                    return Err(Error::invalid(
                        format!("triggers[{i}]"),
                        "no trigger kind set (cron, interval, once, event, webhook, queue or after)",
                    ));
                }
                Some(pb::trigger::Kind::Cron(c)) => {
                    let mut v = json!({"type": "cron", "expr": c.expr});
                    if !c.timezone.is_empty() {
                        v["timezone"] = c.timezone.clone().into();
                    }
                    if c.jitter_seconds > 0 {
                        v["jitter_seconds"] = c.jitter_seconds.into();
                    }
                    if let Some(at) = &c.start_at {
                        v["start_at"] = instant_json(at, path("start_at"))?;
                    }
                    time_fields_json(&mut v, &c.jitter, c.dst.as_ref(), c.end_at.as_ref(), c.max_runs, path)?;
                    v
                }
                Some(pb::trigger::Kind::Interval(iv)) => {
                    let mut v = json!({"type": "interval"});
                    if !iv.every.is_empty() {
                        v["every"] = iv.every.clone().into();
                    }
                    if let Some(s) = iv.every_seconds {
                        v["every_seconds"] = s.into();
                    }
                    if let Some(t) = &iv.start_at {
                        let at = from_timestamp(t).ok_or_else(|| Error::invalid(path("start_at"), "not a valid timestamp"))?;
                        v["start_at"] = at.to_rfc3339().into();
                    }
                    if iv.jitter_seconds > 0 {
                        v["jitter_seconds"] = iv.jitter_seconds.into();
                    }
                    if iv.wall_clock {
                        v["wall_clock"] = true.into();
                    }
                    if !iv.timezone.is_empty() {
                        v["timezone"] = iv.timezone.clone().into();
                    }
                    time_fields_json(&mut v, &iv.jitter, iv.dst.as_ref(), iv.end_at.as_ref(), iv.max_runs, path)?;
                    v
                }
                Some(pb::trigger::Kind::Once(once)) => {
                    let at = once
                        .at
                        .as_ref()
                        .ok_or_else(|| Error::invalid(path("at"), "required"))
                        .and_then(|t| from_timestamp(t).ok_or_else(|| Error::invalid(path("at"), "not a valid timestamp")))?;
                    json!({"type": "once", "at": at.to_rfc3339()})
                }
                Some(pb::trigger::Kind::Event(ev)) => json!({"type": "event", "topic": ev.topic}),
                Some(pb::trigger::Kind::Webhook(w)) => webhook_json(w, &path)?,
                Some(pb::trigger::Kind::Queue(q)) => {
                    let mut v = json!({"type": "queue", "broker": q.broker});
                    for (k, x) in [("queue", &q.queue), ("subject", &q.subject), ("stream", &q.stream), ("format", &q.format)] {
                        if !x.is_empty() {
                            v[k] = x.clone().into();
                        }
                    }
                    if q.max_pending > 0 {
                        v["max_pending"] = q.max_pending.into();
                    }
                    if q.prefetch > 0 {
                        v["prefetch"] = q.prefetch.into();
                    }
                    if q.max_body_bytes > 0 {
                        v["max_body_bytes"] = q.max_body_bytes.into();
                    }
                    if !q.dedup_ttl.is_empty() {
                        v["dedup"] = json!({"ttl": q.dedup_ttl});
                    }
                    v
                }
                Some(pb::trigger::Kind::After(a)) => {
                    let mut v = json!({"type": "after", "task": a.task});
                    if !a.status.is_empty() {
                        v["status"] = a.status.clone().into();
                    }
                    v
                }
            };
            list.push(v);
        }
        o.insert("triggers".into(), Value::Array(list));
    }
    if let Some(e) = &d.execution {
        o.insert("execution".into(), execution_json(e)?);
    }
    // An empty context is no context (a task file's `context: {}`).
    if let Some(c) = d.context.as_ref().filter(|c| !c.fields.is_empty()) {
        o.insert("context".into(), struct_json_checked(c, "context")?);
    }
    if let Some(n) = &d.notify {
        let mut v = Map::new();
        for (k, list) in [
            ("on_success", &n.on_success),
            ("on_failure", &n.on_failure),
            ("on_skipped", &n.on_skipped),
            ("on_breaker_open", &n.on_breaker_open),
        ] {
            if !list.is_empty() {
                v.insert(k.into(), list.clone().into());
            }
        }
        o.insert("notify".into(), Value::Object(v));
    }
    if !d.labels.is_empty() {
        o.insert("labels".into(), json!(d.labels));
    }
    if let Some(h) = &d.history {
        let mut v = Map::new();
        if let Some(k) = h.keep_last {
            v.insert("keep_last".into(), k.into());
        }
        if !h.max_age.is_empty() {
            v.insert("max_age".into(), h.max_age.clone().into());
        }
        o.insert("history".into(), Value::Object(v));
    }
    Ok(Value::Object(o))
}

fn webhook_json(w: &pb::WebhookTrigger, path: &dyn Fn(&str) -> String) -> Result<Value> {
    let mut v = json!({"type": "webhook", "path": w.path});
    match &w.auth {
        Some(pb::webhook_trigger::Auth::Hmac(h)) => {
            let mut a = json!({"secret_file": h.secret_file, "header": h.header});
            for (k, x) in
                [("algorithm", &h.algorithm), ("encoding", &h.encoding), ("prefix", &h.prefix), ("timestamp_header", &h.timestamp_header)]
            {
                if !x.is_empty() {
                    a[k] = x.clone().into();
                }
            }
            if h.tolerance_seconds > 0 {
                a["tolerance_seconds"] = h.tolerance_seconds.into();
            }
            v["auth"] = json!({ "hmac": a });
        }
        Some(pb::webhook_trigger::Auth::Bearer(b)) => v["auth"] = json!({"bearer": {"token_file": b.token_file}}),
        Some(pb::webhook_trigger::Auth::None(_)) => v["auth"] = "none".into(),
        // Left out: validation says auth is required.
        None => {}
    }
    if !w.dedup_header.is_empty() || !w.dedup_body_field.is_empty() || !w.dedup_ttl.is_empty() {
        let mut d = Map::new();
        for (k, x) in [("header", &w.dedup_header), ("body_field", &w.dedup_body_field), ("ttl", &w.dedup_ttl)] {
            if !x.is_empty() {
                d.insert(k.into(), x.clone().into());
            }
        }
        v["dedup"] = Value::Object(d);
    }
    match (w.no_headers, w.headers.is_empty()) {
        (true, false) => return Err(Error::invalid(path("no_headers"), "give headers or no_headers, not both")),
        (true, true) => v["headers"] = json!([]),
        (false, false) => v["headers"] = w.headers.clone().into(),
        (false, true) => {}
    }
    if w.max_body_bytes > 0 {
        v["max_body_bytes"] = w.max_body_bytes.into();
    }
    Ok(v)
}

/// A stored webhook trigger as its typed message.
fn webhook_pb(w: &crate::model::trigger::WebhookTrigger) -> pb::WebhookTrigger {
    use crate::model::trigger::{HmacAlgorithm, SignatureEncoding, WebhookAuth};
    let auth = match &w.auth {
        WebhookAuth::Hmac(h) => pb::webhook_trigger::Auth::Hmac(pb::HmacAuth {
            secret_file: h.secret_file.clone(),
            header: h.header.clone(),
            algorithm: match h.algorithm {
                HmacAlgorithm::Sha256 => "sha256",
                HmacAlgorithm::Sha1 => "sha1",
            }
            .into(),
            encoding: match h.encoding {
                SignatureEncoding::Hex => "hex",
                SignatureEncoding::Base64 => "base64",
            }
            .into(),
            prefix: h.prefix.clone(),
            timestamp_header: h.timestamp_header.clone().unwrap_or_default(),
            tolerance_seconds: h.tolerance_seconds,
        }),
        WebhookAuth::Bearer(b) => pb::webhook_trigger::Auth::Bearer(pb::BearerAuth { token_file: b.token_file.clone() }),
        WebhookAuth::None => pb::webhook_trigger::Auth::None(true),
    };
    let d = w.dedup.as_ref();
    pb::WebhookTrigger {
        path: w.path.clone(),
        auth: Some(auth),
        dedup_header: d.and_then(|d| d.header.clone()).unwrap_or_default(),
        dedup_body_field: d.and_then(|d| d.body_field.clone()).unwrap_or_default(),
        dedup_ttl: d.and_then(|d| d.ttl.clone()).unwrap_or_default(),
        headers: w.headers.clone().unwrap_or_default(),
        max_body_bytes: w.max_body_bytes.unwrap_or(0),
        no_headers: w.headers.as_ref().is_some_and(Vec::is_empty),
    }
}

/// A double of the typed definition as a JSON number.
///
/// Errors: `InvalidArgument` on `field` for NaN and infinities, which a
/// task file cannot hold either (they were dropped, silently).
fn finite(x: f64, field: &str) -> Result<serde_json::Number> {
    serde_json::Number::from_f64(x)
        .ok_or_else(|| Error::invalid(field, format!("{x} is not a number a task file can hold (NaN or infinite)")))
}

fn execution_json(e: &pb::Execution) -> Result<Value> {
    let mut v = Map::new();
    let mut put = |k: &str, x: Option<Value>| {
        if let Some(x) = x {
            v.insert(k.into(), x);
        }
    };
    put("timeout_seconds", e.timeout_seconds.map(Value::from));
    put("max_retries", e.max_retries.map(Value::from));
    put("concurrency_limit", e.concurrency_limit.map(Value::from));
    put("misfire_grace_seconds", e.misfire_grace_seconds.map(Value::from));
    put("priority", e.priority.map(Value::from));
    put("start_timeout_seconds", e.start_timeout_seconds.map(Value::from));
    put(
        "overlap_policy",
        match pb::OverlapPolicy::try_from(e.overlap_policy).unwrap_or_default() {
            pb::OverlapPolicy::Unspecified => None,
            pb::OverlapPolicy::Skip => Some("skip".into()),
            pb::OverlapPolicy::Queue => Some("queue".into()),
            pb::OverlapPolicy::CancelRunning => Some("cancel_running".into()),
        },
    );
    put(
        "misfire_policy",
        match pb::MisfirePolicy::try_from(e.misfire_policy).unwrap_or_default() {
            pb::MisfirePolicy::Unspecified => None,
            pb::MisfirePolicy::RunOnce => Some("run_once".into()),
            pb::MisfirePolicy::RunAll => Some("run_all".into()),
            pb::MisfirePolicy::Skip => Some("skip".into()),
        },
    );
    if let Some(b) = &e.retry_backoff {
        let mut r = Map::new();
        for (k, x) in [("base_seconds", b.base_seconds), ("cap_seconds", b.cap_seconds), ("jitter_seconds", b.jitter_seconds)] {
            if let Some(x) = x {
                r.insert(k.into(), Value::Number(finite(x, &format!("execution.retry_backoff.{k}"))?));
            }
        }
        put("retry_backoff", Some(Value::Object(r)));
    }
    if let Some(s) = &e.selector {
        // No labels is `selector: {}` (the file's `labels: {}` is the same).
        put("selector", Some(if s.labels.is_empty() { json!({}) } else { json!({"labels": s.labels}) }));
    }
    if let Some(cb) = &e.circuit_breaker {
        put("circuit_breaker", Some(json!({"failure_threshold": cb.failure_threshold, "cooldown_seconds": cb.cooldown_seconds})));
    }
    if !e.resources.is_empty() {
        let uses = e
            .resources
            .iter()
            .map(|r| {
                let mut u = json!({"name": r.name});
                if let Some(n) = r.units {
                    u["units"] = n.into();
                }
                // 0 is the default (tokens has no presence).
                if r.tokens > 0 {
                    u["tokens"] = r.tokens.into();
                }
                u
            })
            .collect::<Vec<_>>();
        put("resources", Some(Value::Array(uses)));
    }
    put(
        "on_resource_busy",
        match pb::OnResourceBusy::try_from(e.on_resource_busy).unwrap_or_default() {
            pb::OnResourceBusy::Unspecified => None,
            pb::OnResourceBusy::Wait => Some("wait".into()),
            pb::OnResourceBusy::Skip => Some("skip".into()),
        },
    );
    put("rate_limit_max_wait_seconds", e.rate_limit_max_wait_seconds.map(Value::from));
    if let Some(l) = &e.limits {
        let mut m = Map::new();
        if let Some(b) = l.memory_max_bytes {
            m.insert("memory_max".into(), b.into());
        }
        if let Some(c) = l.cpu {
            m.insert("cpu".into(), Value::Number(finite(c, "execution.limits.cpu")?));
        }
        if let Some(n) = l.pids_max {
            m.insert("pids_max".into(), n.into());
        }
        put("limits", Some(Value::Object(m)));
    }
    Ok(Value::Object(v))
}

/// A stored task's definition as applied, typed (`Task.definition`): the
/// fields of `written` (the task's [`TaskSpec::written_fields`]) with the
/// values `spec` holds, every other field unset; `context` when the spec
/// has one.
pub fn applied_definition(spec: &TaskSpec, written: &Value) -> pb::TaskDefinition {
    let mut d = typed(spec, None);
    let has = |w: &Value, k: &str| w.get(k).is_some();
    if !has(written, "description") {
        d.description.clear();
    }
    let listed = written.get("triggers").and_then(Value::as_array);
    for (i, t) in d.triggers.iter_mut().enumerate() {
        let w = listed.and_then(|l| l.get(i)).unwrap_or(&Value::Null);
        match &mut t.kind {
            Some(pb::trigger::Kind::Queue(q)) => {
                if !has(w, "format") {
                    q.format.clear();
                }
                if !has(w, "max_pending") {
                    q.max_pending = 0;
                }
            }
            Some(pb::trigger::Kind::After(a)) if !has(w, "status") => a.status.clear(),
            Some(pb::trigger::Kind::Webhook(hook)) => {
                let written_hmac = w.get("auth").and_then(|a| a.get("hmac")).unwrap_or(&Value::Null);
                if let Some(pb::webhook_trigger::Auth::Hmac(h)) = &mut hook.auth {
                    if !has(written_hmac, "algorithm") {
                        h.algorithm.clear();
                    }
                    if !has(written_hmac, "encoding") {
                        h.encoding.clear();
                    }
                    if !has(written_hmac, "tolerance_seconds") {
                        h.tolerance_seconds = 0;
                    }
                }
            }
            // Every other field of a trigger is kept only when written.
            _ => {}
        }
    }
    match (written.get("execution"), d.execution.as_mut()) {
        (Some(w), Some(e)) => {
            let keep = |k: &str| has(w, k);
            unset_unless(keep("timeout_seconds"), &mut e.timeout_seconds);
            unset_unless(keep("start_timeout_seconds"), &mut e.start_timeout_seconds);
            unset_unless(keep("max_retries"), &mut e.max_retries);
            unset_unless(keep("concurrency_limit"), &mut e.concurrency_limit);
            unset_unless(keep("misfire_grace_seconds"), &mut e.misfire_grace_seconds);
            unset_unless(keep("priority"), &mut e.priority);
            unset_unless(keep("rate_limit_max_wait_seconds"), &mut e.rate_limit_max_wait_seconds);
            for (k, v) in [
                ("overlap_policy", &mut e.overlap_policy),
                ("misfire_policy", &mut e.misfire_policy),
                ("on_resource_busy", &mut e.on_resource_busy),
            ] {
                if !keep(k) {
                    *v = 0;
                }
            }
            match w.get("retry_backoff") {
                None => e.retry_backoff = None,
                Some(wb) => {
                    if let Some(b) = e.retry_backoff.as_mut() {
                        for (k, v) in [
                            ("base_seconds", &mut b.base_seconds),
                            ("cap_seconds", &mut b.cap_seconds),
                            ("jitter_seconds", &mut b.jitter_seconds),
                        ] {
                            if !has(wb, k) {
                                *v = None;
                            }
                        }
                    }
                }
            }
            let uses = w.get("resources").and_then(Value::as_array);
            for (i, r) in e.resources.iter_mut().enumerate() {
                if !uses.and_then(|u| u.get(i)).is_some_and(|u| has(u, "units")) {
                    r.units = None;
                }
            }
        }
        _ => d.execution = None,
    }
    if !has(written, "notify") {
        d.notify = None;
    }
    if !has(written, "history") {
        d.history = None;
    }
    d
}

fn unset_unless<T>(written: bool, v: &mut Option<T>) {
    if !written {
        *v = None;
    }
}

/// A stored task's effective definition, typed (`Task.effective`): every
/// field with the value in force — the spec's defaults, and those of its
/// triggers (zone UTC, interval anchor the Unix epoch, a webhook's default
/// headers and body limit, a queue's prefetch and body limit) and
/// `history` (the server's `defaults` when the task has none). Dedup of a
/// webhook without `dedup` (the `Idempotency-Key` header when present)
/// and fields with no default (selector, breaker, limits) stay unset.
pub fn effective_definition(spec: &TaskSpec, defaults: &crate::engine::retention::RetentionConfig) -> pb::TaskDefinition {
    typed(spec, Some(defaults))
}

/// `d` as the task file's JSON document ([`definition_json`] of a stored
/// task's typed form, which always converts).
pub fn typed_json(d: &pb::TaskDefinition) -> Value {
    definition_json(d).unwrap_or(Value::Null)
}

/// A DST policy as the API sends it.
fn dst_pb(d: crate::schedule::DstSpec) -> pb::DstPolicy {
    pb::DstPolicy {
        gap: d.gap.map(|g| g.as_str().to_string()).unwrap_or_default(),
        repeat: d.repeat.map(|r| r.as_str().to_string()).unwrap_or_default(),
    }
}

/// An instant of a typed definition as the task file writes it, or an
/// error at `field`.
fn instant_json(t: &prost_types::Timestamp, field: String) -> Result<Value> {
    let at = from_timestamp(t).ok_or_else(|| Error::invalid(field, "not a valid timestamp"))?;
    Ok(at.to_rfc3339().into())
}

/// The fields cron and interval triggers share — `jitter`, `dst`,
/// `end_at`, `max_runs` — written into `v` as the task file has them
/// (their values are checked when the document is read).
fn time_fields_json(
    v: &mut Value,
    jitter: &str,
    dst: Option<&pb::DstPolicy>,
    end_at: Option<&prost_types::Timestamp>,
    max_runs: Option<u64>,
    path: impl Fn(&str) -> String,
) -> Result<()> {
    if !jitter.is_empty() {
        v["jitter"] = jitter.into();
    }
    if let Some(d) = dst {
        let mut o = Map::new();
        if !d.gap.is_empty() {
            o.insert("gap".into(), d.gap.clone().into());
        }
        if !d.repeat.is_empty() {
            o.insert("repeat".into(), d.repeat.clone().into());
        }
        v["dst"] = Value::Object(o);
    }
    if let Some(t) = end_at {
        v["end_at"] = instant_json(t, path("end_at"))?;
    }
    if let Some(n) = max_runs {
        v["max_runs"] = n.into();
    }
    Ok(())
}

/// A duration as `history.max_age` writes it: `30d`, `12h`, `90m`, `45s`.
fn duration_text(seconds: i64) -> String {
    match seconds {
        s if s > 0 && s % 86_400 == 0 => format!("{}d", s / 86_400),
        s if s > 0 && s % 3600 == 0 => format!("{}h", s / 3600),
        s if s > 0 && s % 60 == 0 => format!("{}m", s / 60),
        s => format!("{}s", s.max(0)),
    }
}

/// The typed form of a spec: every field the spec holds (`trigger` and
/// `triggers` both become `triggers`); with `fill`, the defaults that are
/// not in the spec too ([`effective_definition`]).
fn typed(spec: &TaskSpec, fill: Option<&crate::engine::retention::RetentionConfig>) -> pb::TaskDefinition {
    use crate::model::trigger::{DEFAULT_EVENT_HEADERS, EventFormat};
    let filled = fill.is_some();
    let triggers = spec
        .all_triggers()
        .into_iter()
        .map(|t| pb::Trigger {
            kind: Some(match t {
                TriggerSpec::Cron(c) => pb::trigger::Kind::Cron(pb::CronTrigger {
                    expr: c.expr.clone(),
                    timezone: c.timezone.clone().or_else(|| filled.then(|| "UTC".to_string())).unwrap_or_default(),
                    jitter_seconds: c.jitter_seconds,
                    jitter: c.jitter.map(|_| "auto".to_string()).unwrap_or_default(),
                    dst: c.dst.map(dst_pb),
                    start_at: c.start_at.map(to_timestamp),
                    end_at: c.end_at.map(to_timestamp),
                    max_runs: c.max_runs,
                }),
                TriggerSpec::Interval(iv) => pb::trigger::Kind::Interval(pb::IntervalTrigger {
                    every: iv.every.clone().unwrap_or_default(),
                    every_seconds: iv.every_seconds,
                    start_at: iv.start_at.or(filled.then_some(DateTime::<Utc>::UNIX_EPOCH)).map(to_timestamp),
                    jitter_seconds: iv.jitter_seconds,
                    jitter: iv.jitter.map(|_| "auto".to_string()).unwrap_or_default(),
                    wall_clock: iv.wall_clock,
                    timezone: iv.timezone.clone().or_else(|| (filled && iv.wall_clock).then(|| "UTC".to_string())).unwrap_or_default(),
                    dst: iv.dst.map(dst_pb),
                    end_at: iv.end_at.map(to_timestamp),
                    max_runs: iv.max_runs,
                }),
                TriggerSpec::Once(o) => pb::trigger::Kind::Once(pb::OnceTrigger { at: Some(to_timestamp(o.at)) }),
                TriggerSpec::Event(e) => pb::trigger::Kind::Event(pb::EventTrigger { topic: e.topic.clone() }),
                TriggerSpec::Webhook(w) => {
                    let mut hook = webhook_pb(w);
                    if filled {
                        if w.headers.is_none() {
                            hook.headers = DEFAULT_EVENT_HEADERS.iter().map(|h| h.to_string()).collect();
                        }
                        hook.max_body_bytes = w.max_body();
                    }
                    pb::trigger::Kind::Webhook(hook)
                }
                TriggerSpec::Queue(q) => pb::trigger::Kind::Queue(pb::QueueTrigger {
                    broker: q.broker.clone(),
                    queue: q.queue.clone().unwrap_or_default(),
                    subject: q.subject.clone().unwrap_or_default(),
                    stream: q.stream.clone().unwrap_or_default(),
                    format: match q.format {
                        EventFormat::Json => "json",
                        EventFormat::Raw => "raw",
                    }
                    .into(),
                    max_pending: q.max_pending,
                    prefetch: if filled { q.prefetch() } else { q.prefetch.unwrap_or(0) },
                    max_body_bytes: if filled { q.max_body() } else { q.max_body_bytes.unwrap_or(0) },
                    dedup_ttl: q.dedup.as_ref().and_then(|d| d.ttl.clone()).unwrap_or_default(),
                }),
                TriggerSpec::After(a) => {
                    pb::trigger::Kind::After(pb::AfterTrigger { task: a.task.clone(), status: a.status.as_str().into() })
                }
            }),
        })
        .collect();
    let ex = &spec.execution;
    let execution = pb::Execution {
        timeout_seconds: Some(ex.timeout_seconds),
        max_retries: Some(ex.max_retries),
        retry_backoff: Some(pb::RetryBackoff {
            base_seconds: Some(ex.retry_backoff.base_seconds),
            cap_seconds: Some(ex.retry_backoff.cap_seconds),
            jitter_seconds: Some(ex.retry_backoff.jitter_seconds),
        }),
        concurrency_limit: Some(ex.concurrency_limit),
        overlap_policy: match ex.overlap_policy {
            OverlapPolicy::Skip => pb::OverlapPolicy::Skip,
            OverlapPolicy::Queue => pb::OverlapPolicy::Queue,
            OverlapPolicy::CancelRunning => pb::OverlapPolicy::CancelRunning,
        } as i32,
        misfire_policy: match ex.misfire_policy {
            MisfirePolicy::RunOnce => pb::MisfirePolicy::RunOnce,
            MisfirePolicy::RunAll => pb::MisfirePolicy::RunAll,
            MisfirePolicy::Skip => pb::MisfirePolicy::Skip,
        } as i32,
        misfire_grace_seconds: Some(ex.misfire_grace_seconds),
        priority: Some(ex.priority),
        start_timeout_seconds: Some(ex.start_timeout_seconds),
        selector: ex.selector.as_ref().map(|s| pb::Selector { labels: s.labels.clone().into_iter().collect() }),
        circuit_breaker: ex
            .circuit_breaker
            .map(|cb| pb::CircuitBreakerSpec { failure_threshold: cb.failure_threshold, cooldown_seconds: cb.cooldown_seconds }),
        resources: ex.resources.iter().map(|r| pb::ResourceUse { name: r.name.clone(), units: Some(r.units), tokens: r.tokens }).collect(),
        on_resource_busy: match ex.on_resource_busy {
            OnResourceBusy::Wait => pb::OnResourceBusy::Wait,
            OnResourceBusy::Skip => pb::OnResourceBusy::Skip,
        } as i32,
        rate_limit_max_wait_seconds: Some(i64::try_from(ex.rate_limit_max_wait_seconds).unwrap_or(i64::MAX)),
        limits: ex.limits.map(|l| pb::ExecutionLimits { memory_max_bytes: l.memory_max, cpu: l.cpu, pids_max: l.pids_max }),
    };
    let history = match (fill, &spec.history) {
        (Some(defaults), h) => Some(pb::History {
            keep_last: Some(h.as_ref().and_then(|h| h.keep_last).unwrap_or(defaults.keep_last)),
            max_age: h.as_ref().and_then(|h| h.max_age.clone()).unwrap_or_else(|| duration_text(defaults.max_age.num_seconds())),
        }),
        (None, h) => h.as_ref().map(|h| pb::History { keep_last: h.keep_last, max_age: h.max_age.clone().unwrap_or_default() }),
    };
    pb::TaskDefinition {
        task_id: spec.task_id.clone(),
        agent_id: spec.agent_id.clone(),
        description: spec.description.clone().unwrap_or_default(),
        triggers,
        execution: Some(execution),
        context: (!spec.context.is_empty()).then(|| json_struct(&spec.context)),
        notify: match &spec.notify {
            Some(n) => Some(pb::Notify {
                on_success: n.on_success.clone(),
                on_failure: n.on_failure.clone(),
                on_skipped: n.on_skipped.clone(),
                on_breaker_open: n.on_breaker_open.clone(),
            }),
            None => filled.then(pb::Notify::default),
        },
        history,
        labels: spec.labels.clone().into_iter().collect(),
    }
}

/// `google.protobuf.Struct` → a JSON object.
pub fn struct_json(s: &prost_types::Struct) -> Value {
    Value::Object(s.fields.iter().map(|(k, v)| (k.clone(), value_json(v))).collect())
}

fn value_json(v: &prost_types::Value) -> Value {
    use prost_types::value::Kind;
    match &v.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::NumberValue(n)) => {
            // Whole numbers stay integers (a Struct has only doubles).
            if n.fract() == 0.0 && n.abs() < 9.007_199_254_740_992e15 {
                Value::from(*n as i64)
            } else {
                serde_json::Number::from_f64(*n).map_or(Value::Null, Value::Number)
            }
        }
        Some(Kind::StringValue(s)) => Value::String(s.clone()),
        Some(Kind::BoolValue(b)) => Value::Bool(*b),
        Some(Kind::StructValue(s)) => struct_json(s),
        Some(Kind::ListValue(l)) => Value::Array(l.values.iter().map(value_json).collect()),
    }
}

/// [`struct_json`], refusing what JSON cannot hold.
///
/// Errors: `InvalidArgument` naming the first NaN or infinite number
/// (`context.params.x`), which a task file cannot hold either.
fn struct_json_checked(s: &prost_types::Struct, field: &str) -> Result<Value> {
    fn check(v: &prost_types::Value, path: &str) -> Result<()> {
        use prost_types::value::Kind;
        match &v.kind {
            Some(Kind::NumberValue(n)) => finite(*n, path).map(|_| ()),
            Some(Kind::StructValue(s)) => s.fields.iter().try_for_each(|(k, v)| check(v, &format!("{path}.{k}"))),
            Some(Kind::ListValue(l)) => l.values.iter().enumerate().try_for_each(|(i, v)| check(v, &format!("{path}[{i}]"))),
            _ => Ok(()),
        }
    }
    s.fields.iter().try_for_each(|(k, v)| check(v, &format!("{field}.{k}")))?;
    Ok(struct_json(s))
}

/// A JSON object → `google.protobuf.Struct` (numbers become doubles).
pub fn json_struct(m: &Map<String, Value>) -> prost_types::Struct {
    prost_types::Struct { fields: m.iter().map(|(k, v)| (k.clone(), json_value(v))).collect() }
}

fn json_value(v: &Value) -> prost_types::Value {
    use prost_types::value::Kind;
    let kind = match v {
        Value::Null => Kind::NullValue(0),
        Value::Bool(b) => Kind::BoolValue(*b),
        Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        Value::String(s) => Kind::StringValue(s.clone()),
        Value::Array(a) => Kind::ListValue(prost_types::ListValue { values: a.iter().map(json_value).collect() }),
        Value::Object(o) => Kind::StructValue(json_struct(o)),
    };
    prost_types::Value { kind: Some(kind) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Definition, TaskRecord};

    /// Every field of a task file set (two tasks: the alternatives of a
    /// webhook's auth, of a queue's broker kind, of an interval's period).
    pub(crate) fn full_files() -> Vec<Value> {
        vec![
            json!({"task_id": "full_a", "agent_id": "report_agent", "description": "every field",
                "labels": {"team": "growth", "tier": "1"},
                "triggers": [
                    {"type": "cron", "expr": "0 30 8 * * *", "timezone": "Asia/Shanghai", "jitter_seconds": 5},
                    {"type": "interval", "every": "10m", "start_at": "2026-01-01T08:00:00+08:00", "jitter_seconds": 3},
                    {"type": "once", "at": "2027-01-01T00:00:00Z"},
                    {"type": "event", "topic": "data.updated"},
                    {"type": "webhook", "path": "/hooks/full-a",
                     "auth": {"hmac": {"secret_file": "/etc/punchclock/hook.secret", "header": "X-Signature", "algorithm": "sha1",
                              "encoding": "base64", "prefix": "v1=", "timestamp_header": "X-Timestamp", "tolerance_seconds": 120}},
                     "dedup": {"header": "X-Delivery", "ttl": "2h"}, "headers": ["X-Request-Id", "User-Agent"], "max_body_bytes": 65536},
                    {"type": "queue", "broker": "rabbit", "queue": "reports", "format": "raw", "max_pending": 50, "prefetch": 10,
                     "max_body_bytes": 4096, "dedup": {"ttl": "7d"}},
                    {"type": "after", "task": "full_b", "status": "any"}],
                "execution": {"timeout_seconds": 600, "max_retries": 3, "concurrency_limit": 2, "overlap_policy": "queue",
                    "misfire_policy": "run_all", "misfire_grace_seconds": 120, "priority": 7, "start_timeout_seconds": 900,
                    "retry_backoff": {"base_seconds": 1.5, "cap_seconds": 30, "jitter_seconds": 0.25},
                    "selector": {"labels": {"zone": "a"}}, "circuit_breaker": {"failure_threshold": 3, "cooldown_seconds": 60},
                    "resources": ["search", {"name": "llm", "units": 2, "tokens": 4000}], "on_resource_busy": "skip",
                    "rate_limit_max_wait_seconds": 600, "limits": {"memory_max": "512Mi", "cpu": 0.5, "pids_max": 64}},
                "context": {"params": {"region": "cn-north", "n": 7, "x": 1.5, "list": [true, null, "s"]}, "doc": {"k": "v"}},
                "notify": {"on_success": ["webhook://report-sink"], "on_failure": ["webhook://alert"],
                           "on_skipped": ["https://example.com/skipped"], "on_breaker_open": ["webhook://alert"]},
                "history": {"keep_last": 10, "max_age": "7d"}}),
            json!({"task_id": "full_b", "agent_id": "report_agent",
                "trigger": {"type": "webhook", "path": "/hooks/full-b", "auth": {"bearer": {"token_file": "/etc/punchclock/hook.token"}},
                            "dedup": {"body_field": "data.id"}, "headers": []},
                "execution": {"limits": {"memory_max": 8388608}, "resources": [{"name": "search", "units": 1}],
                              "selector": {}, "retry_backoff": {}},
                "notify": {}, "history": {}}),
            json!({"task_id": "full_c", "agent_id": "report_agent",
                "triggers": [{"type": "interval", "every_seconds": 90},
                             {"type": "queue", "broker": "nats", "subject": "data.>", "stream": "DATA", "format": "json"},
                             {"type": "webhook", "path": "/hooks/full-c", "auth": "none"},
                             {"type": "after", "task": "full_a", "status": "succeeded"}],
                "execution": {}}),
            json!({"task_id": "full_d", "agent_id": "report_agent",
                "trigger": {"type": "cron", "expr": "0 30 2 * * *", "timezone": "Europe/Berlin", "jitter": "auto",
                            "dst": {"gap": "skip", "repeat": "both"}, "start_at": "2026-01-01T00:00:00Z",
                            "end_at": "2036-01-01T00:00:00Z", "max_runs": 100}}),
            json!({"task_id": "full_e", "agent_id": "report_agent",
                "trigger": {"type": "interval", "every": "1d", "start_at": "2026-03-27T08:00:00Z", "wall_clock": true,
                            "timezone": "Europe/Berlin", "dst": {"gap": "shift"}, "jitter": "auto",
                            "end_at": "2036-01-01T00:00:00Z", "max_runs": 5}}),
        ]
    }

    /// Only what is required.
    fn minimal() -> Value {
        json!({"task_id": "bare", "agent_id": "report_agent"})
    }

    fn def(doc: &Value) -> Definition {
        Definition::from_json(&doc.to_string()).unwrap_or_else(|e| panic!("{doc}: {e}"))
    }

    /// The typed definition as applied of a document.
    fn typed_of(doc: &Value) -> pb::TaskDefinition {
        let d = def(doc);
        applied_definition(&d.spec, &d.spec.written_fields(&d.applied))
    }

    /// Issue 34, point 11: a typed get-then-apply lost `execution.limits`
    /// (the typed `Execution` had no field for them) and came back with a
    /// dozen defaults filled (and some not), so re-applying it was never
    /// `unchanged`. A task file and the typed definition made of it now
    /// write the same fields; the typed one converts back to itself.
    #[test]
    fn a_task_file_and_its_typed_form_are_one_definition() {
        for doc in full_files().into_iter().chain([minimal()]) {
            let d = def(&doc);
            let written = d.spec.written_fields(&d.applied);
            let typed = applied_definition(&d.spec, &written);
            let again = def(&definition_json(&typed).expect("json"));
            assert_eq!(again.spec.written_fields(&again.applied), written, "{doc}");
            assert!(again.spec.same_meaning(&d.spec), "{doc}");
            assert_eq!(applied_definition(&again.spec, &again.spec.written_fields(&again.applied)), typed, "{doc}");
            // Stored from the file, applied again typed: unchanged.
            let t = "2026-12-01T00:00:00Z".parse().expect("t");
            assert!(TaskRecord::new(d.clone(), t).same_as(&again), "{doc}");
            assert!(TaskRecord::new(again, t).same_as(&d), "{doc}");
        }
        let a = typed_of(&full_files()[0]);
        let limits = a.execution.as_ref().and_then(|e| e.limits).expect("limits");
        assert_eq!(limits, pb::ExecutionLimits { memory_max_bytes: Some(512 << 20), cpu: Some(0.5), pids_max: Some(64) });
        let Some(pb::trigger::Kind::Queue(q)) = &a.triggers[5].kind else { panic!("queue") };
        assert_eq!((q.max_pending, q.prefetch, q.format.as_str(), q.dedup_ttl.as_str()), (50, 10, "raw", "7d"));
        // Written fields only: nothing of the defaults.
        let bare = typed_of(&minimal());
        assert_eq!(bare, pb::TaskDefinition { task_id: "bare".into(), agent_id: "report_agent".into(), ..Default::default() });
        let c = typed_of(&full_files()[2]);
        assert_eq!(c.execution, Some(pb::Execution::default()), "execution: {{}} is written, nothing in it");
        let Some(pb::trigger::Kind::Queue(q)) = &c.triggers[1].kind else { panic!("queue") };
        assert_eq!((q.max_pending, q.prefetch, q.format.as_str()), (0, 0, "json"));
        let b = typed_of(&full_files()[1]);
        let Some(pb::trigger::Kind::Webhook(w)) = &b.triggers[0].kind else { panic!("webhook") };
        assert!(w.no_headers && w.headers.is_empty(), "headers: [] is not the default headers");
        assert_eq!(b.execution.as_ref().map(|e| e.resources[0].units), Some(Some(1)), "units: 1 was written");
        let a_res = a.execution.as_ref().map(|e| e.resources.clone()).unwrap_or_default();
        assert_eq!((a_res[0].units, a_res[0].tokens), (None, 0), "a resource named alone");
    }

    /// A typed definition with every field set comes back as applied, and
    /// one with a field whose file value has no typed presence (`no_headers`
    /// with headers) is refused naming it.
    #[test]
    fn a_typed_definition_comes_back_as_it_was_applied() {
        for doc in full_files() {
            let typed = typed_of(&doc);
            let d = def(&definition_json(&typed).expect("json"));
            assert_eq!(applied_definition(&d.spec, &d.spec.written_fields(&d.applied)), typed, "{doc}");
        }
        let mut bad = typed_of(&full_files()[0]);
        let Some(pb::trigger::Kind::Webhook(w)) = &mut bad.triggers[4].kind else { panic!("webhook") };
        w.no_headers = true;
        assert!(definition_json(&bad).expect_err("both").to_string().starts_with("triggers[4].no_headers:"));
        bad.triggers.push(pb::Trigger { kind: None });
        let mut no_kind = typed_of(&minimal());
        no_kind.triggers.push(pb::Trigger { kind: None });
        assert!(definition_json(&no_kind).expect_err("no kind").to_string().starts_with("triggers[0]:"));
    }

    /// Ways of writing the same definition are one definition; ways of
    /// writing different ones are not.
    #[test]
    fn spellings_of_one_definition_are_unchanged_and_changes_are_not() {
        let t = "2026-12-01T00:00:00Z".parse().expect("t");
        let base = json!({"task_id": "t", "agent_id": "a", "trigger": {"type": "cron", "expr": "0 * * * *"},
            "execution": {"limits": {"memory_max": "64Mi"}, "resources": ["search"]}, "description": "d"});
        let stored = TaskRecord::new(def(&base), t);
        let same = [json!({"task_id": "t", "agent_id": "a", "triggers": [{"type": "cron", "expr": "0 * * * *", "jitter_seconds": 0}],
                   "execution": {"limits": {"memory_max": 67108864}, "resources": [{"name": "search", "tokens": 0}]}, "description": "d",
                   "labels": {}, "context": {}})];
        for doc in same {
            assert!(stored.same_as(&def(&doc)), "{doc}");
        }
        let different = [
            // A default written is a field written.
            json!({"task_id": "t", "agent_id": "a", "trigger": {"type": "cron", "expr": "0 * * * *"},
                   "execution": {"limits": {"memory_max": "64Mi"}, "resources": ["search"], "timeout_seconds": 3600}, "description": "d"}),
            json!({"task_id": "t", "agent_id": "a", "trigger": {"type": "cron", "expr": "0 * * * *"},
                   "execution": {"limits": {"memory_max": "64Mi"}, "resources": [{"name": "search", "units": 1}]}, "description": "d"}),
            json!({"task_id": "t", "agent_id": "a", "trigger": {"type": "cron", "expr": "0 * * * *"},
                   "execution": {"limits": {"memory_max": "65Mi"}, "resources": ["search"]}, "description": "d"}),
            json!({"task_id": "t", "agent_id": "a", "trigger": {"type": "cron", "expr": "0 * * * *"},
                   "execution": {"resources": ["search"]}, "description": "d"}),
        ];
        for doc in different {
            assert!(!stored.same_as(&def(&doc)), "{doc}");
        }
    }

    /// Found attacking issue 34's typed API: a context's whole-valued float
    /// (`1.0`) came back from the typed form as `1`, so a typed
    /// get-then-apply said "updated" and rewrote the document; and NaN or
    /// an infinity in a typed double was dropped in silence (a CPU limit
    /// of NaN stored as no limit).
    #[test]
    fn typed_numbers_round_trip_and_non_numbers_are_refused() {
        let t = "2026-12-01T00:00:00Z".parse().expect("t");
        let doc = json!({"task_id": "t", "agent_id": "a", "context": {"params": {"f": 1.0, "g": [2.0, 2.5], "h": {"i": 3.0}}}});
        let stored = TaskRecord::new(def(&doc), t);
        let back = definition_json(&typed_of(&doc)).expect("json");
        assert!(stored.same_as(&def(&back)), "{back}");
        assert!(
            !stored.same_as(&def(
                &json!({"task_id": "t", "agent_id": "a", "context": {"params": {"f": 1.5, "g": [2.0, 2.5], "h": {"i": 3.0}}}})
            ))
        );
        for x in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let mut d = typed_of(
                &json!({"task_id": "t", "agent_id": "a", "execution": {"limits": {"cpu": 0.5}, "retry_backoff": {"base_seconds": 2.0}}}),
            );
            let e = d.execution.as_mut().expect("execution");
            e.limits.as_mut().expect("limits").cpu = Some(x);
            let err = definition_json(&d).expect_err("refused").to_string();
            assert!(err.contains("execution.limits.cpu") && err.contains("NaN or infinite"), "{err}");
            let e = d.execution.as_mut().expect("execution");
            e.limits = None;
            e.retry_backoff.as_mut().expect("backoff").base_seconds = Some(x);
            let err = definition_json(&d).expect_err("refused").to_string();
            assert!(err.contains("execution.retry_backoff.base_seconds"), "{err}");
            let mut d = typed_of(&json!({"task_id": "t", "agent_id": "a", "context": {"params": {"p": [1]}}}));
            let params = d.context.as_mut().and_then(|c| c.fields.get_mut("params")).expect("params");
            let Some(prost_types::value::Kind::StructValue(p)) = params.kind.as_mut() else { panic!("struct") };
            p.fields.insert("x".into(), prost_types::Value { kind: Some(prost_types::value::Kind::NumberValue(x)) });
            let err = definition_json(&d).expect_err("refused").to_string();
            assert!(err.contains("context.params.x"), "{err}");
        }
    }

    /// Issue 34, point 11: records written before the document was kept
    /// still load; their definition as applied is the spec (all that is
    /// known), and applying that again is unchanged.
    #[test]
    fn a_record_without_its_document_stands_for_itself() {
        // A record as the previous version stored it.
        let old = r#"{"spec":{"task_id":"old","agent_id":"a","execution":{"timeout_seconds":600,"max_retries":0,
            "retry_backoff":{"base_seconds":2.0,"cap_seconds":60.0,"jitter_seconds":0.5},"concurrency_limit":1,"overlap_policy":"skip",
            "misfire_policy":"run_once","misfire_grace_seconds":60,"priority":0,"start_timeout_seconds":3600,"on_resource_busy":"wait",
            "rate_limit_max_wait_seconds":1800,"resources":["search"],"limits":{"memory_max":536870912}}},
            "created_at":"2026-12-01T00:00:00Z","updated_at":"2026-12-01T00:00:00Z"}"#;
        let rec: TaskRecord = serde_json::from_str(old).expect("an old record loads");
        assert_eq!(rec.applied, None);
        let doc = rec.applied_doc();
        assert_eq!(doc["execution"]["timeout_seconds"], 600);
        assert!(rec.same_as(&def(&doc)), "its spec applied again");
        let typed = applied_definition(&rec.spec, &rec.written_fields());
        assert!(rec.same_as(&def(&definition_json(&typed).expect("json"))), "its typed form applied again");
        assert_eq!(typed.execution.and_then(|e| e.limits).and_then(|l| l.memory_max_bytes), Some(512 << 20));
    }

    /// The effective definition fills every default, the triggers' too.
    #[test]
    fn the_effective_definition_has_every_default() {
        let defaults = crate::engine::retention::RetentionConfig::default();
        let d = def(&json!({"task_id": "t", "agent_id": "a", "triggers": [
            {"type": "cron", "expr": "0 * * * *"}, {"type": "interval", "every": "1h"},
            {"type": "queue", "broker": "b", "queue": "q", "max_pending": 20},
            {"type": "webhook", "path": "/hooks/t", "auth": "none"}]}));
        let e = effective_definition(&d.spec, &defaults);
        let Some(pb::trigger::Kind::Cron(c)) = &e.triggers[0].kind else { panic!("cron") };
        assert_eq!(c.timezone, "UTC");
        let Some(pb::trigger::Kind::Interval(iv)) = &e.triggers[1].kind else { panic!("interval") };
        assert_eq!(iv.start_at, Some(prost_types::Timestamp { seconds: 0, nanos: 0 }));
        let Some(pb::trigger::Kind::Queue(q)) = &e.triggers[2].kind else { panic!("queue") };
        assert_eq!((q.format.as_str(), q.max_pending, q.prefetch, q.max_body_bytes), ("json", 20, 20, 1 << 20));
        let Some(pb::trigger::Kind::Webhook(w)) = &e.triggers[3].kind else { panic!("webhook") };
        assert!(w.headers.contains(&"idempotency-key".to_string()) && w.max_body_bytes == 1 << 20, "{w:?}");
        let ex = e.execution.as_ref().expect("execution");
        assert_eq!((ex.timeout_seconds, ex.concurrency_limit, ex.rate_limit_max_wait_seconds), (Some(3600), Some(1), Some(1800)));
        assert_eq!(ex.retry_backoff.and_then(|b| b.jitter_seconds), Some(0.5));
        assert_eq!(e.history, Some(pb::History { keep_last: Some(1000), max_age: "30d".into() }));
        // It is a task file too: applied, it means the same.
        let back = def(&typed_json(&e));
        assert_eq!(effective_definition(&back.spec, &defaults), e);
    }
}
