//! The hang report between real processes over tcp and shm: a planted two-rank deadlock, a
//! three-rank cycle, a chain that ends at a SIGSTOPped rank (then SIGKILLed: no report, the
//! survivors fail at once), and SIGUSR1 in the middle of a ping-pong that then completes. Each
//! rank keeps its own log (`capture_logs`) and checks the summary its process wrote.

mod common;
mod fault_util;

use common::api::*;
use common::*;
use fault_util::*;
use mscclpp::abi::mscclppResult_t::*;
use mscclpp::capi::comm::*;
use mscclpp::capi::conn::*;
use mscclpp::capi::devconn::*;
use std::process::Child;
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(90);

fn me() -> usize {
    env_usize("MSCCLPP_TEST_RANK")
}

/// The hang report lines this process has logged once one contains `needle`: waits for it at
/// most `bound` (the reporter thread writes it a moment after the timeout or the signal).
fn report_with(needle: &str, bound: Duration) -> Vec<String> {
    let t0 = Instant::now();
    // Ends: a line contains the needle, or the bound passes (a failure).
    loop {
        let lines: Vec<String> = logged()
            .into_iter()
            .filter(|l| l.contains("hang report"))
            .collect();
        if lines.iter().any(|l| l.contains(needle)) {
            for l in &lines {
                println!("rank {}: {l}", me());
            }
            return lines;
        }
        assert!(
            t0.elapsed() < bound,
            "rank {}: no hang report line with {needle:?} within {bound:?}; logged:\n{}",
            me(),
            logged().join("\n")
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The one line of `lines` that contains `needle`, checked to contain each of `parts`.
fn line_with<'a>(lines: &'a [String], needle: &str, parts: &[&str]) -> &'a str {
    let l = lines
        .iter()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("no line with {needle:?}"));
    for p in parts {
        assert!(l.contains(p), "{p:?} missing from: {l}");
    }
    l
}

