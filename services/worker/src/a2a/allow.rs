//! Which remote agents a worker may reach: the allowlist of URL prefixes (`a2a.allow`),
//! the address classes refused unless explicitly allowed (`a2a.allow_private`), and
//! the one DNS resolution per call whose checked addresses the connection is pinned to.
//!
//! A URL is admitted when
//!
//! 1. it is `http://` or `https://`, without user name or password;
//! 2. an `allow` prefix covers it: the same scheme, host and port (a default port
//!    counts as written), and a path equal to the prefix's or below it (segment by
//!    segment: `/a2a` covers `/a2a/agent`, not `/a2a-admin`);
//! 3. every address it stands for is public: an IP literal as written, a host name as
//!    resolved (once, here), each address checked. Loopback, private, link-local,
//!    shared, documentation, multicast and other special-purpose addresses (IPv4 and
//!    IPv6, IPv4 addresses embedded in IPv6 ones included) are refused unless an
//!    `allow_private` entry (an address or a CIDR) covers them.
//!
//! The caller then connects to exactly the addresses checked here (see
//! `exchange::Pins`), so a name that resolves elsewhere a moment later (DNS
//! rebinding) changes nothing.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use reqwest::Url;

/// A URL prefix of `a2a.allow`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Prefix {
    /// As configured, for messages.
    shown: String,
    scheme: String,
    host: String,
    port: u16,
    /// Without a trailing `/`, except the root `/`.
    path: String,
}

impl Prefix {
    fn parse(text: &str) -> Result<Self, String> {
        let url = Url::parse(text.trim()).map_err(|e| {
            format!(
                "{text:?} is not a URL ({e}); give a URL prefix such as \
                 \"https://agents.example.com\" or \"http://127.0.0.1:9999/a2a\""
            )
        })?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(format!(
                "{text:?} must be an http:// or https:// URL prefix"
            ));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(format!(
                "{text:?} must not hold a user name or password; a profile's credential \
                 goes in a variable its `credential_env` names"
            ));
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err(format!(
                "{text:?} must not have a query or fragment: a prefix is a scheme, a host, \
                 a port and a path"
            ));
        }
        let (Some(host), Some(port)) = (url.host_str(), url.port_or_known_default()) else {
            return Err(format!("{text:?} must name a host"));
        };
        let path = match url.path().trim_end_matches('/') {
            "" => "/".to_owned(),
            p => p.to_owned(),
        };
        Ok(Self {
            shown: text.trim().to_owned(),
            scheme: url.scheme().to_owned(),
            host: host.to_owned(),
            port,
            path,
        })
    }

    fn covers(&self, url: &Url) -> bool {
        url.scheme() == self.scheme
            && url.host_str() == Some(self.host.as_str())
            && url.port_or_known_default() == Some(self.port)
            && (self.path == "/"
                || url.path() == self.path
                || url
                    .path()
                    .strip_prefix(self.path.as_str())
                    .is_some_and(|rest| rest.starts_with('/')))
    }
}

/// An address range of `a2a.allow_private`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cidr {
    net: IpAddr,
    len: u8,
}

impl Cidr {
    /// Reads `a.b.c.d`, `a.b.c.d/n`, an IPv6 address or `addr/n`.
    pub(crate) fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let (addr, len) = match text.split_once('/') {
            Some((a, l)) => (a, Some(l)),
            None => (text, None),
        };
        let net: IpAddr = addr
            .trim_matches(|c| c == '[' || c == ']')
            .parse()
            .map_err(|_| {
                format!(
                    "{text:?} is not an IP address or CIDR; write e.g. \"10.1.2.3\", \
                 \"10.1.0.0/16\", \"127.0.0.1\" or \"fd00::/8\""
                )
            })?;
        let max = if net.is_ipv4() { 32 } else { 128 };
        let len = match len {
            None => max,
            Some(l) => l
                .parse::<u8>()
                .ok()
                .filter(|l| *l <= max)
                .ok_or_else(|| format!("{text:?}: the prefix length must be 0 to {max}"))?,
        };
        Ok(Self { net, len })
    }

    /// Whether `ip` lies in the range (an IPv4 range also covers the IPv4 address an
    /// IPv6 address embeds).
    pub(crate) fn contains(&self, ip: IpAddr) -> bool {
        match (self.net, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => in_v4(ip, net, self.len),
            (IpAddr::V6(net), IpAddr::V6(ip)) => in_v6(ip, net, self.len),
            (IpAddr::V4(net), IpAddr::V6(ip)) => {
                embedded_v4(ip).is_some_and(|(v4, _)| in_v4(v4, net, self.len))
            }
            (IpAddr::V6(_), IpAddr::V4(_)) => false,
        }
    }
}

