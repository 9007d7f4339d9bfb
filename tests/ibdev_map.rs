//! `MSCCLPP_IBDEV_MAP`: a 2023 program passes the `ibDev` names of the machine it was written
//! for (Azure NDv4: "mlx5_ib0" .. "mlx5_ib7"). Without a map such a name that names no
//! libfabric domain here fails setup clearly (the domains there are, and the variable to set);
//! with `*=auto` or `mlx5_ib0=lo` the same program runs unchanged, every byte checked; a map
//! to a domain that does not exist fails naming that domain; a map to two domains joined by
//! `+` stripes over them (two rails on loopback). Two ranks over tcp on loopback.

mod common;

use common::api::*;
use common::*;
use mscclpp::abi::mscclppResult_t::*;
use mscclpp::capi::conn::*;
use std::time::Duration;

const CHUNK: usize = 100_003;
const DEADLINE: Duration = Duration::from_secs(60);

/// Both ranks of `test`, with ibDev "mlx5_ib0" over tcp and `map` as MSCCLPP_IBDEV_MAP.
fn ranks(test: &str, map: Option<&str>, body: fn(Env)) {
    ranks_with(test, map, &[], body)
}

/// `ranks` with more variables.
fn ranks_with(test: &str, map: Option<&str>, more: &[(&'static str, &str)], body: fn(Env)) {
    if is_rank(test) {
        body(env());
        return;
    }
    let mut vars = vec![
        ("MSCCLPP_TEST_TRANSPORT", "tcp".to_string()),
        ("MSCCLPP_NET_PROVIDER", "tcp".to_string()),
        ("MSCCLPP_TEST_IBDEV", "mlx5_ib0".to_string()),
        ("MSCCLPP_WAIT_TIMEOUT", "20".to_string()),
        ("MSCCLPP_BOOTSTRAP_TIMEOUT", "20".to_string()),
    ];
    if let Some(m) = map {
        vars.push(("MSCCLPP_IBDEV_MAP", m.to_string()));
    }
    vars.extend(more.iter().map(|(k, v)| (*k, v.to_string())));
    spawn(test, 2, &vars).expect_success(DEADLINE);
}

/// Connects to the other rank with ibDev "mlx5_ib0", exchanges a chunk each way, checks it.
fn runs(e: Env) {
    let c = init(&e.root, e.rank, e.n);
    let mut buf = vec![0u8; 2 * CHUNK];
    for i in 0..CHUNK {
        buf[e.rank * CHUNK + i] = pattern(e.rank, i);
    }
    ok(connect(c, 1 - e.rank, 0, &mut buf));
    ok(mscclppConnectionSetup(c));
    ok(mscclppProxyLaunch(c));
    alltoall_and_finish(c, &buf, e.rank, e.n, CHUNK);
}

/// Setup fails with mscclppInvalidArgument, its text containing every one of `want`.
fn setup_fails(e: &Env, want: &[&str]) {
    let c = init(&e.root, e.rank, e.n);
    let mut buf = vec![0u8; 64];
    ok(connect(c, 1 - e.rank, 0, &mut buf));
    assert_eq!(mscclppConnectionSetup(c), mscclppInvalidArgument);
    let m = last_error();
    for w in want {
        assert!(m.contains(w), "the error does not say {w:?}: {m}");
    }
    ok(mscclpp::capi::comm::mscclppCommDestroy(c));
}

#[test]
fn unmapped_name_fails_listing_domains_and_the_variable() {
    ranks(
        "unmapped_name_fails_listing_domains_and_the_variable",
        None,
        |e| {
            setup_fails(
                &e,
                &[
                    "\"mlx5_ib0\"",
                    "MSCCLPP_IBDEV_MAP",
                    "domains with RDM endpoints and RMA writes here",
                    "lo",
                ],
            )
        },
    );
}

#[test]
fn star_to_auto_runs_a_2023_program() {
    ranks("star_to_auto_runs_a_2023_program", Some("*=auto"), runs);
}

#[test]
fn name_to_loopback_domain_runs() {
    ranks("name_to_loopback_domain_runs", Some("mlx5_ib0=lo"), runs);
}

#[test]
fn map_to_missing_domain_fails_naming_it() {
    ranks(
        "map_to_missing_domain_fails_naming_it",
        Some("mlx5_ib1=lo,mlx5_ib0=nosuchnic0"),
        |e| setup_fails(&e, &["\"nosuchnic0\"", "MSCCLPP_IBDEV_MAP", "\"mlx5_ib0\""]),
    );
}

/// `mlx5_ib0=lo+lo`: two rails (two endpoints on loopback) through the whole C API; with
/// 16 KiB stripes the 100003-byte put is 7 chunks, 4 on rail 0 and 3 on rail 1, which the
/// endpoint's closing log line counts. Every byte is checked.
#[test]
fn name_to_two_rails_stripes_a_2023_program() {
    ranks_with(
        "name_to_two_rails_stripes_a_2023_program",
        Some("mlx5_ib0=lo+lo"),
        &[
            ("MSCCLPP_NET_STRIPE_CHUNK", "16384"),
            ("MSCCLPP_DEBUG", "INFO"),
        ],
        |e| {
            capture_logs();
            runs(e);
            let logs = logged();
            let carried = logs
                .iter()
                .find(|l| l.contains("/lo+lo carried: "))
                .unwrap_or_else(|| panic!("no rails' closing line; log:\n{}", logs.join("\n")));
            assert!(
                carried.ends_with("lo 0 MiB in 4 writes; lo 0 MiB in 3 writes"),
                "{carried}"
            );
        },
    );
}
