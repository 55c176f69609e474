//! One cluster, one configuration: the configuration in force lives in
//! the store ([`crate::repo::config`]), versioned, and every replica
//! follows it; `--config FILE` is the way to apply one, not a replica's
//! private truth (issue 34: a resource of 2 on one replica became 6 live
//! agents after a failover to a replica whose file said 6).
//!
//! - A replica reads the stored configuration at start and follows its
//!   changes ([`follow`]); until the first read it has its file's.
//! - When none is stored yet, the first replica with a file stores it as
//!   version 1 ([`ensure_stored`]); a replica whose file differs from the
//!   stored one says so (logged, and `config diff -f FILE` shows how) and
//!   runs on the stored one.
//! - A leader's engine reads the stored configuration itself before it
//!   starts ([`ensure_stored`]): it never leads on another version. One it
//!   cannot read (a file a `secret_file` names missing on this host) stops
//!   the engine from starting, saying why; the replica steps down.
//! - `config apply -f FILE` (and SIGHUP on the leader, with its file)
//!   validates the document, then every stored task against it, and stores
//!   it in one fenced transaction that fails if a task or the
//!   configuration changed in between ([`Config`]'s `revision` is what a
//!   task write compares): tasks and configuration are checked against
//!   each other whichever comes second.

use std::time::Duration;

use futures::StreamExt;

use super::{Config, ConfigHandle};
use crate::error::{Error, Result};
use crate::model::TaskSpec;
use crate::repo::Repo;
use crate::repo::config::{ConfigAt, StoredConfig};

/// Problems listed in one error at most (a configuration that strands
/// 10,000 tasks names the first few and counts the rest).
const MAX_PROBLEMS: usize = 20;

