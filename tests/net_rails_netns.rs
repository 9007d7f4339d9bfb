//! Striping over several NICs between two "hosts": two network namespaces joined by 2 or 4
//! veth pairs, each pair its own tcp domain (a rail), one process in each (this binary
//! re-executed under `ip netns exec`). Every byte is checked, every rail must carry its share
//! (the rails' counters), and a rail taken down mid-stream must fail the next signal with an
//! error naming that rail within the wait timeout. Needs root and `ip`; otherwise each test
//! says it skipped and passes. The namespaces go when the test ends.

mod common;

use common::netns::{ip, Hosts};
use common::raw::{
    fetch, initiator_rounds, pattern, progress_until_published, publish, region, target_rounds,
    wait_for,
};
use mscclpp::error::Error;
use mscclpp::transport::net::Rails;
use mscclpp::transport::Endpoint;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// 16 MiB per round: 16 chunks of the default 1 MiB stripe.
const WORDS: usize = (16 << 20) / 8;
const ROUNDS: u64 = 4;
const DEADLINE: Duration = Duration::from_secs(60);
/// `MSCCLPP_WAIT_TIMEOUT` of the rail-down run.
const DOWN_TIMEOUT_S: u64 = 3;
/// Rounds before the rail goes down.
const GOOD_ROUNDS: u64 = 2;

fn rails_of(var: &str) -> Vec<String> {
    std::env::var(var)
        .unwrap()
        .split('+')
        .map(str::to_string)
        .collect()
}

fn open() -> Rails {
    let names = rails_of("NET_RAILS");
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    Rails::open(&names, None, &mscclpp::config::get().net).unwrap()
}

fn target(dir: &Path, rounds: u64) {
    let mut ep = open();
    let dst = vec![0u64; WORDS];
    let epoch = vec![0u64; 2];
    let (_, d) = ep.register(region(&dst)).unwrap();
    let (_, e) = ep.register(region(&epoch)).unwrap();
    publish(dir, "target", &[ep.address().unwrap(), d, e]);
    let ini = fetch(dir, "initiator", DEADLINE);
    let peer = ep.add_peer(0, &ini[0]).unwrap();
    let ack = ep.import(peer, &ini[1]).unwrap();
    target_rounds(&mut ep, peer, ack, &dst, &epoch, rounds, DEADLINE);
    publish(dir, "target_done", &[]);
    // The rail-down run: stay until the initiator has seen its error.
    if rounds == GOOD_ROUNDS {
        fetch(dir, "done", DEADLINE);
    }
}

fn initiator(dir: &Path, down: bool) {
    let t = fetch(dir, "target", DEADLINE);
    let mut ep = open();
    let n = ep.rail_stats().len();
    let mut src = vec![0u64; WORDS];
    let ackw = vec![0u64; 1];
    let (_, a) = ep.register(region(&ackw)).unwrap();
    publish(dir, "initiator", &[ep.address().unwrap(), a]);
    let peer = ep.add_peer(1, &t[0]).unwrap();
    let d = ep.import(peer, &t[1]).unwrap();
    let e = ep.import(peer, &t[2]).unwrap();
    let s = ep.register(region(&src)).unwrap().0;
    let rounds = if down { GOOD_ROUNDS } else { ROUNDS };
    let per_round = initiator_rounds(&mut ep, peer, (s, d, e), &mut src, &ackw, rounds, DEADLINE);
    let bytes = (WORDS * 8) as u64;
    eprintln!(
        "{} rails ({}): {per_round:?} per round of 16 MiB + flag + ack, {:.2} GB/s",
        n,
        ep.describe(),
        bytes as f64 / per_round.as_secs_f64() / 1e9
    );
    // Every rail carried its share of every round: 16 chunks over n rails.
    for (r, st) in ep.rail_stats().iter().enumerate() {
        assert_eq!(st.bytes, rounds * bytes / n as u64, "rail {r}: {st:?}");
    }
    if down {
        let rails = rails_of("NET_RAILS");
        ip(&["link", "set", &rails[1], "down"]).unwrap();
        for (i, w) in src.iter_mut().enumerate() {
            *w = pattern(rounds + 1, i);
        }
        let t0 = Instant::now();
        let r = ep
            .write(peer, s, 0, d, 0, bytes)
            .and_then(|_| ep.write_value(peer, e, 8, rounds + 1))
            .and_then(|_| ep.flush(peer));
        let took = t0.elapsed();
        match r {
            Err(Error::Timeout { what, .. }) => {
                let want = format!("rail 1 of {n} ({})", rails[1]);
                assert!(what.contains(&want), "the error must name {want}: {what}");
                eprintln!("rail down after {took:?}: timed out: {what}");
            }
            other => panic!("a put over a rail that is down returned {other:?}"),
        }
        assert!(
            took < Duration::from_secs(DOWN_TIMEOUT_S + 5),
            "the error took {took:?}, the wait timeout is {DOWN_TIMEOUT_S} s"
        );
        publish(dir, "done", &[]);
        return;
    }
    // The target's last acks' markers land here: progress until it is done.
    wait_for(&mut ep, &ackw, 0, rounds, "last ack", DEADLINE);
    progress_until_published(&mut ep, dir, "target_done", DEADLINE);
}

