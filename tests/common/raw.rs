//! Helpers for tests that drive `transport::Endpoint`s directly between two processes: host
//! regions, atomic reads of words a peer writes, and the exchange of address/region blobs
//! through files in a private directory.
#![allow(dead_code)]

use mscclpp::transport::{MemKind, Region};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub fn region(v: &[u64]) -> Region {
    Region {
        addr: v.as_ptr() as u64,
        len: (v.len() * 8) as u64,
        kind: MemKind::Host,
    }
}

pub fn word(v: &[u64], i: usize) -> u64 {
    // SAFETY: in bounds and aligned; written by the other process through RMA, hence atomic.
    unsafe { AtomicU64::from_ptr(v.as_ptr().add(i) as *mut u64) }.load(Ordering::Acquire)
}

pub fn pattern(round: u64, i: usize) -> u64 {
    round.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i as u64
}

/// Writes blobs to `name` atomically (temp file + rename): u32 count, then u32 len + bytes.
pub fn publish(dir: &Path, name: &str, blobs: &[Vec<u8>]) {
    let mut out = Vec::new();
    out.extend_from_slice(&(blobs.len() as u32).to_le_bytes());
    for b in blobs {
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        out.extend_from_slice(b);
    }
    let tmp = dir.join(format!("{name}.tmp"));
    std::fs::write(&tmp, out).unwrap();
    std::fs::rename(tmp, dir.join(name)).unwrap();
}

/// Waits (at most `deadline`) for `name` and parses it.
pub fn fetch(dir: &Path, name: &str, deadline: Duration) -> Vec<Vec<u8>> {
    let t0 = Instant::now();
    // Ends when the peer has published the file, or at the deadline.
    let data = loop {
        if let Ok(d) = std::fs::read(dir.join(name)) {
            break d;
        }
        assert!(t0.elapsed() < deadline, "peer never published {name}");
        std::thread::sleep(Duration::from_millis(5));
    };
    let take = |p: &mut usize, n: usize| {
        let s = &data[*p..*p + n];
        *p += n;
        s
    };
    let mut p = 0;
    let count = u32::from_le_bytes(take(&mut p, 4).try_into().unwrap());
    (0..count)
        .map(|_| {
            let n = u32::from_le_bytes(take(&mut p, 4).try_into().unwrap()) as usize;
            take(&mut p, n).to_vec()
        })
        .collect()
}
