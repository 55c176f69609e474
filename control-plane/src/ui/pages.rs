//! The dashboard's HTML: pages and the fragments the live stream sends
//! ([`cell`], [`run_row`]), from [`crate::views`] types only. maud escapes
//! every value; times are shown in UTC, and in the task's zone where a
//! task has one.

use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use maud::{DOCTYPE, Markup, html};

use super::session::Viewer;
use super::{RunsQuery, TasksQuery};
use crate::api::TaskView;
use crate::model::notification::Notification;
use crate::model::run::TriggerKind;
use crate::model::{RunRecord, RunStatus};
use crate::schedule::{CronTrigger, IntervalTrigger};
use crate::views::{BudgetView, ClusterView, PolicyViews, ResourceView, RunDetail, RunSummary, RunnerView, SlotCell, TaskSummary};

/// `s` percent-encoded as one path segment.
pub fn path_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn query_value(s: &str) -> String {
    path_segment(s)
}

fn utc(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

fn ms(v: Option<i64>) -> String {
    match v {
        None => "–".into(),
        Some(m) if m.abs() < 10_000 => format!("{m} ms"),
        Some(m) if m.abs() < 600_000 => format!("{:.1} s", m as f64 / 1000.0),
        Some(m) => format!("{:.1} min", m as f64 / 60_000.0),
    }
}

/// Every page's frame: the header with its links and who is looking, the
/// body, and the live stream the page listens to (`live`: its URL).
fn layout(viewer: Option<&Viewer>, title: &str, live: Option<String>, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · punchclock" }
                link rel="stylesheet" href="/ui/assets/style.css";
                script src="/ui/assets/app.js" defer {}
            }
            body data-live-url=[live] data-csrf=[viewer.map(|v| v.csrf.clone())] {
                header.top {
                    a.brand href="/ui/tasks" { "punchclock" }
                    nav {
                        a href="/ui/tasks" { "Tasks" }
                        a href="/ui/events" { "Events" }
                        a href="/ui/cluster" { "Cluster" }
                    }
                    span.who {
                        @if let Some(v) = viewer {
                            (v.name) " · " (v.role.as_str())
                            @if v.signed_in {
                                form.inline method="post" action="/ui/logout" { button.link type="submit" { "Sign out" } }
                            }
                        }
                        span #live-state title="live updates" {}
                    }
                }
                div #flash role="status" aria-live="polite" {}
                main { (body) }
            }
        }
    }
}

/// An error page.
pub fn error(viewer: Option<&Viewer>, code: StatusCode, message: &str) -> Markup {
    layout(
        viewer,
        code.canonical_reason().unwrap_or("Error"),
        None,
        html! {
            h1 { (code.as_u16()) " " (code.canonical_reason().unwrap_or("")) }
            p.error { (message) }
            p { a href="/ui/tasks" { "Back to the tasks" } }
        },
    )
}

/// The sign-in form.
pub fn login(error: &str) -> Markup {
    layout(
        None,
        "Sign in",
        None,
        html! {
            h1 { "Sign in" }
            p { "Give an API token (" code { "punchclock token new" } "); it is kept in a cookie this dashboard only reads." }
            @if !error.is_empty() { p.error role="alert" { (error) } }
            form.login method="post" action="/ui/login" {
                label for="token" { "Token" }
                input #token type="password" name="token" autocomplete="current-password" required;
                button type="submit" { "Sign in" }
            }
        },
    )
}

// ------------------------------------------------------------- fragments

/// One slot as a cell: its status as colour and as text (`aria-label`, and
/// a text only screen readers and tests read), a coalesced range wider with
/// its count, a link to the run.
pub fn cell(c: &SlotCell) -> Markup {
    let s = &c.summary;
    let label = c.label();
    let late = s.status == RunStatus::Pending && !s.reason.is_empty();
    let class = format!("cell s-{}{}", s.status.as_str().to_ascii_lowercase(), if late { " late" } else { "" });
    let width = if s.slots > 1 { format!("--span:{}", s.slots.min(6)) } else { String::new() };
    let title =
        format!("{} · slot {}{}", label, utc(s.scheduled_at), if s.reason.is_empty() { String::new() } else { format!(" · {}", s.reason) });
    html! {
        a class=(class) id={ "cell-" (s.run_id) } href={ "/ui/runs/" (path_segment(&s.run_id)) } title=(title)
            aria-label=(label) data-status=(s.status.as_str()) data-slots=(s.slots) style=[(!width.is_empty()).then_some(width)] {
            span.sr { (label) @if late { " (" (s.reason) ")" } }
            @if s.slots > 1 { span.count { "×" (s.slots) } }
        }
    }
}

