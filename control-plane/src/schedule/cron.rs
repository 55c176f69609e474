//! Cron expressions with cronie semantics, on top of `croner`.
//!
//! Rules (reference: cronie / Vixie cron, `DESIGN.md` "Cron semantics"):
//! 5 fields are minute-first, 6 seconds-first, 7 add a year; day-of-month and
//! day-of-week both restricted match if EITHER matches; 0 and 7 are Sunday;
//! `next_after(t)` is strictly after `t`.
//!
//! The text is read here, by cronie's grammar (`entry.c` `get_list`,
//! `get_range`, `get_number`) plus the extensions the README lists, and
//! handed to croner as plain numbers: croner's own reading differs from
//! cronie's (it turned `-SUN` into `-7`, replaced month and day names in
//! every field, split fields at any Unicode space, skipped empty list items,
//! refused `*,5` and `MON-0`, took `/10`); `read` below is that reader.
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
//! A trigger's `dst` policy replaces either half of that rule (README
//! "DST"): `gap: shift` runs a skipped slot at the jump (as fixed-time
//! expressions do), `gap: skip` leaves it a SKIPPED `dst_gap` record there
//! ([`CronSchedule::gap_slots`]); `repeat: first | last | both` runs a
//! repeated slot at its first, its second or both occurrences (each its
//! own instant, so its own run id). Without a policy, fixed-time
//! expressions shift and take the first occurrence; wildcard ones drop the
//! gap's slots without a record and take both occurrences.
//!
//! croner walks the wall clock (naive local times, no zone); this module
//! maps each wall clock time to instants by the zone's offsets around it.

use std::str::FromStr;

use chrono::{DateTime, Duration, LocalResult, NaiveDateTime, Offset, TimeZone, Utc};
use chrono_tz::Tz;
use croner::Cron;
use croner::parser::{self, CronParser, Seconds};

use super::spec::{DstSpec, GapRule, RepeatRule};
use crate::error::Error;

/// A parsed cron expression bound to an IANA zone and a DST policy.
#[derive(Debug, Clone)]
pub struct CronSchedule {
    cron: Cron,
    tz: Tz,
    /// The expression as written.
    pub expr: String,
    /// Neither the minute nor the hour field starts with `*` (see the
    /// module doc): by default DST gaps and overlaps fire such slots once.
    fixed_time: bool,
    /// The DST policy, each half resolved.
    rules: DstRules,
    /// The shortest gap between two slots (ms), worked out once when first
    /// asked (`jitter: auto`); the schedule is shared through
    /// [`parse_cron`]'s cache, so once per expression.
    min_gap_ms: std::sync::OnceLock<Option<u64>>,
}

/// A DST policy with both halves decided: a trigger's `dst`, and cronie's
/// rule for the expression's shape where it says nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DstRules {
    /// Slots in a gap.
    pub gap: Gap,
    /// Slots in a repeated hour.
    pub repeat: RepeatRule,
}

/// What slots in a DST gap do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Gap {
    /// Run at the jump (`gap: shift`).
    Shift,
    /// A SKIPPED `dst_gap` record at the jump (`gap: skip`).
    Skip,
    /// Nothing at all: cronie's rule for wildcard expressions, the
    /// default when `dst.gap` is not given.
    Omit,
}

impl DstRules {
    /// `spec`'s halves; a half not given is cronie's for a fixed-time
    /// (`fixed`) or a wildcard expression.
    pub fn resolve(spec: DstSpec, fixed: bool) -> DstRules {
        DstRules {
            gap: match spec.gap {
                Some(GapRule::Shift) => Gap::Shift,
                Some(GapRule::Skip) => Gap::Skip,
                None if fixed => Gap::Shift,
                None => Gap::Omit,
            },
            repeat: spec.repeat.unwrap_or(if fixed { RepeatRule::First } else { RepeatRule::Both }),
        }
    }

    /// The instants of wall clock time `c` in `tz` under these rules,
    /// earliest first: one, two (`both`) or none in a repeated hour's
    /// choice, and for a time in a gap the jump (`shift`, `skip`) or none.
    pub fn instants(self, tz: Tz, c: NaiveDateTime) -> Vec<DateTime<Utc>> {
        match tz.from_local_datetime(&c) {
            LocalResult::Single(a) => vec![a.to_utc()],
            LocalResult::Ambiguous(a, b) => match self.repeat {
                RepeatRule::First => vec![a.to_utc()],
                RepeatRule::Last => vec![b.to_utc()],
                RepeatRule::Both => vec![a.to_utc(), b.to_utc()],
            },
            LocalResult::None => match self.gap {
                Gap::Omit => Vec::new(),
                Gap::Shift | Gap::Skip => gap_jump(tz, c).into_iter().collect(),
            },
        }
    }
}

/// The instant a gap containing wall clock time `c` ends (the first
/// instant with the new offset).
pub fn gap_jump(tz: Tz, c: NaiveDateTime) -> Option<DateTime<Utc>> {
    let guess = c.and_utc().timestamp() - offset_of(tz, c.and_utc().timestamp()).num_seconds();
    transition_of(tz, guess - NEAR_SECONDS, guess + NEAR_SECONDS).map(|t| t.at)
}

/// How far an offset change reaches in wall clock time: more than the
/// largest DST shift in use (2 h, Antarctica/Troll) plus its own width.
/// Two changes of one zone are never this close.
const NEAR_SECONDS: i64 = 3 * 3600;

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

