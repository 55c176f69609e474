//! Acceptance 1 (issue 3): two replicas race on the same slot 1,000 times
//! against a real etcd: exactly one run record per slot, and the loser is
//! told the slot is taken. A replica holding a stale fencing token is
//! rejected outright.

use std::sync::Arc;

use chrono::{Duration, TimeZone, Utc};
use punchclock_control_plane::election::Leadership;
use punchclock_control_plane::error::Error;
use punchclock_control_plane::model::RunRecord;
use punchclock_control_plane::model::run::{TriggerKind, slot_run_id};
use punchclock_control_plane::repo::Keys;
use punchclock_control_plane::repo::Repo;
use punchclock_control_plane::store::etcd::EtcdStore;
use punchclock_control_plane::store::{Compare, KvStore};
use punchclock_tests::etcd::Etcd;

const SLOTS: i64 = 1000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_racing_on_a_slot_make_exactly_one_run() {
    let etcd = Etcd::start(1).await;
    let keys = Keys::new("/race/");
    // Each "replica" has its own etcd connection.
    let a: Arc<dyn KvStore> = Arc::new(EtcdStore::connect(&etcd.endpoints()).await.expect("connect a"));
    let b: Arc<dyn KvStore> = Arc::new(EtcdStore::connect(&etcd.endpoints()).await.expect("connect b"));
    // Both believe they lead (the test hook): same election key, same token.
    let election_key = "/race/election/leader";
    let token = a.put(election_key, b"leader".to_vec()).await.expect("election key");
    let lead = Leadership { token: token as u64, fence: vec![Compare::create_revision(election_key, token)] };
    let base = Utc.with_ymd_and_hms(2026, 11, 30, 0, 0, 0).single().expect("t");

    // Both replicas start each slot's write together.
    let barrier = Arc::new(tokio::sync::Barrier::new(2));
    let replica = |store: Arc<dyn KvStore>, name: &'static str| {
        let keys = keys.clone();
        let lead = lead.clone();
        let barrier = barrier.clone();
        tokio::spawn(async move {
            let mut won = Vec::new();
            for i in 0..SLOTS {
                barrier.wait().await;
                let slot = base + Duration::seconds(i);
                let mut run = RunRecord::pending(slot_run_id("race", slot), "race", "agent", TriggerKind::Interval, slot, Utc::now());
                run.params.insert("writer".into(), name.into());
                won.push(Repo::new(store.clone(), keys.clone()).create_run(&lead, Utc::now(), &mut run).await.expect("write"));
            }
            won
        })
    };
    let (wa, wb) = tokio::join!(replica(a.clone(), "a"), replica(b.clone(), "b"));
    let (wa, wb) = (wa.expect("a"), wb.expect("b"));
    for i in 0..SLOTS as usize {
        assert!(wa[i] ^ wb[i], "slot {i}: exactly one replica creates the run (a={}, b={})", wa[i], wb[i]);
    }
    let (runs, _) = a.range(&keys.runs()).await.expect("range");
    assert_eq!(runs.len(), SLOTS as usize, "one record per slot");
    let wins_a = wa.iter().filter(|w| **w).count();
    println!("replica a won {wins_a} slots, b won {}", SLOTS as usize - wins_a);
    assert!(wins_a > 0 && wins_a < SLOTS as usize, "both replicas won some races (a real race happened)");

    // A replica with a stale token (an older election key revision) is fenced.
    let stale = Leadership { token: token as u64 - 1, fence: vec![Compare::create_revision(election_key, token - 1)] };
    let slot = base + Duration::seconds(SLOTS + 1);
    let mut run = RunRecord::pending(slot_run_id("race", slot), "race", "agent", TriggerKind::Interval, slot, Utc::now());
    let r = Repo::new(b.clone(), keys.clone()).create_run(&stale, Utc::now(), &mut run).await;
    assert!(matches!(r, Err(Error::Fenced(_))), "stale token must be rejected: {r:?}");
    assert!(b.get(&keys.run(&run.run_id)).await.expect("get").is_none(), "nothing written by the stale replica");
}
