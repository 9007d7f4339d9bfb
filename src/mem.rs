//! Memory this library allocates for itself (FIFOs, epoch counters, staging).

use crate::error::{Error, Result};
use std::alloc::{alloc_zeroed, dealloc, Layout};

/// Zeroed, aligned host memory, freed on drop. Other threads (and, through registration, remote
/// peers) may write it; Rust code touches it only through raw pointers and atomics.
pub struct HostBlock {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: a HostBlock is only an owned allocation; all access goes through raw pointers whose
// users document their own synchronisation.
unsafe impl Send for HostBlock {}
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
