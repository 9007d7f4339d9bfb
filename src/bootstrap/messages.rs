//! Tagged point-to-point messages, and the per-peer connections that every frame this rank
//! sends travels on (opened on first use, authenticated with an `Open` frame).

use super::frame::{self, Kind, MAX_PAYLOAD};
use super::{net, Bootstrap, Out};
use crate::error::{Error, Result};
use crate::sync::lock;
use std::net::Shutdown;
use std::time::Instant;

impl Bootstrap {
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
        let what = self.recv_checks(peer, tag)?;
        let deadline = Instant::now() + self.timeout;
        self.mailbox
            .take((Kind::P2p, peer, tag), deadline, self.timeout, &what)
    }

    /// Waits at most `bound` for the message `peer` sent with `tag`: `Some` when it came, `None`
    /// when the peer's connection closed first (it destroyed its communicator, or died).
    /// Fails at the bound, or at once when this communicator was aborted.
    pub fn recv_unless_gone(
        &self,
        peer: usize,
        tag: u64,
        bound: std::time::Duration,
    ) -> Result<Option<Vec<u8>>> {
        let what = self.recv_checks(peer, tag)?;
        let deadline = Instant::now() + bound;
        self.mailbox
            .take_unless_gone((Kind::P2p, peer, tag), deadline, bound, &what)
    }

    /// The checks before a receive, and what the receive is called in its errors.
    fn recv_checks(&self, peer: usize, tag: u64) -> Result<impl Fn() -> String + '_> {
        self.check_peer(peer, "recv")?;
        self.check_sticky("recv")?;
        Ok(move || {
            format!(
                "rank {}: recv from rank {peer} with tag {tag:#x}",
                self.rank
            )
        })
    }

    pub(super) fn send_frame(
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
}
