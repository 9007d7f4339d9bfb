//! One libfabric RDM endpoint (`NetEndpoint`, the module doc of `net` says what it guarantees):
//! opening it (the provider's plan, `order.rs`; the signal way; FI_HMEM or staging), and the
//! `Endpoint` trait over its parts (`regions`, `ops`, `peers`, `staging`).

use super::blob::{self, AddrBlob, Mode, MrBlob};
use super::fabric::{core_provider, InfoView};
use super::ops::Stats;
use super::ops::{Op, Ops};
use super::peers::{self, Peers};
use super::regions::{self, Regions};
use super::staging::{self, Net, Staging};
use super::{counted, mr, order, probe, select, signals, unordered};
use crate::config::{Hmem, NetConfig};
use crate::error::{Error, Result};
use crate::transport::epoch::{self, EpochMem};
use crate::transport::{AbortCheck, Caps, Endpoint, MemKind, MrId, PeerId, Region, RemoteId};
use libfabric_sys as fi;
use std::sync::atomic::{AtomicBool, Ordering as AtOrd};

/// Bounds on the operations one endpoint keeps in flight (the provider's tx size in between).
pub(super) const MIN_DEPTH: usize = 16;
pub(super) const MAX_DEPTH: usize = 4096;

/// Defenses a unit test may take out to show that the test layer catches their absence (the
/// planted bugs of issue 40; docs/DESIGN.md 3.6). Per thread: the endpoints a unit test opens
/// open on its thread.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Planted {
    /// Plan from the fi_info alone, without the provider's source rules (`Attrs::amend`).
    pub no_amend: bool,
    /// Trust the plan without trying it (`probe.rs`).
    pub no_probe: bool,
    /// Leave writes that carry CQ data uncut where the provider repeats it per segment.
    pub no_split_cap: bool,
    /// Let a signal ride whatever the chunks a staged source is really cut into (bounce
    /// slots): the ride test counts chunks of `max_chunk` (before issue 40, finding 3 of the
    /// review).
    pub ride_ignores_source_chunks: bool,
    /// Let a signal ride a write larger than the ordered size (before issue 40: only the
    /// writes before it were counted; finding 6 of the review).
    pub ride_ignores_own_size: bool,
}

#[cfg(test)]
thread_local! {
    pub(super) static PLANTED: std::cell::Cell<Planted> = std::cell::Cell::new(Planted::default());
}

/// The defenses taken out on this thread (none outside unit tests).
pub(super) fn planted() -> Planted {
    #[cfg(test)]
    return PLANTED.with(|p| p.get());
    #[cfg(not(test))]
    Planted::default()
}

/// Removes the shm provider's files left under this pid by a dead process
/// (`libfabric_sys::remove_stale_shm_files` says why), once, before the first endpoint.
fn remove_stale_shm_names() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        for (name, r) in libfabric_sys::remove_stale_shm_files() {
            match r {
                Ok(()) => crate::info!("net: removed /dev/shm/{name}, left by a dead process that had this pid"),
                Err(e) => crate::warn!("net: cannot remove stale /dev/shm/{name} ({e}); shm endpoints may fail with EBUSY"),
            }
        }
    });
}

/// A libfabric RDM endpoint (module doc), in parts. Fields drop in this order once `Drop` has
/// closed every MR and the endpoint: `ops` frees its registered host blocks, closes the CQ, AV,
/// domain and fabric, then frees the op slots (the writes' contexts); `staging` drops its
/// copier before the rings and bounce slots its copies read.
pub struct NetEndpoint {
    /// Registrations, local regions, imported regions (`regions.rs`).
    pub(super) regions: Regions,
    /// The libfabric objects and the writes in flight on them (`ops.rs`).
    pub(super) ops: Ops,
    /// Our address and the peer table (`peers.rs`).
    pub(super) peers: Peers,
    /// GPU memory staged through host memory (`staging/`).
    pub(super) staging: Staging,
    /// Serves `mscclppTransportSHM` (see `Endpoint::caps`).
    pub(super) shm_transport: bool,
    /// Where the NIC was chosen by locality: the equally near NICs, this one first, which
    /// `Rails::widen` may add as rails (`select::Choice::nics`).
    pub(super) nics: Vec<String>,
}

// SAFETY: the raw pointers are libfabric objects and memory owned by this endpoint. The domain is
// opened with FI_THREAD_DOMAIN, and every use goes through `&mut self` (the comm and the proxy
// serialise on a Mutex), so no two threads touch the domain's objects at once.
unsafe impl Send for NetEndpoint {}

/// Logged once per process: what flush means without FI_DELIVERY_COMPLETE.
pub(super) static WEAK_FLUSH_LOGGED: AtomicBool = AtomicBool::new(false);

/// Providers on which FI_HMEM was measured slower than staging through pinned host memory,
/// with the measurement: `MSCCLPP_NET_HMEM=auto` stages GPU memory on them. Hardware providers
/// (verbs, efa, cxi), whose NIC writes GPU memory itself, are not here.
pub(super) const HMEM_SLOWER_THAN_STAGING: &[(&str, &str)] = &[(
    "shm",
    "FI_HMEM through the shm provider measured ~4x slower than staging (1.6 against 6.7 GB/s one way, one H100, libfabric 2.1 with CUDA, bench/RESULTS.md 2026-11-24); MSCCLPP_NET_HMEM=1 uses it anyway",
)];

/// Providers (the first of a layered name) whose writes move only while the target calls into
/// them, software all: their writes carry the activity mark (`signals::ACTIVITY`). Hardware
/// providers place writes without the target, and their completion queues do not grow.
pub(super) const TARGET_PROGRESSES: &[&str] = &["tcp", "shm", "net", "sockets", "udp"];

