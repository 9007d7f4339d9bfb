//! Peers that go away: a rank dropped or killed after joining fails the others' collectives
//! naming it, `watch_peers` reports a peer lost when its process aborts or is killed, and a
//! peer that says goodbye (destroyed normally) is not a loss. Ranks are threads, or a child
//! process where one must die (this test re-run alone, `common::child_command`).

mod common;

use common::boot::{child, child_done, local_addr, poll_lost, with_ranks};
use common::child_role;
use mscclpp::bootstrap::Bootstrap;
use mscclpp::error::Error;
use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// What this file's children do (their role, from `common::child_role`).
fn play(role: &str) {
    match role {
        "rank2" => role_rank2(),
        "watch_abort" => role_watch_abort(),
        "watch_wait" => role_watch_wait(),
        "watch_bye" => role_watch_bye(),
        other => panic!("unknown role {other}"),
    }
    child_done(role);
}

#[test]
fn rank_dropped_after_init_fails_the_others() {
    let n = 4;
    let addr = local_addr();
    let gate = Arc::new(Barrier::new(n));
    let t = Instant::now();
    let res = with_ranks(&addr, n, move |b| {
        if b.rank() == 2 {
            drop(b);
            gate.wait();
            return None;
        }
        gate.wait();
        let mut d = vec![0u8; 4 * n];
        Some(b.all_gather(&mut d).map_err(|e| e.to_string()))
    });
    for (r, x) in res.into_iter().enumerate() {
        if let Some(x) = x {
            let m = x.expect_err("all-gather without rank 2 succeeded");
            assert!(
                m.contains("rank 2"),
                "rank {r}: error does not name rank 2: {m}"
            );
        }
    }
    // Nobody waited for the 30 s default timeout.
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t.elapsed()
    );
}

#[test]
fn watch_peers_arguments() {
    with_ranks(&local_addr(), 3, |b| {
        let n = b.nranks();
        assert!(matches!(
            b.watch_peers(&[n]),
            Err(Error::InvalidArgument(_))
        ));
        // Nothing, or only this rank: nothing to wait for.
        b.watch_peers(&[]).unwrap();
        b.watch_peers(&[b.rank()]).unwrap();
        // Duplicates and this rank are ignored; a second call with the same peers is harmless.
        let others: Vec<usize> = (0..n).filter(|&p| p != b.rank()).collect();
        let mut with_dups = others.clone();
        with_dups.extend(&others);
        with_dups.push(b.rank());
        b.watch_peers(&with_dups).unwrap();
        b.watch_peers(&others).unwrap();
        assert_eq!(b.lost_peer(), None);
        b.barrier().unwrap();
    });
}

