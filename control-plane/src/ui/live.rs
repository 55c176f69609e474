//! `GET /ui/live?task=ID&run=ID`: the page's live stream, server-sent
//! events from the replica's run watch ([`crate::watch`]).
//!
//! Each run change is one `run` event whose data is JSON: `run_id`,
//! `task_id`, `status`, and the run's HTML as each page shows it — `cell`
//! (a slot cell of the tasks list), `row` (a line of a task's runs). The
//! page's script puts them in place. A watcher that falls behind (its
//! queue of [`crate::watch::WATCHER_QUEUE`] changes full) gets a `reload`
//! event: the page reads itself again rather than miss a change. The
//! stream's memory per session is that queue and its socket's send buffer
//! ([`crate::http::SEND_BUFFER_BYTES`]), whatever the browser does; a
//! comment every 15 s keeps proxies from closing it. A replica holds at
//! most [`cap_for`] streams (`503` past it: the page works without one),
//! so streams never take every connection of the HTTP port.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::Deserialize;

use crate::api::Core;
use crate::views::{RunSummary, SlotCell};
use crate::watch::WatchFilter;

/// Most live streams a replica holds, whatever its HTTP port's cap.
pub const MAX_LIVE_STREAMS: usize = 1000;

/// The live streams a replica whose HTTP port takes `http_max`
/// connections holds at most: a quarter of them, at most
/// [`MAX_LIVE_STREAMS`].
pub fn cap_for(http_max: usize) -> usize {
    (http_max / 4).clamp(1, MAX_LIVE_STREAMS)
}

/// The open live streams, and their cap.
#[derive(Debug, Clone)]
pub struct Streams {
    open: Arc<AtomicUsize>,
    max: usize,
}

impl Streams {
    /// No stream open yet; at most `max`.
    pub fn new(max: usize) -> Streams {
        Streams { open: Arc::new(AtomicUsize::new(0)), max }
    }

    fn take(&self) -> Option<Slot> {
        self.open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < self.max).then_some(n + 1)).ok()?;
        Some(Slot(self.open.clone()))
    }
}

/// One open stream, given back on drop.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// `GET /ui/live` query.
#[derive(Debug, Default, Deserialize)]
pub struct LiveQuery {
    /// One task's runs (empty: all).
    #[serde(default)]
    pub task: String,
    /// One run (empty: any).
    #[serde(default)]
    pub run: String,
}

/// The event stream.
pub async fn stream(
    State(core): State<Arc<Core>>,
    axum::Extension(streams): axum::Extension<Streams>,
    headers: HeaderMap,
    Query(q): Query<LiveQuery>,
) -> Response {
    let _viewer = match super::session::viewer(&core, &headers, "/punchclock.v1.RunService/WatchRuns") {
        Ok(v) => v,
        Err(r) => return r,
    };
    let Some(slot) = streams.take() else {
        let why = format!("{} live streams are open on this replica; the page works without one (reload it to see changes)", streams.max);
        return (axum::http::StatusCode::SERVICE_UNAVAILABLE, [(axum::http::header::RETRY_AFTER, "30")], why).into_response();
    };
    let filter = WatchFilter { task_id: q.task, run_id: (!q.run.is_empty()).then_some(q.run) };
    let sub = match core.watchers.subscribe(filter) {
        Ok(s) => s,
        Err(e) => return super::error_page(None, &e),
    };
    let behind = sub.behind.clone();
    // The subscription (and its queue) lives as long as the stream.
    let events = futures::stream::unfold((sub, slot), move |(mut sub, slot)| async move {
        let run = sub.rx.recv().await;
        run.map(|run| (Ok::<_, std::convert::Infallible>(run_event(&run)), (sub, slot)))
    })
    .chain(futures::stream::once(async move {
        // The relay ended this watcher: behind, or the replica's bus closed.
        let why = if behind.load(Ordering::Relaxed) { "behind" } else { "ended" };
        Ok(Event::default().event("reload").data(why))
    }));
    Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))).into_response()
}

fn run_event(run: &crate::model::RunRecord) -> Event {
    let summary = RunSummary::of(run);
    let data = serde_json::json!({
        "run_id": run.run_id,
        "task_id": run.task_id,
        "status": run.status.as_str(),
        "cell": super::pages::cell(&SlotCell { summary: summary.clone() }).into_string(),
        "row": super::pages::run_row(&summary).into_string(),
    });
    Event::default().event("run").data(data.to_string())
}