/// Whether a peer that dies can wedge an endpoint of `provider` (`Caps::may_wedge`): libfabric
/// 1.17's shm keeps its spin locks in the shared memory its peers map, whichever of our
/// transports opened it (mscclppTransportSHM, or the IB transport with
/// `MSCCLPP_NET_PROVIDER=shm`); efa and 2.x's lnx reach peers on the same host through an shm
/// endpoint of their own (efa unless `FI_EFA_ENABLE_SHM_TRANSFER=0`, which is not read here:
/// they count as wedgeable either way).
pub(super) fn provider_may_wedge(provider: &str) -> bool {
    matches!(core_provider(provider), "shm" | "efa" | "lnx")
}

/// How signals travel on this endpoint (as remote CQ data riding with the put, or counted by
/// the receiver), or why they are writes of their own.
pub(super) fn signals_choice(
    cfg: &NetConfig,
    a: &order::Attrs,
    plan: &order::Plan,
) -> std::result::Result<order::SignalWay, String> {
    if !cfg.cq_signals {
        return Err("MSCCLPP_NET_CQ_SIGNALS=0".into());
    }
    order::signal_way(a, plan)
}

/// Whether this endpoint registers GPU memory with FI_HMEM, or why not (the reason is logged
/// per region).
pub(super) fn hmem_choice(
    policy: Hmem,
    reported: bool,
    provider: &str,
) -> std::result::Result<(), &'static str> {
    if policy == Hmem::Never {
        return Err("MSCCLPP_NET_HMEM=0");
    }
    if policy == Hmem::Auto {
        if let Some(why) = slower_than_staging(provider) {
            return Err(why);
        }
    }
    if !reported {
        return Err("the provider does not report FI_HMEM");
    }
    Ok(())
}

/// Why FI_HMEM on `provider` was measured slower than staging, if it was
/// (`HMEM_SLOWER_THAN_STAGING`).
pub(super) fn slower_than_staging(provider: &str) -> Option<&'static str> {
    HMEM_SLOWER_THAN_STAGING
        .iter()
        .find(|(p, _)| core_provider(provider) == *p)
        .map(|(_, why)| *why)
}

/// Whether an endpoint for GPU memory asks the provider for FI_HMEM: not where its memory would
/// be staged anyway (`MSCCLPP_NET_HMEM=0`; `auto` on a provider measured slower than staging,
/// the SHM transport's or the only one named). A provider's FI_HMEM entry is weaker in other
/// ways: shm's orders no write (its device copies by IPC may end after a later command), so
/// every write would wait for the one before it.
pub(super) fn asks_hmem(cfg: &NetConfig, shm: bool) -> bool {
    match cfg.hmem {
        Hmem::Never => false,
        Hmem::Always => true,
        Hmem::Auto => {
            let named = match (shm, &cfg.providers) {
                (true, _) => vec!["shm"],
                (false, Some(p)) => p.iter().map(String::as_str).collect(),
                (false, None) => Vec::new(),
            };
            named.is_empty() || !named.iter().all(|p| slower_than_staging(p).is_some())
        }
    }
}

