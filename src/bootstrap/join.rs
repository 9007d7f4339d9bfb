//! Joining a communicator: rank 0 starts the root, every rank registers its listen address
//! there and gets the table of all ranks' addresses, then a barrier proves the ring reachable.

use super::frame::{self, Kind};
use super::mailbox::Mailbox;
use super::{addr, check_ranks, id, net, root, timeout, Bootstrap, Out};
use crate::abi::MSCCLPP_UNIQUE_ID_BYTES;
use crate::error::{Error, Result};
use std::net::{Shutdown, SocketAddr, TcpListener};
use std::sync::Mutex;
use std::time::{Duration, Instant};

impl Bootstrap {
    /// Joins the `nranks`-rank communicator whose root is `ip_port` (`"ip:port"`,
    /// `"[ipv6]:port"` or `"host:port"`); rank 0 listens there. Every rank must pass the same
    /// string: the communicator's magic is derived from it, from `nranks`, and from
    /// `MSCCLPP_BOOTSTRAP_SECRET` where set (ranks without the same secret are refused).
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
            frame::addr_magic_with(
                ip_port,
                nranks,
                crate::config::get().bootstrap_secret.as_deref(),
            ),
            rank,
            nranks,
        )
    }

    /// Joins the communicator described by a unique id from
    /// [`new_unique_id`](super::new_unique_id).
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
}
