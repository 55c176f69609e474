//! The key layout: every key the control plane reads or writes, built
//! under one prefix. Nothing else formats keys.

/// Builds every key the control plane uses, under one prefix.
#[derive(Debug, Clone)]
pub struct Keys {
    prefix: String,
}

impl Default for Keys {
    fn default() -> Self {
        Keys::new("/punchclock/")
    }
}

impl Keys {
    /// Keys under `prefix` (a trailing `/` is added if missing).
    pub fn new(prefix: &str) -> Self {
        let mut p = prefix.to_string();
        if !p.ends_with('/') {
            p.push('/');
        }
        Keys { prefix: p }
    }
    /// `{prefix}tasks/`
    pub fn tasks(&self) -> String {
        format!("{}tasks/", self.prefix)
    }
    /// `{prefix}tasks/{id}`: a [`crate::model::TaskRecord`].
    pub fn task(&self, id: &str) -> String {
        format!("{}tasks/{id}", self.prefix)
    }
    /// `{prefix}schedule/`
    pub fn cursors(&self) -> String {
        format!("{}schedule/", self.prefix)
    }
    /// `{prefix}schedule/{id}`: a [`crate::model::Cursor`].
    pub fn cursor(&self, id: &str) -> String {
        format!("{}schedule/{id}", self.prefix)
    }
    /// `{prefix}runs/`
    pub fn runs(&self) -> String {
        format!("{}runs/", self.prefix)
    }
    /// `{prefix}runs/{task_id}.`: every run of one task.
    pub fn runs_of(&self, task_id: &str) -> String {
        format!("{}runs/{task_id}.", self.prefix)
    }
    /// `{prefix}runs/{run_id}`: a [`crate::model::RunRecord`].
    pub fn run(&self, run_id: &str) -> String {
        format!("{}runs/{run_id}", self.prefix)
    }
    /// `{prefix}active/`: index of non-terminal runs.
    pub fn active_runs(&self) -> String {
        format!("{}active/", self.prefix)
    }
    /// `{prefix}active/{run_id}`: present while the run is not terminal.
    pub fn active_run(&self, run_id: &str) -> String {
        format!("{}active/{run_id}", self.prefix)
    }
    /// `{prefix}hist/`: every run by its slot (the time index).
    pub fn history(&self) -> String {
        format!("{}hist/", self.prefix)
    }
    /// `{prefix}hist/{slot}.{run_id}`, the slot as 20 digits of
    /// nanoseconds since 1970 (UTC), so key order is slot order: written
    /// with each write of the run (a run's slot never changes).
    pub fn history_entry(&self, scheduled_at: chrono::DateTime<chrono::Utc>, run_id: &str) -> String {
        Keys::history_key(&self.history(), scheduled_at, run_id)
    }
    /// `{index}{slot}.{run_id}` under a time index prefix ([`Keys::history`]
    /// or [`Keys::task_history`]); with an empty `run_id`, `{index}{slot}`
    /// (every entry of that slot sorts after it, every earlier slot's before).
    pub fn history_key(index: &str, scheduled_at: chrono::DateTime<chrono::Utc>, run_id: &str) -> String {
        match run_id {
            "" => format!("{index}{:020}", slot_nanos(scheduled_at)),
            _ => format!("{index}{:020}.{run_id}", slot_nanos(scheduled_at)),
        }
    }
    /// `{prefix}hist-task/{task_id}/`: one task's runs by slot.
    pub fn task_history(&self, task_id: &str) -> String {
        format!("{}hist-task/{task_id}/", self.prefix)
    }
    /// `{prefix}hist-task/{task_id}/{slot}.{run_id}`: as
    /// [`Keys::history_entry`], under the task.
    pub fn task_history_entry(&self, task_id: &str, scheduled_at: chrono::DateTime<chrono::Utc>, run_id: &str) -> String {
        Keys::history_key(&self.task_history(task_id), scheduled_at, run_id)
    }
    /// The slot and the run of a time index key's suffix (after
    /// [`Keys::history`] or [`Keys::task_history`]).
    pub fn history_parts(suffix: &str) -> Option<(chrono::DateTime<chrono::Utc>, &str)> {
        let (nanos, run_id) = suffix.split_once('.')?;
        let n: i64 = nanos.parse().ok()?;
        Some((chrono::DateTime::from_timestamp_nanos(n), run_id))
    }
    /// `{prefix}hist-out/`: finished runs waiting to move to the archive.
    pub fn archive_out(&self) -> String {
        format!("{}hist-out/", self.prefix)
    }
    /// `{prefix}hist-out/{run_id}`: written with a run's final record when
    /// the history is PostgreSQL; deleted with the run once archived.
    pub fn archive_out_item(&self, run_id: &str) -> String {
        format!("{}hist-out/{run_id}", self.prefix)
    }
    /// `{prefix}dedup/`: event ids' dedup keys.
    pub fn dedups(&self) -> String {
        format!("{}dedup/", self.prefix)
    }
    /// `{prefix}dedup/{key}`: a [`crate::model::event::DedupClaim`]; `key`
    /// is the event's id run (`{task}.{kind}-{digest of scope and id}`).
    pub fn dedup(&self, key: &str) -> String {
        format!("{}dedup/{key}", self.prefix)
    }
    /// `{prefix}events/{run_id}`: the body of the event that started a
    /// run, when too large for its record (raw bytes as received).
    pub fn event_body(&self, run_id: &str) -> String {
        format!("{}events/{run_id}", self.prefix)
    }
    /// `{prefix}backfills/`: every backfill.
    pub fn backfills(&self) -> String {
        format!("{}backfills/", self.prefix)
    }
    /// `{prefix}backfills/{id}`: a [`crate::model::backfill::Backfill`].
    pub fn backfill(&self, id: &str) -> String {
        format!("{}backfills/{id}", self.prefix)
    }
    /// `{prefix}outbox/`: notifications to deliver (pending) or dead-lettered.
    pub fn outbox(&self) -> String {
        format!("{}outbox/", self.prefix)
    }
    /// `{prefix}outbox/{id}`: a [`crate::model::notification::Notification`].
    pub fn outbox_item(&self, id: &str) -> String {
        format!("{}outbox/{id}", self.prefix)
    }
    /// `{prefix}notifications/`: delivery records of delivered notifications.
    pub fn delivered(&self) -> String {
        format!("{}notifications/", self.prefix)
    }
    /// `{prefix}notifications/{id}`: a delivered notification without its payload.
    pub fn delivered_item(&self, id: &str) -> String {
        format!("{}notifications/{id}", self.prefix)
    }
    /// `{prefix}applies/`: journals of applies too large for one
    /// transaction (see [`crate::repo::apply`]).
    pub fn applies(&self) -> String {
        format!("{}applies/", self.prefix)
    }
    /// `{prefix}applies/{id}/`: one apply's journal.
    pub fn apply(&self, id: &str) -> String {
        format!("{}applies/{id}/", self.prefix)
    }
    /// `{prefix}applies/{id}/chunk-{n:06}`: a JSON array of task specs.
    pub fn apply_chunk(&self, id: &str, n: usize) -> String {
        format!("{}applies/{id}/chunk-{n:06}", self.prefix)
    }
    /// `{prefix}applies/{id}/ready`: present once every chunk is written
    /// (the number of chunks).
    pub fn apply_ready(&self, id: &str) -> String {
        format!("{}applies/{id}/ready", self.prefix)
    }
    /// `{prefix}election/`
    pub fn election(&self) -> String {
        format!("{}election/", self.prefix)
    }
    /// `{prefix}election/leader`: the leader's member record, on its lease;
    /// its create revision is the fencing token.
    pub fn election_leader(&self) -> String {
        format!("{}election/leader", self.prefix)
    }
    /// `{prefix}election/members/`
    pub fn election_members(&self) -> String {
        format!("{}election/members/", self.prefix)
    }
    /// `{prefix}election/members/{id}`: a live replica, on its lease.
    pub fn election_member(&self, id: &str) -> String {
        format!("{}election/members/{id}", self.prefix)
    }
    /// `{prefix}budgets/`: the budgets' ledger.
    pub fn budgets(&self) -> String {
        format!("{}budgets/", self.prefix)
    }
    /// `{prefix}budgets/{name}/{window_start}/total`: the spend folded so
    /// far of one window ([`crate::model::budget::Amount`]; the window's
    /// start in Unix seconds).
    pub fn budget_total(&self, name: &str, window_start: i64) -> String {
        format!("{}budgets/{name}/{window_start}/total", self.prefix)
    }
    /// `{prefix}budgets/{name}/{window_start}/runs/{run_id}`: one run's
    /// settled spend, written with its final record; folded into the
    /// total later.
    pub fn budget_charge(&self, name: &str, window_start: i64, run_id: &str) -> String {
        format!("{}budgets/{name}/{window_start}/runs/{run_id}", self.prefix)
    }
    /// `{prefix}config/current`: the cluster configuration in force (see
    /// [`crate::repo::config`]).
    pub fn config_current(&self) -> String {
        format!("{}config/current", self.prefix)
    }
    /// `{prefix}config/history/{version:020}`: an earlier version.
    pub fn config_version(&self, version: u64) -> String {
        format!("{}config/history/{version:020}", self.prefix)
    }
    /// `{prefix}meta/tasks-changed`: put by every task write (its mod
    /// revision tells a configuration apply that a task changed).
    pub fn tasks_changed(&self) -> String {
        format!("{}meta/tasks-changed", self.prefix)
    }
    /// `{prefix}meta/history-index`: the time index covers every run
    /// (absent: runs written before it may be missing from it); its
    /// value, while being built, the last run key indexed.
    pub fn history_index_state(&self) -> String {
        format!("{}meta/history-index", self.prefix)
    }
    /// `{prefix}holds/`: resources held back (see [`Keys::hold`]).
    pub fn holds(&self) -> String {
        format!("{}holds/", self.prefix)
    }
    /// `{prefix}holds/{resource}`: a [`crate::model::run::HoldBack`], the
    /// resource's latest hold-back (written with the attempt whose agent
    /// asked for it; deleted by `resources release`).
    pub fn hold(&self, resource: &str) -> String {
        format!("{}holds/{resource}", self.prefix)
    }
    /// Splits a ledger key: `(name, window_start, None)` for a total,
    /// `(name, window_start, Some(run_id))` for a run's entry.
    pub fn parse_budget_key<'a>(&self, key: &'a str) -> Option<(&'a str, i64, Option<&'a str>)> {
        let rest = key.strip_prefix(&self.prefix)?.strip_prefix("budgets/")?;
        let (name, rest) = rest.split_once('/')?;
        let (start, rest) = rest.split_once('/')?;
        let start = start.parse().ok()?;
        match rest {
            "total" => Some((name, start, None)),
            r => Some((name, start, Some(r.strip_prefix("runs/")?))),
        }
    }
    /// The id after a collection prefix (`tasks/`, `runs/`, ...).
    pub fn id_after<'a>(&self, collection: &str, key: &'a str) -> Option<&'a str> {
        key.strip_prefix(collection)
    }
}

/// Nanoseconds since 1970 of a slot, at least 0 (slots are after 1970).
fn slot_nanos(t: chrono::DateTime<chrono::Utc>) -> u64 {
    u64::try_from(t.timestamp_nanos_opt().unwrap_or(i64::MAX)).unwrap_or(0)
}
