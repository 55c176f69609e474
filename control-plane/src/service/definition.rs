//! The typed task definition (`pb::TaskDefinition`) ⇄ the task file's
//! document. A typed definition becomes the same JSON a task file holds and
//! goes through the one validation path ([`crate::model::TaskSpec::from_json`]),
//! so both forms have the same defaults, rules and error paths; a stored
//! [`TaskSpec`] becomes a typed definition for `Task.definition`.

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
                Some(pb::trigger::Kind::Webhook(w)) => webhook_json(w),
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
        o.insert("execution".into(), execution_json(e));
    }
    if let Some(c) = &d.context {
        o.insert("context".into(), struct_json(c));
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

fn webhook_json(w: &pb::WebhookTrigger) -> Value {
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
    if !w.headers.is_empty() {
        v["headers"] = w.headers.clone().into();
    }
    if w.max_body_bytes > 0 {
        v["max_body_bytes"] = w.max_body_bytes.into();
    }
    v
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
    }
}

fn execution_json(e: &pb::Execution) -> Value {
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
            if let Some(x) = x.and_then(serde_json::Number::from_f64) {
                r.insert(k.into(), Value::Number(x));
            }
        }
        put("retry_backoff", Some(Value::Object(r)));
    }
    if let Some(s) = &e.selector {
        put("selector", Some(json!({"labels": s.labels})));
    }
    if let Some(cb) = &e.circuit_breaker {
        put("circuit_breaker", Some(json!({"failure_threshold": cb.failure_threshold, "cooldown_seconds": cb.cooldown_seconds})));
    }
    if !e.resources.is_empty() {
        let uses = e
            .resources
            .iter()
            .map(|r| {
                let mut u = json!({"name": r.name, "tokens": r.tokens});
                if let Some(n) = r.units {
                    u["units"] = n.into();
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
    Value::Object(v)
}

/// The typed form of a stored definition (its `trigger` and `triggers`
/// both become `triggers`).
pub fn definition_of(spec: &TaskSpec) -> pb::TaskDefinition {
    let triggers = spec
        .all_triggers()
        .into_iter()
        .map(|t| pb::Trigger {
            kind: Some(match t {
                TriggerSpec::Cron(c) => pb::trigger::Kind::Cron(pb::CronTrigger {
                    expr: c.expr.clone(),
                    timezone: c.timezone.clone().unwrap_or_default(),
                    jitter_seconds: c.jitter_seconds,
                }),
                TriggerSpec::Interval(iv) => pb::trigger::Kind::Interval(pb::IntervalTrigger {
                    every: iv.every.clone().unwrap_or_default(),
                    every_seconds: iv.every_seconds,
                    start_at: iv.start_at.map(to_timestamp),
                    jitter_seconds: iv.jitter_seconds,
                }),
                TriggerSpec::Once(o) => pb::trigger::Kind::Once(pb::OnceTrigger { at: Some(to_timestamp(o.at)) }),
                TriggerSpec::Event(e) => pb::trigger::Kind::Event(pb::EventTrigger { topic: e.topic.clone() }),
                TriggerSpec::Webhook(w) => pb::trigger::Kind::Webhook(webhook_pb(w)),
                TriggerSpec::Queue(q) => pb::trigger::Kind::Queue(pb::QueueTrigger {
                    broker: q.broker.clone(),
                    queue: q.queue.clone().unwrap_or_default(),
                    subject: q.subject.clone().unwrap_or_default(),
                    stream: q.stream.clone().unwrap_or_default(),
                    format: match q.format {
                        crate::model::trigger::EventFormat::Json => "json",
                        crate::model::trigger::EventFormat::Raw => "raw",
                    }
                    .into(),
                    max_pending: q.max_pending,
                    prefetch: q.prefetch.unwrap_or(0),
                    max_body_bytes: q.max_body_bytes.unwrap_or(0),
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
        rate_limit_max_wait_seconds: Some(ex.rate_limit_max_wait_seconds as i64),
    };
    pb::TaskDefinition {
        task_id: spec.task_id.clone(),
        agent_id: spec.agent_id.clone(),
        description: spec.description.clone().unwrap_or_default(),
        triggers,
        execution: Some(execution),
        context: (!spec.context.is_empty()).then(|| json_struct(&spec.context)),
        notify: spec.notify.as_ref().map(|n| pb::Notify {
            on_success: n.on_success.clone(),
            on_failure: n.on_failure.clone(),
            on_skipped: n.on_skipped.clone(),
            on_breaker_open: n.on_breaker_open.clone(),
        }),
        history: spec.history.as_ref().map(|h| pb::History { keep_last: h.keep_last, max_age: h.max_age.clone().unwrap_or_default() }),
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

    /// A definition through the typed form and back is the same definition.
    #[test]
    fn typed_and_json_definitions_are_the_same() {
        let json = r#"{"task_id": "daily_report_001", "agent_id": "report_agent", "description": "d",
            "triggers": [{"type": "cron", "expr": "0 30 8 * * *", "timezone": "Asia/Shanghai", "jitter_seconds": 5},
                         {"type": "interval", "every": "10m", "start_at": "2026-01-01T00:00:00Z"},
                         {"type": "once", "at": "2027-01-01T00:00:00Z"}],
            "execution": {"timeout_seconds": 600, "max_retries": 3, "concurrency_limit": 2, "overlap_policy": "queue",
                          "misfire_policy": "skip", "retry_backoff": {"base_seconds": 1.5},
                          "selector": {"labels": {"zone": "a"}}, "circuit_breaker": {"failure_threshold": 3, "cooldown_seconds": 60},
                          "resources": ["search", {"name": "llm", "units": 2, "tokens": 4000}], "on_resource_busy": "skip",
                          "rate_limit_max_wait_seconds": 600},
            "labels": {"team": "growth"},
            "context": {"params": {"region": "cn-north", "n": 7, "x": 1.5, "list": [true, null, "s"]}},
            "notify": {"on_failure": ["webhook://alert"]}, "history": {"keep_last": 10, "max_age": "7d"}}"#;
        let spec = TaskSpec::from_json(json).expect("valid");
        let typed = definition_of(&spec);
        let back = TaskSpec::from_json(&definition_json(&typed).expect("json").to_string()).expect("valid again");
        assert_eq!(definition_of(&back), typed);
        assert_eq!(back.params()["n"], 7);
        assert_eq!(back.execution, spec.execution);
        // A trigger without a kind is named.
        let mut bad = typed.clone();
        bad.triggers.push(pb::Trigger { kind: None });
        assert!(definition_json(&bad).expect_err("no kind").to_string().starts_with("triggers[3]:"));
    }
}
