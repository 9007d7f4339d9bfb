//! How a write that must land after the earlier writes to its peer (a flag, a staging record, a
//! delivery marker) is ordered after them. Decided once per endpoint from what the provider
//! granted ([`decide`]), then per write from the size of the largest write to that peer since
//! it was last drained ([`Plan::after`]). Pure: no libfabric call, so that unit tests can feed
//! it fi_info-shaped fixtures of providers this machine does not have (docs/DESIGN.md, 3.6).
//!
//! What libfabric promises (fi_endpoint(3), "Max RMA Ordered Size"): `tx_attr.msg_order` with
//! FI_ORDER_RMA_WAW orders how writes are *processed*; whether an earlier write's *data* is
//! placed before a later write's is a separate promise, bounded by `ep_attr.max_order_waw_size`
//! ("both smaller than the size"; 0: none, -1: any). The spec states data ordering per memory
//! location; a flag lands on another location than its data, so what this module relies on is
//! the providers' in-order placement within that bound, which each provider class's entry in
//! DESIGN.md 3.6 names. Where the bound does not cover the earlier write, the follower carries
//! FI_FENCE, or the earlier write carries FI_DELIVERY_COMPLETE and the follower waits for its
//! completion ("drain"). With neither, nothing orders a flag after its data and the endpoint
//! is refused: a drain to *local* completion is not one (tcp;ofi_rxm completes a write locally
//! before it arrives).
//!
//! What this module knows of one provider beyond its attributes, read in its source (libfabric
//! 1.17.0 through 2.1.0, prov/shm/src):
//! - `shm` advertises WAW for any size. With cross-memory attach, the receiver copies each write
//!   while it processes the write's command, commands in the order they were posted. Without it
//!   (containers without ptrace rights, `FI_SHM_DISABLE_CMA=1`), a write above the inject size
//!   goes by its SAR protocol, and the receiver moves on to the next command while that write's
//!   data still comes; but the sender then posts nothing more to that peer (every post path
//!   answers -FI_EAGAIN while the peer's `sar_status` is set, which only the transfer's end
//!   clears), so a later write still lands after it. Its fast path, which copies at the sender
//!   and could overtake a queued write, is off whenever ordering is asked for
//!   (`smr_fast_rma_enabled`). So it is trusted for every size, as advertised; its FI_HMEM entry
//!   (inject size 0) for none, since its IPC copies of device memory may end after a later
//!   command (ROCR's are asynchronous in 2.x). Proved on the provider by `endpoint_conformance`
//!   `shm_sar::value_rides_with_data`: a large write by SAR, then a small one carrying the value.

use super::fabric::{core_provider, InfoView};
use libfabric_sys as fi;

/// The largest write that is ordered after earlier ones (a staging record; flags and markers
/// are 8 bytes): "both smaller than the size" makes a bound below it order nothing.
pub(super) const FOLLOWER_BYTES: u64 = 64;

/// The `msg_order` bits that mean "RMA writes are processed in order" (libfabric 1.x spells
/// it both ways).
const WAW_BITS: u64 = fi::FI_ORDER_RMA_WAW | fi::FI_ORDER_WAW as u64;

/// The caps an endpoint that posts receives asks for.
pub(super) const RECV_CAPS: u64 = fi::FI_MSG as u64 | fi::FI_RECV as u64;

/// What the provider granted that bears on ordering, read from the chosen fi_info
/// ([`Attrs::from_info`]) or written by a test.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Attrs {
    /// `fabric_attr.prov_name`, e.g. `tcp;ofi_rxm` (for the quirks in the module doc).
    pub provider: String,
    /// `tx_attr.msg_order`, only the bits that were asked for: a provider may take an unordered
    /// fast path when ordering was not requested, whatever it lists (shm does).
    pub msg_order: u64,
    /// `ep_attr.max_order_waw_size` (`u64::MAX`: any size).
    pub max_order_waw_size: u64,
    /// FI_FENCE requested and in `caps`.
    pub fence: bool,
    /// FI_DELIVERY_COMPLETE requested and in `tx_attr.op_flags`.
    pub delivery_complete: bool,
    /// `domain_attr.cq_data_size`: bytes of remote CQ data a write may carry.
    pub cq_data_size: u64,
    /// `tx_attr.inject_size`.
    pub inject_size: u64,
    /// FI_RX_CQ_DATA in `mode` or `rx_attr.mode`: remote CQ data consumes a posted receive.
    pub rx_cq_data: bool,
    /// FI_MR_LOCAL in `domain_attr.mr_mode`: every local buffer needs its descriptor.
    pub mr_local: bool,
    /// The endpoint can post receives (FI_MSG and FI_RECV requested and in `caps`), which
    /// remote CQ data consumes where `rx_cq_data`.
    pub recv: bool,
    /// FI_HMEM in `caps`: the provider's entry for device memory.
    pub hmem: bool,
}