/// One field of an expression: its name in errors, its values and the
/// names it knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Second,
    Minute,
    Hour,
    DayOfMonth,
    Month,
    DayOfWeek,
    Year,
}

use Field::{DayOfMonth, DayOfWeek, Hour, Minute, Month, Second, Year};

const FIELDS_5: [Field; 5] = [Minute, Hour, DayOfMonth, Month, DayOfWeek];
const FIELDS_6: [Field; 6] = [Second, Minute, Hour, DayOfMonth, Month, DayOfWeek];
const FIELDS_7: [Field; 7] = [Second, Minute, Hour, DayOfMonth, Month, DayOfWeek, Year];

/// cronie's `MonthNames` and `DowNames` (`entry.c`): three letters, any
/// case, the n-th name meaning the field's lowest value + n.
const MONTH_NAMES: [&str; 12] = ["JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"];
const DAY_NAMES: [&str; 7] = ["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"];

impl Field {
    fn name(self) -> &'static str {
        match self {
            Second => "second",
            Minute => "minute",
            Hour => "hour",
            DayOfMonth => "day-of-month",
            Month => "month",
            DayOfWeek => "day-of-week",
            Year => "year",
        }
    }

    /// Lowest and highest value (cronie's `FIRST_*`/`LAST_*`: day-of-week
    /// 0-7, both Sunday; seconds as minutes; years as croner bounds them).
    fn bounds(self) -> (u32, u32) {
        match self {
            Second | Minute => (0, 59),
            Hour => (0, 23),
            DayOfMonth => (1, 31),
            Month => (1, 12),
            DayOfWeek => (0, 7),
            Year => (1, 5000),
        }
    }

    /// The names this field knows, and no other field's.
    fn names(self) -> &'static [&'static str] {
        match self {
            Month => &MONTH_NAMES,
            DayOfWeek => &DAY_NAMES,
            _ => &[],
        }
    }
}

/// An expression read by cronie's grammar (`entry.c` `get_list`,
/// `get_range`, `get_number`) plus the extensions the README lists: the text
/// croner is given, and the flags cronie takes from the text as written.
#[derive(Debug)]
struct Read {
    /// The fields for croner, space-separated: numbers only (names and
    /// `SUN` read per field here, not by croner's text replacement, which
    /// turned `-SUN` into `-7`), `*` inside a list spelled out as a range,
    /// a day-of-week `x-0` as `x-7`, `a/s` as `a-max/s`.
    croner: String,
    /// Neither the minute nor the hour field starts with `*` (cronie's
    /// `MIN_STAR`/`HR_STAR` come from the first character): see the module
    /// doc.
    fixed_time: bool,
    /// A day field starts with `*` or `?` (cronie's `DOM_STAR`/`DOW_STAR`,
    /// `*/2` included): a day must match both day fields; otherwise either.
    dom_and_dow: bool,
}

/// The 5-field text of an alias (cronie's `@` entries, any case).
fn alias(text: &str) -> Result<&'static str, CronError> {
    match text.to_ascii_lowercase().as_str() {
        "@yearly" | "@annually" => Ok("0 0 1 1 *"),
        "@monthly" => Ok("0 0 1 * *"),
        "@weekly" => Ok("0 0 * * 0"),
        "@daily" | "@midnight" => Ok("0 0 * * *"),
        "@hourly" => Ok("0 * * * *"),
        "@reboot" => Err(CronError::Expr("@reboot is not a schedule".into())),
        _ => Err(CronError::Expr(format!("unknown alias {text:?}"))),
    }
}

/// Reads `expr` (see [`Read`]). Errors name the cron field and its text
/// (`day-of-week field "3-1": ...`), or the character that is not ASCII
/// or separates fields without being a space or a tab.
fn read(expr: &str) -> Result<Read, CronError> {
    // cronie's `Skip_Blanks` separates fields at ' ' and '\t' only; Rust's
    // `split_whitespace` (croner's) also at U+00A0, U+3000 and the like,
    // and croner's `to_uppercase` reads U+017F ſ as S.
    if let Some((at, c)) = expr.chars().enumerate().find(|(_, c)| !(c.is_ascii_graphic() || *c == ' ' || *c == '\t')) {
        return Err(CronError::Expr(format!(
            "character U+{:04X} at character {} of {expr:?}: an expression is ASCII, and only ASCII spaces and tabs separate its fields",
            u32::from(c),
            at + 1
        )));
    }
    let text = expr.trim_matches([' ', '\t']);
    if text.is_empty() {
        return Err(CronError::Expr("must not be empty".into()));
    }
    let text = if text.starts_with('@') { alias(text)? } else { text };
    let parts: Vec<&str> = text.split([' ', '\t']).filter(|p| !p.is_empty()).collect();
    let fields: &[Field] = match parts.len() {
        5 => &FIELDS_5,
        6 => &FIELDS_6,
        7 => &FIELDS_7,
        n => {
            return Err(CronError::Expr(format!(
                "{text:?} has {n} fields; use 5 (minute first), 6 (seconds first) or 7 (with year), or an @alias"
            )));
        }
    };
    let mut croner = Vec::with_capacity(parts.len());
    for (part, field) in parts.iter().zip(fields) {
        let f = read_field(*field, part).map_err(|why| CronError::Expr(format!("{} field {part:?}: {why}", field.name())))?;
        croner.push(f);
    }
    let starts_star = |f: Field| parts.iter().zip(fields).any(|(p, g)| *g == f && (p.starts_with('*') || p.starts_with('?')));
    Ok(Read {
        croner: croner.join(" "),
        fixed_time: !starts_star(Minute) && !starts_star(Hour),
        dom_and_dow: starts_star(DayOfMonth) || starts_star(DayOfWeek),
    })
}

