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
use super::profile::{self, WriteData};
use libfabric_sys as fi;

/// The largest write that is ordered after earlier ones (a staging record; flags and markers
/// are 8 bytes): "both smaller than the size" makes a bound below it order nothing.
pub(super) const FOLLOWER_BYTES: u64 = 64;

/// The `msg_order` bits that mean "RMA writes are processed in order" (libfabric 1.x spells
/// it both ways).
const WAW_BITS: u64 = fi::FI_ORDER_RMA_WAW | fi::FI_ORDER_WAW as u64;

/// What the provider granted that bears on ordering, read from the chosen fi_info
/// ([`Attrs::from_info`]) and amended by what its source does beyond it ([`Attrs::amend`]), or
/// written by a test.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Attrs {
    /// `fabric_attr.prov_name`, e.g. `tcp;ofi_rxm` (for the quirks in the module doc).
    pub provider: String,
    /// `fabric_attr.name` (efa's two fabrics share a provider name, `profile::of`).
    pub fabric: String,
    /// `tx_attr.msg_order`, only the bits that were asked for: a provider may take an unordered
    /// fast path when ordering was not requested, whatever it lists (shm does).
    pub msg_order: u64,
    /// `ep_attr.max_order_waw_size` (`u64::MAX`: any size).
    pub max_order_waw_size: u64,
    /// FI_FENCE requested and in `caps`.
    pub fence: bool,
    /// FI_DELIVERY_COMPLETE requested, in `tx_attr.op_flags`, and acted on by the provider's
    /// writes (`amend`).
    pub delivery_complete: bool,
    /// `domain_attr.cq_data_size`: bytes of remote CQ data a write may carry.
    pub cq_data_size: u64,
    /// A write may carry remote CQ data at all (`amend`: cxi refuses it, opx 1.17 drops it,
    /// whatever `cq_data_size` says; the probe finds what the table does not know).
    pub write_cq_data: bool,
    /// A write above this many bytes is split by the provider, its remote CQ data repeated on
    /// every piece (efa-rdm's device writes: `profile::EFA_WRITE_SEGMENT`).
    pub split_with_data: Option<u64>,
    /// `tx_attr.inject_size`.
    pub inject_size: u64,
    /// FI_RX_CQ_DATA in `mode` or `rx_attr.mode`: remote CQ data consumes a posted receive.
    /// Signals are then never carried as CQ data (no provider this library uses needs it:
    /// docs/PROVIDERS.md; this library posts no receives).
    pub rx_cq_data: bool,
    /// FI_MR_LOCAL in `domain_attr.mr_mode`: every local buffer needs its descriptor.
    pub mr_local: bool,
    /// FI_HMEM in `caps`: the provider's entry for device memory.
    pub hmem: bool,
}

