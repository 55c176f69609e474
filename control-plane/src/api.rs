//! The API core: what each RPC does, without transport types. Task
//! definitions are plain store writes (any replica may serve them); run
//! creation, cancellation and runner sessions go to the leader's engine.
//! Run watches follow the replica's lifecycle bus.

use std::sync::{Arc, RwLock};

use chrono::{DateTime, Utc};
use futures::StreamExt;

use crate::clock::SharedClock;
use crate::election::{Election, LeaderInfo};
use crate::engine::core::Triggered;
use crate::engine::lifecycle::{Lifecycle, LifecycleBus};
use crate::engine::{EngineHandle, EventAdmitted, TriggerRequest};
use crate::error::{Error, Result};
use crate::model::{Cursor, Definition, RunRecord, TaskRecord, TaskSpec};
use crate::repo::history::{self, HistoryQuery, HistoryStore};
use crate::repo::{ApplyOutcome, Repo, record_for};
use crate::schedule::{CronSchedule, Schedule, Shape, next_slot};
use crate::views::{RunSummary, RunnerView, SlotCell, TaskSummary};

/// Most fire times one preview returns.
pub const MAX_PREVIEW: u32 = 1000;
/// Default page of `ListTasks`.
pub const DEFAULT_TASK_PAGE: u32 = 500;
/// Largest page of `ListTasks`.
pub const MAX_TASK_PAGE: u32 = 1000;
/// Default page of `ListRuns`.
pub const DEFAULT_RUN_LIMIT: u32 = 100;
/// Most runs one `ListRuns` returns (a larger `limit` is capped).
pub const MAX_RUN_LIMIT: u32 = 1000;
/// Tasks firing at one instant without jitter from which `apply` warns.
pub const CROWDED_INSTANT: usize = 50;

/// Longest warning text returned with an apply.
const MAX_WARNING_BYTES: usize = 300;
/// Attempts of an optimistic read-modify-write before giving up.
const CAS_ATTEMPTS: usize = 5;

/// A task with its scheduler state, as `GetTask`/`ListTasks` show it.
#[derive(Debug, Clone)]
pub struct TaskView {
    /// The stored record.
    pub record: TaskRecord,
    /// Its cursor, if it ever fired.
    pub cursor: Option<Cursor>,
    /// Next nominal slot (UTC), if any and not paused.
    pub next_fire_at: Option<DateTime<Utc>>,
    /// Why its time triggers have no slot left, when their bounds ended
    /// them: `end_at 2026-12-01T00:00:00Z passed`, `max_runs 3 reached`.
    pub ended: Option<String>,
}

/// A backfill started, or a dry run's listing ([`Core::backfill`]).
#[derive(Debug, Clone, Default)]
pub struct BackfillPlan {
    /// The backfill started (none for a dry run).
    pub backfill: Option<crate::model::backfill::Backfill>,
    /// A dry run: each slot, the run it concerns, what it would get.
    pub listing: Vec<(DateTime<Utc>, String, String)>,
}

/// One re-run ([`Core::rerun`], [`Core::rerun_matching`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rerun {
    /// The run re-run.
    pub of: String,
    /// Its re-run (with a dry run: the id it would get).
    pub run_id: String,
    /// False: it existed already, or a dry run.
    pub created: bool,
    /// Why it was left out (it has a re-run already).
    pub skipped: Option<String>,
}

/// A preview of a schedule ([`Core::preview`]).
#[derive(Debug, Clone, Default)]
pub struct Preview {
    /// The nominal slots (UTC).
    pub times: Vec<DateTime<Utc>>,
    /// When each fires: its slot plus the trigger's jitter.
    pub fires: Vec<DateTime<Utc>>,
    /// The zone the slots are read in.
    pub zone: Option<chrono_tz::Tz>,
    /// DST effects at the zone's next changes, jitter, an ended bound.
    pub notes: Vec<String>,
}

/// What `ApplyTask` did.
#[derive(Debug, Clone)]
pub struct Applied {
    /// The stored record (or, with `dry_run`, what would be stored).
    pub record: TaskRecord,
    /// False when a task with this id existed and was replaced.
    pub created: bool,
    /// Created, updated or unchanged (with `dry_run`: what would be).
    pub outcome: ApplyOutcome,
    /// Problems that do not stop the apply.
    pub warnings: Vec<String>,
}

/// What `ApplyTasks` did to one task.
#[derive(Debug, Clone)]
pub struct AppliedTask {
    /// The task.
    pub task_id: String,
    /// Created, updated or unchanged (with `dry_run`: what would be).
    pub outcome: ApplyOutcome,
    /// Problems that do not stop the apply.
    pub warnings: Vec<String>,
}

/// Validates every definition of a task file at `now`, in order.
///
/// Errors: `InvalidArgument` on `tasks` listing every bad definition (by
/// position and id, the first 20) and every repeated id.
fn validate_all(spec_jsons: &[String], now: DateTime<Utc>, config: &crate::config::Config) -> Result<Vec<Definition>> {
    validate_listed(spec_jsons, now, config)
}

/// [`validate_all`] without a server (`punchclock validate -f`), and the
/// problems across the file's own tasks (a webhook path twice, a cycle of
/// `after`). With `config`, resources and brokers are checked against it;
/// without, every one a definition names is taken as defined.
///
/// Errors: as [`validate_all`]; `InvalidArgument` listing the problems
/// across tasks.
pub fn validate_file(spec_jsons: &[String], now: DateTime<Utc>, config: Option<&crate::config::Config>) -> Result<Vec<TaskSpec>> {
    let lax;
    let config = match config {
        Some(c) => c,
        None => {
            let mut c = crate::config::Config::defaults();
            for spec in spec_jsons.iter().filter_map(|j| TaskSpec::from_json(j).ok()) {
                for r in &spec.execution.resources {
                    c.resources.entry(r.name.clone()).or_default();
                }
                for q in spec.queues() {
                    let kind = if q.queue.is_some() { crate::config::BrokerKind::Amqp } else { crate::config::BrokerKind::Nats };
                    let b = crate::config::Broker { kind, url: String::new(), ca_file: None, credentials_file: None };
                    c.brokers.entry(q.broker.clone()).or_insert(b);
                }
            }
            lax = c;
            &lax
        }
    };
    let specs: Vec<TaskSpec> = validate_listed(spec_jsons, now, config)?.into_iter().map(|d| d.spec).collect();
    let refs: Vec<&TaskSpec> = specs.iter().collect();
    let problems = crate::model::trigger::check_across(&refs, std::iter::empty(), crate::engine::core::policy::dependencies::MAX_FOLLOWERS);
    if !problems.is_empty() {
        let lines: Vec<String> = problems.iter().map(|p| format!("task {}: {}: {}", p.task_id, p.field, p.reason)).collect();
        return Err(Error::invalid("tasks", format!("{} problems across tasks:\n  {}", problems.len(), lines.join("\n  "))));
    }
    Ok(specs)
}

fn validate_listed(spec_jsons: &[String], now: DateTime<Utc>, config: &crate::config::Config) -> Result<Vec<Definition>> {
    const SHOWN_PROBLEMS: usize = 20;
    let mut specs = Vec::with_capacity(spec_jsons.len());
    let mut problems = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (i, json) in spec_jsons.iter().enumerate() {
        match validate_spec(json, now, config) {
            Ok(def) if !seen.insert(def.spec.task_id.clone()) => {
                problems.push(format!("task #{} ({}): task_id: appears more than once", i + 1, def.spec.task_id));
            }
            Ok(spec) => specs.push(spec),
            Err(e) => {
                let id = serde_json::from_str::<serde_json::Value>(json)
                    .ok()
                    .and_then(|v| v.get("task_id").and_then(|id| id.as_str()).map(str::to_string))
                    .unwrap_or_else(|| "?".into());
                // A definition's own list of problems, indented under it.
                problems.push(format!("task #{} ({id}): {}", i + 1, e.to_string().replace('\n', "\n    ")));
            }
        }
    }
    if problems.is_empty() {
        return Ok(specs);
    }
    let more = problems.len().saturating_sub(SHOWN_PROBLEMS);
    let mut text = format!("{} of {} definitions are invalid; nothing applied:", problems.len(), spec_jsons.len());
    for p in problems.iter().take(SHOWN_PROBLEMS) {
        text.push_str("\n  ");
        text.push_str(p);
    }
    if more > 0 {
        text.push_str(&format!("\n  ... and {more} more"));
    }
    Err(Error::invalid("tasks", text))
}

