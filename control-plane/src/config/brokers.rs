//! `brokers:` — the message brokers queue triggers consume from, by name.
//! The leader connects to a broker while some task's `queue` trigger names
//! it; credentials come from files on the control plane hosts, never from
//! the store.
//!
//! ```yaml
//! brokers:
//!   rabbit:
//!     amqp: {url: "amqp://127.0.0.1:5672/%2f", credentials_file: /etc/punchclock/rabbit.cred}
//!   events:
//!     nats: {url: "nats://127.0.0.1:4222", tls: {ca_file: /etc/punchclock/nats-ca.pem}}
//! ```

use serde::Deserialize;

use crate::error::{Error, Result};

/// One broker as written: exactly one of `amqp` or `nats`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BrokerSpec {
    /// RabbitMQ (AMQP 0.9.1).
    #[serde(default)]
    pub amqp: Option<ConnectionSpec>,
    /// NATS with JetStream.
    #[serde(default)]
    pub nats: Option<ConnectionSpec>,
}

/// How to reach a broker.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectionSpec {
    /// `amqp://` / `amqps://` (RabbitMQ: host, port, vhost), `nats://` /
    /// `tls://` (NATS).
    pub url: String,
    /// TLS: `{ca_file}` trusts that CA (PEM) instead of the system roots;
    /// `amqps://` and `tls://` turn TLS on.
    #[serde(default)]
    pub tls: Option<TlsSpec>,
    /// A file holding `user:password` (one line), or for NATS a `.creds`
    /// file (JWT and NKey seed, as `nsc` writes it). Read at each connection.
    #[serde(default)]
    pub credentials_file: Option<String>,
}

/// `tls:` of a broker.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSpec {
    /// The CA certificate(s) to trust, PEM.
    #[serde(default)]
    pub ca_file: Option<String>,
}

/// A validated broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Broker {
    /// Which protocol.
    pub kind: BrokerKind,
    /// Its URL (credentials in it are allowed; the file is better).
    pub url: String,
    /// CA file to trust, if any.
    pub ca_file: Option<String>,
    /// Credentials file, if any.
    pub credentials_file: Option<String>,
}

/// A broker's protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrokerKind {
    /// RabbitMQ, AMQP 0.9.1.
    Amqp,
    /// NATS JetStream.
    Nats,
}

impl BrokerKind {
    /// `amqp` or `nats`.
    pub fn as_str(self) -> &'static str {
        match self {
            BrokerKind::Amqp => "amqp",
            BrokerKind::Nats => "nats",
        }
    }
}

/// Checks one broker.
///
/// Errors: `InvalidArgument` naming `brokers.NAME` (its name is an id:
/// letters, digits, `_`, `-`) or `brokers.NAME.amqp.url` and the like.
pub fn validate(name: &str, spec: &BrokerSpec) -> Result<Broker> {
    crate::model::task::validate_id(&format!("brokers.{name}"), name)?;
    let (kind, c) = match (&spec.amqp, &spec.nats) {
        (Some(c), None) => (BrokerKind::Amqp, c),
        (None, Some(c)) => (BrokerKind::Nats, c),
        _ => return Err(Error::invalid(format!("brokers.{name}"), "give one of amqp or nats")),
    };
    let at = |f: &str| format!("brokers.{name}.{}.{f}", kind.as_str());
    let schemes: &[&str] = match kind {
        BrokerKind::Amqp => &["amqp://", "amqps://"],
        BrokerKind::Nats => &["nats://", "tls://"],
    };
    if !schemes.iter().any(|s| c.url.starts_with(s) && c.url.len() > s.len()) {
        return Err(Error::invalid(at("url"), format!("{:?}: a URL starting with {}", c.url, schemes.join(" or "))));
    }
    let file = |f: &str, v: &Option<String>| -> Result<Option<String>> {
        match v {
            Some(p) if !p.starts_with('/') => Err(Error::invalid(at(f), format!("{p:?}: an absolute path"))),
            other => Ok(other.clone()),
        }
    };
    Ok(Broker {
        kind,
        url: c.url.clone(),
        ca_file: file("tls.ca_file", &c.tls.as_ref().and_then(|t| t.ca_file.clone()))?,
        credentials_file: file("credentials_file", &c.credentials_file)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn brokers_are_checked_naming_the_field() {
        let spec = |amqp: Option<&str>, nats: Option<&str>| BrokerSpec {
            amqp: amqp.map(|u| ConnectionSpec { url: u.into(), ..Default::default() }),
            nats: nats.map(|u| ConnectionSpec { url: u.into(), ..Default::default() }),
        };
        assert_eq!(validate("r", &spec(Some("amqp://h:5672/%2f"), None)).expect("ok").kind, BrokerKind::Amqp);
        assert_eq!(validate("n", &spec(None, Some("nats://h:4222"))).expect("ok").kind, BrokerKind::Nats);
        let field = |r: Result<Broker>| match r {
            Err(Error::InvalidArgument { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(field(validate("r", &spec(Some("http://h"), None))), "brokers.r.amqp.url");
        assert_eq!(field(validate("r", &spec(Some("amqp://h"), Some("nats://h")))), "brokers.r");
        assert_eq!(field(validate("bad name", &spec(Some("amqp://h"), None))), "brokers.bad name");
        let mut s = spec(None, Some("nats://h"));
        s.nats.as_mut().expect("nats").credentials_file = Some("relative.creds".into());
        assert_eq!(field(validate("n", &s)), "brokers.n.nats.credentials_file");
    }
}
