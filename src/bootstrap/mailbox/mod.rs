//! The receiving half of a rank: one thread accepts connections on the rank's listener,
//! authenticates them (magic and sender rank in an `Open` frame), reads whole frames and files
//! them by (kind, sender, tag). Because it always drains its sockets, a `send` never waits for
//! the receiver to call `recv`.
//!
//! It also watches the rank's outgoing connections: a peer never writes on those, so when one
//! becomes readable the peer has closed it (exited, or dropped its communicator).
//!
//! Peer loss: a peer that destroys its communicator sends `Bye` before closing its connection
//! to us; an incoming connection that ends any other way (EOF without `Bye`, an error, a
//! malformed frame) is recorded as a loss. The owner reads losses of the peers it watches with
//! [`Mailbox::lost_peer`], which costs one atomic load while nothing was lost.
//!
//! Hang reports: the thread answers a peer's `ReportAsk` itself, with what the owner's
//! [`ReportSource`] says, on the connection the question came on; so a rank whose user threads
//! and kernels are stuck still answers. The answers to this rank's own questions come back on
//! its outgoing connections, which the thread watches anyway, and are filed like messages.
//!
//! The thread is `reader.rs`; this file is the owner's side: the state both share and the calls
//! that file, take and wait on it.

mod reader;

use super::frame::Kind;
use crate::error::{Error, Result};
use crate::sync::lock;
use reader::Reader;
use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// (frame kind, sender rank, tag).
pub(crate) type Key = (Kind, usize, u64);

/// Builds this rank's hang report when a peer asks (`Kind::ReportAsk`), on the mailbox's
/// thread: it must answer within milliseconds and never wait for a lock that a stuck thread
/// may hold (`comm::hang`). At most `frame::MAX_REPORT_LEN` bytes; longer is sent empty.
pub type ReportSource = Arc<dyn Fn() -> Vec<u8> + Send + Sync>;

#[derive(Default)]
struct State {
    msgs: HashMap<Key, VecDeque<Vec<u8>>>,
    /// Per peer: bytes of its tagged (`P2p`) messages filed and not yet taken, bounded by the
    /// quota (`MSCCLPP_BOOTSTRAP_QUOTA_MB`; the reader drops a peer that goes over).
    buffered: Vec<u64>,
    /// Per peer: why nothing more will come from it.
    gone: Vec<Option<String>>,
    /// A peer gave up on the whole communicator (its Abort), or the reader failed.
    aborted: Option<String>,
    /// Per peer: a `Watch` frame arrived from it, so its connection to us exists.
    watch_in: Vec<bool>,
    /// Per peer: the owner asked to hear of its loss ([`Mailbox::watch_mark`]).
    watched: Vec<bool>,
    /// Peers whose incoming connection ended without a `Bye`, in the order seen, with why.
    lost: Vec<(usize, String)>,
    new_watches: Vec<(usize, TcpStream)>,
    /// The number of this rank's latest hang-report request (`Kind::ReportAsk` tag): only
    /// answers to it are filed, so a peer cannot make this rank keep reports nobody waits for.
    report_asked: u64,
    stop: bool,
    close_all: bool,
}

impl State {
    /// Takes the oldest message filed under `key`, releasing its bytes from the sender's quota
    /// of unread tagged messages.
    fn pop(&mut self, key: Key) -> Option<Vec<u8>> {
        let q = self.msgs.get_mut(&key)?;
        let m = q.pop_front();
        if q.is_empty() {
            self.msgs.remove(&key);
        }
        let m = m?;
        if key.0 == Kind::P2p && key.1 < self.buffered.len() {
            self.buffered[key.1] = self.buffered[key.1].saturating_sub(m.len() as u64);
        }
        Some(m)
    }
}

struct Shared {
    st: Mutex<State>,
    /// Signalled (notify_all) whenever `msgs`, `gone`, `aborted` or `watch_in` change.
    cv: Condvar,
    /// Set (Release) once `st.lost` is non-empty, so that the frequent "anything lost?" check
    /// of a proxy thread is one atomic load (Acquire) and never waits on the reader's lock.
    lost_any: AtomicBool,
    /// Answers peers' `ReportAsk`s; None: answered with an empty report.
    report: Mutex<Option<ReportSource>>,
}

pub(crate) struct Mailbox {
    shared: Arc<Shared>,
    wake: UnixStream,
    thread: Option<JoinHandle<()>>,
    rank: usize,
}

