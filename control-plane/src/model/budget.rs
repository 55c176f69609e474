//! What budgets count and how it is stored: an [`Amount`] of spend, the
//! [`BudgetCharge`] a run carries from its admission (the reservation a new
//! leader rebuilds), and the ledger's keys (`budgets/{name}/{window}/…`,
//! see [`crate::repo::Keys::budget_total`]). The policy is
//! `engine/core/policy/budgets.rs`; the configuration `config/budgets.rs`.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::run::Usage;

/// Spend over a window, or one run's: cost (the agents' currency unit),
/// tokens and runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Amount {
    /// Cost: the agents' `usage.cost`, else tokens times the model's price.
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub cost: f64,
    /// Input tokens.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub input_tokens: u64,
    /// Output tokens.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub output_tokens: u64,
    /// Runs admitted.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub runs: u64,
}

fn is_zero_f64(v: &f64) -> bool {
    *v == 0.0
}

fn is_zero_u64(v: &u64) -> bool {
    *v == 0
}

impl Amount {
    /// One run that used `usage` (its cost as reported, or `priced` when
    /// it reported none).
    pub fn of_run(usage: &Usage, priced: Option<f64>) -> Amount {
        let cost = if usage.cost > 0.0 { usage.cost } else { priced.unwrap_or(0.0) };
        Amount { cost, input_tokens: usage.input_tokens, output_tokens: usage.output_tokens, runs: 1 }
    }

    /// `self + o`.
    pub fn plus(self, o: Amount) -> Amount {
        Amount {
            // Finite whatever is added (a stored ledger must stay readable).
            cost: (self.cost + o.cost).min(f64::MAX),
            input_tokens: self.input_tokens.saturating_add(o.input_tokens),
            output_tokens: self.output_tokens.saturating_add(o.output_tokens),
            runs: self.runs.saturating_add(o.runs),
        }
    }

    /// `self - o`, never below zero.
    pub fn minus(self, o: Amount) -> Amount {
        Amount {
            cost: (self.cost - o.cost).max(0.0),
            input_tokens: self.input_tokens.saturating_sub(o.input_tokens),
            output_tokens: self.output_tokens.saturating_sub(o.output_tokens),
            runs: self.runs.saturating_sub(o.runs),
        }
    }
}

/// What a run was charged against one budget at admission: the window it
/// counts in and the estimate reserved until it ends (settled then against
/// what it used, in the same transaction as its final record).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BudgetCharge {
    /// The budget (`budgets[].name` of the config).
    pub budget: String,
    /// Start of the window the run counts in (UTC).
    pub window_start: DateTime<Utc>,
    /// The estimate reserved (`runs` is 1).
    pub reserved: Amount,
    /// Nothing could estimate the run when it was admitted (no settled run
    /// of its task, none in the window) and the budget limits more than
    /// runs: only its run is reserved, and it is estimated again when it
    /// can be dispatched — after the first such run of the window settles
    /// (issue 34: a new task's first burst was admitted whole).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unknown: bool,
}