/// Whether two documents say the same (their parsed values are equal:
/// layout, comments and key order do not matter).
pub fn same_document(a: &str, b: &str) -> bool {
    let parse = |t: &str| serde_yaml_ng::from_str::<serde_yaml_ng::Value>(t).ok();
    match (parse(a), parse(b)) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

/// The configuration a stored document makes, with its version and
/// revision.
///
/// Errors: `InvalidArgument` naming the field (a file the document names
/// is missing on this host, a field this build does not know).
pub fn parse_stored(at: &ConfigAt) -> Result<Config> {
    let mut c = Config::from_text(&at.stored.text)?;
    c.version = at.stored.version;
    c.revision = at.revision;
    c.text = at.stored.text.clone();
    Ok(c)
}

/// Takes the stored configuration into `handle` (unless it has it
/// already); says so when this replica's file differs from it.
///
/// Errors: as [`parse_stored`].
pub fn adopt(handle: &ConfigHandle, at: &ConfigAt) -> Result<()> {
    if handle.current().revision == at.revision {
        return Ok(());
    }
    let config = parse_stored(at)?;
    if let Some(file) = handle.file_text()
        && !same_document(&file, &at.stored.text)
    {
        tracing::warn!(
            file = %handle.path().map(|p| p.display().to_string()).unwrap_or_default(),
            version = at.stored.version,
            applied_by = %at.stored.applied_by,
            "this replica's --config differs from the cluster's configuration; the cluster's applies \
             (punchclock config diff -f FILE shows how; config apply -f FILE changes it)"
        );
    }
    tracing::info!(version = at.stored.version, "cluster configuration in force");
    handle.replace(config);
    Ok(())
}

/// The stored configuration into `handle`; when none is stored yet and
/// this replica has a file, its file is stored first as version 1
/// (create-if-absent: of replicas starting together, one stores). Tasks
/// that do not fit it are logged, not refused (they ran on it before).
///
/// Errors: store errors; as [`parse_stored`].
pub async fn ensure_stored(repo: &Repo, handle: &ConfigHandle, by: &str, now: chrono::DateTime<chrono::Utc>) -> Result<()> {
    for _ in 0..5 {
        let current = repo.get_config().await?;
        let file = handle.file_text();
        match (&current, &file) {
            (Some(at), Some(text)) if handle.file_wins() && !same_document(&at.stored.text, text) => {
                // A single node's file is the cluster's: applied as a new
                // version, if the tasks fit it.
                let config = Config::from_text(text)?;
                let tasks_rev = repo.tasks_changed_revision().await?;
                let specs: Vec<TaskSpec> = repo.load_tasks().await?.into_iter().map(|(r, _)| r.spec).collect();
                let found = problems(&specs, &config);
                if !found.is_empty() {
                    for p in found.iter().take(MAX_PROBLEMS) {
                        tracing::error!(problem = %p, "--config not applied: a task does not fit it; the stored configuration stays");
                    }
                    return adopt(handle, at);
                }
                let path = handle.path().map(|p| p.display().to_string()).unwrap_or_default();
                let version = at.stored.version + 1;
                let stored =
                    StoredConfig { version, text: text.clone(), applied_at: now, applied_by: format!("replica {by}: --config {path}") };
                if let Some(revision) = repo.put_config_if(None, &stored, at.revision, tasks_rev).await? {
                    tracing::info!(path, version, "applied this replica's --config as the cluster's configuration");
                    return adopt(handle, &ConfigAt { stored, revision });
                }
                continue;
            }
            (Some(at), _) => return adopt(handle, at),
            (None, None) => return Ok(()),
            (None, Some(_)) => {}
        }
        let Some(text) = file else { return Ok(()) };
        let tasks_rev = repo.tasks_changed_revision().await?;
        let specs: Vec<TaskSpec> = repo.load_tasks().await?.into_iter().map(|(r, _)| r.spec).collect();
        let config = Config::from_text(&text)?;
        for p in problems(&specs, &config).into_iter().take(MAX_PROBLEMS) {
            tracing::error!(problem = %p, "a stored task does not fit this replica's --config, stored as the cluster's first");
        }
        let path = handle.path().map(|p| p.display().to_string()).unwrap_or_default();
        let stored = StoredConfig { version: 1, text, applied_at: now, applied_by: format!("replica {by}: --config {path}") };
        if repo.put_config_if(None, &stored, 0, tasks_rev).await?.is_some() {
            tracing::info!(path, "stored this replica's --config as the cluster's configuration (version 1)");
        }
    }
    Err(Error::Unavailable { reason: "the cluster configuration kept changing while this replica read it".into(), leader: None })
}

/// Follows the stored configuration into `handle` until the store is gone
/// (a replica's background task): the first read, then every change.
/// A document this build cannot take is logged and the last good one
/// stays (the leader's engine refuses to start on it: [`ensure_stored`]).
pub async fn follow(repo: Repo, handle: ConfigHandle, by: String, clock: crate::clock::SharedClock) {
    let mut pause = Duration::from_millis(200);
    loop {
        let watch = repo.watch_config().await;
        match ensure_stored(&repo, &handle, &by, clock.now()).await {
            Ok(()) => pause = Duration::from_millis(200),
            Err(e) => tracing::error!(error = %e, "cannot take the cluster configuration"),
        }
        match watch {
            Ok(mut changes) => {
                while let Some(change) = changes.next().await {
                    match change {
                        Ok(at) => {
                            if let Err(e) = adopt(&handle, &at) {
                                tracing::error!(error = %e, version = at.stored.version, "cannot take the cluster configuration");
                            }
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, "configuration watch ended");
                            break;
                        }
                    }
                }
            }
            Err(e) => tracing::debug!(error = %e, "cannot watch the configuration yet"),
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(10));
    }
}

/// Every way `specs` do not fit `config`, as `task ID: FIELD: why`.
pub fn problems(specs: &[TaskSpec], config: &Config) -> Vec<String> {
    let mut out = Vec::new();
    for spec in specs {
        for (field, why) in task_problems(spec, config) {
            out.push(format!("task {:?}: {field}: {why}", spec.task_id));
        }
    }
    out
}