/// Parses and validates one definition at `now`: the model's checks, then
/// that every recurring trigger still has a fire time.
///
/// Errors: `InvalidArgument` naming the field.
fn validate_spec(spec_json: &str, now: DateTime<Utc>, config: &crate::config::Config) -> Result<Definition> {
    let def = Definition::from_json(spec_json)?;
    let spec = &def.spec;
    // Checked against the cluster configuration (and the write compares
    // its revision: see `crate::config::cluster`).
    // Every one of them (found attacking issue 34: only the first was said).
    let problems = crate::config::cluster::task_problems(spec, config);
    if let Some(((field, why), rest)) = problems.split_first() {
        let also: String = rest.iter().map(|(f, w)| format!("\nalso {f}: {w}")).collect();
        return Err(Error::invalid(field.clone(), format!("{why}{also}")));
    }
    for i in 0..spec.all_triggers().len() {
        let Some(s) = spec.compile_trigger(i) else { continue };
        let s = s?;
        if !matches!(s.shape, Shape::Once { .. }) && s.next_after(now).is_none() {
            let path = if spec.trigger.is_some() && i == 0 {
                "trigger".to_string()
            } else {
                format!("triggers[{}]", i - usize::from(spec.trigger.is_some()))
            };
            if s.shape.next_after(now).is_some() {
                return Err(Error::invalid(format!("{path}.end_at"), "is past: the trigger has no slot left"));
            }
            return Err(Error::invalid(format!("{path}.expr"), "has no fire time after now"));
        }
    }
    Ok(def)
}

/// Why a task's time triggers have no slot left, when their bounds ended
/// them (`max_runs` counted in its cursor, `end_at` past `now`); `None`
/// while a slot may come, or for a task without time triggers.
pub fn ended_by_bounds(record: &TaskRecord, cursor: Option<&Cursor>, now: DateTime<Utc>) -> Option<String> {
    let scheds = record.spec.schedules().ok()?;
    if scheds.is_empty() {
        return None;
    }
    let runs = cursor.map_or(0, |c| c.time_runs);
    if let Some(max) = scheds.iter().find_map(|s| s.bounds.max_runs)
        && runs >= max
    {
        return Some(format!("max_runs {max} reached ({runs} runs)"));
    }
    let base = cursor.and_then(|c| c.last_slot).unwrap_or(record.created_at).max(now);
    if next_slot(&scheds, base).is_some() {
        return None;
    }
    let ends: Vec<DateTime<Utc>> = scheds.iter().filter_map(|s| s.bounds.end).collect();
    let end = ends.iter().max()?;
    Some(format!("end_at {} passed", end.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)))
}

/// Shared state of the API services.
pub struct Core {
    /// Typed store access.
    pub repo: Repo,
    /// Run history (`ListRuns`, `GetRun` of a run no longer in the store,
    /// `stats`): the store's own, or PostgreSQL's (`--history`).
    pub history: Arc<dyn HistoryStore>,
    /// Lifecycle events of this replica: the engine's while it leads, the
    /// stored run changes otherwise.
    pub lifecycle: LifecycleBus,
    /// Clock.
    pub clock: SharedClock,
    /// Election.
    pub election: Arc<dyn Election>,
    /// The engine while this replica leads.
    pub engine: RwLock<Option<EngineHandle>>,
    /// Run retention defaults (for `PruneRuns`).
    pub retention: crate::engine::retention::RetentionConfig,
    /// Why this replica leads without a running engine, if it does.
    pub engine_problem: std::sync::Mutex<Option<String>>,
    /// Prometheus metrics of this replica.
    pub metrics: Arc<crate::metrics::Metrics>,
    /// The config file (`--config`: sinks, resources, budgets): the leader
    /// delivers notifications and enforces resources and budgets; every
    /// replica validates applies against it.
    pub config: crate::config::ConfigHandle,
    /// Open run watches (fed from `lifecycle`).
    pub watchers: crate::watch::RunWatchers,
    /// Traces are exported (a new leader then emits again the spans of
    /// runs that ended just before its term).
    pub traces: bool,
    /// Tokens and roles: the HTTP port's `POST /events/{topic}` checks
    /// them as the gRPC port does.
    pub auth: Arc<crate::auth::Auth>,
    /// How this leader's queue consumers are (`/readyz`, `/metrics`).
    pub consumers: Arc<crate::events::consumers::ConsumerHealth>,
    /// The history archive (`--history postgres://`) and how its mover is.
    pub archive: Option<(Arc<dyn HistoryStore>, Arc<crate::engine::archive::ArchiveStatus>)>,
    /// The dashboard's settings.
    pub ui: crate::ui::UiConfig,
}

impl Core {
    /// The engine, or `Unavailable` naming the leader when this replica is not it.
    pub async fn engine(&self) -> Result<EngineHandle> {
        if let Some(e) = self.engine.read().ok().and_then(|g| g.clone()) {
            return Ok(e);
        }
        let leader = self.election.leader().await.map(|l| l.advertise_address).filter(|a| !a.is_empty());
        // With no leader at all, a store alarm is the likely reason: say so.
        if leader.is_none()
            && let Some(alarm) = self.repo.store().alarms().await.ok().and_then(|a| a.into_iter().next())
        {
            return Err(Error::Unavailable { reason: format!("no leader: {}", alarm_reason(&alarm)), leader: None });
        }
        Err(Error::Unavailable { reason: "this replica is not the leader".into(), leader })
    }

    /// Records (or clears) why this replica leads without an engine.
    pub fn set_engine_problem(&self, problem: Option<String>) {
        if let Ok(mut p) = self.engine_problem.lock() {
            *p = problem;
        }
    }

    /// Why this replica cannot serve now (empty when it can): the store
    /// does not take writes, or it leads without a running engine.
    pub async fn readiness(&self) -> Vec<String> {
        let mut why = Vec::new();
        if let Err(e) = self.repo.store().ready().await {
            why.push(format!("store not writable: {e}"));
        }
        for alarm in self.repo.store().alarms().await.unwrap_or_default() {
            why.push(alarm_reason(&alarm));
        }
        let leading = self.election.leadership().borrow().is_some();
        let engine = self.engine.read().map(|g| g.is_some()).unwrap_or(false);
        if leading && !engine {
            let problem = self.engine_problem.lock().ok().and_then(|p| p.clone());
            why.push(problem.unwrap_or_else(|| "leading, but the engine is not running yet".into()));
        }
        why
    }

    /// SIGHUP: applies this replica's `--config` file to the cluster
    /// ([`Core::apply_config`]) when this replica leads; a follower only
    /// says that its file differs (apply it with `config apply -f`, or
    /// SIGHUP the leader). Returns the version in force after it.
    ///
    /// Errors: as [`Core::apply_config`]; `Unavailable` on a follower whose
    /// file differs from the cluster's configuration.
    pub async fn reload_config(&self) -> Result<u64> {
        let Some(text) = self.config.file_text() else { return Ok(self.config.current().version) };
        if crate::config::cluster::same_document(&self.config.current().text, &text) {
            return Ok(self.config.current().version);
        }
        if self.engine.read().ok().and_then(|g| g.clone()).is_none() {
            crate::config::Config::from_text(&text)?;
            return Err(Error::Unavailable {
                reason:
                    "this replica's --config differs from the cluster's configuration, and only the leader applies its file on SIGHUP: \
                         run punchclock config apply -f FILE"
                        .into(),
                leader: self.election.leader().await.map(|l| l.advertise_address),
            });
        }
        let path = self.config.path().map(|p| p.display().to_string()).unwrap_or_default();
        let by = format!("replica {}: --config {path} (SIGHUP)", self.election.id());
        Ok(self.apply_config(&text, &by, false).await?.version)
    }

    /// `ApplyConfig`: validates the cluster configuration `text` and every
    /// stored task against it, and stores it as the next version (see
    /// [`crate::config::cluster::apply`]); on the leader.
    ///
    /// Errors: `InvalidArgument` naming the field or the tasks that would
    /// not fit; `Unavailable` naming the leader on a follower.
    pub async fn apply_config(&self, text: &str, by: &str, dry_run: bool) -> Result<crate::config::cluster::Applied> {
        let engine = self.engine().await?;
        crate::config::cluster::apply(&self.repo, engine.leadership(), &self.config, text, by, dry_run, self.clock.now()).await
    }

    /// `GetConfig`: the configuration in force (`version` 0), or an
    /// earlier version (the last 20 are kept); `None` when none was ever
    /// stored (the defaults apply) or that version is gone.
    ///
    /// Errors: store errors.
    pub async fn get_config(&self, version: u64) -> Result<Option<crate::repo::config::StoredConfig>> {
        if version == 0 {
            return Ok(self.repo.get_config().await?.map(|c| c.stored));
        }
        self.repo.get_config_version(version).await
    }

    /// The configuration to validate against now, fresh from the store
    /// when `stale` (a write found the one held here was replaced).
    async fn config_for_write(&self, stale: bool) -> Result<Arc<crate::config::Config>> {
        if stale && let Some(at) = self.repo.get_config().await? {
            crate::config::cluster::adopt(&self.config, &at)?;
        }
        Ok(self.config.current())
    }

