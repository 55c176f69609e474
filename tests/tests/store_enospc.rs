//! Issue 8, acceptance 5: the embedded store on a full disk. `dev` keeps
//! its data on a small tmpfs (mounted by the test; it needs root) with a
//! task firing every second; the disk is filled. `/healthz` answers 503
//! saying the store takes no writes, and an apply says why it failed; once
//! space returns, writes resume without a restart (`/healthz` 200, new runs
//! recorded), and nothing accepted before is lost (also after a restart).

use std::io::Write;
use std::process::Command;
use std::time::Duration;

use punchclock_proto::v1 as pb;
use punchclock_tests::{KeepLogsOnPanic, Proc, apply, at, http_get, list_runs, status, tasks, wait_run};

async fn wait_health(addr: &str, want: u16, within: Duration) -> String {
    let deadline = std::time::Instant::now() + within;
    loop {
        let (code, body) = http_get(addr, "/healthz");
        if code == want {
            return body;
        }
        assert!(std::time::Instant::now() < deadline, "/healthz never answered {want}: last {code} {body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Unmounts the tmpfs when the test ends, however it ends.
struct Mount(std::path::PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_makes_dev_unready_and_writes_resume_when_space_returns() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = KeepLogsOnPanic::new(dir.path(), "store_enospc");
    let log_copy = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("store_enospc_dev.log");
    let disk = dir.path().join("disk");
    std::fs::create_dir(&disk).expect("mkdir");
    let mounted = Command::new("mount").args(["-t", "tmpfs", "-o", "size=32m", "tmpfs"]).arg(&disk).status().expect("run mount");
    assert!(mounted.success(), "this test mounts a small tmpfs and needs root (or CAP_SYS_ADMIN)");
    let _mount = Mount(disk.clone());

    let data = disk.join("data");
    let mut dev = Proc::dev_logged(&data, 8, &dir.path().join("dev.log"));
    let health = {
        let mut found = String::new();
        for _ in 0..100 {
            if let Some(a) = dev.log_text().split("health on http://").nth(1).and_then(|r| r.split('/').next()) {
                found = a.to_string();
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        found
    };
    assert!(!health.is_empty(), "dev printed no health address");
    wait_health(&health, 200, Duration::from_secs(30)).await;
    apply(&dev.addr, serde_json::json!({"task_id": "tick", "agent_id": "ok_agent", "trigger": {"type": "interval", "every": "1s"}})).await;
    wait_run(&dev.addr, "tick", Duration::from_secs(30), |r| status(r) == pb::RunStatus::Succeeded).await;

    // Fill the disk.
    let filler = disk.join("filler");
    {
        let mut f = std::fs::File::create(&filler).expect("filler");
        let block = vec![0u8; 1 << 20];
        while f.write_all(&block).is_ok() {}
        let _ = f.sync_all();
    }
    let body = wait_health(&health, 503, Duration::from_secs(60)).await;
    assert!(body.contains("No space left on device") || body.contains("space"), "/healthz says why: {body}");
    // The store file may have room left inside it for a few small writes
    // (how much depends on its page layout): applies are accepted until
    // one is refused, and that one says why. Every accepted one is kept.
    let mut client = tasks(&dev.addr).await;
    let mut accepted = Vec::new();
    let refused = loop {
        let id = format!("late{}", accepted.len());
        let r = client
            .apply_task(pb::ApplyTaskRequest {
                spec_json: serde_json::json!({"task_id": id, "agent_id": "ok_agent", "trigger": {"type": "interval", "every": "1h"}})
                    .to_string(),
                dry_run: false,
                task: None,
            })
            .await;
        match r {
            Ok(_) => accepted.push(id),
            Err(e) => break e,
        }
        assert!(accepted.len() < 200, "200 applies accepted on a full disk");
    };
    println!("{} applies accepted before the full disk refused one", accepted.len());
    assert!(refused.message().contains("space"), "the API says why: {}", refused.message());
    let before: Vec<String> =
        list_runs(&dev.addr, "tick").await.iter().filter(|r| status(r) == pb::RunStatus::Succeeded).map(|r| r.run_id.clone()).collect();

    // Space returns: writes resume, without a restart.
    std::fs::remove_file(&filler).expect("free the disk");
    let freed = chrono::Utc::now();
    wait_health(&health, 200, Duration::from_secs(60)).await;
    let after = wait_run(&dev.addr, "tick", Duration::from_secs(90), |r| {
        status(r) == pb::RunStatus::Succeeded && at(&r.scheduled_at).is_some_and(|t| t > freed)
    })
    .await;
    assert!(!before.contains(&after.run_id));
    apply(&dev.addr, serde_json::json!({"task_id": "late", "agent_id": "ok_agent", "trigger": {"type": "interval", "every": "1h"}})).await;

    // Nothing lost, also across a restart.
    dev.signal(libc::SIGTERM);
    let _ = dev.child.wait();
    let _ = std::fs::write(&log_copy, dev.log_text());
    let dev = Proc::dev_logged(&data, 8, &dir.path().join("dev2.log"));
    let stored = list_runs(&dev.addr, "tick").await;
    for id in &before {
        assert!(stored.iter().any(|r| &r.run_id == id), "run {id} finished before the disk filled is gone");
    }
    let mut client = tasks(&dev.addr).await;
    client.get_task(pb::GetTaskRequest { task_id: "late".into() }).await.expect("the task applied after recovery is kept");
    for id in accepted {
        client
            .get_task(pb::GetTaskRequest { task_id: id.clone() })
            .await
            .unwrap_or_else(|e| panic!("{id}, accepted on the full disk, is gone: {e}"));
    }
}