/// One field: `?` (day fields, Quartz's "any") or a comma list of items,
/// none empty (croner skipped empty items; cronie refuses them).
fn read_field(f: Field, text: &str) -> Result<String, String> {
    if text == "?" {
        return if matches!(f, DayOfMonth | DayOfWeek) {
            Ok("*".into())
        } else {
            Err("? (any) is only for day-of-month and day-of-week".into())
        };
    }
    if text == "*" {
        return Ok("*".into());
    }
    let items: Vec<&str> = text.split(',').collect();
    let mut out = Vec::with_capacity(items.len());
    for item in &items {
        if item.is_empty() {
            return Err("empty list item (a comma with no value on one side)".into());
        }
        out.push(read_item(f, item)?);
    }
    let has = |s: &str| items.iter().any(|i| i.eq_ignore_ascii_case(s));
    if f == DayOfMonth && has("L") && has("LW") {
        // croner tests LW first and never reaches L: one would be dropped.
        return Err("L (last day) and LW (last weekday) together are not supported; use one of them".into());
    }
    Ok(out.join(","))
}

/// One list item: `*`, `*/s`, `a`, `a-b`, `a-b/s`, `a/s` (Quartz: from `a`
/// to the field's end), and `L`, `LW`, `nW` in day-of-month, `nL`, `n#k` in
/// day-of-week. `a` and `b` are numbers or this field's names.
fn read_item(f: Field, item: &str) -> Result<String, String> {
    let (lo, hi) = f.bounds();
    if item.contains('~') {
        return Err("~ (cronie's random pick) is not supported".into());
    }
    if let Some((range, step)) = item.split_once('/') {
        let step = number(step).ok_or_else(|| format!("step {step:?} is not a number"))?;
        if step == 0 {
            return Err("step must not be 0".into());
        }
        if step > hi - lo + 1 {
            return Err(format!("step {step} is larger than the field's range {lo}-{hi} (it would fire only at the start)"));
        }
        return match range {
            "" => Err(format!("a step needs a start: write */{step} (every {step}) or a-b/{step}")),
            "*" => Ok(format!("*/{step}")),
            r => match r.split_once('-') {
                Some((a, b)) => {
                    let (a, b) = read_range(f, a, b, Some(step))?;
                    Ok(format!("{a}-{b}/{step}"))
                }
                None => Ok(format!("{}-{hi}/{step}", value(f, r)?)),
            },
        };
    }
    if item == "*" {
        // cronie: `*` as one item of a list is every value.
        return Ok(format!("{lo}-{hi}"));
    }
    if let Some((a, b)) = item.split_once('-') {
        let (a, b) = read_range(f, a, b, None)?;
        return Ok(format!("{a}-{b}"));
    }
    match f {
        DayOfMonth => {
            let up = item.to_ascii_uppercase();
            if up == "L" || up == "LW" {
                return Ok(up);
            }
            if let Some(d) = up.strip_suffix('W') {
                return Ok(format!("{}W", value(f, d)?));
            }
        }
        DayOfWeek => {
            if item.eq_ignore_ascii_case("L") {
                return Err("L alone matches no day here; write 5L for the last Friday of the month, \
                            or put L in day-of-month for the last day of the month"
                    .into());
            }
            if let Some((d, k)) = item.split_once('#') {
                let d = value(f, d)?;
                return match number(k) {
                    Some(k @ 1..=5) => Ok(format!("{d}#{k}")),
                    _ => Err(format!("#{k}: the occurrence after # is 1 to 5")),
                };
            }
            if let Some(d) = item.strip_suffix(['L', 'l']) {
                return Ok(format!("{}L", value(f, d)?));
            }
        }
        _ => {}
    }
    Ok(value(f, item)?.to_string())
}

/// `a-b`: `a` at most `b`, except cronie's one wrap: a day-of-week range
/// ending at 0 (`SUN`) reads as ending at 7 (`get_range`, `R_RANGE_NUM2`),
/// but not with a step, where cronie takes the step first and sets no day.
fn read_range(f: Field, a: &str, b: &str, step: Option<u32>) -> Result<(u32, u32), String> {
    let (x, y) = (value(f, a)?, value(f, b)?);
    if x <= y {
        return Ok((x, y));
    }
    if f == DayOfWeek && y == 0 {
        return match step {
            None => Ok((x, 7)),
            Some(s) => Err(format!("cronie reads a stepped range ending at Sunday (0) as no day at all; write {x}-7/{s}")),
        };
    }
    let hint = if f == DayOfWeek { " (only a range ending at 0 or SUN reads as ending at 7, Sunday)" } else { "" };
    Err(format!("range {a}-{b} runs backwards ({x} is after {y}); ranges do not wrap{hint}"))
}

