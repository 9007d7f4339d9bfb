//! Memory registration: the lifecycle code (register, FI_MR_ENDPOINT bind + enable, key and
//! descriptor read afterwards, close before the endpoint), written once over a small trait so
//! that it runs against libfabric and against a mock that enforces cxi's rules.
//!
//! Why a trait: no provider on CI machines uses FI_MR_ENDPOINT (only cxi and opx do), so the
//! real sequence can only be partly exercised there (tcp/shm answer `fi_mr_bind` with
//! -FI_ENOSYS, accepted only under `MSCCLPP_TEST_FORCE_MR_ENDPOINT=1`). The mock checks what
//! cxi checks: an MR is unusable (no key, no descriptor, no I/O) until bound and enabled, and
//! an endpoint with MRs still bound to it cannot be closed.

use super::fabric::{check, close_fid, fab_err, ENOSYS};
use crate::error::{Error, Result};
use crate::transport::slots::Slots;
use libfabric_sys as fi;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Requested keys must be unique per domain (tcp answers -FI_ENOKEY otherwise). A process-wide
/// counter is unique for every domain of the process. Relaxed: only uniqueness matters.
static NEXT_KEY: AtomicU64 = AtomicU64::new(1);

/// A fresh requested key that fits in `key_size` bytes.
pub(super) fn next_key(key_size: usize) -> Result<u64> {
    let k = NEXT_KEY.fetch_add(1, Ordering::Relaxed);
    if key_size < 8 && k >> (8 * key_size) != 0 {
        return Err(Error::internal(format!(
            "memory-registration keys exhausted: key {k} does not fit the provider's {key_size}-byte keys"
        )));
    }
    Ok(k)
}

/// How the provider wants memory registered (from `domain_attr->mr_mode`, plus the test switch).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Policy {
    /// FI_MR_ENDPOINT: bind each MR to the endpoint and enable it before use.
    pub endpoint: bool,
    /// `MSCCLPP_TEST_FORCE_MR_ENDPOINT=1` on a provider that did not select FI_MR_ENDPOINT: run
    /// the sequence and accept -FI_ENOSYS from bind/enable.
    pub forced: bool,
    /// FI_MR_PROV_KEY: the provider picks keys; otherwise we request unique ones.
    pub prov_key: bool,
    /// FI_MR_VIRT_ADDR: remote addresses are virtual addresses; otherwise offsets into the MR.
    pub virt_addr: bool,
    /// `domain_attr->mr_key_size`.
    pub key_size: usize,
}

/// One registration request.
#[derive(Clone, Copy, Debug)]
pub(super) struct Request {
    pub addr: u64,
    pub len: u64,
    pub access: u64,
    /// Ignored under FI_MR_PROV_KEY.
    pub requested_key: u64,
    /// Some(ordinal): CUDA device memory (FI_HMEM_CUDA).
    pub cuda_device: Option<i32>,
}

/// A usable local registration.
#[derive(Debug)]
pub(super) struct LocalMr<H> {
    pub handle: H,
    pub addr: u64,
    pub key: u64,
    pub desc: *mut c_void,
}

/// The few MR (and endpoint-teardown) operations the lifecycle needs.
pub(super) trait FabricOps {
    type Handle: Copy + std::fmt::Debug;
    fn reg(&mut self, r: &Request) -> Result<Self::Handle>;
    fn bind_ep(&mut self, h: Self::Handle) -> Result<()>;
    fn enable(&mut self, h: Self::Handle) -> Result<()>;
    fn key(&mut self, h: Self::Handle) -> Result<u64>;
    fn desc(&mut self, h: Self::Handle) -> Result<*mut c_void>;
    fn close_mr(&mut self, h: Self::Handle) -> Result<()>;
    fn close_ep(&mut self) -> Result<()>;
}

fn is_enosys(e: &Error) -> bool {
    matches!(e, Error::Fabric { code, .. } if *code == ENOSYS)
}

/// Passes `r` through, except -FI_ENOSYS under the test switch (tcp/shm have no endpoint MRs).
fn tolerate(pol: &Policy, step: &str, r: Result<()>) -> Result<()> {
    match r {
        Err(e) if pol.forced && is_enosys(&e) => {
            crate::trace!("net: {step} -> -FI_ENOSYS accepted (MSCCLPP_TEST_FORCE_MR_ENDPOINT)");
            Ok(())
        }
        r => r,
    }
}