impl Mailbox {
    pub(crate) fn start(
        listener: TcpListener,
        magic: u64,
        rank: usize,
        nranks: usize,
        timeout: Duration,
    ) -> Result<Mailbox> {
        let ctx = |what: &str| format!("rank {rank}: bootstrap reader: {what}");
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::sys(ctx("set_nonblocking"), e))?;
        let (wake, wake_rx) = UnixStream::pair().map_err(|e| Error::sys(ctx("socketpair"), e))?;
        wake.set_nonblocking(true)
            .and_then(|_| wake_rx.set_nonblocking(true))
            .map_err(|e| Error::sys(ctx("set_nonblocking"), e))?;
        let shared = Arc::new(Shared {
            st: Mutex::new(State {
                gone: vec![None; nranks],
                buffered: vec![0; nranks],
                watch_in: vec![false; nranks],
                watched: vec![false; nranks],
                ..State::default()
            }),
            cv: Condvar::new(),
            lost_any: AtomicBool::new(false),
            report: Mutex::new(None),
        });
        let reader = Reader::new(
            shared.clone(),
            listener,
            wake_rx,
            magic,
            rank,
            nranks,
            timeout,
        );
        let thread = std::thread::Builder::new()
            .name(format!("mscclpp-boot-r{rank}"))
            .spawn(move || reader.run())
            .map_err(|e| Error::sys(ctx("spawning its thread"), e))?;
        Ok(Mailbox {
            shared,
            wake,
            thread: Some(thread),
            rank,
        })
    }

    fn poke(&self) {
        // A full socket buffer means a wake-up is already pending, so WouldBlock is fine.
        let _ = (&self.wake).write(&[1]);
    }

    /// Files a message this rank sent to itself.
    pub(crate) fn put_local(&self, kind: Kind, tag: u64, data: Vec<u8>) {
        let mut st = lock(&self.shared.st);
        st.msgs
            .entry((kind, self.rank, tag))
            .or_default()
            .push_back(data);
        self.shared.cv.notify_all();
    }

    /// Takes the oldest message filed under `key`, waiting until the deadline. Fails at once
    /// when the sender is gone or the communicator was aborted.
    pub(crate) fn take(
        &self,
        key: Key,
        deadline: Instant,
        timeout: Duration,
        what: &dyn Fn() -> String,
    ) -> Result<Vec<u8>> {
        let peer = key.1;
        let waiting = || format!("nothing arrived from rank {peer}");
        self.wait_for(peer, deadline, timeout, what, &waiting, |st| st.pop(key))
    }

    /// As [`Mailbox::take`], but a peer whose connection closed before the message came is an
    /// answer too (`Ok(None)`), not an error.
    pub(crate) fn take_unless_gone(
        &self,
        key: Key,
        deadline: Instant,
        timeout: Duration,
        what: &dyn Fn() -> String,
    ) -> Result<Option<Vec<u8>>> {
        let peer = key.1;
        let waiting = || format!("nothing arrived from rank {peer}");
        self.wait_for(peer, deadline, timeout, what, &waiting, |st| {
            match st.pop(key) {
                Some(m) => Some(Some(m)),
                None => st.gone[peer].is_some().then_some(None),
            }
        })
    }

    /// Waits until `peer`'s `Watch` frame has arrived (its connection to us exists and is
    /// authenticated), until the deadline. Fails at once when the peer is gone or the
    /// communicator was aborted.
    pub(crate) fn wait_watch(
        &self,
        peer: usize,
        deadline: Instant,
        timeout: Duration,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        let waiting = || {
            format!("rank {peer} did not open its connection to this rank (did it call watch_peers with this rank?)")
        };
        self.wait_for(peer, deadline, timeout, what, &waiting, |st| {
            st.watch_in[peer].then_some(())
        })
    }

    /// Waits until `ready` finds what it needs in the state (it runs under the lock, at once
    /// and after every change), failing at once when `peer` is gone, the communicator was
    /// aborted or the reader stopped, and at the deadline with a timeout saying `waiting()`.
    fn wait_for<T>(
        &self,
        peer: usize,
        deadline: Instant,
        timeout: Duration,
        what: &dyn Fn() -> String,
        waiting: &dyn Fn() -> String,
        mut ready: impl FnMut(&mut State) -> Option<T>,
    ) -> Result<T> {
        self.wait_state(deadline, |st| {
            if let Some(t) = ready(st) {
                return Some(Ok(t));
            }
            if let Some(a) = &st.aborted {
                return Some(Err(Error::remote(format!("{}: {a}", what()))));
            }
            if let Some(g) = &st.gone[peer] {
                return Some(Err(Error::remote(format!("{}: rank {peer} {g}", what()))));
            }
            if st.stop {
                return Some(Err(Error::internal(format!(
                    "{}: bootstrap reader stopped",
                    what()
                ))));
            }
            None
        })
        .unwrap_or_else(|| {
            Err(Error::timeout(
                format!("{}: {}", what(), waiting()),
                timeout,
            ))
        })
    }

    /// Runs `check` under the state's lock, at once and after every change the reader makes,
    /// until it gives an answer; None once the deadline passes without one.
    fn wait_state<R>(
        &self,
        deadline: Instant,
        mut check: impl FnMut(&mut State) -> Option<R>,
    ) -> Option<R> {
        let mut st = lock(&self.shared.st);
        // Ends: `check` answers, or the deadline passes (each wait_timeout is bounded by it).
        loop {
            if let Some(r) = check(&mut st) {
                return Some(r);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            // Notified (cv) whenever the reader changes the state (files a message, a peer
            // goes, the reader stops).
            st = self
                .shared
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Adds peers to the set whose loss [`Mailbox::lost_peer`] reports.
    pub(crate) fn watch_mark(&self, peers: &[usize]) {
        let mut st = lock(&self.shared.st);
        for &p in peers {
            st.watched[p] = true;
        }
    }

    /// The first watched peer whose incoming connection ended without a `Bye`, and why; with
    /// `among`, the first such peer of those listed (each loss is kept, not only the first).
    pub(crate) fn lost_peer(&self, among: Option<&[usize]>) -> Option<(usize, String)> {
        if !self.shared.lost_any.load(Ordering::Acquire) {
            return None;
        }
        let st = lock(&self.shared.st);
        st.lost
            .iter()
            .find(|(p, _)| st.watched[*p] && among.is_none_or(|a| a.contains(p)))
            .cloned()
    }

    /// Asks the reader to watch an outgoing connection to `peer` for closure.
    pub(crate) fn watch(&self, peer: usize, s: TcpStream) {
        lock(&self.shared.st).new_watches.push((peer, s));
        self.poke();
    }

    /// Closes every connection (incoming and watched) and refuses new ones: peers see this
    /// rank disappear, which is how a failure travels to ranks that wait on it.
    pub(crate) fn close_all(&self) {
        lock(&self.shared.st).close_all = true;
        self.poke();
    }

    /// Sets what answers peers' hang-report requests (None: an empty report).
    pub(crate) fn set_report_source(&self, f: Option<ReportSource>) {
        *lock(&self.shared.report) = f;
    }

    /// Starts a new hang-report request: its number, the tag of its `ReportAsk`s. Answers to
    /// earlier requests still filed are dropped, and late ones are no longer filed.
    pub(crate) fn begin_report(&self) -> u64 {
        let mut st = lock(&self.shared.st);
        st.report_asked += 1;
        st.msgs.retain(|k, _| k.0 != Kind::Report);
        st.report_asked
    }

    /// Why `peer`'s messages can no longer come (it died, said goodbye, or was dropped), if so.
    pub(crate) fn gone(&self, peer: usize) -> Option<String> {
        let st = lock(&self.shared.st);
        if let Some((_, why)) = st.lost.iter().find(|(p, _)| *p == peer) {
            return Some(format!("lost: {why}"));
        }
        st.gone[peer].as_ref().map(|g| format!("rank {peer} {g}"))
    }

    /// Every peer whose incoming connection ended without a goodbye (watched or not), with why.
    pub(crate) fn lost_peers(&self) -> Vec<(usize, String)> {
        if !self.shared.lost_any.load(Ordering::Acquire) {
            return Vec::new();
        }
        lock(&self.shared.st).lost.clone()
    }

    /// Waits until the deadline for `peer`'s answer to hang-report request `asked`; the error
    /// says why none came (the peer is gone, or said nothing in time).
    pub(crate) fn take_report(
        &self,
        peer: usize,
        asked: u64,
        deadline: Instant,
        bound: Duration,
    ) -> std::result::Result<Vec<u8>, String> {
        // Ends: the answer is filed, the peer is gone, the reader stopped, or the deadline
        // passes. An aborted bootstrap does not end it: peers still answer while their
        // connections last.
        self.wait_state(deadline, |st| {
            if let Some(m) = st.pop((Kind::Report, peer, asked)) {
                return Some(Ok(m));
            }
            if let Some((_, why)) = st.lost.iter().find(|(p, _)| *p == peer) {
                return Some(Err(format!("lost: {why}")));
            }
            if let Some(g) = &st.gone[peer] {
                return Some(Err(format!("rank {peer} {g}")));
            }
            if st.stop {
                return Some(Err("this rank's bootstrap reader stopped".into()));
            }
            None
        })
        .unwrap_or_else(|| {
            Err(format!(
                "not within {bound:?} (its process stopped, or its host unreachable?)"
            ))
        })
    }

    pub(crate) fn aborted(&self) -> Option<String> {
        lock(&self.shared.st).aborted.clone()
    }
}

impl Drop for Mailbox {
    fn drop(&mut self) {
        lock(&self.shared.st).stop = true;
        self.poke();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