/// One run as a line of a runs table.
pub fn run_row(s: &RunSummary) -> Markup {
    html! {
        tr id={ "row-" (s.run_id) } data-run=(s.run_id) data-status=(s.status.as_str()) {
            td { a href={ "/ui/runs/" (path_segment(&s.run_id)) } { (s.run_id) } }
            td { span class={ "badge s-" (s.status.as_str().to_ascii_lowercase()) } { (s.status.as_str()) } }
            td { (s.trigger.as_str()) }
            td { (utc(s.scheduled_at)) }
            td.num { (ms(s.dispatch_lag_ms)) }
            td.num { (ms(s.start_lag_ms)) }
            td.num { (ms(s.duration_ms)) }
            td.num { (s.attempts) }
            td { (s.runner_id) }
            td.reason { (s.reason) @if s.slots > 1 { " (" (s.slots) " slots)" } }
        }
    }
}

fn runs_head() -> Markup {
    html! {
        thead { tr {
            th { "Run" } th { "Status" } th { "Trigger" } th { "Slot" } th { "Dispatch lag" } th { "Start lag" }
            th { "Duration" } th { "Attempts" } th { "Runner" } th { "Why" }
        } }
    }
}

// ------------------------------------------------------------------ words

fn zone_of(t: &crate::model::trigger::TriggerSpec) -> Option<String> {
    match t {
        crate::model::trigger::TriggerSpec::Cron(c) => Some(c.timezone.clone().unwrap_or_else(|| "UTC".into())),
        _ => None,
    }
}

fn two(s: &str) -> Option<u32> {
    s.parse::<u32>().ok()
}

fn cron_words(c: &CronTrigger) -> String {
    let f: Vec<&str> = c.expr.split_whitespace().collect();
    let (sec, rest) = if f.len() == 6 { (Some(f[0]), &f[1..]) } else { (None, &f[..]) };
    let tz = c.timezone.as_deref().unwrap_or("UTC");
    let words = match (sec, rest) {
        (Some("*"), ["*", "*", "*", "*", "*"]) => Some("every second".to_string()),
        (Some(s), ["*", "*", "*", "*", "*"]) if s.starts_with("*/") => Some(format!("every {} seconds", &s[2..])),
        (None | Some("0"), ["*", "*", "*", "*", "*"]) => Some("every minute".to_string()),
        (None | Some("0"), [m, "*", "*", "*", "*"]) if m.starts_with("*/") => Some(format!("every {} minutes", &m[2..])),
        (None | Some("0"), [m, "*", "*", "*", "*"]) if two(m).is_some() => Some(format!("every hour at :{:02}", two(m).unwrap_or(0))),
        (None | Some("0"), [m, h, "*", "*", dow]) if two(m).is_some() && two(h).is_some() => {
            let at = format!("{:02}:{:02}", two(h).unwrap_or(0), two(m).unwrap_or(0));
            Some(match *dow {
                "*" => format!("every day at {at}"),
                "1-5" | "MON-FRI" | "mon-fri" => format!("every weekday at {at}"),
                d => format!("at {at} on day-of-week {d}"),
            })
        }
        _ => None,
    };
    match words {
        Some(w) => format!("{w} {tz}"),
        None => format!("cron \u{201c}{}\u{201d} {tz}", c.expr),
    }
}

fn interval_words(i: &IntervalTrigger) -> String {
    match (&i.every, i.every_seconds) {
        (Some(e), _) => format!("every {e}"),
        (None, Some(s)) => format!("every {s} s"),
        _ => "interval".into(),
    }
}

/// A trigger in words: `every day at 08:30 Asia/Shanghai`, `every 10m`,
/// `webhook /hooks/x`.
pub fn trigger_words(t: &crate::model::trigger::TriggerSpec) -> String {
    use crate::model::trigger::TriggerSpec as T;
    match t {
        T::Cron(c) => cron_words(c),
        T::Interval(i) => interval_words(i),
        T::Once(o) => format!("once at {}", utc(o.at)),
        T::Webhook(w) => format!("webhook {}", w.path),
        T::Queue(q) => format!("queue {} {}", q.broker, q.queue.as_deref().or(q.subject.as_deref()).unwrap_or("")),
        T::Event(e) => format!("event {}", e.topic),
        T::After(a) => format!(
            "after {} ({})",
            a.task,
            serde_json::to_value(a.status).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
        ),
    }
}

/// The next `n` fires of a task after `now` (none for event-only tasks).
fn next_fires(t: &TaskView, now: DateTime<Utc>, n: u32) -> Vec<DateTime<Utc>> {
    if t.record.paused || t.ended.is_some() {
        return Vec::new();
    }
    t.record.spec.schedules().map(|s| crate::api::preview_times(&s, now, n)).unwrap_or_default()
}

fn in_zone(t: DateTime<Utc>, zone: Option<&str>) -> String {
    match zone.and_then(|z| z.parse::<chrono_tz::Tz>().ok()) {
        Some(tz) if tz != chrono_tz::UTC => {
            format!("{} ({})", t.with_timezone(&tz).format("%Y-%m-%d %H:%M:%S %Z"), t.format("%H:%M:%S UTC"))
        }
        _ => utc(t),
    }
}

