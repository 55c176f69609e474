//! Run retention: while it leads, a replica deletes finished runs beyond
//! each task's `history` (its newest `keep_last` finished runs, none older
//! than `max_age`; the server's defaults where a task says nothing, and
//! for the runs of deleted tasks), in fenced batches, every
//! [`RetentionConfig::interval`]. A run that is not finished, or whose
//! agent may still be alive (the `active/` index), is never deleted, and
//! neither is one written since it was listed. After each pass the store's
//! change history is compacted up to the previous pass's revision (etcd:
//! its database stops growing; watchers keep one interval of history).
//! Each pass also deletes notification delivery records and dead letters
//! older than the default `max_age`.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::clock::SharedClock;
use crate::election::Leadership;
use crate::error::{Error, Result};
use crate::model::run::{slot_of_run_id, task_of_run};
use crate::model::task::HistorySpec;
use crate::repo::{Repo, RunKey};
use crate::store::Revision;

/// The server's retention defaults and pace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetentionConfig {
    /// Finished runs kept per task, newest first (`--history-keep-last`).
    pub keep_last: u32,
    /// Age after which a finished run is deleted (`--history-max-age`).
    pub max_age: chrono::Duration,
    /// Time between passes (`--retention-interval`).
    pub interval: Duration,
    /// Compact the store's history after each pass (`--no-etcd-compaction`
    /// turns it off: etcd's compaction is cluster-wide, for every key
    /// prefix; who shares an etcd may want to run it themselves).
    pub compact: bool,
}

impl Default for RetentionConfig {
    /// 1,000 runs, 30 days, every 5 minutes.
    fn default() -> Self {
        RetentionConfig { keep_last: 1000, max_age: chrono::Duration::days(30), interval: Duration::from_secs(300), compact: true }
    }
}

/// What a pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PruneReport {
    /// Runs deleted.
    pub deleted: usize,
    /// Runs left (finished or not).
    pub kept: usize,
    /// The store's revision when the pass started.
    pub revision: Revision,
    /// What the operator should know (a prune made without a leader).
    pub note: Option<String>,
}

/// A task's retention: its `history` over the defaults.
fn policy(history: Option<&HistorySpec>, defaults: &RetentionConfig) -> (usize, chrono::Duration) {
    let keep_last = history.and_then(|h| h.keep_last).unwrap_or(defaults.keep_last) as usize;
    let max_age = history
        .and_then(HistorySpec::max_age_seconds)
        .and_then(|s| chrono::Duration::try_seconds(i64::try_from(s).ok()?))
        .unwrap_or(defaults.max_age);
    (keep_last, max_age)
}

/// The finished runs of one task to delete: beyond the newest `keep_last`
/// (by creation), or older than `max_age` by `age_of` (`None`: unknown,
/// kept). `runs` excludes active ones.
fn expired(
    mut runs: Vec<RunKey>,
    keep_last: usize,
    cutoff: DateTime<Utc>,
    age_of: impl Fn(&RunKey) -> Option<DateTime<Utc>>,
) -> (Vec<RunKey>, usize) {
    runs.sort_by_key(|r| std::cmp::Reverse(r.create_revision));
    let old = runs.split_off(keep_last.min(runs.len()));
    let (mut delete, keep): (Vec<RunKey>, Vec<RunKey>) = runs.into_iter().partition(|r| age_of(r).is_some_and(|t| t < cutoff));
    delete.extend(old);
    (delete, keep.len())
}

