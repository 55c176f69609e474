//! A background task owned by the leader's engine (retention, notification
//! delivery): spawned with the engine, aborted when dropped, and stopped
//! with [`Worker::stop`] — which waits until it is gone, with what it held
//! (the store: an embedded store's file lock).

use std::future::Future;

/// See the module docs.
#[derive(Debug)]
pub struct Worker(tokio::task::JoinHandle<()>);

impl Worker {
    /// Spawns `task` on the current runtime.
    pub fn spawn(task: impl Future<Output = ()> + Send + 'static) -> Worker {
        Worker(tokio::spawn(task))
    }

    /// Aborts it and waits until it is gone.
    pub async fn stop(&mut self) {
        self.0.abort();
        let _ = (&mut self.0).await;
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.0.abort();
    }
}
