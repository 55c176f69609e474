//! Connecting to the control plane: `--endpoint`/`PUNCHCLOCK_ENDPOINT`,
//! one or more comma-separated addresses, tried in turn; `https://`
//! addresses over TLS (`--ca-file`, else the webpki roots); every call
//! carries `authorization: Bearer TOKEN` when a token is configured
//! (`--token`/`PUNCHCLOCK_TOKEN`, or `--token-file`).

use std::sync::OnceLock;
use std::time::Duration;

use punchclock_proto::bearer::{self, Bearer};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

/// Default API address.
pub const DEFAULT_ENDPOINT: &str = "http://127.0.0.1:7700";

/// A connection: a channel whose calls carry the token.
pub type Conn = InterceptedService<Channel, Bearer>;

/// How the CLI authenticates: set once at start ([`configure`]).
#[derive(Default)]
pub struct ClientOptions {
    /// Bearer token.
    pub token: Option<String>,
    /// CA certificate (PEM) for `https://` endpoints.
    pub ca_pem: Option<Vec<u8>>,
}

static OPTIONS: OnceLock<ClientOptions> = OnceLock::new();

/// Sets the token and CA for every later connection.
///
/// Errors: the token is not a valid header value (a newline, say).
pub fn configure(opts: ClientOptions) -> Result<(), String> {
    if let Some(t) = &opts.token
        && bearer::header(t).is_none()
    {
        return Err("--token/--token-file: not a valid token (printable ASCII only)".to_string());
    }
    let _ = OPTIONS.set(opts);
    Ok(())
}

fn options() -> &'static ClientOptions {
    OPTIONS.get_or_init(ClientOptions::default)
}

/// `host:port` → `http://host:port` (`https://` when a CA file is given).
pub fn normalize(addr: &str) -> String {
    let a = addr.trim();
    if a.starts_with("http://") || a.starts_with("https://") {
        a.to_string()
    } else if options().ca_pem.is_some() {
        format!("https://{a}")
    } else {
        format!("http://{a}")
    }
}

/// The endpoint for `url`, with TLS when it is `https://`.
///
/// Errors: a malformed address.
pub fn endpoint(url: &str, ca_pem: Option<&[u8]>) -> Result<Endpoint, String> {
    let mut ep = Endpoint::from_shared(url.to_string()).map_err(|e| format!("{url}: {e}"))?;
    if url.starts_with("https://") {
        let tls = match ca_pem {
            Some(ca) => ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)),
            None => ClientTlsConfig::new().with_webpki_roots(),
        };
        ep = ep.tls_config(tls).map_err(|e| format!("{url}: TLS: {e}"))?;
    }
    Ok(ep)
}

/// Connects to the first reachable address of a comma-separated list.
pub async fn connect(endpoints: &str) -> Result<Conn, String> {
    let opts = options();
    let bearer = Bearer::new(opts.token.as_deref());
    let mut last = String::from("no endpoint given");
    for addr in endpoints.split(',').filter(|a| !a.trim().is_empty()) {
        let url = normalize(addr);
        if opts.token.is_some() && url.starts_with("http://") && !is_loopback(&url) {
            eprintln!("warning: sending a token over plaintext to {url}: use https:// (README \"Security\")");
        }
        let ep = match endpoint(&url, opts.ca_pem.as_deref()) {
            Ok(e) => e.connect_timeout(Duration::from_secs(3)).timeout(Duration::from_secs(30)),
            Err(e) => {
                last = e;
                continue;
            }
        };
        match ep.connect().await {
            Ok(ch) => return Ok(InterceptedService::new(ch, bearer)),
            Err(e) => {
                let cause = innermost(&e);
                let hint = if cause.contains("UnknownIssuer") { " (give the CA that signed its certificate: --ca-file)" } else { "" };
                last = format!("cannot reach the control plane at {url}: {cause}{hint}");
            }
        }
    }
    Err(last)
}

/// Whether an `http(s)://host:port` URL names a loopback host.
fn is_loopback(url: &str) -> bool {
    let host = url.split("://").nth(1).unwrap_or("").split('/').next().unwrap_or("");
    let host = host.rsplit_once(':').map(|(h, _)| h).unwrap_or(host).trim_matches(['[', ']']);
    host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The innermost cause of a transport error ("certificate not valid for
/// name", "Connection refused"), which is the useful part.
fn innermost(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = e;
    let mut text = e.to_string();
    while let Some(next) = cause.source() {
        cause = next;
        text = next.to_string();
    }
    text
}

/// Connects to the leader: asks the first reachable endpoint who leads and
/// follows its advertised address (leader-only calls: trigger, cancel,
/// runners). Falls back to the reachable endpoint when no leader is known.
pub async fn connect_leader(endpoints: &str) -> Result<Conn, String> {
    use punchclock_proto::v1::cluster_service_client::ClusterServiceClient;
    let ch = connect(endpoints).await?;
    let leader = ClusterServiceClient::new(ch.clone()).get_leader(punchclock_proto::v1::GetLeaderRequest {}).await;
    match leader {
        Ok(r) => {
            let r = r.into_inner();
            if r.is_self || r.advertise_address.is_empty() {
                return Ok(ch);
            }
            // Never follow a TLS endpoint to a plaintext one (the token
            // would go in clear); a bare address keeps the scheme.
            let tls = endpoints.split(',').any(|e| e.trim().starts_with("https://")) || options().ca_pem.is_some();
            let adv = r.advertise_address.trim();
            let target = if tls && !adv.contains("://") { format!("https://{adv}") } else { adv.to_string() };
            if tls && !target.starts_with("https://") {
                return Err(format!(
                    "the leader advertises {target} (plaintext) but this client uses TLS: not following it (set the server's --advertise to https://…)"
                ));
            }
            connect(&target).await
        }
        Err(_) => Ok(ch),
    }
}
