//! The leader's consumers of queue triggers: one per task and queue
//! trigger, started with the leader's engine and stopped with it (a
//! replica that steps down drops its connections, so what it held
//! unacknowledged is redelivered — to the next leader, whose dedup makes
//! it a no-op when its record was committed).
//!
//! Delivery, the same for RabbitMQ (`amqp.rs`) and NATS JetStream
//! (`nats.rs`):
//! - a consumer takes at most as many messages as the task has room for
//!   (`max_pending` less the runs waiting) and at most `prefetch` at once;
//!   with no room it stops taking (RabbitMQ: cancels its consumer and
//!   gives back what it held) and waits for a run of the task to be
//!   dispatched or to end;
//! - each batch goes to the engine in one request; a message is
//!   acknowledged once its record (a run, or SKIPPED with a reason:
//!   `invalid_event`, `paused`, `circuit_open`, `budget_exceeded`, ...) is
//!   committed — never when the run ends, so a 3-hour agent never meets a
//!   consumer timeout; one whose task is gone is acknowledged too (logged):
//!   nothing is redelivered forever;
//! - a broker that is down or refuses is retried with backoff (0.5 s to
//!   30 s), said in `/readyz` (`degraded`), the log (once a minute) and
//!   `punchclock_queue_consumer_up`; the rest of the control plane goes on.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::{broadcast, watch};

use super::event_request;
use crate::clock::SharedClock;
use crate::config::{Broker, BrokerKind, ConfigHandle};
use crate::engine::lifecycle::{Lifecycle, LifecycleBus};
use crate::engine::{EventRequest, WeakEngineHandle};
use crate::error::Error;
use crate::model::event::event_run_id;
use crate::model::run::TriggerKind;
use crate::model::trigger::{EventFormat, QueueTrigger};
use crate::worker::Worker;

/// What a consumer needs of the leader.
#[derive(Clone)]
pub struct ConsumerContext {
    /// The engine (weak: the consumers never keep it alive).
    pub engine: WeakEngineHandle,
    /// Its lifecycle events (a paused consumer waits for a dispatch or an end).
    pub bus: LifecycleBus,
    /// The clock.
    pub clock: SharedClock,
    /// Where consumers say how they are.
    pub health: Arc<ConsumerHealth>,
}

/// The queue triggers of every task (from the engine) and a version that
/// changes whenever they do.
pub type Sources = watch::Receiver<(u64, Vec<(String, QueueTrigger)>)>;

/// The consumers of this leader: reconciles one per task and queue
/// trigger with the tasks and the config's brokers, until the engine
/// stops it.
pub async fn run(ctx: ConsumerContext, mut sources: Sources, config: ConfigHandle) {
    let mut config_rx = config.subscribe();
    let mut running: HashMap<String, (QueueTrigger, Broker, Worker)> = HashMap::new();
    let _clear = ClearOnDrop(ctx.health.clone());
    loop {
        let (_, wanted) = sources.borrow_and_update().clone();
        let brokers = config.current().brokers.clone();
        let mut desired: HashMap<String, (String, QueueTrigger, Broker)> = HashMap::new();
        for (task_id, q) in wanted {
            match brokers.get(&q.broker) {
                Some(b) => {
                    desired.insert(consumer_name(&task_id, &q), (task_id, q, b.clone()));
                }
                None => tracing::error!(task_id, broker = %q.broker, "a queue trigger names a broker the config no longer defines"),
            }
        }
        let stale: Vec<String> = running
            .iter()
            .filter(|(name, (q, b, _))| desired.get(*name).is_none_or(|(_, dq, db)| dq != q || db != b))
            .map(|(name, _)| name.clone())
            .collect();
        for name in stale {
            if let Some((_, _, mut w)) = running.remove(&name) {
                w.stop().await;
                ctx.health.forget(&name);
                tracing::info!(consumer = %name, "queue consumer stopped");
            }
        }
        for (name, (task_id, q, b)) in desired {
            if running.contains_key(&name) {
                continue;
            }
            tracing::info!(consumer = %name, broker = %q.broker, kind = b.kind.as_str(), "queue consumer starting");
            let w = Worker::spawn(consume(ctx.clone(), name.clone(), task_id, q.clone(), b.clone()));
            running.insert(name, (q, b, w));
        }
        tokio::select! {
            r = sources.changed() => if r.is_err() { break },
            r = config_rx.changed() => if r.is_err() { break },
        }
    }
    for (_, (_, _, mut w)) in running.drain() {
        w.stop().await;
    }
}

/// `task/broker/queue` or `task/broker/stream/subject`.
fn consumer_name(task_id: &str, q: &QueueTrigger) -> String {
    format!("{task_id}/{}", q.source_name())
}

/// One consumer, reconnecting with backoff for as long as it runs.
async fn consume(ctx: ConsumerContext, name: String, task_id: String, q: QueueTrigger, broker: Broker) {
    let mut backoff = Duration::from_millis(500);
    loop {
        let started = tokio::time::Instant::now();
        let r = match broker.kind {
            BrokerKind::Amqp => super::amqp::consume(&ctx, &name, &task_id, &q, &broker).await,
            BrokerKind::Nats => super::nats::consume(&ctx, &name, &task_id, &q, &broker).await,
        };
        match r {
            // The engine is gone: this leader's consumers end with it.
            Ok(Ended::EngineGone) => return,
            Err(why) => {
                ctx.health.set(&name, &q.broker, Some(why.clone()));
                if crate::auth::refusal_due(&format!("consumer {name}")).is_some() {
                    tracing::warn!(consumer = %name, broker = %q.broker, error = %why, retry_in_ms = backoff.as_millis() as u64, "queue consumer cannot consume; retrying");
                }
            }
        }
        // A connection that lived a while starts the backoff over.
        if started.elapsed() > Duration::from_secs(30) {
            backoff = Duration::from_millis(500);
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(30));
    }
}