impl NetEndpoint {
    /// Opens an endpoint (see `open`) with the settings `cfg` instead of the process's.
    pub fn open(
        domain: Option<&str>,
        shm: bool,
        device: Option<i32>,
        cfg: &NetConfig,
    ) -> Result<Self> {
        remove_stale_shm_names();
        let req = select::Request {
            domain,
            shm,
            // Only asks for FI_HMEM.
            device: device.filter(|_| asks_hmem(cfg, shm)),
        };
        let choice = select::choose(&req, cfg)?;
        let info = choice.info;
        let i = info
            .first()
            .ok_or_else(|| Error::internal("empty fi_info after selection"))?;
        let v = InfoView(i);
        let (provider, domain_name, fabric_name) =
            (v.prov_name(), v.domain_name(), v.fabric_name());
        let d = v
            .domain()
            .ok_or_else(|| Error::internal("fi_info without domain_attr"))?;
        let mr_mode = d.mr_mode as u32;
        let unsupported = mr_mode & !(select::MR_MODE_SUPPORTED | fi::FI_MR_HMEM);
        if unsupported != 0 {
            return Err(Error::usage(format!(
                "provider {provider} requires mr_mode {} which this transport does not implement",
                select::mr_mode_names(unsupported)
            )));
        }
        let layer = cfg.unordered.map(|u| {
            let real_mr_local = mr_mode & fi::FI_MR_LOCAL != 0;
            unordered::Layer::new(u, real_mr_local)
        });
        // The cxi-like layer registers as cxi does: the FI_MR_ENDPOINT sequence (bind and
        // enable, -FI_ENOSYS from tcp and shm accepted), keys per endpoint (`Regions`); its
        // offsets are the real provider's (tcp and shm take offsets, docs/PROVIDERS.md).
        let provider_keys = layer.as_ref().is_some_and(|l| l.profile.provider_keys);
        let forced = cfg.force_mr_endpoint || provider_keys;
        let policy = mr::Policy {
            endpoint: mr_mode & fi::FI_MR_ENDPOINT != 0 || forced,
            forced: forced && mr_mode & fi::FI_MR_ENDPOINT == 0,
            prov_key: mr_mode & fi::FI_MR_PROV_KEY != 0,
            virt_addr: mr_mode & fi::FI_MR_VIRT_ADDR != 0,
            key_size: d.mr_key_size,
        };
        let tx_size = v.tx().map_or(MIN_DEPTH, |t| t.size);
        // More slots than the provider's queue makes the provider answer -FI_EAGAIN, which the
        // retry path then absorbs.
        let depth = cfg
            .tx_depth
            .map(|n| n.clamp(1, 65536))
            .unwrap_or_else(|| tx_size.clamp(MIN_DEPTH, MAX_DEPTH));
        let max_msg = v.ep().map_or(u64::MAX, |e| e.max_msg_size as u64).max(8);
        let max_chunk = cfg.max_chunk.map_or(max_msg, |c| c.clamp(1, max_msg));
        let addr_format = i.addr_format;

        let layer = layer.map(|l| l.sized(depth));
        // What the provider's source does beyond its fi_info (`profile.rs`), then, under the
        // test layer, what the profile it imitates grants instead of the real provider.
        let mut attrs = choice.attrs.clone();
        let mut notes = if planted().no_amend {
            Vec::new()
        } else {
            attrs.amend()
        };
        if let Some(l) = &layer {
            attrs = l.profile.restrict(attrs);
        }
        let (ops, raw) = Ops::open(
            info,
            depth,
            max_chunk,
            (provider.clone(), domain_name.clone()),
            (
                Self::plan_for(&attrs, &provider, &domain_name)?,
                attrs.delivery_complete && cfg.delivery_complete,
                cfg.cq_signals,
            ),
        )?;
        let mut ep = NetEndpoint {
            regions: Regions::new(policy, hmem_choice(cfg.hmem, choice.hmem, &provider)),
            ops,
            peers: Peers::new(AddrBlob {
                provider: provider.clone(),
                addr_format,
                raw: raw.clone(),
                scratch: MrBlob::direct(policy.virt_addr, 0, 8, 0),
            }),
            staging: Staging::new(device, cfg),
            shm_transport: shm,
            nics: choice.nics,
        };
        ep.ops.layer = layer.map(Box::new);
        if provider_keys {
            ep.regions.endpoint_keys = Some(1);
        }
        ep.regions
            .register_fixed(&mut ep.ops, &mut ep.peers.me.scratch)?;

        crate::info!(
            "net: opened {} domain {domain_name} fabric {fabric_name}{} mr_mode {}{} delivery-complete {} hmem {}{} depth {depth} max_msg {max_msg} chunk {max_chunk}{}",
            provider,
            cfg.addr.as_ref().map_or(String::new(), |a| format!(" addr {a}")),
            select::mr_mode_names(mr_mode),
            if policy.forced { " (FI_MR_ENDPOINT forced for testing)" } else { "" },
            choice.attrs.delivery_complete,
            choice.hmem,
            if ep.staging.force_staging { " (staging forced for testing)" } else { "" },
            if ep.ops.napping { "; waits that last nap (crowded host)" } else { "" },
        );
        if let Some(l) = &ep.ops.layer {
            notes.push(format!(
                "unordered test layer {} (seed {}, MSCCLPP_TEST_UNORDERED) over the real provider: planned for what it plays",
                l.profile.describe(),
                l.seed
            ));
        }
        ep.settle(attrs, cfg, &raw, notes)?;
        if !ep.ops.delivery_complete && !WEAK_FLUSH_LOGGED.swap(true, AtOrd::Relaxed) {
            // True by construction: `order::decide` refuses a plan that would drain without
            // delivery completion, and `Ops::post` fails such a plan's writes if the provider
            // refuses it per write.
            crate::info!(
                "net: {}: a flush waits for local completion only, which on some providers precedes arrival at the peer; flags are still ordered after their data (see the ordering line)",
                if !cfg.delivery_complete {
                    "FI_DELIVERY_COMPLETE off for flush markers (MSCCLPP_NET_DELIVERY_COMPLETE=0; writes whose ordering needs it keep it)".to_string()
                } else {
                    format!("provider {provider} does not accept FI_DELIVERY_COMPLETE")
                }
            );
        }
        Ok(ep)
    }

    /// The plan for `attrs`, or the endpoint's refusal naming why.
    fn plan_for(attrs: &order::Attrs, provider: &str, domain: &str) -> Result<order::Plan> {
        order::decide(attrs).map_err(|why| {
            Error::usage(format!(
                "net:{provider}/{domain}: {why}; choose another provider (MSCCLPP_NET_PROVIDER)"
            ))
        })
    }

