//! Cron expressions with cronie semantics, on top of `croner`.
//!
//! Rules (reference: cronie / Vixie cron, `DESIGN.md` "Cron semantics"):
//! 5 fields are minute-first, 6 seconds-first, 7 add a year; day-of-month and
//! day-of-week both restricted match if EITHER matches; 0 and 7 are Sunday;
//! a fixed-time slot in a spring-forward gap fires once at the first instant
//! after the jump; in a fall-back overlap it fires once, at the first
//! occurrence; `next_after(t)` is strictly after `t`.

use std::str::FromStr;

use chrono::{DateTime, TimeZone, Utc};
use chrono_tz::Tz;
use croner::Cron;
use croner::parser::{CronParser, Seconds, Year};

use crate::error::Error;

/// A parsed cron expression bound to an IANA zone.
#[derive(Debug, Clone)]
pub struct CronSchedule {
    cron: Cron,
    tz: Tz,
    /// The expression as written.
    pub expr: String,
    /// Jitter bound in milliseconds.
    pub jitter_ms: u64,
}

/// A cron parse error before it knows its field path.
#[derive(Debug)]
pub enum CronError {
    /// Problem with the expression (message names the cron field).
    Expr(String),
    /// Unknown zone.
    Zone(String),
}

impl CronError {
    /// Places the error at `path.expr` / `path.timezone`.
    pub fn at(self, path: &str) -> Error {
        match self {
            CronError::Expr(m) => Error::invalid(format!("{path}.expr"), m),
            CronError::Zone(m) => Error::invalid(format!("{path}.timezone"), m),
        }
    }
}

impl std::fmt::Display for CronError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CronError::Expr(m) => write!(f, "expr: {m}"),
            CronError::Zone(m) => write!(f, "timezone: {m}"),
        }
    }
}

/// cronie's day rule: when either day field starts with `*` (including
/// `*/2`), a day must match both; when both are restricted, either.
fn parser_for(expr: &str) -> CronParser {
    let parts: Vec<&str> = expr.split_whitespace().collect();
    let (dom, dow) = match parts.len() {
        5 => (2, 4),
        6 | 7 => (3, 5),
        _ => return parser(),
    };
    let star = |i: usize| parts.get(i).is_some_and(|p| p.starts_with('*') || p.starts_with('?'));
    if star(dom) || star(dow) { parser_with(true) } else { parser() }
}

fn parser() -> CronParser {
    parser_with(false)
}

fn parser_with(dom_and_dow: bool) -> CronParser {
    CronParser::builder()
        .seconds(Seconds::Optional)
        .year(Year::Optional)
        // cronie: both day fields restricted → OR; see `parser_for`.
        .dom_and_dow(dom_and_dow)
        // Accept `0/10` (= 0-59/10), as cronie and Quartz do.
        .sloppy_ranges(true)
        .build()
}

const FIELDS_5: [&str; 5] = ["minute", "hour", "day-of-month", "month", "day-of-week"];
const FIELDS_6: [&str; 6] = ["second", "minute", "hour", "day-of-month", "month", "day-of-week"];
const FIELDS_7: [&str; 7] = ["second", "minute", "hour", "day-of-month", "month", "day-of-week", "year"];

/// Names the first field croner refuses: the first `i` for which the
/// expression with fields `0..=i` as written and the rest `*` fails.
fn blame_field(expr: &str, msg: &str) -> String {
    let parts: Vec<&str> = expr.split_whitespace().collect();
    let names: &[&str] = match parts.len() {
        5 => &FIELDS_5,
        6 => &FIELDS_6,
        7 => &FIELDS_7,
        n => return format!("{expr:?} has {n} fields; use 5 (minute first), 6 (seconds first) or 7 (with year), or an @alias"),
    };
    let p = parser();
    for (i, name) in names.iter().enumerate() {
        let probe: Vec<&str> = parts.iter().enumerate().map(|(j, f)| if j <= i { *f } else { "*" }).collect();
        if let Err(e) = p.parse(&probe.join(" ")) {
            return format!("{name} field {:?}: {e}", parts[i]);
        }
    }
    format!("{expr:?}: {msg}")
}

/// The range of each field, by name (cronie: minute 0-59, hour 0-23,
/// day-of-month 1-31, month 1-12, day-of-week 0-7; seconds 0-59).
fn field_range(name: &str) -> (u32, u32) {
    match name {
        "second" | "minute" => (0, 59),
        "hour" => (0, 23),
        "day-of-month" => (1, 31),
        "month" => (1, 12),
        "day-of-week" => (0, 7),
        _ => (1970, 2099),
    }
}