/// A number or one of the field's names, within the field's bounds.
fn value(f: Field, s: &str) -> Result<u32, String> {
    let (lo, hi) = f.bounds();
    if s.is_empty() {
        return Err("a value is missing (a range needs both ends)".into());
    }
    if let Some(n) = number(s) {
        return if (lo..=hi).contains(&n) { Ok(n) } else { Err(format!("{n} is out of range {lo}-{hi}")) };
    }
    if s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{s} is out of range {lo}-{hi}"));
    }
    if let Some(i) = f.names().iter().position(|n| n.eq_ignore_ascii_case(s)) {
        return Ok(lo + i as u32);
    }
    Err(match f.names() {
        [first, .., last] => format!("{s:?} is neither a number {lo}-{hi} nor a name {first}-{last}"),
        _ => format!("{s:?} is not a number {lo}-{hi}"),
    })
}

/// ASCII digits only (`str::parse` also takes a leading `+`).
fn number(s: &str) -> Option<u32> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// The parser for croner's text (see [`Read`]): 5 to 7 fields, no sloppy
/// ranges (`a/s` arrives as `a-max/s`; `/s` is refused before).
fn croner_parser(dom_and_dow: bool) -> CronParser {
    CronParser::builder().seconds(Seconds::Optional).year(parser::Year::Optional).dom_and_dow(dom_and_dow).build()
}

impl CronSchedule {
    /// The shortest gap between two of its slots in ms (over its first 16
    /// slots after 2001-01-01), worked out once; `None` without slots.
    pub fn min_gap_ms(&self) -> Option<u64> {
        *self.min_gap_ms.get_or_init(|| {
            let mut t = Utc.with_ymd_and_hms(2001, 1, 1, 0, 0, 0).single()?;
            let mut least: Option<i64> = None;
            for _ in 0..16 {
                let n = self.next_after(t)?;
                if t.timestamp() != 978_307_200 {
                    let gap = (n - t).num_milliseconds();
                    least = Some(least.map_or(gap, |l| l.min(gap)));
                }
                t = n;
            }
            least.map(|l| l.max(1) as u64)
        })
    }

    /// Parses `expr` in zone `tz` (IANA name). Errors name the cron field
    /// (`minute field "61": ...`), an unknown zone, or a schedule that can
    /// never fire (`0 0 30 2 *`). What is accepted: the README's
    /// "Schedules and cron semantics".
    pub fn parse(expr: &str, tz: &str, dst: DstSpec) -> Result<Self, CronError> {
        let tz = Tz::from_str(tz)
            .map_err(|_| CronError::Zone(format!("unknown time zone {tz:?} (use an IANA name such as \"Asia/Shanghai\")")))?;
        let read = read(expr)?;
        let cron = croner_parser(read.dom_and_dow).parse(&read.croner).map_err(|e| CronError::Expr(format!("{expr:?}: {e}")))?;
        let trimmed = expr.trim_matches([' ', '\t']);
        let rules = DstRules::resolve(dst, read.fixed_time);
        let s = CronSchedule { cron, tz, expr: trimmed.to_string(), fixed_time: read.fixed_time, rules, min_gap_ms: Default::default() };
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

    /// The DST policy it runs by.
    pub fn dst_rules(&self) -> DstRules {
        self.rules
    }

    /// First fire time strictly after `t`, or `None` if there is none
    /// (before year 5000, croner's search bound). Daylight saving time as
    /// the module doc says; a gap's slots under `gap: skip` are the jump
    /// too (see [`CronSchedule::gap_slots`]).
    pub fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let Some(tr) = self.transition_in(t.timestamp() - NEAR_SECONDS, t.timestamp() + NEAR_SECONDS) else {
            // No offset change near `t`: the next wall clock match after
            // `t`'s is the next slot.
            return self.walk(t, wall(t, self.offset_at(t.timestamp())), false);
        };
        let Transition { at, before, after } = tr;
        let at_wall = |o: Duration| wall(at, o);
        let (gap_kept, repeat) = (self.rules.gap != Gap::Omit, self.rules.repeat);
        if t < at {
            // Wall clock before the change: `t + before`. In a fall back,
            // `last` leaves the repeated times to their second occurrence.
            let first_end = if after < before && repeat == RepeatRule::Last { at_wall(after) } else { at_wall(before) };
            if let Ok(c) = self.cron.find_next_occurrence(&wall(t, before), false)
                && c < first_end
            {
                return from_wall(c, before);
            }
        }
        let (from, inclusive) = if after > before {
            // Spring forward: wall clock `[at + before, at + after)` never happens.
            if t < at {
                if gap_kept
                    && let Ok(c) = self.cron.find_next_occurrence(&at_wall(before), true)
                    && c <= at_wall(after)
                {
                    // Shifted (or recorded) at the jump; a slot at the jump
                    // itself is the same instant.
                    return Some(at);
                }
                (at_wall(after), !gap_kept)
            } else {
                (wall(t, after), false)
            }
        } else {
            // Fall back: wall clock `[at + after, at + before)` happens twice.
            let repeat_end = at_wall(before);
            if t < at {
                if repeat == RepeatRule::First { (repeat_end, true) } else { (at_wall(after), true) }
            } else if repeat == RepeatRule::First && wall(t, after) < repeat_end {
                (repeat_end, true)
            } else {
                (wall(t, after), false)
            }
        };
        self.walk(t, from, inclusive)
    }

    /// The wall clock matches in `[lo, hi)`, at most `cap` of them.
    pub fn matches_in(&self, lo: NaiveDateTime, hi: NaiveDateTime, cap: usize) -> Vec<NaiveDateTime> {
        let mut out = Vec::new();
        let (mut from, mut inclusive) = (lo, true);
        while out.len() < cap
            && let Ok(c) = self.cron.find_next_occurrence(&from, inclusive)
            && c < hi
        {
            out.push(c);
            from = c;
            inclusive = false;
        }
        out
    }

