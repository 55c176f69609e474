//! The runner's self-fence: a runner that no leader has acknowledged for
//! the fence deadline (`Welcome.fence_ms`, counted from *sending* the last
//! acknowledged heartbeat or Hello) stops its agents, so that the leader —
//! which declares the runner lost only after the deadline plus a margin,
//! counted from the *arrival* of its last message — can never see two
//! agents of a task alive at once (control plane `timing.rs`).
//!
//! Two enforcers share one deadline:
//! - the runner itself interrupts its executions `kill_grace` + the leader's `stop_lead_ms` (1 s) before
//!   the deadline (they are reported `OUTCOME_INTERRUPTED`);
//! - the agent shim ([`crate::shim`], reading [`punchclock_agent_shim::fence_file`]) reads the deadline from a file in the
//!   work directory and kills its agent's group (TERM `kill_grace` before
//!   the deadline, KILL at it) — which works even while the runner process
//!   is stopped (SIGSTOP) or hung.
//!
//! Instants are `CLOCK_BOOTTIME` nanoseconds: one clock for every process
//! on the host, which also counts time spent suspended.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tracing::warn;

pub use punchclock_agent_shim::fence_file::{FENCE_REASON, boottime_ns, read_deadline};

/// Name of the deadline file in the runner's work directory.
pub const FENCE_FILE: &str = "fence";
/// What the runner counts on when a leader sends no `stop_lead_ms` (one
/// before the field): it stops its agents its kill grace and this long
/// before the fence deadline.
pub const DEFAULT_STOP_LEAD: Duration = Duration::from_secs(1);

/// The fence deadline of one runner process; cheap to clone.
#[derive(Debug, Clone)]
pub struct Fence {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    path: PathBuf,
    kill_grace: Duration,
    /// Boottime ns by which the agents must be gone; `None`: no fence.
    deadline: Mutex<Option<u64>>,
    /// The leader's `Welcome.stop_lead_ms`: the runner stops its agents
    /// its kill grace and this long before the deadline.
    stop_lead: Mutex<Duration>,
}

impl Fence {
    /// A fence with no deadline yet, writing its deadline to `path`.
    pub fn new(path: PathBuf, kill_grace: Duration) -> Self {
        Fence { inner: Arc::new(Inner { path, kill_grace, deadline: Mutex::new(None), stop_lead: Mutex::new(DEFAULT_STOP_LEAD) }) }
    }

    /// How long beyond the kill grace the runner stops its agents before
    /// the deadline (a Welcome's `stop_lead_ms`; 0: [`DEFAULT_STOP_LEAD`]).
    pub fn set_stop_lead(&self, ms: u64) {
        let lead = if ms == 0 { DEFAULT_STOP_LEAD } else { Duration::from_millis(ms) };
        *self.inner.stop_lead.lock().unwrap_or_else(PoisonError::into_inner) = lead;
    }

    /// [`Fence::set_stop_lead`]'s value.
    pub fn stop_lead(&self) -> Duration {
        *self.inner.stop_lead.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The deadline file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    fn deadline(&self) -> Option<u64> {
        *self.inner.deadline.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The agents may live `remaining` from now: moves the deadline later
    /// (never earlier) and writes it for the shims.
    pub fn extend(&self, remaining: Duration) {
        let at = boottime_ns().saturating_add(u64::try_from(remaining.as_nanos()).unwrap_or(u64::MAX));
        {
            let mut d = self.inner.deadline.lock().unwrap_or_else(PoisonError::into_inner);
            match *d {
                Some(cur) if cur >= at => return,
                _ => *d = Some(at),
            }
        }
        self.write(at);
    }

    /// No fence (a leader that sends no fence deadline).
    pub fn disarm(&self) {
        *self.inner.deadline.lock().unwrap_or_else(PoisonError::into_inner) = None;
        let _ = std::fs::remove_file(&self.inner.path);
    }

    fn write(&self, at: u64) {
        let tmp = self.inner.path.with_extension("tmp");
        let r = std::fs::write(&tmp, format!("{at}\n")).and_then(|()| std::fs::rename(&tmp, &self.inner.path));
        if let Err(e) = r {
            warn!(path = %self.inner.path.display(), error = %e, "cannot write the fence deadline for the agent shims");
        }
    }

    /// How long until the runner must stop its agents (zero when overdue);
    /// `None` without a fence.
    pub fn stop_in(&self) -> Option<Duration> {
        let d = self.deadline()?;
        let lead = u64::try_from((self.inner.kill_grace + self.stop_lead()).as_nanos()).unwrap_or(u64::MAX);
        Some(Duration::from_nanos(d.saturating_sub(lead).saturating_sub(boottime_ns())))
    }

    /// Whether agents must be stopped now: the deadline less the kill
    /// grace has passed.
    pub fn expired(&self) -> bool {
        let Some(d) = self.deadline() else { return false };
        let grace = u64::try_from(self.inner.kill_grace.as_nanos()).unwrap_or(u64::MAX);
        boottime_ns() >= d.saturating_sub(grace)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadline_only_moves_later_and_reaches_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = Fence::new(dir.path().join(FENCE_FILE), Duration::from_millis(100));
        assert_eq!(f.stop_in(), None);
        assert!(!f.expired());
        f.extend(Duration::from_secs(60));
        let first = read_deadline(f.path()).expect("written");
        f.extend(Duration::from_secs(1));
        assert_eq!(read_deadline(f.path()), Some(first), "an earlier deadline does not replace a later one");
        assert!(!f.expired());
        assert!(f.stop_in().expect("armed") > Duration::from_secs(55));
        f.disarm();
        assert_eq!(read_deadline(f.path()), None);
        let g = Fence::new(dir.path().join("g"), Duration::from_millis(100));
        g.extend(Duration::from_millis(50));
        assert!(g.expired(), "within the kill grace of the deadline");
        assert_eq!(g.stop_in(), Some(Duration::ZERO));
    }
}