/// What a query asked the provider for (only those of its grants count).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Asked {
    pub order: bool,
    pub fence: bool,
    pub dc: bool,
    /// FI_MSG | FI_RECV (for signals counted by the receiver, `counted.rs`).
    pub recv: bool,
}

impl Attrs {
    /// The attributes of `info`, as granted to a query that asked for `asked`.
    pub fn from_info(info: &fi::fi_info, asked: Asked) -> Attrs {
        let v = InfoView(info);
        let (tx, ep, dom, rx) = (v.tx(), v.ep(), v.domain(), v.rx());
        let msg_order = if asked.order {
            tx.map_or(0, |t| t.msg_order)
        } else {
            0
        };
        let op_flags = tx.map_or(0, |t| t.op_flags);
        Attrs {
            provider: v.prov_name(),
            msg_order,
            max_order_waw_size: ep.map_or(0, |e| e.max_order_waw_size as u64),
            fence: asked.fence && info.caps & fi::FI_FENCE as u64 != 0,
            delivery_complete: asked.dc && op_flags & fi::FI_DELIVERY_COMPLETE as u64 != 0,
            cq_data_size: dom.map_or(0, |d| d.cq_data_size as u64),
            inject_size: tx.map_or(0, |t| t.inject_size as u64),
            rx_cq_data: (info.mode | rx.map_or(0, |r| r.mode)) & fi::FI_RX_CQ_DATA != 0,
            mr_local: dom.is_some_and(|d| d.mr_mode as u32 & fi::FI_MR_LOCAL != 0),
            recv: asked.recv && info.caps & RECV_CAPS == RECV_CAPS,
            hmem: info.caps & fi::FI_HMEM != 0,
        }
    }
}

/// How one write is ordered after the earlier writes to its peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum FlagOrder {
    /// The provider places it after their data: posted as it is.
    Plain,
    /// Posted with FI_FENCE: the provider starts it once they have completed.
    Fence,
    /// Posted once every earlier write to the peer has completed (a flag is queued for that,
    /// `Peers::defer_flag`; a record or marker waits); the writes this waits for carried
    /// FI_DELIVERY_COMPLETE ([`Plan::needs_dc`]), so completed means arrived.
    Drain,
}

/// The decision for one endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Plan {
    /// A write of at most this many bytes is placed before any later write to the same peer
    /// (0: none is; `u64::MAX`: any is).
    pub ordered_upto: u64,
    /// How a write follows one larger than `ordered_upto`: `Fence` or `Drain` (`Plain` only
    /// when every size is ordered).
    pub beyond: FlagOrder,
    /// Why, for the endpoint's INFO line.
    pub why: String,
}

impl Plan {
    /// How a flag, record or marker follows the writes to its peer since the peer was last
    /// drained, the largest of which had `largest` bytes.
    pub fn after(&self, largest: u64) -> FlagOrder {
        if largest <= self.ordered_upto {
            FlagOrder::Plain
        } else {
            self.beyond
        }
    }

    /// Whether a write of `len` bytes must carry FI_DELIVERY_COMPLETE: a later drain waits for
    /// its completion, which must then mean arrival.
    pub fn needs_dc(&self, len: u64) -> bool {
        self.beyond == FlagOrder::Drain && len > self.ordered_upto
    }

