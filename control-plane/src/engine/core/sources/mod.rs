//! Run sources: what asks the core for runs. Each source turns its input
//! into run requests and hands them to the one admission
//! (`runs.rs::admit`: every policy, one record per run id). Today:
//! - time slots: `tasks.rs` (the generator: plans a task's due slots);
//! - manual triggers: `runs.rs` (`trigger`, delayed ones admitted when due);
//! - events, re-runs and followers: `events.rs` (one existence lookup per
//!   batch, then admission);
//! - backfills: [`backfill`] (a durable object whose cursor the fenced
//!   leader advances with the run of each slot).
//!
//! A new source is a file here, its request type and its API.

pub mod backfill;