    /// The slots of a gap that `gap: skip` records at `at` instead of
    /// running: how many wall clock matches fall in the gap that ends at
    /// `at` (0 when `at` ends no gap, the policy is not `skip`, or `at`
    /// is itself a match: that slot runs, and the gap's fold into it).
    pub fn gap_slots(&self, at: DateTime<Utc>) -> u64 {
        if self.rules.gap != Gap::Skip {
            return 0;
        }
        let Some(tr) = self.transition_in(at.timestamp() - 1, at.timestamp()) else { return 0 };
        if tr.at != at || tr.after <= tr.before {
            return 0;
        }
        let (lo, hi) = (wall(at, tr.before), wall(at, tr.after));
        if self.cron.is_time_matching(&hi).unwrap_or(false) {
            return 0;
        }
        let mut n = 0;
        let mut from = lo;
        let mut inclusive = true;
        while let Ok(c) = self.cron.find_next_occurrence(&from, inclusive) {
            if c >= hi || n >= 100_000 {
                break;
            }
            n += 1;
            from = c;
            inclusive = false;
        }
        n
    }

    /// The first slot after `t` at or after wall clock `from` (strictly
    /// after with `inclusive` false), mapping each wall clock match to its
    /// instants by the rules ([`DstRules::instants`]); a gap the rules
    /// omit is walked past.
    fn walk(&self, t: DateTime<Utc>, mut from: NaiveDateTime, mut inclusive: bool) -> Option<DateTime<Utc>> {
        // Each turn moves past one wall clock match; only matches at or
        // before `t` (a few, next to an offset change) or inside a far gap
        // come round again.
        for _ in 0..100_000 {
            let c = self.cron.find_next_occurrence(&from, inclusive).ok()?;
            match self.tz.from_local_datetime(&c) {
                LocalResult::None => {
                    // `c` is in a gap: the change lies within a few hours
                    // of `c` read with any nearby offset.
                    let guess = c.and_utc().timestamp() - self.offset_at(c.and_utc().timestamp()).num_seconds();
                    let tr = self.transition_in(guess - NEAR_SECONDS, guess + NEAR_SECONDS)?;
                    if self.rules.gap != Gap::Omit && tr.at > t {
                        return Some(tr.at);
                    }
                    from = wall(tr.at, tr.after);
                    inclusive = true;
                    continue;
                }
                _ => {
                    if let Some(i) = self.rules.instants(self.tz, c).into_iter().find(|i| *i > t) {
                        return Some(i);
                    }
                }
            }
            from = c;
            inclusive = false;
        }
        None
    }

    /// The zone's offset (local − UTC) at Unix second `s`.
    fn offset_at(&self, s: i64) -> Duration {
        offset_of(self.tz, s)
    }

    /// The offset change in `(lo, hi]` (Unix seconds), if the offsets at
    /// the two ends differ: the first second with the new offset.
    fn transition_in(&self, lo: i64, hi: i64) -> Option<Transition> {
        transition_of(self.tz, lo, hi)
    }
}

/// `tz`'s offset (local − UTC) at Unix second `s`.
fn offset_of(tz: Tz, s: i64) -> Duration {
    let at = DateTime::from_timestamp(s, 0).unwrap_or_default();
    Duration::seconds(i64::from(tz.offset_from_utc_datetime(&at.naive_utc()).fix().local_minus_utc()))
}

/// `tz`'s offset change in `(lo, hi]` (Unix seconds), if the offsets at
/// the two ends differ: the first second with the new offset.
fn transition_of(tz: Tz, lo: i64, hi: i64) -> Option<Transition> {
    let before = offset_of(tz, lo);
    if offset_of(tz, hi) == before {
        return None;
    }
    let (mut lo, mut hi) = (lo, hi);
    // offset_of(lo) == before, offset_of(hi) != before.
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if offset_of(tz, mid) == before { lo = mid } else { hi = mid }
    }
    Some(Transition { at: DateTime::from_timestamp(hi, 0)?, before, after: offset_of(tz, hi) })
}

