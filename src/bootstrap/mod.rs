//! TCP rendezvous between the ranks of a communicator, and the small collectives and tagged
//! messages that connection setup runs over it.
//!
//! Joining: rank 0 serves the root address (`root`); every rank (rank 0 included) opens its
//! own listener on the interface that reaches the root, connects to the root and sends a
//! `Hello` (magic, rank, nranks, listen address). When all have joined, the root sends each
//! the table of listen addresses; a barrier around the ring then proves every rank reachable.
//!
//! Afterwards ranks talk directly: one persistent connection per (sender, receiver) pair,
//! opened on first use. A thread per rank (`mailbox`) drains incoming connections into a
//! mailbox keyed by (sender, tag), so sends never wait for the matching receive. The
//! all-gather is a ring over those connections; the barrier a dissemination over them.
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
//!
//! [`Bootstrap`]'s methods, by role: `join.rs` (the rendezvous), `messages.rs` (tagged send and
//! receive, and the connections every frame goes out on), `collective.rs` (all-gather,
//! barrier), `watch.rs` (the peer-death watch), `report.rs` (hang reports: asking every rank,
//! answered by its mailbox thread), `teardown.rs` (the sticky failure and its `Abort`s,
//! goodbye on drop).

mod addr;
mod collective;
pub mod frame;
mod id;
/// Eight random bytes from the kernel, never zero (nonces that tell processes apart).
pub(crate) use id::random_magic as random_nonce;
mod join;
mod mailbox;
mod messages;
mod net;
mod report;
mod root;
mod teardown;
mod watch;

use crate::abi::MSCCLPP_UNIQUE_ID_BYTES;
use crate::error::{Error, Result};
use frame::MAX_RANKS;
use mailbox::Mailbox;
pub use mailbox::ReportSource;
pub use report::Answer;
use std::net::{SocketAddr, SocketAddrV6, TcpListener, TcpStream};
use std::sync::Mutex;
use std::time::Duration;

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
    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn nranks(&self) -> usize {
        self.nranks
    }

    /// Ranks whose bootstrap listens on this rank's IP address (this one included): the ranks
    /// on this host, as far as the addresses tell.
    pub fn ranks_on_this_host(&self) -> usize {
        let me = self.peers[self.rank].ip();
        self.peers.iter().filter(|a| a.ip() == me).count()
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
}

#[cfg(test)]
mod tests;
