//! Time, through one [`Clock`] so tests control it — two clocks in one:
//!
//! - the **wall clock** (`DateTime<Utc>`): what slots, records and users
//!   see. Cron and interval slots follow it, so a clock that is stepped
//!   (NTP, an operator) moves them too;
//! - the **monotonic clock** ([`Mono`]): elapsed time, which never jumps.
//!   Every deadline and timeout measures it — an attempt's timeout, a
//!   run's start timeout, a retry's backoff, a runner's silence — so a
//!   wall clock step neither ends an attempt early nor keeps one alive.
//!
//! Domain code never calls `Utc::now()` itself: the engine reads both
//! clocks at once ([`Clock::read`], a [`Now`]) and sleeps through the
//! clock, so a test can drive every timer with a [`ManualClock`] and see
//! exact instants, and step the wall clock alone ([`ManualClock::jump`]).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use tokio::sync::watch;

/// A monotonic instant: the time elapsed since an arbitrary origin (the
/// process's first reading of the system clock; a [`ManualClock`]'s
/// creation). Comparable only with readings of the same clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Mono(Duration);

impl Mono {
    /// The origin.
    pub const ZERO: Mono = Mono(Duration::ZERO);

    /// The instant `elapsed` after the origin.
    pub fn from_elapsed(elapsed: Duration) -> Mono {
        Mono(elapsed)
    }

    /// Time since the origin.
    pub fn elapsed(self) -> Duration {
        self.0
    }

    /// `d` later; a negative `d` counts as zero (a deadline is never
    /// earlier than the reading it was set from).
    pub fn after(self, d: chrono::Duration) -> Mono {
        Mono(self.0.saturating_add(d.to_std().unwrap_or(Duration::ZERO)))
    }

    /// Elapsed from `earlier` to `self` (zero when `earlier` is later).
    pub fn since(self, earlier: Mono) -> chrono::Duration {
        chrono::Duration::from_std(self.0.saturating_sub(earlier.0)).unwrap_or(chrono::Duration::MAX)
    }
}

/// Both clocks read at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Now {
    /// Wall clock (UTC).
    pub wall: DateTime<Utc>,
    /// Monotonic clock.
    pub mono: Mono,
}

impl Now {
    /// A reading (tests and conversions).
    pub fn new(wall: DateTime<Utc>, mono: Mono) -> Now {
        Now { wall, mono }
    }

    /// `d` later on both clocks: time passing.
    pub fn plus(self, d: chrono::Duration) -> Now {
        Now { wall: self.wall.checked_add_signed(d).unwrap_or(DateTime::<Utc>::MAX_UTC), mono: self.mono.after(d) }
    }

    /// The monotonic instant at which the wall clock will read `at`, as
    /// far as this reading can tell (the wall clock keeping its rate);
    /// now when `at` is past. Used once, where a wall instant (a stored
    /// deadline, a retry's `next_attempt_at`) becomes a monotonic deadline.
    pub fn mono_at(self, at: DateTime<Utc>) -> Mono {
        self.mono.after(at.signed_duration_since(self.wall))
    }

    /// How much further the wall clock moved than the monotonic clock
    /// since `earlier`: positive after a forward step, negative after a
    /// backward one, about zero otherwise.
    pub fn wall_step_since(self, earlier: Now) -> chrono::Duration {
        self.wall.signed_duration_since(earlier.wall) - self.mono.since(earlier.mono)
    }
}

/// A source of both clocks that can also sleep.
pub trait Clock: Send + Sync + 'static {
    /// The current UTC instant.
    fn now(&self) -> DateTime<Utc>;
    /// The current monotonic instant.
    fn mono(&self) -> Mono;
    /// Both clocks at once.
    fn read(&self) -> Now {
        Now { wall: self.now(), mono: self.mono() }
    }
    /// Resolves at or after `deadline` (UTC). The system clock may resolve
    /// early after a wall-clock jump; callers re-check [`Clock::now`].
    fn sleep_until(&self, deadline: DateTime<Utc>) -> BoxFuture<'static, ()>;
    /// Resolves at or after the monotonic `deadline`, or earlier (the
    /// system clock wakes at least every 30 s; a manual clock at every
    /// change, so a wall clock step is seen): callers re-check.
    fn sleep_until_mono(&self, deadline: Mono) -> BoxFuture<'static, ()>;
}

/// Shared handle to a clock.
pub type SharedClock = Arc<dyn Clock>;

/// The real clock: `Utc::now()` and tokio's monotonic timers.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

