//! Issue 36: the dashboard (`/ui/`) in a real browser — Debian's chromium,
//! headless, driven over WebDriver — against `punchclock dev` and a
//! server with tokens:
//! - the tasks page shows each slot as a cell: a failing task's as FAILED,
//!   a SKIPPED cell's reason as text, a coalesced misfire with its count;
//! - a task triggered from its page: the run appears there and reaches
//!   SUCCEEDED without a reload, and a second window on the tasks page sees
//!   the new cell too (the live stream);
//! - the run page of a retried run shows both attempts and the trace link;
//! - search finds one task among 10,000 and paging reaches the last;
//! - with tokens: a reader sees no action and a forged action with its
//!   cookie is refused (403); an operator's action without the CSRF token
//!   is refused, with it it is done and the audit log names the operator.
//!
//! Screenshots of each page go to `target/ui-screenshots/`.

use std::time::Duration;

use fantoccini::{Client, Locator};
use punchclock_proto::v1 as pb;
use punchclock_tests::browser::{Driver, screenshot, wait_for};
use punchclock_tests::receiver::Receiver;
use punchclock_tests::{KeepLogsOnPanic, Proc, apply_all, http_get, http_get_with, http_post, runs, tasks, wait_engine};

fn no_browser() {
    punchclock_tests::skip("dashboard", "PUNCHCLOCK_SKIP_BROWSER_TESTS", "chromium and chromium-driver are not installed");
}

/// The `aria-label`s of the cells of `task` on the tasks page.
async fn cells(c: &Client, task: &str) -> Vec<(String, u64)> {
    let Ok(found) = c.find_all(Locator::Css(&format!("[id='slots-{task}'] a.cell"))).await else { return Vec::new() };
    let mut out = Vec::new();
    for e in found {
        let label = e.attr("aria-label").await.ok().flatten().unwrap_or_default();
        let slots = e.attr("data-slots").await.ok().flatten().and_then(|s| s.parse().ok()).unwrap_or(1);
        out.push((label, slots));
    }
    out
}

/// A mark in the page's window: still there later means no reload.
async fn mark(c: &Client, v: &str) {
    c.execute(&format!("window.__mark = {v:?};"), vec![]).await.expect("mark");
}

