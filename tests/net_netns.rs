//! Two "hosts": two network namespaces joined by a veth pair (10.99.0.1/24, 10.99.0.2/24),
//! one process in each (this binary re-executed under `ip netns exec`). The initiator picks
//! its interface with `MSCCLPP_NET_IFACE`, the target its address with `MSCCLPP_NET_ADDR`; the
//! default (loopback) endpoint must refuse the non-loopback peer with a message naming those
//! variables. Needs root and `ip`; otherwise the test says it skipped and passes.
//! The namespaces (and with them the veth pair) are deleted when the test ends.

mod common;

use common::netns::Hosts;
use common::raw::{
    fetch, initiator_rounds, progress_until_published, publish, region, target_rounds,
};
use mscclpp::config::NetConfig;
use mscclpp::error::Error;
use mscclpp::transport::net::{self, NetEndpoint};
use mscclpp::transport::Endpoint;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const WORDS: usize = (1 << 20) / 8;
const ROUNDS: u64 = 10;
const DEADLINE: Duration = Duration::from_secs(30);

fn target(dir: &Path) {
    let mut ep = net::open(None, false, None).unwrap();
    assert!(!ep.describe().ends_with("/lo"), "{}", ep.describe());
    let dst = vec![0u64; WORDS];
    let epoch = vec![0u64; 2];
    let (_, d) = ep.register(region(&dst)).unwrap();
    let (_, e) = ep.register(region(&epoch)).unwrap();
    publish(dir, "target", &[ep.address().unwrap(), d, e]);
    let ini = fetch(dir, "initiator", DEADLINE);
    let peer = ep.add_peer(0, &ini[0]).unwrap();
    let ack = ep.import(peer, &ini[1]).unwrap();
    target_rounds(&mut *ep, peer, ack, &dst, &epoch, ROUNDS, DEADLINE);
    publish(dir, "target_done", &[]);
}

fn initiator(dir: &Path) {
    let t = fetch(dir, "target", DEADLINE);
    // The default endpoint (loopback) must refuse a peer on another host, and say what to set.
    // The process's settings name the namespace's interface; the same without it is the default.
    let cfg = &mscclpp::config::get().net;
    let iface = cfg
        .iface
        .clone()
        .expect("MSCCLPP_NET_IFACE is set for this child");
    let no_iface = NetConfig {
        iface: None,
        ..cfg.clone()
    };
    let mut lo = NetEndpoint::open(None, false, None, &no_iface).unwrap();
    match lo.add_peer(1, &t[0]) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("MSCCLPP_NET_IFACE"), "{m}"),
        other => panic!("loopback endpoint accepted a remote peer: {other:?}"),
    }
    drop(lo);
    let mut ep = net::open(None, false, None).unwrap();
    assert!(
        ep.describe().ends_with(&format!("/{iface}")),
        "{}",
        ep.describe()
    );
    let mut src = vec![0u64; WORDS];
    let ackw = vec![0u64; 1];
    let (_, a) = ep.register(region(&ackw)).unwrap();
    publish(dir, "initiator", &[ep.address().unwrap(), a]);
    let peer = ep.add_peer(1, &t[0]).unwrap();
    let d = ep.import(peer, &t[1]).unwrap();
    let e = ep.import(peer, &t[2]).unwrap();
    let s = ep.register(region(&src)).unwrap().0;
    let per_round = initiator_rounds(&mut *ep, peer, (s, d, e), &mut src, &ackw, ROUNDS, DEADLINE);
    // The target flushes its last ack with a delivery marker that lands here: keep progressing
    // until it is done.
    progress_until_published(&mut *ep, dir, "target_done", DEADLINE);
    eprintln!(
        "net across namespaces ({}): {:?} per round of 1 MiB + flag + ack",
        ep.describe(),
        per_round
    );
}

/// Entry point of the re-executed roles; a no-op otherwise.
#[test]
fn netns_role() {
    let dir = match std::env::var("NET_NS_DIR") {
        Ok(d) => PathBuf::from(d),
        Err(_) => return,
    };
    match std::env::var("NET_NS_ROLE").as_deref() {
        Ok("target") => target(&dir),
        Ok("initiator") => initiator(&dir),
        other => panic!("unknown role {other:?}"),
    }
}

#[test]
fn two_namespaces_over_veth() {
    if std::env::var("NET_NS_DIR").is_ok() {
        return;
    }
    let hosts = match Hosts::create("n", "10.99.0") {
        Ok(h) => h,
        Err(e) => {
            eprintln!("skipped: cannot create network namespaces here ({e})");
            return;
        }
    };
    let id = std::process::id() % 100_000;
    let dir = std::env::temp_dir().join(format!("mscclpp-net-ns-{id}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let exe = std::env::current_exe().unwrap();
    let spawn = |netns: &str, role: &str, var: (&str, &str)| {
        Command::new("ip")
            .args(["netns", "exec", netns])
            .arg(&exe)
            .args(["--exact", "netns_role", "--nocapture", "--test-threads=1"])
            .env("NET_NS_DIR", &dir)
            .env("NET_NS_ROLE", role)
            .env("MSCCLPP_NET_PROVIDER", "tcp")
            .env(var.0, var.1)
            .spawn()
            .unwrap()
    };
    let mut t = spawn(&hosts.ns[1], "target", ("MSCCLPP_NET_ADDR", "10.99.0.2"));
    let mut i = spawn(
        &hosts.ns[0],
        "initiator",
        ("MSCCLPP_NET_IFACE", &hosts.dev[0]),
    );
    let (si, st) = (i.wait().unwrap(), t.wait().unwrap());
    let _ = std::fs::remove_dir_all(&dir);
    assert!(si.success() && st.success(), "initiator {si}, target {st}");
}
