//! Choosing a provider, domain and address, then the strongest ordering / completion semantics
//! that provider grants for it.
//!
//! Two steps. (1) One `fi_getinfo` with the plain requirements (RDM, RMA writes, our mr_mode)
//! lists every candidate; candidates are filtered (explicit provider, domain name, interface)
//! and ranked. (2) For the winner, `fi_getinfo` is asked again, narrowed to that provider,
//! domain and fabric, first with WAW ordering and FI_DELIVERY_COMPLETE requested, then with
//! less, so a provider that rejects a request is still used with the next-best guarantee.

use super::fabric::{core_provider, strdup, InfoList, InfoView};
use super::locality;
use super::order::{self, Asked, Attrs};
use crate::config::NetConfig;
use crate::error::{Error, Result};
use libfabric_sys as fi;

/// The `mr_mode` bits this transport implements (docs/DESIGN.md, 3.3 "IB").
pub(super) const MR_MODE_SUPPORTED: u32 = fi::FI_MR_LOCAL
    | fi::FI_MR_VIRT_ADDR
    | fi::FI_MR_ALLOCATED
    | fi::FI_MR_PROV_KEY
    | fi::FI_MR_ENDPOINT;

/// Providers that work but are too slow or hang-prone for RMA here; used only when named.
const SLOW_PROVIDERS: &[&str] = &["sockets", "udp;ofi_rxd", "udp"];
/// Software providers, in the order we prefer them when nothing names one. Anything not listed
/// here and not slow is taken for a hardware provider (verbs, efa, cxi, opx, psm3...) and wins.
const SOFTWARE_PREFERENCE: &[&str] = &["tcp;ofi_rxm", "tcp", "net", "net;ofi_rxm"];
/// Never chosen by default: utility layers and hooks, and shm (only same-host, has its own
/// transport enum).
const NEVER_DEFAULT: &[&str] = &["shm", "ofi_hook", "ofi_mrail"];

/// What the caller asked for.
#[derive(Clone, Debug)]
pub(super) struct Request<'a> {
    pub domain: Option<&'a str>,
    pub shm: bool,
    pub device: Option<i32>,
}

/// The outcome: one info (owned, `next` = NULL) and the guarantees it comes with.
pub(super) struct Choice {
    pub info: InfoList,
    /// What it granted that bears on ordering (`order::decide` turns it into a plan).
    pub attrs: Attrs,
    pub hmem: bool,
    /// Where the NIC was chosen by locality: the equally near NICs in the order to use them
    /// (the chosen one first), which a striping endpoint opens as further rails. Else empty.
    pub nics: Vec<String>,
}

#[derive(Clone, Copy)]
struct Wanted {
    order: bool,
    dc: bool,
    fence: bool,
    hmem: bool,
}

fn hints(req: &Request<'_>, w: &Wanted) -> Result<InfoList> {
    let mut h = InfoList::alloc()?;
    let i = h.head_mut();
    i.caps = fi::FI_RMA as u64 | fi::FI_WRITE as u64 | fi::FI_REMOTE_WRITE as u64;
    if w.fence {
        i.caps |= fi::FI_FENCE as u64;
    }
    if w.hmem {
        i.caps |= fi::FI_HMEM;
    }
    // Every operation gets a context that starts with an fi_context2 and lives until its
    // completion (see `OpSlot`), which satisfies both modes.
    i.mode = fi::FI_CONTEXT | fi::FI_CONTEXT2;
    // SAFETY: fi_allocinfo allocates every attribute struct; we only write plain fields and
    // malloc'd strings that fi_freeinfo will free.
    unsafe {
        (*i.ep_attr).type_ = fi::FI_EP_RDM;
        let mut mr_mode = MR_MODE_SUPPORTED;
        if w.hmem {
            mr_mode |= fi::FI_MR_HMEM;
        }
        (*i.domain_attr).mr_mode = mr_mode as i32;
        // One proxy thread (or the API thread under the same mutex) uses all objects of the
        // domain at a time: the weakest threading level suffices.
        (*i.domain_attr).threading = fi::FI_THREAD_DOMAIN;
        (*i.domain_attr).av_type = fi::FI_AV_TABLE;
        if w.order {
            (*i.tx_attr).msg_order = fi::FI_ORDER_RMA_WAW | fi::FI_ORDER_WAW as u64;
        }
        if w.dc {
            (*i.tx_attr).op_flags = fi::FI_DELIVERY_COMPLETE as u64;
        }
        if req.shm {
            (*i.fabric_attr).prov_name = strdup("shm")?;
        }
    }
    Ok(h)
}