/// p50 and p99 of `v` (nearest rank), if any.
fn p50_p99(mut v: Vec<i64>) -> Option<(i64, i64)> {
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    let at = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    Some((at(0.5), at(0.99)))
}

fn lags(cells: &[SlotCell], f: impl Fn(&RunSummary) -> Option<i64>) -> String {
    match p50_p99(cells.iter().filter_map(|c| f(&c.summary)).collect()) {
        Some((a, b)) => format!("{} / {}", ms(Some(a)), ms(Some(b))),
        None => "–".into(),
    }
}

fn breaker_words(t: &TaskView) -> Option<String> {
    let b = t.cursor.as_ref()?.breaker.as_ref()?;
    use crate::model::breaker::BreakerPhase;
    match b.phase {
        BreakerPhase::Closed if b.consecutive_failures == 0 => None,
        BreakerPhase::Closed => Some(format!("closed ({} failed in a row)", b.consecutive_failures)),
        BreakerPhase::Open => Some(format!("open until {}", b.open_until.map(utc).unwrap_or_default())),
        BreakerPhase::HalfOpen => Some("half-open (trial run)".into()),
    }
}

/// An action's form: sent in place by the page's script (`reload`: the page
/// is read again once it is done, for actions that change what it shows
/// other than runs, which arrive live).
fn action_form(viewer: &Viewer, action: &str, label: &str, reload: bool, extra: Markup) -> Markup {
    html! {
        form.action method="post" action=(action) data-inplace="1" data-reload=[reload.then_some("1")] {
            input type="hidden" name="csrf" value=(viewer.csrf);
            (extra)
            button type="submit" { (label) }
        }
    }
}

// ------------------------------------------------------------------ pages

/// A row's resources: each one the task takes, the units its live slots
/// hold of it (a run takes them when dispatched and gives them back when
/// it ends), and the resource's use cluster-wide (`None`: the leader's
/// views are not at hand).
fn resources_held(r: &TaskSummary, policy: Option<&PolicyViews>) -> Markup {
    let uses = &r.task.record.spec.execution.resources;
    let running = r
        .slots
        .iter()
        .filter(|c| {
            let s = &c.summary;
            s.status == RunStatus::Running || (s.status == RunStatus::Pending && s.dispatch_lag_ms.is_some())
        })
        .count() as u32;
    html! {
        @for u in uses {
            @let res = policy.and_then(|p| p.resources.iter().find(|v| v.name == u.name));
            div.res {
                (u.name) ": " (running * u.units) " held"
                @if let Some(v) = res {
                    span.sub {
                        " (" (v.in_use) @if let Some(c) = v.limits.concurrency { " / " (c) } " in use"
                        @if v.waiting > 0 { ", " (v.waiting) " waiting" }
                        @if v.held_until.is_some() { ", held back" }
                        ")"
                    }
                }
            }
        }
    }
}

/// A row's budgets: each budget whose scope covers the task, as `used /
/// limit` of its limited measures and its state.
fn budget_use(r: &TaskSummary, policy: Option<&PolicyViews>) -> Markup {
    let spec = &r.task.record.spec;
    html! {
        @if let Some(p) = policy {
            @for b in p.budgets.iter().filter(|b| b.covers(&spec.task_id, &spec.agent_id, &spec.labels)) {
                div.budget title={ (b.name) " (" (b.scope) ", " (b.window) ")" } {
                    (b.name) ": " (b.use_words().join(", "))
                    @if b.state != "ok" { " " span class={ "badge b-" (b.state) } { (b.state) } }
                }
            }
        }
    }
}