async fn marked(c: &Client) -> String {
    c.execute("return window.__mark || '';", vec![]).await.expect("read mark").as_str().unwrap_or_default().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_show_their_status_and_reason_and_a_trigger_arrives_live() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "dashboard");
    let Some(driver) = Driver::start(&dir.path().join("chromedriver.log")) else { return no_browser() };
    let data = dir.path().join("data");
    let hook = Receiver::start("whsec_dashboard_0123").await;
    let cfg = dir.path().join("config.yaml");
    std::fs::write(
        &cfg,
        format!(
            "resources:\n  llm: {{concurrency: 4}}\nbudgets:\n  - name: daily\n    scope: {{agent: light_agent}}\n    window: 1d\n    limits: {{runs: 100000}}\nsinks:\n  hook: {{url: \"{}\", secret: whsec_dashboard_0123}}\n",
            hook.url()
        ),
    )
    .expect("config");
    let cfg = cfg.display().to_string();
    let trace_url = ["--ui-trace-url", "http://traces.example/trace/{trace_id}", "--config", &cfg];
    let mut dev = Proc::dev_with(&data, 8, &dir.path().join("dev.log"), &trace_url);
    let yearly = serde_json::json!({"type": "cron", "expr": "0 0 1 1 *"});
    let specs = [
        serde_json::json!({"task_id": "failing", "agent_id": "fail_agent", "trigger": {"type": "interval", "every": "1s"},
            "execution": {"max_retries": 0}}),
        serde_json::json!({"task_id": "skippy", "agent_id": "light_agent", "trigger": {"type": "interval", "every": "1s"},
            "execution": {"concurrency_limit": 1, "overlap_policy": "skip", "resources": ["llm"]}}),
        serde_json::json!({"task_id": "late", "agent_id": "light_agent", "trigger": {"type": "interval", "every": "1s"},
            "execution": {"misfire_grace_seconds": 1, "misfire_policy": "skip"}}),
        serde_json::json!({"task_id": "retried", "agent_id": "fail_agent", "trigger": yearly,
            "execution": {"max_retries": 1, "retry_backoff": {"base_seconds": 1, "cap_seconds": 1, "jitter_seconds": 0}},
            "notify": {"on_failure": ["webhook://hook"]}}),
        serde_json::json!({"task_id": "cleanup", "agent_id": "light_agent", "trigger": {"type": "after", "task": "retried", "status": "failed"}}),
        serde_json::json!({"task_id": "manual", "agent_id": "light_agent", "trigger": yearly}),
    ];
    apply_all(&tasks(&dev.addr).await, specs.into_iter()).await;
    // `late` runs once, then the control plane is away for a few seconds:
    // its missed slots come back as one SKIPPED `misfired` record.
    wait_for(Duration::from_secs(60), "late's first run", || {
        let addr = dev.addr.clone();
        async move {
            let r = runs(&addr).await.list_runs(pb::ListRunsRequest { task_id: "late".into(), ..Default::default() }).await.ok()?;
            (!r.into_inner().runs.is_empty()).then_some(())
        }
    })
    .await;
    dev.kill9();
    tokio::time::sleep(Duration::from_secs(5)).await; // the downtime itself
    let dev = Proc::dev_with(&data, 8, &dir.path().join("dev2.log"), &trace_url);
    wait_engine(&dev.addr).await;
    let ui = format!("http://{}/ui", dev.http_addr());
    let retried = tasks(&dev.addr)
        .await
        .trigger_task(pb::TriggerTaskRequest { task_id: "retried".into(), ..Default::default() })
        .await
        .expect("trigger")
        .into_inner()
        .run_id;

    // The tasks page: FAILED cells, a SKIPPED cell's reason, a coalesced
    // misfire with its count.
    let a = driver.session().await;
    a.goto(&format!("{ui}/tasks")).await.expect("tasks page");
    wait_for(Duration::from_secs(60), "a FAILED cell of `failing`", || async {
        cells(&a, "failing").await.iter().any(|(l, _)| l == "FAILED").then_some(())
    })
    .await;
    let skipped = wait_for(Duration::from_secs(60), "a SKIPPED cell of `skippy` with its reason", || async {
        // (its slots missed while the control plane was away are SKIPPED
        // `misfired`: the one sought is an overlap's)
        cells(&a, "skippy").await.into_iter().find(|(l, _)| l.starts_with("SKIPPED ") && l.contains("concurrency_limit"))
    })
    .await;
    assert!(skipped.0.contains("concurrency_limit"), "{skipped:?}");
    let reason_text = a
        .execute(
            "return Array.from(document.querySelectorAll(\"[id='slots-skippy'] a[data-status=SKIPPED] .sr\"), e => e.textContent).join(' | ');",
            vec![],
        )
        .await
        .expect("text");
    assert!(reason_text.as_str().unwrap_or_default().contains("concurrency_limit"), "the reason is text: {reason_text}");
    let missed = wait_for(Duration::from_secs(60), "the coalesced misfire of `late`", || async {
        cells(&a, "late").await.into_iter().find(|(l, n)| l.contains("misfired") && *n > 1)
    })
    .await;
    assert!(missed.0.contains(&format!("×{}", missed.1)), "the cell shows its count: {missed:?}");
    // The row's resources held and budget use.
    let (held, budget) = wait_for(Duration::from_secs(60), "skippy holding `llm`", || async {
        a.refresh().await.ok()?;
        let row = a.find(Locator::Css("tr[data-task=skippy]")).await.ok()?;
        let held = row.find(Locator::Css("td.resources")).await.ok()?.text().await.ok()?;
        let budget = row.find(Locator::Css("td.budgets")).await.ok()?.text().await.ok()?;
        held.contains("llm: 1 held").then_some((held, budget))
    })
    .await;
    assert!(held.contains("/ 4 in use"), "{held}");
    let used: u64 = budget
        .strip_prefix("daily: runs ")
        .and_then(|r| r.split(" / ").next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("the budget's use: {budget:?}"));
    assert!(used > 0 && budget.contains("/ 100000"), "{budget}");
    screenshot(&a, "tasks").await;

    // A second window on the tasks page; the first on `manual`'s page.
    let b = driver.session().await;
    b.goto(&format!("{ui}/tasks")).await.expect("tasks page");
    b.wait().for_element(Locator::Css("body[data-live=open]")).await.expect("b's live stream");
    mark(&b, "b").await;
    let before = cells(&b, "manual").await.len();
    a.goto(&format!("{ui}/tasks/manual")).await.expect("task page");
    a.wait().for_element(Locator::Css("body[data-live=open]")).await.expect("a's live stream");
    mark(&a, "a").await;
    a.find(Locator::Css("form[action$='/trigger'] button")).await.expect("trigger button").click().await.expect("click");
    wait_for(Duration::from_secs(60), "the triggered run SUCCEEDED on the task page", || async {
        a.find(Locator::Css("[id='runs-manual'] tr[data-status=SUCCEEDED]")).await.ok().map(|_| ())
    })
    .await;
    assert_eq!(marked(&a).await, "a", "the task page was not reloaded");
    let flash = a.find(Locator::Id("flash")).await.expect("flash").text().await.expect("text");
    assert!(flash.starts_with("triggered: run "), "{flash}");
    wait_for(Duration::from_secs(30), "the new cell in the other window", || async {
        let now = cells(&b, "manual").await;
        (now.len() > before && now.iter().any(|(l, _)| l == "SUCCEEDED")).then_some(())
    })
    .await;
    assert_eq!(marked(&b).await, "b", "the tasks page was not reloaded");
    screenshot(&a, "task").await;

    // The retried run: both attempts, their outcomes, the trace link.
    wait_for(Duration::from_secs(60), "the retried run to end", || {
        let (addr, id) = (dev.addr.clone(), retried.clone());
        async move {
            let r = runs(&addr).await.get_run(pb::GetRunRequest { run_id: id }).await.ok()?.into_inner();
            (r.status == pb::RunStatus::Failed as i32).then_some(())
        }
    })
    .await;
    a.goto(&format!("{ui}/runs/{retried}")).await.expect("run page");
    let attempts = a.find_all(Locator::Css("tr.attempt")).await.expect("attempts");
    assert_eq!(attempts.len(), 2, "both attempts");
    for at in &attempts {
        assert_eq!(at.attr("data-outcome").await.expect("attr").as_deref(), Some("FAILED"));
    }
    // Its notification and the run that followed it, each linked.
    wait_for(Duration::from_secs(30), "the failure's notification delivered", || async {
        hook.received().iter().any(|r| r.body["run"]["run_id"] == retried.as_str()).then_some(())
    })
    .await;
    a.refresh().await.expect("read the run page again");
    let note = a.find(Locator::Css("table.notifications tbody tr")).await.expect("a notification row").text().await.expect("text");
    assert!(note.contains("on_failure") && note.contains("webhook://hook") && note.contains("delivered"), "{note}");
    let follower = a.find(Locator::Css("table.downstream tr[data-run]")).await.expect("the downstream run");
    let follower_id = follower.attr("data-run").await.expect("attr").unwrap_or_default();
    assert_eq!(follower_id, format!("cleanup.after-{retried}"));
    let attempts = a.find_all(Locator::Css("tr.attempt")).await.expect("attempts");
    assert_eq!(attempts.len(), 2, "both attempts, read again");
    let trace = a.find(Locator::Css("a.trace")).await.expect("trace link");
    let href = trace.attr("href").await.expect("href").unwrap_or_default();
    let id = trace.text().await.expect("trace id");
    assert_eq!(href, format!("http://traces.example/trace/{id}"));
    screenshot(&a, "run").await;
    a.goto(&format!("{ui}/cluster")).await.expect("cluster page");
    a.find(Locator::Css("table.runners")).await.expect("runners table");
    screenshot(&a, "cluster").await;
    a.goto(&format!("{ui}/events")).await.expect("events page");
    screenshot(&a, "events").await;
    a.close().await.expect("close");
    b.close().await.expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn search_finds_one_task_among_ten_thousand_and_paging_reaches_the_last() {
    const N: usize = 10_000;
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "dashboard_search");
    let Some(driver) = Driver::start(&dir.path().join("chromedriver.log")) else { return no_browser() };
    let dev = Proc::dev(&dir.path().join("data"));
    let client = tasks(&dev.addr).await;
    let specs: Vec<String> = (0..N)
        .map(|i| {
            let mut t = serde_json::json!({"task_id": format!("fleet-{i:05}"), "agent_id": "light_agent",
                                           "trigger": {"type": "cron", "expr": "0 0 1 1 *"}});
            if i == 7777 {
                t["labels"] = serde_json::json!({"team": "needle"});
            }
            t.to_string()
        })
        .collect();
    let messages: Vec<pb::ApplyTasksRequest> =
        specs.chunks(500).map(|c| pb::ApplyTasksRequest { spec_json: c.to_vec(), ..Default::default() }).collect();
    client.clone().apply_tasks(tokio_stream::iter(messages)).await.expect("apply 10,000 tasks");
    let ui = format!("http://{}/ui", dev.http_addr());
    let c = driver.session().await;
    for q in ["fleet-07777", "NEEDLE"] {
        c.goto(&format!("{ui}/tasks?q={q}")).await.expect("search");
        let rows = c.find_all(Locator::Css("tr[data-task]")).await.expect("rows");
        assert_eq!(rows.len(), 1, "search {q:?}");
        assert_eq!(rows[0].attr("data-task").await.expect("attr").as_deref(), Some("fleet-07777"));
    }
    screenshot(&c, "tasks-search").await;
    // A search that matches 1,000 tasks pages through them, each once.
    c.goto(&format!("{ui}/tasks?q=FLEET-09")).await.expect("search");
    let mut found = Vec::new();
    loop {
        for r in c.find_all(Locator::Css("tr[data-task]")).await.expect("rows") {
            found.push(r.attr("data-task").await.expect("attr").unwrap_or_default());
        }
        match c.find(Locator::Css("a.next")).await {
            Ok(next) => next.click().await.expect("next page"),
            Err(_) => break,
        }
        assert!(found.len() <= 1000, "paging does not end");
    }
    let want: Vec<String> = (9000..10_000).map(|i| format!("fleet-{i:05}")).collect();
    assert_eq!(found, want, "the search's pages hold each match once, in order");
    c.goto(&format!("{ui}/tasks")).await.expect("tasks");
    let mut pages = 1;
    while let Ok(next) = c.find(Locator::Css("a.next")).await {
        next.click().await.expect("next page");
        pages += 1;
        assert!(pages <= N / 100 + 1, "paging does not end");
    }
    let rows = c.find_all(Locator::Css("tr[data-task]")).await.expect("rows");
    let last = rows.last().expect("a row").attr("data-task").await.expect("attr");
    assert_eq!(last.as_deref(), Some("fleet-09999"), "the last page ends with the last task");
    assert_eq!(pages, N / 100, "{N} tasks in pages of 100");
    c.close().await.expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_cannot_act_and_an_operator_acts_only_with_the_csrf_token() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "dashboard_auth");
    let Some(driver) = Driver::start(&dir.path().join("chromedriver.log")) else { return no_browser() };
    let pki = punchclock_tests::pki::Pki::make(&[]);
    let port = punchclock_tests::etcd::free_port();
    let http = punchclock_tests::etcd::free_port();
    let (listen, http_listen) = (format!("127.0.0.1:{port}"), format!("127.0.0.1:{http}"));
    let data = format!("embedded:{}", dir.path().join("data").display());
    let auth = pki.path("tokens.yaml");
    let server = Proc::start(
        &["server", "--store", &data, "--listen", &listen, "--http-listen", &http_listen, "--auth-file", &auth],
        &dir.path().join("server.log"),
        true,
    );
    let admin = pki.token("admin");
    let ch = punchclock_tests::endpoint(&server.addr).connect().await.expect("connect");
    let mut client = pb::task_service_client::TaskServiceClient::new(tonic::service::interceptor::InterceptedService::new(
        ch,
        punchclock_proto::bearer::Bearer::new(Some(admin.as_str())),
    ));
    client
        .apply_task(pb::ApplyTaskRequest {
            spec_json:
                serde_json::json!({"task_id": "guarded", "agent_id": "light_agent", "trigger": {"type": "cron", "expr": "0 0 1 1 *"}})
                    .to_string(),
            ..Default::default()
        })
        .await
        .expect("apply");
    let ui = format!("http://{http_listen}/ui");

    // Without a session: the sign-in form.
    let (code, _) = http_get(&http_listen, "/ui/tasks");
    assert_eq!(code, 303, "no session: to the sign-in form");

    // A reader: no action button; its session's cookie on a forged
    // trigger: 403, and the refusal is audited.
    let c = driver.session().await;
    let sign_in = |token: String| {
        let (c, ui) = (&c, &ui);
        async move {
            c.goto(&format!("{ui}/login")).await.expect("login page");
            c.find(Locator::Id("token")).await.expect("token field").send_keys(&token).await.expect("type");
            c.find(Locator::Css("form.login button")).await.expect("sign in").click().await.expect("click");
            c.goto(&format!("{ui}/tasks/guarded")).await.expect("task page");
            let csrf = c.find(Locator::Css("body")).await.expect("body").attr("data-csrf").await.expect("attr").unwrap_or_default();
            let cookie = c.get_named_cookie("punchclock_ui").await.expect("the session cookie");
            assert!(cookie.http_only().unwrap_or(false), "HttpOnly");
            (format!("punchclock_ui={}", cookie.value()), csrf)
        }
    };
    c.goto(&format!("{ui}/login")).await.expect("login page");
    screenshot(&c, "login").await;
    let reader = pki.token("reader");
    let (reader_cookie, reader_csrf) = sign_in(reader.clone()).await;
    assert!(!reader_cookie.ends_with(&format!("={reader}")), "the cookie holds a session id beside the token");
    assert!(c.find_all(Locator::Css("form[action$='/trigger']")).await.expect("forms").is_empty(), "a reader sees no trigger");
    let form = format!("csrf={reader_csrf}");
    let post = |cookie: &str, body: &str| {
        http_post(
            &http_listen,
            "/ui/tasks/guarded/trigger",
            &[("Cookie", cookie), ("Content-Type", "application/x-www-form-urlencoded"), ("x-punchclock-ui", "1")],
            Some(body.as_bytes()),
        )
    };
    let (code, body) = post(&reader_cookie, &form);
    assert_eq!(code, 403, "a reader's forged trigger is refused");
    assert!(!body.contains('<'), "a refusal to the page's script is a line of text: {body}");
    wait_for(Duration::from_secs(10), "the refusal's audit line", || async {
        let log = server.log_text();
        log.lines().any(|l| l.contains("punchclock::audit") && l.contains("token=reader") && l.contains("denied")).then_some(())
    })
    .await;

    // An operator: without the CSRF token refused; with it, done and
    // audited once, naming the task.
    c.delete_all_cookies().await.expect("clear the reader's cookie");
    let op = pki.token("operator");
    let (op_cookie, op_csrf) = sign_in(op.clone()).await;
    let (code, _) = post(&op_cookie, "params=");
    assert_eq!(code, 403, "an operator's action without the CSRF token is refused");
    let (code, _) = post(&op_cookie, &format!("csrf={reader_csrf}&params="));
    assert_eq!(code, 403, "another session's CSRF token is refused");
    let (code, body) = post(&op_cookie, &format!("csrf={op_csrf}&params="));
    assert_eq!(code, 200, "{body}");
    assert!(body.starts_with("triggered: run "), "{body}");
    let log = wait_for(Duration::from_secs(10), "the audit line", || async {
        let log = server.log_text();
        log.lines()
            .any(|l| l.contains("punchclock::audit: audit") && l.contains("token=operator") && l.contains("TriggerTask"))
            .then_some(log)
    })
    .await;
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("punchclock::audit: audit") && l.contains("token=operator") && l.contains("TriggerTask"))
        .collect();
    assert_eq!(lines.len(), 1, "one action, one audit line: {lines:#?}");
    assert!(lines[0].contains("target=\"guarded\""), "{}", lines[0]);
    assert!(!log.contains(&op), "the audit log never holds the token itself");

    // Sign-out ends the session: its cookie, replayed, is sent to sign in;
    // a new sign-in is a new session with another CSRF token.
    c.find(Locator::Css("form[action='/ui/logout'] button")).await.expect("sign out").click().await.expect("click");
    c.wait().for_element(Locator::Id("token")).await.expect("signed out: the sign-in form");
    let (code, _) = http_get_with(&http_listen, "/ui/tasks", &[("Cookie", &op_cookie)]);
    assert_eq!(code, 303, "a signed-out session's cookie no longer reads");
    let (code, _) = post(&op_cookie, &format!("csrf={op_csrf}&params="));
    assert_eq!(code, 303, "nor acts");
    let (_, again) = sign_in(op.clone()).await;
    assert_ne!(again, op_csrf, "each sign-in its own CSRF token");
    c.close().await.expect("close");
}