/// Narrows hints to exactly the chosen candidate.
fn narrow(h: &mut InfoList, c: &fi::fi_info) -> Result<()> {
    let v = InfoView(c);
    let i = h.head_mut();
    i.addr_format = c.addr_format;
    // SAFETY: as in `hints`; previous strings (shm) are freed before being replaced.
    unsafe {
        libc::free((*i.fabric_attr).prov_name.cast());
        (*i.fabric_attr).prov_name = strdup(&v.prov_name())?;
        (*i.fabric_attr).name = strdup(&v.fabric_name())?;
        (*i.domain_attr).name = strdup(&v.domain_name())?;
    }
    Ok(())
}

fn same_candidate(a: &fi::fi_info, b: &fi::fi_info) -> bool {
    let (a, b) = (InfoView(a), InfoView(b));
    a.prov_name() == b.prov_name()
        && a.domain_name() == b.domain_name()
        && a.fabric_name() == b.fabric_name()
        && a.0.addr_format == b.0.addr_format
        && a.src_addr() == b.src_addr()
}

/// True for an IPv4/IPv6 loopback source address.
pub(super) fn is_loopback(addr_format: u32, addr: &[u8]) -> bool {
    match addr_format {
        fi::FI_SOCKADDR_IN if addr.len() >= 8 => addr[4] == 127,
        fi::FI_SOCKADDR_IN6 if addr.len() >= 24 => {
            addr[8..23].iter().all(|&b| b == 0) && addr[23] == 1
        }
        _ => false,
    }
}

fn is_socket_format(f: u32) -> bool {
    f == fi::FI_SOCKADDR_IN || f == fi::FI_SOCKADDR_IN6 || f == fi::FI_SOCKADDR
}

fn matches_any(prov: &str, list: &[&str]) -> bool {
    list.iter()
        .any(|p| prov == *p || core_provider(prov) == *p || prov.starts_with(p))
}

/// Ranking key (lower is better), or None to skip this info.
fn rank(
    v: &InfoView<'_>,
    req: &Request<'_>,
    env: &NetConfig,
    idx: usize,
) -> Option<(u32, u32, u32, usize)> {
    let prov = v.prov_name();
    let first = core_provider(&prov);
    let prov_rank = if req.shm {
        if prov != "shm" {
            return None;
        }
        0
    } else if let Some(names) = &env.providers {
        // Exact names first ("net" over "net;ofi_rxm"), then the core provider of a layering.
        if names.contains(&prov) {
            0
        } else if names.iter().any(|n| n == first) {
            1
        } else {
            return None;
        }
    } else {
        if matches_any(&prov, NEVER_DEFAULT) || SLOW_PROVIDERS.contains(&prov.as_str()) {
            return None;
        }
        match SOFTWARE_PREFERENCE.iter().position(|p| *p == prov) {
            Some(p) => 1 + p as u32,
            None => 0,
        }
    };
    let domain = v.domain_name();
    // A provider this transport cannot plan for (docs/PROVIDERS.md, "not used") only when its
    // fabric is named: opening it then fails with the reason (`order::decide`).
    if let Some(p) = super::profile::of(first, &v.fabric_name()) {
        if p.does.unusable.is_some() && req.domain != Some(v.fabric_name().as_str()) {
            return None;
        }
    }
    if let Some(d) = req.domain {
        if d != domain && d != v.fabric_name() {
            return None;
        }
    }
    if let (Some(iface), false) = (&env.iface, req.shm) {
        if *iface != domain {
            return None;
        }
    }
    // Socket providers: unless something chose the interface, loopback first (see module doc
    // of `net`: safe default for one host; multi-host sets MSCCLPP_NET_IFACE, MSCCLPP_NET_ADDR
    // or ibDev), then IPv4 before IPv6, and link-local IPv6 (needs a scope id) last.
    let fmt = v.0.addr_format;
    let chosen_elsewhere = req.domain.is_some() || env.iface.is_some() || env.addr.is_some();
    let lo = if is_socket_format(fmt) && !chosen_elsewhere {
        u32::from(!is_loopback(fmt, v.src_addr()))
    } else {
        0
    };
    let family = match fmt {
        fi::FI_SOCKADDR_IN => 0,
        fi::FI_SOCKADDR_IN6 if v.fabric_name().starts_with("fe80") => 2,
        fi::FI_SOCKADDR_IN6 => 1,
        _ => 0,
    };
    Some((prov_rank, lo, family, idx))
}

