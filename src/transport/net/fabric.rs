//! Owned libfabric objects and the error helper: the only file of the net transport, with
//! `mr.rs`'s real `FabricOps`, that holds the raw `fid` pointers' lifetimes.

use crate::error::{Error, Result};
use libfabric_sys as fi;
use std::ffi::{c_char, c_void, CStr, CString};
use std::ptr;

/// The libfabric API version we ask for (the oldest we build against).
pub(super) const API_VERSION: u32 = fi::FI_VERSION(1, 17);

/// `-FI_EAGAIN` etc. as the (negative) values the data calls return.
pub(super) const EAGAIN: i64 = -(fi::FI_EAGAIN as i64);
pub(super) const EAVAIL: i64 = -(fi::FI_EAVAIL as i64);
pub(super) const ENOSYS: i64 = -(fi::FI_ENOSYS as i64);
pub(super) const ENODATA: i64 = -(fi::FI_ENODATA as i64);
pub(super) const ETOOSMALL: i64 = -(fi::FI_ETOOSMALL as i64);
pub(super) const EBADFLAGS: i64 = -(fi::FI_EBADFLAGS as i64);

/// `fi_strerror` of a libfabric error code (either sign).
/// The core provider of a provider name: `tcp` of `tcp;ofi_rxm`, the name itself where it has
/// no utility layer. What the provider-specific choices (ordering, FI_HMEM, wedging, progress)
/// are keyed on.
pub(super) fn core_provider(name: &str) -> &str {
    name.split(';').next().unwrap_or(name)
}

pub(super) fn strerror(code: i64) -> String {
    let c = code.unsigned_abs().min(i32::MAX as u64) as i32;
    // SAFETY: fi_strerror returns a pointer to a static, NUL-terminated string for any value.
    let p = unsafe { fi::fi_strerror(c) };
    if p.is_null() {
        return format!("libfabric error {c}");
    }
    // SAFETY: non-null, NUL-terminated, static (see above).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// An `Error::Fabric` for `call` that returned `rc` (kept as returned: negative).
pub(super) fn fab_err(call: impl Into<String>, rc: i64) -> Error {
    Error::Fabric {
        call: call.into(),
        code: rc,
        detail: strerror(rc),
    }
}

/// `Ok` for `rc == 0`, `Error::Fabric` otherwise.
pub(super) fn check(call: &str, rc: i64) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(fab_err(call, rc))
    }
}

/// A C string field of an fi_info, or "" when NULL.
pub(super) fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: libfabric's string attributes are NUL-terminated and live as long as the info.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The index of the slot in `slots` whose address is `ctx`, the context an operation was
/// posted with (each slot begins with its `fi_context2`), or None for any other pointer.
pub(super) fn slot_of<T>(slots: &[T], ctx: *mut c_void) -> Option<usize> {
    let sz = std::mem::size_of::<T>();
    let off = (ctx as usize).wrapping_sub(slots.as_ptr() as usize);
    (off % sz == 0 && off / sz < slots.len()).then_some(off / sz)
}

/// A malloc'd copy of `s`, for fi_info fields that `fi_freeinfo` will `free`.
pub(super) fn strdup(s: &str) -> Result<*mut c_char> {
    let c = CString::new(s).map_err(|_| Error::invalid_arg(format!("{s:?} contains NUL")))?;
    // SAFETY: c is a valid NUL-terminated string; strdup copies it into malloc'd memory.
    let p = unsafe { libc::strdup(c.as_ptr()) };
    if p.is_null() {
        return Err(Error::last_os("strdup"));
    }
    Ok(p)
}

/// An owned `fi_info` list (from `fi_getinfo`, `fi_allocinfo` or `fi_dupinfo`).
pub(super) struct InfoList(*mut fi::fi_info);

