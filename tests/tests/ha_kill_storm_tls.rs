//! Issue 10, acceptance 3: the HA kill-storm scenario with TLS on the API
//! and runner streams, a token on every client (the test's own clients
//! and CLI runs an admin's, the runner a runner token bound to its id),
//! and etcd over TLS with a client certificate. The same checks as
//! `ha_kill_storm.rs` (see `punchclock_tests::storm`).

use punchclock_tests::pki::{Pki, use_client_credentials};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_kill_storm_over_tls_with_tokens() {
    let pki = Pki::make(&["r1"]);
    use_client_credentials(&pki, "admin");
    punchclock_tests::storm::kill_storm("ha_kill_storm_tls", Some(&pki)).await;
}