    /// Whether the leader `l` names (another replica) does not answer (a
    /// killed or stopped leader's lease outlives it by up to its TTL, and
    /// until then every replica names it): its HTTP `/livez` is asked with
    /// a 1 s deadline; a leader without an HTTP port must answer the HTTP/2
    /// connection preface on its gRPC address within 1 s (a killed process
    /// refuses the connection; a stopped one's kernel accepts it, but
    /// nothing answers). False when this replica leads or when there is no
    /// leader.
    pub async fn leader_unresponsive(&self, l: &LeaderInfo) -> bool {
        const DEADLINE: std::time::Duration = std::time::Duration::from_secs(1);
        if l.leader_id.is_empty() || l.leader_id == self.election.id() {
            return false;
        }
        if l.http_address.is_empty() {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let authority = l.advertise_address.split_once("://").map_or(l.advertise_address.as_str(), |(_, a)| a).trim_end_matches('/');
            let probe = async {
                let mut s = tokio::net::TcpStream::connect(authority).await?;
                // The client preface and an empty SETTINGS frame: an HTTP/2
                // server answers with its SETTINGS (a TLS one with an alert
                // or by closing: an answer too).
                s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0").await?;
                s.read(&mut [0u8; 16]).await
            };
            return !matches!(tokio::time::timeout(DEADLINE, probe).await, Ok(Ok(_)));
        }
        static CLIENT: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();
        let client = CLIENT.get_or_init(|| reqwest::Client::builder().timeout(DEADLINE).build().unwrap_or_else(|_| reqwest::Client::new()));
        let url = format!("{}/livez", l.http_address.trim_end_matches('/'));
        !client.get(url).send().await.is_ok_and(|r| r.status().is_success())
    }

    /// Current leader as known here.
    pub async fn leader(&self) -> Option<LeaderInfo> {
        self.election.leader().await
    }

    /// Validates and stores a task (create or replace). Nothing is written
    /// when validation fails. Warns (on the leader) when no connected runner
    /// serves the task's agent.
    pub async fn apply_task(&self, spec_json: &str, dry_run: bool) -> Result<Applied> {
        let now = self.clock.now();
        let mut config = self.config_for_write(false).await?;
        let mut def = validate_spec(spec_json, now, &config)?;
        let mut warnings = self.agent_warnings(&def.spec).await;
        warnings.extend(self.sink_warnings(&def.spec));
        warnings.extend(self.check_across(&[&def.spec]).await?.into_values().flatten());
        warnings.extend(self.time_warnings(&[&def.spec], now).await.into_values().flatten());
        for _ in 0..CAS_ATTEMPTS {
            let prev = self.repo.get_task(&def.spec.task_id).await?;
            let (rec, outcome) = record_for(&def, prev.as_ref().map(|(r, _)| r), now);
            let created = prev.is_none();
            if dry_run || outcome == ApplyOutcome::Unchanged {
                return Ok(Applied { record: rec, created, outcome, warnings });
            }
            if self.repo.put_task_checked(&rec, prev.as_ref().map_or(0, |(_, rev)| *rev), config.revision).await? {
                tracing::info!(task_id = %def.spec.task_id, created, "task applied");
                return Ok(Applied { record: rec, created, outcome, warnings });
            }
            // The task, or the cluster configuration, changed meanwhile:
            // validate again against the configuration in force.
            config = self.config_for_write(true).await?;
            def = validate_spec(spec_json, now, &config)?;
        }
        Err(Error::Unavailable { reason: format!("task {} is being changed concurrently; try again", def.spec.task_id), leader: None })
    }

    /// Validates every definition of `spec_jsons` (a whole task file), then
    /// creates or replaces them all or none (see [`crate::repo::apply`]);
    /// with `dry_run`, says what it would do. Writes go through the leader
    /// (its fence guards them, and a new leader finishes an interrupted
    /// apply).
    ///
    /// Errors: `InvalidArgument` listing every bad definition (by position
    /// and id) and repeated ids — nothing is written; `Unavailable` naming
    /// the leader on a follower; store errors.
    pub async fn apply_tasks(&self, spec_jsons: Vec<String>, dry_run: bool) -> Result<Vec<AppliedTask>> {
        let now = self.clock.now();
        // Thousands of definitions are seconds of CPU: off the runtime's
        // workers, which also serve the lease renewals and the engine.
        let config = self.config_for_write(false).await?;
        let config_rev = config.revision;
        let defs = tokio::task::spawn_blocking(move || validate_all(&spec_jsons, now, &config))
            .await
            .map_err(|e| Error::Internal(format!("validation task failed: {e}")))??;
        let mut across = self.check_across(&defs.iter().map(|d| &d.spec).collect::<Vec<_>>()).await?;
        for (task, w) in self.time_warnings(&defs.iter().map(|d| &d.spec).collect::<Vec<_>>(), now).await {
            across.entry(task).or_default().extend(w);
        }
        let outcomes = if dry_run {
            self.repo.preview_apply(&defs, now).await?
        } else {
            let engine = self.engine().await?;
            // In a task of its own: a client that goes away mid-apply does
            // not stop it halfway (a journaled apply is finished).
            let (repo, lead, to_write) = (self.repo.clone(), engine.leadership().clone(), defs.clone());
            let report = tokio::spawn(async move { repo.apply_tasks(&lead, &to_write, now, config_rev).await })
                .await
                .map_err(|e| Error::Internal(format!("apply task failed: {e}")))??;
            tracing::info!(tasks = defs.len(), transactions = report.transactions, journaled = report.journaled, "tasks applied");
            report.outcomes
        };
        // One question per distinct agent and selector, not per task.
        let mut warned: std::collections::HashMap<(String, String), Vec<String>> = std::collections::HashMap::new();
        let mut out = Vec::with_capacity(defs.len());
        for (spec, outcome) in defs.into_iter().map(|d| d.spec).zip(outcomes) {
            let key = (spec.agent_id.clone(), format!("{:?}", spec.execution.selector));
            let warnings = match warned.get(&key) {
                Some(w) => w.clone(),
                None => {
                    let w = self.agent_warnings(&spec).await;
                    warned.insert(key, w.clone());
                    w
                }
            };
            let mut warnings = warnings;
            warnings.extend(self.sink_warnings(&spec));
            warnings.extend(across.remove(&spec.task_id).unwrap_or_default());
            out.push(AppliedTask { task_id: spec.task_id, outcome, warnings });
        }
        Ok(out)
    }

    /// The rules across tasks of definitions with webhook or `after`
    /// triggers (one task per webhook path, no cycle of `after`, at most
    /// [`crate::engine::core::policy::dependencies::MAX_FOLLOWERS`] tasks
    /// following one), checked against every stored task; and warnings by
    /// task: a followed task that does not exist (yet), a webhook secret
    /// this replica cannot read.
    ///
    /// Errors: `InvalidArgument` naming the field (`trigger.path`,
    /// `triggers[1].task`; for several definitions, `tasks` listing each).
    async fn check_across(&self, specs: &[&TaskSpec]) -> Result<std::collections::HashMap<String, Vec<String>>> {
        let mut warnings: std::collections::HashMap<String, Vec<String>> = std::collections::HashMap::new();
        for spec in specs {
            let events = spec.all_triggers().iter().any(|t| !t.is_time() && !matches!(t, crate::model::task::TriggerSpec::After(_)));
            if events && spec.execution.overlap_policy == crate::model::task::OverlapPolicy::Skip {
                warnings.entry(spec.task_id.clone()).or_default().push(format!(
                    "overlap_policy skip: an event that arrives while {} run(s) are active is recorded SKIPPED; events usually want overlap_policy: queue",
                    spec.execution.concurrency_limit
                ));
            }
        }
        if !specs.iter().any(|s| !s.webhooks().is_empty() || !s.follows().is_empty()) {
            return Ok(warnings);
        }
        let stored: Vec<TaskSpec> = self.repo.load_tasks().await?.into_iter().map(|(r, _)| r.spec).collect();
        let problems = crate::model::trigger::check_across(specs, stored.iter(), crate::engine::core::policy::dependencies::MAX_FOLLOWERS);
        match problems.as_slice() {
            [] => {}
            [p] if specs.len() == 1 => return Err(Error::invalid(p.field.clone(), p.reason.clone())),
            ps => {
                let lines: Vec<String> = ps.iter().map(|p| format!("task {}: {}: {}", p.task_id, p.field, p.reason)).collect();
                return Err(Error::invalid(
                    "tasks",
                    format!("{} problems across tasks; nothing applied:\n  {}", ps.len(), lines.join("\n  ")),
                ));
            }
        }
        let known: std::collections::HashSet<&str> =
            stored.iter().map(|s| s.task_id.as_str()).chain(specs.iter().map(|s| s.task_id.as_str())).collect();
        for spec in specs {
            let w = warnings.entry(spec.task_id.clone()).or_default();
            for a in spec.follows() {
                if !known.contains(a.task.as_str()) {
                    w.push(format!("follows task {:?}, which does not exist (yet): its runs start once it does", a.task));
                }
            }
            for hook in spec.webhooks() {
                let file = match &hook.auth {
                    crate::model::trigger::WebhookAuth::Hmac(h) => Some(&h.secret_file),
                    crate::model::trigger::WebhookAuth::Bearer(b) => Some(&b.token_file),
                    crate::model::trigger::WebhookAuth::None => None,
                };
                if let Some(f) = file
                    && std::fs::metadata(f).is_err()
                {
                    w.push(format!("{}: {f} cannot be read on this control plane: requests are refused (503) until it can", hook.path));
                }
            }
        }
        Ok(warnings)
    }