impl InfoList {
    /// A fresh hints structure with every attribute allocated.
    pub fn alloc() -> Result<Self> {
        // SAFETY: plain allocation call.
        let p = unsafe { fi::fi_allocinfo() };
        if p.is_null() {
            return Err(Error::internal("fi_allocinfo returned NULL"));
        }
        Ok(InfoList(p))
    }
    /// A copy of one entry (its `next` is NULL in the copy).
    pub fn dup(info: &fi::fi_info) -> Result<Self> {
        // SAFETY: info is a valid fi_info; fi_dupinfo deep-copies that one entry.
        let p = unsafe { fi::fi_dupinfo(info) };
        if p.is_null() {
            return Err(Error::internal("fi_dupinfo returned NULL"));
        }
        Ok(InfoList(p))
    }
    /// `fi_getinfo`; "no match" is an empty list, not an error.
    pub fn query(node: Option<&str>, flags: u64, hints: &InfoList) -> Result<Self> {
        let node_c = node
            .map(CString::new)
            .transpose()
            .map_err(|_| Error::invalid_arg("network address contains NUL"))?;
        let mut out: *mut fi::fi_info = ptr::null_mut();
        // SAFETY: hints is a valid info from fi_allocinfo; node is NULL or NUL-terminated; out
        // receives a list we own (freed in Drop).
        let rc = unsafe {
            fi::fi_getinfo(
                API_VERSION,
                node_c.as_ref().map_or(ptr::null(), |c| c.as_ptr()),
                ptr::null(),
                flags,
                hints.0,
                &mut out,
            )
        } as i64;
        if rc == ENODATA {
            return Ok(InfoList(ptr::null_mut()));
        }
        check("fi_getinfo", rc)?;
        Ok(InfoList(out))
    }
    pub fn as_ptr(&self) -> *mut fi::fi_info {
        self.0
    }
    /// The first entry, if any.
    pub fn first(&self) -> Option<&fi::fi_info> {
        // SAFETY: NULL or a valid fi_info owned by self.
        unsafe { self.0.as_ref() }
    }
    /// Mutable access to the head entry, for filling in hints (an `alloc`ed info, whose
    /// attribute pointers are all non-NULL). Panics on an empty list (a `query` with no match).
    pub fn head_mut(&mut self) -> &mut fi::fi_info {
        // SAFETY: NULL or an info we own exclusively (&mut self).
        unsafe { self.0.as_mut() }.expect("head_mut on an empty fi_info list")
    }
    pub fn iter(&self) -> InfoIter<'_> {
        InfoIter {
            cur: self.0,
            _list: self,
        }
    }
}

impl Drop for InfoList {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: we own the list; freed exactly once.
            unsafe { fi::fi_freeinfo(self.0) };
        }
    }
}

pub(super) struct InfoIter<'a> {
    cur: *mut fi::fi_info,
    _list: &'a InfoList,
}

impl<'a> Iterator for InfoIter<'a> {
    type Item = &'a fi::fi_info;
    fn next(&mut self) -> Option<Self::Item> {
        // SAFETY: every `next` of a list from libfabric is NULL or a valid entry that lives as
        // long as the list, which `_list` borrows.
        let cur = unsafe { self.cur.as_ref() }?;
        self.cur = cur.next;
        Some(cur)
    }
}

/// Read-only views of the attribute structs of a libfabric-produced info (never NULL there).
pub(super) struct InfoView<'a>(pub &'a fi::fi_info);