/// Of the equally ranked candidates `top` (indices into `all`), the one on the NIC nearest to
/// this rank's GPU (or, for host memory, its CPU), spread over the node's GPUs
/// (`locality`); None when a domain was named or fewer than two NICs with PCI addresses
/// compete. Also returns the equally near NICs in the order to use them (`Choice::nics`).
fn nearest_nic(
    all: &InfoList,
    top: &[usize],
    req: &Request<'_>,
    env: &NetConfig,
) -> Option<(usize, Vec<String>)> {
    if req.shm || req.domain.is_some() || env.iface.is_some() || env.addr.is_some() {
        return None;
    }
    let infos: Vec<(usize, InfoView<'_>)> = all
        .iter()
        .enumerate()
        .filter(|(k, _)| top.contains(k))
        .map(|(k, i)| (k, InfoView(i)))
        .collect();
    let nics: Vec<locality::Nic> = infos
        .iter()
        .filter_map(|(_, v)| {
            Some(locality::Nic {
                name: v.domain_name(),
                pci: v.nic_pci()?,
            })
        })
        .collect();
    let mut names: Vec<&str> = nics.iter().map(|n| n.name.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    if names.len() < 2 {
        return None;
    }
    let sys = locality::Sysfs::new(&env.sysfs_root);
    let (choice, whose) = match req.device {
        Some(d) => {
            let Some(gpu) =
                crate::cuda::pci_bus_id(d).and_then(|b| b.parse::<locality::Pci>().ok())
            else {
                // Say why the nearest-NIC choice is skipped rather than pass over it silently.
                crate::info!(
                    "net: GPU {d}'s PCI address is unknown (cuDeviceGetPCIBusId): taking the first of the {} equally ranked domains, not the nearest",
                    names.len()
                );
                return None;
            };
            (
                locality::for_gpu(&sys, gpu, &nics)?,
                format!("GPU {d} ({gpu})"),
            )
        }
        None => {
            // SAFETY: no arguments; returns the CPU this thread runs on, or -1.
            let cpu = usize::try_from(unsafe { libc::sched_getcpu() }).ok()?;
            (locality::for_cpu(&sys, cpu, &nics)?, format!("CPU {cpu}"))
        }
    };
    let first = choice.nics.first()?;
    let k = infos.iter().find(|(_, v)| v.domain_name() == *first)?.0;
    crate::info!(
        "net: NIC {first} for {whose}: {}, turn {} of {} among the GPUs (or CPUs) sharing these NICs; in order of use: {} (of {} NICs)",
        choice.near,
        choice.turn.0 + 1,
        choice.turn.1,
        choice.nics.join(", "),
        names.len()
    );
    Some((k, choice.nics))
}

/// "; not used unless named: efa-direct (why)" for the fabrics `all` lists that this
/// transport passes over (`rank`), or nothing.
fn unusable_here(all: &InfoList) -> String {
    let mut seen: Vec<String> = Vec::new();
    for i in all.iter() {
        let v = InfoView(i);
        let p = super::profile::of(core_provider(&v.prov_name()), &v.fabric_name());
        if let Some(why) = p.and_then(|p| p.does.unusable) {
            let s = format!("fabric {} ({why})", v.fabric_name());
            if !seen.contains(&s) {
                seen.push(s);
            }
        }
    }
    match seen.is_empty() {
        true => String::new(),
        false => format!("; not used unless named as ibDev: {}", seen.join(", ")),
    }
}

/// "prov: domain (fabric, fabric), domain (fabric); prov: ..." for error messages.
fn list_domains(all: &InfoList) -> String {
    /// A domain and its fabrics.
    type Dom = (String, Vec<String>);
    // (provider, [(domain, [fabric])]) in the order fi_getinfo listed them.
    let mut provs: Vec<(String, Vec<Dom>)> = Vec::new();
    for i in all.iter() {
        let v = InfoView(i);
        let (p, d, f) = (v.prov_name(), v.domain_name(), v.fabric_name());
        let pi = match provs.iter().position(|x| x.0 == p) {
            Some(k) => k,
            None => {
                provs.push((p, Vec::new()));
                provs.len() - 1
            }
        };
        let doms = &mut provs[pi].1;
        let di = match doms.iter().position(|x| x.0 == d) {
            Some(k) => k,
            None => {
                doms.push((d, Vec::new()));
                doms.len() - 1
            }
        };
        if !doms[di].1.contains(&f) {
            doms[di].1.push(f);
        }
    }
    if provs.is_empty() {
        return "none".into();
    }
    provs
        .iter()
        .map(|(p, doms)| {
            let ds: Vec<String> = doms
                .iter()
                .map(|(d, fs)| format!("{d} ({})", fs.join(", ")))
                .collect();
            format!("{p}: {}", ds.join(", "))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Picks the provider/domain for `req` and the strongest guarantees it grants.
pub(super) fn choose(req: &Request<'_>, env: &NetConfig) -> Result<Choice> {
    let node = if req.shm { None } else { env.addr.as_deref() };
    let flags = if node.is_some() { fi::FI_SOURCE } else { 0 };
    // GPU memory: ask for FI_HMEM first; without it the endpoint still opens, and registering
    // device memory reports that staging is needed (see `NetEndpoint::register`).
    let mut hmem = req.device.is_some();
    let plain = |hmem: bool| Wanted {
        order: false,
        dc: false,
        fence: false,
        hmem,
    };
    // The best-ranked candidate of one query, by index; among equally ranked ones on
    // several NICs, the one nearest to this rank's GPU or CPU.
    let pick = |all: &InfoList| {
        let ranked: Vec<_> = all
            .iter()
            .enumerate()
            .filter_map(|(k, i)| rank(&InfoView(i), req, env, k))
            .collect();
        let best = *ranked.iter().min()?;
        let top: Vec<usize> = ranked
            .iter()
            .filter(|r| (r.0, r.1, r.2) == (best.0, best.1, best.2))
            .map(|r| r.3)
            .collect();
        Some(nearest_nic(all, &top, req, env).unwrap_or((best.3, Vec::new())))
    };
    let mut all = InfoList::query(node, flags, &hints(req, &plain(hmem))?)?;
    let mut best = pick(&all);
    if best.is_none() && hmem {
        // No FI_HMEM provider fits: take one without (GPU buffers then need staging).
        hmem = false;
        all = InfoList::query(node, flags, &hints(req, &plain(false))?)?;
        best = pick(&all);
    }
    let (best, nics) = match best {
        Some((k, nics)) => (all.iter().nth(k), nics),
        None => (None, Vec::new()),
    };
    let Some(cand) = best else {
        let mut what = if req.shm {
            "the shm provider offers no RDM endpoint with RMA writes".to_string()
        } else if let Some(d) = req.domain {
            format!("no libfabric domain or fabric named {d:?}")
        } else if let Some(i) = &env.iface {
            format!("no libfabric domain for interface {i:?} (MSCCLPP_NET_IFACE)")
        } else if env.providers.is_some() {
            "no usable libfabric domain".to_string()
        } else {
            "no suitable libfabric provider (sockets and udp;ofi_rxd are used only when named in MSCCLPP_NET_PROVIDER)".to_string()
        };
        if let (Some(p), false) = (&env.providers, req.shm) {
            what += &format!(
                " for provider {} (MSCCLPP_NET_PROVIDER / FI_PROVIDER)",
                p.join(",")
            );
        }
        if let Some(n) = node {
            what += &format!(" at address {n} (MSCCLPP_NET_ADDR)");
        }
        return Err(Error::invalid_arg(format!(
            "{what}; domains with RDM endpoints and RMA writes here: {}{}",
            list_domains(&all),
            unusable_here(&all)
        )));
    };

    // Step 2: the best guarantees for exactly this candidate. Order of preference: ordered
    // writes with delivery completion, then ordered only, then fence (+dc), then dc alone.
    // FI_FENCE is asked for with ordering only where the ordering is bounded (a fence may
    // cost: cxi turns off PCIe relaxed ordering for RMA when it is requested).
    let tries = [
        (true, true, false),
        (true, false, false),
        (false, true, true),
        (false, false, true),
        (false, true, false),
    ];
    let query = |w: Wanted| -> Result<Option<(InfoList, Attrs)>> {
        let mut h = hints(req, &w)?;
        narrow(&mut h, cand)?;
        let got = InfoList::query(node, flags, &h)?;
        let Some(i) = got.iter().find(|i| same_candidate(i, cand)) else {
            return Ok(None);
        };
        let asked = Asked {
            order: w.order,
            fence: w.fence,
            dc: w.dc,
        };
        Ok(Some((InfoList::dup(i)?, Attrs::from_info(i, asked))))
    };
    for (order, dc, fence) in tries {
        let w = Wanted {
            order,
            dc,
            fence,
            hmem,
        };
        let Some((mut info, mut attrs)) = query(w)? else {
            continue;
        };
        let bounded = order::decide(&attrs).map_or(true, |p| p.ordered_upto != u64::MAX);
        if order && bounded {
            if let Some((i, a)) = query(Wanted { fence: true, ..w })? {
                if a.fence {
                    (info, attrs) = (i, a);
                }
            }
        }
        let hmem = hmem && info.first().is_some_and(|i| i.caps & fi::FI_HMEM != 0);
        return Ok(Choice {
            info,
            attrs,
            hmem,
            nics,
        });
    }
    // Nothing extra granted: the candidate itself (`order::decide` refuses it unless it
    // orders writes unasked, which does not count).
    Ok(Choice {
        info: InfoList::dup(cand)?,
        attrs: Attrs::from_info(cand, Asked::default()),
        hmem: hmem && cand.caps & fi::FI_HMEM != 0,
        nics,
    })
}

/// "[FI_MR_LOCAL, ...]" for logs.
pub(super) fn mr_mode_names(m: u32) -> String {
    let names = [
        (fi::FI_MR_LOCAL, "FI_MR_LOCAL"),
        (fi::FI_MR_VIRT_ADDR, "FI_MR_VIRT_ADDR"),
        (fi::FI_MR_ALLOCATED, "FI_MR_ALLOCATED"),
        (fi::FI_MR_PROV_KEY, "FI_MR_PROV_KEY"),
        (fi::FI_MR_ENDPOINT, "FI_MR_ENDPOINT"),
        (fi::FI_MR_HMEM, "FI_MR_HMEM"),
        (fi::FI_MR_RAW, "FI_MR_RAW"),
        (fi::FI_MR_MMU_NOTIFY, "FI_MR_MMU_NOTIFY"),
        (fi::FI_MR_RMA_EVENT, "FI_MR_RMA_EVENT"),
    ];
    let v: Vec<&str> = names
        .iter()
        .filter(|(b, _)| m & *b != 0)
        .map(|(_, n)| *n)
        .collect();
    format!("[{}]", v.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_detection() {
        // sockaddr_in: family(2) port(2) addr(4) zero(8)
        let mut a = [0u8; 16];
        a[0] = 2;
        a[4] = 127;
        a[7] = 1;
        assert!(is_loopback(fi::FI_SOCKADDR_IN, &a));
        a[4] = 10;
        assert!(!is_loopback(fi::FI_SOCKADDR_IN, &a));
        let mut b = [0u8; 28];
        b[23] = 1;
        assert!(is_loopback(fi::FI_SOCKADDR_IN6, &b));
        assert!(!is_loopback(fi::FI_ADDR_STR, b"fi_shm://1"));
    }

    #[test]
    fn provider_lists() {
        assert!(matches_any("ofi_hook_perf", NEVER_DEFAULT));
        assert!(matches_any("shm", NEVER_DEFAULT));
        assert!(!matches_any("tcp;ofi_rxm", NEVER_DEFAULT));
        assert!(SLOW_PROVIDERS.contains(&"udp;ofi_rxd"));
    }
}