/// How a consumer's session ended without an error.
#[derive(Debug)]
pub(crate) enum Ended {
    /// The engine stopped (leadership lost): consuming ends.
    EngineGone,
}

/// Room for messages: `max_pending` less the task's runs waiting, waiting
/// (on the lifecycle bus) while there is none. `Err` when the engine is
/// gone.
pub(crate) async fn room(
    ctx: &ConsumerContext,
    task_id: &str,
    q: &QueueTrigger,
    bus: &mut broadcast::Receiver<Lifecycle>,
) -> Result<usize, Ended> {
    loop {
        let engine = ctx.engine.upgrade().ok_or(Ended::EngineGone)?;
        let waiting = engine.waiting(task_id.to_string()).await.map_err(|_| Ended::EngineGone)?;
        drop(engine);
        let max = u64::from(q.max_pending);
        if waiting < max {
            return Ok(((max - waiting) as usize).min(q.prefetch() as usize));
        }
        // Full: wait for one of the task's runs to leave waiting.
        loop {
            match bus.recv().await {
                Ok(Lifecycle::RunDispatched { run, .. } | Lifecycle::RunFinished(run)) if run.task_id == task_id => break,
                Ok(Lifecycle::LeadershipLost { .. }) => return Err(Ended::EngineGone),
                Ok(_) => {}
                Err(broadcast::error::RecvError::Lagged(_)) => break,
                Err(broadcast::error::RecvError::Closed) => return Err(Ended::EngineGone),
            }
        }
    }
}

/// Sends a batch to the engine: `Ok` once every message has its record
/// committed (or its task is gone: logged) — acknowledge them all; `Err`
/// when the engine is gone — acknowledge none (they are redelivered).
pub(crate) async fn admit(ctx: &ConsumerContext, name: &str, events: Vec<EventRequest>) -> Result<(), Ended> {
    let engine = ctx.engine.upgrade().ok_or(Ended::EngineGone)?;
    let ids: Vec<String> = events.iter().map(|e| e.run_id.clone()).collect();
    let answers = engine.events(events).await.map_err(|_| Ended::EngineGone)?;
    for (id, a) in ids.iter().zip(answers) {
        match a {
            Ok(_) => {}
            Err(Error::NotFound { .. }) => {
                tracing::warn!(consumer = %name, run_id = %id, "a message for a task that is gone: acknowledged without a record");
            }
            Err(e) => {
                // Nothing else is expected (an engine stopping answers
                // Unavailable): let it be redelivered.
                tracing::warn!(consumer = %name, run_id = %id, error = %e, "a message could not be admitted; it will be redelivered");
                return Err(Ended::EngineGone);
            }
        }
    }
    Ok(())
}

/// The request for one message of a queue trigger: a body over
/// `max_body_bytes`, or not JSON for `format: json`, is recorded SKIPPED
/// `invalid_event` (without the body when too large).
#[allow(clippy::too_many_arguments)]
pub(crate) fn message_request(
    task_id: &str,
    q: &QueueTrigger,
    key: &str,
    received_at: DateTime<Utc>,
    headers: BTreeMap<String, String>,
    attributes: BTreeMap<String, String>,
    body: &[u8],
    priority: i32,
) -> EventRequest {
    let name = q.source_name();
    let run_id = event_run_id(task_id, TriggerKind::Queue, &q.dedup_scope(), key);
    let too_large = body.len() as u64 > q.max_body();
    let mut ev = event_request(
        task_id,
        run_id,
        TriggerKind::Queue,
        &name,
        key,
        received_at,
        headers,
        attributes,
        if too_large { &[] } else { body },
    );
    ev.priority = priority;
    ev.dedup_window = i64::try_from(q.dedup_ttl_seconds()).ok().and_then(chrono::Duration::try_seconds);
    if too_large {
        ev.info.body_bytes = body.len() as u64;
        ev.invalid = Some(format!("a message of {} bytes; this trigger takes at most {} (max_body_bytes)", body.len(), q.max_body()));
    } else if q.format == EventFormat::Json && !super::is_json(&ev.info) {
        ev.invalid = Some("not a JSON document (the trigger's format is json; format: raw takes any bytes)".into());
    }
    ev
}

/// How each consumer is, for `/readyz` and `/metrics`.
#[derive(Debug, Default)]
pub struct ConsumerHealth {
    states: Mutex<BTreeMap<String, ConsumerState>>,
}

/// One consumer's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerState {
    /// The broker it consumes from.
    pub broker: String,
    /// Why it cannot consume now (`None`: it consumes).
    pub error: Option<String>,
}

impl ConsumerHealth {
    /// Records a consumer's state.
    pub fn set(&self, name: &str, broker: &str, error: Option<String>) {
        let mut s = self.states.lock().unwrap_or_else(PoisonError::into_inner);
        s.insert(name.to_string(), ConsumerState { broker: broker.to_string(), error });
    }

    fn forget(&self, name: &str) {
        self.states.lock().unwrap_or_else(PoisonError::into_inner).remove(name);
    }

    /// Every consumer of this replica (none unless it leads), by name.
    pub fn snapshot(&self) -> BTreeMap<String, ConsumerState> {
        self.states.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

/// Clears the health of a leader's consumers when they stop with it.
struct ClearOnDrop(Arc<ConsumerHealth>);

impl Drop for ClearOnDrop {
    fn drop(&mut self) {
        self.0.states.lock().unwrap_or_else(PoisonError::into_inner).clear();
    }
}
