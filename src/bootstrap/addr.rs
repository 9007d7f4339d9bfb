//! Root addresses: parsing `ip:port` / `[v6]:port` / `host:port`, name resolution, and the
//! choice of a local interface for `mscclppGetUniqueId`.

use std::ffi::{CStr, CString};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6, ToSocketAddrs};

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Host {
    /// A literal address; the u32 is the IPv6 scope id (0 when none).
    Ip(IpAddr, u32),
    Name(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Target {
    pub host: Host,
    pub port: u16,
}

/// Parses a root address without touching the network. The error says what is wrong.
pub(crate) fn parse(s: &str) -> Result<Target, String> {
    if s.is_empty() {
        return Err("empty address (expected ip:port, [ipv6]:port or host:port)".into());
    }
    if s.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("{s:?} contains whitespace or control characters"));
    }
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (inside, after) = rest
            .split_once(']')
            .ok_or_else(|| format!("{s:?}: '[' without a closing ']'"))?;
        let port = after
            .strip_prefix(':')
            .ok_or_else(|| format!("{s:?}: missing :port after ']'"))?;
        let (ip, scope) = match inside.split_once('%') {
            Some((ip, scope)) => (ip, parse_scope(scope).map_err(|e| format!("{s:?}: {e}"))?),
            None => (inside, 0),
        };
        let ip: Ipv6Addr = ip
            .parse()
            .map_err(|_| format!("{s:?}: {ip:?} is not an IPv6 address"))?;
        (Host::Ip(IpAddr::V6(ip), scope), port)
    } else {
        let (host, port) = s
            .rsplit_once(':')
            .ok_or_else(|| format!("{s:?}: missing :port"))?;
        if host.contains(':') {
            return Err(format!(
                "{s:?}: an IPv6 address needs brackets, as in [::1]:5000"
            ));
        }
        (parse_host(host).map_err(|e| format!("{s:?}: {e}"))?, port)
    };
    let port = parse_port(port).map_err(|e| format!("{s:?}: {e}"))?;
    Ok(Target { host, port })
}

fn parse_port(p: &str) -> Result<u16, String> {
    if p.is_empty() {
        return Err("missing port number after ':'".into());
    }
    if p.len() > 5 || !p.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("port {p:?} is not a number in 1..=65535"));
    }
    match p.parse::<u32>() {
        Ok(n) if (1..=65535).contains(&n) => Ok(n as u16),
        _ => Err(format!("port {p} is outside 1..=65535")),
    }
}

fn parse_host(h: &str) -> Result<Host, String> {
    if h.is_empty() {
        return Err("missing host before ':'".into());
    }
    if let Ok(ip) = h.parse::<Ipv4Addr>() {
        return Ok(Host::Ip(IpAddr::V4(ip), 0));
    }
    if h.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return Err(format!("{h:?} is not a valid IPv4 address"));
    }
    if h.len() > 253 {
        return Err("host name longer than 253 characters".into());
    }
    for label in h.trim_end_matches('.').split('.') {
        let ok_chars = label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if label.is_empty() || label.len() > 63 || !ok_chars || label.starts_with('-') {
            return Err(format!("{h:?} is not a valid host name"));
        }
    }
    Ok(Host::Name(h.to_owned()))
}

/// An IPv6 zone: a number or an interface name.
fn parse_scope(z: &str) -> Result<u32, String> {
    if let Ok(n) = z.parse::<u32>() {
        return Ok(n);
    }
    let c = CString::new(z).map_err(|_| format!("bad IPv6 zone {z:?}"))?;
    // SAFETY: `c` is a valid NUL-terminated string for the duration of the call.
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if idx == 0 {
        return Err(format!("IPv6 zone {z:?} names no interface"));
    }
    Ok(idx)
}

/// The addresses `t` stands for, IPv4 first (the root binds the first; clients try all in
/// turn, so both sides agree when a name resolves to both families).
pub(crate) fn resolve(t: &Target) -> io::Result<Vec<SocketAddr>> {
    let mut v: Vec<SocketAddr> = match &t.host {
        Host::Ip(IpAddr::V6(ip), scope) => {
            vec![SocketAddr::V6(SocketAddrV6::new(*ip, t.port, 0, *scope))]
        }
        Host::Ip(ip, _) => vec![SocketAddr::new(*ip, t.port)],
        Host::Name(n) => (n.as_str(), t.port).to_socket_addrs()?.collect(),
    };
    v.sort_by_key(|a| a.is_ipv6());
    v.dedup();
    if v.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            "name resolved to no address",
        ));
    }
    Ok(v)
}