/// How one task does not fit a configuration: `(field, why)` for each
/// resource it takes that is not defined, or whose concurrency is below
/// its units or tokens per minute below its estimate, and each queue
/// trigger whose broker is not defined or of the other protocol.
pub fn task_problems(spec: &TaskSpec, config: &Config) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (i, r) in spec.execution.resources.iter().enumerate() {
        let Some(limits) = config.resources.get(&r.name) else {
            out.push((
                format!("execution.resources[{i}]"),
                format!("resource {:?} is not defined in the cluster configuration (resources:)", r.name),
            ));
            continue;
        };
        // A run that can never get its units would wait forever.
        if let Some(c) = limits.concurrency.filter(|c| r.units > *c) {
            out.push((
                format!("execution.resources[{i}].units"),
                format!("{} units of resource {:?}, whose concurrency is {c}: it could never run", r.units, r.name),
            ));
        }
        if let Some(t) = limits.tokens_per_minute.filter(|t| r.tokens > *t) {
            out.push((
                format!("execution.resources[{i}].tokens"),
                format!("an estimate of {} tokens for resource {:?}, whose tokens_per_minute is {t}", r.tokens, r.name),
            ));
        }
    }
    for (i, t) in spec.all_triggers().into_iter().enumerate() {
        if let crate::model::task::TriggerSpec::Queue(q) = t {
            let field = format!("{}.broker", spec.trigger_path(i));
            let Some(b) = config.brokers.get(&q.broker) else {
                out.push((field, format!("broker {:?} is not defined in the cluster configuration (brokers:)", q.broker)));
                continue;
            };
            let wants = if q.queue.is_some() { super::BrokerKind::Amqp } else { super::BrokerKind::Nats };
            if b.kind != wants {
                let (has, give) = match b.kind {
                    super::BrokerKind::Amqp => ("RabbitMQ (amqp)", "queue"),
                    super::BrokerKind::Nats => ("NATS (nats)", "subject and stream"),
                };
                out.push((field, format!("broker {:?} is {has}: give {give}", q.broker)));
            }
        }
    }
    out
}

/// What [`apply`] did.
#[derive(Debug, Clone)]
pub struct Applied {
    /// The version in force after it (the same when nothing changed).
    pub version: u64,
    /// The document differed from the one in force (with `dry_run`: would
    /// have been stored).
    pub changed: bool,
    /// The version it replaced (0: none was stored).
    pub previous: u64,
}

/// Validates `text` and every stored task against it, then stores it as
/// the next version under the leader's fence (`lead`), unless it says what
/// the one in force says; with `dry_run`, only checks. Holds the apply
/// lock (no `ApplyTasks` between the check and the write); a task written
/// meanwhile by another replica makes the write fail and the check run
/// again.
///
/// Errors: `InvalidArgument` naming the field, or listing every task that
/// would not fit (`task ID: FIELD: why`); [`Error::Fenced`]; store errors.
pub async fn apply(
    repo: &Repo,
    lead: &crate::election::Leadership,
    handle: &ConfigHandle,
    text: &str,
    by: &str,
    dry_run: bool,
    now: chrono::DateTime<chrono::Utc>,
) -> Result<Applied> {
    let config = Config::from_text(text)?;
    let _one_at_a_time = repo.lock_applies().await;
    for _ in 0..5 {
        let current = repo.get_config().await?;
        let previous = current.as_ref().map_or(0, |c| c.stored.version);
        if current.as_ref().is_some_and(|c| same_document(&c.stored.text, text)) {
            return Ok(Applied { version: previous, changed: false, previous });
        }
        // The mark first: a task written after it moves it.
        let tasks_rev = repo.tasks_changed_revision().await?;
        let specs: Vec<TaskSpec> = repo.load_tasks().await?.into_iter().map(|(r, _)| r.spec).collect();
        let found = problems(&specs, &config);
        if !found.is_empty() {
            let mut why = format!("{} task(s) would not fit this configuration:", found.len());
            for p in found.iter().take(MAX_PROBLEMS) {
                why.push_str("\n  ");
                why.push_str(p);
            }
            if found.len() > MAX_PROBLEMS {
                why.push_str(&format!("\n  ... and {} more", found.len() - MAX_PROBLEMS));
            }
            return Err(Error::invalid("config", why));
        }
        if dry_run {
            return Ok(Applied { version: previous + 1, changed: true, previous });
        }
        let stored = StoredConfig { version: previous + 1, text: text.to_string(), applied_at: now, applied_by: by.to_string() };
        let config_rev = current.as_ref().map_or(0, |c| c.revision);
        if let Some(revision) = repo.put_config_if(Some(lead), &stored, config_rev, tasks_rev).await? {
            tracing::info!(version = stored.version, by, "cluster configuration applied");
            adopt(handle, &ConfigAt { stored, revision })?;
            return Ok(Applied { version: previous + 1, changed: true, previous });
        }
    }
    Err(Error::Unavailable { reason: "tasks or the configuration kept changing during the apply; try again".into(), leader: None })
}
