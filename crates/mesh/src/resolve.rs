//! Endpoints whose host name stands for several replicas.
//!
//! In a cluster a service's replicas sit behind one DNS name (a headless Service
//! resolves to every ready pod). A single HTTP/2 connection would pin a client to one of
//! them, so a [`channel`](crate::handles::channel) to a host name resolves it to every
//! address, re-resolves it every [`RESOLVE_INTERVAL`], and spreads calls over the
//! addresses with tower's power-of-two-choices balancer (fewest requests in flight of two
//! picked at random). The worker's registration uses the same resolution to register
//! with every supervisor replica.
//!
//! IP literals and `localhost` name one process and are used as given.

use std::collections::BTreeSet;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tonic::transport::Uri;

/// How often a host name is resolved again once it has resolved.
pub const RESOLVE_INTERVAL: Duration = Duration::from_secs(10);

/// How often a host name that has not resolved yet (or resolved to nothing) is tried
/// again: pods start before their peers' DNS records exist.
pub const RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// Resolves `host:port` to socket addresses; [`dns`] in production, a fixed answer in
/// tests.
pub type Resolver = Arc<
    dyn Fn(String, u16) -> Pin<Box<dyn Future<Output = io::Result<Vec<SocketAddr>>> + Send>>
        + Send
        + Sync,
>;

/// The system resolver (`getaddrinfo`, through tokio).
pub fn dns() -> Resolver {
    Arc::new(|host, port| {
        Box::pin(async move {
            Ok(tokio::net::lookup_host((host.as_str(), port))
                .await?
                .collect())
        })
    })
}

/// The parts of an endpoint URL that resolution needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Named {
    /// `http` or `https`.
    pub scheme: String,
    /// The host name to resolve.
    pub host: String,
    /// The port (the scheme's default when the URL names none).
    pub port: u16,
}

impl Named {
    /// The endpoint URL of one resolved address, e.g. `http://10.0.3.7:7400`.
    pub fn url_of(&self, addr: SocketAddr) -> String {
        format!("{}://{addr}", self.scheme)
    }
}

/// The host name in `url` when it stands for replicas to resolve; `None` for an IP
/// literal, `localhost`, `https` (its certificate names the host, not an address) or a
/// URL that does not parse (the caller reports that).
pub fn named(url: &str) -> Option<Named> {
    let uri: Uri = url.parse().ok()?;
    let scheme = uri.scheme_str()?.to_ascii_lowercase();
    if scheme != "http" {
        return None;
    }
    let host = uri.host()?.trim_start_matches('[').trim_end_matches(']');
    if host.parse::<IpAddr>().is_ok() || host.eq_ignore_ascii_case("localhost") {
        return None;
    }
    Some(Named {
        port: uri.port_u16().unwrap_or(80),
        host: host.to_owned(),
        scheme,
    })
}

/// What changed between two resolutions of one name.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Diff {
    /// Addresses new in this answer.
    pub added: Vec<SocketAddr>,
    /// Addresses the answer no longer holds.
    pub removed: Vec<SocketAddr>,
}

/// Resolves `name` once and tells what changed against `known`, which it updates. A
/// failed resolution or an empty answer changes nothing (a DNS hiccup must not drop
/// every replica); it is returned as the error.
///
/// # Errors
///
/// The resolver's error, or `NotFound` for an empty answer.
pub async fn refresh(
    resolver: &Resolver,
    name: &Named,
    known: &mut BTreeSet<SocketAddr>,
) -> io::Result<Diff> {
    let answer: BTreeSet<SocketAddr> = resolver(name.host.clone(), name.port)
        .await?
        .into_iter()
        .collect();
    if answer.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("{} resolved to no address", name.host),
        ));
    }
    let diff = Diff {
        added: answer.difference(known).copied().collect(),
        removed: known.difference(&answer).copied().collect(),
    };
    *known = answer;
    Ok(diff)
}

/// A host name followed over time: what it resolved to last and whether it is failing,
/// so each change and each failure is logged once.
#[derive(Debug)]
pub struct Followed {
    /// The name.
    pub name: Named,
    /// What it resolved to last.
    pub known: BTreeSet<SocketAddr>,
    failing: bool,
}

impl Followed {
    /// `name`, not resolved yet.
    pub fn new(name: Named) -> Self {
        Self {
            name,
            known: BTreeSet::new(),
            failing: false,
        }
    }

    /// Resolves the name again: what changed, or `None` when it failed (the last answer
    /// stands). `what` says in the logs what the addresses are.
    pub async fn refresh(&mut self, resolver: &Resolver, what: &str) -> Option<Diff> {
        match refresh(resolver, &self.name, &mut self.known).await {
            Ok(diff) => {
                if self.failing || !diff.added.is_empty() || !diff.removed.is_empty() {
                    tracing::info!(host = %self.name.host, addresses = ?self.known, "{what}");
                }
                self.failing = false;
                Some(diff)
            }
            Err(e) => {
                if !self.failing {
                    tracing::warn!(host = %self.name.host, error = %e, "cannot resolve the host of {what}; trying again");
                }
                self.failing = true;
                None
            }
        }
    }

    /// How long to wait before the next refresh: `every`, or [`RETRY_INTERVAL`] while the
    /// name has never resolved.
    pub fn next_in(&self, every: Duration) -> Duration {
        if self.known.is_empty() {
            RETRY_INTERVAL.min(every)
        } else {
            every
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixed(answers: Vec<Vec<&'static str>>) -> Resolver {
        let answers = Arc::new(std::sync::Mutex::new(answers.into_iter()));
        Arc::new(move |_, port| {
            let next = answers.lock().unwrap().next().unwrap_or_default();
            Box::pin(async move {
                Ok(next
                    .iter()
                    .map(|ip| SocketAddr::new(ip.parse().unwrap(), port))
                    .collect())
            })
        })
    }

    #[test]
    fn only_http_host_names_are_resolved() {
        let n = named("http://convene-supervisor-peers:7400").unwrap();
        assert_eq!(n.host, "convene-supervisor-peers");
        assert_eq!(n.port, 7400);
        assert_eq!(
            n.url_of("10.0.0.7:7400".parse().unwrap()),
            "http://10.0.0.7:7400"
        );
        assert_eq!(named("http://policy").unwrap().port, 80);
        for literal in [
            "http://127.0.0.1:7400",
            "http://[::1]:7400",
            "http://localhost:7400",
            "https://supervisor.example.com",
            "not a url",
        ] {
            assert_eq!(named(literal), None, "{literal}");
        }
    }

    #[tokio::test]
    async fn a_refresh_reports_what_came_and_went_and_a_failure_keeps_the_last_answer() {
        let resolver = fixed(vec![
            vec!["10.0.0.1", "10.0.0.2"],
            vec!["10.0.0.2", "10.0.0.3"],
            vec![],
        ]);
        let name = named("http://peers:7400").unwrap();
        let mut known = BTreeSet::new();
        let first = refresh(&resolver, &name, &mut known).await.unwrap();
        assert_eq!(first.added.len(), 2);
        assert!(first.removed.is_empty());
        let second = refresh(&resolver, &name, &mut known).await.unwrap();
        assert_eq!(second.added, vec!["10.0.0.3:7400".parse().unwrap()]);
        assert_eq!(second.removed, vec!["10.0.0.1:7400".parse().unwrap()]);
        let empty = refresh(&resolver, &name, &mut known).await.unwrap_err();
        assert!(empty.to_string().contains("no address"), "{empty}");
        assert_eq!(known.len(), 2, "an empty answer keeps the last one");
    }
}
