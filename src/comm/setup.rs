//! Connection setup (`mscclppConnectionSetup`): open one endpoint and proxy state per
//! `EndpointKey`, register each connection's buffer and epoch block, exchange the halves with
//! the peers over the bootstrap, import theirs, and fill the device connections.
//!
//! All halves are sent before any is received, and sends never wait for the receiver, so the
//! order in which ranks declared their connections cannot deadlock; a missing counterpart ends
//! in the bootstrap's timeout with an error naming the connection.

use super::{Comm, Conn, ConnBlob, Phase, Request, Slot, TAG_ACK, TAG_CONN};
use crate::abi::*;
use crate::error::{Error, Result};
use crate::fifo::Fifo;
use crate::mem::MemKind;
use crate::mem::SharedBlock;
use crate::proxy::{DirectEpoch, ProxyConn, ProxyWork, SharedEndpoint};
use crate::sync::lock;
use crate::transport::epoch::{EpochMem, EPOCH_BYTES};
use crate::transport::inbox::{self, Inbox, Outbox};
use crate::transport::{self, EndpointKey, MrId, Region};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// What every setup acknowledgement starts with; the link follows (`acknowledge`).
const ACK: &[u8; 2] = b"ok";

/// The most connections one proxy FIFO can address (connId has 10 bits).
const MAX_CONNS_PER_PROXY: usize = 1 << MSCCLPP_BITS_CONNID;

/// This rank's half of one connection, made and sent in step 1.
struct Local {
    slot: usize,
    /// The connection's buffer as registered with its endpoint.
    src: MrId,
    epoch: EpochMem,
}

impl Comm {
    /// Establishes every declared connection (mscclppConnectionSetup).
    pub fn setup(&mut self) -> Result<()> {
        self.check_sticky()?;
        if self.phase != Phase::Declaring {
            return Err(Error::usage(if self.phase == Phase::Ready {
                "mscclppConnectionSetup was already called"
            } else {
                "an earlier mscclppConnectionSetup failed; destroy this communicator"
            }));
        }
        let r = self.setup_all();
        self.phase = if r.is_ok() {
            Phase::Ready
        } else {
            Phase::Failed
        };
        r
    }

    fn setup_all(&mut self) -> Result<()> {
        let reqs = std::mem::take(&mut self.requests);
        // 1. Register locally and send our half of every connection.
        let mut local = Vec::with_capacity(reqs.len());
        for r in &reqs {
            local.push(self.send_half(r)?);
        }
        // 2. Receive the peers' halves, validate, import.
        let mut inline = 0;
        for (i, (r, l)) in reqs.iter().zip(local).enumerate() {
            inline += self.establish(r, l)? as usize;
            crate::trace!(
                "rank {}: connection {i} to rank {} tag {} ready",
                self.rank(),
                r.remote_rank,
                r.tag
            );
        }
        // 3. Both sides have imported each other's regions (and mapped the shared epoch
        // blocks) before either returns; the names can go then.
        self.acknowledge()?;
        for c in &mut self.conns {
            c._epoch.unlink_shared();
        }
        // From now on a peer that dies (closes its bootstrap connection without a goodbye)
        // is noticed by the proxies, which abort every wait on this communicator.
        let peers: Vec<usize> = self.conns.iter().map(|c| c.remote_rank).collect();
        self.boot.watch_peers(&peers)?;
        self.hang = Some(super::hang::open(self.hang_source()));
        crate::info!(
            "rank {}: {} connections set up over {} endpoints",
            self.rank(),
            self.conns.len(),
            self.slots.len()
        );
        if inline > 0 {
            crate::info!(
                "rank {}: on {inline} SHM connections, host threads' puts of up to {} bytes on an idle connection go inline through the peer's ring, without the proxy (MSCCLPP_SHM_INLINE_BYTES)",
                self.rank(),
                crate::config::get().shm_inline_bytes
            );
        }
        Ok(())
    }

