//! The network transport between two processes (tcp;ofi_rxm on loopback, and shm): the test
//! re-executes its own binary as the peer (`NET_TP_ROLE=child`), and the two exchange their
//! address and region blobs through files in a private directory. Each round the parent writes
//! 1 MiB and a flag; the child waits for the flag, checks every byte, and acknowledges with a
//! flag write back; so both directions, ordering and flush are exercised across processes.

mod common;

use common::raw::{fetch, initiator_rounds, publish, region, target_rounds, wait_for};
use mscclpp::transport::net;
use mscclpp::transport::Endpoint;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const WORDS: usize = (1 << 20) / 8;
const ROUNDS: u64 = 20;
const DEADLINE: Duration = Duration::from_secs(30);

fn open(shm: bool) -> Box<dyn Endpoint> {
    if shm {
        net::open(None, true, None)
    } else {
        net::open(Some("lo"), false, None)
    }
    .unwrap()
}

/// The peer process: target of the data, initiator of the acknowledgements.
fn child(dir: &Path, shm: bool) {
    let mut ep = open(shm);
    let dst = vec![0u64; WORDS];
    let epoch = vec![0u64; 2];
    let (_, dblob) = ep.register(region(&dst)).unwrap();
    let (_, eblob) = ep.register(region(&epoch)).unwrap();
    publish(dir, "child", &[ep.address().unwrap(), dblob, eblob]);
    let parent = fetch(dir, "parent", DEADLINE);
    let peer = ep.add_peer(0, &parent[0]).unwrap();
    let ack = ep.import(peer, &parent[1]).unwrap();
    target_rounds(&mut *ep, peer, ack, &dst, &epoch, ROUNDS, DEADLINE);
}

fn parent(shm: bool) {
    let dir: PathBuf = std::env::temp_dir().join(format!(
        "mscclpp-net-tp-{}-{}",
        std::process::id(),
        if shm { "shm" } else { "tcp" }
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut kid = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env("NET_TP_ROLE", "child")
        .env("NET_TP_DIR", &dir)
        .env("NET_TP_SHM", if shm { "1" } else { "0" })
        .spawn()
        .unwrap();
    let mut ep = open(shm);
    let mut src = vec![0u64; WORDS];
    let ackw = vec![0u64; 1];
    let (_, ablob) = ep.register(region(&ackw)).unwrap();
    publish(&dir, "parent", &[ep.address().unwrap(), ablob]);
    let c = fetch(&dir, "child", DEADLINE);
    let peer = ep.add_peer(1, &c[0]).unwrap();
    let d = ep.import(peer, &c[1]).unwrap();
    let e = ep.import(peer, &c[2]).unwrap();
    let s = ep.register(region(&src)).unwrap().0;
    let per_round = initiator_rounds(&mut *ep, peer, (s, d, e), &mut src, &ackw, ROUNDS, DEADLINE);
    eprintln!(
        "net two-process {}: {ROUNDS} rounds of 1 MiB + flag + ack, {per_round:?} per round",
        ep.describe()
    );
    // The child flushes its last ack with a delivery marker that lands here: progress until it
    // has finished (software providers move data only while the target progresses).
    let t1 = Instant::now();
    let status = loop {
        if let Some(st) = kid.try_wait().unwrap() {
            break st;
        }
        assert!(
            t1.elapsed() < Duration::from_secs(60),
            "child did not finish"
        );
        ep.progress().unwrap();
        std::thread::yield_now();
    };
    let _ = std::fs::remove_dir_all(&dir);
    assert!(status.success(), "child failed: {status}");
}

/// The child's entry point; a no-op unless started by `parent` or `latency`.
#[test]
fn child_entry() {
    let dir = || PathBuf::from(std::env::var("NET_TP_DIR").unwrap());
    let shm = std::env::var("NET_TP_SHM").as_deref() == Ok("1");
    match std::env::var("NET_TP_ROLE").as_deref() {
        Ok("child") => child(&dir(), shm),
        Ok("pp_child") => pingpong(&dir(), shm, false),
        _ => {}
    }
}

const PP_ROUNDS: u64 = 20_000;

/// 8-byte put + flag, answered by the same: the transport's own half round trip (no proxy
/// threads). `parent` side measures; both sides poll their memory and progress their CQ.
fn pingpong(dir: &Path, shm: bool, parent: bool) {
    let mut ep = open(shm);
    let mine = vec![0u64; 16];
    let (_, blob) = ep.register(region(&mine)).unwrap();
    let (me, other) = if parent {
        ("pp_parent", "pp_child")
    } else {
        ("pp_child", "pp_parent")
    };
    publish(dir, me, &[ep.address().unwrap(), blob]);
    let o = fetch(dir, other, DEADLINE);
    let peer = ep.add_peer(usize::from(parent), &o[0]).unwrap();
    let theirs = ep.import(peer, &o[1]).unwrap();
    let src = vec![0u64; 1];
    let s = ep.register(region(&src)).unwrap().0;
    let mut lat = Vec::with_capacity(PP_ROUNDS as usize);
    for r in 1..=PP_ROUNDS {
        let t = Instant::now();
        if parent {
            ep.write(peer, s, 0, theirs, 0, 8).unwrap();
            ep.write_value(peer, theirs, 64, r).unwrap();
        }
        wait_for(&mut *ep, &mine, 8, r, "ping-pong", DEADLINE);
        if !parent {
            ep.write(peer, s, 0, theirs, 0, 8).unwrap();
            ep.write_value(peer, theirs, 64, r).unwrap();
        }
        lat.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
    }
    ep.flush(peer).unwrap();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(200) {
        ep.progress().unwrap();
    }
    if parent {
        lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
        eprintln!(
            "{}: 8 B put + flag half round trip through the Endpoint: median {:.2} us, p10 {:.2} us, p99 {:.2} us ({PP_ROUNDS} rounds)",
            ep.describe(),
            lat[lat.len() / 2],
            lat[lat.len() / 10],
            lat[lat.len() * 99 / 100]
        );
    }
}

/// Latency measurement, not a correctness test: `cargo test --release --test net_two_process
/// -- --ignored --nocapture` (MSCCLPP_NET_DELIVERY_COMPLETE=0 to compare without it).
#[test]
#[ignore]
fn latency() {
    for shm in [false, true] {
        let dir = std::env::temp_dir().join(format!("mscclpp-net-pp-{}-{shm}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut kid = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
            .env("NET_TP_ROLE", "pp_child")
            .env("NET_TP_DIR", &dir)
            .env("NET_TP_SHM", if shm { "1" } else { "0" })
            .spawn()
            .unwrap();
        pingpong(&dir, shm, true);
        assert!(kid.wait().unwrap().success());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn two_processes_tcp() {
    if std::env::var("NET_TP_ROLE").is_ok() {
        return;
    }
    parent(false);
}

#[test]
fn two_processes_shm() {
    if std::env::var("NET_TP_ROLE").is_ok() {
        return;
    }
    parent(true);
}
