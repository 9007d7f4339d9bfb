//! Multi-rank tests as processes: the test binary re-executes itself once per rank with
//! `MSCCLPP_TEST_ROLE=<test name>` and the rank's environment; the parent waits for all with a
//! deadline and kills the rest when one fails or hangs.
#![allow(dead_code)]

pub mod api;
pub mod boot;
pub mod netns;
pub mod raw;

use std::io::Read;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// True in a child process started for `test`.
pub fn is_rank(test: &str) -> bool {
    std::env::var("MSCCLPP_TEST_ROLE").is_ok_and(|r| r == test)
}

/// A rank's identity, from the environment `spawn` gave it.
pub struct Env {
    pub rank: usize,
    pub n: usize,
    pub root: String,
}

pub fn env() -> Env {
    Env {
        rank: env_usize("MSCCLPP_TEST_RANK"),
        n: env_usize("MSCCLPP_TEST_NRANKS"),
        root: std::env::var("MSCCLPP_TEST_ROOT").unwrap(),
    }
}

pub fn env_usize(k: &str) -> usize {
    std::env::var(k)
        .unwrap_or_else(|_| panic!("{k} not set"))
        .parse()
        .unwrap()
}

/// A TCP port on 127.0.0.1 that is free now and that nothing else on this machine is about to
/// take, for a bootstrap root that binds it a moment later.
///
/// Why not `bind(0)`: the kernel hands out the same ephemeral range to every `bind(0)` and
/// `connect`, so a port released here could be taken by another test's listener or connection
/// before the root binds it (seen in CI: "the port is already in use"). Ports below the
/// ephemeral range are handed out only on request: this picks one there, different for each
/// call of this process and spread by pid across processes, and checks it binds.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    let (base, span) = (10_000u32, low.saturating_sub(10_000).max(1000));
    let start = std::process::id().wrapping_mul(7919) % span;
    for _ in 0..span {
        let port = base + (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
        if std::net::TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
            return port as u16;
        }
    }
    panic!("no free TCP port in {base}..{}", base + span)
}

/// A command that re-runs test `test` of this binary alone (ignored or not) as one child
/// process, with `MSCCLPP_TEST_ROLE=test` and `MSCCLPP_TEST_CHILD=role` (what the child is to
/// do, see [`child_role`]); stdin is null unless the caller sets it.
pub fn child_command(test: &str, role: &str) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args([
        test,
        "--exact",
        "--nocapture",
        "--test-threads=1",
        "--include-ignored",
    ])
    .env("MSCCLPP_TEST_ROLE", test)
    .env("MSCCLPP_TEST_CHILD", role)
    .stdin(Stdio::null());
    c
}

/// In a child that [`child_command`] started for `test`: its role. None in the test's parent.
pub fn child_role(test: &str) -> Option<String> {
    if !is_rank(test) {
        return None;
    }
    Some(std::env::var("MSCCLPP_TEST_CHILD").unwrap_or_default())
}

/// Runs `cmd` to its end, or kills it at `deadline`: its exit status (None: killed at the
/// deadline) and its stdout then stderr.
pub fn output_within(mut cmd: Command, deadline: Duration) -> (Option<ExitStatus>, String) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning a child");
    // Readers on threads: a child that fills one pipe must not block on it.
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut v);
            }
            String::from_utf8_lossy(&v).into_owned()
        })
    };
    let out = drain(child.stdout.take().map(|r| Box::new(r) as _));
    let err = drain(child.stderr.take().map(|r| Box::new(r) as _));
    let status = wait_child(&mut child, deadline);
    // The pipes close when the child (and whatever inherited them) has exited.
    let text = format!("{}\n{}", out.join().unwrap(), err.join().unwrap());
    (status, text)
}