/// `/ui/tasks`: a page of task rows; `policy`, the leader's resources and
/// budgets for their columns.
pub fn tasks(
    viewer: &Viewer,
    q: &TasksQuery,
    rows: &[TaskSummary],
    next: &str,
    policy: Option<&PolicyViews>,
    now: DateTime<Utc>,
) -> Markup {
    let kinds = ["cron", "interval", "once", "webhook", "queue", "event", "after"];
    let statuses = ["SUCCEEDED", "FAILED", "TIMEOUT", "CANCELLED", "SKIPPED", "RUNNING", "PENDING", "RETRYING"];
    let keep = format!(
        "q={}&state={}&trigger={}&last={}&breaker={}",
        query_value(&q.q),
        query_value(&q.state),
        query_value(&q.trigger),
        query_value(&q.last),
        query_value(&q.breaker)
    );
    let body = html! {
        h1 { "Tasks" }
        form.filters method="get" action="/ui/tasks" role="search" {
            input type="search" name="q" value=(q.q) placeholder="id, agent or label contains…" aria-label="search tasks";
            select name="state" aria-label="state" {
                option value="" selected[q.state.is_empty()] { "paused or not" }
                option value="active" selected[q.state == "active"] { "active" }
                option value="paused" selected[q.state == "paused"] { "paused" }
            }
            select name="trigger" aria-label="trigger kind" {
                option value="" { "any trigger" }
                @for k in kinds { option value=(k) selected[q.trigger == k] { (k) } }
            }
            select name="last" aria-label="last run status" {
                option value="" { "any last run" }
                @for s in statuses { option value=(s) selected[q.last == s] { "last " (s) } }
            }
            label { input type="checkbox" name="breaker" value="open" checked[q.breaker == "open"]; " breaker open" }
            button type="submit" { "Filter" }
        }
        @if viewer.can_operate() {
            form.bulk #bulk method="post" action="/ui/tasks-bulk" data-inplace="1" data-reload="1" {
                input type="hidden" name="csrf" value=(viewer.csrf);
                input type="hidden" name="tasks" value="";
                span { "Selected: " }
                button type="submit" name="action" value="pause" { "Pause" }
                button type="submit" name="action" value="resume" { "Resume" }
            }
        }
        table.tasks data-live-tasks="1" {
            thead { tr {
                @if viewer.can_operate() { th { input type="checkbox" #select-all aria-label="select all"; } }
                th { "Task" } th { "Trigger" } th { "Next fires" } th { "Last " (super::TASK_CELLS) " slots, newest first" }
                th.num { "Dispatch lag p50/p99" } th.num { "Start lag p50/p99" } th { "Breaker" }
                th { "Resources held" } th { "Budget use" }
            } }
            tbody {
                @for r in rows {
                    @let t = &r.task;
                    @let spec = &t.record.spec;
                    @let triggers = spec.all_triggers();
                    @let zone = triggers.iter().find_map(|tr| zone_of(tr));
                    tr id={ "task-" (spec.task_id) } data-task=(spec.task_id) data-paused=(t.record.paused) {
                        @if viewer.can_operate() { td { input.pick type="checkbox" value=(spec.task_id) aria-label={ "select " (spec.task_id) }; } }
                        td.task {
                            a href={ "/ui/tasks/" (path_segment(&spec.task_id)) } { (spec.task_id) }
                            div.sub { "agent " (spec.agent_id) @for (k, v) in &spec.labels { " " span.label { (k) "=" (v) } } }
                            @if t.record.paused { span.badge.paused { "paused" } }
                        }
                        td { @for tr in &triggers { div { (trigger_words(tr)) } } }
                        td.fires {
                            @for f in next_fires(t, now, 3) { div { (in_zone(f, zone.as_deref())) } }
                            @if let Some(e) = &t.ended { div.muted { "ended: " (e) } }
                        }
                        td { div.cells id={ "slots-" (spec.task_id) } data-max=(super::TASK_CELLS) { @for c in &r.slots { (cell(c)) } } }
                        td.num { (lags(&r.slots, |s| s.dispatch_lag_ms)) }
                        td.num { (lags(&r.slots, |s| s.start_lag_ms)) }
                        td { (breaker_words(t).unwrap_or_else(|| "closed".into())) }
                        td.resources { (resources_held(r, policy)) }
                        td.budgets { (budget_use(r, policy)) }
                    }
                }
            }
        }
        @if rows.is_empty() { p.empty { "No task matches." } }
        nav.pages {
            @if !q.after.is_empty() { a href={ "/ui/tasks?" (keep) } { "First page" } }
            @if !next.is_empty() { a.next href={ "/ui/tasks?" (keep) "&after=" (query_value(next)) } { "Next page" } }
        }
    };
    layout(Some(viewer), "Tasks", Some("/ui/live".into()), body)
}

/// `/ui/tasks/{id}`: the task, its next fires (and zone), its last slots,
/// a page of its runs with the filters that chose them and the next page's
/// token, at `now`.
#[allow(clippy::too_many_arguments)] // one page's parts, each from its own read
pub fn task(
    viewer: &Viewer,
    t: &TaskView,
    fires: &crate::api::Preview,
    slots: &[SlotCell],
    runs: &[RunRecord],
    rq: &RunsQuery,
    next: &str,
    now: DateTime<Utc>,
) -> Markup {
    let spec = &t.record.spec;
    let id = &spec.task_id;
    let seg = path_segment(id);
    let zone = fires.zone.map(|z| z.name().to_string());
    let applied = t
        .record
        .applied
        .as_ref()
        .map(|v| serde_json::to_string_pretty(v).unwrap_or_default())
        .unwrap_or_else(|| serde_json::to_string_pretty(&spec).unwrap_or_default());
    let first_page = rq.page.is_empty();
    let keep = format!("status={}&since={}&until={}", query_value(&rq.status), query_value(&rq.since), query_value(&rq.until));
    let body = html! {
        h1 { "Task " (id) @if t.record.paused { " " span.badge.paused { "paused" } } }
        dl.facts {
            dt { "Agent" } dd { (spec.agent_id) }
            dt { "Triggers" } dd { @for tr in spec.all_triggers() { div { (trigger_words(tr)) } } }
            dt { "Overlap" } dd { (serde_json::to_value(spec.execution.overlap_policy).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()) }
            dt { "Misfires" } dd { (serde_json::to_value(spec.execution.misfire_policy).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()) ", grace " (spec.execution.misfire_grace_seconds) " s" }
            dt { "Next fires" } dd {
                @for (f, at) in fires.times.iter().zip(&fires.fires) {
                    div { (in_zone(*f, zone.as_deref())) @if at != f { span.muted { " fires " (utc(*at)) } } }
                }
                @if fires.times.is_empty() { "none" }
            }
            @if !fires.notes.is_empty() {
                dt { "Time notes" } dd { @for n in &fires.notes { div.note { (n) } } }
            }
            dt { "Breaker" } dd { (breaker_words(t).unwrap_or_else(|| "closed".into())) }
            @if let Some(c) = &t.cursor { @if let Some(l) = c.last_slot { dt { "Last slot" } dd { (utc(l)) } } }
        }
        @if viewer.can_operate() {
            div.actions {
                (action_form(viewer, &format!("/ui/tasks/{seg}/trigger"), "Trigger now", false, html! {
                    input type="text" name="params" placeholder="params, a JSON object" aria-label="params";
                }))
                @if t.record.paused {
                    (action_form(viewer, &format!("/ui/tasks/{seg}/resume"), "Resume", true, html! {}))
                } @else {
                    (action_form(viewer, &format!("/ui/tasks/{seg}/pause"), "Pause", true, html! {}))
                }
                @if !spec.schedules().unwrap_or_default().is_empty() {
                    (action_form(viewer, &format!("/ui/tasks/{seg}/backfill"), "Backfill", false, html! {
                        input type="text" name="from" placeholder="from: 30d or 2026-11-01T00:00:00Z" aria-label="backfill from";
                        input type="text" name="to" placeholder="to (empty: now)" aria-label="backfill to";
                        select name="reprocess" aria-label="reprocess" {
                            option value="missing" { "missing slots" } option value="failed" { "failed slots" } option value="all" { "every slot" }
                        }
                        input type="number" name="max_concurrent" min="1" max="1000" value="1" aria-label="max concurrent";
                    }))
                }
                @if spec.execution.circuit_breaker.is_some() {
                    (action_form(viewer, &format!("/ui/tasks/{seg}/reset-breaker"), "Reset breaker", true, html! {}))
                }
            }
        }
        h2 { "Slots" }
        div.timeline {
            div.cells.past id={ "slots-" (id) } data-max=(super::TASK_CELLS) aria-label="past slots, newest first" {
                @for c in slots { (cell(c)) }
            }
            span.now title={ "now: " (utc(now)) } { "now" }
            div.cells.planned aria-label="planned slots" {
                @for f in &fires.times {
                    span.cell.planned title={ "planned: " (in_zone(*f, zone.as_deref())) } aria-label={ "planned " (utc(*f)) } {}
                }
            }
        }
        p.muted.policies {
            "Overlap: " (serde_json::to_value(spec.execution.overlap_policy).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default())
            " (a slot while " (spec.execution.concurrency_limit.max(1)) " run(s) are active). "
            "Misfire: a slot later than " (spec.execution.misfire_grace_seconds) " s is "
            (serde_json::to_value(spec.execution.misfire_policy).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default())
            " (missed slots in a row are one cell with their count). "
            @if zone.as_deref().is_some_and(|z| z != "UTC") {
                "DST in " (zone.clone().unwrap_or_default()) ": a fixed-time slot in the skipped hour runs once at the jump, in the repeated hour once at its first occurrence."
            }
        }
        h2 { "Runs" }
        form.filters method="get" action={ "/ui/tasks/" (seg) } {
            select name="status" aria-label="status" {
                option value="" { "any status" }
                @for s in ["SUCCEEDED", "FAILED", "TIMEOUT", "CANCELLED", "SKIPPED", "RUNNING", "PENDING", "RETRYING"] {
                    option value=(s) selected[rq.status == s] { (s) }
                }
            }
            input type="text" name="since" value=(rq.since) placeholder="since (1h or a time)" aria-label="since";
            input type="text" name="until" value=(rq.until) placeholder="until" aria-label="until";
            button type="submit" { "Show" }
        }
        table.runs {
            (runs_head())
            tbody id={ "runs-" (id) } data-head=(if first_page && rq.status.is_empty() && rq.until.is_empty() { "1" } else { "0" }) {
                @for r in runs { (run_row(&RunSummary::of(r))) }
            }
        }
        @if runs.is_empty() { p.empty { "No runs in this window." } }
        nav.pages {
            @if !first_page { a href={ "/ui/tasks/" (seg) "?" (keep) } { "Newest" } }
            @if !next.is_empty() { a.next href={ "/ui/tasks/" (seg) "?" (keep) "&page=" (query_value(next)) } { "Older" } }
        }
        details {
            summary { "Definition as applied" }
            pre { (applied) }
        }
        p.muted { "Shown at " (utc(now)) }
    };
    layout(Some(viewer), id, Some(format!("/ui/live?task={}", query_value(id))), body)
}

/// `/ui/runs/{id}`.
pub fn run(
    viewer: &Viewer,
    d: &RunDetail,
    notes: &crate::error::Result<Vec<Notification>>,
    downstream: &crate::error::Result<Vec<RunSummary>>,
    trace_link: Option<&str>,
) -> Markup {
    let r = &d.record;
    let s = &d.summary;
    let seg = path_segment(&r.run_id);
    let json = |v: &serde_json::Value| serde_json::to_string_pretty(v).unwrap_or_default();
    let body = html! {
        h1 { "Run " (r.run_id) }
        p {
            span id={ "status-" (r.run_id) } class={ "badge s-" (r.status.as_str().to_ascii_lowercase()) } { (r.status.as_str()) }
            " of task " a href={ "/ui/tasks/" (path_segment(&r.task_id)) } { (r.task_id) }
            @if !s.reason.is_empty() { " — " span.reason { (s.reason) } }
        }
        dl.facts {
            dt { "Trigger" } dd { (r.trigger.as_str()) }
            dt { "Slot" } dd { (utc(r.scheduled_at)) @if s.slots > 1 { " (" (s.slots) " slots: " (r.missed_from.map(utc).unwrap_or_default()) " – " (r.missed_until.map(utc).unwrap_or_default()) ")" } }
            dt { "Dispatch lag" } dd { (ms(s.dispatch_lag_ms)) }
            dt { "Start lag" } dd { (ms(s.start_lag_ms)) }
            dt { "Duration" } dd { (ms(s.duration_ms)) }
            @if let Some(f) = r.finished_at { dt { "Finished" } dd { (utc(f)) } }
            @if !r.trace_id.is_empty() {
                dt { "Trace" } dd {
                    @match trace_link {
                        Some(tpl) => a.trace href=(tpl.replace("{trace_id}", &r.trace_id)) { (r.trace_id) },
                        None => code.trace { (r.trace_id) },
                    }
                }
            }
            @if let Some(e) = &r.event { dt { "Event" } dd { code { (serde_json::to_string(e).unwrap_or_default()) } } }
            @if let Some(of) = &r.rerun_of { dt { "Re-run of" } dd { a.rerun-of href={ "/ui/runs/" (path_segment(of)) } { (of) } } }
            @if let Some(u) = &r.upstream {
                dt { "Upstream" } dd {
                    a.upstream href={ "/ui/runs/" (path_segment(&u.run_id)) } { (u.run_id) } " of " (u.task) " (" (u.status.as_str()) ")"
                    @if u.chain > 1 { " — " (u.chain) " runs up the chain" }
                }
            }
            @if !r.params.is_empty() { dt { "Params" } dd { code { (serde_json::Value::Object(r.params.clone())) } } }
        }
        @if viewer.can_operate() {
            div.actions {
                @if !r.status.is_terminal() { (action_form(viewer, &format!("/ui/runs/{seg}/cancel"), "Cancel", true, html! {})) }
                @if r.status.is_terminal() {
                    // A linked run with the same params, event and upstream.
                    (action_form(viewer, &format!("/ui/runs/{seg}/rerun"), "Re-run with the same input", false, html! {}))
                }
            }
        }
        h2 { "Attempts" }
        table.attempts {
            thead { tr { th { "#" } th { "Runner" } th { "Execution id" } th { "Dispatched" } th { "Started" } th { "Ended" } th { "Outcome" } th { "Class" } th { "Exit" } th { "Error" } } }
            tbody {
                @for a in &r.attempts {
                    tr.attempt data-outcome=[a.outcome.map(|o| format!("{o:?}").to_ascii_uppercase())] {
                        td { (a.attempt) }
                        td { (a.runner_id) }
                        td { code { (a.execution_id) } }
                        td { (utc(a.dispatched_at)) }
                        td { (a.started_at.map(utc).unwrap_or_default()) }
                        td { (a.finished_at.map(utc).unwrap_or_default()) }
                        td.outcome { (a.outcome.map(|o| format!("{o:?}").to_ascii_uppercase()).unwrap_or_else(|| "–".into())) }
                        td { (a.class.clone().unwrap_or_default()) }
                        td { (a.exit_code.map(|c| c.to_string()).unwrap_or_default()) }
                        td.reason { (a.error.clone().unwrap_or_default()) }
                    }
                }
            }
        }
        @if r.attempts.is_empty() { p.empty { "No attempt yet." } }
        @if let Some(p) = &r.progress {
            h2 { "Progress" }
            dl.facts {
                dt { "Percent" } dd { (p.percent.map(|v| format!("{v:.0} %")).unwrap_or_else(|| "–".into())) }
                dt { "Message" } dd { (p.message) }
                dt { "Updated" } dd { (utc(p.updated_at)) }
            }
            @if let Some(c) = &p.checkpoint { h2 { "Checkpoint" } pre.checkpoint { (json(c)) } }
        }
        @if let Some(v) = &r.result { h2 { "Result" } pre { (json(v)) } }
        @if r.attempts.iter().any(|a| a.usage.is_some()) || !r.charges.is_empty() {
            h2 { "Usage and cost" }
            table.usage {
                thead { tr { th { "Attempt" } th { "Model" } th { "Usage as reported" } } }
                tbody { @for a in r.attempts.iter().filter(|a| a.usage.is_some()) { tr {
                    td { (a.attempt) } td { (a.model.clone().unwrap_or_default()) }
                    td { code { (serde_json::to_string(&a.usage).unwrap_or_default()) } }
                } } }
            }
            @if !r.charges.is_empty() {
                table.charges {
                    thead { tr { th { "Budget" } th { "Window from" } th { "Reserved at admission" } } }
                    tbody { @for c in &r.charges { tr {
                        td { (c.budget) } td { (utc(c.window_start)) }
                        td { code { (serde_json::to_string(&c.reserved).unwrap_or_default()) } @if c.unknown { " (estimated again at dispatch)" } }
                    } } }
                }
            }
        }
        h2 { "Notifications" }
        (failed_section("Notifications could not be read", notes.as_ref(), |ns: &Vec<Notification>| html! {
            @if ns.is_empty() { p.empty { "None sent." } } @else {
                table.notifications {
                    thead { tr { th { "Id" } th { "Event" } th { "Sink" } th { "Status" } th { "Attempts" } th { "Delivered" } th { "Last error" } } }
                    tbody { @for n in ns { tr data-status=(n.status.as_str()) {
                        td { code { (n.id) } } td { (n.event.as_str()) } td { (n.sink) } td { (n.status.as_str()) }
                        td.num { (n.attempts) } td { (n.delivered_at.map(utc).unwrap_or_default()) }
                        td.reason { (n.last_error.clone().unwrap_or_default()) }
                    } } }
                }
            }
        }))
        h2 { "Downstream runs" }
        (failed_section("Downstream runs are the leader's to show", downstream.as_ref(), |rs: &Vec<RunSummary>| html! {
            @if rs.is_empty() { p.empty { "No task follows this run." } } @else {
                table.runs.downstream { (runs_head()) tbody { @for s in rs { (run_row(s)) } } }
            }
        }))
        @if !r.stdout_tail.is_empty() { h2 { "Output (tail)" } pre.tail { (r.stdout_tail) } }
        @if !r.stderr_tail.is_empty() { h2 { "Errors (tail)" } pre.tail { (r.stderr_tail) } }
    };
    layout(Some(viewer), &format!("Run {}", r.run_id), Some(format!("/ui/live?run={}", query_value(&r.run_id))), body)
}

fn failed_section<V>(what: &str, r: Result<&V, &crate::error::Error>, f: impl Fn(&V) -> Markup) -> Markup {
    match r {
        Ok(v) => f(v),
        Err(e) => html! { p.muted { (what) ": " (e.to_string()) } },
    }
}

/// `/ui/cluster`: replicas, history, runners, resources, budgets.
pub fn cluster(
    viewer: &Viewer,
    c: &ClusterView,
    runners: &crate::error::Result<Vec<RunnerView>>,
    policy: &crate::error::Result<PolicyViews>,
    history: (&str, Option<String>),
) -> Markup {
    let body = html! {
        h1 { "Cluster" }
        dl.facts {
            dt { "Leader" } dd { (c.leader_id) " " (c.leader_address) @if c.leader_unresponsive { " " span.badge.s-failed { "unresponsive" } } }
            dt { "Fencing token" } dd { (c.fencing_token) }
            dt { "Store" } dd { (c.store) }
            dt { "History" } dd { (history.0) @if let Some(p) = &history.1 { " — " span.error { (p) } } }
            dt { "Config version" } dd { (c.config_version) }
            dt { "Answered by" } dd { (c.answered_by) }
        }
        h2 { "Replicas" }
        table { thead { tr { th { "Id" } th { "Address" } th { "Role" } } }
            tbody { @for m in &c.members { tr { td { (m.id) } td { (m.advertise_address) } td { @if m.is_leader { "leader" } @else { "follower" } } } } } }
        h2 { "Runners" }
        (failed_section("Runners are the leader's to show", runners.as_ref(), |rs: &Vec<RunnerView>| html! {
            table.runners { thead { tr { th { "Id" } th { "Agents" } th { "Slots used / total" } th { "Labels" } th { "Version" } th { "Connected" } th { "Last seen" } th { "Draining" } } }
                tbody { @for r in rs { tr {
                    td { (r.runner_id) }
                    td { (r.agents.join(", ")) }
                    td.num { (r.busy) " / " (r.slots) }
                    td { @for (k, v) in &r.labels { span.label { (k) "=" (v) } " " } }
                    td { (r.version) }
                    td { @if r.connected { "since " (utc(r.connected_at)) } @else { span.s-failed { "disconnected" } } }
                    td { (utc(r.last_seen)) }
                    td { @if r.draining { span.badge.paused { "draining" } } @else { "no" } }
                } } }
            }
            @if rs.is_empty() { p.empty { "No runner." } }
        }))
        h2 { "Resources" }
        (failed_section("Resources are the leader's to show", policy.as_ref().map(|p| &p.resources), |rs: &Vec<ResourceView>| html! {
            table { thead { tr { th { "Name" } th.num { "In use" } th.num { "Concurrency" } th.num { "Waiting" } th { "Held back" } } }
                tbody { @for r in rs { tr {
                    td { (r.name) }
                    td.num { (r.in_use) }
                    td.num { (r.limits.concurrency.map(|c| c.to_string()).unwrap_or_else(|| "–".into())) }
                    td.num { (r.waiting) }
                    td { @if let Some(u) = r.held_until { "until " (utc(u)) " — " (r.held_why) } }
                } } }
            }
            @if rs.is_empty() { p.empty { "No resource configured." } }
        }))
        h2 { "Budgets" }
        (failed_section("Budgets are the leader's to show", policy.as_ref().map(|p| &p.budgets), |bs: &Vec<BudgetView>| html! {
            table { thead { tr { th { "Name" } th { "Scope" } th { "Window" } th { "Used (with reserved) / limit" } th { "State" } th { "Resets" } } }
                tbody { @for b in bs { tr {
                    td { (b.name) }
                    td { (b.scope) }
                    td { (b.window) }
                    td { @for w in b.use_words() { div { (w) } } }
                    td { span class={ "badge b-" (b.state) } { (b.state) } }
                    td { (in_zone(b.window_end, Some(&b.timezone))) }
                } } }
            }
            @if bs.is_empty() { p.empty { "No budget configured." } }
        }))
    };
    layout(Some(viewer), "Cluster", None, body)
}

/// `/ui/events`: the tasks each kind of event starts, their last
/// deliveries as cells (a deduplicated delivery makes no cell: it found its
/// run), and the leader's queue consumers.
pub fn events(
    viewer: &Viewer,
    sections: &[(TriggerKind, Vec<TaskSummary>)],
    consumers: &std::collections::BTreeMap<String, crate::events::consumers::ConsumerState>,
) -> Markup {
    let body = html! {
        h1 { "Events" }
        h2 { "Queue consumers" }
        @if consumers.is_empty() { p.empty { "None on this replica: the leader consumes, when a task has a queue trigger." } }
        @else {
            table { thead { tr { th { "Consumer" } th { "Broker" } th { "State" } } }
                tbody { @for (name, c) in consumers { tr {
                    td { (name) } td { (c.broker) }
                    td { @match &c.error { Some(e) => span.error { "retrying: " (e) }, None => "consuming" } }
                } } }
            }
        }
        @for (kind, rows) in sections {
            h2 { (kind.as_str()) " triggers" }
            @if rows.is_empty() { p.empty { "No task." } }
            @else {
                table.tasks data-live-tasks="1" {
                    thead { tr { th { "Task" } th { "Trigger" } th { "Last deliveries, newest first" } th { "Dispatch lag p50/p99" } } }
                    tbody { @for r in rows {
                        @let spec = &r.task.record.spec;
                        tr data-task=(spec.task_id) {
                            td { a href={ "/ui/tasks/" (path_segment(&spec.task_id)) } { (spec.task_id) } }
                            td { @for tr in spec.all_triggers() { @if tr.kind() == *kind { div { (trigger_words(tr)) } } } }
                            td { div.cells id={ "slots-" (spec.task_id) } data-max=(super::TASK_CELLS) { @for c in &r.slots { (cell(c)) } } }
                            td.num { (lags(&r.slots, |s| s.dispatch_lag_ms)) }
                        }
                    } }
                }
            }
        }
    };
    layout(Some(viewer), "Events", Some("/ui/live".into()), body)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cron(expr: &str, tz: Option<&str>) -> String {
        cron_words(&CronTrigger { expr: expr.into(), timezone: tz.map(str::to_string), ..Default::default() })
    }

    #[test]
    fn cron_in_words() {
        assert_eq!(cron("30 8 * * *", Some("Asia/Shanghai")), "every day at 08:30 Asia/Shanghai");
        assert_eq!(cron("*/10 * * * *", None), "every 10 minutes UTC");
        assert_eq!(cron("* * * * * *", None), "every second UTC");
        assert_eq!(cron("0 9 * * 1-5", Some("Europe/Paris")), "every weekday at 09:00 Europe/Paris");
        assert_eq!(cron("0 0 1 * *", None), "cron \u{201c}0 0 1 * *\u{201d} UTC");
    }

    #[test]
    fn percentiles_and_segments() {
        assert_eq!(p50_p99(vec![5, 1, 3, 2, 4]), Some((3, 5)));
        assert_eq!(p50_p99(Vec::new()), None);
        assert_eq!(path_segment("a b/c.d"), "a%20b%2Fc.d");
    }
}