fn in_v4(ip: Ipv4Addr, net: Ipv4Addr, len: u8) -> bool {
    let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
    u32::from(ip) & mask == u32::from(net) & mask
}

fn in_v6(ip: Ipv6Addr, net: Ipv6Addr, len: u8) -> bool {
    let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
    u128::from(ip) & mask == u128::from(net) & mask
}

/// The special-purpose IPv4 ranges (RFC 6890 and successors): none is a public agent.
const V4_SPECIAL: &[([u8; 4], u8, &str)] = &[
    ([0, 0, 0, 0], 8, "a \"this network\" address (0.0.0.0/8)"),
    ([10, 0, 0, 0], 8, "a private address (10.0.0.0/8)"),
    (
        [100, 64, 0, 0],
        10,
        "a shared carrier-grade NAT address (100.64.0.0/10)",
    ),
    ([127, 0, 0, 0], 8, "a loopback address (127.0.0.0/8)"),
    (
        [169, 254, 0, 0],
        16,
        "a link-local address (169.254.0.0/16)",
    ),
    ([172, 16, 0, 0], 12, "a private address (172.16.0.0/12)"),
    (
        [192, 0, 0, 0],
        24,
        "an IETF protocol assignment (192.0.0.0/24)",
    ),
    ([192, 0, 2, 0], 24, "a documentation address (192.0.2.0/24)"),
    (
        [192, 88, 99, 0],
        24,
        "a 6to4 relay anycast address (192.88.99.0/24)",
    ),
    ([192, 168, 0, 0], 16, "a private address (192.168.0.0/16)"),
    (
        [198, 18, 0, 0],
        15,
        "a benchmarking address (198.18.0.0/15)",
    ),
    (
        [198, 51, 100, 0],
        24,
        "a documentation address (198.51.100.0/24)",
    ),
    (
        [203, 0, 113, 0],
        24,
        "a documentation address (203.0.113.0/24)",
    ),
    ([224, 0, 0, 0], 4, "a multicast address (224.0.0.0/4)"),
    (
        [240, 0, 0, 0],
        4,
        "a reserved or broadcast address (240.0.0.0/4)",
    ),
];

/// The special-purpose IPv6 ranges, but those embedding an IPv4 address (judged by
/// that address instead, see [`embedded_v4`]).
const V6_SPECIAL: &[(u128, u8, &str)] = &[
    (0, 128, "the unspecified address (::)"),
    (1, 128, "the loopback address (::1)"),
    (0, 96, "an IPv4-compatible address (::/96, deprecated)"),
    (
        0x0064_ff9b_0001_u128 << 80,
        48,
        "a local-use NAT64 address (64:ff9b:1::/48)",
    ),
    (0x0100_u128 << 112, 64, "a discard-only address (100::/64)"),
    (
        0x2001_0000_u128 << 96,
        32,
        "a Teredo tunnel address (2001::/32)",
    ),
    (
        0x2001_0002_u128 << 96,
        48,
        "a benchmarking address (2001:2::/48)",
    ),
    (
        0x2001_0db8_u128 << 96,
        32,
        "a documentation address (2001:db8::/32)",
    ),
    (
        0x3fff_u128 << 112,
        20,
        "a documentation address (3fff::/20)",
    ),
    (
        0xfc00_u128 << 112,
        7,
        "a unique local (private) address (fc00::/7)",
    ),
    (0xfe80_u128 << 112, 10, "a link-local address (fe80::/10)"),
    (
        0xfec0_u128 << 112,
        10,
        "a site-local address (fec0::/10, deprecated)",
    ),
    (0xff00_u128 << 112, 8, "a multicast address (ff00::/8)"),
];

