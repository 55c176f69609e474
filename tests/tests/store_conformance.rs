//! The store conformance suite (`control-plane/src/store/conformance.rs`)
//! against a real etcd process (the embedded store runs it in its own crate).

use std::sync::Arc;

use punchclock_control_plane::store::conformance::run_all;
use punchclock_control_plane::store::etcd::EtcdStore;
use punchclock_tests::etcd::Etcd;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_store_passes_conformance() {
    let etcd = Etcd::start(1).await;
    let store = EtcdStore::connect(&etcd.endpoints()).await.expect("connect");
    run_all(Arc::new(store), "/conf/").await;
}
