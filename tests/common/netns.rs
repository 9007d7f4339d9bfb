//! Two "hosts" for multi-host tests: network namespaces joined by a veth pair, addresses
//! `<subnet>.1/24` and `<subnet>.2/24` only inside them. Needs root and `ip`; removed on drop
//! (also when a test fails).
#![allow(dead_code)]

use std::process::Command;

pub struct Hosts {
    pub ns: [String; 2],
    /// The veth end inside each namespace (use it as MSCCLPP_NET_IFACE / MSCCLPP_SOCKET_IFNAME).
    pub dev: [String; 2],
    /// Every veth pair (`create_pairs`), the first being `dev`.
    pub pairs: Vec<[String; 2]>,
}

pub fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("running ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Hosts {
    /// `tag` keeps the names of concurrent tests apart (a few characters: interface names are
    /// limited to 15); `subnet` is e.g. "10.99.0".
    pub fn create(tag: &str, subnet: &str) -> Result<Self, String> {
        Self::create_pairs(tag, &[subnet])
    }

    /// Namespaces joined by one veth pair per subnet ("10.98.1", "10.98.2", ...): the rails
    /// of a striped endpoint, each pair its own tcp domain.
    pub fn create_pairs(tag: &str, subnets: &[&str]) -> Result<Self, String> {
        let id = std::process::id() % 100_000;
        let pairs: Vec<[String; 2]> = (0..subnets.len())
            .map(|k| {
                let k = if k == 0 { String::new() } else { k.to_string() };
                [format!("v{tag}{id}{k}a"), format!("v{tag}{id}{k}b")]
            })
            .collect();
        let h = Hosts {
            ns: [format!("m{tag}{id}a"), format!("m{tag}{id}b")],
            dev: pairs[0].clone(),
            pairs,
        };
        // On an error, dropping `h` removes whatever exists already.
        ip(&["netns", "add", &h.ns[0]])?;
        ip(&["netns", "add", &h.ns[1]])?;
        for i in 0..2 {
            ip(&["-n", &h.ns[i], "link", "set", "lo", "up"])?;
        }
        for (pair, subnet) in h.pairs.iter().zip(subnets) {
            ip(&[
                "link", "add", &pair[0], "type", "veth", "peer", "name", &pair[1],
            ])?;
            for (i, (dev, ns)) in pair.iter().zip(&h.ns).enumerate() {
                ip(&["link", "set", dev, "netns", ns])?;
                let addr = format!("{subnet}.{}/24", i + 1);
                ip(&["-n", ns, "addr", "add", &addr, "dev", dev])?;
                ip(&["-n", ns, "link", "set", dev, "up"])?;
            }
        }
        Ok(h)
    }

    /// Sets host 0's end of the link down or up.
    pub fn link(&self, up: bool) {
        let state = if up { "up" } else { "down" };
        ip(&["-n", &self.ns[0], "link", "set", &self.dev[0], state]).unwrap();
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        // Deleting a namespace deletes its end of the veth pair, and with it the pair.
        for ns in &self.ns {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}
