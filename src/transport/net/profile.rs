//! What each libfabric provider the library names does with the calls this transport makes,
//! read in the provider's own source at the tags given (github.com/ofiwg/libfabric), one entry
//! per provider: what its `fi_info` advertises to our hints, and what its source does beyond
//! that. Every rule carries its citation (file, function, lines, tag). `docs/PROVIDERS.md` is
//! rendered from this table (`render`), and a test fails when the two differ; the fixtures of
//! `order.rs` and the profiles of the unordered test layer are built from it.
//!
//! How the library uses it: `order::Attrs` is read from the chosen `fi_info`, then `amend`
//! applies what the provider's source does that its `fi_info` does not say (cxi refuses remote
//! CQ data on writes although it advertises 8 bytes of it; efa-direct and opx advertise
//! FI_DELIVERY_COMPLETE and never act on it on a write; efa-rdm repeats a write's remote CQ
//! data on every 1 GiB segment). What can be tried without a peer is tried as well when the
//! endpoint opens (`probe.rs`): a rule here is a reading, the probe is the provider answering.
//!
//! Pure data and pure functions: a leaf.

use libfabric_sys as fi;

/// One reading of a provider's source.
#[derive(Clone, Copy, Debug)]
pub(super) struct Cite {
    /// The libfabric tag it was read at (`v2.5.0`).
    pub at: &'static str,
    pub file: &'static str,
    pub lines: &'static str,
    /// The function, macro or table.
    pub func: &'static str,
    /// What the source says there, in a few words (quoted where in quotes). Read by
    /// docs/PROVIDERS.md's rendering (`render`).
    #[cfg_attr(not(test), allow(dead_code))]
    pub says: &'static str,
}

/// What remote CQ data on an RMA write (`fi_writemsg` with FI_REMOTE_CQ_DATA) does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum WriteData {
    /// Delivered with the write; the target reads it from its CQ once the write is in place,
    /// without a receive posted for it.
    Carried,
    /// `fi_writemsg` answers -FI_EBADFLAGS (the flag is outside the accepted mask).
    Refused,
    /// The flag is dropped: the write lands, the target hears nothing.
    Dropped,
}

/// u64 FI_SUM atomics into a peer's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Atomics {
    /// None (-FI_ENOSYS, or no FI_ATOMIC info for our hints).
    No,
    /// Applied by the target's CPU in its progress; GPU memory by copy out, add, copy back
    /// (not atomic against the GPU).
    Software,
    /// Applied by the NIC.
    Nic,
}

/// A size the provider advertises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Size {
    Bytes(u64),
    /// Any size (`-1`, `SIZE_MAX`).
    Any,
    /// Read from the hardware at run time (the port's `max_msg_sz`): not in the source.
    Device,
}

/// What the provider's `fi_info` says to this library's hints (`select.rs`: FI_RMA, FI_WRITE,
/// FI_REMOTE_WRITE, FI_ORDER_RMA_WAW | FI_ORDER_WAW, FI_DELIVERY_COMPLETE, FI_FENCE where the
/// order is bounded, mode FI_CONTEXT | FI_CONTEXT2).
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(test), allow(dead_code))]
pub(super) struct Advertised {
    /// FI_ORDER_RMA_WAW in `tx_attr.msg_order` when asked for.
    pub waw: bool,
    /// `ep_attr.max_order_waw_size`.
    pub max_order_waw: Size,
    /// FI_FENCE in `caps` when asked for.
    pub fence: bool,
    /// FI_DELIVERY_COMPLETE in `tx_attr.op_flags`.
    pub dc: bool,
    /// `domain_attr.cq_data_size`.
    pub cq_data: u64,
    /// FI_RX_CQ_DATA in `mode`: remote CQ data consumes a posted receive.
    pub rx_cq_data: bool,
    /// `domain_attr.mr_mode`.
    pub mr_mode: u32,
    /// `ep_attr.max_msg_size`.
    pub max_msg: Size,
    /// `tx_attr.inject_size`.
    pub inject: Size,
}

/// What the provider does beyond what its `fi_info` says.
#[derive(Clone, Copy, Debug)]
pub(super) struct Does {
    pub write_data: WriteData,
    /// FI_DELIVERY_COMPLETE on a write means the write arrived (false: ignored on writes).
    pub dc_on_writes: bool,
    /// A write above this many bytes is split into pieces, each carrying the write's remote
    /// CQ data: the target reads it once per piece.
    pub split_with_data: Option<u64>,
    /// (For docs/PROVIDERS.md: no plan uses atomics yet.)
    #[cfg_attr(not(test), allow(dead_code))]
    pub atomics: Atomics,
    /// Not usable by this transport at all, and why (never chosen unless named).
    pub unusable: Option<&'static str>,
}