/// Waits for `child` until `bound`; kills it at the deadline (None then).
pub fn wait_child(child: &mut Child, bound: Duration) -> Option<ExitStatus> {
    let t0 = Instant::now();
    // Ends: the child exits, or the bound passes and it is killed.
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return Some(st);
        }
        if t0.elapsed() > bound {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub struct Ranks {
    pub children: Vec<(usize, Child)>,
}

/// Starts `n` ranks of test `test` (its full path as libtest prints it, e.g.
/// `alltoall_tcp_2`), each with MSCCLPP_TEST_RANK/NRANKS/ROOT and `extra` env.
pub fn spawn(test: &str, n: usize, extra: &[(&str, String)]) -> Ranks {
    let root = format!("127.0.0.1:{}", free_port());
    spawn_wrapped(test, n, &root, extra, |_| Vec::new())
}

/// As [`spawn`], with the root address given and each rank's command prefixed by
/// `wrap(rank)` (e.g. `ip netns exec ns0`).
pub fn spawn_wrapped(
    test: &str,
    n: usize,
    root: &str,
    extra: &[(&str, String)],
    wrap: impl Fn(usize) -> Vec<String>,
) -> Ranks {
    let exe = std::env::current_exe().unwrap();
    let mut children = Vec::new();
    for r in 0..n {
        let prefix = wrap(r);
        let mut c = match prefix.split_first() {
            Some((prog, args)) => {
                let mut c = Command::new(prog);
                c.args(args).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        c.args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env("MSCCLPP_TEST_ROLE", test)
            .env("MSCCLPP_TEST_RANK", r.to_string())
            .env("MSCCLPP_TEST_NRANKS", n.to_string())
            .env("MSCCLPP_TEST_ROOT", root)
            .stdin(Stdio::null());
        for (k, v) in extra {
            c.env(k, v);
        }
        children.push((r, c.spawn().expect("spawning a rank")));
    }
    Ranks { children }
}

impl Ranks {
    /// Waits for every rank; returns each rank's exit status code (None: killed by signal or
    /// by the deadline).
    pub fn wait(self, deadline: Duration) -> Vec<Option<i32>> {
        let t0 = Instant::now();
        self.wait_until(|| t0.elapsed() > deadline)
    }

    /// As [`wait`](Self::wait), with a deadline that moves while the ranks make progress: they
    /// are killed once file `progress` (which a rank rewrites as it goes, see
    /// [`api::progress`]) has not changed for `stall`, or after `cap` in all. For long tests
    /// whose speed depends on the host's load: each hand-off of a 2-rank ping-pong waits for a
    /// CPU-bound neighbour's time slice on a crowded host.
    pub fn wait_progressing(
        self,
        progress: &std::path::Path,
        stall: Duration,
        cap: Duration,
    ) -> Vec<Option<i32>> {
        let t0 = Instant::now();
        let (mut seen, mut moved) = (None, Instant::now());
        self.wait_until(|| {
            let now = std::fs::read(progress).ok();
            if now != seen {
                (seen, moved) = (now, Instant::now());
            }
            moved.elapsed() > stall || t0.elapsed() > cap
        })
    }

    /// Polls the ranks until every one has exited or `expired` says so, then kills the rest.
    fn wait_until(mut self, mut expired: impl FnMut() -> bool) -> Vec<Option<i32>> {
        let mut codes: Vec<Option<Option<i32>>> = vec![None; self.children.len()];
        // Polls until every child has exited or the deadline passes, then kills the rest.
        while codes.iter().any(|c| c.is_none()) {
            for (i, (_, ch)) in self.children.iter_mut().enumerate() {
                if codes[i].is_none() {
                    if let Some(st) = ch.try_wait().unwrap() {
                        codes[i] = Some(st.code());
                    }
                }
            }
            if expired() {
                for (i, (_, ch)) in self.children.iter_mut().enumerate() {
                    if codes[i].is_none() {
                        let _ = ch.kill();
                        let _ = ch.wait();
                        codes[i] = Some(None);
                    }
                }
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        codes.into_iter().map(|c| c.flatten()).collect()
    }

    /// Waits and asserts every rank exited 0.
    pub fn expect_success(self, deadline: Duration) {
        assert_exited_0(self.wait(deadline));
    }
}

/// Asserts that every rank exited 0 (`codes` from [`Ranks::wait`] and its kin).
pub fn assert_exited_0(codes: Vec<Option<i32>>) {
    assert!(
        codes.iter().all(|c| *c == Some(0)),
        "rank exit codes: {codes:?} (None = killed or timed out)"
    );
}

/// Whether fi_getinfo lists an RDM endpoint with RMA writes of provider `name`.
pub fn provider_listed(name: &str) -> Result<(), String> {
    use libfabric_sys as fi;
    let c = std::ffi::CString::new(name).unwrap();
    // SAFETY: fi_allocinfo gives a hints structure with every attribute allocated; we set plain
    // fields and one malloc'd string, which fi_freeinfo frees; `out` is freed the same way.
    unsafe {
        let hints = fi::fi_allocinfo();
        if hints.is_null() {
            return Err("fi_allocinfo failed".into());
        }
        (*hints).caps = fi::FI_RMA as u64 | fi::FI_WRITE as u64 | fi::FI_REMOTE_WRITE as u64;
        (*(*hints).ep_attr).type_ = fi::FI_EP_RDM;
        (*(*hints).fabric_attr).prov_name = libc::strdup(c.as_ptr());
        let mut out: *mut fi::fi_info = std::ptr::null_mut();
        let rc = fi::fi_getinfo(
            fi::FI_VERSION(1, 17),
            std::ptr::null(),
            std::ptr::null(),
            0,
            hints,
            &mut out,
        );
        fi::fi_freeinfo(hints);
        let listed = rc == 0 && !out.is_null();
        if !out.is_null() {
            fi::fi_freeinfo(out);
        }
        if listed {
            Ok(())
        } else {
            Err(format!(
                "fi_getinfo lists no RDM endpoint with RMA writes of provider {name} (rc {rc})"
            ))
        }
    }
}

/// Whether a test over libfabric provider `provider` is to be skipped here: only when the
/// provider is not listed and `MSCCLPP_TEST_ALLOW_MISSING` (comma-separated) names it, as the
/// run against libfabric 2.x does for `net`, which 2.x no longer has. A provider missing
/// without that is the test's failure, never a silent skip.
pub fn skip_missing_provider(test: &str, provider: &str) -> bool {
    let allowed = std::env::var("MSCCLPP_TEST_ALLOW_MISSING").unwrap_or_default();
    if !allowed.split(',').any(|p| p.trim() == provider) {
        return false;
    }
    match provider_listed(provider) {
        Ok(()) => false,
        Err(why) => {
            eprintln!("SKIPPED {test}: {why} (MSCCLPP_TEST_ALLOW_MISSING={allowed})");
            true
        }
    }
}

/// Live threads and open descriptors of this process (entries of `/proc/self/task`, `fd`).
pub fn threads_and_fds() -> (usize, usize) {
    let n = |d: &str| {
        std::fs::read_dir(d)
            .unwrap_or_else(|e| panic!("{d}: {e}"))
            .count()
    };
    (n("/proc/self/task"), n("/proc/self/fd"))
}

/// [`threads_and_fds`] as a baseline: once the thread count has held still for 100 ms, or as
/// it is after 2 s. Threads joined just before (a warm-up's) stay listed in `/proc` a moment
/// (below), and a baseline that counted one made a later, settled count look one short.
pub fn threads_and_fds_steady() -> (usize, usize) {
    let t0 = Instant::now();
    let mut now = threads_and_fds();
    let mut since = Instant::now();
    // Ends: the count holds for 100 ms, or 2 s pass (polling every 10 ms).
    while since.elapsed() < Duration::from_millis(100) && t0.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(10));
        let next = threads_and_fds();
        if next.0 != now.0 {
            since = Instant::now();
        }
        now = next;
    }
    now
}

/// [`threads_and_fds`] once `settled` accepts it, or as it is after `bound`: a joined thread
/// stays listed in `/proc` a moment after join returns (the kernel clears its tid before the
/// task is reaped), so a leak is a count that stays up, not one seen once.
pub fn threads_and_fds_settled(
    bound: Duration,
    settled: impl Fn((usize, usize)) -> bool,
) -> (usize, usize) {
    let t0 = Instant::now();
    let mut now = threads_and_fds();
    // Ends: the counts settle, or the bound passes (polling every 10 ms).
    while !settled(now) && t0.elapsed() < bound {
        std::thread::sleep(Duration::from_millis(10));
        now = threads_and_fds();
    }
    now
}
