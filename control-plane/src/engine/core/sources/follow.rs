//! Followers (`after` triggers): when a run ends, the dependencies policy
//! names the tasks that follow it; each gets one run — or a SKIPPED
//! `upstream_unmet` record when the run's status is not one it follows —
//! created in the ended run's write group, its id `{task}.after-{run}`
//! (so a run's end makes each follower's run once).

use super::RunRequest;
use crate::clock::Now;
use crate::engine::core::EngineCore;
use crate::model::RunRecord;
use crate::model::event::{Upstream, after_run_id};
use crate::model::run::{SkipReason, TriggerKind};

impl EngineCore {
    /// A run of `task_id` follows the run that ended (`after`, from the
    /// dependencies policy): its run — or its SKIPPED `upstream_unmet`
    /// record — is created in the ended run's group.
    pub(in crate::engine::core) fn follow(&mut self, now: Now, task_id: &str, upstream: Upstream, unmet: Option<String>) {
        let run_id = after_run_id(task_id, &upstream.run_id);
        let mut run = RunRecord::pending(run_id, task_id, "", TriggerKind::After, now.wall, now.wall);
        run.upstream = Some(upstream);
        let skip = unmet.map(|why| (SkipReason::UpstreamUnmet, why));
        // A task deleted meanwhile has no follower run (NotFound).
        let _ = self.submit(now, RunRequest { skip, ..RunRequest::new(run) });
    }
}