    /// The slot of the endpoint for `key`, opened (with its FIFO and proxy state) on first use.
    fn slot_for(&mut self, key: &EndpointKey) -> Result<usize> {
        if let Some(i) = self.slots.iter().position(|s| &s.key == key) {
            return Ok(i);
        }
        let mut ep = transport::open(key)?;
        crate::info!("rank {}: opened endpoint {}", self.rank(), ep.describe());
        let caps = ep.caps();
        let fifo = Fifo::for_device(key.device())?;
        if let Some(word) = fifo.done_word() {
            if ep.use_done_word(word)? {
                fifo.enable_done_word()?;
            }
        }
        let ep: SharedEndpoint = Arc::new(Mutex::new(ep));
        let name = format!("mscclpp-proxy-{}.{}", self.rank(), self.slots.len());
        // Host producers may do the proxy's work, except on an endpoint a dead peer can wedge
        // (a host thread stuck inside it could not be abandoned as the proxy thread can).
        let work = ProxyWork::new(
            fifo,
            ep.clone(),
            self.boot.clone(),
            self.sticky.clone(),
            name,
            !caps.may_wedge,
        );
        let gate = lock(&work).gate();
        self.slots.push(Slot {
            key: key.clone(),
            caps,
            ep,
            work,
            gate,
            running: None,
            abandoned: false,
            peers: HashMap::new(),
        });
        Ok(self.slots.len() - 1)
    }

    /// Step 1 for one connection: its endpoint, its epoch block where the transport places it,
    /// both registered, and our half sent to the peer.
    fn send_half(&mut self, r: &Request) -> Result<Local> {
        let s = self.slot_for(&r.key)?;
        let mut ep = lock(&self.slots[s].ep);
        let epoch = ep.epoch_block(r.kind)?;
        let addr = ep.address()?;
        let (src, data_blob) = ep.register(Region {
            addr: r.buff,
            len: r.size,
            kind: r.kind,
        })?;
        let (epoch_mr, epoch_blob) = ep.register(Region {
            addr: epoch.ptr() as u64,
            len: epoch.export_len(),
            kind: r.kind,
        })?;
        drop(ep);
        self.hold_region(s, src);
        self.hold_region(s, epoch_mr);
        let msg = ConnBlob {
            transport: r.transport as u32,
            tag: r.tag,
            rank: self.rank(),
            size: r.size,
            addr: &addr,
            data: &data_blob,
            epoch: &epoch_blob,
            epoch_shm: epoch.shared_name().unwrap_or("").as_bytes(),
        }
        .encode();
        self.boot
            .send(r.remote_rank, TAG_CONN | r.tag as u32 as u64, &msg)?;
        Ok(Local {
            slot: s,
            src,
            epoch,
        })
    }

