//! Cron expressions with cronie semantics, on top of `croner`.
//!
//! Rules (reference: cronie / Vixie cron, `DESIGN.md` "Cron semantics"):
//! 5 fields are minute-first, 6 seconds-first, 7 add a year; day-of-month and
//! day-of-week both restricted match if EITHER matches; 0 and 7 are Sunday;
//! `next_after(t)` is strictly after `t`.
//!
//! Daylight saving time, as cronie's `cron.c` runs it (its "time jumped
//! forward / backward" cases). An expression is **fixed-time** when neither
//! its minute nor its hour field starts with `*` (cronie's `MIN_STAR` and
//! `HR_STAR` flags): `30 2 * * *`, `0 2,14 * * *`, `0,30 2 * * *`,
//! `0-59/20 2 * * *`, `30 1-3 * * *`, `@daily`. Any other (`*/15 2 * * *`,
//! `15 * * * *`, `@hourly`) is a **wildcard** expression.
//! - Spring forward: the wall clock times of the gap never happen. Every
//!   fixed-time slot inside it fires once, at the first instant after the
//!   jump (slots that land on that instant are one slot: run ids are per
//!   instant); wildcard slots inside it do not fire.
//! - Fall back: the wall clock times of the overlap happen twice. A
//!   fixed-time slot fires at the first occurrence only; a wildcard slot at
//!   both.
//!
//! croner walks the wall clock (naive local times, no zone); this module
//! maps each wall clock time to instants by the zone's offsets around it.

use std::str::FromStr;

use chrono::{DateTime, Duration, LocalResult, NaiveDateTime, Offset, TimeZone, Utc};
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
    /// Neither the minute nor the hour field starts with `*` (see the
    /// module doc): DST gaps and overlaps fire such slots once.
    fixed_time: bool,
}

/// How far an offset change reaches in wall clock time: more than the
/// largest DST shift in use (2 h, Antarctica/Troll) plus its own width.
/// Two changes of one zone are never this close.
const NEAR_SECONDS: i64 = 3 * 3600;