/// What croner accepts but a user surely did not mean: a step larger than
/// its field's range (`*/70` in minutes fires only at 0), and `L` alone in
/// day-of-week (it matches no day).
fn precheck(expr: &str) -> Result<(), CronError> {
    let parts: Vec<&str> = expr.split_whitespace().collect();
    let names: &[&str] = match parts.len() {
        5 => &FIELDS_5,
        6 => &FIELDS_6,
        7 => &FIELDS_7,
        _ => return Ok(()),
    };
    for (field, name) in parts.iter().zip(names) {
        if *name == "day-of-week" && field.eq_ignore_ascii_case("L") {
            return Err(CronError::Expr(
                "day-of-week field \"L\": L alone matches no day here; write 5L for the last Friday of the month, \
                 or put L in day-of-month for the last day of the month"
                    .into(),
            ));
        }
        let (lo, hi) = field_range(name);
        for item in field.split(',') {
            if let Some((_, step)) = item.split_once('/')
                && let Ok(step) = step.parse::<u32>()
                && step > hi - lo + 1
            {
                return Err(CronError::Expr(format!(
                    "{name} field {field:?}: step {step} is larger than the field's range {lo}-{hi} (it would fire only at the start)"
                )));
            }
        }
    }
    Ok(())
}

impl CronSchedule {
    /// Parses `expr` in zone `tz` (IANA name). Errors name the cron field
    /// (`minute field "61": ...`), an unknown zone, or a schedule that can
    /// never fire (`0 0 30 2 *`).
    pub fn parse(expr: &str, tz: &str, jitter_ms: u64) -> Result<Self, CronError> {
        let tz = Tz::from_str(tz)
            .map_err(|_| CronError::Zone(format!("unknown time zone {tz:?} (use an IANA name such as \"Asia/Shanghai\")")))?;
        let trimmed = expr.trim();
        if trimmed.is_empty() {
            return Err(CronError::Expr("must not be empty".into()));
        }
        let normalized = match trimmed.to_ascii_lowercase().as_str() {
            "@midnight" => "@daily".to_string(),
            "@reboot" => return Err(CronError::Expr("@reboot is not a schedule".into())),
            a if a.starts_with('@') && !["@yearly", "@annually", "@monthly", "@weekly", "@daily", "@hourly"].contains(&a) => {
                return Err(CronError::Expr(format!("unknown alias {trimmed:?}")));
            }
            _ => trimmed.to_string(),
        };
        precheck(&normalized)?;
        let cron = parser_for(&normalized).parse(&normalized).map_err(|e| CronError::Expr(blame_field(&normalized, &e.to_string())))?;
        let s = CronSchedule { cron, tz, expr: trimmed.to_string(), jitter_ms };
        // A calendar-impossible schedule (Feb 30, Apr 31) has no slot at all.
        let probe = Utc.with_ymd_and_hms(2000, 1, 1, 0, 0, 0).single().unwrap_or_default();
        if s.next_after(probe).is_none() {
            return Err(CronError::Expr(format!("{trimmed:?} can never fire")));
        }
        Ok(s)
    }

    /// The zone the expression is read in.
    pub fn timezone(&self) -> Tz {
        self.tz
    }

    /// First fire time strictly after `t`, or `None` if there is none
    /// (before year 5000, croner's search bound).
    pub fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let local = t.with_timezone(&self.tz);
        self.cron.find_next_occurrence(&local, false).ok().map(|d| d.with_timezone(&Utc))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shared cron cases (a copy of `shared/cases/cron.json`): the truth
    /// for cron semantics, checked here against next-fire computation.
    const CASES: &str = include_str!("../../../tests/cases/cron.json");

    #[test]
    fn shared_cron_cases_pass() {
        let v: serde_json::Value = serde_json::from_str(CASES).expect("cases parse");
        for c in v["cases"].as_array().expect("cases") {
            let id = c["id"].as_str().unwrap_or("?");
            let s = CronSchedule::parse(c["expr"].as_str().unwrap_or(""), c["timezone"].as_str().unwrap_or("UTC"), 0)
                .unwrap_or_else(|e| panic!("{id}: {e}"));
            let mut t: DateTime<Utc> = c["after"].as_str().unwrap_or("").parse().expect("after");
            for want in c["expected"].as_array().expect("expected") {
                let want: DateTime<Utc> = want.as_str().unwrap_or("").parse().expect("expected time");
                let got = s.next_after(t).unwrap_or_else(|| panic!("{id}: no fire after {t}"));
                assert_eq!(got, want, "case {id}");
                t = got;
            }
        }
        for c in v["invalid"].as_array().expect("invalid") {
            let id = c["id"].as_str().unwrap_or("?");
            let r = CronSchedule::parse(c["expr"].as_str().unwrap_or(""), c["timezone"].as_str().unwrap_or("UTC"), 0);
            assert!(r.is_err(), "invalid case {id} was accepted");
        }
    }

