//! Acceptance 3 (issue 3): kill -9 of the leader every few seconds, 20
//! times, with 20 tasks firing every second. After the storm: zero
//! duplicate runs per slot, zero slots without a record, and every run a
//! runner finished has its result recorded once (see
//! `punchclock_tests::storm`).

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_kill_storm_loses_and_duplicates_nothing() {
    punchclock_tests::storm::kill_storm("ha_kill_storm", None).await;
}
