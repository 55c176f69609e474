//! `resources:` — scarce things many tasks share (a search API, an LLM
//! provider), each with the limits the leader enforces at dispatch across
//! every task that declares it (`execution.resources`): at most
//! `concurrency` live agents, at most `requests_per_minute` attempts
//! started and `tokens_per_minute` tokens (an attempt's estimate, settled
//! against its reported usage) per minute.
//!
//! ```yaml
//! resources:
//!   search-api: {concurrency: 3}
//!   openai: {concurrency: 50, requests_per_minute: 500, tokens_per_minute: 200000}
//! ```

use serde::Deserialize;

use crate::error::{Error, Result};

/// One resource as written.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResourceSpec {
    /// Live agents at once, across every task that uses it (`1..=100000`).
    #[serde(default)]
    pub concurrency: Option<u32>,
    /// Attempts started per minute (`1..=1000000`).
    #[serde(default)]
    pub requests_per_minute: Option<u32>,
    /// Tokens per minute: each attempt reserves its task's estimate
    /// (`execution.resources[].tokens`) and settles it with the usage it
    /// reports (`1..=10^12`).
    #[serde(default)]
    pub tokens_per_minute: Option<u64>,
}

/// The validated limits of one resource (`None`: no limit of that kind).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResourceLimits {
    /// Live agents at once.
    pub concurrency: Option<u32>,
    /// Attempts started per minute.
    pub requests_per_minute: Option<u32>,
    /// Tokens per minute.
    pub tokens_per_minute: Option<u64>,
}

/// Checks one resource.
///
/// Errors: `InvalidArgument` naming `resources.NAME` (its name: letters,
/// digits, `_`, `-`, `.`; 1 to 64) or `resources.NAME.FIELD`; a resource
/// with no limit at all.
pub fn validate(name: &str, spec: &ResourceSpec) -> Result<ResourceLimits> {
    if !punchclock_proto::resources::is_valid_name(name) {
        return Err(Error::invalid(format!("resources.{name}"), punchclock_proto::resources::NAME_RULE));
    }
    let field = |f: &str| format!("resources.{name}.{f}");
    if let Some(c) = spec.concurrency
        && !(1..=100_000).contains(&c)
    {
        return Err(Error::invalid(field("concurrency"), format!("must be in 1..=100000 (got {c})")));
    }
    if let Some(r) = spec.requests_per_minute
        && !(1..=1_000_000).contains(&r)
    {
        return Err(Error::invalid(field("requests_per_minute"), format!("must be in 1..=1000000 (got {r})")));
    }
    if let Some(t) = spec.tokens_per_minute
        && !(1..=1_000_000_000_000).contains(&t)
    {
        return Err(Error::invalid(field("tokens_per_minute"), format!("must be in 1..=1000000000000 (got {t})")));
    }
    if spec.concurrency.is_none() && spec.requests_per_minute.is_none() && spec.tokens_per_minute.is_none() {
        return Err(Error::invalid(
            format!("resources.{name}"),
            "give at least one limit: concurrency, requests_per_minute or tokens_per_minute",
        ));
    }
    Ok(ResourceLimits {
        concurrency: spec.concurrency,
        requests_per_minute: spec.requests_per_minute,
        tokens_per_minute: spec.tokens_per_minute,
    })
}