    #[test]
    fn errors_name_the_cron_field() {
        let e = CronSchedule::parse("0 61 * * *", "UTC", 0).expect_err("bad minute").to_string();
        assert!(e.contains("hour field") || e.contains("minute field"), "{e}");
        let e = CronSchedule::parse("0 61 * * *", "UTC", 0).expect_err("bad").to_string();
        // 5 fields are minute-first: "0 61" puts 61 in the hour field.
        assert!(e.contains("hour field \"61\""), "{e}");
        let e = CronSchedule::parse("61 * * * *", "UTC", 0).expect_err("bad").to_string();
        assert!(e.contains("minute field \"61\""), "{e}");
        let e = CronSchedule::parse("0 0 * * *", "Mars/Olympus", 0).expect_err("bad zone").to_string();
        assert!(e.contains("Mars/Olympus"), "{e}");
        // Several bad fields: the first is named.
        let e = CronSchedule::parse("61 25 * * *", "UTC", 0).expect_err("bad").to_string();
        assert!(e.contains("minute field \"61\""), "{e}");
        let e = CronSchedule::parse("*/70 * * * *", "UTC", 0).expect_err("step").to_string();
        assert!(e.contains("step 70 is larger than the field's range 0-59"), "{e}");
        let e = CronSchedule::parse("0 0 * * L", "UTC", 0).expect_err("L").to_string();
        assert!(e.contains("L alone matches no day") && e.contains("5L"), "{e}");
        assert!(CronSchedule::parse("0 0 L * *", "UTC", 0).is_ok() && CronSchedule::parse("0 0 * * 5L", "UTC", 0).is_ok());
        let e = CronSchedule::parse("0 0 30 2 *", "UTC", 0).expect_err("never").to_string();
        assert!(e.contains("never fire"), "{e}");
    }

    /// cronie: a day field starting with `*` (even `*/2`) means both must
    /// match; croner alone treated `*/2` as restricted and used OR.
    #[test]
    fn stepped_star_day_field_means_and() {
        let s = CronSchedule::parse("0 0 */2 * MON", "UTC", 0).expect("parse");
        let mut t: DateTime<Utc> = "2026-02-01T00:00:00Z".parse().expect("t");
        let mut got = Vec::new();
        for _ in 0..3 {
            t = s.next_after(t).expect("next");
            got.push(t.to_rfc3339());
        }
        assert_eq!(got, vec!["2026-02-09T00:00:00+00:00", "2026-02-23T00:00:00+00:00", "2026-03-09T00:00:00+00:00"]);
        // Both restricted: OR (the shared dom-dow-or case covers it too).
        let s = CronSchedule::parse("0 0 1 * MON", "UTC", 0).expect("parse");
        let t: DateTime<Utc> = "2026-02-01T00:00:00Z".parse().expect("t");
        assert_eq!(s.next_after(t).map(|d| d.to_rfc3339()), Some("2026-02-02T00:00:00+00:00".to_string()));
    }

    #[test]
    fn aliases_and_seven_fields() {
        let t: DateTime<Utc> = "2026-11-30T10:15:00Z".parse().expect("t");
        let hourly = CronSchedule::parse("@hourly", "UTC", 0).expect("alias");
        assert_eq!(hourly.next_after(t), Some("2026-11-30T11:00:00Z".parse().expect("t")));
        let midnight = CronSchedule::parse("@midnight", "UTC", 0).expect("alias");
        assert_eq!(midnight.next_after(t), Some("2026-12-01T00:00:00Z".parse().expect("t")));
        let y = CronSchedule::parse("0 0 0 1 1 * 2028", "UTC", 0).expect("7 fields");
        assert_eq!(y.next_after(t), Some("2028-01-01T00:00:00Z".parse().expect("t")));
        let last = CronSchedule::parse("0 12 L * *", "UTC", 0).expect("L");
        assert_eq!(last.next_after(t), Some("2026-11-30T12:00:00Z".parse().expect("t")));
    }
}
