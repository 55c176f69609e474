//! Tasks that follow tasks (`{type: after, task: A, status}` on B): when a
//! run of A ends, B gets a run — or, when A ended in a status B did not ask
//! for, a SKIPPED `upstream_unmet` record naming A's run and status. The
//! edge lives on the follower only (nothing on A can go stale); this
//! policy indexes it by the task followed.
//!
//! B's record is created in the same transaction that makes A's run
//! terminal (the core writes it in A's run's group), with the run id
//! `{B}.after-{A's run id}`: B runs exactly once per run of A, across
//! failovers — a new leader either sees A terminal and B created, or
//! neither. SKIPPED records of A (slots that never ran) and runs of A
//! cancelled before their first attempt start nothing.
//!
//! A cycle is refused at apply; one made by two applies at once is cut at
//! run time: a chain longer than [`MAX_CHAIN`] runs records SKIPPED
//! `upstream_unmet` instead of following again.

use std::collections::{BTreeMap, HashMap};

use super::{FinishQuery, Policy, Write};
use crate::model::RunStatus;
use crate::model::event::Upstream;
use crate::model::task::TaskSpec;
use crate::model::trigger::AfterStatus;

/// Longest chain of runs following runs (A → B → C is 2): past it a
/// follower is recorded SKIPPED `upstream_unmet`.
pub const MAX_CHAIN: u32 = 64;

/// Most tasks that may follow one task: each follower's record commits in
/// the transaction that ends the followed run.
pub const MAX_FOLLOWERS: usize = 16;

/// The `after` edges, by the task followed.
#[derive(Debug, Default)]
pub struct Dependencies {
    /// Task followed → its followers and the ends each follows.
    followers: HashMap<String, BTreeMap<String, AfterStatus>>,
    /// Follower → the tasks it follows (to drop its edges when it changes).
    follows: HashMap<String, Vec<String>>,
}

impl Dependencies {
    /// The followers of `task_id`, by id.
    pub fn followers_of(&self, task_id: &str) -> Vec<(String, AfterStatus)> {
        self.followers.get(task_id).map(|m| m.iter().map(|(k, v)| (k.clone(), *v)).collect()).unwrap_or_default()
    }
}