    /// Plans the endpoint for `attrs`, trying on itself what the plan relies on (`probe.rs`):
    /// a refusal takes that primitive out and plans again, with one WARN line. Then sets the
    /// plan, the way signals travel and what flush means, and writes the endpoint's one INFO
    /// line on its plan: what it is, why (`notes`: the provider's source rules applied, the
    /// test layer), and what was tried.
    fn settle(
        &mut self,
        mut attrs: order::Attrs,
        cfg: &NetConfig,
        raw: &[u8],
        mut notes: Vec<String>,
    ) -> Result<()> {
        let (provider, domain) = (self.ops.provider.clone(), self.ops.domain.clone());
        let sc = self.peers.me.scratch;
        let mut tries = match planted().no_probe {
            true => probe::Tries::none("a planted bug: the plan trusted untried"),
            false => probe::Tries::new(&self.ops, raw, (sc.base, sc.key)),
        };
        // Ends when every primitive the plan relies on was accepted (or cannot be tried): each
        // refusal removes one of at most three from `attrs`, so at most four rounds.
        let (plan, way) = loop {
            let plan = Self::plan_for(&attrs, &provider, &domain)?;
            let way = signals_choice(cfg, &attrs, &plan);
            let mut relies = Vec::new();
            if let Ok(w) = &way {
                let bytes = match w {
                    order::SignalWay::Ride => signals::CQ_DATA_BYTES,
                    order::SignalWay::Counted => counted::CQ_DATA_BYTES,
                };
                relies.push(probe::Primitive::CqData(probe::probe_data(bytes)));
            }
            if plan.beyond == order::FlagOrder::Fence {
                relies.push(probe::Primitive::Fence);
            }
            if attrs.delivery_complete {
                relies.push(probe::Primitive::DeliveryComplete);
            }
            let refusal = relies
                .into_iter()
                .find_map(|p| match tries.answer(&mut self.ops, p) {
                    None | Some(probe::Answer::Done) => None,
                    Some(probe::Answer::Refused(why)) => Some((p, why)),
                    Some(probe::Answer::Silent) => {
                        Some((p, "no completion within the bound".to_string()))
                    }
                });
            let Some((p, why)) = refusal else {
                break (plan, way);
            };
            let then = match p {
                probe::Primitive::CqData(_) => {
                    attrs.write_cq_data = false;
                    "signals are writes of their own"
                }
                probe::Primitive::Fence => {
                    attrs.fence = false;
                    "a flag after a larger write waits for the writes before it instead"
                }
                _ => {
                    attrs.delivery_complete = false;
                    "nothing that needs delivery completion is planned"
                }
            };
            crate::warn!(
                "net: {}: the provider refused {} to the endpoint itself ({why}): {then}",
                self.describe(),
                p.describe()
            );
            notes.push(format!("{} refused when tried", p.describe()));
        };
        match (&tries.untried, tries.accepted()) {
            (Some(why), _) if !planted().no_probe => {
                crate::warn!("net: {}: the plan stands untried: {why}", self.describe())
            }
            (_, Some(ok)) => notes.push(ok),
            _ => {}
        }
        let (way, way_text) = match way {
            Ok(order::SignalWay::Counted) => (
                Some(order::SignalWay::Counted),
                "signals counted by the receiver: every write carries a 4-byte tag in its remote CQ data, a put's signal into host memory is its last write's tag, and the receiver stores it once every write before it has arrived".to_string(),
            ),
            Ok(order::SignalWay::Ride) => (
                Some(order::SignalWay::Ride),
                "signals ride: a put's signal into host memory rides as remote CQ data on the put's last write where that write and every one before it are ordered, and the receiver stores it once the write is in place".to_string(),
            ),
            Err(why) => (None, format!("signals are flags of their own: {why}")),
        };
        let ops = &mut self.ops;
        ops.plan = plan;
        ops.delivery_complete = attrs.delivery_complete && cfg.delivery_complete;
        ops.cq_signals = way.is_some();
        ops.counted = way == Some(order::SignalWay::Counted);
        // Writes carry the activity mark where the target must progress for them to move
        // (with counted signals every write carries a tag, which tells the same).
        ops.activity_marks =
            ops.cq_signals && !ops.counted && TARGET_PROGRESSES.contains(&core_provider(&provider));
        if let (Some(seg), true) = (attrs.split_with_data, ops.cq_signals) {
            if !planted().no_split_cap {
                // A write the provider would cut would repeat its CQ data per piece: writes
                // are cut below, at half the segment, since the device's own limit (efa's
                // max_rdma_size), which can make the segment smaller, cannot be read.
                ops.max_chunk = ops.max_chunk.min((seg / 2).max(8));
                notes.push(format!("writes cut at {} bytes", ops.max_chunk));
            }
        }
        crate::info!(
            "net: {} plan: {}; {way_text}{}{}",
            self.describe(),
            self.ops.plan.describe(),
            if notes.is_empty() { "" } else { "; " },
            notes.join("; ")
        );
        Ok(())
    }

    /// Counters (for tests).
    pub fn stats(&self) -> Stats {
        Stats {
            signals_stored: self.ops.incoming.stored,
            ..self.ops.stats
        }
    }

    /// The provider name, e.g. `tcp;ofi_rxm`.
    pub fn provider(&self) -> &str {
        &self.ops.provider
    }