    /// Warnings about time by task: slots a DST change in the next two
    /// years skips or repeats, with what the trigger's `dst` policy does
    /// to them ([`Schedule::dst_effects`]); and, on the leader, a next fire
    /// shared with [`CROWDED_INSTANT`] or more tasks without jitter
    /// ("480 tasks fire at 2026-12-08T09:00:00Z: ... jitter: auto").
    async fn time_warnings(&self, specs: &[&TaskSpec], now: DateTime<Utc>) -> std::collections::HashMap<String, Vec<String>> {
        let mut out: std::collections::HashMap<String, Vec<String>> = std::collections::HashMap::new();
        // Tasks share expressions: the effects of one are worked out once.
        let mut effects: std::collections::HashMap<String, Vec<String>> = std::collections::HashMap::new();
        let mut next: Vec<(String, DateTime<Utc>)> = Vec::new();
        for spec in specs {
            for (i, t) in spec.all_triggers().iter().enumerate() {
                let Some(Ok(s)) = spec.compile_trigger(i) else { continue };
                let key = serde_json::to_string(t).unwrap_or_default();
                let lines = effects.entry(key).or_insert_with(|| s.dst_effects(now));
                let path = spec.trigger_path(i);
                out.entry(spec.task_id.clone()).or_default().extend(lines.iter().map(|l| format!("{path}: {l}")));
                if s.jitter_ms() == 0
                    && let Some(n) = s.next_after(now)
                {
                    next.push((spec.task_id.clone(), n));
                }
            }
        }
        let Some(engine) = self.engine.read().ok().and_then(|g| g.clone()) else { return out };
        if next.is_empty() {
            return out;
        }
        let instants: std::collections::HashSet<DateTime<Utc>> = next.iter().map(|(_, n)| *n).collect();
        let exclude: std::collections::HashSet<String> = specs.iter().map(|s| s.task_id.clone()).collect();
        let mut crowd = engine.query(move |core, _| core.fires_at(&instants, &exclude)).await.unwrap_or_default();
        // The tasks of this apply crowd an instant too.
        for (_, n) in &next {
            *crowd.entry(*n).or_insert(0) += 1;
        }
        for (task, n) in next {
            let count = crowd.get(&n).copied().unwrap_or(0);
            if count >= CROWDED_INSTANT {
                out.entry(task).or_default().push(format!(
                    "{count} tasks fire at {} UTC: add jitter: auto to spread them (a tenth of the period, at most 15 minutes, the same offset every time)",
                    n.format("%Y-%m-%dT%H:%M:%S")
                ));
            }
        }
        out
    }

    /// "notify names webhook://X, which this replica's --config does not
    /// define": its notifications would be dead-lettered.
    fn sink_warnings(&self, spec: &TaskSpec) -> Vec<String> {
        let Some(n) = &spec.notify else { return Vec::new() };
        let config = self.config.current();
        let mut missing: Vec<&str> = [&n.on_success, &n.on_failure, &n.on_skipped, &n.on_breaker_open]
            .into_iter()
            .flatten()
            .filter_map(|s| s.strip_prefix("webhook://"))
            .filter(|name| !config.notify.has_sink(name))
            .collect();
        missing.sort_unstable();
        missing.dedup();
        missing
            .into_iter()
            .map(|name| format!("notify names webhook://{name}, which the control plane's --config does not define: its notifications will be dead-lettered"))
            .collect()
    }

    /// "No connected runner serves agent X", when this replica leads and
    /// knows it (followers cannot tell).
    async fn agent_warnings(&self, spec: &TaskSpec) -> Vec<String> {
        let Some(engine) = self.engine.read().ok().and_then(|g| g.clone()) else { return Vec::new() };
        let selector = spec.execution.selector.as_ref().map(|s| s.labels.clone()).unwrap_or_default();
        match engine.serves_agent(spec.agent_id.clone(), selector.clone()).await {
            Ok(false) => {
                let labels = if selector.is_empty() { String::new() } else { format!(" with labels {selector:?}") };
                let mut text = format!(
                    "no connected runner serves agent {:?}{labels}: its runs wait (execution.start_timeout_seconds {} s) for one",
                    spec.agent_id, spec.execution.start_timeout_seconds
                );
                // Labels can be long: a warning stays a line.
                if text.len() > MAX_WARNING_BYTES {
                    let mut end = MAX_WARNING_BYTES;
                    while !text.is_char_boundary(end) {
                        end -= 1;
                    }
                    text.truncate(end);
                    text.push_str("...");
                }
                vec![text]
            }
            _ => Vec::new(),
        }
    }

    async fn modify_task(&self, task_id: &str, f: impl Fn(&mut TaskRecord, DateTime<Utc>)) -> Result<TaskRecord> {
        for _ in 0..CAS_ATTEMPTS {
            let (mut rec, rev) =
                self.repo.get_task(task_id).await?.ok_or_else(|| Error::NotFound { kind: "task", id: task_id.to_string() })?;
            f(&mut rec, self.clock.now());
            if self.repo.put_task_if(&rec, rev).await? {
                return Ok(rec);
            }
        }
        Err(Error::Unavailable { reason: format!("task {task_id} is being changed concurrently; try again"), leader: None })
    }

    /// Pauses a task (idempotent).
    pub async fn pause_task(&self, task_id: &str) -> Result<TaskRecord> {
        self.modify_task(task_id, |r, now| {
            if !r.paused {
                r.paused = true;
                r.paused_at = Some(now);
                r.updated_at = now;
            }
        })
        .await
    }

    /// Resumes a task (idempotent); the engine covers the paused slots.
    pub async fn resume_task(&self, task_id: &str) -> Result<TaskRecord> {
        self.modify_task(task_id, |r, now| {
            if r.paused {
                r.paused = false;
                r.paused_reason.clear();
                r.resumed_at = Some(now);
                r.updated_at = now;
            }
        })
        .await
    }

    /// Deletes a task; its runs are kept.
    pub async fn delete_task(&self, task_id: &str) -> Result<()> {
        if self.repo.delete_task(task_id).await? { Ok(()) } else { Err(Error::NotFound { kind: "task", id: task_id.to_string() }) }
    }

    fn view(&self, record: TaskRecord, cursor: Option<Cursor>) -> TaskView {
        let next_fire_at = if record.paused {
            None
        } else {
            // As the engine sees it: after a resume, the paused slots are
            // covered and the schedule goes on from the resume.
            let base = cursor.as_ref().and_then(|c| c.last_slot).unwrap_or(record.created_at);
            let base = record.resumed_at.map_or(base, |r| base.max(r));
            record.spec.schedules().ok().and_then(|s| next_slot(&s, base).map(|(t, _)| t))
        };
        let ended = ended_by_bounds(&record, cursor.as_ref(), self.clock.now());
        let next_fire_at = if ended.is_some() { None } else { next_fire_at };
        TaskView { record, cursor, next_fire_at, ended }
    }

    /// One task with its cursor.
    pub async fn get_task(&self, task_id: &str) -> Result<TaskView> {
        let (rec, _) = self.repo.get_task(task_id).await?.ok_or_else(|| Error::NotFound { kind: "task", id: task_id.to_string() })?;
        let cursor = self.repo.get_cursor(task_id).await?;
        Ok(self.view(rec, cursor))
    }

    /// Tasks by id, `limit` of them after `page_token` (a task id; empty =
    /// from the start). Returns the page and the next token (empty at the end).
    /// Reads only that page from the store.
    pub async fn list_tasks_page(&self, page_token: &str, limit: u32) -> Result<(Vec<TaskView>, String)> {
        let limit = if limit == 0 { DEFAULT_TASK_PAGE } else { limit.min(MAX_TASK_PAGE) } as usize;
        let (page, next) = self.repo.tasks_page(page_token, limit).await?;
        Ok((page.into_iter().map(|(rec, cursor)| self.view(rec, cursor)).collect(), next.unwrap_or_default()))
    }