/// Registers one region following `pol`; on any failure the half-made MR is closed.
pub(super) fn register<O: FabricOps>(
    ops: &mut O,
    pol: &Policy,
    r: &Request,
) -> Result<LocalMr<O::Handle>> {
    let h = ops.reg(r)?;
    let rest = (|| {
        if pol.endpoint {
            // cxi/opx: an MR is created disabled; it becomes usable once bound to the endpoint
            // that will use it and enabled. Key and descriptor are valid only afterwards.
            tolerate(pol, "fi_mr_bind", ops.bind_ep(h))?;
            tolerate(pol, "fi_mr_enable", ops.enable(h))?;
        }
        let key = ops.key(h)?;
        if pol.key_size < 8 && pol.key_size > 0 && key >> (8 * pol.key_size) != 0 {
            return Err(Error::internal(format!(
                "provider returned key {key:#x} wider than its {}-byte key size",
                pol.key_size
            )));
        }
        Ok((key, ops.desc(h)?))
    })();
    match rest {
        Ok((key, desc)) => Ok(LocalMr {
            handle: h,
            addr: r.addr,
            key,
            desc,
        }),
        Err(e) => {
            if let Err(e2) = ops.close_mr(h) {
                crate::warn!("net: closing a failed registration: {e2}");
            }
            Err(e)
        }
    }
}

/// The registrations of one endpoint: its fixed ones (op slots, scratch word), the regions it
/// exports, bounce slots, and the sources of registered writes, which `close` releases after
/// their call (a released index is reused, so the table never grows past what is open at
/// once). Every entry left is closed by `teardown`.
pub(super) struct Table<H> {
    mrs: Slots<LocalMr<H>>,
}

impl<H> Table<H> {
    pub fn new() -> Self {
        Table {
            mrs: Slots::default(),
        }
    }

    /// Keeps `m` until `close` or `teardown`; returns its index.
    pub fn insert(&mut self, m: LocalMr<H>) -> usize {
        self.mrs.insert(m)
    }

    /// The registrations open now.
    #[cfg(test)]
    pub fn open(&self) -> usize {
        self.mrs.held()
    }
}

/// An index the table handed out and has not closed: indexing a closed one is a bug in the
/// caller (its region was released while still in use), not a recoverable error.
impl<H> std::ops::Index<usize> for Table<H> {
    type Output = LocalMr<H>;
    fn index(&self, i: usize) -> &LocalMr<H> {
        self.mrs
            .get(i)
            .unwrap_or_else(|| panic!("memory registration {i} used after it was closed"))
    }
}

/// Closes registration `i` of `t`, whose memory no write in flight reads any more. Its index is
/// reused even when the provider fails the close (the MR is then lost either way; the failure
/// is returned).
pub(super) fn close<O: FabricOps>(ops: &mut O, t: &mut Table<O::Handle>, i: usize) -> Result<()> {
    let m = t
        .mrs
        .remove(i)
        .ok_or_else(|| Error::internal(format!("closing memory registration {i}, not open")))?;
    ops.close_mr(m.handle)
}

/// Closes every registration, then the endpoint: FI_MR_ENDPOINT providers refuse to close an
/// endpoint that still has MRs bound to it, and domain MRs may go first too. Failures are
/// logged; the first one is returned after everything was attempted.
pub(super) fn teardown<O: FabricOps>(ops: &mut O, t: &mut Table<O::Handle>) -> Result<()> {
    let mut first: Option<Error> = None;
    for m in t.mrs.drain() {
        if let Err(e) = ops.close_mr(m.handle) {
            crate::warn!("net: closing a memory registration: {e}");
            first.get_or_insert(e);
        }
    }
    if let Err(e) = ops.close_ep() {
        crate::warn!("net: closing the endpoint: {e}");
        first.get_or_insert(e);
    }
    first.map_or(Ok(()), Err)
}

/// libfabric registrations open now in this process (`RealOps`): a registration that is
/// never closed shows here. For tests (`tests/e2e_host.rs`) and leak checks.
pub fn live_registrations() -> usize {
    LIVE.load(Ordering::Relaxed)
}