/// One provider (module doc).
#[derive(Clone, Copy, Debug)]
pub(super) struct Profile {
    /// As docs/PROVIDERS.md names it.
    pub name: &'static str,
    /// The core provider (`fabric::core_provider` of `prov_name`) it applies to.
    pub prov: &'static str,
    /// The fabric name it applies to (None: any): efa's two fabrics share a provider name.
    pub fabric: Option<&'static str>,
    /// The tags read.
    pub read_at: &'static str,
    /// What its fi_info says: read from the provider itself at run time, so here only for
    /// docs/PROVIDERS.md and the fixtures of `order.rs`.
    #[cfg_attr(not(test), allow(dead_code))]
    pub advertised: Advertised,
    pub does: Does,
    /// The citations, by the rule they prove (`Rule::name`).
    pub cites: &'static [(Rule, Cite)],
}

/// The rules a citation proves (a column of docs/PROVIDERS.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Rule {
    Order,
    Fence,
    DeliveryComplete,
    CqData,
    Split,
    Atomics,
    MrMode,
    MaxWrite,
    Inject,
    Usable,
}

impl Rule {
    #[cfg(test)]
    pub fn name(self) -> &'static str {
        match self {
            Rule::Order => "write order",
            Rule::Fence => "FI_FENCE",
            Rule::DeliveryComplete => "delivery complete",
            Rule::CqData => "remote CQ data on writes",
            Rule::Split => "split writes",
            Rule::Atomics => "u64 FI_SUM atomics",
            Rule::MrMode => "MR mode",
            Rule::MaxWrite => "largest write",
            Rule::Inject => "inject size",
            Rule::Usable => "usable",
        }
    }
}

const fn c(
    at: &'static str,
    file: &'static str,
    lines: &'static str,
    func: &'static str,
    says: &'static str,
) -> Cite {
    Cite {
        at,
        file,
        lines,
        func,
        says,
    }
}

/// The bytes at which efa-rdm cuts a device write into segments (`efa_write_segment_size`,
/// the lesser of it and the device's `max_rdma_size`; the latter is not in the source, and
/// `FI_OPT_MAX_RMA_SIZE` answers `max_msg_size` on efa-rdm, so it cannot be read).
pub(super) const EFA_WRITE_SEGMENT: u64 = 1 << 30;

const MR_LOCAL: u32 = fi::FI_MR_LOCAL;
const VIRT: u32 = fi::FI_MR_VIRT_ADDR;
const ALLOC: u32 = fi::FI_MR_ALLOCATED;
const PROV_KEY: u32 = fi::FI_MR_PROV_KEY;
const MR_EP: u32 = fi::FI_MR_ENDPOINT;

