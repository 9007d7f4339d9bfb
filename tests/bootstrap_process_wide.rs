//! Bootstrap behaviour set for a whole process, each test in a child process of its own (this
//! test re-run alone, `common::child_command`): the connection timeout from
//! MSCCLPP_BOOTSTRAP_TIMEOUT and `set_timeout` bounding every wait (absent root, missing rank,
//! silent peer, unwatched peer), the interface from MSCCLPP_SOCKET_IFNAME, and no thread or
//! descriptor left behind by many communicators.

mod common;

use common::boot::{check_all_gather, child_done, local_addr, run_child, with_ranks};
use common::{child_role, threads_and_fds_settled, threads_and_fds_steady};
use mscclpp::bootstrap::{self, Bootstrap};
use mscclpp::error::Error;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What this file's children do (their role, from `common::child_role`).
fn play(role: &str) {
    match role {
        "timeouts" => role_timeouts(),
        "env_timeout" => role_env_timeout(),
        "ifname_lo" => role_ifname_lo(),
        "ifname_none" => role_ifname_none(),
        "leaks" => role_leaks(),
        "secret_rank0" | "secret_rank1" => role_secret_rank(role),
        "quota" => role_quota(),
        other => panic!("unknown role {other}"),
    }
    child_done(role);
}

#[test]
fn timeouts_in_a_child() {
    const T: &str = "timeouts_in_a_child";
    if let Some(role) = child_role(T) {
        return play(&role);
    }
    run_child(T, "timeouts", &[("MSCCLPP_BOOTSTRAP_TIMEOUT", "7")]);
}

#[test]
fn env_timeout_alone_bounds_an_absent_root() {
    const T: &str = "env_timeout_alone_bounds_an_absent_root";
    if let Some(role) = child_role(T) {
        return play(&role);
    }
    run_child(T, "env_timeout", &[("MSCCLPP_BOOTSTRAP_TIMEOUT", "1")]);
}

#[test]
fn socket_ifname_in_a_child() {
    const T: &str = "socket_ifname_in_a_child";
    if let Some(role) = child_role(T) {
        return play(&role);
    }
    run_child(T, "ifname_lo", &[("MSCCLPP_SOCKET_IFNAME", "lo")]);
    run_child(
        T,
        "ifname_none",
        &[("MSCCLPP_SOCKET_IFNAME", "=no-such-if9")],
    );
}

/// `MSCCLPP_BOOTSTRAP_SECRET`: two ranks of an `ip:port` communicator, each a process of its
/// own, join when they share the secret; with different secrets (or one without) the root
/// refuses the other's frames and both fail within the bootstrap timeout, instead of joining.
#[test]
fn bootstrap_secret_keeps_out_ranks_without_it() {
    const T: &str = "bootstrap_secret_keeps_out_ranks_without_it";
    if let Some(role) = child_role(T) {
        return play(&role);
    }
    for (secrets, join) in [
        (["s3cret", "s3cret"], true),
        (["s3cret", "other"], false),
        (["s3cret", ""], false),
    ] {
        let addr = local_addr();
        let kids: Vec<_> = secrets
            .iter()
            .enumerate()
            .map(|(r, secret)| {
                let role = format!("secret_rank{r}");
                let mut cmd = common::boot::child(
                    T,
                    &role,
                    &[
                        ("MSCCLPP_TEST_ROOT", addr.as_str()),
                        ("MSCCLPP_TEST_JOIN", if join { "1" } else { "0" }),
                        ("MSCCLPP_BOOTSTRAP_TIMEOUT", "3"),
                    ],
                );
                if secret.is_empty() {
                    cmd.env_remove("MSCCLPP_BOOTSTRAP_SECRET");
                } else {
                    cmd.env("MSCCLPP_BOOTSTRAP_SECRET", secret);
                }
                std::thread::spawn(move || common::output_within(cmd, Duration::from_secs(60)))
            })
            .collect();
        for (r, k) in kids.into_iter().enumerate() {
            let (status, text) = k.join().unwrap();
            assert!(
                status.is_some_and(|s| s.success())
                    && text.contains(&format!("CHILD secret_rank{r} OK")),
                "secrets {secrets:?}, rank {r} ({status:?}):\n{text}"
            );
        }
    }
}

