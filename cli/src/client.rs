//! Connecting to the control plane: `--endpoint`/`PUNCHCLOCK_ENDPOINT`,
//! one or more comma-separated addresses, tried in turn.

use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

/// Default API address.
pub const DEFAULT_ENDPOINT: &str = "http://127.0.0.1:7700";

/// `host:port` → `http://host:port`.
pub fn normalize(addr: &str) -> String {
    let a = addr.trim();
    if a.starts_with("http://") || a.starts_with("https://") { a.to_string() } else { format!("http://{a}") }
}

/// Connects to the first reachable address of a comma-separated list.
pub async fn connect(endpoints: &str) -> Result<Channel, String> {
    let mut last = String::from("no endpoint given");
    for addr in endpoints.split(',').filter(|a| !a.trim().is_empty()) {
        let url = normalize(addr);
        let ep = match Endpoint::from_shared(url.clone()) {
            Ok(e) => e.connect_timeout(Duration::from_secs(3)).timeout(Duration::from_secs(30)),
            Err(e) => {
                last = format!("{url}: {e}");
                continue;
            }
        };
        match ep.connect().await {
            Ok(ch) => return Ok(ch),
            Err(e) => last = format!("cannot reach the control plane at {url}: {e}"),
        }
    }
    Err(last)
}

/// Connects to the leader: asks the first reachable endpoint who leads and
/// follows its advertised address (leader-only calls: trigger, cancel,
/// runners). Falls back to the reachable endpoint when no leader is known.
pub async fn connect_leader(endpoints: &str) -> Result<Channel, String> {
    use punchclock_proto::v1::cluster_service_client::ClusterServiceClient;
    let ch = connect(endpoints).await?;
    let leader = ClusterServiceClient::new(ch.clone()).get_leader(punchclock_proto::v1::GetLeaderRequest {}).await;
    match leader {
        Ok(r) => {
            let r = r.into_inner();
            if r.is_self || r.advertise_address.is_empty() { Ok(ch) } else { connect(&r.advertise_address).await }
        }
        Err(_) => Ok(ch),
    }
}
