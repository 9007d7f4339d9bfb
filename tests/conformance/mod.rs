//! The `Endpoint` conformance suite's harness: what an endpoint under test is ([`Opener`]), its
//! memory ([`Mem`]: host words, or CUDA device memory for P2P), a group of endpoints in one
//! process ([`Group`]: one driven by the test thread, the others progressed by a thread of
//! their own as their proxies would), and [`run`], which runs one case over one opener in a
//! child process with the opener's environment. The cases are in `cases.rs`.
#![allow(dead_code)]

pub mod cases;

use crate::common::{child_command, child_role, output_within};
use mscclpp::cuda::{CtxGuard, DeviceMem, PinnedHost, Stream};
use mscclpp::error::Result;
use mscclpp::transport::{Endpoint, MemKind, MrId, PeerId, Region, RemoteId};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Longest wait of a case for anything (a flag, a peer thread); the endpoints' own waits are
/// bounded shorter by MSCCLPP_WAIT_TIMEOUT (see [`run`]).
pub const DEADLINE: Duration = Duration::from_secs(30);
/// Longest run of one case's child process, killed then.
const CHILD_DEADLINE: Duration = Duration::from_secs(180);

/// One kind of endpoint under test.
pub struct Opener {
    /// Environment of the child process the cases run in; the transport variables not named
    /// here are removed (see [`run`]).
    pub env: &'static [(&'static str, &'static str)],
    pub open: fn() -> Result<Box<dyn Endpoint>>,
    /// Where its regions live.
    pub mem: MemKind,
    /// A transfer larger than its largest single one (chunk, staging ring, SM-engine job).
    pub big: usize,
    /// A libfabric endpoint: argument errors are `Error::InvalidArgument` and zero-byte
    /// writes are refused too, regions of zero bytes or at address 0 are refused, device
    /// memory is refused on a host endpoint, and region blobs have the `net::blob` layout.
    pub libfabric: bool,
    /// Lines of the library's log (MSCCLPP_DEBUG=INFO) that show the mode under test ran: each
    /// must appear somewhere in the case's output.
    pub proof: &'static [&'static str],
    /// Why it cannot open on this machine (checked in the parent; the case is then skipped
    /// with that reason printed), or Ok.
    pub available: fn() -> std::result::Result<(), String>,
}

impl Opener {
    pub fn open(&self) -> Box<dyn Endpoint> {
        (self.open)().unwrap_or_else(|e| panic!("opening the endpoint: {e}"))
    }
    pub fn alloc(&self, len: usize) -> Mem {
        match self.mem {
            MemKind::Host => Mem::host(len),
            MemKind::Device(d) => Mem::device(d, len),
        }
    }
}

/// Variables that choose or shape a transport: a case's child sees only those its opener sets.
const TRANSPORT_VARS: &[&str] = &[
    "FI_PROVIDER",
    "MSCCLPP_NET_PROVIDER",
    "MSCCLPP_NET_IFACE",
    "MSCCLPP_NET_ADDR",
    "MSCCLPP_NET_MAX_CHUNK",
    "MSCCLPP_NET_TX_DEPTH",
    "MSCCLPP_NET_DELIVERY_COMPLETE",
    "MSCCLPP_NET_HMEM",
    "MSCCLPP_NET_STAGING_BYTES",
    "MSCCLPP_NET_STAGING_SLOTS",
    "MSCCLPP_NET_STAGING_CHUNK",
    "MSCCLPP_NET_STRIPE_CHUNK",
    "MSCCLPP_NET_RAILS",
    "MSCCLPP_TEST_FORCE_STAGING",
    "MSCCLPP_TEST_FORCE_MR_ENDPOINT",
    "MSCCLPP_TEST_UNORDERED",
    "MSCCLPP_P2P_SM_MAX_BYTES",
    "MSCCLPP_P2P_FLAG",
];

