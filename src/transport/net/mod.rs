//! The network transport: one libfabric RDM endpoint (fabric, domain, address vector, completion
//! queue, endpoint) per `NetEndpoint`, RMA writes for Data, an 8-byte write for Flag, a CQ drain
//! for Sync. Serves `mscclppTransportIB` (any provider) and `mscclppTransportSHM` (`shm`).
//!
//! Choice of provider and address (`select.rs`): `shm` for SHM. Otherwise
//! `MSCCLPP_NET_PROVIDER` (or `FI_PROVIDER`) narrows the provider; `ibDev` names a domain or
//! fabric; `MSCCLPP_NET_IFACE` names the interface (the domain name of socket providers) and
//! `MSCCLPP_NET_ADDR` the local address to bind. With none of them, a hardware provider wins,
//! then `tcp;ofi_rxm`, `tcp`, `net`; `sockets` and `udp;ofi_rxd` (slow, hang-prone for RMA)
//! only when named. Socket providers then default to the loopback interface: correct on one
//! host, and it never sends traffic off the machine by surprise; a rank whose peer is not on
//! loopback fails in `add_peer` with a message naming the variables to set.
//!
//! Guarantees (Endpoint contract):
//! - Flag after data (`order.rs`, docs/DESIGN.md 3.6): WAW ordering is requested
//!   (`FI_ORDER_RMA_WAW | FI_ORDER_WAW`) and trusted for writes within the provider's
//!   `max_order_waw_size`; after a larger write, the flag (or staging record, or marker)
//!   carries `FI_FENCE`, or failing that every earlier write to the peer is completed first,
//!   the unordered ones having carried FI_DELIVERY_COMPLETE: a flag waits for that in a
//!   per-peer queue (`Peers::defer_flag`, posted by `post_ready` from progress, the next write
//!   or a flush), so the proxy is not held up; queued flags into one word that are ready
//!   together go as one, the newest count. A provider with none of these is refused when the
//!   endpoint opens. What a provider grants is read from its fi_info and amended by what its
//!   source does beyond it (`profile.rs`, docs/PROVIDERS.md); what the plan relies on is
//!   tried on the endpoint itself when it opens (`probe.rs`).
//! - A `write_then_value` into host memory of a peer that takes them is one write carrying the
//!   value as remote CQ data, stored by the peer's endpoint when it reads that write's
//!   completion (`signals.rs`), where the plan orders every earlier write and every chunk of
//!   this one, the riding chunk too; a flush writes the newest such value of each word again,
//!   so it covers them. On efa-rdm, signals are counted by the receiver instead (`counted.rs`).
//! - A peer is an endpoint, not a rank: what we keep for it (staging channel, counting stream)
//!   is its link (`blob::LinkBlob`), exchanged after both sides added each other.
//! - flush = "arrived": tcp;ofi_rxm and net complete a plain write locally before the data is
//!   at the target, so flush needs `FI_DELIVERY_COMPLETE`. Putting it on every write costs a
//!   target acknowledgement per write (measured, 8 B put + flag half round trip: tcp 7.5 us
//!   without, 11.6 us with it on both writes; shm 1.2 / 2.6 us), and on a flag alone it made
//!   the tcp signal half round trip bimodal (median 164 us against 3.7 us plain: the
//!   acknowledgement waits on the target's progress). So data and flag writes go plain, and a
//!   flush whose peer's last write was a plain one posts one 8-byte delivery-complete write (a
//!   "marker") into that peer's scratch word (advertised in its address blob). The marker is
//!   ordered like a flag, so its delivery implies that of every earlier write it follows in
//!   order, and the writes it does not follow in order carried FI_DELIVERY_COMPLETE
//!   themselves; the flush waits for all of them. Where the provider refuses it, flush only
//!   means "locally complete" (INFO, once).
//! - A peer must keep progressing its endpoint until its peers' flushes are done (the marker
//!   needs the target's progress): a stopped communicator's endpoints are progressed until its
//!   next launch or destroy (`proxy::Keeper`), and a destroyed one lingers (`comm::LINGER`)
//!   before it closes its endpoints; raw `Endpoint` users progress until the peer is done.
//! - shm drops a write with a bad key or range at the target without an error completion; only
//!   validated blobs reach the data path, so this needs a peer bug, but it goes unreported.
//! - Source buffers stay untouched until completion; the flag's 8-byte value sits in a
//!   registered staging slot owned by the operation's context slot until its completion.
//! - `-FI_EAGAIN`: progress the CQ and retry the same operation, never drop; every wait is
//!   bounded by `crate::config::wait_timeout()`.
//!
//! GPU memory: with FI_HMEM (and a provider that registers CUDA memory, and a driver with
//! `cuFlushGPUDirectRDMAWrites`) device regions are registered directly, and values (signal
//! counts) written into them are relayed through the owner's proxy, which flushes GPUDirect
//! writes before storing them. Otherwise device regions are staged through pinned host memory
//! (`staging/`): the owner's proxy copies every write into the GPU buffer and stores values
//! after those copies. The owner chooses per region and tells writers in the region blob.

mod blob;
mod counted;
mod endpoint;
mod fabric;
mod flush;
mod locality;
mod mr;
mod ops;
mod order;
mod peers;
mod probe;
mod profile;
mod rails;
mod record;
mod regions;
mod select;
mod signals;
mod staging;
mod unordered;

use super::Endpoint;
use crate::config::NetConfig;
use crate::error::Result;

pub use endpoint::NetEndpoint;
pub use mr::live_registrations;
pub use ops::Stats;
pub use rails::{RailStats, Rails};

/// Opens a libfabric RDM endpoint on `domain` (None: first suitable); `shm` selects the shm
/// provider. `device` is the CUDA device whose memory will be registered, if any. Domains
/// joined by `+` (`mlx5_0+mlx5_1`), or NICs the library chose that have equally near
/// siblings, make one endpoint striped over them (`rails.rs`).
pub fn open(domain: Option<&str>, shm: bool, device: Option<i32>) -> Result<Box<dyn Endpoint>> {
    open_with(domain, shm, device, &crate::config::get().net)
}

/// `open` with the settings `cfg` instead of the process's.
pub fn open_with(
    domain: Option<&str>,
    shm: bool,
    device: Option<i32>,
    cfg: &NetConfig,
) -> Result<Box<dyn Endpoint>> {
    // Rails named: by ibDev (or its MSCCLPP_IBDEV_MAP target), else by MSCCLPP_NET_IFACE.
    let named = match (domain, &cfg.iface) {
        _ if shm => None,
        (Some(d), _) => d.contains('+').then_some(d),
        (None, Some(i)) => i.contains('+').then_some(i.as_str()),
        (None, None) => None,
    };
    if let Some(list) = named {
        let names: Vec<&str> = list.split('+').map(str::trim).collect();
        return Ok(Box::new(Rails::open(&names, device, cfg)?));
    }
    let ep = NetEndpoint::open(domain, shm, device, cfg)?;
    if shm || cfg.rails < 2 {
        return Ok(Box::new(ep));
    }
    Rails::widen(ep, device, cfg)
}

#[cfg(test)]
mod tests;