/// Hostile clients of the dashboard (found by an attack): a form trickled
/// a byte at a time is cut at the body timeout (408) instead of holding
/// its connection for ever; live streams take at most a quarter of the
/// HTTP port's connections, so `/healthz` still answers with every stream
/// open; a `since` too long ago is a 400, not a dropped connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickled_forms_and_idle_streams_do_not_take_the_port() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "dashboard_hostile");
    let dev = Proc::dev_with(
        &dir.path().join("data"),
        2,
        &dir.path().join("dev.log"),
        &["--http-max-connections", "40", "--http-max-connections-per-ip", "40", "--http-body-timeout", "1s"],
    );
    wait_engine(&dev.addr).await;
    let http = dev.http_addr();

    // Ten trickled sign-in forms, from one address: each is answered.
    let mut trickles: Vec<std::net::TcpStream> = (0..10)
        .map(|_| {
            let mut s = std::net::TcpStream::connect(&http).expect("connect");
            write!(
                s,
                "POST /ui/login HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: 1000\r\n\r\nt"
            )
            .expect("send");
            s.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
            s
        })
        .collect();
    for s in &mut trickles {
        let mut head = [0u8; 12];
        s.read_exact(&mut head).expect("an answer within the body timeout, not silence");
        // 408 once the timeout passes; 503 at once past the address's
        // share of the port's turns to read a body.
        let head = String::from_utf8_lossy(&head).to_string();
        assert!(head == "HTTP/1.1 408" || head == "HTTP/1.1 503", "{head}");
    }
    drop(trickles);

    // Live streams up to their cap (a quarter of 40), then 503; the port
    // still answers.
    let open_stream = || {
        let mut s = std::net::TcpStream::connect(&http).expect("connect");
        write!(s, "GET /ui/live HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n").expect("send");
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let mut head = [0u8; 12];
        s.read_exact(&mut head).expect("an answer");
        (String::from_utf8_lossy(&head).to_string(), s)
    };
    let streams: Vec<_> = (0..10).map(|_| open_stream()).collect();
    for (head, _) in &streams {
        assert_eq!(head, "HTTP/1.1 200");
    }
    let (head, _extra) = open_stream();
    assert_eq!(head, "HTTP/1.1 503", "the eleventh stream is refused");
    let (code, _) = http_get(&http, "/healthz");
    assert_eq!(code, 200, "the port answers with every stream open");
    drop(streams);

    // A window too long ago.
    let once = serde_json::json!({"task_id": "t", "agent_id": "light_agent", "trigger": {"type": "cron", "expr": "0 0 1 1 *"}});
    apply_all(&tasks(&dev.addr).await, [once].into_iter()).await;
    let (code, body) = http_get(&http, "/ui/tasks/t?since=100000000d");
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("too long ago"), "{body}");
}