/// cronie's fixed-time test: neither the minute nor the hour field starts
/// with `*` (`entry.c` sets `MIN_STAR`/`HR_STAR` from the first character).
/// `@hourly` is `0 * * * *`; the other aliases are fixed.
fn is_fixed_time(expr: &str) -> bool {
    let parts: Vec<&str> = expr.split_whitespace().collect();
    let (minute, hour) = match parts.len() {
        1 => return !parts[0].eq_ignore_ascii_case("@hourly"),
        5 => (parts[0], parts[1]),
        _ => match (parts.get(1), parts.get(2)) {
            (Some(m), Some(h)) => (*m, *h),
            _ => return false,
        },
    };
    !minute.starts_with('*') && !hour.starts_with('*')
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
        let s = CronSchedule { cron, tz, expr: trimmed.to_string(), jitter_ms, fixed_time: is_fixed_time(&normalized) };
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

    /// Whether DST gaps and overlaps fire this schedule's slots once (see
    /// the module doc).
    pub fn is_fixed_time(&self) -> bool {
        self.fixed_time
    }

    /// First fire time strictly after `t`, or `None` if there is none
    /// (before year 5000, croner's search bound). Daylight saving time as
    /// the module doc says.
    pub fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let Some(tr) = self.transition_in(t.timestamp() - NEAR_SECONDS, t.timestamp() + NEAR_SECONDS) else {
            // No offset change near `t`: the next wall clock match after
            // `t`'s is the next slot.
            return self.walk(t, wall(t, self.offset_at(t.timestamp())), false);
        };
        let Transition { at, before, after } = tr;
        let at_wall = |o: Duration| wall(at, o);
        if t < at {
            // Wall clock before the change: `t + before`.
            if let Ok(c) = self.cron.find_next_occurrence(&wall(t, before), false)
                && c < at_wall(before)
            {
                return from_wall(c, before);
            }
        }
        let (from, inclusive) = if after > before {
            // Spring forward: wall clock `[at + before, at + after)` never happens.
            if t < at {
                if self.fixed_time
                    && let Ok(c) = self.cron.find_next_occurrence(&at_wall(before), true)
                    && c <= at_wall(after)
                {
                    // cronie runs the fixed-time slots it skipped at once.
                    return Some(at);
                }
                // `at + after` itself: a fixed-time slot there was the one above.
                (at_wall(after), !self.fixed_time)
            } else {
                (wall(t, after), false)
            }
        } else {
            // Fall back: wall clock `[at + after, at + before)` happens twice;
            // a fixed-time slot only the first time.
            let repeat_end = at_wall(before);
            if t < at {
                if self.fixed_time { (repeat_end, true) } else { (at_wall(after), true) }
            } else if self.fixed_time && wall(t, after) < repeat_end {
                (repeat_end, true)
            } else {
                (wall(t, after), false)
            }
        };
        self.walk(t, from, inclusive)
    }

    /// The first slot after `t` at or after wall clock `from` (strictly
    /// after with `inclusive` false), mapping each wall clock match to its
    /// instants: one, the earlier of two in an overlap (both for wildcard
    /// schedules, the first after `t`), or in a gap the instant the gap
    /// ends (fixed-time schedules; wildcard ones go on past the gap).
    fn walk(&self, t: DateTime<Utc>, mut from: NaiveDateTime, mut inclusive: bool) -> Option<DateTime<Utc>> {
        // Each turn moves past one wall clock match; only matches at or
        // before `t` (a few, next to an offset change) or inside a far gap
        // come round again.
        for _ in 0..100_000 {
            let c = self.cron.find_next_occurrence(&from, inclusive).ok()?;
            match self.tz.from_local_datetime(&c) {
                LocalResult::Single(a) if a.to_utc() > t => return Some(a.to_utc()),
                LocalResult::Ambiguous(a, b) => {
                    if a.to_utc() > t {
                        return Some(a.to_utc());
                    }
                    if !self.fixed_time && b.to_utc() > t {
                        return Some(b.to_utc());
                    }
                }
                LocalResult::None => {
                    // `c` is in a gap: the change lies within a few hours
                    // of `c` read with any nearby offset.
                    let guess = c.and_utc().timestamp() - self.offset_at(c.and_utc().timestamp()).num_seconds();
                    let tr = self.transition_in(guess - NEAR_SECONDS, guess + NEAR_SECONDS)?;
                    if self.fixed_time && tr.at > t {
                        return Some(tr.at);
                    }
                    from = wall(tr.at, tr.after);
                    inclusive = true;
                    continue;
                }
                LocalResult::Single(_) => {}
            }
            from = c;
            inclusive = false;
        }
        None
    }

    /// The zone's offset (local − UTC) at Unix second `s`.
    fn offset_at(&self, s: i64) -> Duration {
        let at = DateTime::from_timestamp(s, 0).unwrap_or_default();
        Duration::seconds(i64::from(self.tz.offset_from_utc_datetime(&at.naive_utc()).fix().local_minus_utc()))
    }

    /// The offset change in `(lo, hi]` (Unix seconds), if the offsets at
    /// the two ends differ: the first second with the new offset.
    fn transition_in(&self, lo: i64, hi: i64) -> Option<Transition> {
        let before = self.offset_at(lo);
        if self.offset_at(hi) == before {
            return None;
        }
        let (mut lo, mut hi) = (lo, hi);
        // offset_at(lo) == before, offset_at(hi) != before.
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if self.offset_at(mid) == before { lo = mid } else { hi = mid }
        }
        Some(Transition { at: DateTime::from_timestamp(hi, 0)?, before, after: self.offset_at(hi) })
    }
}

/// One change of a zone's UTC offset.
#[derive(Debug, Clone, Copy)]
struct Transition {
    /// The first instant with the new offset.
    at: DateTime<Utc>,
    /// Offset (local − UTC) before `at`.
    before: Duration,
    /// Offset from `at` on.
    after: Duration,
}

/// The wall clock reading of instant `t` under offset `o`.
fn wall(t: DateTime<Utc>, o: Duration) -> NaiveDateTime {
    t.naive_utc() + o
}