    /// Runs `f` (a registration) with what it needs of staging (`regions::Stage`).
    pub(super) fn with_stage<T>(
        &mut self,
        f: impl FnOnce(&mut Regions, &mut Ops, regions::Stage<'_>) -> T,
    ) -> T {
        let who = self.ops.describe();
        let st = &mut self.staging;
        let (device, force, force_source) = (st.device, st.force_staging, st.force_staged_source);
        let mut copier = || st.prepare_copier(&who);
        let stage = regions::Stage {
            device,
            force,
            force_source,
            copier: &mut copier,
        };
        f(&mut self.regions, &mut self.ops, stage)
    }

    /// The staging state, and the rest for it to work with.
    pub(super) fn parts(&mut self) -> (&mut Staging, Net<'_>) {
        let net = Net {
            regions: &mut self.regions,
            ops: &mut self.ops,
            peers: &mut self.peers,
        };
        (&mut self.staging, net)
    }

    pub(super) fn remote(&self, peer: PeerId, dst: RemoteId) -> Result<MrBlob> {
        self.regions.remote(&self.ops, &self.peers, peer, dst)
    }

    /// Whether local region `mr` is registered with libfabric (host memory, FI_HMEM), so that
    /// other rails can register it too; false for staged memory.
    pub(super) fn is_direct(&self, mr: MrId) -> bool {
        self.regions
            .get(mr)
            .is_some_and(|l| l.backing != regions::Backing::Staged)
    }

    /// The checks `write` makes before anything moves (peer, both ranges), also for a write
    /// that `rails.rs` then splits over several endpoints; returns the destination's blob.
    pub(super) fn check_write(
        &self,
        peer: PeerId,
        src: MrId,
        src_off: u64,
        dst: RemoteId,
        dst_off: u64,
        size: u64,
    ) -> Result<MrBlob> {
        self.check_peer(peer)?;
        let remote = self.remote(peer, dst)?;
        self.regions
            .check_write(&self.peers, peer, src, src_off, &remote, dst_off, size)?;
        Ok(remote)
    }

    /// The first half of a flush of the direct writes to `peer` (`rails.rs` waits on several
    /// endpoints at once): posts the deferred flags that are ready, then, once none waits, the
    /// delivery marker where one is needed. Returns whether the flush must begin again once
    /// the writes in flight have completed (flags still waited, and the marker must follow
    /// them).
    pub(super) fn begin_flush(&mut self, peer: PeerId) -> Result<bool> {
        self.check_peer(peer)?;
        self.rewrite_rode(peer)?;
        self.peers.post_ready(&mut self.ops, peer)?;
        if !self.peers[peer].deferred.is_empty() {
            return Ok(true);
        }
        self.peers.post_marker(&mut self.ops, peer)?;
        Ok(false)
    }

    /// How writers reach an imported region (None: not `peer`'s region). A rail other than 0
    /// carries data only into one that is not staged; a value waits for earlier staging
    /// records only into a direct one (`write_value`).
    pub(super) fn remote_mode(&self, peer: PeerId, remote: RemoteId) -> Option<Mode> {
        self.remote(peer, remote).ok().map(|b| b.mode)
    }

    /// Whether `n` more writes can be posted without waiting for an op slot (at most all of
    /// them: a write larger than the provider's largest message takes several).
    pub(super) fn has_room(&self, n: usize) -> bool {
        let (free, depth) = self.ops.free_slots();
        free >= n.clamp(1, depth)
    }

    /// The op slots one direct write of `size` bytes takes (`max_chunk` each).
    pub(super) fn slots_for(&self, size: u64) -> usize {
        usize::try_from(size.div_ceil(self.ops.max_chunk.max(1))).unwrap_or(usize::MAX)
    }

    /// Whether staging records sent to `peer` are still unacknowledged (`flush` waits for
    /// them).
    pub(super) fn records_unacked(&self, peer: PeerId) -> bool {
        self.peers.get(peer).is_some() && self.staging.records_pending(&self.peers, peer).is_some()
    }

    /// Writes to `peer` whose completion has not been read yet, and flags waiting to be
    /// posted to it.
    pub(super) fn outstanding_to(&self, peer: PeerId) -> usize {
        self.peers
            .get(peer)
            .map_or(0, |p| p.outstanding + p.deferred.len())
    }

    /// Reads the completion queue once (`Ops::poll`).
    pub(super) fn poll_once(&mut self) -> Result<usize> {
        let n = self.ops.poll(&mut self.peers)?;
        self.peers.post_ready_all(&mut self.ops)?;
        Ok(n)
    }

    /// One pause of a bounded wait on this endpoint's provider (`Ops::pause`).
    pub(super) fn pause(
        &mut self,
        wait: &mut crate::sync::Backoff,
        what: impl FnOnce() -> String,
    ) -> Result<()> {
        self.ops.pause(wait, what)
    }

    /// Writes again, as a lone value, the latest value of each word that values rode into since
    /// the last flush of `peer`, where that latest one rode: what the flush then waits for
    /// covers it (a riding value is stored by the peer's endpoint when it reads the write's
    /// completion, maybe after our flush would return; the copy lands first and the late store
    /// changes nothing, `signals.rs`). At most one 8-byte write per word per flush.
    pub(super) fn rewrite_rode(&mut self, peer: PeerId) -> Result<()> {
        for (dst, off, value) in self.ops.outgoing.rode_to(peer) {
            self.ops
                .outgoing
                .take(peer, (dst, off), value, false)
                .map_err(Error::invalid_arg)?;
            let remote = self.remote(peer, dst)?;
            self.post_value(peer, &remote, off, value)?;
        }
        Ok(())
    }

    /// Before a signal counted by the receiver (`counted.rs`): waits until the staging records
    /// sent to `peer` are acknowledged and the flags queued for it are posted, so that the
    /// signal, applied once the writes before it have arrived, never overtakes them.
    pub(super) fn counted_after_queued(&mut self, peer: PeerId) -> Result<()> {
        let (st, mut net) = self.parts();
        if let Some((ci, sent)) = st.records_pending(net.peers, peer) {
            st.wait_acked(&mut net, ci, sent)?;
        }
        self.peers.post_deferred(&mut self.ops, peer, |n, rank| {
            format!(
                "waiting for {n} queued flags to rank {rank} to be posted before a counted signal"
            )
        })
    }

    /// Posts a checked write of `size` bytes from `src` to `dst` (the imported region's blob and
    /// the offset), its last chunk carrying `cq_data` if given (only into a direct region).
    pub(super) fn post_write(
        &mut self,
        peer: PeerId,
        src: (MrId, u64),
        (remote, dst_off): (MrBlob, u64),
        size: u64,
        cq_data: Option<u64>,
    ) -> Result<()> {
        let dest = if remote.mode == Mode::Staged {
            staging::Dest::Staged { remote, dst_off }
        } else {
            staging::Dest::Direct {
                base: remote.base + dst_off,
                key: remote.key,
            }
        };
        let (st, mut net) = self.parts();
        st.write_chunks(&mut net, peer, src, size, dest, cq_data)
    }

    /// The remote CQ data carrying `value` into word `off` of `remote` (imported region `dst`),
    /// where values into it ride so (the owner said so in its blob, and this endpoint sends
    /// them), or None: a write of the value itself. An error for a value the owner could not
    /// rebuild (`signals::Outgoing`). On a counting endpoint, the `counted::ask` for the
    /// write that carries it, recorded as sent (`Outgoing::take_counted`).
    pub(super) fn cq_value(
        &mut self,
        peer: PeerId,
        dst: RemoteId,
        remote: &MrBlob,
        off: u64,
        value: u64,
    ) -> Result<Option<u64>> {
        if !self.ops.cq_signals || !remote.cq_values {
            return Ok(None);
        }
        if self.ops.counted {
            // On a counting endpoint a value rides only as a counted tag (8 bytes of CQ data
            // do not fit): to a peer that gave us no stream, it is a flag of its own.
            let Some(w) = counted::word(remote.id, off).filter(|_| self.counts_to(peer)) else {
                return Ok(None);
            };
            let counts = self.ops.outgoing.take_counted(peer, (dst, off), value);
            return Ok(counts.then(|| counted::ask(w)));
        }
        let Some(d) = signals::encode(remote.id, off, value) else {
            return Ok(None);
        };
        self.ops
            .outgoing
            .take(peer, (dst, off), value, true)
            .map_err(Error::invalid_arg)?;
        Ok(Some(d))
    }

    /// Posts `value` into word `dst_off` of `remote` as a write of its own (a record into
    /// staged memory), ordered after the writes before it by the plan (`write_value`).
    pub(super) fn post_value(
        &mut self,
        peer: PeerId,
        remote: &MrBlob,
        dst_off: u64,
        value: u64,
    ) -> Result<()> {
        let (raddr, key) = (remote.base + dst_off, remote.key);
        let (st, mut net) = self.parts();
        if remote.mode != Mode::Direct {
            // Into device memory: the owner's proxy stores it after the data (module doc).
            return st
                .post_record(
                    &mut net,
                    peer,
                    staging::Record {
                        seq: 0,
                        kind: staging::Kind::Value,
                        region: remote.id,
                        off: dst_off,
                        arg: value,
                        ring_pos: 0,
                    },
                )
                .map(|_| ());
        }
        if let Some((ci, sent)) = st.records_pending(net.peers, peer) {
            // A direct flag must not overtake staged data still being applied by the peer.
            st.wait_acked(&mut net, ci, sent)?;
        }
        net.peers.post_ready(net.ops, peer)?;
        let d = peers::Deferred {
            after: 0,
            value,
            raddr,
            key,
        };
        if net.peers.defer_flag(net.ops, peer, d) {
            // Posted by `post_ready` (progress, the next write, a flush) once the writes before
            // it have completed, without holding up this proxy's other work.
            return Ok(());
        }
        let fence = net.order_before_flag(peer)?;
        // Flags are plain writes, like data (no `confirm`): FI_DELIVERY_COMPLETE on
        // tcp;ofi_rxm turned the 8-byte signal half round trip from 3.7 us into a bimodal
        // 7..230 us (acks wait for the target's progress), and its p99 is milliseconds even in
        // a raw ping-pong. A flush confirms delivery with one marker write instead (see module
        // doc).
        net.post(&Op {
            fence,
            ..Op::inline(peer, &value.to_ne_bytes(), raddr, key)
        })
    }

    /// Whether signals to `peer` are counted by it (`counted.rs`): our writes to it carry
    /// tags.
    pub(super) fn counts_to(&self, peer: PeerId) -> bool {
        self.ops.tags_to(&self.peers, peer)
    }

    pub(super) fn check_peer(&self, peer: PeerId) -> Result<()> {
        if peer >= self.peers.len() {
            return Err(Error::invalid_arg(format!(
                "unknown peer {peer} on {}",
                self.describe()
            )));
        }
        Ok(())
    }
}

impl Endpoint for NetEndpoint {
    fn describe(&self) -> String {
        self.ops.describe()
    }