/// Entry point of the re-executed roles; a no-op otherwise.
#[test]
fn rails_role() {
    let dir = match std::env::var("NET_NS_DIR") {
        Ok(d) => PathBuf::from(d),
        Err(_) => return,
    };
    let down = std::env::var("NET_NS_DOWN").is_ok();
    match std::env::var("NET_NS_ROLE").as_deref() {
        Ok("target") => target(&dir, if down { GOOD_ROUNDS } else { ROUNDS }),
        Ok("initiator") => initiator(&dir, down),
        other => panic!("unknown role {other:?}"),
    }
}

/// Runs the two roles across `rails` veth pairs; `down`: the rail-down run.
fn run(tag: &str, rails: usize, down: bool) {
    if std::env::var("NET_NS_DIR").is_ok() {
        return;
    }
    let subnets: Vec<String> = (0..rails).map(|k| format!("10.97.{k}")).collect();
    let subnets: Vec<&str> = subnets.iter().map(String::as_str).collect();
    let hosts = match Hosts::create_pairs(tag, &subnets) {
        Ok(h) => h,
        Err(e) => {
            eprintln!("skipped: cannot create network namespaces here ({e})");
            return;
        }
    };
    let dir = std::env::temp_dir().join(format!("mscclpp-rails-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let exe = std::env::current_exe().unwrap();
    let spawn = |side: usize, role: &str| {
        let names: Vec<&str> = hosts.pairs.iter().map(|p| p[side].as_str()).collect();
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &hosts.ns[side]])
            .arg(&exe)
            .args(["--exact", "rails_role", "--nocapture", "--test-threads=1"])
            .env("NET_NS_DIR", &dir)
            .env("NET_NS_ROLE", role)
            .env("NET_RAILS", names.join("+"))
            .env("MSCCLPP_NET_PROVIDER", "tcp");
        if down {
            c.env("NET_NS_DOWN", "1")
                .env("MSCCLPP_WAIT_TIMEOUT", DOWN_TIMEOUT_S.to_string());
        }
        c.spawn().unwrap()
    };
    let mut t = spawn(1, "target");
    let mut i = spawn(0, "initiator");
    let (si, st) = (i.wait().unwrap(), t.wait().unwrap());
    let _ = std::fs::remove_dir_all(&dir);
    assert!(si.success() && st.success(), "initiator {si}, target {st}");
}

#[test]
fn stripes_over_two_veth_pairs() {
    run("r2", 2, false);
}

#[test]
fn stripes_over_four_veth_pairs() {
    run("r4", 4, false);
}

#[test]
fn a_rail_taken_down_mid_stream_fails_naming_it() {
    run("rd", 2, true);
}
