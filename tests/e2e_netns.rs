//! Two "hosts": ranks in two network namespaces joined by a veth pair, addresses only inside
//! them, bootstrap and data over libfabric's tcp provider. Needs root (CI has it); elsewhere the
//! test prints why it is skipped.

mod common;

use common::api::*;
use common::*;
use mscclpp::capi::comm::*;
use mscclpp::capi::conn::*;
use std::process::Command;
use std::time::Duration;

const NAME: &str = "two_hosts_over_veth_tcp";
const BYTES: usize = 4 << 20;

/// Two namespaces with a veth pair; removed on drop (also when the test fails).
struct Hosts {
    ns: [String; 2],
}

fn ip(args: &[&str]) -> Result<(), String> {
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
    fn create() -> Result<Self, String> {
        let id = std::process::id() % 100_000;
        let h = Hosts {
            ns: [format!("msc{id}a"), format!("msc{id}b")],
        };
        let (va, vb) = (format!("mv{id}a"), format!("mv{id}b"));
        ip(&["netns", "add", &h.ns[0]])?;
        ip(&["netns", "add", &h.ns[1]])?;
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
        ip(&["link", "set", &va, "netns", &h.ns[0]])?;
        ip(&["link", "set", &vb, "netns", &h.ns[1]])?;
        for (ns, dev, addr) in [
            (&h.ns[0], &va, "10.99.0.1/24"),
            (&h.ns[1], &vb, "10.99.0.2/24"),
        ] {
            ip(&["-n", ns, "addr", "add", addr, "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(h)
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

fn rank_body() {
    let (rank, n, root) = (
        env_usize("MSCCLPP_TEST_RANK"),
        env_usize("MSCCLPP_TEST_NRANKS"),
        std::env::var("MSCCLPP_TEST_ROOT").unwrap(),
    );
    let c = init(&root, rank, n);
    let mut buf = vec![0u8; 2 * BYTES];
    for i in 0..BYTES {
        buf[rank * BYTES + i] = pattern(rank, i);
    }
    let peer = 1 - rank;
    ok(connect(c, peer, 0, &mut buf));
    ok(mscclppConnectionSetup(c));
    ok(mscclppProxyLaunch(c));
    let d = &mut dev_conns(c)[0];
    let off = (rank * BYTES) as u64;
    put_signal(d, off, off, BYTES as u64);
    flush(d);
    wait(d);
    for i in 0..BYTES {
        assert_eq!(
            buf[peer * BYTES + i],
            pattern(peer, i),
            "byte {i} from rank {peer}"
        );
    }
    ok(mscclppBootstrapBarrier(c));
    ok(mscclppProxyStop(c));
    ok(mscclppCommDestroy(c));
}

#[test]
fn two_hosts_over_veth_tcp() {
    if is_rank(NAME) {
        return rank_body();
    }
    let hosts = match Hosts::create() {
        Ok(h) => h,
        Err(e) => {
            println!("SKIPPED {NAME}: cannot create network namespaces here ({e})");
            return;
        }
    };
    let id = std::process::id() % 100_000;
    let ifs = [format!("mv{id}a"), format!("mv{id}b")];
    let root = "10.99.0.1:29517";
    let env = [
        ("MSCCLPP_TEST_TRANSPORT", "tcp".to_string()),
        ("MSCCLPP_NET_PROVIDER", "tcp".to_string()),
        ("MSCCLPP_BOOTSTRAP_TIMEOUT", "20".to_string()),
    ];
    let ranks = spawn_wrapped(NAME, 2, root, &env, |r| {
        vec![
            "ip".into(),
            "netns".into(),
            "exec".into(),
            hosts.ns[r].clone(),
            "env".into(),
            format!("MSCCLPP_NET_IFACE={}", ifs[r]),
            format!("MSCCLPP_SOCKET_IFNAME={}", ifs[r]),
        ]
    });
    ranks.expect_success(Duration::from_secs(120));
    drop(hosts);
}
