//! The root's side of the rendezvous: rank 0 runs it on a thread while it joins like any rank.
//!
//! The root accepts connections on the root address, reads one `Hello` from each, checks every
//! field, and once all ranks have joined sends each the table of listen addresses. It serves
//! all connections from one poll loop, so a stranger that connects and sends nothing, sends
//! garbage or stops mid-frame costs only its own connection: it is dropped (and logged), and
//! the real ranks carry on.

use super::frame::{self, decode_addr, encode_addr, Assembler, Expect, Kind, HEADER_LEN};
use super::net;
use crate::error::{Error, Result};
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A running root; dropping it cancels the rendezvous and joins the thread.
pub(crate) struct Root {
    wake: UnixStream,
    thread: Option<JoinHandle<Result<()>>>,
}

impl Root {
    /// Binds the root address (errors here are the caller's: address in use, not local) and
    /// starts serving it.
    pub(crate) fn start(
        bind: SocketAddr,
        magic: u64,
        nranks: usize,
        timeout: Duration,
    ) -> Result<Root> {
        let listener = TcpListener::bind(bind).map_err(|e| {
            let why = if e.kind() == io::ErrorKind::AddrInUse {
                "the port is already in use (another communicator or program holds it)"
            } else {
                "is it an address of this host?"
            };
            Error::sys(
                format!("rank 0: cannot listen on the bootstrap root address {bind}: {why}"),
                e,
            )
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::sys("bootstrap root: set_nonblocking", e))?;
        let (wake, wake_rx) =
            UnixStream::pair().map_err(|e| Error::sys("bootstrap root: socketpair", e))?;
        let serve = Serve {
            listener,
            wake: wake_rx,
            bind,
            magic,
            nranks,
            timeout,
        };
        let thread = std::thread::Builder::new()
            .name("mscclpp-boot-root".into())
            .spawn(move || serve.run())
            .map_err(|e| Error::sys("bootstrap root: spawning its thread", e))?;
        Ok(Root {
            wake,
            thread: Some(thread),
        })
    }

    /// Waits for the root to finish (it has sent, or failed to send, every table).
    pub(crate) fn finish(mut self) -> Result<()> {
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(Error::internal("the bootstrap root thread panicked")),
            None => Ok(()),
        }
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            // Any byte (or the close below) wakes the loop, which aborts and returns.
            let _ = (&self.wake).write(&[1]);
            let _ = self.wake.shutdown(Shutdown::Both);
            let _ = t.join();
        }
    }
}

struct Serve {
    listener: TcpListener,
    wake: UnixStream,
    bind: SocketAddr,
    magic: u64,
    nranks: usize,
    timeout: Duration,
}

struct Pending {
    s: TcpStream,
    from: SocketAddr,
    asm: Assembler,
    by: Instant,
}

struct Joined {
    s: TcpStream,
    from: SocketAddr,
    listen: SocketAddr,
}

enum Outcome {
    Wait,
    Drop,
    Join(usize, SocketAddr),
}

