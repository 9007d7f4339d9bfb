//! The mailbox's thread: accepts and authenticates connections on the rank's listener, reads
//! their frames into the mailbox's `State`, watches the rank's outgoing connections for
//! closure (and for the answers to this rank's hang-report requests, the one frame a peer
//! writes on them), answers peers' hang-report requests, and records why each peer's messages
//! can no longer come.

use super::Shared;
use crate::bootstrap::frame::{self, Assembler, Expect, Kind, MAX_REPORT_LEN};
use crate::bootstrap::net;
use crate::sync::lock;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    /// The peer sent `Abort` on it, with why (its closing follows from that failure).
    aborted: Option<String>,
}

/// One of this rank's outgoing connections, watched: the peer writes nothing on it but the
/// answers to our hang-report requests, so anything else readable means it closed.
struct Watched {
    peer: usize,
    s: TcpStream,
    asm: Assembler,
}

pub(super) struct Reader {
    shared: Arc<Shared>,
    listener: TcpListener,
    wake: UnixStream,
    magic: u64,
    rank: usize,
    nranks: usize,
    timeout: Duration,
    conns: Vec<Conn>,
    watches: Vec<Watched>,
    in_closed: Vec<Option<String>>,
    out_closed: Vec<bool>,
    /// After `close_all`: new connections are refused.
    closed: bool,
    buf: Vec<u8>,
    /// The most bytes of tagged messages one peer may leave unread (`State::buffered`).
    quota: u64,
}

/// Most bytes read from one connection per wake-up, so that one busy sender cannot starve
/// the others.
const READ_BUDGET: usize = 1 << 20;

/// How long the thread may spend writing one hang report back to the peer that asked (into
/// an otherwise unused direction of the connection: its socket buffer is empty).
const REPLY_BOUND: Duration = Duration::from_secs(1);

impl Reader {
    /// The reader of a new mailbox, before its thread starts.
    pub(super) fn new(
        shared: Arc<Shared>,
        listener: TcpListener,
        wake: UnixStream,
        magic: u64,
        rank: usize,
        nranks: usize,
        timeout: Duration,
    ) -> Reader {
        Reader {
            shared,
            listener,
            wake,
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
            quota: crate::config::get().bootstrap_quota,
        }
    }