impl Policy for Dependencies {
    fn name(&self) -> &'static str {
        "dependencies"
    }

    fn task_changed(&mut self, task_id: &str, spec: Option<&TaskSpec>) {
        for up in self.follows.remove(task_id).unwrap_or_default() {
            if let Some(m) = self.followers.get_mut(&up) {
                m.remove(task_id);
                if m.is_empty() {
                    self.followers.remove(&up);
                }
            }
        }
        let Some(spec) = spec else { return };
        let edges: Vec<(String, AfterStatus)> = spec.follows().into_iter().map(|a| (a.task.clone(), a.status)).collect();
        if edges.is_empty() {
            return;
        }
        for (up, status) in &edges {
            self.followers.entry(up.clone()).or_default().insert(task_id.to_string(), *status);
        }
        self.follows.insert(task_id.to_string(), edges.into_iter().map(|(up, _)| up).collect());
    }

    fn finished(&mut self, q: &FinishQuery<'_>) -> Vec<Write> {
        // A slot that never ran, or a run cancelled before its first
        // attempt, did nothing to follow.
        if q.run.status == RunStatus::Skipped || (q.run.status == RunStatus::Cancelled && q.run.attempts.is_empty()) {
            return Vec::new();
        }
        let chain = q.run.upstream.as_ref().map_or(0, |u| u.chain) + 1;
        self.followers_of(&q.run.task_id)
            .into_iter()
            .map(|(task_id, status)| {
                let unmet = if chain > MAX_CHAIN {
                    Some(format!("a chain of {chain} runs following runs is longer than {MAX_CHAIN} (a cycle of after triggers?)"))
                } else if !status.matches(q.run.status) {
                    Some(format!(
                        "upstream run {} of task {} ended {}; this task follows it on {}",
                        q.run.run_id,
                        q.run.task_id,
                        q.run.status.as_str(),
                        status.as_str()
                    ))
                } else {
                    None
                };
                let mut upstream = Upstream::of(q.run);
                upstream.chain = chain;
                Write::Follow { task_id, upstream, unmet }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::RunRecord;
    use crate::model::run::TriggerKind;

    fn spec(json: serde_json::Value) -> TaskSpec {
        TaskSpec::from_json(&json.to_string()).expect("spec")
    }

    fn ended(task: &str, status: RunStatus, upstream_chain: Option<u32>) -> RunRecord {
        let t = "2026-12-03T10:00:00Z".parse().expect("t");
        let mut r = RunRecord::pending(format!("{task}.x"), task, "ag", TriggerKind::Manual, t, t);
        r.status = status;
        r.result = Some(serde_json::json!({"n": 1}));
        if status != RunStatus::Skipped {
            r.attempts.push(crate::model::Attempt { attempt: 1, ..Default::default() });
        }
        if let Some(chain) = upstream_chain {
            r.upstream = Some(Upstream { task: "z".into(), run_id: "z.1".into(), status: RunStatus::Succeeded, result: None, chain });
        }
        r
    }

    fn follow(d: &mut Dependencies, run: &RunRecord) -> Vec<(String, Option<String>, u32)> {
        let q = FinishQuery { now: run.scheduled_at, run, task: None, breaker: None };
        d.finished(&q)
            .into_iter()
            .map(|w| match w {
                Write::Follow { task_id, upstream, unmet } => {
                    assert_eq!((upstream.task.as_str(), upstream.run_id.as_str()), (run.task_id.as_str(), run.run_id.as_str()));
                    (task_id, unmet, upstream.chain)
                }
                other => panic!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn a_run_that_ends_starts_its_followers_or_says_why_not() {
        let mut d = Dependencies::default();
        d.task_changed("b", Some(&spec(serde_json::json!({"task_id": "b", "agent_id": "ag", "trigger": {"type": "after", "task": "a"}}))));
        d.task_changed(
            "c",
            Some(&spec(
                serde_json::json!({"task_id": "c", "agent_id": "ag", "trigger": {"type": "after", "task": "a", "status": "failed"}}),
            )),
        );
        let ok = follow(&mut d, &ended("a", RunStatus::Succeeded, None));
        assert_eq!(ok.len(), 2);
        assert_eq!((ok[0].0.as_str(), ok[0].1.is_none(), ok[0].2), ("b", true, 1));
        assert!(ok[1].1.as_deref().is_some_and(|w| w.contains("ended SUCCEEDED") && w.contains("on failed")), "{ok:?}");
        let failed = follow(&mut d, &ended("a", RunStatus::Timeout, Some(3)));
        assert!(failed[0].1.is_some() && failed[1].1.is_none() && failed[1].2 == 4, "{failed:?}");
        // A skipped slot of A never ran: nothing follows it.
        assert!(follow(&mut d, &ended("a", RunStatus::Skipped, None)).is_empty());
        // Nor a run cancelled before it started; one cancelled while it ran
        // is followed on `any`.
        let mut never = ended("a", RunStatus::Cancelled, None);
        never.attempts.clear();
        assert!(follow(&mut d, &never).is_empty());
        let cancelled = follow(&mut d, &ended("a", RunStatus::Cancelled, None));
        assert_eq!(cancelled.len(), 2, "{cancelled:?}");
        // A chain past the bound is cut.
        let long = follow(&mut d, &ended("a", RunStatus::Succeeded, Some(MAX_CHAIN)));
        assert!(long[0].1.as_deref().is_some_and(|w| w.contains("cycle")), "{long:?}");
        // B changed to follow nothing; C deleted: nobody follows A.
        d.task_changed("b", Some(&spec(serde_json::json!({"task_id": "b", "agent_id": "ag"}))));
        d.task_changed("c", None);
        assert!(follow(&mut d, &ended("a", RunStatus::Succeeded, None)).is_empty());
        assert!(d.followers.is_empty() && d.follows.is_empty());
    }
}