    /// The plan used whatever the provider grants (tests of the fence and drain paths on
    /// providers that order every write).
    #[cfg(test)]
    pub fn forced(how: FlagOrder) -> Plan {
        Plan {
            ordered_upto: if how == FlagOrder::Plain { u64::MAX } else { 0 },
            beyond: how,
            why: format!("{how:?} forced for a test"),
        }
    }

    /// One line for the endpoint's INFO: the strategy, then why.
    pub fn describe(&self) -> String {
        let how = match self.beyond {
            FlagOrder::Plain => "plain",
            FlagOrder::Fence => "fenced (FI_FENCE)",
            FlagOrder::Drain => {
                "posted once the peer's writes have completed (a flag waits in a queue, not the proxy), the unordered ones carrying FI_DELIVERY_COMPLETE"
            }
        };
        let strategy = match self.ordered_upto {
            u64::MAX => "plain after writes of any size".to_string(),
            0 => format!("after every write: {how}"),
            n => format!("plain after writes of up to {n} bytes; after larger ones: {how}"),
        };
        format!("{strategy} ({})", self.why)
    }
}

fn size_text(n: u64) -> String {
    if n == u64::MAX {
        "any size".into()
    } else {
        n.to_string()
    }
}

/// The plan for a provider that granted `a`, or why no write can be ordered after another
/// on it (the endpoint is then refused).
pub(super) fn decide(a: &Attrs) -> Result<Plan, String> {
    let core = core_provider(&a.provider);
    let mut why = Vec::new();
    let mut upto = if a.msg_order & WAW_BITS == 0 {
        why.push("no FI_ORDER_RMA_WAW granted".to_string());
        0
    } else {
        // "Both smaller than the size": a bound of b orders writes of up to b - 1 bytes.
        let n = match a.max_order_waw_size {
            u64::MAX => u64::MAX,
            b => b.saturating_sub(1),
        };
        why.push(format!(
            "FI_ORDER_RMA_WAW, max_order_waw_size {}",
            size_text(a.max_order_waw_size)
        ));
        n
    };
    if core == "shm" {
        // (Its FI_HMEM entry also reports an inject size of 0: either says so.)
        if a.hmem || a.inject_size == 0 {
            upto = 0;
            why.push("shm with FI_HMEM trusted for no size (its IPC copies of device memory may end after a later command)".into());
        } else if upto == u64::MAX {
            why.push("shm: a write by its SAR protocol holds back the sender's next command to the peer until its data is in".into());
        }
    }
    if upto < FOLLOWER_BYTES {
        upto = 0;
    }
    let beyond = if upto == u64::MAX {
        FlagOrder::Plain
    } else if a.fence {
        why.push("FI_FENCE".into());
        FlagOrder::Fence
    } else if a.delivery_complete {
        why.push("no FI_FENCE, FI_DELIVERY_COMPLETE".into());
        FlagOrder::Drain
    } else {
        return Err(format!(
            "provider {} cannot order a signal after its data: {}, and it grants neither FI_FENCE nor FI_DELIVERY_COMPLETE (waiting for local completion is not arrival)",
            a.provider,
            match upto {
                0 => why.join("; "),
                n => format!("{} (writes above {n} bytes are not ordered)", why.join("; ")),
            }
        ));
    };
    if a.cq_data_size > 0 {
        why.push(format!(
            "remote CQ data {} bytes{}",
            a.cq_data_size,
            if a.rx_cq_data {
                ", each needing a posted receive"
            } else {
                ""
            }
        ));
    }
    Ok(Plan {
        ordered_upto: upto,
        beyond,
        why: why.join("; "),
    })
}

/// How a put's signal travels on an endpoint (docs/DESIGN.md 3.6), where signals are not
/// plain writes of their own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SignalWay {
    /// As 8 bytes of remote CQ data on the put's last write, stored when the receiver reads
    /// its completion, where the plan orders that write as it would a flag (`signals.rs`).
    Ride,
    /// A 4-byte tag in the remote CQ data of every write, the receiver counting them and
    /// applying a signal once every write before it was read (`counted.rs`): for providers
    /// that order no write.
    Counted,
}

