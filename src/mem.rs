//! Memory this library allocates for itself (FIFOs, epoch counters, staging), and the kinds of
//! memory (`MemKind`, `Region`) the layers above talk about.

use crate::error::{Error, Result};
use std::alloc::{alloc_zeroed, dealloc, Layout};

/// Where a buffer lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemKind {
    Host,
    /// CUDA device memory of this device ordinal.
    Device(i32),
}

/// A local memory range, as the user (or this library) gave it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Region {
    pub addr: u64,
    pub len: u64,
    pub kind: MemKind,
}

/// Zeroed, aligned host memory, freed on drop. Other threads (and, through registration, remote
/// peers) may write it; Rust code touches it only through raw pointers and atomics.
pub struct HostBlock {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: a HostBlock is only an owned allocation; all access goes through raw pointers whose
// users document their own synchronisation.
unsafe impl Send for HostBlock {}
// SAFETY: as for the unsafe code just above.
unsafe impl Sync for HostBlock {}

impl HostBlock {
    pub fn zeroed(len: usize, align: usize) -> Result<Self> {
        let layout = Layout::from_size_align(len.max(1), align)
            .map_err(|e| Error::internal(format!("bad layout {len}/{align}: {e}")))?;
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::sys(
                format!("allocating {len} bytes"),
                std::io::Error::from(std::io::ErrorKind::OutOfMemory),
            ));
        }
        Ok(HostBlock { ptr, layout })
    }
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.layout.size()
    }
    pub fn is_empty(&self) -> bool {
        self.layout.size() == 0
    }
}

impl Drop for HostBlock {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout, freed once.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

/// Zeroed host memory in a POSIX shared-memory object, so that another process of this host
/// can map it by name ([`SharedBlock::open`]). The SHM transport keeps each connection's epoch
/// block in one: a peer then stores a signal straight into it, without entering libfabric
/// (`direct_flag`, proxy/conn.rs).
///
/// Names are `/mscclpp-epoch-<pid>-<n>`; the creator unlinks the name once the peer has mapped
/// it (end of connection setup) or on drop, so a crash leaves at most the objects of
/// unfinished setups behind.
pub struct SharedBlock {
    ptr: *mut u8,
    len: usize,
    name: String,
    /// Created here (unlinked by us) rather than opened.
    owner: bool,
    /// Relaxed: only `unlink` (any thread) reads and sets it; the name's removal is its own.
    unlinked: std::sync::atomic::AtomicBool,
}

// SAFETY: as for HostBlock: an owned mapping, touched only through raw pointers and atomics.
unsafe impl Send for SharedBlock {}
// SAFETY: as for the unsafe code just above.
unsafe impl Sync for SharedBlock {}

/// The prefix of every name `SharedBlock` creates; `open` accepts no other.
pub const SHARED_PREFIX: &str = "/mscclpp-epoch-";

/// The number in the next name `SharedBlock::create` makes (`<prefix><pid>-<n>`).
static NEXT_NAME: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl SharedBlock {
    /// A new object of `len` bytes (rounded up to a page), zeroed.
    pub fn create(len: usize) -> Result<Self> {
        let n = NEXT_NAME.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("{SHARED_PREFIX}{}-{n}", std::process::id());
        let len = len.max(1).next_multiple_of(4096);
        let cname = std::ffi::CString::new(name.clone()).expect("no NUL in the name");
        let open = || {
            // SAFETY: valid NUL-terminated name; O_EXCL: never another process's object.
            unsafe {
                libc::shm_open(
                    cname.as_ptr(),
                    libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                    0o600,
                )
            }
        };
        let mut fd = open();
        if fd < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EEXIST) {
            // Only this process makes names with its pid, and never the same one twice: the
            // object is a leftover of a dead process that had this pid (killed during a
            // setup). Refusing it failed whole runs once pids wrapped around.
            // SAFETY: valid NUL-terminated name.
            unsafe { libc::shm_unlink(cname.as_ptr()) };
            crate::info!("removed /dev/shm{name}, left by a dead process that had this pid");
            fd = open();
        }
        if fd < 0 {
            return Err(Error::sys(
                format!("shm_open({name})"),
                std::io::Error::last_os_error(),
            ));
        }
        // From here on the name exists: a failure unlinks it (Drop of the half-made block).
        let mut b = SharedBlock {
            ptr: std::ptr::null_mut(),
            len,
            name,
            owner: true,
            unlinked: std::sync::atomic::AtomicBool::new(false),
        };
        // SAFETY: fd is ours; ftruncate zero-fills the new object. posix_fallocate reserves its
        // pages now: a full /dev/shm (a container's 64 MiB) is then this error at setup rather
        // than a SIGBUS at the first store into a page that cannot be had.
        let r = unsafe { libc::ftruncate(fd, len as libc::off_t) };
        let r = if r != 0 {
            Err(std::io::Error::last_os_error())
        } else {
            // SAFETY: as above; returns an errno instead of setting errno.
            match unsafe { libc::posix_fallocate(fd, 0, len as libc::off_t) } {
                0 => map(fd, len),
                e => Err(std::io::Error::from_raw_os_error(e)),
            }
        };
        // SAFETY: fd is ours, closed once (the mapping stays).
        unsafe { libc::close(fd) };
        b.ptr = r.map_err(|e| {
            Error::sys(
                format!("sizing ({len} bytes, in /dev/shm) and mapping {}", b.name),
                e,
            )
        })?;
        Ok(b)
    }

