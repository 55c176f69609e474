//! Issue 9, acceptance 2: a real Prometheus (Debian's `prometheus`
//! package, which `make test` installs) scrapes `/metrics` of `dev`; its
//! HTTP API gives a start-lag histogram count equal to the runs that
//! started, as `runs list -o json` shows them. `promtool check metrics`
//! passes on the exposition, `promtool check rules` and `check config` on
//! `deploy/prometheus/`, and every metric that the alert rules and the
//! Grafana dashboard name is one `/metrics` serves.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::etcd::free_port;
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, cli, http_get, repo_root, status, wait_n_runs};
use serde_json::{Value, json};

fn encode_query(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// One instant query against Prometheus' HTTP API: the first sample's value.
fn query(prom: &str, q: &str) -> Option<f64> {
    let (code, body) = http_get(prom, &format!("/api/v1/query?query={}", encode_query(q)));
    if code != 200 {
        return None;
    }
    let v: Value = serde_json::from_str(&body).ok()?;
    v["data"]["result"][0]["value"][1].as_str()?.parse().ok()
}

fn promtool(args: &[&str], stdin: Option<&str>) -> (bool, String) {
    let mut child = Command::new("promtool")
        .args(args)
        .current_dir(repo_root())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian package prometheus; `make deps` installs it)");
    if let Some(text) = stdin {
        child.stdin.take().expect("stdin").write_all(text.as_bytes()).expect("write");
    }
    drop(child.stdin.take());
    let out = child.wait_with_output().expect("promtool");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// Metric names (`punchclock_...`) a rules or dashboard file mentions.
fn names_in(path: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(path).expect("read");
    let mut names = BTreeSet::new();
    let mut rest = text.as_str();
    while let Some(i) = rest.find("punchclock_") {
        let tail = &rest[i..];
        let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
        names.insert(tail[..end].to_string());
        rest = &tail[end..];
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_dev_and_counts_every_started_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "metrics");
    // A sink nobody listens on, tried once: failures become dead letters.
    let cfg = dir.path().join("punchclock.yaml");
    std::fs::write(&cfg, "notifications:\n  max_attempts: 1\nsinks:\n  nowhere:\n    url: http://127.0.0.1:1/hook\n").expect("config");
    let dev = Proc::dev_with(&dir.path().join("data"), 8, &dir.path().join("dev.log"), &["--config", &cfg.to_string_lossy()]);
    let target = dev.http_addr();

    // A real Prometheus scraping it every second.
    let prom_port = free_port();
    let prom = format!("127.0.0.1:{prom_port}");
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: punchclock\n    static_configs:\n      - targets: [\"{target}\"]\n"
        ),
    )
    .expect("config");
    let prom_log = dir.path().join("prometheus.log");
    let _prometheus = Proc::start_bin(
        Path::new("prometheus"),
        &[
            &format!("--config.file={}", config.display()),
            &format!("--storage.tsdb.path={}", dir.path().join("tsdb").display()),
            &format!("--web.listen-address={prom}"),
        ],
        &[],
        &prom_log,
        false,
    );

    let every = json!({"type": "interval", "every": "1s"});
    apply(&dev.addr, json!({"task_id": "m_ok", "agent_id": "ok_agent", "trigger": every})).await;
    apply(
        &dev.addr,
        json!({"task_id": "m_fail", "agent_id": "fail_agent", "trigger": every,
        "execution": {"circuit_breaker": {"failure_threshold": 1000, "cooldown_seconds": 60}},
        "notify": {"on_failure": ["webhook://nowhere"]}}),
    )
    .await;
    // Runs that overlap: SKIPPED concurrency_limit slots.
    apply(&dev.addr, json!({"task_id": "m_slow", "agent_id": "slow_agent", "trigger": every})).await;
    // A run no runner can take: it stays PENDING (the pending gauge).
    apply(&dev.addr, json!({"task_id": "m_nobody", "agent_id": "nobody_agent"})).await;
    cli(&dev.addr, &["task", "trigger", "m_nobody"]);
    wait_n_runs(&dev.addr, "m_ok", 4, Duration::from_secs(30), |r| status(r) == pb::RunStatus::Succeeded).await;
    wait_n_runs(&dev.addr, "m_fail", 2, Duration::from_secs(30), |r| status(r) == pb::RunStatus::Failed).await;
    wait_n_runs(&dev.addr, "m_slow", 2, Duration::from_secs(30), |r| status(r) == pb::RunStatus::Skipped).await;
    for task in ["m_ok", "m_fail", "m_slow"] {
        cli(&dev.addr, &["task", "pause", task]);
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let runs: Vec<Value> = loop {
        let mut runs = Vec::new();
        for task in ["m_ok", "m_fail", "m_slow"] {
            let list: Value =
                serde_json::from_str(&cli(&dev.addr, &["-o", "json", "runs", "list", "--task", task, "--limit", "1000"])).expect("json");
            runs.extend(list.as_array().expect("array").iter().cloned());
        }
        if runs.iter().all(|r| !matches!(r["status"].as_str(), Some("PENDING" | "RUNNING" | "RETRYING"))) {
            break runs;
        }
        assert!(tokio::time::Instant::now() < deadline, "runs did not finish");
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let started = runs.iter().filter(|r| !r["actual_started_at"].is_null()).count() as f64;
    let failed = runs.iter().filter(|r| r["status"] == "FAILED").count() as f64;
    let skipped = runs.iter().filter(|r| r["status"] == "SKIPPED").map(|r| r["missed_count"].as_u64().unwrap_or(1)).sum::<u64>() as f64;
    assert!(started >= 6.0);

    // Prometheus scrapes once a second: wait (bounded) for a scrape taken
    // after the last run finished.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let count = query(&prom, "sum(punchclock_start_lag_seconds_count)");
        let fails = query(&prom, "sum(punchclock_runs_finished_total{status=\"FAILED\"})");
        let skips = query(&prom, "sum(punchclock_slots_skipped_total)");
        if count == Some(started) && fails == Some(failed) && skips == Some(skipped) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "Prometheus says {count:?} runs started, {fails:?} failed, {skips:?} slots skipped; the records say {started}, {failed}, {skipped}; log: {}",
            std::fs::read_to_string(&prom_log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(query(&prom, "up{job=\"punchclock\"}"), Some(1.0));
    assert_eq!(query(&prom, "punchclock_is_leader"), Some(1.0));
    assert_eq!(query(&prom, "sum(punchclock_runners_connected)"), Some(1.0));
    assert_eq!(query(&prom, "punchclock_runs_pending{agent_id=\"nobody_agent\"}"), Some(1.0));
    assert_eq!(query(&prom, "punchclock_breaker_state{task_id=\"m_fail\",state=\"closed\"}"), Some(1.0));
    assert!(query(&prom, "sum(punchclock_notifications_dead_total)").is_some_and(|n| n >= 1.0));

    // promtool lints the exposition, the rules and the config.
    let (code, exposition) = http_get(&target, "/metrics");
    assert_eq!(code, 200);
    let (ok, out) = promtool(&["check", "metrics"], Some(&exposition));
    assert!(ok, "promtool check metrics: {out}\n{exposition}");
    let (ok, out) = promtool(&["check", "rules", "deploy/prometheus/alerts.yml"], None);
    assert!(ok, "promtool check rules: {out}");
    let (ok, out) = promtool(&["check", "config", "deploy/prometheus/prometheus.yml"], None);
    assert!(ok, "promtool check config: {out}");

    // Every metric the alerts and the dashboard use exists.
    let served: BTreeSet<String> = exposition
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .flat_map(|n| [n.to_string(), format!("{n}_bucket"), format!("{n}_count"), format!("{n}_sum")])
        .collect();
    let root = repo_root();
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("deploy/grafana/punchclock-dashboard.json")).expect("dashboard"))
            .expect("dashboard is JSON");
    assert!(dashboard["panels"].as_array().is_some_and(|p| p.len() >= 8));
    for file in ["deploy/prometheus/alerts.yml", "deploy/grafana/punchclock-dashboard.json"] {
        let used = names_in(&root.join(file));
        assert!(!used.is_empty());
        let missing: Vec<&String> = used.iter().filter(|n| !served.contains(*n)).collect();
        assert!(missing.is_empty(), "{file} uses metrics /metrics does not serve: {missing:?}");
    }
}