/// One address of a local interface.
#[derive(Clone, Debug)]
pub(crate) struct Iface {
    pub name: String,
    pub ip: IpAddr,
    pub scope: u32,
    pub up: bool,
    pub loopback: bool,
}

/// Every address of every local interface (getifaddrs).
pub(crate) fn interfaces() -> io::Result<Vec<Iface>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head into `head`; it is freed below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut cur = head;
    // Ends at the list's NULL terminator.
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, still allocated.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: ifa_addr is non-NULL and points at a sockaddr of at least its family's size.
        let family = unsafe { (*ifa.ifa_addr).sa_family } as i32;
        let (ip, scope) = match family {
            libc::AF_INET => {
                // SAFETY: the family says this is a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                (
                    IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))),
                    0,
                )
            }
            libc::AF_INET6 => {
                // SAFETY: the family says this is a sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                (
                    IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)),
                    sin6.sin6_scope_id,
                )
            }
            _ => continue,
        };
        let flags = ifa.ifa_flags;
        out.push(Iface {
            name,
            ip,
            scope,
            up: flags & libc::IFF_UP as u32 != 0,
            loopback: flags & libc::IFF_LOOPBACK as u32 != 0 || ip.is_loopback(),
        });
    }
    // SAFETY: `head` came from getifaddrs and is freed once; no reference into it survives.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

fn is_link_local(ip: &IpAddr) -> bool {
    matches!(ip, IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80)
}

/// IPv4 before global IPv6 before link-local IPv6.
fn family_rank(ip: &IpAddr) -> u8 {
    match ip {
        IpAddr::V4(_) => 0,
        _ if is_link_local(ip) => 2,
        _ => 1,
    }
}