/// The way signals travel on a provider that granted `a`, planned `plan`, or why neither
/// way fits (they are then writes of their own, ordered by the plan).
pub(super) fn signal_way(a: &Attrs, plan: &Plan) -> Result<SignalWay, String> {
    if a.cq_data_size >= super::signals::CQ_DATA_BYTES && !a.rx_cq_data {
        return Ok(SignalWay::Ride);
    }
    let mut no = Vec::new();
    if a.cq_data_size < super::counted::CQ_DATA_BYTES {
        no.push(format!(
            "it carries {} bytes of remote CQ data",
            a.cq_data_size
        ));
    }
    if plan.ordered_upto != 0 || plan.beyond != FlagOrder::Drain {
        no.push("it orders writes (a flag after them costs no round trip)".to_string());
    }
    if a.rx_cq_data && !a.recv {
        no.push(
            "its remote CQ data consumes posted receives, and FI_MSG/FI_RECV were not granted"
                .to_string(),
        );
    }
    if no.is_empty() {
        return Ok(SignalWay::Counted);
    }
    Err(format!(
        "riding needs {} bytes of remote CQ data without posted receives ({} bytes{}); counting by the receiver does not fit: {}",
        super::signals::CQ_DATA_BYTES,
        a.cq_data_size,
        if a.rx_cq_data { ", consuming receives" } else { "" },
        no.join("; ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::net::fabric::{strdup, InfoList};

    /// An fi_info as a provider fills it in, by field.
    struct Fixture {
        prov: &'static str,
        caps: u64,
        mode: u64,
        rx_mode: u64,
        msg_order: u64,
        op_flags: u64,
        inject_size: usize,
        max_order_waw_size: usize,
        cq_data_size: usize,
        mr_mode: u32,
    }

    const RMA: u64 = fi::FI_RMA as u64 | fi::FI_WRITE as u64 | fi::FI_REMOTE_WRITE as u64;
    const DC: u64 = fi::FI_DELIVERY_COMPLETE as u64;
    const TC: u64 = fi::FI_TRANSMIT_COMPLETE as u64;
    const FENCE: u64 = fi::FI_FENCE as u64;
    const WAW_SET: u64 = fi::FI_ORDER_WAW as u64 | fi::FI_ORDER_RMA_WAW | fi::FI_ORDER_ATOMIC_WAW;
    const SAS: u64 = fi::FI_ORDER_SAS as u64;

    impl Fixture {
        /// The fixture as an fi_info, read back the way the endpoint reads the chosen one.
        fn attrs(&self, asked: Asked) -> Attrs {
            let mut l = InfoList::alloc().unwrap();
            let i = l.head_mut();
            i.caps = self.caps;
            i.mode = self.mode;
            // SAFETY: an fi_allocinfo'd info: every attribute struct is allocated; the
            // provider name is a malloc'd string that fi_freeinfo frees.
            unsafe {
                (*i.fabric_attr).prov_name = strdup(self.prov).unwrap();
                (*i.tx_attr).msg_order = self.msg_order;
                (*i.tx_attr).op_flags = self.op_flags;
                (*i.tx_attr).inject_size = self.inject_size;
                (*i.rx_attr).mode = self.rx_mode;
                (*i.ep_attr).max_order_waw_size = self.max_order_waw_size;
                (*i.domain_attr).cq_data_size = self.cq_data_size;
                (*i.domain_attr).mr_mode = self.mr_mode as i32;
            }
            Attrs::from_info(l.first().unwrap(), asked)
        }
    }

    /// What `select::choose` asks first, and what each provider below grants to it.
    const ASK_ALL: Asked = Asked {
        order: true,
        fence: true,
        dc: true,
        recv: true,
    };

    /// prov/cxi/src/cxip_info.c: WAW of any size, FI_FENCE, delivery complete, 8 bytes of CQ
    /// data, FI_MR_ENDPOINT.
    fn cxi() -> Fixture {
        Fixture {
            prov: "cxi",
            caps: RMA | FENCE | fi::FI_HMEM,
            mode: 0,
            rx_mode: 0,
            msg_order: SAS | WAW_SET | fi::FI_ORDER_RMA_RAR,
            op_flags: TC | DC | FENCE,
            inject_size: 192,
            max_order_waw_size: usize::MAX,
            cq_data_size: 8,
            mr_mode: fi::FI_MR_ENDPOINT | fi::FI_MR_PROV_KEY | fi::FI_MR_ALLOCATED,
        }
    }

    /// prov/psm3/src/psmx3{.h,_attr.c}: WAW in msg_order, but PSMX3_RMA_ORDER_SIZE (4096) as
    /// the data bound; no fence; delivery complete; CQ data 8 bytes on the RMA info.
    fn psm3() -> Fixture {
        Fixture {
            prov: "psm3",
            caps: RMA,
            mode: fi::FI_CONTEXT,
            rx_mode: 0,
            msg_order: SAS | WAW_SET,
            op_flags: TC | DC,
            inject_size: 64,
            max_order_waw_size: 4096,
            cq_data_size: 8,
            mr_mode: 0,
        }
    }

    /// prov/efa/src/efa_prov_info.c, RDM endpoint: msg_order without any RMA bit (its
    /// max_order_waw_size is set for emulated atomics and must not count), no fence, delivery
    /// complete, 4 bytes of CQ data that consume posted receives.
    fn efa_rdm() -> Fixture {
        Fixture {
            prov: "efa",
            caps: RMA | RECV_CAPS,
            mode: 0,
            rx_mode: fi::FI_RX_CQ_DATA,
            msg_order: SAS | fi::FI_ORDER_ATOMIC_WAW,
            op_flags: TC | DC,
            inject_size: 4096,
            max_order_waw_size: 8 << 10,
            cq_data_size: 4,
            mr_mode: fi::FI_MR_ALLOCATED | fi::FI_MR_PROV_KEY | fi::FI_MR_VIRT_ADDR,
        }
    }

    /// efa-direct (libfabric 2.x): the device's own RDMA: nothing ordered, transmit complete
    /// only, FI_MR_LOCAL, CQ data that needs posted receives.
    fn efa_direct() -> Fixture {
        Fixture {
            prov: "efa",
            caps: RMA,
            mode: 0,
            rx_mode: fi::FI_RX_CQ_DATA,
            msg_order: 0,
            op_flags: TC,
            inject_size: 32,
            max_order_waw_size: 0,
            cq_data_size: 4,
            mr_mode: fi::FI_MR_LOCAL
                | fi::FI_MR_ALLOCATED
                | fi::FI_MR_PROV_KEY
                | fi::FI_MR_VIRT_ADDR,
        }
    }

    /// prov/shm/src/smr_attr.c: WAW of any size advertised, inject size 4096, delivery
    /// complete, no fence.
    fn shm() -> Fixture {
        Fixture {
            prov: "shm",
            caps: RMA,
            mode: 0,
            rx_mode: 0,
            msg_order: SAS | WAW_SET,
            op_flags: TC | DC,
            inject_size: 4096,
            max_order_waw_size: usize::MAX,
            cq_data_size: 8,
            mr_mode: fi::FI_MR_VIRT_ADDR,
        }
    }

    /// prov/rxm over tcp (as fi_info -v prints it here): WAW of any size, delivery complete.
    fn tcp_rxm() -> Fixture {
        Fixture {
            prov: "tcp;ofi_rxm",
            caps: RMA,
            mode: 0,
            rx_mode: 0,
            msg_order: SAS | WAW_SET,
            op_flags: TC | DC,
            inject_size: 64,
            max_order_waw_size: usize::MAX,
            cq_data_size: 8,
            mr_mode: 0,
        }
    }

    /// verbs RC through rxm (prov/verbs/src/verbs_info.c): WAW up to the port's max_msg_sz,
    /// FI_MR_LOCAL, CQ data (the immediate) consuming posted receives.
    fn verbs_rc() -> Fixture {
        Fixture {
            prov: "verbs;ofi_rxm",
            caps: RMA,
            mode: 0,
            rx_mode: fi::FI_RX_CQ_DATA,
            msg_order: SAS | WAW_SET,
            op_flags: TC | DC,
            inject_size: 64,
            max_order_waw_size: 1 << 30,
            cq_data_size: 4,
            mr_mode: fi::FI_MR_LOCAL | fi::FI_MR_VIRT_ADDR | fi::FI_MR_ALLOCATED,
        }
    }

    fn plan(f: &Fixture) -> Plan {
        decide(&f.attrs(ASK_ALL)).unwrap_or_else(|e| panic!("{}: {e}", f.prov))
    }

    use FlagOrder::{Drain, Fence, Plain};

    #[test]
    fn cxi_orders_every_size_and_never_fences() {
        let p = plan(&cxi());
        for n in [8, 4096, 1 << 30, u64::MAX] {
            assert_eq!(p.after(n), Plain, "{n}");
            assert!(!p.needs_dc(n));
        }
    }

    #[test]
    fn psm3_orders_below_4k_and_drains_above() {
        let p = plan(&psm3());
        assert_eq!(p.ordered_upto, 4095);
        assert_eq!(p.after(8), Plain);
        assert_eq!(p.after(4095), Plain);
        assert_eq!(p.after(4096), Drain);
        assert_eq!(p.after(16 << 20), Drain);
        assert!(!p.needs_dc(4095) && p.needs_dc(4096));
        assert!(p.why.contains("max_order_waw_size 4096"), "{}", p.why);
    }

    #[test]
    fn efa_rdm_orders_nothing_and_drains_every_write_to_delivery() {
        let a = efa_rdm().attrs(ASK_ALL);
        assert!(a.rx_cq_data && a.cq_data_size == 4 && !a.mr_local);
        let p = decide(&a).unwrap();
        assert_eq!(p.ordered_upto, 0);
        // max_order_waw_size is set, but the message order has no RMA bit: it orders nothing.
        for n in [1, 8, 64, 4096, 1 << 20] {
            assert_eq!(p.after(n), Drain, "{n}");
            assert!(p.needs_dc(n));
        }
        assert_eq!(p.after(0), Plain, "nothing written since the last drain");
        assert!(p.why.contains("posted receive"), "{}", p.why);
    }

    /// Signals ride where 8 bytes of CQ data come without posted receives; on EFA's RDM
    /// endpoint (4 bytes, receives, nothing ordered) the receiver counts, given receives;
    /// elsewhere they are flags of their own.
    #[test]
    fn the_way_signals_travel_per_provider() {
        let way = |f: &Fixture, asked: Asked| {
            let a = f.attrs(asked);
            decide(&a).and_then(|p| signal_way(&a, &p))
        };
        for f in [tcp_rxm(), shm(), cxi(), psm3()] {
            assert_eq!(way(&f, ASK_ALL), Ok(SignalWay::Ride), "{}", f.prov);
        }
        assert_eq!(way(&efa_rdm(), ASK_ALL), Ok(SignalWay::Counted));
        let e = way(
            &efa_rdm(),
            Asked {
                recv: false,
                ..ASK_ALL
            },
        )
        .unwrap_err();
        assert!(e.contains("FI_MSG/FI_RECV"), "{e}");
        let e = way(
            &Fixture {
                caps: RMA,
                ..efa_rdm()
            },
            ASK_ALL,
        )
        .unwrap_err();
        assert!(e.contains("FI_MSG"), "{e}");
        let e = way(&verbs_rc(), ASK_ALL).unwrap_err();
        assert!(e.contains("orders writes") && e.contains("4 bytes"), "{e}");
    }

    #[test]
    fn efa_direct_is_refused() {
        let a = efa_direct().attrs(ASK_ALL);
        assert!(a.mr_local && a.rx_cq_data);
        let e = decide(&a).unwrap_err();
        assert!(
            e.contains("efa") && e.contains("FI_DELIVERY_COMPLETE") && e.contains("FI_FENCE"),
            "{e}"
        );
    }

    #[test]
    fn shm_orders_every_size_but_not_with_hmem() {
        let p = plan(&shm());
        assert_eq!(p.ordered_upto, u64::MAX);
        assert_eq!(p.after(u64::MAX), Plain);
        assert!(!p.needs_dc(64 << 20));
        assert!(p.describe().starts_with("plain after writes of any size"));
        assert!(p.why.contains("SAR protocol holds back"), "{}", p.why);
        // shm's FI_HMEM entry (FI_HMEM in its caps, an inject size of 0): nothing is ordered,
        // whichever of the two says so.
        for hmem_entry in [
            Fixture {
                caps: RMA | fi::FI_HMEM,
                inject_size: 0,
                ..shm()
            },
            Fixture {
                caps: RMA | fi::FI_HMEM,
                ..shm()
            },
            Fixture {
                inject_size: 0,
                ..shm()
            },
        ] {
            let p = decide(&hmem_entry.attrs(ASK_ALL)).unwrap();
            assert_eq!((p.ordered_upto, p.after(8)), (0, Drain));
            assert!(
                p.why.contains("FI_HMEM") && !p.why.contains("SAR"),
                "{}",
                p.why
            );
        }
    }

    #[test]
    fn tcp_rxm_orders_every_size() {
        let p = plan(&tcp_rxm());
        assert_eq!(p.ordered_upto, u64::MAX);
        assert_eq!(p.after(u64::MAX), Plain);
        assert!(p.describe().starts_with("plain after writes of any size"));
    }

    #[test]
    fn verbs_rc_orders_up_to_its_bound_then_drains() {
        let a = verbs_rc().attrs(ASK_ALL);
        assert!(a.mr_local && a.rx_cq_data);
        let p = decide(&a).unwrap();
        assert_eq!(p.after(1 << 29), Plain);
        assert_eq!(p.after(1 << 30), Drain);
    }

    #[test]
    fn a_bounded_provider_with_fence_fences_beyond_its_bound() {
        let p = plan(&Fixture {
            caps: RMA | FENCE,
            ..psm3()
        });
        assert_eq!((p.after(4095), p.after(4096)), (Plain, Fence));
        assert!(!p.needs_dc(1 << 20), "a fence needs no delivery completion");
    }

    #[test]
    fn a_bound_below_a_record_orders_nothing() {
        let p = plan(&Fixture {
            max_order_waw_size: 64,
            ..psm3()
        });
        assert_eq!((p.ordered_upto, p.after(8)), (0, Drain));
    }

    /// Finding 9: without delivery-complete a drain orders nothing, so it is never chosen.
    #[test]
    fn drain_is_never_chosen_without_delivery_complete() {
        let no_dc = Asked {
            dc: false,
            ..ASK_ALL
        };
        for f in [
            cxi(),
            psm3(),
            efa_rdm(),
            efa_direct(),
            shm(),
            tcp_rxm(),
            verbs_rc(),
        ] {
            match decide(&f.attrs(no_dc)) {
                Ok(p) => {
                    assert_ne!(p.beyond, Drain, "{}: {p:?}", f.prov);
                    assert!(!p.describe().contains("drain"), "{}", f.prov);
                }
                Err(e) => assert!(
                    e.contains("neither FI_FENCE nor FI_DELIVERY_COMPLETE"),
                    "{e}"
                ),
            }
        }
        // Those that order every size keep working; the rest are refused.
        assert!(decide(&tcp_rxm().attrs(no_dc)).is_ok());
        assert!(decide(&cxi().attrs(no_dc)).is_ok());
        assert!(decide(&shm().attrs(no_dc)).is_ok());
        assert!(decide(&psm3().attrs(no_dc)).is_err());
        assert!(decide(&efa_rdm().attrs(no_dc)).is_err());
    }

    /// Grants that were not asked for do not count: shm takes an unordered fast path for RMA
    /// when ordering was not requested.
    #[test]
    fn only_requested_grants_count() {
        let a = tcp_rxm().attrs(Asked {
            order: false,
            fence: true,
            dc: true,
            ..ASK_ALL
        });
        assert_eq!(a.msg_order, 0);
        assert_eq!(decide(&a).unwrap().after(8), Drain);
        let a = cxi().attrs(Asked {
            order: false,
            fence: false,
            dc: false,
            ..ASK_ALL
        });
        assert!(!a.fence && !a.delivery_complete);
        assert!(decide(&a).is_err());
    }

    #[test]
    fn forced_plans() {
        assert_eq!(Plan::forced(Fence).after(1), Fence);
        assert_eq!(Plan::forced(Drain).after(1), Drain);
        assert!(Plan::forced(Drain).needs_dc(1));
        assert_eq!(Plan::forced(Plain).after(u64::MAX), Plain);
    }
}