/// Every provider the library names (module doc). The order is docs/PROVIDERS.md's.
pub(super) const PROFILES: &[Profile] = &[
    Profile {
        name: "tcp",
        prov: "tcp",
        fabric: None,
        read_at: "v1.17.0 (tcp;ofi_rxm), v2.1.0, v2.5.0 (tcp's own RDM endpoint)",
        advertised: Advertised {
            waw: true,
            max_order_waw: Size::Any,
            fence: false,
            dc: true,
            cq_data: 8,
            rx_cq_data: false,
            mr_mode: 0,
            max_msg: Size::Any,
            inject: Size::Bytes(64),
        },
        does: Does {
            write_data: WriteData::Carried,
            dc_on_writes: true,
            split_with_data: None,
            atomics: Atomics::Software,
            unusable: None,
        },
        cites: &[
            (Rule::Order, c("v1.17.0", "prov/tcp/src/tcpx_attr.c", "83", "tcpx_ep_attr", ".max_order_waw_size = SIZE_MAX")),
            (Rule::Order, c("v2.1.0", "prov/tcp/src/xnet_progress.c", "1418-1438", "xnet_tx_queue_insert", "one FIFO tx queue per connection, one connection per peer")),
            (Rule::Order, c("v1.17.0", "prov/rxm/src/rxm_rma.c", "104", "rxm_ep_rma_common", "one core fi_writemsg per write: never split")),
            (Rule::Fence, c("v2.1.0", "prov/tcp/src/xnet_attr.c", "37-44", "XNET_RDM_EP_CAPS", "no FI_FENCE: hints asking for it get -FI_ENODATA")),
            (Rule::DeliveryComplete, c("v2.1.0", "prov/tcp/src/xnet.h", "625-631", "xnet_set_ack_flags", "FI_DELIVERY_COMPLETE: the target acknowledges after the data; without it a write completes when handed to the socket")),
            (Rule::CqData, c("v2.1.0", "prov/tcp/src/xnet_progress.c", "951-953", "xnet_handle_write", "the CQ data travels in the write's header and is reported after its data, no receive consumed")),
            (Rule::CqData, c("v1.17.0", "prov/rxm/src/rxm_init.c", "319", "rxm_info_to_rxm", "FI_RX_CQ_DATA removed from the mode rxm reports")),
            (Rule::Atomics, c("v1.17.0", "prov/rxm/src/rxm_init.c", "511-527", "rxm_validate_atomic_hints", "FI_ATOMIC with FI_ORDER_WAW in the hints: -FI_EINVAL"), ),
            (Rule::Atomics, c("v2.1.0", "prov/tcp/src/xnet_rdm.c", "584-599", "xnet_rdm_atomic_ops", "fi_no_atomic_*: -FI_ENOSYS")),
            (Rule::MrMode, c("v2.1.0", "prov/util/src/util_attr.c", "1205-1211", "fi_alter_domain_attr", "OFI_MR_BASIC|OFI_MR_SCALABLE stripped: mr_mode 0, remote addresses are offsets, keys requested")),
            (Rule::Inject, c("v1.17.0", "prov/rxm/src/rxm_init.c", "337-342", "rxm_info_to_rxm", "tcp's 128 bytes less rxm's 64-byte header; 2.x's own endpoint: 128 (xnet.h:95)")),
        ],
    },
    Profile {
        name: "shm",
        prov: "shm",
        fabric: None,
        read_at: "v1.17.0, v2.1.0, v2.5.0",
        advertised: Advertised {
            waw: true,
            max_order_waw: Size::Any,
            fence: false,
            dc: true,
            cq_data: 8,
            rx_cq_data: false,
            mr_mode: 0,
            max_msg: Size::Any,
            inject: Size::Bytes(4096),
        },
        does: Does {
            write_data: WriteData::Carried,
            dc_on_writes: true,
            split_with_data: None,
            atomics: Atomics::Software,
            unusable: None,
        },
        cites: &[
            (Rule::Order, c("v1.17.0", "prov/shm/src/smr_progress.c", "1041-1089", "smr_progress_cmd", "one command queue per peer, drained in order; a CMA copy ends while its command is processed")),
            (Rule::Order, c("v1.17.0", "prov/shm/src/smr_rma.c", "132-135", "smr_generic_rma", "while a SAR transfer to the peer runs (sar_status), every new write to it answers -FI_EAGAIN")),
            (Rule::Order, c("v1.17.0", "prov/shm/src/smr.h", "232-233", "smr_fast_rma_enabled", "the fast path that copies at the sender is off when RMA ordering is asked for")),
            (Rule::Order, c("v2.1.0", "prov/shm/src/smr_progress.c", "556-567", "smr_progress_ipc", "its FI_HMEM entry's device copies may end after a later command (ROCR's asynchronous IPC copy): ordered for no size")),
            (Rule::Fence, c("v1.17.0", "prov/shm/src/smr_attr.c", "35-40", "SMR_TX_CAPS", "no FI_FENCE")),
            (Rule::DeliveryComplete, c("v1.17.0", "prov/shm/src/smr_ep.c", "642-643", "smr_select_proto", "FI_DELIVERY_COMPLETE: a protocol whose completion waits for the target's response")),
            (Rule::CqData, c("v1.17.0", "prov/shm/src/smr_attr.c", "107", "smr_domain_attr", "cq_data_size 8, carried in the write's command, no receive consumed")),
            (Rule::CqData, c("v2.1.0", "prov/shm/src/smr_progress.c", "1115-1117", "smr_progress_cmd_rma", "2.0-2.4 flag the target's entry FI_REMOTE_CQ_DATA only (no FI_RMA): read that flag alone")),
            (Rule::Atomics, c("v1.17.0", "prov/shm/src/smr_atomic.c", "547-572", "smr_query_atomic", "host memory, at most 4096 bytes, applied by the target's progress")),
            (Rule::MrMode, c("v1.17.0", "prov/shm/src/smr_init.c", "164-170", "smr_getinfo", "FI_MR_VIRT_ADDR only with the fast path; with ordering asked, mr_mode 0 (offsets)")),
            (Rule::Inject, c("v1.17.0", "prov/shm/src/smr_attr.c", "50", "smr_tx_attr", "SMR_INJECT_SIZE 4096; 0 for its FI_HMEM entry (:70)")),
        ],
    },
    Profile {
        name: "cxi",
        prov: "cxi",
        fabric: None,
        read_at: "v1.22.0, v2.1.0, v2.5.0",
        advertised: Advertised {
            waw: true,
            max_order_waw: Size::Any,
            fence: true,
            dc: true,
            cq_data: 8,
            rx_cq_data: false,
            mr_mode: MR_EP | ALLOC | PROV_KEY,
            max_msg: Size::Bytes((1 << 32) - 1),
            inject: Size::Bytes(192),
        },
        does: Does {
            write_data: WriteData::Refused,
            dc_on_writes: true,
            split_with_data: None,
            atomics: Atomics::Nic,
            unusable: None,
        },
        cites: &[
            (Rule::Order, c("v2.5.0", "prov/cxi/src/cxip_rma.c", "545-576", "cxip_rma_is_unrestricted", "a write goes ordered (unrestricted) when the msg_order asked for has FI_ORDER_WAW or FI_ORDER_RMA_WAW")),
            (Rule::Order, c("v2.5.0", "prov/cxi/src/cxip_info.c", "259-261", "cxip_ep_attr", ".max_order_waw_size = -1")),
            (Rule::Order, c("v1.22.0", "man/fi_cxi.7.md", "401-415", "PCIe Ordering", "ordered per operation: body packets relaxed, an operation's last packet strictly ordered")),
            (Rule::Fence, c("v2.5.0", "prov/cxi/src/cxip_cmdq.c", "404-417", "cxip_cmdq_emit_dma", "FI_FENCE: a C_CMD_CQ_FENCE before the command; the cap only if asked for (cxip_info.c:1982-1988)")),
            (Rule::DeliveryComplete, c("v2.5.0", "prov/cxi/src/cxip_rma.c", "363-364", "cxip_rma_emit_dma", "FI_DELIVERY_COMPLETE sets the flush bit; the default completion is the target NIC's ack, data not yet visible")),
            (Rule::CqData, c("v2.5.0", "prov/cxi/src/cxip_rma.c", "824-826", "cxip_rma_writemsg", "flags outside CXIP_WRITEMSG_ALLOWED_FLAGS (no FI_REMOTE_CQ_DATA): -FI_EBADFLAGS; the same at v1.22.0:724-726, v2.1.0:752-754")),
            (Rule::CqData, c("v2.5.0", "prov/cxi/src/cxip_ep.c", "776-780", "cxip_ep_enable", "fi_writedata only from 2.5, with FI_CXI_ENABLE_WRITEDATA=1 and provider keys; otherwise -FI_ENOSYS; cq_data_size 8 is for messages")),
            (Rule::Atomics, c("v2.5.0", "prov/cxi/src/cxip_atomic.c", "106", "_cxip_amo_valid", "FI_SUM on FI_UINT64 valid in the NIC; FI_FENCE and FI_DELIVERY_COMPLETE accepted (:1458-1464)")),
            (Rule::MrMode, c("v2.5.0", "prov/cxi/src/cxip_info.c", "38, 92", "cxip_prov_key_domain_attr, cxip_client_key_domain_attr", "FI_MR_ENDPOINT|FI_MR_ALLOCATED (+FI_MR_PROV_KEY), never FI_MR_VIRT_ADDR: offsets (cxip_atomic.c:1298)")),
            (Rule::MrMode, c("v2.5.0", "prov/cxi/src/cxip_mr.c", "1560", "cxip_mr_bind", "fi_mr_bind before the endpoint is enabled: -FI_EINVAL; a provider key is FI_KEY_NOTAVAIL until fi_mr_enable (:1659)")),
            (Rule::MaxWrite, c("v2.5.0", "prov/cxi/include/cxip.h", "80", "CXIP_EP_MAX_MSG_SZ", "(1 << 32) - 1, one DMA command, never split (cxip_rma.c:387)")),
            (Rule::Inject, c("v2.5.0", "prov/cxi/include/cxip.h", "161", "CXIP_INJECT_SIZE", "C_MAX_IDC_PAYLOAD_UNR (192 in HPE's cassini_user_defs.h, outside libfabric)")),
        ],
    },
    Profile {
        name: "efa (efa-rdm)",
        prov: "efa",
        fabric: Some("efa"),
        read_at: "v1.17.0, v1.22.0, v2.1.0, v2.5.0",
        advertised: Advertised {
            waw: false,
            max_order_waw: Size::Bytes(0),
            fence: false,
            dc: true,
            cq_data: 4,
            rx_cq_data: false,
            mr_mode: MR_LOCAL | VIRT | ALLOC | PROV_KEY,
            max_msg: Size::Any,
            inject: Size::Bytes(4096),
        },
        does: Does {
            write_data: WriteData::Carried,
            dc_on_writes: true,
            split_with_data: Some(EFA_WRITE_SEGMENT),
            atomics: Atomics::Software,
            unusable: None,
        },
        cites: &[
            (Rule::Order, c("v2.5.0", "prov/efa/src/efa_prov_info.c", "635-636", "efa_prov_info_alloc_for_rdm", "msg_order: FI_ORDER_SAS and the atomic bits, no RMA bit (same at v1.17.0:631)")),
            (Rule::Order, c("v2.5.0", "prov/efa/src/efa_user_info.c", "364-365", "efa_user_info_alter_rdm", "max_order_waw_size 0 unless FI_ORDER_ATOMIC_WAW is asked (it sizes emulated atomics)")),
            (Rule::Order, c("v2.5.0", "prov/efa/src/rdm/efa_rdm_pke_cmd.c", "827-842", "efa_rdm_pke_proc_received", "write packets bypass the reorder buffer")),
            (Rule::Fence, c("v2.5.0", "prov/util/src/util_attr.c", "1173-1176", "ofi_check_info", "FI_FENCE appears nowhere in prov/efa: hints with it get no efa info")),
            (Rule::DeliveryComplete, c("v2.5.0", "prov/efa/src/rdm/efa_rdm_rma.c", "360-365", "efa_rdm_rma_post_write", "the device write path returns before FI_DELIVERY_COMPLETE is read; its completion is the device's (whether that is remote placement is not in the source)")),
            (Rule::CqData, c("v2.5.0", "prov/efa/src/efa_cq.h", "55", "EFA_CQ_DATA_SIZE", "4 bytes (8 at v1.17.0, rxr/rxr.h:497)")),
            (Rule::CqData, c("v2.5.0", "prov/efa/src/efa_base_ep.c", "360-364", "efa_base_ep_create_qp", "\"RDM full protocol doesn't support FI_RX_CQ_DATA\": no receive posted by the user; entry op_context NULL (rdm/efa_rdm_cq.c:207)")),
            (Rule::Split, c("v2.5.0", "prov/efa/src/rdm/efa_rdm_ope.c", "1554", "efa_rdm_ope_post_remote_write", "device writes cut at MIN(efa_write_segment_size, max_rdma_size); the segment is 1 GiB (efa_env.c:36), no variable sets it")),
            (Rule::Split, c("v2.5.0", "prov/efa/src/rdm/efa_rdm_pke.c", "702-714", "efa_rdm_pke_write", "the immediate goes on every segment; one segment is only assert()ed")),
            (Rule::Atomics, c("v2.5.0", "prov/efa/src/rdm/efa_rdm_pke_rta.c", "227-232", "efa_rdm_pke_proc_write_rta", "emulated: the target's CPU applies it; GPU memory by copy out and back (:168-190)")),
            (Rule::MrMode, c("v2.5.0", "prov/efa/src/efa_user_info.c", "388-389", "efa_user_info_alter_rdm", "FI_MR_LOCAL echoed back when the hints offer it; VIRT_ADDR|ALLOCATED|PROV_KEY (efa_prov_info.c:49)")),
            (Rule::MaxWrite, c("v2.5.0", "prov/efa/src/efa_prov_info.c", "613", "efa_prov_info_alloc_for_rdm", "max_msg_size UINT64_MAX")),
            (Rule::Inject, c("v2.5.0", "prov/efa/src/efa_prov_info.c", "652-662", "efa_prov_info_alloc_for_rdm", "MIN(MTU - header, 4096) with shm on")),
            (Rule::Usable, c("v2.5.0", "prov/efa/src/rdm/efa_rdm_rma.c", "477-488", "efa_rdm_rma_writemsg", "a peer on the same host (itself too) is written through shm, with shm's rules")),
        ],
    },
    Profile {
        name: "efa-direct",
        prov: "efa",
        fabric: Some("efa-direct"),
        read_at: "v2.1.0, v2.5.0 (absent before v2.1.0)",
        advertised: Advertised {
            waw: false,
            max_order_waw: Size::Bytes(0),
            fence: false,
            dc: true,
            cq_data: 4,
            rx_cq_data: false,
            mr_mode: MR_LOCAL | VIRT | ALLOC | PROV_KEY,
            max_msg: Size::Device,
            inject: Size::Bytes(0),
        },
        does: Does {
            write_data: WriteData::Carried,
            dc_on_writes: false,
            split_with_data: None,
            atomics: Atomics::No,
            unusable: Some("it orders no write, has no FI_FENCE, and ignores FI_DELIVERY_COMPLETE on writes, so nothing can order a signal after its data"),
        },
        cites: &[
            (Rule::Order, c("v2.5.0", "prov/efa/src/efa_prov_info.c", "26", "EFA_MSG_ORDER", "(0)")),
            (Rule::Fence, c("v2.5.0", "prov/util/src/util_attr.c", "1173-1176", "ofi_check_info", "no FI_FENCE in prov/efa")),
            (Rule::DeliveryComplete, c("v2.5.0", "prov/efa/src/efa_prov_info.c", "224", "efa_prov_info_set_tx_rx_attr", "advertised through EFA_RDM_TX_OP_FLAGS; no efa-direct data-path file reads FI_DELIVERY_COMPLETE (efa_rma.c:249-261)")),
            (Rule::CqData, c("v2.5.0", "prov/efa/src/efa_user_info.c", "476-498", "efa_user_info_alter_direct", "without FI_RX_CQ_DATA in the hints: returned only on devices with unsolicited write receive, else -FI_ENODATA for FI_RMA")),
            (Rule::MrMode, c("v2.5.0", "prov/efa/src/efa_rma.c", "220-225", "efa_rma_post_write", "FI_MR_LOCAL: a write without its descriptor is -FI_EINVAL")),
            (Rule::MaxWrite, c("v2.5.0", "prov/efa/src/efa_rma.c", "235-238", "efa_rma_post_write", "one work request per write, never split; max_msg_size from the device (efa_prov_info.c:157-159)")),
            (Rule::Usable, c("v2.5.0", "prov/efa/src/efa_prov.c", "94-98", "efa_util_prov_initialize", "listed before efa-rdm, and matched by our FI_CONTEXT2 mode (efa_prov_info.c:472): skipped unless named")),
        ],
    },
    Profile {
        name: "verbs;ofi_rxm",
        prov: "verbs",
        fabric: None,
        read_at: "v1.17.0, v2.1.0, v2.5.0",
        advertised: Advertised {
            waw: true,
            max_order_waw: Size::Device,
            fence: false,
            dc: true,
            cq_data: 4,
            rx_cq_data: false,
            mr_mode: MR_LOCAL | VIRT | ALLOC | PROV_KEY,
            max_msg: Size::Device,
            inject: Size::Device,
        },
        does: Does {
            write_data: WriteData::Carried,
            dc_on_writes: true,
            split_with_data: None,
            atomics: Atomics::Software,
            unusable: None,
        },
        cites: &[
            (Rule::Order, c("v2.5.0", "prov/verbs/src/verbs_info.c", "675, 680", "vrb_get_device_attrs", "max_order_waw_size = the port's max_msg_sz (ibv_query_port)")),
            (Rule::Order, c("v2.5.0", "prov/rxm/src/rxm_rma.c", "104", "rxm_ep_rma_common", "one RC work request per write, never split")),
            (Rule::Fence, c("v2.5.0", "prov/rxm/src/rxm_attr.c", "36", "RXM_TX_CAPS", "no FI_FENCE cap: hints with it drop rxm (util_attr.c:1174)")),
            (Rule::DeliveryComplete, c("v2.5.0", "prov/rxm/src/rxm.h", "138", "RXM_TX_OP_FLAGS", "advertised, read nowhere: a write completes at the RC acknowledgement (rxm_cq.c:221 rxm_finish_rma)")),
            (Rule::CqData, c("v2.5.0", "prov/verbs/src/verbs_rma.c", "98-100", "vrb_msg_ep_rma_writemsg", "RDMA_WRITE_WITH_IMM, the data cut to 32 bits; rxm reports cq_data_size MIN(4, 8) (rxm_init.c:372)")),
            (Rule::CqData, c("v2.5.0", "prov/rxm/src/rxm_init.c", "319", "rxm_info_to_rxm", "FI_RX_CQ_DATA hidden: rxm posts and reposts the receives itself (rxm_conn.c:216)")),
            (Rule::Atomics, c("v2.5.0", "prov/rxm/src/rxm_cq.c", "1162", "rxm_do_atomic", "software, at the target's CPU; FI_ATOMIC with FI_ORDER_WAW in the hints: -FI_EINVAL (rxm_init.c:513)")),
            (Rule::MrMode, c("v2.5.0", "prov/verbs/src/verbs_info.c", "85", "verbs_domain_attr", "OFI_MR_BASIC_MAP|FI_MR_LOCAL: virtual addresses, provider keys")),
            (Rule::Inject, c("v2.5.0", "prov/rxm/src/rxm_init.c", "340", "rxm_info_to_rxm", "the QP's max_inline (at most FI_VERBS_INLINE_SIZE, 256) less rxm's 64-byte header")),
        ],
    },
    Profile {
        name: "psm3",
        prov: "psm3",
        fabric: None,
        read_at: "v1.17.0, v2.1.0, v2.5.0",
        advertised: Advertised {
            waw: true,
            max_order_waw: Size::Bytes(4096),
            fence: false,
            dc: true,
            cq_data: 8,
            rx_cq_data: false,
            mr_mode: 0,
            max_msg: Size::Bytes(0xFFFF_F000),
            inject: Size::Bytes(64),
        },
        does: Does {
            write_data: WriteData::Carried,
            dc_on_writes: true,
            split_with_data: None,
            atomics: Atomics::Software,
            unusable: None,
        },
        cites: &[
            (Rule::Order, c("v2.5.0", "prov/psm3/src/psmx3_attr.c", "76", "psmx3_ep_attr", ".max_order_waw_size = PSMX3_RMA_ORDER_SIZE (4096, psmx3.h:129)")),
            (Rule::Order, c("v1.17.0", "prov/psm3/src/psmx3_rma.c", "211-216", "psmx3_am_rma_handler", "with tagged RMA (the 1.17 default, psmx3_init.c:46; off from 2.1) a large write lands when its MQ receive completes, a later small one at once: both must be below the bound")),
            (Rule::Fence, c("v2.5.0", "prov/psm3/src/psmx3_attr.c", "441", "psmx3_init_prov_info", "FI_FENCE not in PSMX3_CAPS: -FI_ENODATA")),
            (Rule::DeliveryComplete, c("v2.5.0", "prov/psm3/src/psmx3_rma.c", "1033", "psmx3_write_generic", "FI_DELIVERY_COMPLETE forces the target's ack on the long path; the short path completes on the target's reply")),
            (Rule::CqData, c("v2.5.0", "prov/psm3/src/psmx3_attr.c", "450-462", "psmx3_init_prov_info", "8 bytes only on the RMA-only instance, offered when the hints ask neither FI_MSG nor FI_TAGGED")),
            (Rule::CqData, c("v2.5.0", "prov/psm3/src/psmx3_rma.c", "139-152", "psmx3_am_rma_handler", "the target writes the entry itself on the last chunk: no receive")),
            (Rule::Atomics, c("v2.5.0", "prov/psm3/src/psmx3_atomic.c", "379", "psmx3_atomic_do_write", "software at the target under a global lock; GPU memory by read-modify-write copies")),
            (Rule::MrMode, c("v2.5.0", "prov/psm3/src/psmx3_mr.c", "317", "psmx3_mr_reg", "mr_mode 0: the remote address is an offset (+ the registration's offset)")),
            (Rule::MaxWrite, c("v2.5.0", "prov/psm3/src/psmx3_attr.c", "72", "psmx3_ep_attr", "0xFFFFF000; written as short AM chunks, the CQ data on the last")),
            (Rule::Inject, c("v2.5.0", "prov/psm3/src/psmx3_init.c", "146", "psmx3_env", "FI_PSM3_INJECT_SIZE, 64 by default")),
        ],
    },
    Profile {
        name: "opx",
        prov: "opx",
        fabric: None,
        read_at: "v1.17.0, v2.1.0, v2.5.0",
        advertised: Advertised {
            waw: false,
            max_order_waw: Size::Any,
            fence: false,
            dc: true,
            cq_data: 4,
            rx_cq_data: false,
            mr_mode: VIRT,
            max_msg: Size::Any,
            inject: Size::Bytes(16),
        },
        does: Does {
            write_data: WriteData::Dropped,
            dc_on_writes: false,
            split_with_data: None,
            atomics: Atomics::Software,
            unusable: Some("it orders no RMA write, has no FI_FENCE, and fi_writemsg ignores FI_DELIVERY_COMPLETE, so nothing can order a signal after its data"),
        },
        cites: &[
            (Rule::Order, c("v2.5.0", "prov/opx/include/rdma/opx/fi_opx.h", "304", "FI_OPX_DEFAULT_MSG_ORDER", "atomic bits only, no FI_ORDER_RMA_WAW; the hints' msg_order is not checked (fi_opx_ep.c:2577)")),
            (Rule::Fence, c("v2.5.0", "prov/opx/src/fi_opx_init.c", "82", "fi_opx_check_info", "FI_FENCE not supported: rejected in caps")),
            (Rule::DeliveryComplete, c("v2.5.0", "prov/opx/src/fi_opx_rma.c", "584", "fi_opx_writemsg_internal", "reads FI_COMPLETION and FI_REMOTE_CQ_DATA only")),
            (Rule::CqData, c("v1.17.0", "prov/opx/src/fi_opx_rma.c", "488-490", "fi_opx_writemsg_internal", "the write is issued with flags 0: FI_REMOTE_CQ_DATA dropped (2.x: carried, 4 bytes, fi_opx_rma.c:584)")),
            (Rule::Atomics, c("v2.5.0", "prov/opx/src/fi_opx_atomic.c", "1716", "fi_opx_atomic_writevalid", "software at the target")),
            (Rule::MrMode, c("v2.5.0", "prov/opx/src/fi_opx_domain.c", "230", "fi_opx_choose_domain", "FI_MR_VIRT_ADDR only when the hints ask for it (ours do)")),
            (Rule::Inject, c("v2.5.0", "prov/opx/include/rdma/opx/fi_opx_hfi1_packet.h", "79", "FI_OPX_HFI1_PACKET_IMM", "16")),
        ],
    },
];