/// Test `<opener>::<case>`: in the parent, skips (saying why) when the opener cannot open
/// here, else runs the test again alone in a child with the opener's environment and checks
/// that it passed; in that child, runs the case.
pub fn run(opener: &str, o: Opener, case: &str, body: fn(&Opener)) {
    let test = format!("{opener}::{case}");
    if child_role(&test).is_some() {
        body(&o);
        println!("CASE {test} OK");
        return;
    }
    if let Err(why) = (o.available)() {
        println!("SKIPPED {test}: {why}");
        return;
    }
    let mut cmd = child_command(&test, "case");
    for k in TRANSPORT_VARS {
        cmd.env_remove(k);
    }
    // Every wait inside the endpoints ends well before the case's own deadlines; the log
    // shows what the endpoints are (`Opener::proof`).
    cmd.env("MSCCLPP_WAIT_TIMEOUT", "20")
        .env("MSCCLPP_DEBUG", "INFO");
    for (k, v) in o.env {
        cmd.env(k, v);
    }
    let t0 = Instant::now();
    let (status, text) = output_within(cmd, CHILD_DEADLINE);
    assert!(
        status.is_some_and(|s| s.success()) && text.contains(&format!("CASE {test} OK")),
        "{test} failed after {:?} ({status:?}, None = killed at the deadline):\n{text}",
        t0.elapsed()
    );
    for p in o.proof {
        assert!(
            text.contains(p),
            "{test}: the log does not show {p:?}, so the mode under test did not run:\n{text}"
        );
    }
}

// ---- memory -----------------------------------------------------------------------------------

/// A buffer an endpoint registers: host memory (read and written as 64-bit atomics, since peers
/// write it behind our back), or CUDA device memory read and written through copies.
pub struct Mem {
    len: usize,
    kind: Kind,
}

enum Kind {
    Host(Box<[AtomicU64]>),
    Device {
        mem: DeviceMem,
        stream: Stream,
        /// Pinned host memory that reads copy through (one read at a time).
        stage: Mutex<PinnedHost>,
    },
}

impl Mem {
    pub fn host(len: usize) -> Self {
        let words = (0..len.div_ceil(8)).map(|_| AtomicU64::new(0)).collect();
        Mem {
            len,
            kind: Kind::Host(words),
        }
    }

