//! TCP rendezvous between the ranks of a communicator, and the small collectives and tagged
//! messages that connection setup runs over it.
//!
//! Joining: rank 0 serves the root address ([`root`]); every rank (rank 0 included) opens its
//! own listener on the interface that reaches the root, connects to the root and sends a
//! `Hello` (magic, rank, nranks, listen address). When all have joined, the root sends each
//! the table of listen addresses; a barrier around the ring then proves every rank reachable.
//!
//! Afterwards ranks talk directly: one persistent connection per (sender, receiver) pair,
//! opened on first use. A thread per rank ([`mailbox`]) drains incoming connections into a
//! mailbox keyed by (sender, tag), so sends never wait for the matching receive. The
//! all-gather is a ring over those connections; the barrier is an all-gather of one byte.
//!
//! Every connect, send and receive is bounded by [`timeout`]. A collective that fails makes
//! the communicator's bootstrap fail for good (sticky), tells the ring neighbours (an `Abort`
//! frame) and closes its connections, so that ranks waiting on it fail promptly too.
//!
//! Peer loss while data moves: [`Bootstrap::watch_peers`] makes each listed peer open its
//! connection to us (a `Watch` frame) and keep it for the communicator's lifetime; a
//! [`Bootstrap`] that is dropped sends `Bye` on its connections before closing them. So a
//! watched connection that closes without `Bye` means the peer process died (the kernel closed
//! its sockets), and [`Bootstrap::lost_peer`] reports it within milliseconds.

mod addr;
pub mod frame;
mod id;
mod mailbox;
mod net;
mod root;

