//! Issue 34, finding 16: `punchclock validate -f` checks task files with no
//! server, as `task apply` would: every problem of every definition (a type
//! error no longer hides the rest), problems across the file's tasks, and —
//! with `--config` — resources and brokers against that configuration.

use std::process::Command;

use punchclock_tests::{bin, repo_root};

fn validate(args: &[&str]) -> (bool, String) {
    let out = Command::new(bin()).arg("validate").args(args).current_dir(repo_root()).output().expect("run punchclock validate");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn task_files_are_checked_offline_naming_every_problem() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).expect("write");
        p.to_string_lossy().into_owned()
    };
    let good = file(
        "good.yaml",
        "task_id: report\nagent_id: report_agent\ntrigger: {type: cron, expr: \"30 8 * * *\", timezone: Asia/Shanghai}\n\
         execution: {resources: [search-api]}\n",
    );
    let (ok, out) = validate(&["-f", &good]);
    assert!(ok && out.contains("1 definition(s) valid (resources and brokers not checked: give --config)"), "{out}");

    let bad = file(
        "bad.yaml",
        "- task_id: bad\n  agent_id: a\n  trigger: {type: cron, expr: \"0 0 * * *\", timezone: Nowhere/City}\n  \
         execution: {max_retries: three, timeout_seconds: ten, concurrency_limit: 0, priority: 5000}\n\
         - task_id: hook1\n  agent_id: a\n  trigger: {type: webhook, path: /hooks/x, auth: none}\n\
         - task_id: hook2\n  agent_id: a\n  trigger: {type: webhook, path: /hooks/x, auth: none}\n",
    );
    let (ok, out) = validate(&["-f", &bad]);
    assert!(!ok, "{out}");
    for field in
        ["execution.max_retries", "execution.timeout_seconds", "execution.priority", "execution.concurrency_limit", "trigger.timezone"]
    {
        assert!(out.contains(field), "{field} not named: {out}");
    }
    // Fixed, the two webhooks on one path are the problem left.
    let across = file(
        "across.yaml",
        "- task_id: hook1\n  agent_id: a\n  trigger: {type: webhook, path: /hooks/x, auth: none}\n\
         - task_id: hook2\n  agent_id: a\n  trigger: {type: webhook, path: /hooks/x, auth: none}\n",
    );
    let (ok, out) = validate(&["-f", &across]);
    assert!(!ok && out.contains("/hooks/x"), "{out}");

    // Against a configuration: the resource must be defined there.
    let config = file("config.yaml", "resources:\n  other: {concurrency: 1}\n");
    let (ok, out) = validate(&["-f", &good, "--config", &config]);
    assert!(!ok && out.contains("execution.resources[0]: resource \"search-api\" is not defined"), "{out}");
    // Every problem against it, not the first alone (found attacking issue 34).
    let two = file("two.yaml", "task_id: two\nagent_id: a\nexecution: {resources: [nosuch, {name: other, units: 5}]}\n");
    let (ok, out) = validate(&["-f", &two, "--config", &config]);
    assert!(
        !ok && out.contains("execution.resources[0]: resource \"nosuch\"") && out.contains("also execution.resources[1].units"),
        "{out}"
    );
    let config = file("config2.yaml", "resources:\n  search-api: {concurrency: 3}\n");
    let (ok, out) = validate(&["-f", &good, "--config", &config]);
    assert!(ok && out.contains("1 definition(s) valid\n"), "{out}");
}