/// See `live_registrations`. Relaxed: a count read by tests after the calls that change it
/// returned on the same thread, or after a barrier with the thread that made them.
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// `FabricOps` over real libfabric objects.
pub(super) struct RealOps<'a> {
    pub domain: *mut fi::fid_domain,
    pub ep: &'a mut *mut fi::fid_ep,
}

impl FabricOps for RealOps<'_> {
    type Handle = *mut fi::fid_mr;

    fn reg(&mut self, r: &Request) -> Result<Self::Handle> {
        let iov = libc::iovec {
            iov_base: r.addr as *mut c_void,
            iov_len: r.len as usize,
        };
        let mut attr = fi::fi_mr_attr {
            iov_count: 1,
            access: r.access,
            offset: 0,
            requested_key: r.requested_key,
            iface: fi::FI_HMEM_SYSTEM,
            ..Default::default()
        };
        fi::mr_attr_set_iov(&mut attr, (&iov as *const libc::iovec).cast());
        if let Some(d) = r.cuda_device {
            attr.iface = fi::FI_HMEM_CUDA;
            attr.device.cuda = d;
        }
        let mut mr: *mut fi::fid_mr = std::ptr::null_mut();
        // SAFETY: domain is open; attr and the iovec it points to outlive the call (the
        // provider copies them); mr receives a new object we own.
        let rc = unsafe { fi::fi_mr_regattr(self.domain, &attr, 0, &mut mr) } as i64;
        check("fi_mr_regattr", rc)?;
        LIVE.fetch_add(1, Ordering::Relaxed);
        Ok(mr)
    }
    fn bind_ep(&mut self, h: Self::Handle) -> Result<()> {
        // SAFETY: h is an open MR, *self.ep an open endpoint of the same domain.
        let rc = unsafe { fi::fi_mr_bind(h, &mut (**self.ep).fid, 0) } as i64;
        check("fi_mr_bind(endpoint)", rc)
    }
    fn enable(&mut self, h: Self::Handle) -> Result<()> {
        // SAFETY: h is an open MR.
        let rc = unsafe { fi::fi_mr_enable(h) } as i64;
        check("fi_mr_enable", rc)
    }
    fn key(&mut self, h: Self::Handle) -> Result<u64> {
        // SAFETY: h is an open MR.
        let k = unsafe { fi::fi_mr_key(h) };
        if k == fi::FI_KEY_NOTAVAIL {
            return Err(fab_err(
                "fi_mr_key (key not available)",
                -(fi::FI_EINVAL as i64),
            ));
        }
        Ok(k)
    }
    fn desc(&mut self, h: Self::Handle) -> Result<*mut c_void> {
        // SAFETY: h is an open MR; the descriptor lives as long as the MR.
        Ok(unsafe { fi::fi_mr_desc(h) })
    }
    fn close_mr(&mut self, h: Self::Handle) -> Result<()> {
        // SAFETY: h is an open MR we own, closed once (the table forgets it).
        let rc = unsafe { fi::fi_close(&mut (*h).fid) } as i64;
        // Counted closed even when the provider fails the close: nothing can close it again.
        LIVE.fetch_sub(1, Ordering::Relaxed);
        check("fi_close(mr)", rc)
    }
    fn close_ep(&mut self) -> Result<()> {
        if !self.ep.is_null() {
            // SAFETY: the endpoint is open and owned by `Objects`; nulled so it is not closed
            // again by `Objects::drop`.
            close_fid("endpoint", unsafe { &mut (**self.ep).fid });
            *self.ep = std::ptr::null_mut();
        }
        Ok(())
    }
}

#[cfg(test)]
pub(super) mod mock {
    //! A fabric that enforces cxi's FI_MR_ENDPOINT rules, as its source has them (v2.5.0,
    //! `prov/cxi/src/cxip_mr.c`): an MR is enabled only once bound (`cxip_mr_control`,
    //! 1607-1611), its provider key is FI_KEY_NOTAVAIL until enabled (1659), and no I/O goes
    //! through it before; binding needs an enabled endpoint (`cxip_mr_bind`, 1560), which
    //! `fabric::Objects::open` gives every MR by enabling the endpoint first.
    use super::*;

    #[derive(Debug, Default)]
    pub struct MockMr {
        pub bound: bool,
        pub enabled: bool,
        pub key: u64,
        pub open: bool,
    }