impl<'a> InfoView<'a> {
    pub fn prov_name(&self) -> String {
        self.opt(self.0.fabric_attr)
            .map_or_else(String::new, |f| cstr(f.prov_name))
    }
    pub fn fabric_name(&self) -> String {
        self.opt(self.0.fabric_attr)
            .map_or_else(String::new, |f| cstr(f.name))
    }
    pub fn domain_name(&self) -> String {
        self.opt(self.0.domain_attr)
            .map_or_else(String::new, |d| cstr(d.name))
    }
    pub fn domain(&self) -> Option<&'a fi::fi_domain_attr> {
        self.opt(self.0.domain_attr)
    }
    pub fn tx(&self) -> Option<&'a fi::fi_tx_attr> {
        self.opt(self.0.tx_attr)
    }
    pub fn ep(&self) -> Option<&'a fi::fi_ep_attr> {
        self.opt(self.0.ep_attr)
    }
    pub fn rx(&self) -> Option<&'a fi::fi_rx_attr> {
        self.opt(self.0.rx_attr)
    }
    fn opt<T>(&self, p: *mut T) -> Option<&'a T> {
        // SAFETY: the attribute pointers of an info are NULL or point into the info's own
        // allocation, which lives as long as 'a.
        unsafe { p.as_ref() }
    }
    /// The PCI address of the NIC behind this info, where the provider reports one.
    pub fn nic_pci(&self) -> Option<super::locality::Pci> {
        let nic = self.opt(self.0.nic)?;
        let bus = self.opt(nic.bus_attr)?;
        if bus.bus_type != fi::FI_BUS_PCI {
            return None;
        }
        // SAFETY: bus_type says the union holds the PCI member.
        let pci = unsafe { bus.attr.pci };
        Some(super::locality::Pci {
            domain: pci.domain_id,
            bus: pci.bus_id,
            dev: pci.device_id,
            func: pci.function_id,
        })
    }
    /// The source address as bytes (empty when absent).
    pub fn src_addr(&self) -> &'a [u8] {
        if self.0.src_addr.is_null() || self.0.src_addrlen == 0 {
            return &[];
        }
        // SAFETY: src_addr points to src_addrlen bytes owned by the info.
        unsafe { std::slice::from_raw_parts(self.0.src_addr as *const u8, self.0.src_addrlen) }
    }
}

/// The fabric, domain, address vector, completion queue and endpoint of one `NetEndpoint`,
/// closed in reverse order of creation. Memory registrations are not here: the endpoint closes
/// them (through `mr::teardown`) before this struct is dropped.
pub(super) struct Objects {
    pub fabric: *mut fi::fid_fabric,
    pub domain: *mut fi::fid_domain,
    pub av: *mut fi::fid_av,
    pub cq: *mut fi::fid_cq,
    pub ep: *mut fi::fid_ep,
}

impl Objects {
    /// Opens everything for `info` and enables the endpoint. `cq_size` entries in the CQ.
    pub fn open(info: &InfoList, cq_size: usize) -> Result<Self> {
        let mut o = Objects {
            fabric: ptr::null_mut(),
            domain: ptr::null_mut(),
            av: ptr::null_mut(),
            cq: ptr::null_mut(),
            ep: ptr::null_mut(),
        };
        let i = info.as_ptr();
        // Each step stores into `o` right away, so an early `?` closes what exists (Drop).
        // SAFETY: (all calls below): `i` is a valid info with non-NULL attributes; out-pointers
        // are fields of `o`; attribute structs are zero-initialised then filled.
        // SAFETY: as for the unsafe code just above.
        unsafe {
            check(
                "fi_fabric",
                fi::fi_fabric((*i).fabric_attr, &mut o.fabric, ptr::null_mut()) as i64,
            )?;
            check(
                "fi_domain",
                fi::fi_domain(o.fabric, i, &mut o.domain, ptr::null_mut()) as i64,
            )?;
            let mut av_attr = fi::fi_av_attr {
                type_: fi::FI_AV_TABLE,
                count: 16,
                ..Default::default()
            };
            check(
                "fi_av_open",
                fi::fi_av_open(o.domain, &mut av_attr, &mut o.av, ptr::null_mut()) as i64,
            )?;
            let mut cq_attr = fi::fi_cq_attr {
                size: cq_size,
                // DATA: peers' writes may carry a signal in remote CQ data (`signals.rs`).
                format: fi::FI_CQ_FORMAT_DATA,
                // We poll from the proxy loop; no wait object needed.
                wait_obj: fi::FI_WAIT_NONE,
                ..Default::default()
            };
            check(
                "fi_cq_open",
                fi::fi_cq_open(o.domain, &mut cq_attr, &mut o.cq, ptr::null_mut()) as i64,
            )?;
            check(
                "fi_endpoint",
                fi::fi_endpoint(o.domain, i, &mut o.ep, ptr::null_mut()) as i64,
            )?;
            check(
                "fi_ep_bind(av)",
                fi::fi_ep_bind(o.ep, &mut (*o.av).fid, 0) as i64,
            )?;
            // FI_RECV too: some providers drive their receive side (which carries the peer's
            // incoming RMA) only through a CQ bound for receives.
            check(
                "fi_ep_bind(cq)",
                fi::fi_ep_bind(
                    o.ep,
                    &mut (*o.cq).fid,
                    (fi::FI_TRANSMIT | fi::FI_RECV) as u64,
                ) as i64,
            )?;
            check("fi_enable", fi::fi_enable(o.ep) as i64)?;
        }
        Ok(o)
    }