/// The IPv4 address an IPv6 address stands for, and how it embeds it: IPv4-mapped
/// (`::ffff:a.b.c.d`), NAT64 (`64:ff9b::a.b.c.d`) or 6to4 (`2002:aabb:ccdd::/48`).
fn embedded_v4(ip: Ipv6Addr) -> Option<(Ipv4Addr, &'static str)> {
    let bits = u128::from(ip);
    let low = Ipv4Addr::from((bits & 0xffff_ffff) as u32);
    if bits >> 32 == 0xffff {
        return Some((low, "an IPv4-mapped address"));
    }
    if bits >> 32 == 0x0064_ff9b_u128 << 64 {
        return Some((low, "a NAT64 address"));
    }
    if bits >> 112 == 0x2002 {
        return Some((
            Ipv4Addr::from(((bits >> 80) & 0xffff_ffff) as u32),
            "a 6to4 address",
        ));
    }
    None
}

/// Why `ip` is not a public address, or None when it is one.
pub(crate) fn classify(ip: IpAddr) -> Option<String> {
    match ip {
        IpAddr::V4(v4) => V4_SPECIAL
            .iter()
            .find(|(net, len, _)| in_v4(v4, Ipv4Addr::from(*net), *len))
            .map(|(_, _, what)| (*what).to_owned()),
        IpAddr::V6(v6) => {
            if let Some((v4, how)) = embedded_v4(v6) {
                return classify(IpAddr::V4(v4)).map(|what| format!("{how} of {v4}, {what}"));
            }
            V6_SPECIAL
                .iter()
                .find(|(net, len, _)| in_v6(v6, Ipv6Addr::from(*net), *len))
                .map(|(_, _, what)| (*what).to_owned())
        }
    }
}

/// A URL the worker may not call, and why; the message says how to allow it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the A2A call to {url} is refused: {why}")]
pub struct Refusal {
    /// The URL, without credentials.
    pub url: String,
    /// Why, and how to allow it.
    pub why: String,
}

/// The compiled `a2a` settings: what the worker may call.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allowlist {
    prefixes: Vec<Prefix>,
    private: Vec<Cidr>,
}