    /// Maps the object another process of this host created with [`SharedBlock::create`].
    /// Only names of that form, and only an object whose size is one of `lens` (each rounded to
    /// a page, as `create` rounds).
    pub fn open(name: &str, lens: &[usize]) -> Result<Self> {
        let lens: Vec<usize> = lens
            .iter()
            .map(|l| l.max(&1).next_multiple_of(4096))
            .collect();
        let rest = name.strip_prefix(SHARED_PREFIX).unwrap_or("");
        if rest.is_empty()
            || name.len() > 64
            || !rest.bytes().all(|b| b.is_ascii_digit() || b == b'-')
        {
            return Err(Error::remote(format!(
                "shared-memory name {name:?} is not one this library creates"
            )));
        }
        let cname = std::ffi::CString::new(name).expect("checked: digits and dashes");
        // SAFETY: valid NUL-terminated name; no O_CREAT: only an existing object.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_RDWR, 0) };
        if fd < 0 {
            return Err(Error::sys(
                format!("shm_open({name})"),
                std::io::Error::last_os_error(),
            ));
        }
        let r = (|| {
            // SAFETY: all-zero bytes are a valid `libc::stat` (plain integers).
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: fd is valid; st is written by fstat.
            if unsafe { libc::fstat(fd, &mut st) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let len = st.st_size as usize;
            if !lens.contains(&len) {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{len} bytes, expected one of {lens:?}"),
                ));
            }
            map(fd, len).map(|p| (p, len))
        })();
        // SAFETY: fd is ours, closed once.
        unsafe { libc::close(fd) };
        let (ptr, len) = r.map_err(|e| Error::remote(format!("mapping the peer's {name}: {e}")))?;
        Ok(SharedBlock {
            ptr,
            len,
            name: name.to_owned(),
            owner: false,
            unlinked: std::sync::atomic::AtomicBool::new(true),
        })
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Removes the name (mappings stay valid); the creator does it once the peer mapped it.
    pub fn unlink(&self) {
        if self.owner
            && !self
                .unlinked
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            let cname = std::ffi::CString::new(self.name.clone()).expect("no NUL in the name");
            // SAFETY: valid NUL-terminated name. A failure (already gone) changes nothing.
            unsafe { libc::shm_unlink(cname.as_ptr()) };
        }
    }
}

/// Maps `len` bytes of `fd`, shared and writable.
fn map(fd: libc::c_int, len: usize) -> std::io::Result<*mut u8> {
    // SAFETY: a fresh shared mapping of an fd we hold; the kernel picks the address.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(p.cast())
    }
}

impl Drop for SharedBlock {
    fn drop(&mut self) {
        self.unlink();
        if !self.ptr.is_null() {
            // SAFETY: mapped in create/open with this length, unmapped once.
            unsafe { libc::munmap(self.ptr.cast(), self.len) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A dead process that had our pid left objects under the names we are about to use: they
    /// are replaced, not refused (a stale name made a 128-rank run's setup fail).
    #[test]
    fn stale_names_of_a_dead_process_with_our_pid_are_replaced() {
        let pid = std::process::id();
        let next = NEXT_NAME.load(Ordering::Relaxed);
        // The next few names, left behind with junk of another size (other tests may take one).
        let stale: Vec<String> = (next..next + 8)
            .map(|n| format!("/dev/shm{SHARED_PREFIX}{pid}-{n}"))
            .collect();
        for p in &stale {
            std::fs::write(p, b"left by a dead process").unwrap();
        }
        let b = SharedBlock::create(64).unwrap();
        assert!(b.name.starts_with(&format!("{SHARED_PREFIX}{pid}-")));
        // Zeroed and of the new size, not the leftover's content.
        // SAFETY: the block maps at least 4096 bytes.
        let first = unsafe { std::slice::from_raw_parts(b.ptr, 64) };
        assert!(first.iter().all(|&x| x == 0));
        drop(b);
        for p in &stale {
            let _ = std::fs::remove_file(p);
        }
    }

    #[test]
    fn shared_block_is_seen_through_its_name_until_unlinked() {
        let a = SharedBlock::create(32).unwrap();
        let b = SharedBlock::open(a.name(), &[32]).unwrap();
        // SAFETY: both map the same page; aligned u64 at offset 8.
        unsafe { AtomicU64::from_ptr(a.ptr().add(8).cast()) }.store(42, Ordering::Release);
        assert_eq!(
            // SAFETY: as for the unsafe code just above.
            unsafe { AtomicU64::from_ptr(b.ptr().add(8).cast()) }.load(Ordering::Acquire),
            42
        );
        a.unlink();
        assert!(
            SharedBlock::open(a.name(), &[32]).is_err(),
            "unlinked name still opens"
        );
        // The mapping outlives the name.
        assert_eq!(
            // SAFETY: `b` still maps the page; aligned u64 at offset 8.
            unsafe { AtomicU64::from_ptr(b.ptr().add(8).cast()) }.load(Ordering::Acquire),
            42
        );
    }

    #[test]
    fn open_refuses_foreign_names_and_sizes() {
        let a = SharedBlock::create(32).unwrap();
        for bad in [
            "",
            "/etc/passwd",
            "/mscclpp-epoch-",
            "/mscclpp-epoch-1/../x",
            "/other-1-2",
        ] {
            assert!(SharedBlock::open(bad, &[32]).is_err(), "{bad:?} accepted");
        }
        assert!(
            SharedBlock::open(a.name(), &[8192, 12288]).is_err(),
            "wrong size accepted"
        );
        assert_eq!(
            SharedBlock::open(a.name(), &[8192, 32]).unwrap().len(),
            4096
        );
        assert!(SharedBlock::open("/mscclpp-epoch-999999999-0", &[32]).is_err());
    }
}
