//! Two "hosts": ranks in two network namespaces joined by a veth pair, addresses only inside
//! them, bootstrap and data over libfabric's tcp provider. Needs root (CI has it); elsewhere the
//! test prints why it is skipped.

mod common;

use common::api::*;
use common::netns::Hosts;
use common::*;
use mscclpp::capi::conn::*;
use std::time::Duration;

const NAME: &str = "two_hosts_over_veth_tcp";
const BYTES: usize = 4 << 20;

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
    finish(c);
}

#[test]
fn two_hosts_over_veth_tcp() {
    if is_rank(NAME) {
        return rank_body();
    }
    let hosts = match Hosts::create("e", "10.99.0") {
        Ok(h) => h,
        Err(e) => {
            println!("SKIPPED {NAME}: cannot create network namespaces here ({e})");
            return;
        }
    };
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
            format!("MSCCLPP_NET_IFACE={}", hosts.dev[r]),
            format!("MSCCLPP_SOCKET_IFNAME={}", hosts.dev[r]),
        ]
    });
    ranks.expect_success(Duration::from_secs(120));
    drop(hosts);
}