/// The profile of the provider `prov_name` (its core provider) on fabric `fabric`, if the
/// library has read it.
pub(super) fn of(core: &str, fabric: &str) -> Option<&'static Profile> {
    PROFILES
        .iter()
        .find(|p| p.prov == core && p.fabric.is_none_or(|f| f == fabric))
}

/// By its docs/PROVIDERS.md name (tests, the unordered layer).
pub(super) fn named(name: &str) -> Option<&'static Profile> {
    PROFILES.iter().find(|p| p.name == name)
}

#[cfg(test)]
fn size(s: Size) -> String {
    match s {
        Size::Any => "any".into(),
        Size::Device => "the device's".into(),
        Size::Bytes(n) if n >= 1 << 20 && n.is_power_of_two() => format!("{} MiB", n >> 20),
        Size::Bytes(n) => n.to_string(),
    }
}

#[cfg(test)]
fn mr_names(m: u32) -> String {
    let names = [
        (fi::FI_MR_ENDPOINT, "ENDPOINT"),
        (fi::FI_MR_LOCAL, "LOCAL"),
        (fi::FI_MR_VIRT_ADDR, "VIRT_ADDR"),
        (fi::FI_MR_ALLOCATED, "ALLOCATED"),
        (fi::FI_MR_PROV_KEY, "PROV_KEY"),
    ];
    let v: Vec<&str> = names
        .iter()
        .filter(|(b, _)| m & b != 0)
        .map(|(_, n)| *n)
        .collect();
    if v.is_empty() {
        "0 (offsets, requested keys)".into()
    } else {
        v.join(" ")
    }
}