/// What a query asked the provider for (only those of its grants count).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Asked {
    pub order: bool,
    pub fence: bool,
    pub dc: bool,
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
            fabric: v.fabric_name(),
            msg_order,
            max_order_waw_size: ep.map_or(0, |e| e.max_order_waw_size as u64),
            fence: asked.fence && info.caps & fi::FI_FENCE as u64 != 0,
            delivery_complete: asked.dc && op_flags & fi::FI_DELIVERY_COMPLETE as u64 != 0,
            cq_data_size: dom.map_or(0, |d| d.cq_data_size as u64),
            write_cq_data: true,
            split_with_data: None,
            inject_size: tx.map_or(0, |t| t.inject_size as u64),
            rx_cq_data: (info.mode | rx.map_or(0, |r| r.mode)) & fi::FI_RX_CQ_DATA != 0,
            mr_local: dom.is_some_and(|d| d.mr_mode as u32 & fi::FI_MR_LOCAL != 0),
            hmem: info.caps & fi::FI_HMEM != 0,
        }
    }

    /// Applies what the provider's source does that its fi_info does not say
    /// (`profile::PROFILES`, docs/PROVIDERS.md); returns, for the endpoint's INFO line, which
    /// profile applied and one note per rule applied, each naming its citation (none for a
    /// provider the table does not have).
    pub fn amend(&mut self) -> Vec<String> {
        let Some(p) = profile::of(core_provider(&self.provider), &self.fabric) else {
            return Vec::new();
        };
        let cite = |r: profile::Rule| {
            p.cites
                .iter()
                .find(|(x, _)| *x == r)
                .map_or(String::new(), |(_, c)| {
                    format!(" ({}:{} {}, {})", c.file, c.lines, c.func, c.at)
                })
        };
        let mut notes = vec![format!("{}'s source read at {}", p.name, p.read_at)];
        if p.does.write_data != WriteData::Carried && self.cq_data_size > 0 {
            self.write_cq_data = false;
            notes.push(format!(
                "{} {} remote CQ data on RMA writes{}",
                p.name,
                match p.does.write_data {
                    WriteData::Refused => "refuses",
                    _ => "drops",
                },
                cite(profile::Rule::CqData)
            ));
        }
        if !p.does.dc_on_writes && self.delivery_complete {
            self.delivery_complete = false;
            notes.push(format!(
                "{} ignores FI_DELIVERY_COMPLETE on writes{}",
                p.name,
                cite(profile::Rule::DeliveryComplete)
            ));
        }
        if let Some(n) = p.does.split_with_data {
            self.split_with_data = Some(n);
            notes.push(format!(
                "{} repeats a write's remote CQ data on every {n}-byte segment{}",
                p.name,
                cite(profile::Rule::Split)
            ));
        }
        notes
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
    if !a.write_cq_data {
        return Err("the provider does not carry remote CQ data on RMA writes".into());
    }
    if a.rx_cq_data {
        return Err(
            "its remote CQ data consumes receives the target posts, which this library does not post"
                .into(),
        );
    }
    if a.cq_data_size >= super::signals::CQ_DATA_BYTES {
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
    if no.is_empty() {
        return Ok(SignalWay::Counted);
    }
    Err(format!(
        "riding needs {} bytes of remote CQ data ({} here); counting by the receiver does not fit: {}",
        super::signals::CQ_DATA_BYTES,
        a.cq_data_size,
        no.join("; ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::net::fabric::{strdup, InfoList};
    use crate::transport::net::profile::{Profile, Size, PROFILES};

    const RMA: u64 = fi::FI_RMA as u64 | fi::FI_WRITE as u64 | fi::FI_REMOTE_WRITE as u64;
    const WAW_SET: u64 = fi::FI_ORDER_WAW as u64 | fi::FI_ORDER_RMA_WAW | fi::FI_ORDER_ATOMIC_WAW;
    const SAS: u64 = fi::FI_ORDER_SAS as u64;
    /// What a device-sized bound or message reads as in these fixtures (the port's
    /// `max_msg_sz` of an InfiniBand HCA: 1 GiB).
    const DEVICE: u64 = 1 << 30;

    fn bytes(s: Size) -> u64 {
        match s {
            Size::Any => u64::MAX,
            Size::Device => DEVICE,
            Size::Bytes(n) => n,
        }
    }

    /// The fi_info a provider returns to our hints, as its profile says (`profile.rs`), read
    /// back the way the endpoint reads the chosen one, with `with` applied to it first.
    fn attrs_with(p: &Profile, asked: Asked, with: impl FnOnce(&mut fi::fi_info)) -> Attrs {
        let a = &p.advertised;
        let mut l = InfoList::alloc().unwrap();
        let i = l.head_mut();
        i.caps = RMA | if a.fence { fi::FI_FENCE as u64 } else { 0 };
        i.mode = if a.rx_cq_data { fi::FI_RX_CQ_DATA } else { 0 };
        // SAFETY: an fi_allocinfo'd info: every attribute struct is allocated; the names are
        // malloc'd strings that fi_freeinfo frees.
        unsafe {
            (*i.fabric_attr).prov_name = strdup(p.prov).unwrap();
            (*i.fabric_attr).name = strdup(p.fabric.unwrap_or("fabric")).unwrap();
            (*i.tx_attr).msg_order = SAS
                | if a.waw {
                    WAW_SET
                } else {
                    fi::FI_ORDER_ATOMIC_WAW
                };
            (*i.tx_attr).op_flags = fi::FI_TRANSMIT_COMPLETE as u64
                | if a.dc {
                    fi::FI_DELIVERY_COMPLETE as u64
                } else {
                    0
                };
            (*i.tx_attr).inject_size = bytes(a.inject) as usize;
            (*i.ep_attr).max_order_waw_size = bytes(a.max_order_waw) as usize;
            (*i.ep_attr).max_msg_size = bytes(a.max_msg) as usize;
            (*i.domain_attr).cq_data_size = a.cq_data as usize;
            (*i.domain_attr).mr_mode = a.mr_mode as i32;
        }
        with(i);
        let mut at = Attrs::from_info(l.first().unwrap(), asked);
        at.amend();
        at
    }

    fn attrs(p: &Profile, asked: Asked) -> Attrs {
        attrs_with(p, asked, |_| {})
    }

    fn prof(name: &str) -> &'static Profile {
        profile::named(name).unwrap()
    }

    /// What `select::choose` asks first (a provider that refuses a part is asked again with
    /// less; the fixtures grant what the profile advertises).
    const ASK_ALL: Asked = Asked {
        order: true,
        fence: true,
        dc: true,
    };

    fn plan(p: &Profile) -> Plan {
        decide(&attrs(p, ASK_ALL)).unwrap_or_else(|e| panic!("{}: {e}", p.name))
    }

    use FlagOrder::{Drain, Fence, Plain};

    /// Every provider of the table, planned from its own fi_info and source: how a flag
    /// follows data, and how a put's signal travels (None: a flag of its own).
    #[test]
    fn each_provider_gets_the_plan_its_source_supports() {
        /// A provider, its plan (how far writes are ordered, and after that), its signal way.
        type Want = (&'static str, Option<(u64, FlagOrder)>, Option<SignalWay>);
        let want: &[Want] = &[
            ("tcp", Some((u64::MAX, Plain)), Some(SignalWay::Ride)),
            ("shm", Some((u64::MAX, Plain)), Some(SignalWay::Ride)),
            ("cxi", Some((u64::MAX, Plain)), None),
            ("efa (efa-rdm)", Some((0, Drain)), Some(SignalWay::Counted)),
            ("efa-direct", None, None),
            ("verbs;ofi_rxm", Some((DEVICE - 1, Drain)), None),
            ("psm3", Some((4095, Drain)), Some(SignalWay::Ride)),
            ("opx", None, None),
        ];
        assert_eq!(
            want.len(),
            PROFILES.len(),
            "a provider of the table is not checked here"
        );
        for (name, how, way) in want {
            let p = prof(name);
            let a = attrs(p, ASK_ALL);
            match (decide(&a), how) {
                (Ok(plan), Some((upto, beyond))) => {
                    assert_eq!((plan.ordered_upto, plan.beyond), (*upto, *beyond), "{name}");
                    assert_eq!(signal_way(&a, &plan).ok(), *way, "{name}");
                }
                (Err(e), None) => assert!(
                    e.contains("neither FI_FENCE nor FI_DELIVERY_COMPLETE"),
                    "{name}: {e}"
                ),
                (got, _) => panic!("{name}: {got:?}"),
            }
            assert_eq!(
                p.does.unusable.is_some(),
                how.is_none(),
                "{name}: the table agrees"
            );
        }
    }

    /// Finding 1 of issue 40: cxi advertises 8 bytes of CQ data, for messages; its
    /// fi_writemsg refuses FI_REMOTE_CQ_DATA. Its fi_info alone would make signals ride.
    #[test]
    fn cxi_never_rides_whatever_its_fi_info_says() {
        let p = prof("cxi");
        let a = attrs(p, ASK_ALL);
        assert_eq!((a.cq_data_size, a.write_cq_data), (8, false));
        let plan = decide(&a).unwrap();
        let e = signal_way(&a, &plan).unwrap_err();
        assert!(e.contains("does not carry remote CQ data"), "{e}");
        // Unamended, the fi_info would have it ride (what the library did before).
        let raw = Attrs {
            write_cq_data: true,
            ..a
        };
        assert_eq!(signal_way(&raw, &plan), Ok(SignalWay::Ride));
        // Every size ordered, never fenced (the fence is asked only where the order is bounded).
        for n in [8, 4096, 1 << 30, u64::MAX] {
            assert_eq!(plan.after(n), Plain, "{n}");
            assert!(!plan.needs_dc(n));
        }
    }

    /// Finding 2: efa-rdm's CQ data needs no receive, and its device writes repeat it per
    /// segment; efa-direct ignores FI_DELIVERY_COMPLETE and so cannot be planned at all.
    #[test]
    fn efa_rdm_counts_without_receives_and_efa_direct_is_refused() {
        let a = attrs(prof("efa (efa-rdm)"), ASK_ALL);
        assert!(!a.rx_cq_data && a.cq_data_size == 4 && a.mr_local);
        assert_eq!(a.split_with_data, Some(profile::EFA_WRITE_SEGMENT));
        let p = decide(&a).unwrap();
        assert_eq!(p.ordered_upto, 0);
        for n in [1, 8, 64, 4096, 1 << 20] {
            assert_eq!(p.after(n), Drain, "{n}");
            assert!(p.needs_dc(n));
        }
        assert_eq!(p.after(0), Plain, "nothing written since the last drain");
        assert_eq!(signal_way(&a, &p), Ok(SignalWay::Counted));
        let d = attrs(prof("efa-direct"), ASK_ALL);
        assert!(!d.delivery_complete, "advertised, ignored on writes");
        let e = decide(&d).unwrap_err();
        assert!(
            e.contains("efa") && e.contains("FI_DELIVERY_COMPLETE"),
            "{e}"
        );
        // Were its FI_RX_CQ_DATA granted, signals would still not ride or count on receives.
        let rx = attrs_with(prof("efa (efa-rdm)"), ASK_ALL, |i| {
            i.mode = fi::FI_RX_CQ_DATA
        });
        assert!(signal_way(&rx, &p).unwrap_err().contains("receives"));
    }

    #[test]
    fn psm3_orders_below_4k_and_drains_above() {
        let p = plan(prof("psm3"));
        assert_eq!(p.ordered_upto, 4095);
        assert_eq!(p.after(8), Plain);
        assert_eq!(p.after(4095), Plain);
        assert_eq!(p.after(4096), Drain);
        assert_eq!(p.after(16 << 20), Drain);
        assert!(!p.needs_dc(4095) && p.needs_dc(4096));
        assert!(p.why.contains("max_order_waw_size 4096"), "{}", p.why);
    }

    #[test]
    fn shm_orders_every_size_but_not_with_hmem() {
        let p = plan(prof("shm"));
        assert_eq!(p.ordered_upto, u64::MAX);
        assert_eq!(p.after(u64::MAX), Plain);
        assert!(!p.needs_dc(64 << 20));
        assert!(p.describe().starts_with("plain after writes of any size"));
        assert!(p.why.contains("SAR protocol holds back"), "{}", p.why);
        // shm's FI_HMEM entry (FI_HMEM in its caps, an inject size of 0): nothing is ordered,
        // whichever of the two says so.
        for (hmem, inject) in [(true, 0), (true, 4096), (false, 0)] {
            let a = attrs_with(prof("shm"), ASK_ALL, |i| {
                if hmem {
                    i.caps |= fi::FI_HMEM;
                }
                // SAFETY: an allocated tx_attr.
                unsafe { (*i.tx_attr).inject_size = inject };
            });
            let p = decide(&a).unwrap();
            assert_eq!((p.ordered_upto, p.after(8)), (0, Drain));
            assert!(
                p.why.contains("FI_HMEM") && !p.why.contains("SAR"),
                "{}",
                p.why
            );
        }
    }

    #[test]
    fn tcp_orders_every_size() {
        let p = plan(prof("tcp"));
        assert_eq!(p.ordered_upto, u64::MAX);
        assert_eq!(p.after(u64::MAX), Plain);
        assert!(p.describe().starts_with("plain after writes of any size"));
    }

    #[test]
    fn verbs_orders_below_its_bound_then_drains() {
        let a = attrs(prof("verbs;ofi_rxm"), ASK_ALL);
        assert!(a.mr_local && !a.rx_cq_data && a.cq_data_size == 4);
        let p = decide(&a).unwrap();
        assert_eq!(p.after(DEVICE - 1), Plain);
        assert_eq!(p.after(DEVICE), Drain);
        let e = signal_way(&a, &p).unwrap_err();
        assert!(e.contains("orders writes") && e.contains("4 here"), "{e}");
    }

    #[test]
    fn a_bounded_provider_with_fence_fences_beyond_its_bound() {
        let a = attrs_with(prof("psm3"), ASK_ALL, |i| i.caps |= fi::FI_FENCE as u64);
        let p = decide(&a).unwrap();
        assert_eq!((p.after(4095), p.after(4096)), (Plain, Fence));
        assert!(!p.needs_dc(1 << 20), "a fence needs no delivery completion");
    }

    #[test]
    fn a_bound_below_a_record_orders_nothing() {
        let a = attrs_with(prof("psm3"), ASK_ALL, |i| {
            // SAFETY: an allocated ep_attr.
            unsafe { (*i.ep_attr).max_order_waw_size = 64 };
        });
        let p = decide(&a).unwrap();
        assert_eq!((p.ordered_upto, p.after(8)), (0, Drain));
    }

    /// Finding 9 (2026-11-25): without delivery-complete a drain orders nothing, so it is never
    /// chosen.
    #[test]
    fn drain_is_never_chosen_without_delivery_complete() {
        let no_dc = Asked {
            dc: false,
            ..ASK_ALL
        };
        for p in PROFILES {
            match decide(&attrs(p, no_dc)) {
                Ok(plan) => {
                    assert_ne!(plan.beyond, Drain, "{}: {plan:?}", p.name);
                    assert!(!plan.describe().contains("drain"), "{}", p.name);
                }
                Err(e) => assert!(
                    e.contains("neither FI_FENCE nor FI_DELIVERY_COMPLETE"),
                    "{e}"
                ),
            }
        }
        // Those that order every size keep working; the rest are refused.
        for name in ["tcp", "cxi", "shm"] {
            assert!(decide(&attrs(prof(name), no_dc)).is_ok(), "{name}");
        }
        for name in ["psm3", "efa (efa-rdm)", "verbs;ofi_rxm"] {
            assert!(decide(&attrs(prof(name), no_dc)).is_err(), "{name}");
        }
    }

    /// Grants that were not asked for do not count: shm takes an unordered fast path for RMA
    /// when ordering was not requested.
    #[test]
    fn only_requested_grants_count() {
        let a = attrs(
            prof("tcp"),
            Asked {
                order: false,
                ..ASK_ALL
            },
        );
        assert_eq!(a.msg_order, 0);
        assert_eq!(decide(&a).unwrap().after(8), Drain);
        let a = attrs(prof("cxi"), Asked::default());
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