impl Serve {
    fn run(self) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        let mut pending: Vec<Pending> = Vec::new();
        let mut joined: Vec<Option<Joined>> = (0..self.nranks).map(|_| None).collect();
        let mut count = 0;
        // Ends: when every rank has joined, on cancel (wake), at the deadline, or when a rank
        // that had joined disconnects.
        while count < self.nranks {
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> =
                    (0..self.nranks).filter(|&r| joined[r].is_none()).collect();
                let msg = format!(
                    "bootstrap root at {}: ranks {missing:?} of {} did not join within {:?}",
                    self.bind, self.nranks, self.timeout
                );
                self.abort_all(&mut joined, &msg);
                return Err(Error::timeout(msg, self.timeout));
            }
            pending.retain(|p| {
                let keep = p.by > now;
                if !keep {
                    crate::warn!(
                        "bootstrap root at {}: dropping connection from {}: no complete hello within {:?}",
                        self.bind, p.from, self.timeout
                    );
                }
                keep
            });
            let wait = pending
                .iter()
                .map(|p| p.by)
                .fold(deadline, Instant::min)
                .saturating_duration_since(now);
            let mut fds = vec![net::pollfd(&self.wake), net::pollfd(&self.listener)];
            fds.extend(pending.iter().map(|p| net::pollfd(&p.s)));
            fds.extend(joined.iter().flatten().map(|j| net::pollfd(&j.s)));
            net::poll(&mut fds, Some(wait)).map_err(|e| Error::sys("bootstrap root: poll", e))?;
            if fds[0].revents != 0 {
                let msg = "rank 0 gave up on the rendezvous".to_string();
                self.abort_all(&mut joined, &msg);
                return Err(Error::remote(format!(
                    "bootstrap root at {}: cancelled ({msg})",
                    self.bind
                )));
            }
            // A rank that joined and then disconnected will never get its table: fail everyone
            // now instead of letting them wait for the deadline.
            let jfds = &fds[2 + pending.len()..];
            let mut k = 0;
            let mut left = None;
            for (r, j) in joined.iter_mut().enumerate() {
                let Some(j) = j else { continue };
                if jfds[k].revents != 0 {
                    let mut b = [0u8; 1];
                    match net::read_some(&mut j.s, &mut b) {
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Ok(0) => left = Some((r, j.from, "disconnected".to_string())),
                        Ok(_) => left = Some((r, j.from, "sent bytes after its hello".into())),
                        Err(e) => left = Some((r, j.from, format!("failed: {e}"))),
                    }
                }
                k += 1;
            }
            if let Some((r, from, why)) = left {
                joined[r] = None;
                let msg = format!(
                    "rank {r} (from {from}) {why} before all {} ranks had joined",
                    self.nranks
                );
                crate::warn!("bootstrap root at {}: {msg}; aborting", self.bind);
                self.abort_all(&mut joined, &msg);
                return Err(Error::remote(format!(
                    "bootstrap root at {}: {msg}",
                    self.bind
                )));
            }
            let mut next = Vec::with_capacity(pending.len());
            for (i, mut p) in pending.into_iter().enumerate() {
                if fds[2 + i].revents == 0 {
                    next.push(p);
                    continue;
                }
                match self.read_hello(&mut p, &joined) {
                    Outcome::Wait => next.push(p),
                    Outcome::Drop => {}
                    Outcome::Join(r, listen) => {
                        let j = Joined {
                            s: p.s,
                            from: p.from,
                            listen,
                        };
                        count += 1;
                        crate::info!(
                            "bootstrap root at {}: rank {r} joined from {} (listens on {}), {count}/{}",
                            self.bind, j.from, j.listen, self.nranks
                        );
                        joined[r] = Some(j);
                    }
                }
            }
            pending = next;
            if fds[1].revents != 0 {
                self.accept_all(&mut pending);
            }
        }
        self.broadcast(joined.into_iter().flatten().collect())
    }

    fn accept_all(&self, pending: &mut Vec<Pending>) {
        // Ends: when the accept queue is empty (WouldBlock) or on an error.
        loop {
            match self.listener.accept() {
                Ok((s, from)) => {
                    if pending.len() >= 64 + 4 * self.nranks {
                        crate::warn!(
                            "bootstrap root at {}: too many connections without a hello; dropping {from}",
                            self.bind
                        );
                        continue;
                    }
                    if s.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let _ = s.set_nodelay(true);
                    crate::trace!("bootstrap root at {}: connection from {from}", self.bind);
                    pending.push(Pending {
                        s,
                        from,
                        asm: Assembler::new(),
                        by: Instant::now() + self.timeout,
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    crate::warn!("bootstrap root at {}: accept failed: {e}", self.bind);
                    // Out of descriptors and the like: do not spin on a listener that stays
                    // readable; the next round retries.
                    std::thread::sleep(Duration::from_millis(10));
                    return;
                }
            }
        }
    }

    fn read_hello(&self, p: &mut Pending, joined: &[Option<Joined>]) -> Outcome {
        let expect = Expect {
            magic: self.magic,
            nranks: self.nranks,
            from: None,
            kinds: &[Kind::Hello],
        };
        let mut buf = [0u8; HEADER_LEN + frame::HELLO_LEN];
        // Ends: on WouldBlock (wait for more), EOF, an error, or a complete hello.
        loop {
            let n = match net::read_some(&mut p.s, &mut buf) {
                Ok(0) => {
                    crate::warn!(
                        "bootstrap root at {}: {} closed the connection {}",
                        self.bind,
                        p.from,
                        if p.asm.is_idle() {
                            "without sending anything"
                        } else {
                            "in the middle of its hello (truncated frame)"
                        }
                    );
                    return Outcome::Drop;
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Outcome::Wait,
                Err(e) => {
                    crate::warn!(
                        "bootstrap root at {}: reading from {}: {e}",
                        self.bind,
                        p.from
                    );
                    return Outcome::Drop;
                }
            };
            let (used, f) = match p.asm.feed(&buf[..n], &expect) {
                Ok(x) => x,
                Err(e) => {
                    self.reject(&p.s, p.from, &e.to_string(), e.knows_magic());
                    return Outcome::Drop;
                }
            };
            let Some((h, payload)) = f else { continue };
            if used < n {
                self.reject(&p.s, p.from, "sent bytes after its hello", true);
                return Outcome::Drop;
            }
            let rank = h.sender as usize;
            let mut nb = [0u8; 8];
            nb.copy_from_slice(&payload[..8]);
            let their_n = u64::from_le_bytes(nb);
            if their_n != self.nranks as u64 {
                let why = format!(
                    "rank {rank} says nranks = {their_n}, the root has nranks = {}",
                    self.nranks
                );
                self.reject(&p.s, p.from, &why, true);
                return Outcome::Drop;
            }
            let listen = match decode_addr(&payload[8..]) {
                Ok(a) => a,
                Err(e) => {
                    self.reject(
                        &p.s,
                        p.from,
                        &format!("rank {rank}: bad listen address: {e}"),
                        true,
                    );
                    return Outcome::Drop;
                }
            };
            if let Some(j) = &joined[rank] {
                let why = format!("duplicate rank {rank}: it already joined from {}", j.from);
                self.reject(&p.s, p.from, &why, true);
                return Outcome::Drop;
            }
            return Outcome::Join(rank, listen);
        }
    }

    /// Logs why a connection is dropped; tells the client too when it knew the magic (a
    /// confused member deserves the reason; a stranger gets nothing).
    fn reject(&self, s: &TcpStream, from: SocketAddr, why: &str, tell: bool) {
        crate::warn!(
            "bootstrap root at {}: rejecting connection from {from}: {why}",
            self.bind
        );
        if tell {
            // Best effort on a non-blocking socket: a small frame fits the send buffer.
            let _ = (&*s).write(&abort_frame(self.magic, why));
        }
        // Closing with unread bytes would send a reset, which can destroy the reason before
        // the client reads it: take what has arrived first.
        let _ = s.shutdown(Shutdown::Write);
        let mut sink = [0u8; 4096];
        let _ = net::read_some(&mut &*s, &mut sink);
    }

    fn abort_all(&self, joined: &mut [Option<Joined>], why: &str) {
        let f = abort_frame(self.magic, why);
        for j in joined.iter_mut().flatten() {
            let _ = (&j.s).write(&f);
        }
    }

    fn broadcast(&self, joined: Vec<Joined>) -> Result<()> {
        let mut table = Vec::with_capacity(joined.len() * frame::ADDR_LEN);
        for j in &joined {
            table.extend_from_slice(&encode_addr(&j.listen));
        }
        let f = frame::encode_frame(self.magic, Kind::Table, 0, 0, &table);
        let deadline = Instant::now() + self.timeout;
        let mut failed = Vec::new();
        for (r, j) in joined.iter().enumerate() {
            let r2 =
                j.s.set_nonblocking(false)
                    .and_then(|_| net::write_all_by(&j.s, &f, deadline));
            if let Err(e) = r2 {
                crate::warn!(
                    "bootstrap root at {}: sending the address table to rank {r} at {}: {e}",
                    self.bind,
                    j.from
                );
                failed.push(format!("rank {r}: {e}"));
            }
        }
        if failed.is_empty() {
            crate::info!(
                "bootstrap root at {}: all {} ranks joined; address table sent",
                self.bind,
                self.nranks
            );
            Ok(())
        } else {
            Err(Error::remote(format!(
                "bootstrap root at {}: could not send the address table to {}",
                self.bind,
                failed.join(", ")
            )))
        }
    }
}

pub(crate) fn abort_frame(magic: u64, why: &str) -> Vec<u8> {
    let mut b = why.as_bytes();
    if b.len() > frame::MAX_ABORT_LEN {
        b = &b[..frame::MAX_ABORT_LEN];
    }
    frame::encode_frame(magic, Kind::Abort, 0, 0, b)
}