    pub fn device(device: i32, len: usize) -> Self {
        let mem = DeviceMem::zeroed(device, len).expect("device memory");
        let stream = Stream::new(device).expect("a stream");
        let stage = Mutex::new(PinnedHost::zeroed(device, len.max(8)).expect("pinned memory"));
        Mem {
            len,
            kind: Kind::Device { mem, stream, stage },
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The whole buffer, exactly `len` bytes.
    pub fn region(&self) -> Region {
        let (addr, kind) = match &self.kind {
            Kind::Host(w) => (w.as_ptr() as u64, MemKind::Host),
            Kind::Device { mem, .. } => (mem.ptr(), MemKind::Device(mem.device())),
        };
        Region {
            addr,
            len: self.len as u64,
            kind,
        }
    }

    /// Stores `bytes` at `off` (nothing may write these bytes meanwhile).
    pub fn write(&self, off: usize, bytes: &[u8]) {
        assert!(off + bytes.len() <= self.len);
        match &self.kind {
            Kind::Host(w) => {
                let end = off + bytes.len();
                for (k, word) in w.iter().enumerate().take(end.div_ceil(8)).skip(off / 8) {
                    let mut v = word.load(Ordering::Relaxed).to_ne_bytes();
                    for (j, b) in v.iter_mut().enumerate() {
                        if (off..end).contains(&(k * 8 + j)) {
                            *b = bytes[k * 8 + j - off];
                        }
                    }
                    word.store(u64::from_ne_bytes(v), Ordering::Release);
                }
            }
            Kind::Device { mem, stream, .. } => {
                let _g = CtxGuard::enter(mem.device()).unwrap();
                stream.upload(mem.ptr() + off as u64, bytes).unwrap();
            }
        }
    }

    pub fn fill(&self, byte: u8) {
        self.write(0, &vec![byte; self.len]);
    }

    /// The bytes at `off..off + len`, as they are now.
    pub fn read(&self, off: usize, len: usize) -> Vec<u8> {
        assert!(off + len <= self.len);
        match &self.kind {
            Kind::Host(w) => {
                let words: Vec<u8> = w[off / 8..(off + len).div_ceil(8)]
                    .iter()
                    .flat_map(|x| x.load(Ordering::Acquire).to_ne_bytes())
                    .collect();
                words[off % 8..off % 8 + len].to_vec()
            }
            Kind::Device { mem, stream, stage } => {
                let stage = stage.lock().unwrap();
                let _g = CtxGuard::enter(mem.device()).unwrap();
                stream
                    .copy(stage.dev(), mem.ptr() + off as u64, len as u64, false)
                    .unwrap();
                stream.wait(|| "reading device memory back".into()).unwrap();
                // SAFETY: the copy into the pinned block (at least `len` bytes) has completed.
                unsafe { std::slice::from_raw_parts(stage.host(), len) }.to_vec()
            }
        }
    }

    /// The 8-byte word `i`, read at once (never torn).
    pub fn word(&self, i: usize) -> u64 {
        match &self.kind {
            Kind::Host(w) => w[i].load(Ordering::Acquire),
            Kind::Device { .. } => u64::from_ne_bytes(self.read(i * 8, 8).try_into().unwrap()),
        }
    }
}

/// Byte `i` of the pattern of round `seed`: differs between neighbouring bytes, rounds, and
/// positions 256 bytes or a chunk apart.
pub fn pattern(seed: u64, i: usize) -> u8 {
    ((i as u64 ^ seed << 40).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8
}

pub fn pattern_bytes(seed: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| pattern(seed, i)).collect()
}

/// Asserts `got == want`, naming the first differing byte instead of printing both.
#[track_caller]
pub fn assert_bytes(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        let bad = (i..got.len()).filter(|&j| got[j] != want[j]).count();
        panic!(
            "{what}: byte {i} is {:#04x}, want {:#04x} ({bad} bytes differ from there on, of {})",
            got[i],
            want[i],
            got.len()
        );
    }
}

// ---- endpoints --------------------------------------------------------------------------------

pub type Shared = Arc<Mutex<Box<dyn Endpoint>>>;

/// A target endpoint: rank `k + 1`, progressed in the background.
pub struct Target {
    pub ep: Shared,
    /// Its id for the driven endpoint (rank 0).
    pub to_a: PeerId,
}

/// Endpoint `a` (rank 0, driven by the test thread) and targets of ranks 1..=n, each a peer of
/// `a`, connected as connection setup does (addresses, then links). One thread progresses the targets
/// (`progress` and `poll_incoming`, as a proxy does when idle) until the group drops.
pub struct Group {
    pub a: Box<dyn Endpoint>,
    /// `a`'s id of target k.
    pub peers: Vec<PeerId>,
    pub targets: Vec<Target>,
    stop: Arc<AtomicBool>,
    failed: Arc<Mutex<Option<String>>>,
    progress: Option<JoinHandle<()>>,
}

impl Group {
    pub fn new(o: &Opener, n: usize) -> Self {
        let mut a = o.open();
        let mut peers = Vec::new();
        let mut targets = Vec::new();
        for k in 0..n {
            let rank = k + 1;
            let mut t = o.open();
            // Each side adds the other, then takes the link the other made for it (its staging
            // channel, where it stages; its counting stream, where signals are counted).
            let (a_addr, t_addr) = (a.address().unwrap(), t.address().unwrap());
            let pa = a.add_peer(rank, &t_addr).unwrap();
            let to_a = t.add_peer(0, &a_addr).unwrap();
            let (la, lt) = (a.link_for(pa).unwrap(), t.link_for(to_a).unwrap());
            a.link_to(pa, &lt).unwrap();
            t.link_to(to_a, &la).unwrap();
            peers.push(pa);
            targets.push(Target {
                ep: Arc::new(Mutex::new(t)),
                to_a,
            });
        }
        let stop = Arc::new(AtomicBool::new(false));
        let failed = Arc::new(Mutex::new(None));
        let (eps, stop2, failed2): (Vec<Shared>, _, _) = (
            targets.iter().map(|t| t.ep.clone()).collect(),
            stop.clone(),
            failed.clone(),
        );
        let progress = std::thread::spawn(move || {
            // Ends when the group drops (Release there, Acquire here), or at an error.
            while !stop2.load(Ordering::Acquire) {
                for (k, ep) in eps.iter().enumerate() {
                    let mut ep = ep.lock().unwrap();
                    if let Err(e) = ep.progress().and_then(|_| ep.poll_incoming()) {
                        *failed2.lock().unwrap() = Some(format!("target {k}: {e}"));
                        return;
                    }
                }
                std::thread::yield_now();
            }
        });
        Group {
            a,
            peers,
            targets,
            stop,
            failed,
            progress: Some(progress),
        }
    }