    /// `ListTasks` with the tasks' last `slots` slots from the history
    /// (newest first; 0 = none): the tasks list's rows ([`TaskSummary`]),
    /// those `filter` admits. One history page per task, a few at a time;
    /// runs this replica's engine holds are shown as it knows them (ahead
    /// of the store). With a filter, tasks are read in pages of
    /// [`MAX_TASK_PAGE`] until `limit` pass (or the tasks end); the next
    /// token is the last one given. A text search tests each stored record
    /// before decoding it ([`crate::views::TaskFilter::raw_test`]): most
    /// are never decoded.
    ///
    /// Errors: `InvalidArgument` on `recent_slots` (more than
    /// [`crate::views::MAX_SLOT_CELLS`]); store and history errors.
    pub async fn task_summaries(
        &self,
        filter: &crate::views::TaskFilter,
        page_token: &str,
        limit: u32,
        slots: u32,
    ) -> Result<(Vec<TaskSummary>, String)> {
        if slots > crate::views::MAX_SLOT_CELLS {
            return Err(Error::invalid("recent_slots", format!("at most {} (got {slots})", crate::views::MAX_SLOT_CELLS)));
        }
        let limit = if limit == 0 { DEFAULT_TASK_PAGE } else { limit.min(MAX_TASK_PAGE) };
        if filter.is_empty() {
            let (tasks, next) = self.list_tasks_page(page_token, limit).await?;
            return Ok((self.with_slots(tasks, slots).await?, next));
        }
        // The last status needs each candidate's newest run.
        let slots_read = if filter.last_status.is_some() { slots.max(1) } else { slots };
        let (mut out, mut token) = (Vec::new(), page_token.to_string());
        let raw = filter.raw_test();
        loop {
            let (tasks, next) = self.repo.scan_tasks(&token, MAX_TASK_PAGE as usize, &raw).await?;
            let candidates: Vec<TaskView> =
                tasks.into_iter().map(|(rec, cursor)| self.view(rec, cursor)).filter(|t| filter.admits(t)).collect();
            for s in self.with_slots(candidates, slots_read).await? {
                let last = s.slots.first().map(|c| c.summary.status);
                if filter.last_status.is_none_or(|want| last == Some(want)) {
                    out.push(s);
                }
                if out.len() == limit as usize {
                    // More may follow this one.
                    let last = out.last().map(|s| s.task.record.spec.task_id.clone()).unwrap_or_default();
                    return Ok((out, last));
                }
            }
            if next.is_empty() {
                return Ok((out, String::new()));
            }
            token = next;
        }
    }

    /// Each task with its last `slots` slots.
    async fn with_slots(&self, tasks: Vec<TaskView>, slots: u32) -> Result<Vec<TaskSummary>> {
        if slots == 0 {
            return Ok(tasks.into_iter().map(|task| TaskSummary { task, slots: Vec::new() }).collect());
        }
        let mut reads = Vec::with_capacity(tasks.len());
        for t in &tasks {
            reads.push(self.recent_slots(&t.record.spec.task_id, slots));
        }
        let cells = futures::stream::iter(reads).buffered(8).collect::<Vec<_>>().await;
        let mut out = Vec::with_capacity(tasks.len());
        for (task, cells) in tasks.into_iter().zip(cells) {
            out.push(TaskSummary { task, slots: cells? });
        }
        Ok(out)
    }

    /// A task's last `n` slots from the history, newest first, live runs
    /// as this replica's engine knows them.
    pub async fn recent_slots(&self, task_id: &str, n: u32) -> Result<Vec<SlotCell>> {
        let q = HistoryQuery { task_id: task_id.to_string(), limit: n as usize, newest_first: true, ..Default::default() };
        let mut runs = self.history.page(&q).await?.runs;
        let live: Vec<String> = runs.iter().filter(|r| !r.status.is_terminal()).map(|r| r.run_id.clone()).collect();
        if !live.is_empty()
            && let Some(engine) = self.engine.read().ok().and_then(|g| g.clone())
            && let Ok(active) = engine.active_runs_among(live).await
        {
            for a in active {
                if let Some(r) = runs.iter_mut().find(|r| r.run_id == a.run_id) {
                    *r = a;
                }
            }
        }
        Ok(runs.iter().map(|r| SlotCell { summary: RunSummary::of(r) }).collect())
    }

    /// Fire times of `expr` in `tz` (under the DST policy `dst`) strictly
    /// after `after`, or of a task's triggers: the nominal slots, when
    /// each fires (jitter), and notes — what the DST policy does at the
    /// zone's next changes, the jitter, a bound that ended the task.
    pub async fn preview(
        &self,
        expr: &str,
        tz: &str,
        dst: crate::schedule::DstSpec,
        task_id: &str,
        after: Option<DateTime<Utc>>,
        count: u32,
    ) -> Result<Preview> {
        let after = after.unwrap_or_else(|| self.clock.now());
        if count > MAX_PREVIEW {
            return Err(Error::invalid("count", format!("at most {MAX_PREVIEW} fire times (got {count})")));
        }
        let count = if count == 0 { 5 } else { count };
        let (schedules, id, mut notes) = match (expr.is_empty(), task_id.is_empty()) {
            (false, true) => {
                let tz = if tz.is_empty() { "UTC" } else { tz };
                let c = CronSchedule::parse(expr, tz, dst).map_err(|e| e.at("preview"))?;
                (vec![Schedule::plain(Shape::Cron(std::sync::Arc::new(c)))], String::new(), Vec::new())
            }
            (true, false) => {
                let view = self.get_task(task_id).await?;
                let s = view.record.spec.schedules()?;
                let mut notes: Vec<String> = view.ended.map(|e| format!("no slot left: {e}")).into_iter().collect();
                if view.record.paused {
                    notes.push("paused: no slot fires until the task is resumed".into());
                }
                (s, task_id.to_string(), notes)
            }
            _ => return Err(Error::invalid("expr", "give either expr (with timezone) or task_id")),
        };
        let times = if notes.is_empty() { preview_times(&schedules, after, count) } else { Vec::new() };
        let fires = times
            .iter()
            .map(|t| next_slot(&schedules, *t - chrono::Duration::milliseconds(1)).map_or(*t, |(_, s)| s.fire_at(&id, *t)))
            .collect();
        for s in &schedules {
            notes.extend(s.dst_effects(after));
            match s.jitter {
                crate::schedule::Jitter::Auto(ms) => notes.push(format!(
                    "jitter: auto: each slot fires {} ms after it (a fixed offset of this task, bound {} ms: a tenth of the period, at most 15 min)",
                    crate::schedule::auto_offset(&id, ms).num_milliseconds(),
                    ms
                )),
                crate::schedule::Jitter::PerSlot(ms) => notes.push(format!("jitter_seconds: each slot fires up to {} s after it", ms / 1000)),
                crate::schedule::Jitter::None => {}
            }
        }
        Ok(Preview { zone: schedules.iter().find_map(Schedule::zone), times, fires, notes })
    }

    /// Manual trigger (leader).
    pub async fn trigger(&self, req: TriggerRequest) -> Result<Triggered> {
        if self.repo.get_task(&req.task_id).await?.is_none() {
            return Err(Error::NotFound { kind: "task", id: req.task_id });
        }
        self.engine().await?.trigger(req).await
    }