/// The instant whose wall clock reading under offset `o` is `c`.
fn from_wall(c: NaiveDateTime, o: Duration) -> Option<DateTime<Utc>> {
    Some((c - o).and_utc())
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

    /// cronie's main loop (`cron.c`), minute by minute in real time: the
    /// reference the DST rules are checked against. Returns the instants
    /// at which a 5-field expression's job would start in `[from, until)`
    /// (jobs started at one instant counted once).
    fn cronie_slots(expr: &str, tz: Tz, from: DateTime<Utc>, until: DateTime<Utc>) -> Vec<DateTime<Utc>> {
        let c = CronSchedule::parse(expr, &tz.to_string(), 0).expect("parse");
        let matches = |w: NaiveDateTime| c.cron.is_time_matching(&w).unwrap_or(false);
        let wall_minute = |i: DateTime<Utc>| i.with_timezone(&tz).naive_local();
        let mut out = Vec::new();
        let mut virtual_time = wall_minute(from - Duration::minutes(1));
        let mut i = from;
        while i < until {
            let now = wall_minute(i);
            let diff = (now - virtual_time).num_minutes();
            let fire = if diff == 1 {
                virtual_time = now;
                matches(now)
            } else if diff > 1 {
                // Time jumped forward: wildcard jobs for now, fixed-time
                // jobs for every minute skipped (and now).
                let mut fixed = false;
                while virtual_time < now {
                    virtual_time += Duration::minutes(1);
                    fixed |= matches(virtual_time);
                }
                if c.fixed_time { fixed } else { matches(now) }
            } else {
                // Time went back: wildcard jobs only; virtual time waits.
                !c.fixed_time && matches(now)
            };
            if fire {
                out.push(i);
            }
            i += Duration::minutes(1);
        }
        out
    }

    /// Every shape of expression, in zones that move by an hour and by 30
    /// minutes, north and south, over both changes of 2026: the slots are
    /// exactly the instants cronie's loop starts the job.
    #[test]
    fn dst_slots_are_cronies_for_every_shape() {
        let exprs = [
            "30 2 * * *",
            "0 2,14 * * *",
            "0,30 2 * * *",
            "15,45 1,2 * * *",
            "0-59/20 2 * * *",
            "*/20 2 * * *",
            "30 1-3 * * *",
            "0 0-4/2 * * *",
            "0 */2 * * *",
            "15 * * * *",
            "*/15 * * * *",
            "0 3 * * *",
            "59 1 * * *",
            "0-30/10 1-2 * * *",
            "@daily",
            "@hourly",
            "45 1 * * 0",
        ];
        // (zone, changes of 2026 as UTC instants)
        let zones = [
            ("America/New_York", ["2026-03-08T07:00:00Z", "2026-11-01T06:00:00Z"]),
            ("Europe/Berlin", ["2026-03-29T01:00:00Z", "2026-10-25T01:00:00Z"]),
            ("Australia/Lord_Howe", ["2026-04-04T15:00:00Z", "2026-10-03T15:30:00Z"]),
            ("Australia/Sydney", ["2026-04-04T16:00:00Z", "2026-10-03T16:00:00Z"]),
            ("Antarctica/Troll", ["2026-03-29T01:00:00Z", "2026-10-25T01:00:00Z"]),
        ];
        for (zone, changes) in zones {
            let tz = Tz::from_str(zone).expect("zone");
            for change in changes {
                let at: DateTime<Utc> = change.parse().expect("instant");
                let (from, until) = (at - Duration::hours(30), at + Duration::hours(30));
                let probe = CronSchedule::parse("@daily", zone, 0).expect("parse");
                let t = probe.transition_in(from.timestamp(), until.timestamp()).expect("a change in the window");
                assert_eq!(t.at, at, "{zone}: the change of 2026");
                for expr in exprs {
                    let want = cronie_slots(expr, tz, from, until);
                    assert!(!want.is_empty(), "{expr:?} in {zone}");
                    let s = CronSchedule::parse(expr, zone, 0).expect("parse");
                    let mut got = Vec::new();
                    let mut t = from - Duration::seconds(1);
                    while let Some(n) = s.next_after(t) {
                        if n >= until {
                            break;
                        }
                        got.push(n);
                        t = n;
                    }
                    assert_eq!(got, want, "{expr:?} in {zone} around {change}");
                }
            }
        }
    }

    #[test]
    fn fixed_time_is_cronies_min_star_and_hr_star() {
        for (expr, fixed) in [
            ("30 2 * * *", true),
            ("0 2,14 * * *", true),
            ("0-59/20 2 * * *", true),
            ("0/20 2 * * *", true),
            ("*/20 2 * * *", false),
            ("15 * * * *", false),
            ("0 */2 * * *", false),
            ("0 30 2 * * *", true),
            ("* 30 2 * * *", true),
            ("0 * 2 * * *", false),
            ("@daily", true),
            ("@weekly", true),
            ("@hourly", false),
        ] {
            assert_eq!(CronSchedule::parse(expr, "UTC", 0).expect("parse").is_fixed_time(), fixed, "{expr}");
        }
    }
}