use crate::abi::MSCCLPP_UNIQUE_ID_BYTES;
use crate::error::{Error, Result};
use crate::sync::lock;
use frame::{Kind, MAX_PAYLOAD, MAX_RANKS};
use mailbox::Mailbox;
use std::net::{Shutdown, SocketAddr, SocketAddrV6, TcpListener, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The process-wide bootstrap timeout (`config::bootstrap_timeout`: [`set_timeout`] if called,
/// else `MSCCLPP_BOOTSTRAP_TIMEOUT`, else 30 s). Communicators read it when created.
pub fn timeout() -> Duration {
    crate::config::bootstrap_timeout()
}

/// Sets the process-wide bootstrap timeout (`mscclppSetBootstrapConnTimeout`) for
/// communicators created afterwards; `secs` must be > 0. Overrides the environment.
pub fn set_timeout(secs: i32) -> Result<()> {
    if secs <= 0 {
        return Err(Error::invalid_arg(format!(
            "bootstrap timeout must be > 0 seconds, got {secs}"
        )));
    }
    crate::config::set_bootstrap_timeout(secs as u64);
    Ok(())
}

/// Creates the 128 bytes of a new unique id: an address of this host with a port that is free
/// now (the interface chosen by `MSCCLPP_SOCKET_IFNAME` if set, else the first non-loopback
/// IPv4 interface that is up, else loopback) and a random magic. This host becomes the root:
/// the rank 0 that joins with this id must run here, and listens on that address.
pub fn new_unique_id() -> Result<[u8; MSCCLPP_UNIQUE_ID_BYTES]> {
    let spec = crate::config::get().socket_ifname.clone();
    let ifaces = addr::interfaces()
        .map_err(|e| Error::sys("mscclppGetUniqueId: listing network interfaces", e))?;
    let (ip, scope) = addr::choose(&ifaces, spec.as_deref())
        .map_err(|e| Error::invalid_arg(format!("mscclppGetUniqueId: {e}")))?;
    let probe = match ip {
        std::net::IpAddr::V6(v6) => SocketAddr::V6(SocketAddrV6::new(v6, 0, 0, scope)),
        v4 => SocketAddr::new(v4, 0),
    };
    // The port is free now; rank 0 binds it again (SO_REUSEADDR) when it joins.
    let root = TcpListener::bind(probe)
        .and_then(|l| l.local_addr())
        .map_err(|e| {
            Error::sys(
                format!("mscclppGetUniqueId: finding a free port on {probe}"),
                e,
            )
        })?;
    let magic = id::random_magic()
        .map_err(|e| Error::sys("mscclppGetUniqueId: reading random bytes", e))?;
    crate::info!("unique id: root address {root}");
    Ok(id::encode(magic, &root))
}

fn check_ranks(rank: usize, nranks: usize) -> Result<()> {
    if nranks == 0 || nranks > MAX_RANKS {
        return Err(Error::invalid_arg(format!(
            "nranks must be in 1..={MAX_RANKS}, got {nranks}"
        )));
    }
    if rank >= nranks {
        return Err(Error::invalid_arg(format!(
            "rank {rank} is outside [0, {nranks})"
        )));
    }
    Ok(())
}

/// This rank's connection to one peer.
enum Out {
    /// Not opened yet (opened on first send).
    Idle,
    Open(TcpStream),
    /// A send failed; the stream may hold a partial frame, so the connection is never reused.
    Broken(String),
}

/// One rank's membership in a communicator's bootstrap. `Send + Sync`: every method takes
/// `&self`; collectives are serialised internally, sends to one peer are serialised per peer,
/// and [`Bootstrap::lost_peer`] may be polled from another thread (e.g. through an `Arc`)
/// while the API thread uses it. Dropping it says goodbye to the peers it has connections to,
/// closes its connections and joins its thread.
pub struct Bootstrap {
    rank: usize,
    nranks: usize,
    magic: u64,
    timeout: Duration,
    peers: Vec<SocketAddr>,
    out: Vec<Mutex<Out>>,
    /// Sequence number of the next collective; the lock also serialises collectives.
    coll: Mutex<u32>,
    /// Why this bootstrap failed for good, once it has.
    sticky: Mutex<Option<String>>,
    mailbox: Mailbox,
}

// The rest of the library shares one Bootstrap between threads.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<Bootstrap>();
};

impl Bootstrap {
    /// Joins the `nranks`-rank communicator whose root is `ip_port` (`"ip:port"`,
    /// `"[ipv6]:port"` or `"host:port"`); rank 0 listens there. Every rank must pass the same
    /// string: the communicator's magic is derived from it and from `nranks`.
    pub fn from_addr(ip_port: &str, rank: usize, nranks: usize) -> Result<Self> {
        check_ranks(rank, nranks)?;
        let target = addr::parse(ip_port)
            .map_err(|e| Error::invalid_arg(format!("bootstrap root address {e}")))?;
        let addrs = addr::resolve(&target).map_err(|e| {
            Error::invalid_arg(format!(
                "cannot resolve the bootstrap root address {ip_port:?}: {e}"
            ))
        })?;
        Self::join(
            &addrs,
            ip_port,
            frame::addr_magic(ip_port, nranks),
            rank,
            nranks,
        )
    }

    /// Joins the communicator described by a unique id from [`new_unique_id`].
    pub fn from_id(id: &[u8; MSCCLPP_UNIQUE_ID_BYTES], rank: usize, nranks: usize) -> Result<Self> {
        check_ranks(rank, nranks)?;
        let (magic, root) = id::decode(id).map_err(Error::invalid_arg)?;
        Self::join(&[root], &root.to_string(), magic, rank, nranks)
    }

    fn join(
        root_addrs: &[SocketAddr],
        root_name: &str,
        magic: u64,
        rank: usize,
        nranks: usize,
    ) -> Result<Self> {
        let timeout = timeout();
        let t0 = Instant::now();
        let root = if rank == 0 {
            Some(root::Root::start(root_addrs[0], magic, nranks, timeout)?)
        } else {
            None
        };
        let (mailbox, peers) =
            match Self::rendezvous(root_addrs, root_name, magic, rank, nranks, timeout) {
                Ok(x) => x,
                Err(e) => {
                    drop(root);
                    return Err(e);
                }
            };
        if let Some(r) = root {
            r.finish()?;
        }
        let b = Bootstrap {
            rank,
            nranks,
            magic,
            timeout,
            out: (0..nranks).map(|_| Mutex::new(Out::Idle)).collect(),
            peers,
            coll: Mutex::new(0),
            sticky: Mutex::new(None),
            mailbox,
        };
        // Every rank has the table; make sure every ring link works before returning.
        b.collective(&mut vec![0u8; nranks], "bootstrap's closing barrier")?;
        crate::info!(
            "rank {rank}/{nranks}: bootstrap via {root_name} done in {:?}; listening on {}",
            t0.elapsed(),
            b.peers[rank]
        );
        Ok(b)
    }

    /// Joins at the root: returns this rank's running mailbox and every rank's listen address.
    fn rendezvous(
        root_addrs: &[SocketAddr],
        root_name: &str,
        magic: u64,
        rank: usize,
        nranks: usize,
        timeout: Duration,
    ) -> Result<(Mailbox, Vec<SocketAddr>)> {
        let deadline = Instant::now() + timeout;
        let who = format!("rank {rank}/{nranks}");
        let io = |e, what: &str| {
            net::classify(
                e,
                format!("{who}: {what} the bootstrap root at {root_name}"),
                timeout,
            )
        };
        let conn = net::connect_retry(root_addrs, deadline).map_err(|e| {
            let mut err = io(e, "connecting to");
            if let Error::Timeout { what, .. } = &mut err {
                what.push_str(" (is rank 0 running, with the same address?)");
            }
            err
        })?;
        // Listen on the interface that reaches the root: the one the others can reach too.
        let mut local = conn
            .local_addr()
            .map_err(|e| Error::sys(format!("{who}: local address"), e))?;
        local.set_port(0);
        let listener = TcpListener::bind(local)
            .map_err(|e| Error::sys(format!("{who}: listening on {local}"), e))?;
        let listen = listener
            .local_addr()
            .map_err(|e| Error::sys(format!("{who}: local address"), e))?;
        let mailbox = Mailbox::start(listener, magic, rank, nranks, timeout)?;
        let mut hello = Vec::with_capacity(frame::HELLO_LEN);
        hello.extend_from_slice(&(nranks as u64).to_le_bytes());
        hello.extend_from_slice(&frame::encode_addr(&listen));
        let f = frame::encode_frame(magic, Kind::Hello, rank as u32, 0, &hello);
        net::write_all_by(&conn, &f, deadline).map_err(|e| io(e, "sending hello to"))?;
        // The root gives up on missing ranks at its own deadline and says which are missing;
        // wait a little longer than it so that this rank reports that rather than a bare
        // timeout.
        let deadline = deadline + (timeout / 4).min(Duration::from_secs(5));
        let mut head = [0u8; frame::HEADER_LEN];
        net::read_exact_by(&conn, &mut head, deadline)
            .map_err(|e| io(e, "waiting for the address table from"))?;
        let expect = frame::Expect {
            magic,
            nranks,
            from: None,
            kinds: &[Kind::Table, Kind::Abort],
        };
        let h = frame::decode_header(&head, &expect).map_err(|e| {
            Error::remote(format!(
                "{who}: bad reply from the bootstrap root at {root_name}: {e}"
            ))
        })?;
        let mut payload = vec![0u8; h.len];
        net::read_exact_by(&conn, &mut payload, deadline)
            .map_err(|e| io(e, "reading the address table from"))?;
        let _ = conn.shutdown(Shutdown::Both);
        if h.kind == Kind::Abort {
            return Err(Error::remote(format!(
                "{who}: the bootstrap root at {root_name} refused or aborted the rendezvous: {}",
                String::from_utf8_lossy(&payload)
            )));
        }
        let peers = payload
            .chunks_exact(frame::ADDR_LEN)
            .map(frame::decode_addr)
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::remote(format!("{who}: bad address table from the root: {e}")))?;
        if peers[rank] != listen {
            return Err(Error::remote(format!(
                "{who}: the root's table lists {} for this rank, which listens on {listen}",
                peers[rank]
            )));
        }
        Ok((mailbox, peers))
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn nranks(&self) -> usize {
        self.nranks
    }

    /// Ring all-gather: `data` holds nranks slices of `data.len() / nranks` bytes; slice `rank`
    /// is ours, the others are filled from the other ranks. Collective, bounded by the timeout.
    pub fn all_gather(&self, data: &mut [u8]) -> Result<()> {
        if data.len() % self.nranks != 0 {
            return Err(Error::invalid_arg(format!(
                "rank {}: all-gather buffer of {} bytes is not {} equal slices",
                self.rank,
                data.len(),
                self.nranks
            )));
        }
        if data.len() / self.nranks > MAX_PAYLOAD {
            return Err(Error::invalid_arg(format!(
                "rank {}: all-gather slices of {} bytes exceed the bootstrap's {MAX_PAYLOAD}",
                self.rank,
                data.len() / self.nranks
            )));
        }
        self.collective(data, "all-gather")
    }

    /// Returns once every rank has entered the barrier (bounded by the timeout).
    pub fn barrier(&self) -> Result<()> {
        self.collective(&mut vec![0u8; self.nranks], "barrier")
    }

    fn collective(&self, data: &mut [u8], op: &str) -> Result<()> {
        self.check_sticky(op)?;
        if self.nranks == 1 {
            return Ok(());
        }
        let mut seq = lock(&self.coll);
        let s = *seq;
        *seq = seq.wrapping_add(1);
        let r = self.ring(data, s, op);
        if let Err(e) = &r {
            self.poison(&format!("rank {} failed in {op} #{s}: {e}", self.rank));
        }
        r
    }

    fn ring(&self, data: &mut [u8], seq: u32, op: &str) -> Result<()> {
        let n = self.nranks;
        let chunk = data.len() / n;
        let next = (self.rank + 1) % n;
        let prev = (self.rank + n - 1) % n;
        let deadline = Instant::now() + self.timeout;
        // Step s forwards the slice received in step s-1 (our own in step 0).
        for step in 0..n - 1 {
            let out = (self.rank + n - step) % n;
            let inn = (self.rank + n - step - 1) % n;
            let tag = (seq as u64) << 32 | step as u64;
            self.send_frame(
                next,
                Kind::Coll,
                tag,
                &data[out * chunk..][..chunk],
                deadline,
                op,
            )?;
            let what = || format!("rank {}: {op} step {step}: from rank {prev}", self.rank);
            let m = self
                .mailbox
                .take((Kind::Coll, prev, tag), deadline, self.timeout, &what)?;
            if m.len() != chunk {
                return Err(Error::remote(format!(
                    "{}: got {} bytes per rank, this rank has {chunk} (did the ranks pass different sizes?)",
                    what(),
                    m.len()
                )));
            }
            data[inn * chunk..][..chunk].copy_from_slice(&m);
        }
        Ok(())
    }

    fn check_peer(&self, peer: usize, op: &str) -> Result<()> {
        if peer >= self.nranks {
            return Err(Error::invalid_arg(format!(
                "rank {}: {op}: peer {peer} is outside [0, {})",
                self.rank, self.nranks
            )));
        }
        Ok(())
    }

    /// Sends a tagged message to `peer`; returns once the bytes are handed to the kernel,
    /// without waiting for the peer to call [`Bootstrap::recv`].
    pub fn send(&self, peer: usize, tag: u64, data: &[u8]) -> Result<()> {
        self.check_peer(peer, "send")?;
        if data.len() > MAX_PAYLOAD {
            return Err(Error::invalid_arg(format!(
                "rank {}: send of {} bytes to rank {peer} exceeds the bootstrap's {MAX_PAYLOAD}",
                self.rank,
                data.len()
            )));
        }
        self.check_sticky("send")?;
        if peer == self.rank {
            self.mailbox.put_local(Kind::P2p, tag, data.to_vec());
            return Ok(());
        }
        let deadline = Instant::now() + self.timeout;
        self.send_frame(peer, Kind::P2p, tag, data, deadline, "send")
    }

    /// Receives the message `peer` sent with `tag` (tags may arrive in any order; equal tags
    /// in the order sent), within the timeout.
    pub fn recv(&self, peer: usize, tag: u64) -> Result<Vec<u8>> {
        self.check_peer(peer, "recv")?;
        self.check_sticky("recv")?;
        let what = || {
            format!(
                "rank {}: recv from rank {peer} with tag {tag:#x}",
                self.rank
            )
        };
        let deadline = Instant::now() + self.timeout;
        self.mailbox
            .take((Kind::P2p, peer, tag), deadline, self.timeout, &what)
    }

    /// Makes sure each listed peer has a connection to this rank that stays open while both
    /// live, and remembers them as watched: from then on [`Bootstrap::lost_peer`] reports a
    /// listed peer whose connection closes without a goodbye (its process died).
    ///
    /// Collective between the pairs: every listed peer must call it with this rank in its
    /// list (each side sends a `Watch` frame on its connection to the other, then waits for
    /// the other's). Bounded by the bootstrap timeout. Calling it again with the same peers is
    /// harmless. This rank itself, if listed, is ignored.
    pub fn watch_peers(&self, peers: &[usize]) -> Result<()> {
        for &p in peers {
            self.check_peer(p, "watch_peers")?;
        }
        self.check_sticky("watch_peers")?;
        let mut others: Vec<usize> = peers.iter().copied().filter(|&p| p != self.rank).collect();
        others.sort_unstable();
        others.dedup();
        // Marked before the sends and waits: if one of them fails because a peer died, that
        // loss is still reported by lost_peer.
        self.mailbox.watch_mark(&others);
        let deadline = Instant::now() + self.timeout;
        // All sends first: they never wait for the peer, so the pairs cannot deadlock.
        for &p in &others {
            self.send_frame(p, Kind::Watch, 0, &[], deadline, "watch_peers")?;
        }
        for &p in &others {
            let what = || format!("rank {}: watch_peers: waiting for rank {p}", self.rank);
            self.mailbox.wait_watch(p, deadline, self.timeout, &what)?;
        }
        crate::trace!("rank {}: watching ranks {others:?}", self.rank);
        Ok(())
    }

    /// The first watched peer (see [`Bootstrap::watch_peers`]) whose connection to this rank
    /// closed or failed without a goodbye, with a message saying so; None while all are fine.
    /// One atomic load while nothing was lost, so a proxy thread may poll it often.
    pub fn lost_peer(&self) -> Option<(usize, String)> {
        self.mailbox.lost_peer()
    }

    fn send_frame(
        &self,
        peer: usize,
        kind: Kind,
        tag: u64,
        data: &[u8],
        deadline: Instant,
        op: &str,
    ) -> Result<()> {
        let addr = self.peers[peer];
        let what = || format!("rank {}: {op} to rank {peer} at {addr}", self.rank);
        let mut g = lock(&self.out[peer]);
        if let Out::Idle = *g {
            let s = net::connect(&addr, deadline).map_err(|e| {
                net::classify(
                    e,
                    format!("{} (has rank {peer} exited?)", what()),
                    self.timeout,
                )
            })?;
            let open = frame::encode_raw(self.magic, Kind::Open as u32, self.rank as u32, 0, 0);
            if let Err(e) = net::write_all_by(&s, &open, deadline) {
                return Err(net::classify(e, what(), self.timeout));
            }
            match s.try_clone() {
                Ok(w) => self.mailbox.watch(peer, w),
                Err(e) => crate::warn!("{}: cannot watch the connection: {e}", what()),
            }
            *g = Out::Open(s);
        }
        let s = match &*g {
            Out::Open(s) => s,
            Out::Broken(why) => {
                return Err(Error::remote(format!(
                    "{}: the connection failed earlier: {why}",
                    what()
                )))
            }
            Out::Idle => return Err(Error::internal("bootstrap connection state")),
        };
        let r = if data.len() <= 64 << 10 {
            net::write_all_by(
                s,
                &frame::encode_frame(self.magic, kind, self.rank as u32, tag, data),
                deadline,
            )
        } else {
            let h = frame::encode_raw(
                self.magic,
                kind as u32,
                self.rank as u32,
                tag,
                data.len() as u64,
            );
            net::write_all_by(s, &h, deadline).and_then(|_| net::write_all_by(s, data, deadline))
        };
        if let Err(e) = r {
            let err = net::classify(e, what(), self.timeout);
            let _ = s.shutdown(Shutdown::Both);
            *g = Out::Broken(err.to_string());
            return Err(err);
        }
        crate::trace!("{}: {} bytes, tag {tag:#x}", what(), data.len());
        Ok(())
    }

    /// Fails with the error that broke this bootstrap, if one did (here or at a peer).
    fn check_sticky(&self, op: &str) -> Result<()> {
        if let Some(s) = &*lock(&self.sticky) {
            return Err(Error::remote(format!(
                "rank {}: {op}: the bootstrap failed earlier: {s}",
                self.rank
            )));
        }
        if let Some(a) = self.mailbox.aborted() {
            self.poison(&a);
            return Err(Error::remote(format!("rank {}: {op}: {a}", self.rank)));
        }
        Ok(())
    }

    /// Makes the failure sticky and spreads it: an Abort to every open connection and to both
    /// ring neighbours, then every connection closed. Ranks blocked on this one fail at once
    /// instead of at their deadline.
    fn poison(&self, why: &str) {
        {
            let mut st = lock(&self.sticky);
            if st.is_some() {
                return;
            }
            *st = Some(why.to_string());
        }
        crate::warn!(
            "rank {}: bootstrap failed, telling the peers: {why}",
            self.rank
        );
        let n = self.nranks;
        let (next, prev) = ((self.rank + 1) % n, (self.rank + n - 1) % n);
        let abort = root::abort_frame(self.magic, why);
        let mut abort_from_us = abort.clone();
        abort_from_us[12..16].copy_from_slice(&(self.rank as u32).to_le_bytes());
        let deadline = Instant::now() + self.timeout.min(Duration::from_secs(1));
        for p in (0..n).filter(|&p| p != self.rank) {
            // A peer whose lock is held has a send in progress; that send fails or finishes
            // on its own, and the mailbox closing below still reaches the peer.
            let Ok(mut g) = self.out[p].try_lock() else {
                continue;
            };
            match &*g {
                Out::Open(s) => {
                    let _ = net::write_all_by(s, &abort_from_us, deadline);
                    let _ = s.shutdown(Shutdown::Both);
                }
                Out::Idle if p == next || p == prev => {
                    if let Ok(s) = net::connect(&self.peers[p], deadline) {
                        let mut f = frame::encode_raw(
                            self.magic,
                            Kind::Open as u32,
                            self.rank as u32,
                            0,
                            0,
                        )
                        .to_vec();
                        f.extend_from_slice(&abort_from_us);
                        let _ = net::write_all_by(&s, &f, deadline);
                    }
                }
                _ => {}
            }
            *g = Out::Broken(why.to_string());
        }
        self.mailbox.close_all();
    }
}

/// Longest that dropping a [`Bootstrap`] spends saying goodbye to all its peers together.
const BYE_BUDGET: Duration = Duration::from_secs(1);

impl Drop for Bootstrap {
    /// Says goodbye on every open connection, so that the peers do not take this rank's
    /// closing for a crash, then closes them. Bounded: a Bye is one 32-byte frame that fits
    /// in the socket buffer, so it is handed to the kernel at once; only a peer that stopped
    /// reading can make it wait, and then at most [`BYE_BUDGET`] in all (plus a few ms per
    /// connection), after which that peer sees a close without goodbye, as for a crash.
    fn drop(&mut self) {
        let t0 = Instant::now();
        let shared = t0 + self.timeout.min(BYE_BUDGET);
        let bye = frame::encode_raw(self.magic, Kind::Bye as u32, self.rank as u32, 0, 0);
        let mut said = 0;
        for (p, o) in self.out.iter_mut().enumerate() {
            let o = o.get_mut().unwrap_or_else(|e| e.into_inner());
            if let Out::Open(s) = &*o {
                // Every connection gets at least one try, even after the shared budget.
                let deadline = shared.max(Instant::now() + Duration::from_millis(5));
                match net::write_all_by(s, &bye, deadline) {
                    Ok(()) => said += 1,
                    Err(e) => crate::trace!("rank {}: goodbye to rank {p}: {e}", self.rank),
                }
                // Sends FIN behind the Bye. The peer never writes on this connection, so no
                // unread data can turn the later close into a reset that would discard it.
                let _ = s.shutdown(Shutdown::Both);
            }
            *o = Out::Broken("the bootstrap was dropped".into());
        }
        crate::trace!(
            "rank {}: said goodbye to {said} peers in {:?}",
            self.rank,
            t0.elapsed()
        );
    }
}

#[cfg(test)]
mod tests;