    #[derive(Debug, Default)]
    pub struct MockFabric {
        pub mrs: Vec<MockMr>,
        pub ep_open: bool,
        /// Whether this fabric requires FI_MR_ENDPOINT (cxi) or not.
        pub endpoint_mode: bool,
        pub prov_key: bool,
        pub next_prov_key: u64,
    }

    fn einval(what: &str) -> Error {
        fab_err(format!("mock: {what}"), -(fi::FI_EINVAL as i64))
    }

    impl MockFabric {
        pub fn cxi() -> Self {
            MockFabric {
                ep_open: true,
                endpoint_mode: true,
                prov_key: true,
                next_prov_key: 0x100,
                ..Default::default()
            }
        }
        /// An I/O through `h` (what fi_write with its descriptor would do).
        pub fn use_mr(&self, h: usize) -> Result<()> {
            let m = self
                .mrs
                .get(h)
                .filter(|m| m.open)
                .ok_or_else(|| einval("I/O on a closed MR"))?;
            if self.endpoint_mode && !(m.bound && m.enabled) {
                return Err(einval("I/O on an MR that is not bound and enabled"));
            }
            Ok(())
        }
        fn get(&mut self, h: usize) -> Result<&mut MockMr> {
            self.mrs
                .get_mut(h)
                .filter(|m| m.open)
                .ok_or_else(|| einval("unknown or closed MR"))
        }
    }