    /// Every net endpoint lingers at teardown (peers' delivery markers need our progress).
    /// Endpoints of the shm provider may be wedged by a peer that dies, also under the IB
    /// transport (`provider_may_wedge`); SHM endpoints over host memory take signals straight
    /// into their epoch blocks.
    fn caps(&self) -> Caps {
        Caps {
            may_wedge: provider_may_wedge(&self.peers.me.provider),
            linger: true,
            direct_epoch: self.shm_transport,
        }
    }

    /// SHM over host memory: the epoch block in POSIX shared memory, which the peer maps and
    /// stores signals into without a libfabric call (`direct_flag`, proxy/conn.rs), and writes
    /// small puts into (`transport::inbox`) unless inline puts are off.
    fn epoch_block(&mut self, kind: MemKind) -> Result<EpochMem> {
        if self.direct_epoch_for(kind) {
            epoch::shared(crate::config::get().shm_inline_bytes > 0)
        } else {
            epoch::plain(kind)
        }
    }

    fn direct_epoch_for(&self, kind: MemKind) -> bool {
        self.shm_transport && kind == MemKind::Host
    }

    fn address(&self) -> Result<Vec<u8>> {
        Ok(self.peers.me.encode())
    }

    fn add_peer(&mut self, remote_rank: usize, address: &[u8]) -> Result<PeerId> {
        // A peer striped over several rails: this endpoint talks to its rail 0.
        let address = blob::first_rail(address)
            .map_err(|e| Error::remote(format!("rank {remote_rank}: {e}")))?;
        let policy = self.regions.policy;
        let who = self.ops.describe();
        let (p, new) = self
            .peers
            .add(&self.ops.objs, &who, &policy, remote_rank, address)?;
        if new {
            crate::trace!("net: {} added rank {remote_rank}", self.describe());
        }
        Ok(p)
    }