    /// Inserts one address of this provider's format (`raw`: a peer's, or the endpoint's own
    /// name) into the address vector; `who` names it in the error.
    pub fn av_insert(&self, raw: &[u8], who: &str) -> Result<fi::fi_addr_t> {
        let mut addr: fi::fi_addr_t = fi::FI_ADDR_NOTAVAIL;
        // SAFETY: av is open; the caller checked that raw holds one address of this provider's
        // format; addr receives the handle. Synchronous insert (no flags, no context).
        let rc = unsafe {
            fi::fi_av_insert(
                self.av,
                raw.as_ptr().cast(),
                1,
                &mut addr,
                0,
                ptr::null_mut(),
            )
        } as i64;
        if rc != 1 {
            return Err(fab_err(
                format!("fi_av_insert for {who}"),
                if rc < 0 { rc } else { -(fi::FI_EINVAL as i64) },
            ));
        }
        Ok(addr)
    }

    /// The endpoint's own address (`fi_getname`).
    pub fn name(&self) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; 128];
        for _ in 0..2 {
            let mut len = buf.len();
            // SAFETY: ep is open; buf is writable for len bytes; len is updated by the call.
            let rc = unsafe {
                fi::fi_getname(
                    &mut (*self.ep).fid,
                    buf.as_mut_ptr().cast::<c_void>(),
                    &mut len,
                )
            } as i64;
            if rc == ETOOSMALL && len > buf.len() && len <= 4096 {
                buf.resize(len, 0);
                continue;
            }
            check("fi_getname", rc)?;
            buf.truncate(len);
            return Ok(buf);
        }
        Err(Error::internal("fi_getname: address size kept changing"))
    }
}

/// Closes one fid, logging (not failing) on error: used on teardown paths.
pub(super) fn close_fid(what: &str, f: *mut fi::fid) {
    if f.is_null() {
        return;
    }
    // SAFETY: f is an open fid owned by the caller, closed exactly once.
    let rc = unsafe { fi::fi_close(f) } as i64;
    if rc != 0 {
        crate::warn!("net: closing the {what} failed: {} ({rc})", strerror(rc));
    }
}

impl Drop for Objects {
    fn drop(&mut self) {
        // Reverse order of creation: an endpoint before the CQ and AV it is bound to, all
        // before their domain, the domain before the fabric.
        // SAFETY: (field projections): each pointer is NULL or an open object we own.
        unsafe {
            if !self.ep.is_null() {
                close_fid("endpoint", &mut (*self.ep).fid);
            }
            if !self.cq.is_null() {
                close_fid("completion queue", &mut (*self.cq).fid);
            }
            if !self.av.is_null() {
                close_fid("address vector", &mut (*self.av).fid);
            }
            if !self.domain.is_null() {
                close_fid("domain", &mut (*self.domain).fid);
            }
            if !self.fabric.is_null() {
                close_fid("fabric", &mut (*self.fabric).fid);
            }
        }
    }
}