/// One pass over the runs of `task_id` (all tasks when empty) at `now`.
///
/// Errors: [`Error::Fenced`]; store errors.
pub async fn prune(repo: &Repo, lead: &Leadership, defaults: &RetentionConfig, now: DateTime<Utc>, task_id: &str) -> Result<PruneReport> {
    let revision = repo.current_revision().await?;
    // With an archive, a finished run leaves the store only once the
    // archive has it (the mover): pruning here could lose one that waits.
    if repo.archived() {
        return Ok(PruneReport {
            deleted: 0,
            kept: 0,
            revision,
            note: Some("the history is kept in PostgreSQL (--history): finished runs leave the store once archived, and old months are dropped there".into()),
        });
    }
    let keys = repo.run_keys(task_id).await?;
    let active = repo.active_run_ids().await?;
    let mut by_task: HashMap<String, Vec<RunKey>> = HashMap::new();
    let mut kept = 0;
    for key in keys {
        if active.contains(&key.run_id) {
            kept += 1;
            continue;
        }
        by_task.entry(task_of_run(&key.run_id).to_string()).or_default().push(key);
    }
    let ids: Vec<&str> = by_task.keys().map(String::as_str).collect();
    let histories = repo.task_histories(&ids).await?;
    let mut doomed = Vec::new();
    for (task, runs) in by_task {
        let (history, dedup) = histories.get(&task).map_or((None, 0), |(h, d)| (h.as_ref(), *d));
        let (keep_last, max_age) = policy(history, defaults);
        // An age beyond the calendar keeps everything (validation bounds
        // it; a stored task from an older version may not be).
        let cutoff = now.checked_sub_signed(max_age).unwrap_or(DateTime::<Utc>::MIN_UTC);
        // A run's age is from when it finished. A slot after the cutoff
        // says enough without a read (it cannot have finished earlier);
        // the others that would be kept (manual runs, old slots — a
        // backfill that just ran) are read.
        let mut newest: Vec<&RunKey> = runs.iter().collect();
        newest.sort_by_key(|r| std::cmp::Reverse(r.create_revision));
        let young = |r: &RunKey| slot_of_run_id(&r.run_id).is_some_and(|(_, slot)| slot >= cutoff);
        let unknown: Vec<&str> = newest.iter().take(keep_last).filter(|r| !young(r)).map(|r| r.run_id.as_str()).collect();
        let times = if unknown.is_empty() { HashMap::new() } else { repo.run_times(&unknown).await? };
        let (mut delete, mut keep) = expired(runs, keep_last, cutoff, |r| if young(r) { Some(now) } else { times.get(&r.run_id).copied() });
        // A webhook's run is its delivery id's dedup record: kept at least
        // the trigger's dedup window.
        if dedup > 0 {
            let floor = now - chrono::Duration::seconds(dedup as i64);
            let hooks: Vec<&str> = delete.iter().filter(|r| is_webhook_run(&r.run_id)).map(|r| r.run_id.as_str()).collect();
            if !hooks.is_empty() {
                let times = repo.run_times(&hooks).await?;
                let before = delete.len();
                delete.retain(|r| times.get(&r.run_id).is_none_or(|t| *t < floor));
                keep += before - delete.len();
            }
        }
        kept += keep;
        doomed.extend(delete);
    }
    let deleted = repo.delete_runs(lead, &doomed).await?;
    if deleted > 0 {
        let swept = repo.sweep_history_index(lead).await?;
        tracing::debug!(swept, "time index entries of pruned runs deleted");
    }
    kept += doomed.len() - deleted;
    Ok(PruneReport { deleted, kept, revision, note: None })
}

/// Whether a run id is a webhook delivery's run (`{task}.webhook-…`).
fn is_webhook_run(run_id: &str) -> bool {
    run_id.split_once('.').is_some_and(|(_, rest)| rest.starts_with("webhook-"))
}

