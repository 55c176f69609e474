//! Routing and retries, as plain data structures and functions the engine's
//! decision core calls: the runner registry (who serves what, free slots,
//! liveness — [`registry`]), the ready queue in dispatch order
//! ([`queue`]), and the retry policy ([`retry`]).

pub mod queue;
pub mod registry;
pub mod retry;
