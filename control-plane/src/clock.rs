//! Wall-clock reads go through [`Clock`] so tests control time.
//!
//! Domain code never calls `Utc::now()` itself: the engine asks its clock
//! for "now" and sleeps through it, so a test can drive every timer with a
//! [`ManualClock`] and see exact instants.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use tokio::sync::watch;

/// A source of UTC wall-clock time that can also sleep until an instant.
pub trait Clock: Send + Sync + 'static {
    /// The current UTC instant.
    fn now(&self) -> DateTime<Utc>;
    /// Resolves at or after `deadline` (UTC). The system clock may resolve
    /// early after a wall-clock jump; callers re-check [`Clock::now`].
    fn sleep_until(&self, deadline: DateTime<Utc>) -> BoxFuture<'static, ()>;
}

/// Shared handle to a clock.
pub type SharedClock = Arc<dyn Clock>;

/// The real clock: `Utc::now()` and tokio's monotonic timers.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

/// Longest single sleep of the system clock, so that a wall-clock step
/// (NTP, suspend) is noticed within this bound.
const MAX_SLEEP: Duration = Duration::from_secs(30);

impl Clock for SystemClock {
    #[allow(clippy::disallowed_methods)]
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }

    fn sleep_until(&self, deadline: DateTime<Utc>) -> BoxFuture<'static, ()> {
        let wait = (deadline - self.now()).to_std().unwrap_or(Duration::ZERO);
        Box::pin(tokio::time::sleep(wait.min(MAX_SLEEP)))
    }
}

/// A clock that only moves when a test calls [`ManualClock::set`] or
/// [`ManualClock::advance`]; sleepers wake as soon as the time reaches their
/// deadline.
#[derive(Debug, Clone)]
pub struct ManualClock {
    now: Arc<watch::Sender<DateTime<Utc>>>,
}

impl ManualClock {
    /// A clock standing at `start`.
    pub fn new(start: DateTime<Utc>) -> Self {
        let (tx, _) = watch::channel(start);
        Self { now: Arc::new(tx) }
    }

    /// Moves the clock to `t` (may move backwards, like a real wall clock).
    pub fn set(&self, t: DateTime<Utc>) {
        self.now.send_replace(t);
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: chrono::Duration) {
        self.now.send_modify(|t| *t += d);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.now.borrow()
    }

    fn sleep_until(&self, deadline: DateTime<Utc>) -> BoxFuture<'static, ()> {
        let mut rx = self.now.subscribe();
        Box::pin(async move {
            // `wait_for` checks the current value first, then every change.
            let _ = rx.wait_for(|now| *now >= deadline).await;
        })
    }
}