/// `MSCCLPP_BOOTSTRAP_QUOTA_MB`: a peer that leaves more tagged messages unread than the quota
/// is dropped and reported lost, and what it left is freed; messages that are read as they
/// come never count against it.
#[test]
fn bootstrap_quota_stops_a_flood() {
    const T: &str = "bootstrap_quota_stops_a_flood";
    if let Some(role) = child_role(T) {
        return play(&role);
    }
    run_child(T, "quota", &[("MSCCLPP_BOOTSTRAP_QUOTA_MB", "1")]);
}

#[test]
fn no_thread_or_fd_leaks_in_a_child() {
    const T: &str = "no_thread_or_fd_leaks_in_a_child";
    if let Some(role) = child_role(T) {
        return play(&role);
    }
    run_child(T, "leaks", &[]);
}

fn role_timeouts() {
    // The environment overrides the default, set_timeout overrides the environment.
    assert_eq!(bootstrap::timeout(), Duration::from_secs(7));
    bootstrap::set_timeout(1).unwrap();
    assert_eq!(bootstrap::timeout(), Duration::from_secs(1));
    let limit = Duration::from_secs(10);

    // No root ever appears.
    let t = Instant::now();
    let r = Bootstrap::from_addr(&local_addr(), 1, 2);
    let el = t.elapsed();
    println!("absent root: {el:?}: {:?}", r.as_ref().map(|_| ()));
    assert!(
        matches!(r, Err(Error::Timeout { .. })),
        "{:?}",
        r.map(|_| ())
    );
    assert!(el < limit, "{el:?}");

    // A rank never shows up: the ranks that did fail within the timeout.
    let addr = local_addr();
    let t = Instant::now();
    let hs: Vec<_> = (0..2)
        .map(|r| {
            let a = addr.clone();
            std::thread::spawn(move || Bootstrap::from_addr(&a, r, 3).map(|_| ()))
        })
        .collect();
    for h in hs {
        let r = h.join().unwrap();
        assert!(r.is_err(), "joined without rank 2");
        println!("missing rank: {:?}", r);
    }
    assert!(t.elapsed() < limit, "{:?}", t.elapsed());

    // A peer that never sends: recv and all-gather time out instead of hanging.
    let addr = local_addr();
    let gave_up = Arc::new(AtomicBool::new(false));
    let g = gave_up.clone();
    let res = with_ranks(&addr, 2, move |b| {
        let t = Instant::now();
        let r = if b.rank() == 0 {
            let r = b.recv(1, 42).map(|_| ());
            g.store(true, Ordering::Release);
            r
        } else {
            // Stay alive, silent, until rank 0 has given up.
            until_set(&g);
            Ok(())
        };
        (r.map_err(|e| e.to_string()), t.elapsed())
    });
    let (r0, el) = &res[0];
    println!("silent peer: {el:?}: {r0:?}");
    assert!(r0.as_ref().unwrap_err().contains("timed out"), "{r0:?}");
    assert!(*el < limit);

    let addr = local_addr();
    gave_up.store(false, Ordering::Relaxed);
    let g = gave_up.clone();
    let res = with_ranks(&addr, 2, move |b| {
        if b.rank() == 0 {
            let mut d = [0u8; 2];
            let r = b.all_gather(&mut d).map_err(|e| e.to_string());
            // Sticky: the bootstrap stays failed.
            assert!(b.barrier().is_err());
            g.store(true, Ordering::Release);
            r
        } else {
            until_set(&g);
            Ok(())
        }
    });
    assert!(res[0].is_err(), "{:?}", res[0]);

    // A peer that never calls watch_peers: bounded by the timeout, naming the peer.
    let addr = local_addr();
    gave_up.store(false, Ordering::Relaxed);
    let g = gave_up.clone();
    let res = with_ranks(&addr, 2, move |b| {
        let t = Instant::now();
        let r = if b.rank() == 0 {
            let r = b.watch_peers(&[1]).map_err(|e| e.to_string());
            g.store(true, Ordering::Release);
            r
        } else {
            until_set(&g);
            Ok(())
        };
        (r, t.elapsed())
    });
    let (r0, el) = &res[0];
    println!("unwatched peer: {el:?}: {r0:?}");
    let e = r0.as_ref().unwrap_err();
    assert!(e.contains("rank 1") && e.contains("timed out"), "{e}");
    assert!(*el < limit);
}

