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

use super::frame::{Assembler, Expect, Kind};
use super::net;
use crate::error::{Error, Result};
use crate::sync::lock;
use std::collections::{HashMap, VecDeque};
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// (frame kind, sender rank, tag).
pub(crate) type Key = (Kind, usize, u64);

#[derive(Default)]
struct State {
    msgs: HashMap<Key, VecDeque<Vec<u8>>>,
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
    stop: bool,
    close_all: bool,
}

struct Shared {
    st: Mutex<State>,
    /// Signalled (notify_all) whenever `msgs`, `gone`, `aborted` or `watch_in` change.
    cv: Condvar,
    /// Set (Release) once `st.lost` is non-empty, so that the frequent "anything lost?" check
    /// of a proxy thread is one atomic load (Acquire) and never waits on the reader's lock.
    lost_any: AtomicBool,
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
                watch_in: vec![false; nranks],
                watched: vec![false; nranks],
                ..State::default()
            }),
            cv: Condvar::new(),
            lost_any: AtomicBool::new(false),
        });
        let reader = Reader {
            shared: shared.clone(),
            listener,
            wake: wake_rx,
            magic,
            rank,
            nranks,
            timeout,
            conns: Vec::new(),
            watches: Vec::new(),
            in_closed: vec![None; nranks],
            out_closed: vec![false; nranks],
            closed: false,
            buf: vec![0; 64 << 10],
        };
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
        let mut st = lock(&self.shared.st);
        // Ends: a message arrives, the peer is gone, the communicator aborted, the reader
        // stopped, or the deadline passes (wait_timeout is bounded by it).
        loop {
            if let Some(q) = st.msgs.get_mut(&key) {
                if let Some(m) = q.pop_front() {
                    if q.is_empty() {
                        st.msgs.remove(&key);
                    }
                    return Ok(m);
                }
            }
            if let Some(a) = &st.aborted {
                return Err(Error::remote(format!("{}: {a}", what())));
            }
            if let Some(g) = &st.gone[peer] {
                return Err(Error::remote(format!("{}: rank {peer} {g}", what())));
            }
            if st.stop {
                return Err(Error::internal(format!(
                    "{}: bootstrap reader stopped",
                    what()
                )));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::timeout(
                    format!("{}: nothing arrived from rank {peer}", what()),
                    timeout,
                ));
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
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
        let mut st = lock(&self.shared.st);
        // Ends: the Watch arrives, the peer is gone, the communicator aborted, the reader
        // stopped, or the deadline passes (wait_timeout is bounded by it).
        loop {
            if st.watch_in[peer] {
                return Ok(());
            }
            if let Some(a) = &st.aborted {
                return Err(Error::remote(format!("{}: {a}", what())));
            }
            if let Some(g) = &st.gone[peer] {
                return Err(Error::remote(format!("{}: rank {peer} {g}", what())));
            }
            if st.stop {
                return Err(Error::internal(format!(
                    "{}: bootstrap reader stopped",
                    what()
                )));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::timeout(
                    format!(
                        "{}: rank {peer} did not open its connection to this rank (did it call watch_peers with this rank?)",
                        what()
                    ),
                    timeout,
                ));
            }
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

    /// The first watched peer whose incoming connection ended without a `Bye`, and why.
    pub(crate) fn lost_peer(&self) -> Option<(usize, String)> {
        if !self.shared.lost_any.load(Ordering::Acquire) {
            return None;
        }
        let st = lock(&self.shared.st);
        st.lost.iter().find(|(p, _)| st.watched[*p]).cloned()
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

struct Conn {
    s: TcpStream,
    from: SocketAddr,
    /// Set by the connection's `Open` frame.
    peer: Option<usize>,
    asm: Assembler,
    /// An unauthenticated connection is dropped at this time.
    auth_by: Instant,
    /// The peer said `Bye`: its closing is deliberate, and nothing more may come.
    bye: bool,
    /// The peer sent `Abort` on it (its closing follows from that failure).
    aborted: bool,
}

struct Reader {
    shared: Arc<Shared>,
    listener: TcpListener,
    wake: UnixStream,
    magic: u64,
    rank: usize,
    nranks: usize,
    timeout: Duration,
    conns: Vec<Conn>,
    watches: Vec<(usize, TcpStream)>,
    in_closed: Vec<Option<String>>,
    out_closed: Vec<bool>,
    /// After `close_all`: new connections are refused.
    closed: bool,
    buf: Vec<u8>,
}

/// Most bytes read from one connection per wake-up, so that one busy sender cannot starve
/// the others.
const READ_BUDGET: usize = 1 << 20;

impl Reader {
    fn run(mut self) {
        // Ends: when `stop` is set (Mailbox::drop), when the wake socket's other end closes,
        // or when poll fails (recorded as an abort so that waiters fail instead of hanging).
        loop {
            let close = {
                let mut st = lock(&self.shared.st);
                if st.stop {
                    return;
                }
                self.watches.append(&mut st.new_watches);
                std::mem::take(&mut st.close_all)
            };
            if close && !self.closed {
                self.closed = true;
                for c in self.conns.drain(..) {
                    let _ = c.s.shutdown(Shutdown::Both);
                }
                for (_, w) in self.watches.drain(..) {
                    let _ = w.shutdown(Shutdown::Both);
                }
            }
            if self.closed {
                self.watches.clear();
            }
            let now = Instant::now();
            let (rank, timeout) = (self.rank, self.timeout);
            self.conns.retain(|c| {
                let keep = c.peer.is_some() || c.auth_by > now;
                if !keep {
                    crate::warn!(
                        "rank {rank}: dropping bootstrap connection from {}: not authenticated within {timeout:?}",
                        c.from
                    );
                }
                keep
            });
            let wait = self
                .conns
                .iter()
                .filter(|c| c.peer.is_none())
                .map(|c| c.auth_by.saturating_duration_since(now))
                .min();
            let mut fds = vec![net::pollfd(&self.wake), net::pollfd(&self.listener)];
            fds.extend(self.conns.iter().map(|c| net::pollfd(&c.s)));
            fds.extend(self.watches.iter().map(|(_, w)| net::pollfd(w)));
            if let Err(e) = net::poll(&mut fds, wait) {
                let mut st = lock(&self.shared.st);
                st.aborted = Some(format!(
                    "rank {}: bootstrap reader failed: poll: {e}",
                    self.rank
                ));
                self.shared.cv.notify_all();
                return;
            }
            if fds[0].revents != 0 && !self.drain_wake() {
                return;
            }
            let nconns = self.conns.len();
            let mut keep = Vec::with_capacity(nconns);
            for i in 0..nconns {
                keep.push(fds[2 + i].revents == 0 || self.service(i));
            }
            let mut it = keep.iter();
            self.conns.retain(|_| *it.next().unwrap_or(&true));
            let wfds = &fds[2 + nconns..];
            let mut i = 0;
            let out_closed = &mut self.out_closed;
            self.watches.retain_mut(|(peer, w)| {
                let ev = wfds.get(i).map_or(0, |f| f.revents);
                i += 1;
                if ev == 0 {
                    return true;
                }
                let mut b = [0u8; 64];
                match net::read_some(w, &mut b) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => true,
                    _ => {
                        out_closed[*peer] = true;
                        false
                    }
                }
            });
            if fds[1].revents != 0 {
                self.accept_all();
            }
            self.update_gone();
        }
    }

    /// False when the owner is gone (the wake socket closed).
    fn drain_wake(&mut self) -> bool {
        let mut b = [0u8; 64];
        // Ends: when the socket is empty (WouldBlock), closed, or failing.
        loop {
            match net::read_some(&mut self.wake, &mut b) {
                Ok(0) => return false,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
                Err(_) => return false,
            }
        }
    }

    fn accept_all(&mut self) {
        // Ends: when the accept queue is empty (WouldBlock) or on an error.
        loop {
            match self.listener.accept() {
                Ok((s, from)) => {
                    if self.closed {
                        continue;
                    }
                    if s.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let _ = s.set_nodelay(true);
                    crate::trace!("rank {}: bootstrap connection from {from}", self.rank);
                    self.conns.push(Conn {
                        s,
                        from,
                        peer: None,
                        asm: Assembler::new(),
                        auth_by: Instant::now() + self.timeout,
                        bye: false,
                        aborted: false,
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    crate::warn!("rank {}: bootstrap accept failed: {e}", self.rank);
                    // Out of descriptors and the like: do not spin on a listener that stays
                    // readable; the next round retries.
                    std::thread::sleep(Duration::from_millis(10));
                    return;
                }
            }
        }
    }

    /// Reads what connection `i` has; false when it must be dropped.
    fn service(&mut self, i: usize) -> bool {
        let mut budget = READ_BUDGET;
        // Ends: WouldBlock, EOF, an error, a bad frame, or the read budget spent.
        while budget > 0 {
            let n = match net::read_some(&mut self.conns[i].s, &mut self.buf) {
                Ok(0) => {
                    let c = &self.conns[i];
                    let why = if c.asm.is_idle() {
                        "closed its connection"
                    } else {
                        crate::warn!(
                            "rank {}: bootstrap connection from {} ended in the middle of a frame",
                            self.rank,
                            c.from
                        );
                        "closed its connection in the middle of a frame"
                    };
                    self.ended(i, why.to_string(), true);
                    return false;
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
                Err(e) => {
                    crate::trace!(
                        "rank {}: reading from {}: {e}",
                        self.rank,
                        self.conns[i].from
                    );
                    self.ended(i, format!("connection failed: {e}"), true);
                    return false;
                }
            };
            budget = budget.saturating_sub(n);
            let mut at = 0;
            // Ends: every feed consumes at least one byte of a non-empty slice.
            while at < n {
                let c = &mut self.conns[i];
                let expect = match c.peer {
                    None => Expect {
                        magic: self.magic,
                        nranks: self.nranks,
                        from: None,
                        kinds: &[Kind::Open],
                    },
                    // After Bye nothing may follow: any frame is a protocol error.
                    Some(p) => Expect {
                        magic: self.magic,
                        nranks: self.nranks,
                        from: Some(p),
                        kinds: if c.bye {
                            &[]
                        } else {
                            &[Kind::P2p, Kind::Coll, Kind::Abort, Kind::Watch, Kind::Bye]
                        },
                    },
                };
                let (used, f) = match c.asm.feed(&self.buf[at..n], &expect) {
                    Ok(x) => x,
                    Err(e) => {
                        crate::warn!(
                            "rank {}: dropping bootstrap connection from {}{}: {e}",
                            self.rank,
                            c.from,
                            c.peer.map(|p| format!(" (rank {p})")).unwrap_or_default()
                        );
                        self.ended(i, format!("sent a malformed frame ({e})"), false);
                        return false;
                    }
                };
                at += used;
                let Some((h, payload)) = f else { continue };
                let sender = h.sender as usize;
                match h.kind {
                    Kind::Open => {
                        if sender == self.rank {
                            crate::warn!(
                                "rank {}: dropping bootstrap connection from {} that claims to be this rank",
                                self.rank, c.from
                            );
                            return false;
                        }
                        crate::trace!("rank {}: {} is rank {sender}", self.rank, c.from);
                        c.peer = Some(sender);
                    }
                    Kind::Watch => {
                        lock(&self.shared.st).watch_in[sender] = true;
                        self.shared.cv.notify_all();
                    }
                    Kind::Bye => {
                        crate::trace!("rank {}: rank {sender} said goodbye", self.rank);
                        c.bye = true;
                    }
                    Kind::Abort => {
                        c.aborted = true;
                        let why = String::from_utf8_lossy(&payload).into_owned();
                        let mut st = lock(&self.shared.st);
                        if st.aborted.is_none() {
                            st.aborted =
                                Some(format!("rank {sender} aborted the bootstrap: {why}"));
                        }
                        self.shared.cv.notify_all();
                    }
                    kind => {
                        let mut st = lock(&self.shared.st);
                        st.msgs
                            .entry((kind, sender, h.tag))
                            .or_default()
                            .push_back(payload);
                        self.shared.cv.notify_all();
                    }
                }
            }
        }
        true
    }

    /// Records the end of connection `i` (about to be dropped by the caller): why nothing more
    /// comes from its peer, and, without a prior `Bye`, the peer's loss. `by_peer`: the
    /// connection ended from the peer's side (EOF, reset), rather than by this reader.
    fn ended(&mut self, i: usize, why: String, by_peer: bool) {
        let c = &self.conns[i];
        let Some(p) = c.peer else { return };
        if c.bye {
            self.in_closed[p] = Some(if why == "closed its connection" {
                "said goodbye and closed its connection (communicator destroyed)".into()
            } else {
                format!("said goodbye (communicator destroyed), then {why}")
            });
            return;
        }
        let lost = if c.aborted {
            format!("rank {p} aborted its bootstrap and {why}")
        } else if why == "closed its connection" {
            format!(
                "rank {p} closed its bootstrap connection without saying goodbye (process exited or crashed?)"
            )
        } else if by_peer {
            format!("rank {p}'s bootstrap connection ended without a goodbye: {why} (process exited or crashed?)")
        } else {
            format!("rank {p} {why}; its bootstrap connection was dropped")
        };
        crate::warn!("rank {}: {lost}", self.rank);
        self.in_closed[p] = Some(why);
        let mut st = lock(&self.shared.st);
        if !st.lost.iter().any(|(q, _)| *q == p) {
            st.lost.push((p, lost));
            self.shared.lost_any.store(true, Ordering::Release);
        }
    }

    /// Declares peers gone whose messages can no longer arrive: their connection to us ended,
    /// or they closed ours while none of theirs is open or still unauthenticated (one could
    /// be theirs).
    fn update_gone(&mut self) {
        let unauth = self.conns.iter().any(|c| c.peer.is_none());
        let mut changed = false;
        let mut st = lock(&self.shared.st);
        for p in 0..self.nranks {
            if st.gone[p].is_some() || self.conns.iter().any(|c| c.peer == Some(p)) {
                continue;
            }
            if let Some(why) = self.in_closed[p].take() {
                st.gone[p] = Some(why);
                changed = true;
            } else if self.out_closed[p] && !unauth {
                st.gone[p] = Some("closed its connection".into());
                changed = true;
            }
        }
        if changed {
            self.shared.cv.notify_all();
        }
    }
}