    /// The staging channel this endpoint keeps for `peer`, and on a counting endpoint the
    /// stream its writes name (`blob::LinkBlob`).
    fn link_for(&mut self, peer: PeerId) -> Result<Vec<u8>> {
        self.check_peer(peer)?;
        let (st, mut net) = self.parts();
        let chan = st.chan_for(&mut net, peer)?;
        let stream = self
            .ops
            .counted
            .then(|| self.peers.stream_for(peer))
            .flatten();
        Ok(blob::LinkBlob {
            chan: Some(chan),
            stream,
        }
        .encode())
    }

    fn link_to(&mut self, peer: PeerId, link: &[u8]) -> Result<()> {
        self.check_peer(peer)?;
        let policy = self.regions.policy;
        let l = blob::LinkBlob::decode(link, policy.virt_addr, policy.key_size)
            .map_err(|e| e.within(&self.peers.name(peer)))?;
        self.peers.link_to(peer, l.chan, l.stream)
    }

    fn register(&mut self, region: Region) -> Result<(MrId, Vec<u8>)> {
        self.with_stage(|regions, ops, stage| regions.register(ops, stage, region))
    }

    fn register_source(&mut self, region: Region) -> Result<MrId> {
        self.with_stage(|regions, ops, stage| regions.register_source(ops, stage, region))
    }

    fn release_source(&mut self, src: MrId) -> Result<()> {
        self.regions.release_source(&mut self.ops, src)
    }

    fn deregister(&mut self, mr: MrId) -> Result<()> {
        self.regions.deregister(&mut self.ops, mr)
    }

    fn import(&mut self, peer: PeerId, blob: &[u8]) -> Result<RemoteId> {
        self.check_peer(peer)?;
        self.regions
            .import(&self.peers, peer, blob::first_rail(blob)?)
    }

    fn forget(&mut self, remote: RemoteId) -> Result<()> {
        self.regions.forget(&self.ops, remote)?;
        self.ops.outgoing.forget(remote);
        Ok(())
    }

    fn remote_len(&self, remote: RemoteId) -> Option<u64> {
        self.regions.remote_len(remote)
    }

    fn write(
        &mut self,
        peer: PeerId,
        src: MrId,
        src_off: u64,
        dst: RemoteId,
        dst_off: u64,
        size: u64,
    ) -> Result<()> {
        let remote = self.check_write(peer, src, src_off, dst, dst_off, size)?;
        // Flags whose writes before them have completed go out before more data.
        self.peers.post_ready(&mut self.ops, peer)?;
        self.post_write(peer, (src, src_off), (remote, dst_off), size, None)
    }

    /// One write whose last chunk carries the value as remote CQ data (`signals.rs`) where it
    /// can: the value goes into host memory of a peer that stores such values, the data into a
    /// direct region, nothing of the peer's waits (queued flags, unacknowledged staging
    /// records), and the plan places every earlier write to the peer, and every chunk of this
    /// one, before the last chunk (its completion at the peer, which carries the value, then
    /// means all of them are in place). Otherwise the write, then `write_value`.
    fn write_then_value(
        &mut self,
        peer: PeerId,
        src: MrId,
        src_off: u64,
        dst: RemoteId,
        dst_off: u64,
        size: u64,
        (vdst, voff, value): (RemoteId, u64, u64),
    ) -> Result<()> {
        let remote = self.check_write(peer, src, src_off, dst, dst_off, size)?;
        // Flags whose writes before them have completed go out before more data.
        self.peers.post_ready(&mut self.ops, peer)?;
        let v = self.remote(peer, vdst)?;
        regions::check_value(&self.peers, peer, &v, voff)?;
        // The writes this put goes as (`staging::write_chunks`): chunks of the provider's
        // largest write, or of a bounce slot for a staged source, the last carrying the
        // signal. Riding needs every earlier write to the peer and every chunk of this put,
        // the riding one too, within the ordered size ("both smaller than the size").
        let chunk = {
            let (st, mut net) = self.parts();
            st.source_chunk(&mut net, src, u64::MAX)?
        };
        let before = match planted().ride_ignores_source_chunks {
            true if size > self.ops.max_chunk => self.ops.max_chunk,
            true => 0,
            false if size > chunk => chunk,
            false => 0,
        };
        let riding = match (planted().ride_ignores_own_size, size) {
            (true, _) | (_, 0) => 0,
            (false, n) => (n - 1) % chunk + 1,
        };
        let chunks = before.max(riding);
        let counted = self.counts_to(peer) && size > 0 && remote.mode == Mode::Direct;
        if counted && v.cq_values {
            self.counted_after_queued(peer)?;
        }
        let rides = counted
            || (size > 0
                && remote.mode == Mode::Direct
                && self.peers[peer].deferred.is_empty()
                && !self.records_unacked(peer)
                && self
                    .ops
                    .plan
                    .after(self.peers[peer].largest_since_drain.max(chunks))
                    == order::FlagOrder::Plain);
        let cq = match rides {
            true => self.cq_value(peer, vdst, &v, voff, value)?,
            false => None,
        };
        self.post_write(peer, (src, src_off), (remote, dst_off), size, cq)?;
        if cq.is_none() {
            return self.write_value(peer, vdst, voff, value);
        }
        self.ops.stats.signals_with_data += 1;
        Ok(())
    }