impl Allowlist {
    /// The allowlist of `allow` (URL prefixes) and `allow_private` (addresses and CIDRs).
    ///
    /// # Errors
    ///
    /// An entry that does not parse, named by its key and index.
    pub fn new(allow: &[String], allow_private: &[String]) -> Result<Self, String> {
        let prefixes = allow
            .iter()
            .enumerate()
            .map(|(i, a)| Prefix::parse(a).map_err(|e| format!("a2a.allow[{i}]: {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        let private = allow_private
            .iter()
            .enumerate()
            .map(|(i, a)| Cidr::parse(a).map_err(|e| format!("a2a.allow_private[{i}]: {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { prefixes, private })
    }

    fn refuse(url: &Url, why: String) -> Refusal {
        Refusal {
            url: shown(url),
            why,
        }
    }

    /// Whether `url` may be called, as far as it can tell without DNS: the scheme, no
    /// credentials, an allowlist prefix, and an IP literal's address class.
    ///
    /// # Errors
    ///
    /// Why not, and how to allow it.
    pub fn check_url(&self, url: &Url) -> Result<(), Refusal> {
        if !matches!(url.scheme(), "http" | "https") {
            return Err(Self::refuse(
                url,
                "only http:// and https:// agents can be called".to_owned(),
            ));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(Self::refuse(
                url,
                "the URL holds a user name or password; remove it and name the variable \
                 holding the agent's bearer credential in the profile's credential_env"
                    .to_owned(),
            ));
        }
        if !self.prefixes.iter().any(|p| p.covers(url)) {
            let listed = if self.prefixes.is_empty() {
                "it is empty".to_owned()
            } else {
                format!(
                    "it lists {}",
                    self.prefixes
                        .iter()
                        .map(|p| p.shown.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            };
            let origin = match (url.host_str(), url.port_or_known_default()) {
                (Some(host), Some(port)) => format!("{}://{host}:{port}", url.scheme()),
                _ => shown(url),
            };
            return Err(Self::refuse(
                url,
                format!(
                    "it is not on the worker's A2A allowlist (a2a.allow: {listed}); add a \
                     prefix covering it to the worker configuration, e.g. a2a.allow = \
                     [\"{origin}\"]"
                ),
            ));
        }
        match host_of(url) {
            Some(Target::Ip(ip)) => self.check_ip(url, ip, None),
            Some(Target::Name(_)) => Ok(()),
            None => Err(Self::refuse(url, "the URL names no host".to_owned())),
        }
    }

    /// Whether the worker may connect to `ip` (which `name` resolved to, if it came
    /// from DNS) for `url`.
    fn check_ip(&self, url: &Url, ip: IpAddr, name: Option<&str>) -> Result<(), Refusal> {
        let Some(what) = classify(ip) else {
            return Ok(());
        };
        if self.private.iter().any(|c| c.contains(ip)) {
            return Ok(());
        }
        let subject = match name {
            Some(name) => format!("{name} resolves to {ip}, {what}"),
            None => format!("{ip} is {what}"),
        };
        Err(Self::refuse(
            url,
            format!(
                "{subject}; the worker calls such addresses only when a2a.allow_private \
                 lists them: add \"{ip}\" (or a CIDR covering it) to a2a.allow_private in \
                 the worker configuration if the agent is meant to be reached there"
            ),
        ))
    }

    /// Admits `url`: [`check_url`](Self::check_url), then the addresses to connect to,
    /// each checked: the IP literal, or every address the host name resolves to (DNS
    /// asked once, here). The caller connects to these addresses only.
    ///
    /// # Errors
    ///
    /// Why not, and how to allow it; a name that does not resolve.
    pub async fn admit(&self, url: &Url) -> Result<Vec<SocketAddr>, Refusal> {
        self.admit_with(url, &SystemDns).await
    }

    /// [`admit`](Self::admit), the host name looked up by `dns`.
    pub(crate) async fn admit_with(
        &self,
        url: &Url,
        dns: &dyn Dns,
    ) -> Result<Vec<SocketAddr>, Refusal> {
        self.check_url(url)?;
        let port = url
            .port_or_known_default()
            .ok_or_else(|| Self::refuse(url, "the URL has no port".to_owned()))?;
        let name = match host_of(url) {
            Some(Target::Ip(ip)) => return Ok(vec![SocketAddr::new(ip, port)]),
            Some(Target::Name(name)) => name,
            None => return Err(Self::refuse(url, "the URL names no host".to_owned())),
        };
        let mut addrs = dns
            .lookup(name, port)
            .await
            .map_err(|e| Self::refuse(url, format!("{name} does not resolve ({e})")))?;
        addrs.sort();
        addrs.dedup();
        if addrs.is_empty() {
            return Err(Self::refuse(url, format!("{name} resolves to no address")));
        }
        for addr in &addrs {
            self.check_ip(url, addr.ip(), Some(name))?;
        }
        Ok(addrs)
    }
}

/// Looks host names up for [`Allowlist::admit_with`].
#[async_trait::async_trait]
pub(crate) trait Dns: Send + Sync {
    /// The addresses `name` stands for, each with `port`.
    async fn lookup(&self, name: &str, port: u16) -> std::io::Result<Vec<SocketAddr>>;
}

/// The system's resolver.
pub(crate) struct SystemDns;

#[async_trait::async_trait]
impl Dns for SystemDns {
    async fn lookup(&self, name: &str, port: u16) -> std::io::Result<Vec<SocketAddr>> {
        Ok(tokio::net::lookup_host((name, port)).await?.collect())
    }
}

/// What a URL's host is.
enum Target<'a> {
    /// An IP literal (the URL parser writes every numeric IPv4 spelling as a.b.c.d).
    Ip(IpAddr),
    /// A name to resolve.
    Name(&'a str),
}

fn host_of(url: &Url) -> Option<Target<'_>> {
    let host = url.host_str()?;
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    Some(match bare.parse::<IpAddr>() {
        Ok(ip) => Target::Ip(ip),
        Err(_) => Target::Name(host),
    })
}

/// `url` as messages show it: never with a user name or password.
pub(crate) fn shown(url: &Url) -> String {
    let mut clean = url.clone();
    let _ = clean.set_username("");
    let _ = clean.set_password(None);
    clean.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn special_addresses_are_classified_and_public_ones_pass() {
        for private in [
            "127.0.0.1",
            "127.255.0.9",
            "10.0.0.1",
            "10.255.255.255",
            "172.16.0.1",
            "172.31.255.254",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "224.0.0.1",
            "255.255.255.255",
            "192.0.2.10",
            "198.18.0.1",
            "::",
            "::1",
            "fc00::1",
            "fd12:3456::1",
            "fe80::1",
            "febf::1",
            "fec0::1",
            "ff02::1",
            "2001:db8::1",
            "::ffff:127.0.0.1",
            "::ffff:10.1.2.3",
            "::ffff:169.254.169.254",
            "64:ff9b::a9fe:a9fe",
            "2002:7f00:1::1",
            "::127.0.0.1",
        ] {
            assert!(
                classify(ip(private)).is_some(),
                "{private} counted as public"
            );
        }
        for public in [
            "8.8.8.8",
            "1.1.1.1",
            "172.15.255.255",
            "172.32.0.1",
            "192.169.0.1",
            "100.63.255.255",
            "100.128.0.1",
            "169.253.255.255",
            "2606:4700::1111",
            "2a00:1450::1",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
            "2002:0808:0808::1",
        ] {
            assert_eq!(classify(ip(public)), None, "{public} counted as special");
        }
        assert_eq!(
            classify(ip("::ffff:127.0.0.1")).unwrap(),
            "an IPv4-mapped address of 127.0.0.1, a loopback address (127.0.0.0/8)"
        );
        assert_eq!(
            classify(ip("fe80::1")).unwrap(),
            "a link-local address (fe80::/10)"
        );
    }

    #[test]
    fn cidrs_cover_their_range_and_embedded_v4() {
        let one = Cidr::parse("127.0.0.1").unwrap();
        assert!(one.contains(ip("127.0.0.1")));
        assert!(!one.contains(ip("127.0.0.2")));
        assert!(one.contains(ip("::ffff:127.0.0.1")), "the same destination");
        let net = Cidr::parse("10.1.0.0/16").unwrap();
        assert!(net.contains(ip("10.1.200.3")));
        assert!(!net.contains(ip("10.2.0.1")));
        let ula = Cidr::parse("fd00::/8").unwrap();
        assert!(ula.contains(ip("fd12::1")));
        assert!(!ula.contains(ip("fc00::1")));
        assert!(!ula.contains(ip("10.1.0.1")));
        assert!(Cidr::parse("[::1]").unwrap().contains(ip("::1")));
        assert!(
            Cidr::parse("0.0.0.0/0")
                .unwrap()
                .contains(ip("192.168.0.1"))
        );
        for bad in [
            "10.0.0.0/33",
            "::/129",
            "localhost",
            "10.0.0/8",
            "10.0.0.0/x",
        ] {
            assert!(Cidr::parse(bad).is_err(), "{bad} parsed");
        }
    }

    fn url(text: &str) -> Url {
        Url::parse(text).unwrap()
    }

    #[test]
    fn prefixes_match_scheme_host_port_and_whole_path_segments() {
        let list = Allowlist::new(
            &[
                "https://agents.example.com".to_owned(),
                "https://partner.example.org:8443/a2a/".to_owned(),
            ],
            &[],
        )
        .unwrap();
        for ok in [
            "https://agents.example.com",
            "https://agents.example.com/",
            "https://AGENTS.example.com:443/any/path",
            "https://partner.example.org:8443/a2a",
            "https://partner.example.org:8443/a2a/agent/.well-known/agent-card.json",
        ] {
            list.check_url(&url(ok))
                .unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for refused in [
            "http://agents.example.com/",
            "https://agents.example.com:8443/",
            "https://evil.agents.example.com/",
            "https://agents.example.com.evil.net/",
            "https://partner.example.org:8443/a2a-admin",
            "https://partner.example.org:8443/",
            "https://partner.example.org/a2a",
            "https://partner.example.org:8443/a2a/../admin",
            "https://user:pw@agents.example.com/",
            "ftp://agents.example.com/",
        ] {
            let err = list.check_url(&url(refused)).unwrap_err();
            assert!(!err.to_string().contains("pw@"), "{err}");
        }
        let err = list
            .check_url(&url("https://other.example.net/x"))
            .unwrap_err();
        let text = err.to_string();
        assert!(text.contains("https://other.example.net/x"), "{text}");
        assert!(text.contains("a2a.allow"), "{text}");
        assert!(text.contains("https://other.example.net:443"), "{text}");

        let empty = Allowlist::default();
        let err = empty
            .check_url(&url("https://agents.example.com"))
            .unwrap_err();
        assert!(err.to_string().contains("it is empty"), "{err}");
    }

    #[test]
    fn literal_private_addresses_need_allow_private() {
        let allow = [
            "http://127.0.0.1:9999".to_owned(),
            "http://[::1]:9999".to_owned(),
        ];
        let strict = Allowlist::new(&allow, &[]).unwrap();
        let err = strict
            .check_url(&url("http://127.0.0.1:9999/"))
            .unwrap_err();
        let text = err.to_string();
        assert!(text.contains("http://127.0.0.1:9999/"), "{text}");
        assert!(text.contains("loopback"), "{text}");
        assert!(text.contains("a2a.allow_private"), "{text}");
        assert!(strict.check_url(&url("http://[::1]:9999/")).is_err());

        let loopback = Allowlist::new(&allow, &["127.0.0.1".to_owned()]).unwrap();
        loopback.check_url(&url("http://127.0.0.1:9999/")).unwrap();
        assert!(
            loopback.check_url(&url("http://[::1]:9999/")).is_err(),
            "allowing 127.0.0.1 does not allow ::1"
        );
        // Numeric host spellings are addresses all the same.
        let decimal = Allowlist::new(&["http://2130706433:9999".to_owned()], &[]).unwrap();
        assert!(decimal.check_url(&url("http://2130706433:9999/")).is_err());
    }

    #[tokio::test]
    async fn every_resolved_address_is_checked() {
        let allow = ["http://localhost:9999".to_owned()];
        let strict = Allowlist::new(&allow, &[]).unwrap();
        let err = strict
            .admit(&url("http://localhost:9999/"))
            .await
            .unwrap_err();
        let text = err.to_string();
        assert!(text.contains("localhost resolves to"), "{text}");
        assert!(text.contains("a2a.allow_private"), "{text}");

        let open = Allowlist::new(&allow, &["127.0.0.0/8".to_owned(), "::1".to_owned()]).unwrap();
        let addrs = open.admit(&url("http://localhost:9999/")).await.unwrap();
        assert!(!addrs.is_empty());
        assert!(
            addrs
                .iter()
                .all(|a| a.ip().is_loopback() && a.port() == 9999)
        );

        let literal = Allowlist::new(
            &["http://127.0.0.1:9999".to_owned()],
            &["127.0.0.1".to_owned()],
        )
        .unwrap();
        assert_eq!(
            literal
                .admit(&url("http://127.0.0.1:9999/x"))
                .await
                .unwrap(),
            ["127.0.0.1:9999".parse::<SocketAddr>().unwrap()]
        );
    }

    #[test]
    fn bad_entries_are_named() {
        let err = Allowlist::new(&["agents.example.com".to_owned()], &[]).unwrap_err();
        assert!(err.starts_with("a2a.allow[0]"), "{err}");
        let err = Allowlist::new(&["https://a:b@x.example".to_owned()], &[]).unwrap_err();
        assert!(err.contains("user name"), "{err}");
        let err = Allowlist::new(&[], &["10.0.0.0/99".to_owned()]).unwrap_err();
        assert!(err.starts_with("a2a.allow_private[0]"), "{err}");
    }
}