    pub(super) fn run(mut self) {
        // Ends: when `stop` is set (Mailbox::drop), when the wake socket's other end closes,
        // or when poll fails (recorded as an abort so that waiters fail instead of hanging).
        loop {
            let close = {
                let mut st = lock(&self.shared.st);
                if st.stop {
                    return;
                }
                self.watches
                    .extend(st.new_watches.drain(..).map(|(peer, s)| Watched {
                        peer,
                        s,
                        asm: Assembler::new(),
                    }));
                std::mem::take(&mut st.close_all)
            };
            if close && !self.closed {
                self.closed = true;
                for c in self.conns.drain(..) {
                    let _ = c.s.shutdown(Shutdown::Both);
                }
                for w in self.watches.drain(..) {
                    let _ = w.s.shutdown(Shutdown::Both);
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
            fds.extend(self.watches.iter().map(|w| net::pollfd(&w.s)));
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
            let ready: Vec<bool> = fds[2 + nconns..].iter().map(|f| f.revents != 0).collect();
            let mut keep = Vec::with_capacity(ready.len());
            for (i, r) in ready.into_iter().enumerate() {
                keep.push(!r || self.read_watched(i));
            }
            let mut it = keep.iter();
            self.watches.retain(|_| *it.next().unwrap_or(&true));
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
                        aborted: None,
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

    /// Reads what watched outgoing connection `i` has: answers to our hang-report requests are
    /// filed; anything else (EOF, an error, another frame) means the peer closed it. False
    /// when it must be dropped.
    fn read_watched(&mut self, i: usize) -> bool {
        let mut budget = READ_BUDGET;
        // Ends: WouldBlock, EOF, an error, a bad frame, or the read budget spent.
        while budget > 0 {
            let w = &mut self.watches[i];
            // The sending side keeps this connection in blocking mode.
            let n = match net::read_nowait(&w.s, &mut self.buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
                Ok(n) if n > 0 => n,
                _ => {
                    self.out_closed[w.peer] = true;
                    return false;
                }
            };
            budget = budget.saturating_sub(n);
            let expect = Expect {
                magic: self.magic,
                nranks: self.nranks,
                from: Some(w.peer),
                kinds: &[Kind::Report],
            };
            let mut at = 0;
            // Ends: every feed consumes at least one byte of a non-empty slice.
            while at < n {
                let (used, f) = match w.asm.feed(&self.buf[at..n], &expect) {
                    Ok(x) => x,
                    Err(e) => {
                        crate::trace!(
                            "rank {}: dropping the connection to rank {}: {e}",
                            self.rank,
                            w.peer
                        );
                        self.out_closed[w.peer] = true;
                        return false;
                    }
                };
                at += used;
                let Some((h, payload)) = f else { continue };
                let mut st = lock(&self.shared.st);
                if h.tag == st.report_asked {
                    st.msgs
                        .entry((Kind::Report, w.peer, h.tag))
                        .or_default()
                        .push_back(payload);
                    self.shared.cv.notify_all();
                }
            }
        }
        true
    }

    /// Answers hang-report request `tag` from the peer of incoming connection `i` with this
    /// rank's report, on that connection. A failure leaves the asker to say we did not answer.
    fn answer_report(&mut self, i: usize, tag: u64) {
        let source = lock(&self.shared.report).clone();
        // A panic here would end the thread every message of this rank depends on.
        let report = source.map(|f| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f())).unwrap_or_else(|_| {
                crate::warn!("rank {}: building a hang report panicked", self.rank);
                Vec::new()
            })
        });
        let mut report = report.unwrap_or_default();
        if report.len() > MAX_REPORT_LEN {
            report.clear();
        }
        let f = frame::encode_frame(self.magic, Kind::Report, self.rank as u32, tag, &report);
        let c = &self.conns[i];
        // The reader's sockets are non-blocking; this one write may wait, bounded.
        let r =
            c.s.set_nonblocking(false)
                .and_then(|_| net::write_all_by(&c.s, &f, Instant::now() + REPLY_BOUND));
        let _ = c.s.set_nonblocking(true);
        match r {
            Ok(()) => crate::trace!(
                "rank {}: answered hang-report request {tag} of {} ({} bytes)",
                self.rank,
                c.from,
                report.len()
            ),
            Err(e) => crate::info!(
                "rank {}: could not answer the hang-report request of {}: {e}",
                self.rank,
                c.from
            ),
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
                            &[
                                Kind::P2p,
                                Kind::Coll,
                                Kind::Abort,
                                Kind::Watch,
                                Kind::Bye,
                                Kind::ReportAsk,
                            ]
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
                    Kind::ReportAsk => self.answer_report(i, h.tag),
                    Kind::Abort => {
                        let why = String::from_utf8_lossy(&payload).into_owned();
                        c.aborted = Some(why.clone());
                        let mut st = lock(&self.shared.st);
                        if st.aborted.is_none() {
                            st.aborted =
                                Some(format!("rank {sender} aborted the bootstrap: {why}"));
                        }
                        self.shared.cv.notify_all();
                    }
                    kind => {
                        let mut st = lock(&self.shared.st);
                        if kind == Kind::P2p {
                            st.buffered[sender] += payload.len() as u64;
                            if st.buffered[sender] > self.quota {
                                // A flood on tags nobody reads: drop what it left and the
                                // connection, and report the peer (not this rank's memory).
                                st.msgs.retain(|k, _| !(k.0 == Kind::P2p && k.1 == sender));
                                st.buffered[sender] = 0;
                                drop(st);
                                let why = format!(
                                    "left more than {} MiB of tagged messages unread (MSCCLPP_BOOTSTRAP_QUOTA_MB); its connection was dropped",
                                    self.quota >> 20
                                );
                                crate::warn!("rank {}: rank {sender} {why}", self.rank);
                                self.ended(i, why, false);
                                return false;
                            }
                        }
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
        let lost = if let Some(reason) = &c.aborted {
            format!("rank {p} aborted its bootstrap ({reason}) and {why}")
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