/// Passes every `cfg.interval` while `lead` holds — runs and notification
/// records — compacting after each;
/// ends when fenced. Spawned with the engine, stopped with it.
pub async fn run(repo: Repo, lead: Leadership, cfg: RetentionConfig, clock: SharedClock) {
    let mut previous: Option<Revision> = None;
    let mut compacted: Option<Revision> = None;
    loop {
        tokio::time::sleep(cfg.interval).await;
        match prune(&repo, &lead, &cfg, clock.now(), "").await {
            Ok(report) => {
                if report.deleted > 0 {
                    tracing::info!(deleted = report.deleted, kept = report.kept, "retention: finished runs deleted");
                }
                // Delivery records and dead letters older than the default max age.
                let cutoff = clock.now().checked_sub_signed(cfg.max_age).unwrap_or(DateTime::<Utc>::MIN_UTC);
                match repo.prune_notifications(&lead, cutoff).await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(deleted = n, "retention: old notification records deleted"),
                    Err(Error::Fenced(_)) => return,
                    Err(e) => tracing::warn!(error = %e, "retention: cannot prune notification records"),
                }
                // Event ids whose dedup window ended.
                match repo.sweep_dedup(&lead, clock.now()).await {
                    Ok(0) => {}
                    Ok(n) => tracing::debug!(deleted = n, "retention: expired dedup keys deleted"),
                    Err(Error::Fenced(_)) => return,
                    Err(e) => tracing::warn!(error = %e, "retention: cannot delete expired dedup keys"),
                }
                // Up to the previous pass's revision, once per revision
                // (an idle store would be asked the same again and again).
                if let Some(rev) = previous
                    && cfg.compact
                    && compacted != Some(rev)
                {
                    match repo.store().compact(rev).await {
                        Ok(()) => compacted = Some(rev),
                        Err(e) => tracing::warn!(error = %e, revision = rev, "retention: cannot compact the store's history"),
                    }
                }
                previous = Some(report.revision);
            }
            Err(Error::Fenced(_)) => return,
            Err(e) => tracing::warn!(error = %e, "retention pass failed; trying again next interval"),
        }
    }
}

/// How often the leader folds the budgets' ledger: runs' entries into
/// their window's total (a window holds at most this long's entries).
pub const LEDGER_FOLD_INTERVAL: Duration = Duration::from_secs(10);

/// Folds the budgets' ledger every [`LEDGER_FOLD_INTERVAL`] while `lead`
/// holds ([`Repo::fold_ledgers`]), deleting windows that ended more than
/// `cfg.max_age` ago; ends when fenced. Spawned with the engine.
pub async fn fold_ledgers(repo: Repo, lead: Leadership, cfg: RetentionConfig, clock: SharedClock, config: crate::config::ConfigHandle) {
    loop {
        tokio::time::sleep(LEDGER_FOLD_INTERVAL).await;
        let cutoff = clock.now().checked_sub_signed(cfg.max_age).unwrap_or(DateTime::<Utc>::MIN_UTC);
        let budgets = config.current();
        let end_of = |name: &str, start: DateTime<Utc>| budgets.budgets.iter().find(|b| b.name == name).map(|b| b.window_of(start).1);
        match repo.fold_ledgers(&lead, cutoff, end_of).await {
            Ok((0, 0)) => {}
            Ok((folded, windows)) => tracing::debug!(folded, windows, "budget ledger folded"),
            Err(Error::Fenced(_)) => return,
            Err(e) => tracing::warn!(error = %e, "cannot fold the budgets' ledger; trying again"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str, rev: i64) -> RunKey {
        RunKey { run_id: id.into(), create_revision: rev, mod_revision: rev }
    }

    #[test]
    fn keeps_the_newest_and_drops_the_old() {
        let now: DateTime<Utc> = "2026-12-01T00:00:00Z".parse().expect("t");
        let runs: Vec<RunKey> = (0..10).map(|i| key(&format!("t.r{i}"), i)).collect();
        // Keep 3 by creation; none too old.
        let (delete, kept) = expired(runs.clone(), 3, now - chrono::Duration::days(1), |_| Some(now));
        assert_eq!(kept, 3);
        let mut gone: Vec<i64> = delete.iter().map(|r| r.create_revision).collect();
        gone.sort();
        assert_eq!(gone, (0..7).collect::<Vec<_>>());
        // Among the newest, one older than the cutoff goes too; unknown ages stay.
        let (delete, kept) = expired(runs, 3, now, |r| match r.create_revision {
            9 => Some(now - chrono::Duration::hours(1)),
            8 => None,
            _ => Some(now),
        });
        assert_eq!(kept, 2);
        assert!(delete.iter().any(|r| r.create_revision == 9) && !delete.iter().any(|r| r.create_revision == 8));
    }

    #[test]
    fn a_task_history_overrides_the_defaults() {
        let d = RetentionConfig::default();
        assert_eq!(policy(None, &d), (1000, chrono::Duration::days(30)));
        let h = HistorySpec { keep_last: Some(5), max_age: Some("2h".into()) };
        assert_eq!(policy(Some(&h), &d), (5, chrono::Duration::hours(2)));
    }
}
