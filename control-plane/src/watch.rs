//! Run watches (`WatchRuns`) with bounded memory, whatever the clients do.
//!
//! One relay task reads the replica's lifecycle bus and hands each run
//! change to the watchers it matches, through a bounded queue per watcher
//! ([`WATCHER_QUEUE`] changes, shared `Arc`s, not copies). A watcher whose
//! queue is full loses it (`behind`); its stream catches up with a new
//! listing, read a page at a time as the client reads. So a client that
//! never reads holds at most its queue and one page of the listing, and
//! never makes the bus keep events for it (issue 19: 100 stalled watchers
//! with 35k runs took the leader from 106 MiB to 5.4 GiB, each copying
//! every run into its own unbounded queue, and a lagging one appending
//! another full copy).
//!
//! The initial listing is read from the store a page at a time as the
//! client consumes it ([`LISTING_PAGE`] runs), never whole.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::broadcast::error::RecvError;
use tokio::sync::mpsc;

use crate::engine::lifecycle::LifecycleBus;
use crate::model::RunRecord;

/// Run changes queued for one watcher before it counts as fallen behind
/// (a reader at network speed keeps up with a burst of 10,000 runs).
pub const WATCHER_QUEUE: usize = 1024;
/// Runs read from the store per page of a watch's initial listing.
pub const LISTING_PAGE: usize = 32;
/// Most watches open at once on one replica; more are refused
/// (`RESOURCE_EXHAUSTED`-like `Unavailable`), so watches cannot exhaust it.
pub const MAX_WATCHERS: usize = 10_000;

/// Which runs a watcher wants.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WatchFilter {
    /// Runs of this task (all when empty).
    pub task_id: String,
    /// Only this run (any when `None`).
    pub run_id: Option<String>,
}

impl WatchFilter {
    /// Whether `r` is wanted.
    pub fn matches(&self, r: &RunRecord) -> bool {
        (self.task_id.is_empty() || r.task_id == self.task_id) && self.run_id.as_ref().is_none_or(|id| &r.run_id == id)
    }
}

struct Watcher {
    id: u64,
    filter: WatchFilter,
    tx: mpsc::Sender<Arc<RunRecord>>,
    behind: Arc<AtomicBool>,
}

/// The watchers of one replica and the relay that feeds them.
#[derive(Clone)]
pub struct RunWatchers {
    inner: Arc<Inner>,
}

struct Inner {
    watchers: Mutex<Vec<Watcher>>,
    next_id: AtomicU64,
}

/// One watcher's end: run changes as they come, until the relay ends it.
pub struct Subscription {
    /// Matching changes.
    pub rx: mpsc::Receiver<Arc<RunRecord>>,
    /// Set when its queue was dropped for falling behind (it lists again).
    pub behind: Arc<AtomicBool>,
    id: u64,
    hub: RunWatchers,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.hub.inner.watchers.lock().unwrap_or_else(PoisonError::into_inner).retain(|w| w.id != self.id);
    }
}

impl RunWatchers {
    /// A hub relaying `bus`'s run changes (the relay runs until the bus closes).
    pub fn start(bus: &LifecycleBus) -> RunWatchers {
        let hub = RunWatchers { inner: Arc::new(Inner { watchers: Mutex::new(Vec::new()), next_id: AtomicU64::new(1) }) };
        let mut rx = bus.subscribe();
        let relay = hub.clone();
        tokio::spawn(async move {
            loop {
                match rx.recv().await {
                    Ok(ev) => {
                        if let Some(run) = ev.run() {
                            relay.deliver(run);
                        }
                    }
                    // The relay itself fell behind the bus (the replica is
                    // overloaded): every watcher may have missed a change.
                    Err(RecvError::Lagged(n)) => {
                        tracing::warn!(missed = n, "run watch relay fell behind; every watch lists again");
                        relay.end_all();
                    }
                    Err(RecvError::Closed) => {
                        relay.end_all();
                        return;
                    }
                }
            }
        });
        hub
    }

    /// Registers a watcher (before its listing is read: no change falls
    /// in between).
    ///
    /// Errors: [`crate::error::Error::Unavailable`] when [`MAX_WATCHERS`]
    /// are open.
    pub fn subscribe(&self, filter: WatchFilter) -> crate::error::Result<Subscription> {
        let (tx, rx) = mpsc::channel(WATCHER_QUEUE);
        let behind = Arc::new(AtomicBool::new(false));
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let mut w = self.inner.watchers.lock().unwrap_or_else(PoisonError::into_inner);
        if w.len() >= MAX_WATCHERS {
            return Err(crate::error::Error::Unavailable {
                reason: format!("{MAX_WATCHERS} run watches are open on this replica; close some or watch another replica"),
                leader: None,
            });
        }
        w.push(Watcher { id, filter, tx, behind: behind.clone() });
        Ok(Subscription { rx, behind, id, hub: self.clone() })
    }

    /// Open watches.
    pub fn len(&self) -> usize {
        self.inner.watchers.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// Whether no watch is open.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn deliver(&self, run: &Arc<RunRecord>) {
        let mut w = self.inner.watchers.lock().unwrap_or_else(PoisonError::into_inner);
        w.retain(|w| {
            if !w.filter.matches(run) {
                return !w.tx.is_closed();
            }
            match w.tx.try_send(run.clone()) {
                Ok(()) => true,
                Err(mpsc::error::TrySendError::Full(_)) => {
                    w.behind.store(true, Ordering::Relaxed);
                    tracing::info!(watcher = w.id, queued = WATCHER_QUEUE, "run watcher does not keep up; it lists again when it reads");
                    false
                }
                Err(mpsc::error::TrySendError::Closed(_)) => false,
            }
        });
    }

    fn end_all(&self) {
        let mut w = self.inner.watchers.lock().unwrap_or_else(PoisonError::into_inner);
        for x in w.iter() {
            x.behind.store(true, Ordering::Relaxed);
        }
        w.clear();
    }
}