/// docs/PROVIDERS.md's generated part: the table, then each provider's citations.
#[cfg(test)]
pub(super) fn render() -> String {
    let mut s = String::new();
    s += "| provider | read at | write order | FI_FENCE | delivery complete | remote CQ data on writes | split writes | u64 FI_SUM | MR mode | largest write | inject |\n";
    s += "|---|---|---|---|---|---|---|---|---|---|---|\n";
    for p in PROFILES {
        let a = &p.advertised;
        let d = &p.does;
        let order = match (a.waw, a.max_order_waw) {
            (false, _) => "none".to_string(),
            (true, Size::Bytes(n)) => format!("both below {n} bytes"),
            (true, Size::Device) => "both below the port's max_msg_sz".to_string(),
            (true, Size::Any) => "any size".to_string(),
        };
        let dc = match (a.dc, d.dc_on_writes) {
            (true, true) => "yes",
            (true, false) => "advertised, ignored",
            (false, _) => "no",
        };
        let data = match d.write_data {
            WriteData::Carried if a.rx_cq_data => {
                format!("{} bytes, a posted receive each", a.cq_data)
            }
            WriteData::Carried => format!("{} bytes, no receive", a.cq_data),
            WriteData::Refused => format!(
                "refused (-FI_EBADFLAGS; {} bytes are for messages)",
                a.cq_data
            ),
            WriteData::Dropped => "dropped (1.17); 4 bytes from 2.1".to_string(),
        };
        let split = match d.split_with_data {
            Some(n) => format!("at {}, CQ data on every piece", size(Size::Bytes(n))),
            None => "no".to_string(),
        };
        let atomics = match d.atomics {
            Atomics::No => "no",
            Atomics::Software => "software (target CPU)",
            Atomics::Nic => "NIC",
        };
        let name = match d.unusable {
            Some(_) => format!("{} (not used)", p.name),
            None => p.name.to_string(),
        };
        s += &format!(
            "| {name} | {} | {order} | {} | {dc} | {data} | {split} | {atomics} | {} | {} | {} |\n",
            p.read_at,
            if a.fence { "yes" } else { "no" },
            mr_names(a.mr_mode),
            size(a.max_msg),
            size(a.inject),
        );
    }
    for p in PROFILES {
        s += &format!("\n### {}\n\n", p.name);
        if let Some(why) = p.does.unusable {
            s += &format!("Not used unless named: {why}.\n\n");
        }
        for (rule, c) in p.cites {
            s += &format!(
                "- {}: {} (`{}:{}`, `{}`, {})\n",
                rule.name(),
                c.says,
                c.file,
                c.lines,
                c.func,
                c.at
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEGIN: &str = "<!-- generated from src/transport/net/profile.rs: begin -->\n";
    const END: &str = "<!-- generated: end -->";

    /// docs/PROVIDERS.md carries this table as rendered; a change to either without the other
    /// fails here, and the failure prints the text to paste.
    #[test]
    fn providers_md_is_the_table() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/PROVIDERS.md");
        let doc = std::fs::read_to_string(path).unwrap();
        let (Some(b), Some(e)) = (doc.find(BEGIN), doc.find(END)) else {
            panic!("{path} lacks the generated markers");
        };
        let want = render();
        assert!(
            doc[b + BEGIN.len()..e] == want,
            "{path} differs from profile.rs; the generated part should read (between the lines):\n-----8<-----\n{want}-----8<-----"
        );
    }

    #[test]
    fn every_profile_cites_every_rule_it_sets_apart() {
        for p in PROFILES {
            let has = |r: Rule| p.cites.iter().any(|(x, _)| *x == r);
            for r in [
                Rule::Order,
                Rule::Fence,
                Rule::DeliveryComplete,
                Rule::CqData,
                Rule::MrMode,
            ] {
                assert!(has(r), "{}: no citation for {}", p.name, r.name());
            }
            if p.does.split_with_data.is_some() {
                assert!(has(Rule::Split), "{}", p.name);
            }
            for (_, c) in p.cites {
                assert!(
                    c.at.starts_with('v') && c.file.starts_with("prov/")
                        || c.file.starts_with("man/"),
                    "{}: {c:?}",
                    p.name
                );
                assert!(!c.lines.is_empty() && !c.func.is_empty() && !c.says.is_empty());
            }
        }
    }

    #[test]
    fn lookup_tells_the_efa_fabrics_apart() {
        assert_eq!(of("efa", "efa").unwrap().name, "efa (efa-rdm)");
        assert_eq!(of("efa", "efa-direct").unwrap().name, "efa-direct");
        assert_eq!(of("tcp", "127.0.0.0/8").unwrap().name, "tcp");
        assert!(of("sockets", "x").is_none());
        assert!(named("cxi").is_some());
    }
}