    /// Step 2 for one connection: the peer's half received, checked and imported; the proxy's
    /// and the kernels' views of the connection made. True if small puts on it may go inline
    /// (`transport::inbox`).
    fn establish(&mut self, r: &Request, l: Local) -> Result<bool> {
        let Local {
            slot: s,
            src,
            epoch,
        } = l;
        let msg = self
            .boot
            .recv(r.remote_rank, TAG_CONN | r.tag as u32 as u64)
            .map_err(|e| {
                Error::remote(format!(
                    "connection to rank {} tag {}: no matching mscclppConnect on the peer ({e})",
                    r.remote_rank, r.tag
                ))
            })?;
        let caps = self.slots[s].caps;
        let ConnBlob {
            size: rsize,
            addr,
            data: data_blob,
            epoch: epoch_blob,
            epoch_shm,
            ..
        } = ConnBlob::decode(&msg, r.remote_rank, r.tag, r.transport, caps.direct_epoch)?;
        let slot = &mut self.slots[s];
        let mut ep = lock(&slot.ep);
        // The peer's epoch block, mapped where the transport lets signals be stored into it
        // directly (SHM over host memory).
        let direct = if epoch_shm.is_empty() || !ep.direct_epoch_for(r.kind) {
            None
        } else {
            // The block, with its ring of inline puts unless the peer turned them off.
            let lens: &[usize] = if r.kind == MemKind::Host {
                &[EPOCH_BYTES, inbox::BLOCK_BYTES]
            } else {
                &[EPOCH_BYTES]
            };
            Some(map_peer_epoch(r.remote_rank, epoch_shm, lens)?)
        };
        let peer = match slot.peers.get(&(r.remote_rank, addr.to_vec())) {
            Some(p) => *p,
            None => {
                let p = ep.add_peer(r.remote_rank, addr)?;
                slot.peers.insert((r.remote_rank, addr.to_vec()), p);
                p
            }
        };
        let dst = ep.import(peer, data_blob)?;
        // The envelope's size bounds the kernels' offsets (the proxy's range checks); the
        // region blob bounds what the transport writes. They must agree.
        if ep.remote_len(dst) != Some(rsize) {
            return Err(Error::remote(format!(
                "rank {}: its setup blob declares a {rsize}-byte buffer, but its region blob {} bytes",
                r.remote_rank,
                ep.remote_len(dst).map_or("none".into(), |l| l.to_string())
            )));
        }
        let remote_epoch = ep.import(peer, epoch_blob)?;
        let remote_buff = ep.remote_ptr(dst).unwrap_or(0);
        let remote_epoch_ptr = ep.remote_ptr(remote_epoch).unwrap_or(0);
        // The sizes and the direct path (P2P): written before any kernel can see the connection.
        let direct_limits = ep.direct_limits(peer, dst, remote_epoch);
        drop(ep);
        epoch.write_setup(direct_limits, r.size, rsize)?;
        let mut work = lock(&slot.work);
        if work.conns.len() >= MAX_CONNS_PER_PROXY {
            return Err(Error::invalid_arg(format!(
                "more than {MAX_CONNS_PER_PROXY} connections on one endpoint"
            )));
        }
        let conn_id = work.conns.len();
        if direct.is_some() {
            crate::fifo::set_direct(work.fifo.producer_view(0).triggerFifoHead);
        }
        // Inline puts both ways (`transport::inbox`): ours into the peer's ring, the peer's into
        // ours, which our waiters and proxy apply (the registry lets a waiter find it).
        let max_inline = crate::config::get().shm_inline_bytes;
        let (outbox, inbox) = match (&direct, epoch.shm_block()) {
            (Some(d), Some(own)) if r.kind == MemKind::Host && own.len() >= inbox::BLOCK_BYTES => {
                let outbox = (max_inline > 0 && d.0.len() >= inbox::BLOCK_BYTES)
                    .then(|| Outbox::new(d.0.clone(), r.buff, max_inline))
                    .transpose()?;
                // SAFETY: the user's buffer stays valid until the communicator is destroyed,
                // and its proxies and waiters stop draining before that returns.
                let inbox =
                    Arc::new(unsafe { Inbox::new(own.clone(), r.buff, r.size, r.remote_rank) }?);
                crate::fifo::set_inbox(
                    work.fifo.producer_view(0).triggerFifoHead,
                    conn_id,
                    inbox.clone(),
                );
                (outbox, Some(inbox))
            }
            _ => (None, None),
        };
        let has_inline = outbox.is_some();
        work.conns.push(ProxyConn {
            index: self.dev_conns.len(),
            remote_rank: r.remote_rank,
            peer,
            src,
            local_size: r.size,
            dst,
            remote_size: rsize,
            remote_epoch,
            signals: 0,
            direct,
            outbox,
            inline: Default::default(),
            // On a tight host the receiver needs the core the waiting sender spins on: there a
            // 16 KiB stream that waited ran 20-30% slower than through the proxy (2-core VM).
            wait_for_room_above: if crate::sync::host_is_tight() {
                u64::MAX
            } else {
                crate::proxy::WAIT_FOR_ROOM_ABOVE
            },
            inbox: inbox.clone(),
            undelivered: false,
            regain_direct: false,
        });
        let ep_ptr = epoch.ptr();
        self.dev_conns.push(mscclppDevConn {
            remoteRank: r.remote_rank as i32,
            tag: r.tag,
            localBuff: r.buff as *mut _,
            localSignalEpochId: ep_ptr.cast(),
            remoteSignalEpochId: remote_epoch_ptr as *mut _,
            // SAFETY: every epoch block is at least EPOCH_BYTES (32): 16 of epoch ids, then
            // waitEpochId.
            waitEpochId: unsafe { ep_ptr.add(16) }.cast(),
            remoteBuff: remote_buff as *mut _,
            fifo: work.fifo.producer_view(conn_id),
        });
        drop(work);
        self.conns.push(Conn {
            slot: s,
            remote_rank: r.remote_rank,
            tag: r.tag,
            peer,
            _epoch: epoch,
            inbox,
        });
        Ok(has_inline)
    }