/// Starts the ranks of test `name` (rank r with `envs[r]` besides the transport's settings and
/// the marker directory).
fn start(
    name: &str,
    provider: &str,
    dir: &Dir,
    envs: &[Vec<(&'static str, String)>],
) -> Vec<Child> {
    let root = format!("127.0.0.1:{}", free_port());
    (0..envs.len())
        .map(|r| {
            let mut env = rank_env(provider, 10.0, 30.0);
            env.push(dir.env());
            env.retain(|(k, _)| !envs[r].iter().any(|(k2, _)| k2 == k));
            env.extend(envs[r].iter().cloned());
            spawn_rank(name, r, envs.len(), &root, &env)
        })
        .collect()
}

/// Waits for every child (at most DEADLINE in all); their exit codes (None: killed).
fn wait_all(children: &mut [Child]) -> Vec<Option<i32>> {
    let t0 = Instant::now();
    children
        .iter_mut()
        .map(|c| wait_child(c, DEADLINE.saturating_sub(t0.elapsed())).and_then(|s| s.code()))
        .collect()
}

fn wait_env(s: &str) -> Vec<(&'static str, String)> {
    vec![("MSCCLPP_WAIT_TIMEOUT", s.to_string())]
}

// ---- a planted two-rank deadlock ----------------------------------------------------------

/// Rank 0 signals 4 times and waits for 17 signals; rank 1 the other way round; then each waits
/// for the other before signalling again. Both waits time out (same timeout, as in a real
/// job) and each rank's report names the cycle with the counts.
fn two_rank_deadlock(name: &str, provider: &str) {
    if is_rank(name) {
        capture_logs();
        let e = env();
        let mut buf = vec![0u8; 64];
        let c = connected_pair(&e, 0, &mut buf);
        let d = &mut dev_conns(c)[0];
        let (gives, takes) = if e.rank == 0 { (4, 17) } else { (17, 4) };
        if e.rank == 0 {
            (0..gives).for_each(|_| signal(d));
            (0..takes).for_each(|_| wait(d));
        } else {
            (0..takes).for_each(|_| wait(d));
            (0..gives).for_each(|_| signal(d));
        }
        let (r, el) = timed(|| mscclppDevConnWait(d));
        assert_eq!(r, mscclppRemoteError, "{}", last_error());
        assert!(last_error().contains("timed out"), "{}", last_error());
        // The report is written after the call returned: the timeout stays the bound.
        assert!(el < Duration::from_secs(5), "{el:?}");
        let lines = report_with("cycle 0 -> 1 -> 0", Duration::from_secs(30));
        line_with(
            &lines,
            "cycle 0 -> 1 -> 0",
            &[
                "rank 0 waits for signal 18 from rank 1 (has 17",
                "; rank 1 waits for signal 5 from rank 0 (has 4",
            ],
        );
        line_with(
            &lines,
            "ranks answered",
            &["2 of 2 ranks answered", "host thread: timed out"],
        );
        line_with(
            &lines,
            "rank 0 signals:",
            &["to rank 1 (tag 0): issued 4, sent 4, received 17"],
        );
        line_with(
            &lines,
            "rank 1 signals:",
            &["to rank 0 (tag 0): issued 17, sent 17, received 4"],
        );
        finish(c);
        return;
    }
    let dir = Dir::new(name);
    let mut ranks = start(name, provider, &dir, &[wait_env("2"), wait_env("2")]);
    assert_eq!(wait_all(&mut ranks), vec![Some(0), Some(0)]);
}

#[test]
fn two_rank_deadlock_tcp() {
    two_rank_deadlock("two_rank_deadlock_tcp", "tcp");
}
#[test]
fn two_rank_deadlock_shm() {
    two_rank_deadlock("two_rank_deadlock_shm", "shm");
}

// ---- a three-rank cycle -------------------------------------------------------------------

/// Each of 3 ranks waits for the rank before it in the ring before it signals the next one.
/// Rank 0's wait times out first and its report names the cycle 0 -> 2 -> 1 -> 0; then rank 0
/// signals rank 1, which releases the ring, and all finish.
fn three_rank_cycle(name: &str, provider: &str) {
    if is_rank(name) {
        capture_logs();
        let e = env();
        let (next, prev) = ((e.rank + 1) % 3, (e.rank + 2) % 3);
        let c = init(&e.root, e.rank, 3);
        let (mut a, mut b) = (vec![0u8; 64], vec![0u8; 64]);
        ok(connect(c, next, 0, &mut a));
        ok(connect(c, prev, 0, &mut b));
        ok(mscclppConnectionSetup(c));
        ok(mscclppProxyLaunch(c));
        let conns = dev_conns(c);
        let r = mscclppDevConnWait(&mut conns[1]);
        if e.rank == 0 {
            assert_eq!(r, mscclppRemoteError, "{}", last_error());
            let lines = report_with("cycle 0 -> 2 -> 1 -> 0", Duration::from_secs(30));
            line_with(
                &lines,
                "cycle 0 -> 2 -> 1 -> 0",
                &[
                    "rank 0 waits for signal 1 from rank 2 (has 0, timed out",
                    "; rank 2 waits for signal 1 from rank 1 (has 0); ",
                    "; rank 1 waits for signal 1 from rank 0 (has 0): ",
                ],
            );
            line_with(
                &lines,
                "ranks answered",
                &["3 of 3 ranks answered", "1 cycle(s)"],
            );
        } else {
            // Released by the ring once rank 0 has reported.
            assert_eq!(r, mscclppSuccess, "{}", last_error());
        }
        signal(&mut conns[0]);
        finish(c);
        return;
    }
    let dir = Dir::new(name);
    let envs = [wait_env("2"), wait_env("30"), wait_env("30")];
    let mut ranks = start(name, provider, &dir, &envs);
    assert_eq!(wait_all(&mut ranks), vec![Some(0); 3]);
}

#[test]
fn three_rank_cycle_tcp() {
    three_rank_cycle("three_rank_cycle_tcp", "tcp");
}
#[test]
fn three_rank_cycle_shm() {
    three_rank_cycle("three_rank_cycle_shm", "shm");
}

// ---- a chain that ends at a stopped rank, which is then killed ------------------------------

/// Connections 0-1 and 1-2; rank 0 waits for rank 1, which waits for rank 2 (wait timeout 60
/// s). The parent SIGSTOPs rank 2 and rank 0 asks for a report (SIGUSR1 to itself, as `kill
/// -USR1` would): it names the chain 0 -> 1 -> 2 and rank 2 as not answering. The parent then
/// SIGKILLs rank 2. No report comes of that, and none is needed: rank 1 loses its peer, its
/// communicator aborts and tells rank 0, so both waits fail within seconds of the kill (not at
/// the timeout), and each rank's sticky error names the dead rank. (The same report with rank
/// 2 lost rather than silent is `comm::hang::summary::tests::chain_ending_at_a_dead_rank`: once
/// the loss has aborted the survivors' communicators, their bootstraps are poisoned and no
/// report can be gathered.)
fn dead_peer(name: &str, provider: &str) {
    // Far below the 60 s wait timeout, with room for a loaded machine.
    const PROMPT_MS: u64 = 8000;
    if is_rank(name) {
        capture_logs();
        let e = env();
        let c = init(&e.root, e.rank, 3);
        let (mut a, mut b) = (vec![0u8; 64], vec![0u8; 64]);
        match e.rank {
            0 => ok(connect(c, 1, 0, &mut a)),
            1 => {
                ok(connect(c, 0, 0, &mut a));
                ok(connect(c, 2, 0, &mut b));
            }
            _ => ok(connect(c, 1, 0, &mut a)),
        }
        ok(mscclppConnectionSetup(c));
        ok(mscclppProxyLaunch(c));
        let conns = dev_conns(c);
        mark(&format!("r{}_ready", e.rank), "");
        let reporter = match e.rank {
            2 => {
                // Stopped, then killed here by the parent.
                wait_mark("never", Duration::from_secs(90));
                panic!("rank 2 was not killed");
            }
            1 => {
                mark("r1_waiting", "");
                None
            }
            // Rank 0's main thread waits below; this thread asks for the report.
            _ => Some(std::thread::spawn(stopped_rank_report)),
        };
        // Rank 0's one connection (to rank 1); rank 1's second (to rank 2).
        let d = &mut conns[if e.rank == 0 { 0 } else { 1 }];
        let (r, el) = timed(|| mscclppDevConnWait(d));
        let failed_ms = now_ms();
        let why = last_error();
        println!("rank {}: wait {r:?} after {el:?}: {why}", e.rank);
        if let Some(t) = reporter {
            t.join().expect("rank 0's report");
        }
        let killed_ms: u64 = wait_mark("killed", Duration::from_secs(60))
            .expect("rank 2 never killed")
            .parse()
            .unwrap();
        println!(
            "rank {}: the wait failed {} ms after the kill",
            e.rank,
            failed_ms as i64 - killed_ms as i64
        );
        assert_eq!(r, mscclppRemoteError, "{why}");
        assert!(
            why.contains("aborted") && !why.contains("timed out"),
            "{why}"
        );
        assert!(
            failed_ms >= killed_ms && failed_ms - killed_ms < PROMPT_MS,
            "rank {}: the wait failed {} ms after the kill",
            e.rank,
            failed_ms as i64 - killed_ms as i64
        );
        assert_eq!(async_error(c), mscclppRemoteError);
        // The sticky error names the dead rank: rank 1 saw it go, rank 0 hears it from rank 1.
        assert_eq!(mscclppProxyStop(c), mscclppRemoteError);
        let why = last_error();
        println!("rank {}: {why}", e.rank);
        let lost = "rank 2 closed its bootstrap connection without saying goodbye";
        assert!(why.contains(lost), "{why}");
        if e.rank == 0 {
            assert!(why.contains("rank 1 aborted its bootstrap"), "{why}");
            mark("r0_done", "");
        } else {
            // Rank 0 reads rank 1's abort before rank 1 goes.
            wait_mark("r0_done", Duration::from_secs(60)).expect("rank 0 never finished");
        }
        ok(mscclppCommDestroy(c));
        return;
    }
    let dir = Dir::new(name);
    let envs = [wait_env("60"), wait_env("60"), wait_env("60")];
    let mut ranks = start(name, provider, &dir, &envs);
    fn fail(ranks: &mut [Child], why: String) -> ! {
        ranks.iter_mut().for_each(|c| {
            let _ = c.kill();
        });
        panic!("{why}");
    }
    for r in 0..3 {
        if wait_mark_in(&dir.0, &format!("r{r}_ready"), Duration::from_secs(30)).is_none() {
            fail(&mut ranks, format!("rank {r} never got ready"));
        }
    }
    send_signal(ranks[2].id(), libc::SIGSTOP);
    if !wait_stopped(ranks[2].id(), Duration::from_secs(10)) {
        fail(&mut ranks, "rank 2 did not stop".into());
    }
    mark_in(&dir.0, "r2_stopped", "");
    if wait_mark_in(&dir.0, "reported", Duration::from_secs(60)).is_none() {
        fail(&mut ranks, "rank 0 wrote no report naming the chain".into());
    }
    let killed_ms = now_ms();
    ranks[2].kill().unwrap();
    ranks[2].wait().unwrap();
    mark_in(&dir.0, "killed", &killed_ms.to_string());
    assert_eq!(wait_all(&mut ranks[..2]), vec![Some(0), Some(0)]);
}

/// Rank 0's reporting thread in `dead_peer`: once rank 1 waits and rank 2 is stopped, asks for
/// reports (SIGUSR1) until one names the chain (a wait is listed only after its first few
/// hundred polls, so the first may come too early for rank 1's), checks it, and tells the
/// parent.
fn stopped_rank_report() {
    wait_mark("r1_waiting", Duration::from_secs(60)).expect("rank 1 never waited");
    wait_mark("r2_stopped", Duration::from_secs(60)).expect("rank 2 never stopped");
    let chain = "chain 0 -> 1 -> 2";
    // Ends: a report names the chain, or the fourth does not (each waits at most the
    // report's bound, 5 s, for the stopped rank).
    let lines = (1..=4)
        .find_map(|n| {
            // SAFETY: plain syscall; the library's handler (set up by mscclppConnectionSetup)
            // takes it.
            assert_eq!(unsafe { libc::kill(libc::getpid(), libc::SIGUSR1) }, 0);
            let head = format!("hang report {n} of rank 0 (SIGUSR1)");
            report_with(&head, Duration::from_secs(30));
            let t0 = Instant::now();
            // Ends: report n's chain line is there, or 1 s after its first line (a report's
            // lines are logged one after the other at once).
            loop {
                let lines: Vec<String> = logged()
                    .into_iter()
                    .filter(|l| l.contains(&format!("hang report {n} of rank 0")))
                    .collect();
                if lines.iter().any(|l| l.contains(chain)) {
                    return Some(lines);
                }
                if t0.elapsed() > Duration::from_secs(1) {
                    return None;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        })
        .expect("no report named the chain");
    let silent = "rank 2: no answer (not within ";
    line_with(&lines, chain, &[silent, "its process stopped"]);
    line_with(
        &lines,
        "rank 0 waits for signal 1 from rank 1 (has 0)",
        &["rank 1 has sent 0 and waits for rank 2"],
    );
    line_with(
        &lines,
        "rank 1 waits for signal 1 from rank 2 (has 0)",
        &[silent],
    );
    line_with(&lines, "ranks answered", &["2 of 3 ranks answered"]);
    mark("reported", "");
}

#[test]
fn dead_peer_tcp() {
    dead_peer("dead_peer_tcp", "tcp");
}
#[test]
fn dead_peer_shm() {
    dead_peer("dead_peer_shm", "shm");
}

// ---- SIGUSR1 in the middle of a run -------------------------------------------------------

static OWN_HANDLER_RAN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn own_handler(_: std::ffi::c_int) {
    OWN_HANDLER_RAN.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Installs `own_handler` for SIGUSR1 as a program that relies on it breaking a blocking call
/// does (CPython does the same): no `SA_RESTART`; on the alternate stack (as the Go runtime
/// requires); SIGUSR2 blocked while it runs.
fn install_own_handler() {
    // SAFETY: zeroed is a valid sigaction, completed here; the handler only stores to an
    // atomic.
    unsafe {
        let mut a: libc::sigaction = std::mem::zeroed();
        a.sa_sigaction = own_handler as *const () as usize;
        a.sa_flags = libc::SA_ONSTACK;
        libc::sigemptyset(&mut a.sa_mask);
        libc::sigaddset(&mut a.sa_mask, libc::SIGUSR2);
        assert_eq!(libc::sigaction(libc::SIGUSR1, &a, std::ptr::null_mut()), 0);
    }
}

/// With the report's handler in place of the program's, SIGUSR1 still does what the program
/// installed it for: the action keeps its flags and mask, and a thread blocked in `read` is
/// interrupted (`EINTR`) instead of resuming the call.
fn own_handler_still_interrupts() {
    // SAFETY: a query; `now` is written.
    let now = unsafe {
        let mut now: libc::sigaction = std::mem::zeroed();
        assert_eq!(
            libc::sigaction(libc::SIGUSR1, std::ptr::null(), &mut now),
            0
        );
        now
    };
    assert_eq!(now.sa_flags & libc::SA_RESTART, 0, "SA_RESTART added");
    assert_ne!(now.sa_flags & libc::SA_ONSTACK, 0, "SA_ONSTACK dropped");
    // SAFETY: a mask read.
    assert_eq!(
        unsafe { libc::sigismember(&now.sa_mask, libc::SIGUSR2) },
        1,
        "mask lost"
    );
    let mut fds = [0; 2];
    // SAFETY: fds has room for the two ends.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    let reader = std::thread::spawn(move || {
        let mut b = 0u8;
        // SAFETY: reads one byte into `b` from the pipe's read end, open until joined.
        let n = unsafe { libc::read(fds[0], (&mut b as *mut u8).cast(), 1) };
        (n, std::io::Error::last_os_error().raw_os_error())
    });
    use std::os::unix::thread::JoinHandleExt;
    let t = reader.as_pthread_t();
    let t0 = Instant::now();
    // Ends when the read returned (the signal may come before the thread blocks: sent again
    // every 50 ms), or after 5 s, when a byte ends the read.
    while !reader.is_finished() {
        if t0.elapsed() > Duration::from_secs(5) {
            // SAFETY: writes one byte to the pipe's write end.
            unsafe { libc::write(fds[1], b"x".as_ptr().cast(), 1) };
            break;
        }
        // SAFETY: the thread is alive (not joined).
        unsafe { libc::pthread_kill(t, libc::SIGUSR1) };
        std::thread::sleep(Duration::from_millis(50));
    }
    let (n, err) = reader.join().unwrap();
    assert_eq!(
        (n, err),
        (-1, Some(libc::EINTR)),
        "a read blocked when SIGUSR1 came was resumed, not interrupted"
    );
    // SAFETY: both ends are ours and unused now.
    unsafe {
        libc::close(fds[0]);
        libc::close(fds[1]);
    }
}

/// A ping-pong of checked round numbers; the parent sends SIGUSR1 to rank 0 (which installed
/// a SIGUSR1 handler of its own first) once it runs. Rank 0 goes on until its log has the
/// report, then 50 rounds more, then both finish: the signal disturbed nothing, the program's
/// own handler still ran, and SIGUSR1 still interrupts a blocking call, as it did before.
fn sigusr1(name: &str, provider: &str) {
    if is_rank(name) {
        let me = me();
        if me == 0 {
            install_own_handler();
        }
        capture_logs();
        let e = env();
        let mut buf = vec![0u8; 16];
        let c = connected_pair(&e, 0, &mut buf);
        let d = &mut dev_conns(c)[0];
        let bp = buf.as_mut_ptr() as *mut u64;
        const STOP: u64 = u64::MAX;
        let t0 = Instant::now();
        let mut stop_at = None;
        for round in 0u64.. {
            if me == 0 {
                if round == 20 {
                    mark("r0_running", "");
                }
                if stop_at.is_none() && round % 8 == 0 {
                    let seen = logged()
                        .iter()
                        .any(|l| l.contains("hang report 1 of rank 0 (SIGUSR1)"));
                    if seen {
                        stop_at = Some(round + 50);
                    }
                    assert!(
                        t0.elapsed() < Duration::from_secs(60),
                        "no report on SIGUSR1"
                    );
                }
                let v = if stop_at == Some(round) { STOP } else { round };
                // SAFETY: slot 0 of buf; rank 1 reads it only after our signal.
                unsafe { bp.write_volatile(v) };
                put_signal(d, 0, 0, 8);
                wait(d);
                // SAFETY: slot 1, written by rank 1 before its signal.
                let echo = unsafe { bp.add(1).read_volatile() };
                assert_eq!(echo, v, "round {round}");
                if v == STOP {
                    break;
                }
            } else {
                wait(d);
                // SAFETY: slot 0, written by rank 0 before its signal.
                let v = unsafe { bp.read_volatile() };
                assert!(v == round || v == STOP, "round {round}: {v}");
                // SAFETY: slot 1; rank 0 reads it only after our signal.
                unsafe { bp.add(1).write_volatile(v) };
                put_signal(d, 8, 8, 8);
                if v == STOP {
                    break;
                }
            }
        }
        flush(d);
        if me == 0 {
            let lines = report_with("hang report 1 of rank 0 (SIGUSR1)", Duration::ZERO);
            line_with(&lines, "(SIGUSR1)", &["2 of 2 ranks answered"]);
            assert!(
                OWN_HANDLER_RAN.load(std::sync::atomic::Ordering::Relaxed),
                "the program's own SIGUSR1 handler was not called"
            );
            own_handler_still_interrupts();
        }
        finish(c);
        return;
    }
    let dir = Dir::new(name);
    let mut ranks = start(name, provider, &dir, &[vec![], vec![]]);
    if wait_mark_in(&dir.0, "r0_running", Duration::from_secs(30)).is_none() {
        ranks.iter_mut().for_each(|c| {
            let _ = c.kill();
        });
        panic!("rank 0 never ran");
    }
    send_signal(ranks[0].id(), libc::SIGUSR1);
    assert_eq!(wait_all(&mut ranks), vec![Some(0), Some(0)]);
}

#[test]
fn sigusr1_tcp() {
    sigusr1("sigusr1_tcp", "tcp");
}
#[test]
fn sigusr1_shm() {
    sigusr1("sigusr1_shm", "shm");
}

// ---- the periodic report ------------------------------------------------------------------

/// `MSCCLPP_HANG_REPORT=1`: two ranks deadlocked with a long wait timeout. Within seconds each
/// writes a report of its own accord, naming the cycle while both waits are still pending; a
/// thread of rank 0 that watches its log then signals rank 1, which releases both, and they
/// finish normally. The quick waits of a ping-pong before never made a report.
#[test]
fn periodic_report_tcp() {
    const NAME: &str = "periodic_report_tcp";
    if is_rank(NAME) {
        capture_logs();
        let e = env();
        let mut buf = vec![0u8; 64];
        let c = connected_pair(&e, 0, &mut buf);
        let d = &mut dev_conns(c)[0];
        for _ in 0..50 {
            if e.rank == 0 {
                signal(d);
                wait(d);
            } else {
                wait(d);
                signal(d);
            }
        }
        assert!(
            !logged().iter().any(|l| l.contains("hang report")),
            "a report while nothing waited long"
        );
        let releaser = (e.rank == 0).then(|| {
            let dc = *d;
            struct Conn(mscclpp::abi::mscclppDevConn);
            // SAFETY: the connection's memory lives until `finish`, after the join below.
            unsafe impl Send for Conn {}
            let conn = Conn(dc);
            std::thread::spawn(move || {
                let mut conn = conn;
                report_with("cycle 0 -> 1 -> 0", Duration::from_secs(30));
                signal(&mut conn.0);
            })
        });
        // Both wait: a deadlock until rank 0's thread signals.
        wait(d);
        if e.rank == 1 {
            signal(d);
        }
        if let Some(t) = releaser {
            t.join().unwrap();
        }
        if e.rank == 0 {
            let lines = report_with("cycle 0 -> 1 -> 0", Duration::ZERO);
            line_with(
                &lines,
                "(a wait has lasted 1s (MSCCLPP_HANG_REPORT))",
                &["2 of 2 ranks answered", "1 cycle(s)"],
            );
            let l = line_with(
                &lines,
                "cycle 0 -> 1 -> 0",
                &[
                    "rank 0 waits for signal 51 from rank 1 (has 50)",
                    "rank 1 waits for signal 51 from rank 0 (has 50)",
                ],
            );
            assert!(!l.contains("timed out"), "{l}");
        }
        finish(c);
        return;
    }
    let dir = Dir::new(NAME);
    let env = vec![
        ("MSCCLPP_WAIT_TIMEOUT", "30".to_string()),
        ("MSCCLPP_HANG_REPORT", "1".to_string()),
    ];
    let mut ranks = start(NAME, "tcp", &dir, &[env.clone(), env]);
    assert_eq!(wait_all(&mut ranks), vec![Some(0), Some(0)]);
}