    /// The first peer of `a` (target 0).
    pub fn p(&self) -> PeerId {
        self.peers[0]
    }

    /// Fails when the targets' progress thread stopped at an error.
    pub fn check_targets(&self) {
        if let Some(e) = self.failed.lock().unwrap().as_ref() {
            panic!("progressing the targets failed: {e}");
        }
    }

    /// One round of `a`'s idle work, as its proxy does.
    pub fn progress_a(&mut self) {
        self.a.progress().unwrap();
        self.a.poll_incoming().unwrap();
    }

    /// Registers `mem` on `a` as a source.
    pub fn source(&mut self, mem: &Mem) -> MrId {
        self.a.register(mem.region()).unwrap().0
    }

    /// Registers `mem` on target `k` and imports it on `a`.
    pub fn target_region(&mut self, k: usize, mem: &Mem) -> RemoteId {
        let (_, blob) = self.targets[k]
            .ep
            .lock()
            .unwrap()
            .register(mem.region())
            .unwrap();
        self.a.import(self.peers[k], &blob).unwrap()
    }

    /// Waits until word `i` of `mem` is at least `want`, progressing `a`; fails at
    /// [`DEADLINE`].
    pub fn wait_word(&mut self, mem: &Mem, i: usize, want: u64, what: &str) {
        let t0 = Instant::now();
        // Ends when the word gets there, or fails at the deadline.
        while mem.word(i) < want {
            self.progress_a();
            self.check_targets();
            assert!(
                t0.elapsed() < DEADLINE,
                "{what}: word {i} is {} after {DEADLINE:?}, want {want}",
                mem.word(i)
            );
            std::thread::yield_now();
        }
    }

    /// As [`Group::wait_word`], for a word that thread `h` (which returns why it failed)
    /// writes: fails at once with that thread's own error if it ends first, instead of
    /// waiting out the deadline and hiding it.
    pub fn wait_word_from(
        &mut self,
        mem: &Mem,
        i: usize,
        want: u64,
        what: &str,
        h: &mut Option<JoinHandle<Result<(), String>>>,
    ) {
        let t0 = Instant::now();
        // Ends when the word gets there, fails when the thread ended without it, or at the
        // deadline.
        while mem.word(i) < want {
            self.progress_a();
            self.check_targets();
            if h.as_ref().is_some_and(|t| t.is_finished()) && mem.word(i) < want {
                let r = h.take().unwrap().join().unwrap();
                panic!(
                    "{what}: word {i} is {}, want {want}, and the thread writing it ended: {r:?}",
                    mem.word(i)
                );
            }
            assert!(
                t0.elapsed() < DEADLINE,
                "{what}: word {i} is {} after {DEADLINE:?}, want {want}",
                mem.word(i)
            );
            std::thread::yield_now();
        }
    }

    /// Runs `f` on target `k`'s endpoint (its id for `a` given) on a thread of its own, while
    /// this thread progresses `a` (what `f`'s writes and flushes to `a` need); returns `f`'s
    /// result. Fails at [`DEADLINE`].
    pub fn on_target<T: Send + 'static>(
        &mut self,
        k: usize,
        f: impl FnOnce(&mut dyn Endpoint, PeerId) -> T + Send + 'static,
    ) -> T {
        let (ep, to_a) = (self.targets[k].ep.clone(), self.targets[k].to_a);
        let h = std::thread::spawn(move || f(&mut **ep.lock().unwrap(), to_a));
        self.progress_until(&h, "a target's thread");
        h.join().unwrap()
    }

    /// Progresses `a` until thread `h` has finished; fails at [`DEADLINE`].
    pub fn progress_until<T>(&mut self, h: &JoinHandle<T>, what: &str) {
        let t0 = Instant::now();
        // Ends when the thread is done, or fails at the deadline.
        while !h.is_finished() {
            self.progress_a();
            assert!(
                t0.elapsed() < DEADLINE,
                "{what} still runs after {DEADLINE:?}"
            );
            std::thread::yield_now();
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.progress.take() {
            let _ = h.join();
        }
    }
}
