//! Helpers shared by the fault-injection, hostile-input and thread tests: file markers between
//! the test parent and its rank processes, bounded waits on children, environment presets, and
//! the fresh exchange a survivor runs to show that the library still works after a failure.
#![allow(dead_code)]

use crate::common::api::*;
use mscclpp::abi::mscclppResult_t;
use mscclpp::capi::comm::*;
use mscclpp::capi::conn::*;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

/// Environment of a rank: transport (`shm`, or a libfabric provider for mscclppTransportIB)
/// and the two timeouts, in seconds.
pub fn rank_env(provider: &str, boot_s: f64, wait_s: f64) -> Vec<(&'static str, String)> {
    let mut v = vec![
        ("MSCCLPP_TEST_TRANSPORT", provider.to_string()),
        ("MSCCLPP_BOOTSTRAP_TIMEOUT", boot_s.to_string()),
        ("MSCCLPP_WAIT_TIMEOUT", wait_s.to_string()),
    ];
    if provider != "shm" {
        v.push(("MSCCLPP_NET_PROVIDER", provider.to_string()));
    }
    v
}

/// A scratch directory for markers, removed on drop.
pub struct Dir(pub PathBuf);

impl Dir {
    pub fn new(test: &str) -> Self {
        let p = std::env::temp_dir().join(format!("mscclpp-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Dir(p)
    }
    pub fn env(&self) -> (&'static str, String) {
        ("MSCCLPP_TEST_DIR", self.0.display().to_string())
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The marker directory of a rank process (from `MSCCLPP_TEST_DIR`).
pub fn dir() -> PathBuf {
    PathBuf::from(std::env::var("MSCCLPP_TEST_DIR").expect("MSCCLPP_TEST_DIR"))
}

/// Creates marker `name` (with `text`) atomically: written aside, then renamed.
pub fn mark_in(dir: &Path, name: &str, text: &str) {
    let tmp = dir.join(format!(".{name}.{}", std::process::id()));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, dir.join(name)).unwrap();
}

pub fn mark(name: &str, text: &str) {
    mark_in(&dir(), name, text)
}

/// Waits until marker `name` exists (polling every 5 ms); its text, or None at the deadline.
pub fn wait_mark_in(dir: &Path, name: &str, bound: Duration) -> Option<String> {
    let t0 = Instant::now();
    // Ends: the marker appears, or the bound passes.
    loop {
        if let Ok(s) = std::fs::read_to_string(dir.join(name)) {
            return Some(s);
        }
        if t0.elapsed() > bound {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

pub fn wait_mark(name: &str, bound: Duration) -> Option<String> {
    wait_mark_in(&dir(), name, bound)
}

/// A counter another process can read at any time: one 8-byte pwrite per update, so a reader
/// (or a SIGKILL) never sees a torn value.
pub struct Counter(std::fs::File);

impl Counter {
    pub fn create(path: &Path) -> Self {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .open(path)
            .unwrap();
        let c = Counter(f);
        c.set(0);
        c
    }
    pub fn set(&self, v: u64) {
        use std::os::unix::fs::FileExt;
        self.0.write_all_at(&v.to_le_bytes(), 0).unwrap();
    }
}

/// Reads a [`Counter`]; 0 when the file is missing.
pub fn read_counter(path: &Path) -> u64 {
    match std::fs::read(path) {
        Ok(b) if b.len() >= 8 => u64::from_le_bytes(b[..8].try_into().unwrap()),
        _ => 0,
    }
}

/// The command of rank `rank` of `n` of test `test`, run alone (like `common::spawn`, one rank
/// at a time, and also for a test marked `#[ignore]`: `common::child_command`).
fn rank_command(
    test: &str,
    rank: usize,
    n: usize,
    root: &str,
    extra: &[(&str, String)],
) -> std::process::Command {
    let mut c = crate::common::child_command(test, "rank");
    c.env("MSCCLPP_TEST_RANK", rank.to_string())
        .env("MSCCLPP_TEST_NRANKS", n.to_string())
        .env("MSCCLPP_TEST_ROOT", root);
    for (k, v) in extra {
        c.env(k, v);
    }
    c
}

/// Starts [`rank_command`].
pub fn spawn_rank(
    test: &str,
    rank: usize,
    n: usize,
    root: &str,
    extra: &[(&str, String)],
) -> Child {
    rank_command(test, rank, n, root, extra)
        .spawn()
        .expect("spawning a rank")
}

/// As [`spawn_rank`], with the library's INFO log on and the rank's stderr passed through this
/// process: the receiver hears once, when a line containing `needle` went by (so the parent
/// can act on what the library did, not on a sleep).
pub fn spawn_rank_watched(
    test: &str,
    rank: usize,
    n: usize,
    root: &str,
    extra: &[(&str, String)],
    needle: &str,
) -> (Child, std::sync::mpsc::Receiver<()>) {
    use std::io::BufRead;
    let mut c = rank_command(test, rank, n, root, extra);
    c.env("MSCCLPP_DEBUG", "INFO")
        .stderr(std::process::Stdio::piped());
    let mut child = c.spawn().expect("spawning a rank");
    let err = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let needle = needle.to_string();
    // Ends when the rank's stderr closes (it exited or was killed).
    std::thread::spawn(move || {
        let mut told = false;
        for line in std::io::BufReader::new(err).lines().map_while(|l| l.ok()) {
            eprintln!("{line}");
            if !told && line.contains(&needle) {
                told = true;
                let _ = tx.send(());
            }
        }
    });
    (child, rx)
}

/// Milliseconds since the Unix epoch: a clock that several processes agree on.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Sends `sig` to process `pid` (a child this test started).
pub fn send_signal(pid: u32, sig: i32) {
    // SAFETY: plain syscall on a pid we own.
    let rc = unsafe { libc::kill(pid as i32, sig) };
    assert_eq!(
        rc,
        0,
        "kill({pid}, {sig}): {}",
        std::io::Error::last_os_error()
    );
}

/// Stops the calling process (every thread of it, as SIGSTOP from outside would) until a
/// SIGCONT.
pub fn stop_self() {
    // SAFETY: plain syscall; SIGSTOP cannot be caught, so no handler of ours runs.
    let rc = unsafe { libc::raise(libc::SIGSTOP) };
    assert_eq!(rc, 0, "raise(SIGSTOP): {}", std::io::Error::last_os_error());
}

/// Waits until process `pid` (a child of this test) is stopped: its state in `/proc/PID/stat`
/// is `T`. False if it is not within `bound`, or is gone.
pub fn wait_stopped(pid: u32, bound: Duration) -> bool {
    let t0 = Instant::now();
    // Ends: the process is stopped, is gone, or the bound passes (polling every millisecond).
    loop {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            return false;
        };
        // "PID (COMM) STATE ...": COMM may hold spaces and parentheses, so the state is the
        // first field after the last ')'.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, r)| r.split_whitespace().next());
        match state {
            Some("T") => return true,
            Some("Z") | Some("X") => return false,
            _ if t0.elapsed() > bound => return false,
            _ => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

/// One rank of a fresh 2-rank communicator at `root`: connects to the other rank over the
/// transport of `MSCCLPP_TEST_TRANSPORT`, sends it 64 KiB, receives its 64 KiB, checks every
/// byte, and tears down cleanly.
pub fn exchange_rank(root: &str, rank: usize, seed: u8) {
    const N: usize = 64 << 10;
    let c = init(root, rank, 2);
    let peer = 1 - rank;
    let mut buf = vec![0u8; 2 * N];
    for i in 0..N {
        buf[rank * N + i] = pattern(rank + seed as usize, i);
    }
    ok(connect(c, peer, 0, &mut buf));
    ok(mscclppConnectionSetup(c));
    ok(mscclppProxyLaunch(c));
    let d = &mut dev_conns(c)[0];
    let off = (rank * N) as u64;
    put_signal(d, off, off, N as u64);
    flush(d);
    wait(d);
    for i in 0..N {
        assert_eq!(
            buf[peer * N + i],
            pattern(peer + seed as usize, i),
            "fresh exchange: byte {i} from rank {peer}"
        );
    }
    ok(mscclppBootstrapBarrier(c));
    ok(mscclppProxyStop(c));
    ok(mscclppCommDestroy(c));
}

/// A fresh 2-rank communicator inside this process (ranks as threads) over the transport of
/// `MSCCLPP_TEST_TRANSPORT`: shows that the library works after an earlier failure here.
pub fn fresh_exchange_in_process() {
    let root = format!("127.0.0.1:{}", crate::common::free_port());
    let t0 = Instant::now();
    let hs: Vec<_> = (0..2)
        .map(|r| {
            let root = root.clone();
            std::thread::spawn(move || exchange_rank(&root, r, 77))
        })
        .collect();
    for h in hs {
        h.join().expect("fresh exchange rank panicked");
    }
    println!("fresh in-process exchange done in {:?}", t0.elapsed());
}

/// The result code of `f` with the time it took.
pub fn timed(f: impl FnOnce() -> mscclppResult_t) -> (mscclppResult_t, Duration) {
    let t0 = Instant::now();
    let r = f();
    (r, t0.elapsed())
}