    impl FabricOps for MockFabric {
        type Handle = usize;
        fn reg(&mut self, r: &Request) -> Result<usize> {
            if r.len == 0 || r.addr == 0 {
                return Err(einval("empty registration"));
            }
            let key = if self.prov_key {
                self.next_prov_key += 1;
                self.next_prov_key
            } else {
                if self.mrs.iter().any(|m| m.open && m.key == r.requested_key) {
                    return Err(fab_err("mock: fi_mr_regattr", -(fi::FI_ENOKEY as i64)));
                }
                r.requested_key
            };
            self.mrs.push(MockMr {
                key,
                open: true,
                // Domain-scoped providers enable at registration.
                enabled: !self.endpoint_mode,
                bound: false,
            });
            Ok(self.mrs.len() - 1)
        }
        fn bind_ep(&mut self, h: usize) -> Result<()> {
            if !self.endpoint_mode {
                return Err(fab_err("mock: fi_mr_bind", ENOSYS));
            }
            let ep_open = self.ep_open;
            let m = self.get(h)?;
            if !ep_open || m.bound || m.enabled {
                return Err(einval(
                    "fi_mr_bind: endpoint closed, MR already bound or enabled",
                ));
            }
            m.bound = true;
            Ok(())
        }
        fn enable(&mut self, h: usize) -> Result<()> {
            if !self.endpoint_mode {
                return Err(fab_err("mock: fi_mr_enable", ENOSYS));
            }
            let m = self.get(h)?;
            if !m.bound {
                return Err(einval("fi_mr_enable before fi_mr_bind"));
            }
            m.enabled = true;
            Ok(())
        }
        fn key(&mut self, h: usize) -> Result<u64> {
            let m = self.get(h)?;
            if !m.enabled {
                return Err(einval(
                    "fi_mr_key before the MR is enabled (FI_KEY_NOTAVAIL)",
                ));
            }
            Ok(m.key)
        }
        fn desc(&mut self, h: usize) -> Result<*mut c_void> {
            let m = self.get(h)?;
            if !m.enabled {
                return Err(einval("fi_mr_desc before the MR is enabled"));
            }
            Ok((h + 1) as *mut c_void)
        }
        fn close_mr(&mut self, h: usize) -> Result<()> {
            self.get(h)?.open = false;
            Ok(())
        }
        fn close_ep(&mut self) -> Result<()> {
            if self.mrs.iter().any(|m| m.open && m.bound) {
                return Err(fab_err(
                    "mock: fi_close(endpoint) with MRs still bound",
                    -(fi::FI_EBUSY as i64),
                ));
            }
            self.ep_open = false;
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::mock::MockFabric;
    use super::*;

    fn req(addr: u64, key: u64) -> Request {
        Request {
            addr,
            len: 64,
            access: (fi::FI_WRITE | fi::FI_REMOTE_WRITE) as u64,
            requested_key: key,
            cuda_device: None,
        }
    }

    fn cxi_policy() -> Policy {
        Policy {
            endpoint: true,
            forced: false,
            prov_key: true,
            virt_addr: true,
            key_size: 8,
        }
    }

    #[test]
    fn endpoint_mr_lifecycle_on_cxi_rules() {
        let mut f = MockFabric::cxi();
        let mut t: Table<usize> = Table::new();
        for a in [0x1000u64, 0x2000, 0x3000] {
            let m = register(&mut f, &cxi_policy(), &req(a, 0)).unwrap();
            f.use_mr(m.handle).unwrap();
            assert!(!m.desc.is_null());
            t.insert(m);
        }
        // The endpoint cannot be closed while MRs are bound to it...
        assert!(f.close_ep().is_err());
        f.ep_open = true;
        // ...and teardown closes them first.
        teardown(&mut f, &mut t).unwrap();
        assert!(!f.ep_open);
        assert!(f.mrs.iter().all(|m| !m.open));
    }

    #[test]
    fn closed_registrations_free_their_index() {
        let mut f = MockFabric::cxi();
        let mut t: Table<usize> = Table::new();
        let reg = |f: &mut MockFabric, t: &mut Table<usize>, a| {
            t.insert(register(f, &cxi_policy(), &req(a, 0)).unwrap())
        };
        let (a, b) = (reg(&mut f, &mut t, 0x1000), reg(&mut f, &mut t, 0x2000));
        // A source registered and released per call: the table stays at its size.
        for i in 0..100u64 {
            let s = reg(&mut f, &mut t, 0x10_0000 + i * 0x1000);
            assert_eq!(s, 2, "a released index is reused");
            close(&mut f, &mut t, s).unwrap();
            assert_eq!(t.open(), 2);
        }
        assert_eq!(f.mrs.iter().filter(|m| m.open).count(), 2);
        assert!(
            close(&mut f, &mut t, 2).is_err(),
            "closing twice is refused"
        );
        close(&mut f, &mut t, a).unwrap();
        assert_eq!(t[b].addr, 0x2000);
        assert!(f.close_ep().is_err(), "b is still bound");
        f.ep_open = true;
        teardown(&mut f, &mut t).unwrap();
        assert!(f.mrs.iter().all(|m| !m.open));
    }

    #[test]
    fn skipping_bind_leaves_mr_unusable() {
        let mut f = MockFabric::cxi();
        let pol = Policy {
            endpoint: false,
            ..cxi_policy()
        };
        // Without the bind/enable steps the key is unavailable: registration fails and the
        // half-made MR is closed, not leaked.
        let e = register(&mut f, &pol, &req(0x1000, 0)).unwrap_err();
        assert!(e.to_string().contains("not enabled") || e.to_string().contains("enabled"));
        assert!(f.mrs.iter().all(|m| !m.open));
        // A raw registration without bind+enable is refused for I/O.
        let h = f.reg(&req(0x2000, 0)).unwrap();
        assert!(f.use_mr(h).is_err());
    }

    #[test]
    fn forced_mode_accepts_enosys_only_when_forced() {
        // A domain-scoped provider (tcp/shm) answers bind/enable with -FI_ENOSYS.
        let mut f = MockFabric {
            ep_open: true,
            ..Default::default()
        };
        let mut pol = Policy {
            endpoint: true,
            forced: true,
            prov_key: false,
            virt_addr: false,
            key_size: 8,
        };
        let m = register(&mut f, &pol, &req(0x1000, next_key(8).unwrap())).unwrap();
        f.use_mr(m.handle).unwrap();
        pol.forced = false;
        let e = register(&mut f, &pol, &req(0x2000, next_key(8).unwrap())).unwrap_err();
        assert!(is_enosys(&e), "{e}");
        assert!(!f.mrs[1].open, "failed registration must be closed");
    }

    #[test]
    fn requested_keys_unique() {
        let mut f = MockFabric {
            ep_open: true,
            ..Default::default()
        };
        let pol = Policy {
            key_size: 8,
            ..Default::default()
        };
        register(&mut f, &pol, &req(0x1000, 7)).unwrap();
        assert!(register(&mut f, &pol, &req(0x2000, 7)).is_err());
        let (a, b) = (next_key(8).unwrap(), next_key(8).unwrap());
        assert_ne!(a, b);
        assert!(next_key(1).is_ok() || NEXT_KEY.load(Ordering::Relaxed) > 255);
    }
}