/// The next offset changes of `tz` after `t`, up to `n` of them within
/// two years: (the change, the offset before, the offset after).
pub fn transitions_after(tz: Tz, t: DateTime<Utc>, n: usize) -> Vec<(DateTime<Utc>, Duration, Duration)> {
    let mut out = Vec::new();
    let mut lo = t.timestamp();
    let end = lo + 2 * 366 * 86_400;
    // Offsets are probed a day apart: two changes of a zone are months apart.
    while out.len() < n && lo < end {
        let hi = lo + 86_400;
        if let Some(tr) = transition_of(tz, lo, hi) {
            out.push((tr.at, tr.before, tr.after));
            lo = tr.at.timestamp();
        } else {
            lo = hi;
        }
    }
    out
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
    /// for cron semantics, checked here against next-fire computation; and
    /// this project's own cases of cronie's parsing rules (issue 34).
    const CASES: [&str; 2] = [include_str!("../../../tests/cases/cron.json"), include_str!("../../../tests/cases/cron_extra.json")];

    #[test]
    fn shared_cron_cases_pass() {
        for file in CASES {
            check_cases(file);
        }
    }

    fn check_cases(file: &str) {
        let v: serde_json::Value = serde_json::from_str(file).expect("cases parse");
        for c in v["cases"].as_array().expect("cases") {
            let id = c["id"].as_str().unwrap_or("?");
            let s = CronSchedule::parse(c["expr"].as_str().unwrap_or(""), c["timezone"].as_str().unwrap_or("UTC"), DstSpec::default())
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
            let r = CronSchedule::parse(c["expr"].as_str().unwrap_or(""), c["timezone"].as_str().unwrap_or("UTC"), DstSpec::default());
            assert!(r.is_err(), "invalid case {id} was accepted");
        }
    }

    #[test]
    fn errors_name_the_cron_field() {
        let e = CronSchedule::parse("0 61 * * *", "UTC", DstSpec::default()).expect_err("bad minute").to_string();
        assert!(e.contains("hour field") || e.contains("minute field"), "{e}");
        let e = CronSchedule::parse("0 61 * * *", "UTC", DstSpec::default()).expect_err("bad").to_string();
        // 5 fields are minute-first: "0 61" puts 61 in the hour field.
        assert!(e.contains("hour field \"61\""), "{e}");
        let e = CronSchedule::parse("61 * * * *", "UTC", DstSpec::default()).expect_err("bad").to_string();
        assert!(e.contains("minute field \"61\""), "{e}");
        let e = CronSchedule::parse("0 0 * * *", "Mars/Olympus", DstSpec::default()).expect_err("bad zone").to_string();
        assert!(e.contains("Mars/Olympus"), "{e}");
        // Several bad fields: the first is named.
        let e = CronSchedule::parse("61 25 * * *", "UTC", DstSpec::default()).expect_err("bad").to_string();
        assert!(e.contains("minute field \"61\""), "{e}");
        let e = CronSchedule::parse("*/70 * * * *", "UTC", DstSpec::default()).expect_err("step").to_string();
        assert!(e.contains("step 70 is larger than the field's range 0-59"), "{e}");
        let e = CronSchedule::parse("0 0 * * L", "UTC", DstSpec::default()).expect_err("L").to_string();
        assert!(e.contains("L alone matches no day") && e.contains("5L"), "{e}");
        assert!(
            CronSchedule::parse("0 0 L * *", "UTC", DstSpec::default()).is_ok()
                && CronSchedule::parse("0 0 * * 5L", "UTC", DstSpec::default()).is_ok()
        );
        let e = CronSchedule::parse("0 0 30 2 *", "UTC", DstSpec::default()).expect_err("never").to_string();
        assert!(e.contains("never fire"), "{e}");
    }

    /// cronie: a day field starting with `*` (even `*/2`) means both must
    /// match; croner alone treated `*/2` as restricted and used OR.
    #[test]
    fn stepped_star_day_field_means_and() {
        let s = CronSchedule::parse("0 0 */2 * MON", "UTC", DstSpec::default()).expect("parse");
        let mut t: DateTime<Utc> = "2026-02-01T00:00:00Z".parse().expect("t");
        let mut got = Vec::new();
        for _ in 0..3 {
            t = s.next_after(t).expect("next");
            got.push(t.to_rfc3339());
        }
        assert_eq!(got, vec!["2026-02-09T00:00:00+00:00", "2026-02-23T00:00:00+00:00", "2026-03-09T00:00:00+00:00"]);
        // Both restricted: OR (the shared dom-dow-or case covers it too).
        let s = CronSchedule::parse("0 0 1 * MON", "UTC", DstSpec::default()).expect("parse");
        let t: DateTime<Utc> = "2026-02-01T00:00:00Z".parse().expect("t");
        assert_eq!(s.next_after(t).map(|d| d.to_rfc3339()), Some("2026-02-02T00:00:00+00:00".to_string()));
    }

    #[test]
    fn aliases_and_seven_fields() {
        let t: DateTime<Utc> = "2026-11-30T10:15:00Z".parse().expect("t");
        let hourly = CronSchedule::parse("@hourly", "UTC", DstSpec::default()).expect("alias");
        assert_eq!(hourly.next_after(t), Some("2026-11-30T11:00:00Z".parse().expect("t")));
        let midnight = CronSchedule::parse("@midnight", "UTC", DstSpec::default()).expect("alias");
        assert_eq!(midnight.next_after(t), Some("2026-12-01T00:00:00Z".parse().expect("t")));
        let y = CronSchedule::parse("0 0 0 1 1 * 2028", "UTC", DstSpec::default()).expect("7 fields");
        assert_eq!(y.next_after(t), Some("2028-01-01T00:00:00Z".parse().expect("t")));
        let last = CronSchedule::parse("0 12 L * *", "UTC", DstSpec::default()).expect("L");
        assert_eq!(last.next_after(t), Some("2026-11-30T12:00:00Z".parse().expect("t")));
    }

    /// The first `n` fire times of `expr` (UTC) strictly after `after`, as
    /// RFC 3339 dates at UTC.
    fn fires(expr: &str, after: &str, n: usize) -> Vec<String> {
        let s = CronSchedule::parse(expr, "UTC", DstSpec::default()).unwrap_or_else(|e| panic!("{expr:?}: {e}"));
        let mut t: DateTime<Utc> = after.parse().expect("after");
        let mut out = Vec::new();
        for _ in 0..n {
            t = s.next_after(t).unwrap_or_else(|| panic!("{expr:?}: no fire after {t}"));
            out.push(t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true));
        }
        out
    }

    fn refused(expr: &str) -> String {
        match CronSchedule::parse(expr, "UTC", DstSpec::default()) {
            Ok(_) => panic!("{expr:?} was accepted"),
            Err(e) => e.to_string(),
        }
    }

    /// croner turns the text `-SUN` into `-7`, so `SUN-SUN` and `0-SUN` were
    /// `0-7` and fired every day; cronie reads `SUN` as 0 (Sundays only).
    #[test]
    fn sunday_name_ranges_fire_on_sundays_only() {
        let sundays = ["2026-03-08T00:00:00Z", "2026-03-15T00:00:00Z", "2026-03-22T00:00:00Z"];
        for expr in ["0 0 * * SUN-SUN", "0 0 * * 0-SUN", "0 0 * * sun-0", "0 0 * * 7-SUN", "0 0 * * SUN"] {
            assert_eq!(fires(expr, "2026-03-01T00:00:00Z", 3), sundays, "{expr}");
        }
        // A range ending in SUN still reaches Sunday (cronie: x-0 is x-7).
        assert_eq!(
            fires("0 0 * * SAT-SUN", "2026-03-01T00:00:00Z", 3),
            ["2026-03-07T00:00:00Z", "2026-03-08T00:00:00Z", "2026-03-14T00:00:00Z"]
        );
    }

    /// cronie's `get_range` reads a day-of-week range that ends at 0 after
    /// its start as ending at 7 (`MON-0` is Monday..Sunday); croner refused it.
    #[test]
    fn day_of_week_range_ending_at_0_runs_to_sunday() {
        let fri_to_sun = ["2026-03-06T00:00:00Z", "2026-03-07T00:00:00Z", "2026-03-08T00:00:00Z", "2026-03-13T00:00:00Z"];
        for expr in ["0 0 * * 5-0", "0 0 * * FRI-0", "0 0 * * 5-SUN"] {
            assert_eq!(fires(expr, "2026-03-01T00:00:00Z", 4), fri_to_sun, "{expr}");
        }
        let every_day = ["2026-03-07T00:00:00Z", "2026-03-08T00:00:00Z", "2026-03-09T00:00:00Z"];
        for expr in ["0 0 * * MON-0", "0 0 * * 1-0", "0 0 * * MON-SUN"] {
            assert_eq!(fires(expr, "2026-03-06T00:00:00Z", 3), every_day, "{expr}");
        }
        // cronie takes the step branch before that fix-up, so `1-0/2` is an
        // empty set there: refused here rather than read either way.
        let e = refused("0 0 * * MON-0/2");
        assert!(e.contains("day-of-week field \"MON-0/2\"") && e.contains("1-7/2"), "{e}");
        // Any other backwards range is refused (cronie silently sets nothing,
        // or for `5-0` in minutes the surprising 5-7).
        for (expr, field) in [
            ("0 0 * * 3-1", "day-of-week field \"3-1\""),
            ("30-0 * * * *", "minute field \"30-0\""),
            ("0 0 * NOV-FEB *", "month field \"NOV-FEB\""),
        ] {
            let e = refused(expr);
            assert!(e.contains(field) && e.contains("backwards"), "{expr}: {e}");
        }
    }

    /// cronie accepts `*` as one item of a list (`get_range`'s `R_AST`
    /// state); croner refused `*,5`. The star flags still come from the
    /// field's first character, as in cronie's `entry.c`.
    #[test]
    fn star_inside_a_list_means_every_value() {
        assert_eq!(
            fires("0 *,5 * * *", "2026-03-01T00:00:00Z", 3),
            ["2026-03-01T01:00:00Z", "2026-03-01T02:00:00Z", "2026-03-01T03:00:00Z"]
        );
        assert!(!CronSchedule::parse("*,5 3 * * *", "UTC", DstSpec::default()).expect("parse").is_fixed_time(), "minute starts with *");
        // Day-of-week starts with `*`: cronie's DOW_STAR, so both day fields
        // must match: the 1st of each month.
        assert_eq!(
            fires("0 0 1 * *,5", "2026-03-01T00:00:00Z", 3),
            ["2026-04-01T00:00:00Z", "2026-05-01T00:00:00Z", "2026-06-01T00:00:00Z"]
        );
        // `5,*` does not start with `*`: both fields restricted, either
        // matches, and every day matches the day-of-week field.
        assert_eq!(
            fires("0 0 1 * 5,*", "2026-03-01T00:00:00Z", 3),
            ["2026-03-02T00:00:00Z", "2026-03-03T00:00:00Z", "2026-03-04T00:00:00Z"]
        );
        assert_eq!(fires("0 0 *,L * *", "2026-03-01T00:00:00Z", 2), ["2026-03-02T00:00:00Z", "2026-03-03T00:00:00Z"]);
    }

    /// A field starting with `/` is refused by cronie, Quartz and croner's
    /// own default; `sloppy_ranges` let it through here as every-10.
    #[test]
    fn field_starting_with_slash_is_refused_naming_the_field() {
        let e = refused("/10 * * * *");
        assert!(e.contains("minute field \"/10\"") && e.contains("*/10"), "{e}");
        let e = refused("0 0 /2 * *");
        assert!(e.contains("day-of-month field \"/2\""), "{e}");
        let e = refused("0 0 * * 1,/2");
        assert!(e.contains("day-of-week field \"1,/2\""), "{e}");
        // `0/10` (Quartz: from 0 every 10) stays; the shared cases use it.
        assert_eq!(
            fires("0 0/20 * * * *", "2026-03-01T00:00:00Z", 3),
            ["2026-03-01T00:20:00Z", "2026-03-01T00:40:00Z", "2026-03-01T01:00:00Z"]
        );
    }

    /// `5L` (the last Friday) in a list with other days keeps both; `L`
    /// alone in a day-of-week list matched no day and was dropped silently.
    #[test]
    fn last_weekday_in_a_day_of_week_list_is_kept_and_bare_l_refused() {
        // March 2026: Mondays 23 and 30, last Friday 27.
        let want = ["2026-03-23T00:00:00Z", "2026-03-27T00:00:00Z", "2026-03-30T00:00:00Z", "2026-04-06T00:00:00Z"];
        for expr in ["0 0 * * 5L,1", "0 0 * * 1,5L", "0 0 * * MON,FRIL"] {
            assert_eq!(fires(expr, "2026-03-20T00:00:00Z", 4), want, "{expr}");
        }
        for expr in ["0 0 * * L,1", "0 0 * * 1,L", "0 0 * * l"] {
            let e = refused(expr);
            assert!(e.contains("day-of-week field") && e.contains("L alone matches no day"), "{expr}: {e}");
        }
        // `L` and `LW` in one day-of-month field: croner kept only LW.
        let e = refused("0 0 L,LW * *");
        assert!(e.contains("day-of-month field \"L,LW\""), "{e}");
    }

    /// Rust's `split_whitespace` (in croner and here) split fields at any
    /// Unicode space; cronie splits at ASCII space and tab only.
    #[test]
    fn only_ascii_space_and_tab_separate_fields() {
        for (expr, ch) in [
            ("0\u{a0}0 * * *", "U+00A0"),
            ("0 0 * *\u{3000}*", "U+3000"),
            ("0 0 * * *\u{2003}", "U+2003"),
            ("0 0\n* * *", "U+000A"),
            ("0 0 * * \u{17f}un", "U+017F"),
            ("0 0 * * \u{ff15}", "U+FF15"),
        ] {
            let e = refused(expr);
            assert!(e.contains(ch) && e.contains("ASCII"), "{expr:?}: {e}");
        }
        assert_eq!(fires("0\t0  *\t * *", "2026-03-01T00:00:00Z", 1), ["2026-03-02T00:00:00Z"]);
    }

    /// croner replaced month and day names anywhere in the expression, so
    /// `JAN` in day-of-week was Monday and `MON` in month January; cronie
    /// knows each field's own names only.
    #[test]
    fn names_belong_to_their_own_field() {
        for (expr, field) in [
            ("0 0 * * JAN", "day-of-week field \"JAN\""),
            ("0 0 * MON *", "month field \"MON\""),
            ("0 0 MON * *", "day-of-month field \"MON\""),
            ("0 0 * * MONDAY", "day-of-week field \"MONDAY\""),
            ("0 0 * * */MON", "day-of-week field \"*/MON\""),
        ] {
            let e = refused(expr);
            assert!(e.contains(field), "{expr}: {e}");
        }
        assert_eq!(fires("0 0 1 jan-Feb *", "2026-01-01T00:00:00Z", 2), ["2026-02-01T00:00:00Z", "2027-01-01T00:00:00Z"]);
    }

    /// croner skipped empty list items (`1,` was `1`); cronie refuses them.
    #[test]
    fn empty_list_items_are_refused() {
        for (expr, field) in
            [("0 0 1, * *", "day-of-month field \"1,\""), ("0,,30 * * * *", "minute field \"0,,30\""), ("0 , * * *", "hour field \",\"")]
        {
            let e = refused(expr);
            assert!(e.contains(field) && e.contains("empty"), "{expr}: {e}");
        }
    }

    /// cronie's main loop (`cron.c`), minute by minute in real time: the
    /// reference the DST rules are checked against. Returns the instants
    /// at which a 5-field expression's job would start in `[from, until)`
    /// (jobs started at one instant counted once).
    fn cronie_slots(expr: &str, tz: Tz, from: DateTime<Utc>, until: DateTime<Utc>) -> Vec<DateTime<Utc>> {
        let c = CronSchedule::parse(expr, &tz.to_string(), DstSpec::default()).expect("parse");
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
            "*,30 2 * * *",
            "30,* 2 * * *",
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
                let probe = CronSchedule::parse("@daily", zone, DstSpec::default()).expect("parse");
                let t = probe.transition_in(from.timestamp(), until.timestamp()).expect("a change in the window");
                assert_eq!(t.at, at, "{zone}: the change of 2026");
                for expr in exprs {
                    let want = cronie_slots(expr, tz, from, until);
                    assert!(!want.is_empty(), "{expr:?} in {zone}");
                    let s = CronSchedule::parse(expr, zone, DstSpec::default()).expect("parse");
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
            // cronie reads the first character: `*` as a later list item
            // does not make the field a star field.
            ("*,30 2 * * *", false),
            ("30,* 2 * * *", true),
            ("0 *,5 * * *", false),
            ("0 5,* * * *", true),
        ] {
            assert_eq!(CronSchedule::parse(expr, "UTC", DstSpec::default()).expect("parse").is_fixed_time(), fixed, "{expr}");
        }
    }
}