    /// What this rank's hang report reads: per connection, its peer, tag, proxy slot and id
    /// there, and its epoch block where the host can read it; per slot, its FIFO and proxy.
    fn hang_source(&self) -> super::hang::Source {
        use super::hang::{weak_work, ConnView, SlotView, Source};
        let conns = self
            .conns
            .iter()
            .zip(&self.dev_conns)
            .map(|(c, d)| ConnView {
                remote_rank: c.remote_rank,
                tag: c.tag,
                slot: c.slot,
                conn_id: d.fifo.connId as usize,
                epoch: c._epoch.host_ptr().map(|p| p as *const u64),
            })
            .collect();
        let slots = self
            .slots
            .iter()
            .map(|s| {
                let v = lock(&s.work).fifo.producer_view(0);
                SlotView {
                    head: v.triggerFifoHead as usize,
                    tail: v.triggerFifoTail,
                    work: weak_work(&s.work),
                }
            })
            .collect();
        Source {
            rank: self.rank(),
            nranks: self.nranks(),
            boot: Arc::downgrade(&self.boot),
            conns,
            slots,
            alive: std::sync::RwLock::new(true),
            busy: Mutex::new(()),
            wanted: Mutex::new(None),
            written: Default::default(),
        }
    }

    /// Step 3: an acknowledgement to and from every peer of every connection, carrying what
    /// each endpoint keeps for the other's (`Endpoint::link_for`: the net transport's staging
    /// channel and counting stream), now that both know which of the other's endpoints
    /// writes to them.
    fn acknowledge(&self) -> Result<()> {
        for c in &self.conns {
            let link = lock(&self.slots[c.slot].ep).link_for(c.peer)?;
            self.boot.send(
                c.remote_rank,
                TAG_ACK | c.tag as u32 as u64,
                &[ACK.as_slice(), &link].concat(),
            )?;
        }
        for c in &self.conns {
            let m = self
                .boot
                .recv(c.remote_rank, TAG_ACK | c.tag as u32 as u64)?;
            let Some(link) = m.strip_prefix(ACK.as_slice()) else {
                return Err(Error::remote(format!(
                    "rank {}: bad setup acknowledgement",
                    c.remote_rank
                )));
            };
            lock(&self.slots[c.slot].ep)
                .link_to(c.peer, link)
                .map_err(|e| {
                    e.within(&format!(
                        "connection to rank {} tag {}",
                        c.remote_rank, c.tag
                    ))
                })?;
        }
        Ok(())
    }
}

/// Maps the epoch block that rank `rank` offered by shared-memory name `name`.
fn map_peer_epoch(rank: usize, name: &[u8], lens: &[usize]) -> Result<DirectEpoch> {
    let name = std::str::from_utf8(name)
        .map_err(|_| Error::remote(format!("rank {rank}: shared epoch name is not UTF-8")))?;
    let block = SharedBlock::open(name, lens)
        .map_err(|e| Error::remote(format!("rank {rank}: its epoch block: {e}")))?;
    Ok(DirectEpoch(Arc::new(block)))
}