/// Longest single sleep of the system clock, so that a wall-clock step
/// (NTP, suspend) is noticed within this bound.
const MAX_SLEEP: Duration = Duration::from_secs(30);

/// The system clock's monotonic origin (tokio's clock, so tests with a
/// paused runtime control it too).
fn origin() -> tokio::time::Instant {
    static ORIGIN: OnceLock<tokio::time::Instant> = OnceLock::new();
    *ORIGIN.get_or_init(tokio::time::Instant::now)
}

impl Clock for SystemClock {
    #[allow(clippy::disallowed_methods)]
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }

    fn mono(&self) -> Mono {
        let o = origin();
        Mono(tokio::time::Instant::now().saturating_duration_since(o))
    }

    fn sleep_until(&self, deadline: DateTime<Utc>) -> BoxFuture<'static, ()> {
        let wait = (deadline - self.now()).to_std().unwrap_or(Duration::ZERO);
        Box::pin(tokio::time::sleep(wait.min(MAX_SLEEP)))
    }

    fn sleep_until_mono(&self, deadline: Mono) -> BoxFuture<'static, ()> {
        let wait = deadline.0.saturating_sub(self.mono().0);
        Box::pin(tokio::time::sleep(wait.min(MAX_SLEEP)))
    }
}

/// A clock that only moves when a test says: [`ManualClock::set`] and
/// [`ManualClock::advance`] let time pass (both clocks move);
/// [`ManualClock::jump`] steps the wall clock alone, as NTP or an operator
/// would. Sleepers wake as soon as their deadline is reached (and
/// monotonic sleepers at every change).
#[derive(Debug, Clone)]
pub struct ManualClock {
    now: Arc<watch::Sender<Now>>,
}

impl ManualClock {
    /// A clock standing at `start` (monotonic: the origin).
    pub fn new(start: DateTime<Utc>) -> Self {
        let (tx, _) = watch::channel(Now { wall: start, mono: Mono::ZERO });
        Self { now: Arc::new(tx) }
    }

    /// Lets time pass until the wall clock reads `t` (both clocks move by
    /// the difference). A `t` in the past steps the wall clock back
    /// ([`ManualClock::jump`]), since elapsed time cannot go back.
    pub fn set(&self, t: DateTime<Utc>) {
        self.now.send_modify(|n| {
            let d = t.signed_duration_since(n.wall);
            *n = if d >= chrono::Duration::zero() { n.plus(d) } else { Now { wall: t, mono: n.mono } };
        });
    }

    /// Lets `d` pass on both clocks.
    pub fn advance(&self, d: chrono::Duration) {
        self.now.send_modify(|n| *n = n.plus(d));
    }

    /// Steps the wall clock by `d` (either way); elapsed time stands still.
    pub fn jump(&self, d: chrono::Duration) {
        self.now.send_modify(|n| n.wall += d);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        self.now.borrow().wall
    }

    fn mono(&self) -> Mono {
        self.now.borrow().mono
    }

    fn read(&self) -> Now {
        *self.now.borrow()
    }

    fn sleep_until(&self, deadline: DateTime<Utc>) -> BoxFuture<'static, ()> {
        let mut rx = self.now.subscribe();
        Box::pin(async move {
            // `wait_for` checks the current value first, then every change.
            let _ = rx.wait_for(|now| now.wall >= deadline).await;
        })
    }

    fn sleep_until_mono(&self, deadline: Mono) -> BoxFuture<'static, ()> {
        let mut rx = self.now.subscribe();
        Box::pin(async move {
            if rx.borrow_and_update().mono >= deadline {
                return;
            }
            // Any change wakes the sleeper: the caller re-reads both clocks.
            let _ = rx.changed().await;
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jump_moves_the_wall_clock_only_and_is_measured() {
        let t0: DateTime<Utc> = "2026-12-01T10:00:00Z".parse().expect("t");
        let c = ManualClock::new(t0);
        let start = c.read();
        c.advance(chrono::Duration::seconds(5));
        c.jump(chrono::Duration::hours(1));
        let now = c.read();
        assert_eq!(now.mono.since(start.mono), chrono::Duration::seconds(5));
        assert_eq!(now.wall_step_since(start), chrono::Duration::hours(1));
        c.set(t0);
        assert_eq!(c.read().mono, now.mono, "a set into the past is a backward step");
        assert_eq!(c.read().wall_step_since(now), -chrono::Duration::seconds(3605));
        assert_eq!(now.mono_at(now.wall + chrono::Duration::seconds(30)), now.mono.after(chrono::Duration::seconds(30)));
        assert_eq!(now.mono_at(t0), now.mono, "a past wall instant is now");
    }
}