    fn write_value(&mut self, peer: PeerId, dst: RemoteId, dst_off: u64, value: u64) -> Result<()> {
        self.check_peer(peer)?;
        let remote = self.remote(peer, dst)?;
        regions::check_value(&self.peers, peer, &remote, dst_off)?;
        // (On a counting endpoint `cq_value` is the counted tag's request, or None where the
        // value goes as a write of its own.)
        let counted = match self.ops.counted {
            true => self.cq_value(peer, dst, &remote, dst_off, value)?,
            false => None,
        };
        if let Some(ask) = counted {
            // Where the receiver counts signals, a lone one is the tag of an 8-byte write
            // (`counted.rs`): into the peer's scratch word while earlier writes to it may
            // still be on their way, else into the word itself, where a waiter sees it
            // without the peer's proxy (every earlier write was delivered: all carry
            // FI_DELIVERY_COMPLETE here), which then counts it and stores the same value.
            self.counted_after_queued(peer)?;
            let (raddr, key) = match self.peers[peer].outstanding {
                0 => (remote.base + dst_off, remote.key),
                _ => {
                    let sc = self.peers.scratch(peer);
                    (sc.base, sc.key)
                }
            };
            return self.ops.post(
                &mut self.peers,
                &Op {
                    cq_data: Some(ask),
                    ..Op::inline(peer, &value.to_ne_bytes(), raddr, key)
                },
            );
        }
        // A lone value is a write of its own, also into a word that riding values go to (a
        // CQ-data value alone measured slower over tcp, bench/RESULTS.md session 16): both are
        // ordered after the writes before them, and the owner's stores of riding values never
        // step a count back (`signals.rs`), so the two ways mix. Recorded for the sender's
        // check of later riding values.
        if self.ops.cq_signals && remote.cq_values {
            self.ops
                .outgoing
                .take(peer, (dst, dst_off), value, false)
                .map_err(Error::invalid_arg)?;
        }
        self.post_value(peer, &remote, dst_off, value)
    }

    /// Returns when every earlier write to `peer` has arrived: for staged regions, once the
    /// peer has copied it into its destination memory (it acknowledges only then).
    fn flush(&mut self, peer: PeerId) -> Result<()> {
        self.check_peer(peer)?;
        self.rewrite_rode(peer)?;
        let (st, mut net) = self.parts();
        if let Some(ci) = net.peers[peer].chan {
            let sent = st.chans[ci].out.sent;
            st.wait_acked(&mut net, ci, sent)?;
            if net.peers[peer].last_was_record {
                // Acknowledged, and ordered after every earlier write: all have arrived.
                net.peers[peer].unconfirmed = false;
            }
        }
        net.peers.drain_writes(net.ops, peer)
    }

    fn set_abort_check(&mut self, check: AbortCheck) {
        self.ops.abort_check = Some(check);
    }

    fn progress(&mut self) -> Result<()> {
        self.ops.progress(&mut self.peers)?;
        self.peers.post_ready_all(&mut self.ops)
    }

    fn poll_incoming(&mut self) -> Result<()> {
        let (st, mut net) = self.parts();
        st.poll_incoming(&mut net)
    }

    fn took_incoming(&mut self) -> bool {
        let seen = self.ops.incoming.arrived();
        std::mem::replace(&mut self.ops.incoming_told, seen) != seen
    }
}

impl Drop for NetEndpoint {
    fn drop(&mut self) {
        // In-flight writes still read our registered memory: let them finish (bounded), then
        // close every MR (endpoint-bound ones must go before the endpoint), then the endpoint;
        // `objs` closes the CQ, AV, domain and fabric as it drops, and only then is the staging
        // ring freed (fields drop after this body).
        self.staging.drain_copier();
        self.ops.drain_at_close(&mut self.peers);
        let s = &self.stats();
        if s.staged_chunks + s.records_applied > 0 {
            crate::info!(
                "net: {} staging: sent {} chunks ({} MiB), waited for ring room {}, for bounce slots {}, for copies out {}; applied {} records",
                self.describe(),
                s.staged_chunks,
                s.staged_bytes >> 20,
                s.ring_waits,
                s.bounce_waits,
                s.copy_out_waits,
                s.records_applied
            );
        }
        if s.order_drains + s.order_fences + s.deferred_flags > 0 {
            crate::info!(
                "net: {} ordering: {} flags, records or markers waited for the peer's writes to complete, {} were fenced, {} flags were queued behind their writes ({} of them left out for a newer count into the same word)",
                self.describe(),
                s.order_drains,
                s.order_fences,
                s.deferred_flags,
                s.coalesced_flags
            );
        }
        if s.signals_with_data + s.signals_stored > 0 {
            crate::info!(
                "net: {} signals as remote CQ data{}: sent {} on their puts; stored {} from peers ({} overtaken by a later one)",
                self.describe(),
                if self.ops.counted {
                    format!(" (counted by the receiver: {} tagged writes read)", self.ops.incoming.counted)
                } else {
                    String::new()
                },
                s.signals_with_data,
                s.signals_stored,
                self.ops.incoming.stale
            );
        }
        if let Some(l) = &self.ops.layer {
            crate::info!("net: {}: {}", self.describe(), l.summary());
        }
        if s.naps.n > 0 {
            crate::info!(
                "net: {}: waits for the provider napped {}",
                self.describe(),
                s.naps
            );
        }
        let mut mrs = std::mem::replace(&mut self.regions.mrs, mr::Table::new());
        if let Err(e) = mr::teardown(&mut self.ops.mr_ops(), &mut mrs) {
            crate::warn!("net: teardown of {}: {e}", self.describe());
        }
    }
}