#[test]
fn goodbye_among_three_threads_is_not_a_loss() {
    let n = 3;
    let left = Arc::new(Barrier::new(n));
    let res = with_ranks(&local_addr(), n, move |b| {
        let me = b.rank();
        let others: Vec<usize> = (0..n).filter(|&p| p != me).collect();
        b.watch_peers(&others).unwrap();
        if me == 2 {
            // Destroyed normally: says goodbye to ranks 0 and 1.
            drop(b);
            left.wait();
            return (0, None);
        }
        // A proxy-like thread polls lost_peer through an Arc while this thread keeps using
        // the bootstrap.
        let b = Arc::new(b);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let poller = {
            let (b, stop) = (b.clone(), stop.clone());
            std::thread::spawn(move || {
                let (mut polls, mut seen) = (0usize, None);
                // Ends: when the API thread sets `stop`.
                while !stop.load(Ordering::Relaxed) {
                    polls += 1;
                    if let Some(l) = b.lost_peer() {
                        seen.get_or_insert(l);
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                (polls, seen)
            })
        };
        left.wait();
        // Fails at once (not at the timeout) and says why: rank 2's goodbye, then its close,
        // have been read by the time this returns.
        let t = Instant::now();
        let e = b.recv(2, 99).unwrap_err().to_string();
        assert!(e.contains("rank 2") && e.contains("goodbye"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        let peer = 1 - me;
        for tag in 0..20u64 {
            b.send(peer, tag, &[me as u8; 100]).unwrap();
            assert_eq!(b.recv(peer, tag).unwrap(), vec![peer as u8; 100]);
            std::thread::sleep(Duration::from_millis(15));
        }
        stop.store(true, Ordering::Relaxed);
        let (polls, seen) = poller.join().unwrap();
        assert_eq!(b.lost_peer(), None);
        (polls, seen)
    });
    for (r, (polls, seen)) in res.into_iter().enumerate().take(2) {
        assert_eq!(seen, None, "rank {r} reported a loss");
        assert!(polls > 5, "rank {r}: the poller ran {polls} times");
    }
}

#[test]
fn killed_rank_process_fails_the_others() {
    const T: &str = "killed_rank_process_fails_the_others";
    if let Some(role) = child_role(T) {
        return play(&role);
    }
    let n = 3;
    let addr = local_addr();
    let mut kid = child(T, "rank2", &[("BOOT_TEST_ADDR", &addr)])
        .stdout(Stdio::piped())
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    let gate = Arc::new(Barrier::new(n));
    let g2 = gate.clone();
    let a2 = addr.clone();
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            let (a, g) = (a2.clone(), g2.clone());
            std::thread::spawn(move || {
                let b = Bootstrap::from_addr(&a, r, n).unwrap();
                g.wait();
                let mut d = vec![0u8; 3 * n];
                b.all_gather(&mut d).map_err(|e| e.to_string())
            })
        })
        .collect();
    // Wait for the child to finish joining, then kill it before the all-gather.
    let mut lines = BufReader::new(kid.stdout.take().unwrap()).lines();
    let t = Instant::now();
    // Ends: at the child's line, or panics when its stdout closes (it exited).
    loop {
        let l = lines.next().expect("child exited before joining").unwrap();
        if l.contains("RANK2 JOINED") {
            break;
        }
    }
    kid.kill().unwrap();
    kid.wait().unwrap();
    gate.wait();
    for (r, h) in ranks.into_iter().enumerate() {
        let m = h
            .join()
            .unwrap()
            .expect_err("all-gather with a dead rank succeeded");
        assert!(
            m.contains("rank 2"),
            "rank {r}: error does not name rank 2: {m}"
        );
    }
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t.elapsed()
    );
}

/// Runs rank 0 here and rank 1 as a child of test `test` with `role`; both watch each other.
/// Returns rank 0 and the child, whose stdout has shown "WATCHED".
fn watched_child(test: &str, role: &str) -> (Bootstrap, std::process::Child) {
    let addr = local_addr();
    let mut kid = child(test, role, &[("BOOT_TEST_ADDR", &addr)])
        .stdout(Stdio::piped())
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    let b = Bootstrap::from_addr(&addr, 0, 2).unwrap();
    b.watch_peers(&[1]).unwrap();
    let mut lines = BufReader::new(kid.stdout.take().unwrap()).lines();
    // Ends: at the child's line, or panics when its stdout closes (it exited).
    loop {
        let l = lines.next().expect("child exited before watching").unwrap();
        if l.contains("WATCHED") {
            break;
        }
    }
    // Keep draining its stdout, so that it never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    (b, kid)
}

fn check_reported_lost(b: &Bootstrap, kid: &mut std::process::Child, how: &str) {
    let t = Instant::now();
    let lost = poll_lost(b, Duration::from_secs(10));
    let el = t.elapsed();
    let status = kid.wait().unwrap();
    assert!(!status.success(), "{how}: child exited with {status}");
    let (p, why) = lost.unwrap_or_else(|| panic!("{how}: no loss reported within 10 s"));
    println!("{how}: loss reported after {el:?}: {why}");
    assert_eq!(p, 1, "{why}");
    assert!(why.contains("rank 1") && why.contains("goodbye"), "{why}");
    // It stays reported, and bootstrap calls that wait on rank 1 fail at once.
    assert_eq!(b.lost_peer().map(|l| l.0), Some(1));
    let e = b.recv(1, 5).unwrap_err().to_string();
    assert!(e.contains("rank 1"), "{e}");
}

#[test]
fn aborted_child_is_reported_lost() {
    const T: &str = "aborted_child_is_reported_lost";
    if let Some(role) = child_role(T) {
        return play(&role);
    }
    let (b, mut kid) = watched_child(T, "watch_abort");
    check_reported_lost(&b, &mut kid, "abort()");
}

#[test]
fn sigkilled_child_is_reported_lost() {
    const T: &str = "sigkilled_child_is_reported_lost";
    if let Some(role) = child_role(T) {
        return play(&role);
    }
    let (b, mut kid) = watched_child(T, "watch_wait");
    assert_eq!(b.lost_peer(), None);
    kid.kill().unwrap();
    check_reported_lost(&b, &mut kid, "SIGKILL");
}

#[test]
fn child_saying_goodbye_is_not_lost() {
    const T: &str = "child_saying_goodbye_is_not_lost";
    if let Some(role) = child_role(T) {
        return play(&role);
    }
    let (b, mut kid) = watched_child(T, "watch_bye");
    // The child drops its bootstrap when its stdin closes, then exits 0.
    drop(kid.stdin.take());
    let status = kid.wait().unwrap();
    assert!(status.success(), "child exited with {status}");
    // Its last message arrived before its goodbye.
    assert_eq!(b.recv(1, 7).unwrap(), b"last words");
    let t = Instant::now();
    assert_eq!(poll_lost(&b, Duration::from_millis(500)), None);
    assert!(t.elapsed() >= Duration::from_millis(500));
    let e = b.recv(1, 8).unwrap_err().to_string();
    assert!(e.contains("goodbye"), "{e}");
}

fn role_watch(addr: &str) -> Bootstrap {
    let b = Bootstrap::from_addr(addr, 1, 2).unwrap();
    b.watch_peers(&[0]).unwrap();
    println!("WATCHED");
    std::io::stdout().flush().unwrap();
    b
}

fn role_watch_abort() {
    let _b = role_watch(&std::env::var("BOOT_TEST_ADDR").unwrap());
    // No core file for this deliberate crash.
    let no_core = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: setrlimit reads a valid rlimit.
    unsafe { libc::setrlimit(libc::RLIMIT_CORE, &no_core) };
    std::process::abort();
}

fn role_watch_wait() {
    let b = role_watch(&std::env::var("BOOT_TEST_ADDR").unwrap());
    // Wait to be killed (or for the parent to go away).
    let mut s = String::new();
    let _ = std::io::stdin().read_line(&mut s);
    drop(b);
}

fn role_watch_bye() {
    let b = role_watch(&std::env::var("BOOT_TEST_ADDR").unwrap());
    b.send(0, 7, b"last words").unwrap();
    // Ends: when the parent closes our stdin.
    let mut s = String::new();
    let _ = std::io::stdin().read_line(&mut s);
    drop(b);
}

fn role_rank2() {
    let addr = std::env::var("BOOT_TEST_ADDR").unwrap();
    let b = Bootstrap::from_addr(&addr, 2, 3).unwrap();
    println!("RANK2 JOINED");
    std::io::stdout().flush().unwrap();
    // Wait to be killed (or for the parent to go away).
    let mut s = String::new();
    let _ = std::io::stdin().read_line(&mut s);
    drop(b);
}
