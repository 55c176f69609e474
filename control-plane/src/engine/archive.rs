//! The history mover (`--history postgres://`): while leading, finished
//! runs queued in the store (`hist-out/`, written with each run's final
//! record) are recorded in the archive a batch at a time, in queue order,
//! and then deleted from the store (each only while unchanged). An archive
//! that does not answer stops nothing else: runs wait in the store, the
//! wait is shown (`punchclock_history_outbox_runs`,
//! `punchclock_history_archive_up`, `/readyz`'s `degraded`), and the queue
//! drains once the archive is back.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::election::Leadership;
use crate::error::Error;
use crate::repo::Repo;
use crate::repo::history::HistoryStore;

/// Runs moved per batch.
const BATCH: usize = 256;
/// The wait when the queue is empty.
const IDLE: Duration = Duration::from_millis(500);
/// The longest wait between tries while the archive fails.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// What the mover last saw: read by `/readyz` and `/metrics`.
#[derive(Debug, Default)]
pub struct ArchiveStatus {
    inner: Mutex<StatusInner>,
}

#[derive(Debug, Default)]
struct StatusInner {
    /// Why the archive is not taking runs, and since when.
    failing: Option<(String, chrono::DateTime<chrono::Utc>)>,
    /// Runs waiting at the last count.
    waiting: u64,
}

impl ArchiveStatus {
    /// `Some(reason)` while the archive fails (for `/readyz`).
    pub fn problem(&self) -> Option<String> {
        let s = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        s.failing.as_ref().map(|(why, since)| {
            format!(
                "history archive unreachable since {} ({} finished runs wait in the store): {why}; retrying",
                since.to_rfc3339(),
                s.waiting
            )
        })
    }

    fn set(&self, failing: Option<String>, waiting: u64, now: chrono::DateTime<chrono::Utc>) {
        let mut s = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        s.waiting = waiting;
        s.failing = match (failing, s.failing.take()) {
            (Some(why), Some((_, since))) => Some((why, since)),
            (Some(why), None) => Some((why, now)),
            (None, _) => None,
        };
    }
}

/// How often the archive's expired months are dropped.
const EXPIRE_EVERY: Duration = Duration::from_secs(600);

/// Moves finished runs to `archive` until fenced, and every 10 minutes
/// drops what the archive holds past `max_age` (`--history-max-age`).
/// Spawned with the engine.
pub async fn run(
    repo: Repo,
    lead: Leadership,
    archive: Arc<dyn HistoryStore>,
    status: Arc<ArchiveStatus>,
    metrics: Arc<crate::metrics::Metrics>,
    max_age: chrono::Duration,
) {
    let mut backoff = Duration::from_millis(250);
    let mut expire_at = tokio::time::Instant::now();
    let mut away_since: Option<tokio::time::Instant> = None;
    // A term's end leaves nothing waiting here to report.
    struct Reset(Arc<crate::metrics::Metrics>);
    impl Drop for Reset {
        fn drop(&mut self) {
            self.0.set_history_archive(0, true);
        }
    }
    let _reset = Reset(metrics.clone());
    loop {
        if tokio::time::Instant::now() >= expire_at {
            expire_at = tokio::time::Instant::now() + EXPIRE_EVERY;
            let cutoff = chrono::Utc::now().checked_sub_signed(max_age).unwrap_or(chrono::DateTime::<chrono::Utc>::MIN_UTC);
            match archive.expire_before(cutoff).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(parts = n, "history archive: expired months dropped"),
                Err(e) => tracing::warn!(error = %e, "history archive: cannot drop expired months"),
            }
        }
        let batch = match repo.archive_batch(&lead, BATCH).await {
            Ok(b) => b,
            Err(Error::Fenced(_)) => return,
            Err(e) => {
                tracing::warn!(error = %e, "history mover: cannot read the queue; retrying");
                tokio::time::sleep(MAX_BACKOFF).await;
                continue;
            }
        };
        if batch.is_empty() {
            status.set(None, 0, chrono::Utc::now());
            metrics.set_history_archive(0, true);
            tokio::time::sleep(IDLE).await;
            continue;
        }
        let runs: Vec<_> = batch.iter().map(|(r, _)| r.clone()).collect();
        match archive.record(&runs).await {
            Ok(()) => {
                backoff = Duration::from_millis(250);
                if let Some(since) = away_since.take() {
                    tracing::info!(
                        away_s = since.elapsed().as_secs(),
                        "history archive: reachable again; the runs waiting in the store move"
                    );
                }
                match repo.forget_archived(&lead, &batch).await {
                    Ok(n) => tracing::debug!(moved = n, "history mover: runs archived"),
                    Err(Error::Fenced(_)) => return,
                    Err(e) => tracing::warn!(error = %e, "history mover: cannot delete archived runs from the store; retrying"),
                }
                if batch.len() < BATCH {
                    status.set(None, 0, chrono::Utc::now());
                    metrics.set_history_archive(0, true);
                }
            }
            Err(e) => {
                let waiting = repo.archive_pending().await.unwrap_or(batch.len() as u64);
                away_since.get_or_insert_with(tokio::time::Instant::now);
                tracing::warn!(error = %e, waiting, "history mover: the archive does not take runs; they wait in the store");
                status.set(Some(e.to_string()), waiting, chrono::Utc::now());
                metrics.set_history_archive(waiting, false);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}