    /// `PublishEvent`: one run per task with an event trigger on `topic`,
    /// per `key` (the same key again within `ttl` — a duration, 24 h when
    /// empty, at most 30 days — finds the same runs, `created: false`;
    /// afterwards it makes new ones). Each task's run goes through the event admission (every
    /// policy applies) with trigger kind `event`; the agent gets
    /// `context.event = {source: event, name: topic, key, received_at,
    /// body: the payload}`. Returns once every run is committed, in task
    /// id order, with what became of each.
    ///
    /// Errors: `InvalidArgument` naming `topic`, `idempotency_key`,
    /// `idempotency_ttl` or `payload_json` (not JSON, over 64 KiB);
    /// `Unavailable` off the leader.
    pub async fn publish_event(&self, topic: &str, payload_json: &str, key: &str, ttl: &str) -> Result<Vec<(String, EventAdmitted)>> {
        crate::model::trigger::validate_topic("topic", topic)?;
        crate::model::event::validate_key("idempotency_key", key)?;
        let window = crate::model::trigger::dedup_window("idempotency_ttl", ttl)?;
        if payload_json.len() > crate::model::task::MAX_PARAMS_BYTES {
            return Err(Error::invalid(
                "payload_json",
                format!("{} bytes; at most {} (it is kept whole with every run)", payload_json.len(), crate::model::task::MAX_PARAMS_BYTES),
            ));
        }
        let payload = if payload_json.trim().is_empty() { "null" } else { payload_json };
        serde_json::from_str::<serde_json::Value>(payload).map_err(|e| Error::invalid("payload_json", format!("not JSON: {e}")))?;
        let engine = self.engine().await?;
        let tasks = engine.topic_tasks(topic.to_string()).await?;
        let received_at = self.clock.now();
        let events = tasks
            .iter()
            .map(|task_id| {
                let mut ev = crate::events::event_request(
                    task_id,
                    crate::model::event::published_run_id(task_id, topic, key),
                    crate::model::run::TriggerKind::Event,
                    topic,
                    key,
                    received_at,
                    Default::default(),
                    Default::default(),
                    payload.as_bytes(),
                );
                ev.dedup_window = Some(window);
                ev
            })
            .collect();
        let answers = engine.events(events).await?;
        let mut out = Vec::new();
        for (task_id, a) in tasks.into_iter().zip(answers) {
            match a {
                Ok(a) => out.push((task_id, a)),
                // Deleted between the listing and the event.
                Err(Error::NotFound { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// `GetSchedulingStats`: figures of the runs (of `task_id`, or all when
    /// empty) whose slot is within the last `since` (0: one hour), from
    /// the stored records (see [`crate::stats`]).
    ///
    /// Errors: `InvalidArgument` on a malformed `task_id` or a `since` over
    /// 100 years; store errors.
    pub async fn scheduling_stats(&self, task_id: &str, since: std::time::Duration) -> Result<crate::stats::SchedulingStats> {
        if !task_id.is_empty() {
            crate::model::task::validate_id("task_id", task_id)?;
        }
        let since = if since.is_zero() { std::time::Duration::from_secs(3600) } else { since };
        let since = chrono::Duration::from_std(since)
            .ok()
            .filter(|d| *d <= chrono::Duration::days(36_500))
            .ok_or_else(|| Error::invalid("since_seconds", "must be at most 100 years"))?;
        let until = self.clock.now();
        let mut c = crate::stats::Collector::new(until - since, until);
        let window = HistoryQuery {
            task_id: task_id.to_string(),
            from: Some(until - since),
            to: Some(until + chrono::Duration::nanoseconds(1)),
            limit: MAX_RUN_LIMIT as usize,
            ..HistoryQuery::default()
        };
        history::scan(self.history.as_ref(), &window, |run| c.add(&run)).await?;
        Ok(c.finish())
    }

    /// `ListNotifications`: newest first, of `status` (`None`: all) and
    /// `task_id` (empty: all), at most `limit` (0: 100; capped at 1,000).
    pub async fn list_notifications(
        &self,
        status: Option<crate::model::notification::DeliveryStatus>,
        task_id: &str,
        limit: u32,
    ) -> Result<Vec<crate::model::notification::Notification>> {
        use crate::model::notification::DeliveryStatus;
        let mut all = Vec::new();
        if status != Some(DeliveryStatus::Delivered) {
            all.extend(self.repo.outbox().await?.into_iter().map(|(n, _)| n));
        }
        if status.is_none() || status == Some(DeliveryStatus::Delivered) {
            all.extend(self.repo.delivered().await?.into_iter().map(|(n, _)| n));
        }
        all.retain(|n| status.is_none_or(|s| n.status == s) && (task_id.is_empty() || n.task_id == task_id));
        all.sort_by(|a, b| b.created_at.cmp(&a.created_at).then_with(|| b.id.cmp(&a.id)));
        all.truncate(if limit == 0 { DEFAULT_RUN_LIMIT } else { limit.min(MAX_RUN_LIMIT) } as usize);
        for n in &mut all {
            n.payload = serde_json::Value::Null;
        }
        Ok(all)
    }

    /// `RetryNotification`: see [`Repo::retry_notification`].
    pub async fn retry_notification(&self, id: &str) -> Result<crate::model::notification::Notification> {
        let mut n = self.repo.retry_notification(id, self.clock.now()).await?;
        n.payload = serde_json::Value::Null;
        Ok(n)
    }

    /// `ResetBreaker`: closes the task's circuit breaker (served by the
    /// leader). Errors: `NotFound`, `FailedPrecondition` (no breaker),
    /// `Unavailable` on a follower (naming the leader).
    pub async fn reset_breaker(&self, task_id: &str) -> Result<crate::model::breaker::Breaker> {
        if self.repo.get_task(task_id).await?.is_none() {
            return Err(Error::NotFound { kind: "task", id: task_id.to_string() });
        }
        self.engine().await?.reset_breaker(task_id.to_string()).await
    }

    /// What a run's page shows beside its record: the notifications it
    /// sent (pending, dead, delivered; payloads left out) and the runs that
    /// followed it (`after` triggers; ids `{task}.after-{run id}`, at most
    /// [`crate::engine::core::policy::dependencies::MAX_FOLLOWERS`]).
    /// Followers are the leader's to know: elsewhere they are an
    /// `Unavailable` error, the notifications still read.
    pub async fn run_links(&self, run: &RunRecord) -> (Result<Vec<crate::model::notification::Notification>>, Result<Vec<RunSummary>>) {
        let base = crate::model::notification::notification_base(run);
        let notes = self.repo.notifications_of(&base).await.map(|v| {
            v.into_iter()
                .map(|(mut n, _)| {
                    n.payload = serde_json::Value::Null;
                    n
                })
                .filter(|n| n.run_id == run.run_id)
                .collect()
        });
        let downstream = async {
            let task = run.task_id.clone();
            let followers = self.engine().await?.query(move |c, _| c.followers_of(&task)).await?;
            let mut out = Vec::new();
            for f in followers {
                match self.get_run(&crate::model::event::after_run_id(&f, &run.run_id)).await {
                    Ok(r) => out.push(RunSummary::of(&r)),
                    Err(Error::NotFound { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(out)
        };
        (notes, downstream.await)
    }

    /// One run: as the leader knows it now when it is active here (start
    /// and progress are written lazily), else as stored.
    pub async fn get_run(&self, run_id: &str) -> Result<RunRecord> {
        if let Some(engine) = self.engine.read().ok().and_then(|g| g.clone())
            && let Ok(Some(run)) = engine.active_run(run_id.to_string()).await
        {
            return Ok(run);
        }
        if let Some(run) = self.repo.get_run(run_id).await? {
            return Ok(run);
        }
        self.history.get(run_id).await?.ok_or_else(|| Error::NotFound { kind: "run", id: run_id.to_string() })
    }

    /// `ListRuns`: one page of the runs `q` selects, read from the
    /// history ([`Core::history`]) in `q`'s order, from `page_token` on
    /// (a previous page's; empty: the first); `q.limit` 0 is 100, more than
    /// 1,000 is 1,000. Returns the runs (output tails left out: `GetRun`
    /// has them) and where the next page starts (`None`: the last page).
    ///
    /// Errors: `InvalidArgument` on `task_id` (not a task id) or
    /// `page_token` (malformed, or made for another query); store errors.
    pub async fn list_runs(&self, q: HistoryQuery, page_token: &str) -> Result<(Vec<RunRecord>, Option<history::Cursor>)> {
        if !q.task_id.is_empty() {
            crate::model::task::validate_id("task_id", &q.task_id)?;
        }
        if let (Some(f), Some(t)) = (q.from, q.to)
            && f > t
        {
            return Err(Error::invalid("scheduled_to", "is before scheduled_from"));
        }
        let mut q = q;
        q.limit = if q.limit == 0 { DEFAULT_RUN_LIMIT as usize } else { q.limit.min(MAX_RUN_LIMIT as usize) };
        if !page_token.is_empty() {
            q.after = Some(history::decode_token("page_token", &q, page_token)?);
        }
        let page = self.history.page(&q).await?;
        let mut runs = page.runs;
        // Listings leave out the output tails (up to 64 KiB each); GetRun has them.
        for r in &mut runs {
            r.stdout_tail.clear();
            r.stderr_tail.clear();
        }
        Ok((runs, page.next))
    }

    /// Deletes the finished runs beyond their tasks' history now, of one
    /// task or all (leader).
    ///
    /// Errors: `Unavailable` naming the leader on a follower; store errors.
    ///
    /// While the store has its `NOSPACE` alarm raised (etcd full: no leader
    /// can be elected or write), any replica prunes without a leader: the
    /// deletes are each conditional on the run being unchanged since it was
    /// listed and not active, so they are safe unfenced; the store's
    /// history is then compacted. Freeing the space also takes etcd's own
    /// defragmentation and disarming the alarm, which the answer says.
    pub async fn prune_runs(&self, task_id: &str) -> Result<crate::engine::retention::PruneReport> {
        let engine = match self.engine().await {
            Ok(e) => Some(e),
            Err(e) if self.repo.store().alarms().await.unwrap_or_default().iter().any(|a| a == "NOSPACE") => {
                tracing::warn!(error = %e, "pruning without a leader: the store's NOSPACE alarm is raised");
                None
            }
            Err(e) => return Err(e),
        };
        let unfenced = crate::election::Leadership { token: 0, fence: Vec::new() };
        let lead = engine.as_ref().map_or(&unfenced, |e| e.leadership());
        let mut report = crate::engine::retention::prune(&self.repo, lead, &self.retention, self.clock.now(), task_id).await?;
        if self.repo.store().alarms().await.unwrap_or_default().iter().any(|a| a == "NOSPACE") {
            // The deletes free space only once compacted (up to now: the
            // pass's starting revision still holds every deleted value) and
            // defragmented.
            let now = self.repo.current_revision().await?;
            self.repo.store().compact(now).await?;
            let how = if engine.is_none() { "pruned without a leader" } else { "pruned" };
            report.note = Some(format!("{how} while the store's NOSPACE alarm is raised; {}", crate::store::etcd::NOSPACE_HELP));
        }
        tracing::info!(task_id, deleted = report.deleted, kept = report.kept, "runs pruned on request");
        Ok(report)
    }

    /// Cancels a run (leader).
    pub async fn cancel_run(&self, run_id: &str, reason: &str) -> Result<RunRecord> {
        self.engine().await?.cancel_run(run_id.to_string(), reason.to_string()).await
    }

    /// `runs rerun RUN`: a new run with `run_id`'s input — its params, its
    /// event (`context.event`, a stored body stored again) and upstream —
    /// under `{run_id}.rerun-{n}` (n: one more than its re-runs kept), with
    /// `rerun_of`. Through the event admission: every policy applies, and
    /// the id is create-if-absent. Leader only.
    ///
    /// Errors: `NotFound`; `FailedPrecondition` for a run not finished.
    pub async fn rerun(&self, run_id: &str, dry_run: bool) -> Result<Rerun> {
        let run = self.get_run(run_id).await?;
        if !run.status.is_terminal() {
            return Err(Error::FailedPrecondition(format!("run {run_id} is {}: re-run a run once it has ended", run.status.as_str())));
        }
        // Another re-run of the same run made at the same moment takes the
        // number first: the next one is tried (create-if-absent decides).
        for _ in 0..8 {
            // One more than the highest kept (a pruned one never makes its
            // number taken twice while a later one is kept).
            let n = self
                .repo
                .rerun_ids(run_id)
                .await?
                .iter()
                .filter_map(|id| id.rsplit_once(crate::model::run::RERUN_INFIX).and_then(|(_, n)| n.parse::<usize>().ok()))
                .max()
                .unwrap_or(0)
                + 1;
            let new = crate::model::run::rerun_run_id(run_id, n);
            if dry_run {
                return Ok(Rerun { of: run_id.to_string(), run_id: new, created: false, skipped: None });
            }
            let r =
                self.rerun_all(vec![(run.clone(), new)]).await?.pop().ok_or_else(|| Error::Internal("no answer for the re-run".into()))?;
            if r.created {
                return Ok(r);
            }
        }
        Err(Error::Unavailable { reason: format!("run {run_id} is being re-run concurrently; try again"), leader: None })
    }

    /// `runs rerun --task T --status S --since ..`: each run of `q`
    /// (task, status, slot window; at most `q.limit`) that has no re-run
    /// yet gets one, `{run}.rerun-1`, so the same call again creates
    /// nothing; those with one say so. Leader only. Errors: `NotFound`
    /// for a task that does not exist; `InvalidArgument` without a status.
    pub async fn rerun_matching(&self, q: HistoryQuery, dry_run: bool) -> Result<Vec<Rerun>> {
        crate::model::task::validate_id("task_id", &q.task_id)?;
        if q.status.is_none() {
            return Err(Error::invalid("status", "a bulk re-run names the status it re-runs (e.g. FAILED)"));
        }
        // A task that does not exist is NotFound, not "nothing matched".
        self.get_task(&q.task_id).await?;
        let limit = q.limit;
        let mut out = Vec::new();
        let mut todo = Vec::new();
        let (mut token, mut seen) = (String::new(), 0usize);
        loop {
            let mut page_q = q.clone();
            page_q.limit = 500;
            let (runs, next) = self.list_runs(page_q.clone(), &token).await?;
            for run in runs {
                if seen >= limit {
                    break;
                }
                seen += 1;
                // A re-run is not re-run again in bulk (its run is re-run
                // by hand): the same call again creates nothing.
                if let Some(of) = &run.rerun_of {
                    out.push(Rerun {
                        of: run.run_id.clone(),
                        run_id: run.run_id.clone(),
                        created: false,
                        skipped: Some(format!("a re-run of {of}")),
                    });
                    continue;
                }
                let reruns = self.repo.rerun_ids(&run.run_id).await?;
                if let Some(first) = reruns.first() {
                    out.push(Rerun {
                        of: run.run_id.clone(),
                        run_id: first.clone(),
                        created: false,
                        skipped: Some("re-run already".into()),
                    });
                    continue;
                }
                let new = crate::model::run::rerun_run_id(&run.run_id, 1);
                if dry_run {
                    out.push(Rerun { of: run.run_id.clone(), run_id: new, created: false, skipped: None });
                } else {
                    todo.push((run, new));
                }
            }
            match next {
                Some(c) if seen < limit => token = history::encode_token(&page_q, &c),
                _ => break,
            }
        }
        for chunk in todo.chunks(256) {
            out.extend(self.rerun_all(chunk.to_vec()).await?);
        }
        Ok(out)
    }

    /// Admits the re-runs `(run, new id)` as one batch of events.
    async fn rerun_all(&self, runs: Vec<(RunRecord, String)>) -> Result<Vec<Rerun>> {
        let engine = self.engine().await?;
        let stored: Vec<String> =
            runs.iter().filter(|(r, _)| r.event.as_ref().is_some_and(|e| e.body_stored)).map(|(r, _)| r.run_id.clone()).collect();
        let mut bodies: std::collections::HashMap<String, Vec<u8>> = std::collections::HashMap::new();
        for (id, body) in stored.iter().zip(self.repo.event_bodies(&stored).await?) {
            if let Some(b) = body {
                bodies.insert(id.clone(), b);
            }
        }
        let now = self.clock.now();
        let reqs = runs.iter().map(|(r, new)| crate::engine::EventRequest::rerun(r, new.clone(), bodies.remove(&r.run_id), now)).collect();
        let answers = engine.events(reqs).await?;
        runs.into_iter()
            .zip(answers)
            .map(|((r, _), a)| a.map(|a| Rerun { of: r.run_id, run_id: a.run_id, created: a.created, skipped: None }))
            .collect()
    }

    /// `task backfill`: validates `spec` (its range, at most
    /// [`crate::model::backfill::MAX_BACKFILL_SLOTS`] slots of the task's
    /// time triggers), then either lists what each slot would get
    /// (`dry_run`: nothing is written) or starts the backfill on the leader.
    ///
    /// Errors: `InvalidArgument` naming the field; `NotFound` (task).
    pub async fn backfill(&self, spec: crate::model::backfill::BackfillSpec, dry_run: bool) -> Result<BackfillPlan> {
        use crate::engine::core::sources::backfill::{BackfillOp, plan_slots};
        use crate::model::backfill::{Backfill, MAX_BACKFILL_SLOTS, decide};
        let now = self.clock.now();
        spec.validate(now)?;
        let view = self.get_task(&spec.task_id).await?;
        let scheds = view.record.spec.schedules()?;
        if scheds.is_empty() {
            return Err(Error::invalid("task_id", "the task has no time trigger: it has no slots to backfill"));
        }
        let slots = plan_slots(&scheds, spec.from, spec.to, spec.order)
            .ok_or_else(|| Error::invalid("from", format!("the range has more than {MAX_BACKFILL_SLOTS} slots; backfill it in parts")))?;
        if !dry_run {
            // Milliseconds and a few bits of the nanoseconds: two started
            // in one millisecond get two ids.
            let id = format!("bf-{}-{}-{:03x}", spec.task_id, now.timestamp_millis(), now.timestamp_subsec_nanos() % 4096);
            let rec = Backfill::start(id, spec, slots.len() as u64, now);
            let b = self.engine().await?.backfill(BackfillOp::Create(Box::new(rec))).await?;
            return Ok(BackfillPlan { backfill: Some(b), listing: Vec::new() });
        }
        let mut listing = Vec::with_capacity(slots.len());
        for slot in slots {
            let run_id = crate::model::run::slot_run_id(&spec.task_id, slot);
            if scheds.iter().any(|s| s.gap_slots(slot) > 0) {
                listing.push((slot, run_id, "dst_gap".to_string()));
                continue;
            }
            let run = match self.get_run(&run_id).await {
                Ok(r) => Some(r),
                Err(Error::NotFound { .. }) => None,
                Err(e) => return Err(e),
            };
            let linked = crate::model::run::rerun_run_id(&run_id, 1);
            let rerun_exists = run.is_some() && self.repo.get_run(&linked).await?.is_some();
            let verdict = decide(spec.reprocess, run.as_ref(), rerun_exists);
            let shown = if verdict == crate::model::backfill::Verdict::Rerun { linked } else { run_id };
            listing.push((slot, shown, verdict.words()));
        }
        Ok(BackfillPlan { backfill: None, listing })
    }

    /// Backfills as stored: one task's (`task_id` non-empty) or all, newest first.
    pub async fn backfills(&self, task_id: &str) -> Result<Vec<crate::model::backfill::Backfill>> {
        let mut all: Vec<_> =
            self.repo.load_backfills().await?.into_iter().filter(|b| task_id.is_empty() || b.spec.task_id == task_id).collect();
        all.sort_by(|a, b| b.created_at.cmp(&a.created_at).then_with(|| a.id.cmp(&b.id)));
        Ok(all)
    }

    /// One backfill as stored.
    pub async fn get_backfill(&self, id: &str) -> Result<crate::model::backfill::Backfill> {
        self.repo.get_backfill(id).await?.ok_or_else(|| Error::NotFound { kind: "backfill", id: id.to_string() })
    }

    /// `backfills pause|resume|cancel` (leader).
    pub async fn change_backfill(
        &self,
        op: crate::engine::core::sources::backfill::BackfillOp,
    ) -> Result<crate::model::backfill::Backfill> {
        self.engine().await?.backfill(op).await
    }

    /// The re-runs of `run_id` kept in the store (`rerun_of` read the other way).
    pub async fn reruns_of(&self, run_id: &str) -> Result<Vec<String>> {
        self.repo.rerun_ids(run_id).await
    }

    /// Matching runs now (as stored, a page at a time as the client reads
    /// them), then every change as this replica's lifecycle bus reports it,
    /// through a bounded queue ([`crate::watch`]). A watcher that falls
    /// behind loses its queue and catches up with a new listing, a page at
    /// a time (it may see a run twice, never misses a change).
    ///
    /// Errors: `Unavailable` when too many watches are open; the stream's
    /// items: a store read failing.
    pub async fn watch_runs(&self, task_id: &str, run_id: &str) -> Result<futures::stream::BoxStream<'static, Result<RunRecord>>> {
        let task_id =
            if task_id.is_empty() && !run_id.is_empty() { crate::model::run::task_of_run(run_id).to_string() } else { task_id.to_string() };
        let filter = crate::watch::WatchFilter { task_id, run_id: (!run_id.is_empty()).then(|| run_id.to_string()) };
        // Subscribe first, then read: no change falls in between.
        let sub = self.watchers.subscribe(filter.clone())?;
        let engine = self.engine.read().ok().and_then(|g| g.clone());
        let state = Watch {
            sub,
            hub: self.watchers.clone(),
            repo: self.repo.clone(),
            engine,
            filter,
            page: std::collections::VecDeque::new(),
            after: Some(String::new()),
        };
        let stream = futures::stream::unfold(Some(state), |state| async move {
            let mut w = state?;
            match w.next().await {
                Ok(Some(r)) => Some((Ok(r), Some(w))),
                Ok(None) => None,
                Err(e) => Some((Err(e), None)),
            }
        });
        Ok(stream.boxed())
    }

    /// The cluster as this replica sees it: replicas (by id), the leader
    /// and whether it answers, the store, the running config's version.
    pub async fn cluster_view(&self) -> crate::views::ClusterView {
        let l = self.leader().await.unwrap_or_default();
        let mut members: Vec<crate::views::MemberView> = self
            .election
            .members()
            .await
            .into_iter()
            .map(|(id, advertise_address)| crate::views::MemberView { is_leader: id == l.leader_id, id, advertise_address })
            .collect();
        members.sort_by(|a, b| a.id.cmp(&b.id));
        let leader_unresponsive = self.leader_unresponsive(&l).await;
        crate::views::ClusterView {
            members,
            leader_id: l.leader_id,
            leader_address: l.advertise_address,
            fencing_token: l.token,
            leader_unresponsive,
            store: self.repo.store().describe(),
            answered_by: self.election.id(),
            config_version: self.config.current().version,
        }
    }

    /// The config's shared resources as the leader holds them (leader).
    pub async fn list_resources(&self) -> Result<Vec<crate::views::ResourceView>> {
        self.engine().await?.query(|c, now| c.policy_views(now).resources).await
    }

    /// `ReleaseResource`: ends a resource's hold-back now (an agent's
    /// `rate_limited` or `quota_exhausted`), on the leader.
    ///
    /// Errors: `NotFound` (not a resource of the config); `Unavailable`
    /// when this replica is not the leader.
    pub async fn release_resource(&self, name: &str) -> Result<crate::views::ResourceView> {
        self.engine().await?.release_resource(name.to_string()).await
    }

    /// The config's budgets as the leader holds them now.
    ///
    /// Errors: `Unavailable` when this replica is not the leader.
    pub async fn list_budgets(&self) -> Result<Vec<crate::views::BudgetView>> {
        self.engine().await?.query(|c, now| c.policy_views(now).budgets).await
    }

    /// Resources and budgets in one engine query (leader), for a page that
    /// shows both.
    pub async fn policy_views(&self) -> Result<crate::views::PolicyViews> {
        self.engine().await?.query(|c, now| c.policy_views(now)).await
    }

    /// Connected runners (leader).
    pub async fn list_runners(&self) -> Result<Vec<RunnerView>> {
        self.engine().await?.query(|c, _| c.runner_views()).await
    }
}

/// What a raised store alarm means, for readiness and errors.
fn alarm_reason(alarm: &str) -> String {
    match alarm {
        "NOSPACE" => format!("store alarm NOSPACE: {}", crate::store::etcd::NOSPACE_HELP),
        other => format!("store alarm {other}: etcd refuses writes until the alarm is resolved and disarmed (etcdctl alarm list)"),
    }
}

/// One watch's state: the listing's next page, then the live queue.
struct Watch {
    sub: crate::watch::Subscription,
    hub: crate::watch::RunWatchers,
    repo: Repo,
    engine: Option<EngineHandle>,
    filter: crate::watch::WatchFilter,
    /// Runs of the listing read but not yet sent.
    page: std::collections::VecDeque<RunRecord>,
    /// Where the listing goes on (`None`: listed).
    after: Option<String>,
}

impl Watch {
    /// The next run to send: the listing's, then live changes. `Ok(None)`:
    /// the watch ended (the replica stops).
    async fn next(&mut self) -> Result<Option<RunRecord>> {
        loop {
            if let Some(r) = self.page.pop_front() {
                return Ok(Some(r));
            }
            let Some(after) = self.after.take() else { break };
            let (mut runs, next) = match &self.filter.run_id {
                Some(id) => (self.repo.get_run(id).await?.into_iter().collect(), None),
                None => self.repo.runs_page(&self.filter.task_id, &after, crate::watch::LISTING_PAGE).await?,
            };
            // The leader's memory is ahead of the store for what it writes lazily.
            if let Some(engine) = &self.engine
                && let Ok(active) = engine.active_runs_among(runs.iter().map(|r| r.run_id.clone()).collect()).await
            {
                for a in active {
                    if let Some(r) = runs.iter_mut().find(|r| r.run_id == a.run_id) {
                        *r = a;
                    }
                }
            }
            self.page.extend(runs.into_iter().filter(|r| self.filter.matches(r)));
            self.after = next;
        }
        match self.sub.rx.recv().await {
            Some(r) => Ok(Some(RunRecord::clone(&r))),
            None if self.sub.behind.load(std::sync::atomic::Ordering::Relaxed) => {
                // Fell behind: its queue is gone. It catches up as a new
                // watch does — subscribed again, then the listing, a page
                // at a time — so what it missed comes with the listing and
                // nothing is held for it meanwhile.
                self.sub = self.hub.subscribe(self.filter.clone())?;
                self.after = Some(String::new());
                tracing::debug!(task_id = %self.filter.task_id, "run watch fell behind; listing again");
                Box::pin(self.next()).await
            }
            None => Ok(None),
        }
    }
}

/// Publishes every stored run change on `bus` as [`Lifecycle::RunUpdated`]
/// while this replica does not lead (its watchers then see the leader's
/// writes), watching again after a pause whenever the watch breaks (the
/// store may be without quorum). Ends when `stop` resolves.
pub async fn relay_stored_runs(repo: Repo, bus: LifecycleBus, stop: impl std::future::Future<Output = ()>) {
    const RETRY: std::time::Duration = std::time::Duration::from_secs(1);
    let mut stop = std::pin::pin!(stop);
    loop {
        let watch = tokio::select! {
            _ = &mut stop => return,
            w = repo.watch_runs("") => w,
        };
        match watch {
            Ok(mut watch) => loop {
                tokio::select! {
                    _ = &mut stop => return,
                    ev = watch.next() => match ev {
                        Some(Ok(run)) => {
                            let _ = bus.send(Lifecycle::RunUpdated(Arc::new(run)));
                        }
                        Some(Err(e)) => {
                            tracing::warn!(error = %e, "run watch broke; watching again");
                            break;
                        }
                        None => break,
                    },
                }
            },
            Err(e) => tracing::warn!(error = %e, "cannot watch runs for this replica's watchers; retrying"),
        }
        tokio::select! {
            _ = &mut stop => return,
            _ = tokio::time::sleep(RETRY) => {}
        }
    }
}

/// `count` slots strictly after `after` that run: an instant that stands
/// for local times a DST change skipped under `dst.gap: skip` is a
/// SKIPPED `dst_gap` record, not a run, and is left out (the DST notes
/// say so).
pub fn preview_times(schedules: &[Schedule], after: DateTime<Utc>, count: u32) -> Vec<DateTime<Utc>> {
    let mut out = Vec::new();
    let mut t = after;
    while out.len() < count as usize {
        match next_slot(schedules, t) {
            Some((n, _)) => {
                if schedules.iter().all(|s| s.gap_slots(n) == 0) {
                    out.push(n);
                }
                t = n;
            }
            None => break,
        }
    }
    out
}