/// Rank 1 of a timeout case: stays alive (and silent) until rank 0 has given up (`set`, which
/// pairs with the Release store after its call), and at most 20 s. A fixed sleep could end
/// before a descheduled rank 0 gave up, and its goodbye would then be what rank 0 saw.
fn until_set(set: &AtomicBool) {
    let t = Instant::now();
    // Ends: rank 0 gave up, or 20 s passed.
    while !set.load(Ordering::Acquire) && t.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn role_env_timeout() {
    assert_eq!(bootstrap::timeout(), Duration::from_secs(1));
    let t = Instant::now();
    let id = bootstrap::new_unique_id().unwrap();
    let r = Bootstrap::from_id(&id, 1, 2);
    assert!(
        matches!(r, Err(Error::Timeout { .. })),
        "{:?}",
        r.map(|_| ())
    );
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
}

fn role_ifname_lo() {
    let id = bootstrap::new_unique_id().unwrap();
    let hs: Vec<_> = (0..2)
        .map(|r| {
            std::thread::spawn(move || Bootstrap::from_id(&id, r, 2).unwrap().barrier().unwrap())
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
}

fn role_ifname_none() {
    match bootstrap::new_unique_id() {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("no-such-if9"), "{m}"),
        other => panic!("{other:?}"),
    }
}

fn role_leaks() {
    let cycle = || {
        with_ranks(&local_addr(), 3, |b| {
            check_all_gather(&b, 16, 0);
            b.send((b.rank() + 1) % 3, 1, b"x").unwrap();
            b.recv((b.rank() + 2) % 3, 1).unwrap();
            b.barrier().unwrap();
        });
    };
    cycle();
    let (threads, fds) = threads_and_fds_steady();
    for _ in 0..20 {
        cycle();
    }
    let after = threads_and_fds_settled(Duration::from_secs(2), |(t, _)| t == threads);
    assert_eq!(after.0, threads, "threads leaked");
    assert_eq!(after.1, fds, "file descriptors leaked");
}

/// Rank 0 or 1 of the secret test: joins (and all-gathers) when `MSCCLPP_TEST_JOIN=1`, else
/// must fail to join within the bootstrap timeout (3 s) plus slack.
fn role_secret_rank(role: &str) {
    let rank: usize = role.trim_start_matches("secret_rank").parse().unwrap();
    let addr = std::env::var("MSCCLPP_TEST_ROOT").unwrap();
    let join = std::env::var("MSCCLPP_TEST_JOIN").unwrap() == "1";
    let t = Instant::now();
    let r = Bootstrap::from_addr(&addr, rank, 2);
    println!(
        "rank {rank}: join -> {:?} after {:?}",
        r.as_ref().map(|_| ()),
        t.elapsed()
    );
    if join {
        check_all_gather(&r.unwrap(), 100, 1);
    } else {
        assert!(r.is_err(), "a rank with another secret joined");
        assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    }
}

fn role_quota() {
    let addr = local_addr();
    let out = with_ranks(&addr, 2, |b| {
        b.watch_peers(&[1 - b.rank()]).unwrap();
        let chunk = vec![7u8; 64 << 10];
        if b.rank() == 1 {
            // 2 MiB that rank 0 reads as it comes (each acknowledged before the next): 64 KiB
            // unread at most, within the quota all along.
            for _ in 0..32 {
                b.send(0, 7, &chunk).unwrap();
                b.recv(0, 8).unwrap();
            }
            b.barrier().unwrap();
            // 2 MiB on a tag nobody reads: past the 1 MiB quota. Sends may fail once rank 0
            // dropped the connection.
            for _ in 0..32 {
                if b.send(0, 99, &chunk).is_err() {
                    break;
                }
            }
            String::new()
        } else {
            for _ in 0..32 {
                assert_eq!(b.recv(1, 7).unwrap().len(), 64 << 10);
                b.send(1, 8, b"ok").unwrap();
            }
            // Before the barrier: rank 1 starts its flood only once rank 0 is in it.
            assert_eq!(b.lost_peer(), None, "read messages never count");
            b.barrier().unwrap();
            let t = Instant::now();
            // Ends when the flood is reported, or fails after 20 s.
            let why = loop {
                if let Some((1, why)) = b.lost_peer() {
                    break why;
                }
                assert!(
                    t.elapsed() < Duration::from_secs(20),
                    "the flood was never stopped"
                );
                std::thread::sleep(Duration::from_millis(5));
            };
            // What it left was dropped with it: nothing is handed out on that tag.
            assert!(b.recv(1, 99).is_err());
            why
        }
    });
    println!("rank 0 saw: {}", out[0]);
    assert!(
        out[0].contains("1 MiB of tagged messages unread"),
        "{}",
        out[0]
    );
}