/// Picks the address for a unique id. `spec` is `MSCCLPP_SOCKET_IFNAME`: comma-separated
/// interface name prefixes; a leading `=` makes them exact names, a leading `^` excludes them.
/// Without it: the first up non-loopback IPv4 interface, else IPv4 loopback.
pub(crate) fn choose(ifaces: &[Iface], spec: Option<&str>) -> Result<(IpAddr, u32), String> {
    let Some(spec) = spec else {
        return Ok(ifaces
            .iter()
            .find(|i| i.up && !i.loopback && i.ip.is_ipv4())
            .map(|i| (i.ip, 0))
            .unwrap_or((IpAddr::V4(Ipv4Addr::LOCALHOST), 0)));
    };
    let (exclude, rest) = match spec.strip_prefix('^') {
        Some(r) => (true, r),
        None => (false, spec),
    };
    let (exact, rest) = match rest.strip_prefix('=') {
        Some(r) => (true, r),
        None => (false, rest),
    };
    let names: Vec<&str> = rest
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .collect();
    if names.is_empty() {
        return Err(format!("MSCCLPP_SOCKET_IFNAME={spec:?} names no interface"));
    }
    let listed = |n: &str| {
        names
            .iter()
            .any(|p| if exact { n == *p } else { n.starts_with(p) })
    };
    let mut cands: Vec<&Iface> = ifaces
        .iter()
        .filter(|i| i.up && listed(&i.name) != exclude)
        .collect();
    // Stable: among equals, the system's interface order decides.
    cands.sort_by_key(|i| (exclude && i.loopback, family_rank(&i.ip)));
    match cands.first() {
        Some(i) => Ok((i.ip, if is_link_local(&i.ip) { i.scope } else { 0 })),
        None => {
            let mut have: Vec<&str> = ifaces.iter().map(|i| i.name.as_str()).collect();
            have.dedup();
            Err(format!(
                "no up interface with an address matches MSCCLPP_SOCKET_IFNAME={spec:?} (interfaces: {})",
                have.join(", ")
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(t: &str, port: u16) -> Target {
        Target {
            host: Host::Ip(t.parse().unwrap(), 0),
            port,
        }
    }

    #[test]
    fn parses_good_addresses() {
        assert_eq!(parse("127.0.0.1:5000").unwrap(), ip("127.0.0.1", 5000));
        assert_eq!(parse("[::1]:1").unwrap(), ip("::1", 1));
        assert_eq!(parse("10.0.0.1:65535").unwrap(), ip("10.0.0.1", 65535));
        assert_eq!(
            parse("[fe80::1%3]:80").unwrap(),
            Target {
                host: Host::Ip("fe80::1".parse().unwrap(), 3),
                port: 80
            }
        );
        assert_eq!(
            parse("node-1.cluster_a.local:80").unwrap(),
            Target {
                host: Host::Name("node-1.cluster_a.local".into()),
                port: 80
            }
        );
        assert_eq!(
            parse("localhost:1234").unwrap().host,
            Host::Name("localhost".into())
        );
    }

    #[test]
    fn rejects_malformed_addresses() {
        for bad in [
            "",
            "127.0.0.1",
            "127.0.0.1:",
            ":5000",
            "127.0.0.1:0",
            "127.0.0.1:65536",
            "127.0.0.1:99999999",
            "127.0.0.1:-1",
            "127.0.0.1:+80",
            "127.0.0.1:abc",
            "::1:5000",
            "[::1]",
            "[::1]5000",
            "[::1:5000",
            "[zz]:5000",
            "[127.0.0.1]:5000",
            "[fe80::1%nosuchif0]:80",
            "256.1.1.1:80",
            "1.2.3:80",
            "host name:80",
            " 127.0.0.1:80",
            "127.0.0.1:80\n",
            "http://x:80",
            "a..b:80",
            "-a:80",
            "a/b:80",
        ] {
            assert!(parse(bad).is_err(), "{bad:?} parsed as {:?}", parse(bad));
        }
    }

    fn iface(name: &str, ip: &str, up: bool) -> Iface {
        let ip: IpAddr = ip.parse().unwrap();
        Iface {
            name: name.into(),
            ip,
            scope: 9,
            up,
            loopback: ip.is_loopback(),
        }
    }

    #[test]
    fn chooses_interfaces() {
        let l = vec![
            iface("lo", "127.0.0.1", true),
            iface("lo", "::1", true),
            iface("eth0", "fe80::1", true),
            iface("eth0", "fd00::2", true),
            iface("eth1", "10.0.0.2", false),
            iface("eth2", "10.0.1.2", true),
            iface("ib0", "192.168.0.2", true),
        ];
        let pick = |s: Option<&str>| choose(&l, s).map(|(ip, sc)| (ip.to_string(), sc));
        assert_eq!(pick(None).unwrap(), ("10.0.1.2".into(), 0));
        assert_eq!(pick(Some("ib")).unwrap(), ("192.168.0.2".into(), 0));
        assert_eq!(pick(Some("eth0")).unwrap(), ("fd00::2".into(), 0));
        assert_eq!(pick(Some("=lo")).unwrap(), ("127.0.0.1".into(), 0));
        assert_eq!(pick(Some("^eth,ib")).unwrap(), ("127.0.0.1".into(), 0));
        assert_eq!(pick(Some("^lo,eth2")).unwrap(), ("192.168.0.2".into(), 0));
        assert!(pick(Some("=eth")).is_err());
        assert!(pick(Some("eth1")).is_err(), "eth1 is down");
        assert!(pick(Some("")).is_err());
        let ll = vec![
            iface("lo", "127.0.0.1", true),
            iface("eth0", "fe80::1", true),
        ];
        assert_eq!(
            choose(&ll, Some("eth0")).unwrap(),
            ("fe80::1".parse().unwrap(), 9)
        );
        assert_eq!(
            choose(&ll, None).unwrap(),
            ("127.0.0.1".parse().unwrap(), 0),
            "no non-loopback IPv4: loopback"
        );
    }

    #[test]
    fn reads_real_interfaces() {
        let l = interfaces().unwrap();
        assert!(l.iter().any(|i| i.loopback), "{l:?}");
    }

    #[test]
    fn resolves_v4_first() {
        let v = resolve(&parse("localhost:80").unwrap()).unwrap();
        assert!(!v.is_empty());
        assert!(v.iter().all(|a| a.port() == 80 && a.ip().is_loopback()));
        assert_eq!(
            resolve(&ip("::1", 7)).unwrap(),
            vec!["[::1]:7".parse().unwrap()]
        );
    }
}
