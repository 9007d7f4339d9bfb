//! Helpers for tests that drive `transport::Endpoint`s directly between two processes: host
//! regions, atomic reads of words a peer writes, and the exchange of address/region blobs
//! through files in a private directory.
#![allow(dead_code)]

use mscclpp::transport::{Endpoint, MemKind, MrId, PeerId, Region, RemoteId};
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

/// Waits until word `i` of `v` reaches `want`, progressing `ep` (its CQ must be polled for
/// anything to move). Ends then, or fails at `deadline`.
pub fn wait_for(
    ep: &mut dyn Endpoint,
    v: &[u64],
    i: usize,
    want: u64,
    what: &str,
    deadline: Duration,
) {
    let t0 = Instant::now();
    while word(v, i) < want {
        ep.progress().unwrap();
        assert!(
            t0.elapsed() < deadline,
            "{what}: timed out at {} < {want}",
            word(v, i)
        );
        std::thread::yield_now();
    }
}

/// The target's side of the rounds the two-process suites run: per round, wait for the flag
/// (word 1 of `epoch`), check every word of `dst` against the round's pattern, then write the
/// round number to the initiator's ack word and flush. Then keep progressing a moment: the
/// last flush's delivery marker needs the initiator's side, and the initiator's last
/// completions need ours (as a destroyed communicator does, `comm::LINGER`).
pub fn target_rounds(
    ep: &mut dyn Endpoint,
    peer: PeerId,
    ack: RemoteId,
    dst: &[u64],
    epoch: &[u64],
    rounds: u64,
    deadline: Duration,
) {
    for r in 1..=rounds {
        wait_for(ep, epoch, 1, r, "target waiting for the flag", deadline);
        for i in 0..dst.len() {
            assert_eq!(
                word(dst, i),
                pattern(r, i),
                "round {r} word {i}: data behind the flag"
            );
        }
        ep.write_value(peer, ack, 0, r).unwrap();
        ep.flush(peer).unwrap();
    }
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(200) {
        ep.progress().unwrap();
        std::thread::yield_now();
    }
}

/// Keeps `ep` progressing until the other process published `name` (its last flush, whose
/// delivery marker needs our side, has completed), at most `deadline`: a fixed linger could end
/// before a descheduled peer got to its flush.
pub fn progress_until_published(ep: &mut dyn Endpoint, dir: &Path, name: &str, deadline: Duration) {
    let t0 = Instant::now();
    // Ends when the peer published `name`, or fails at the deadline.
    while !dir.join(name).exists() {
        assert!(t0.elapsed() < deadline, "peer never published {name}");
        ep.progress().unwrap();
        std::thread::yield_now();
    }
}

/// The initiator's side: per round, fill `src` with the round's pattern, write all of it to
/// `dst`, the round number to word 1 of `epoch`, flush, and wait for the target's ack (word 0
/// of `ackw`). Returns the time per round.
#[allow(clippy::too_many_arguments)] // the endpoint, its ids and buffers, the schedule
pub fn initiator_rounds(
    ep: &mut dyn Endpoint,
    peer: PeerId,
    (src_id, dst, epoch): (MrId, RemoteId, RemoteId),
    src: &mut [u64],
    ackw: &[u64],
    rounds: u64,
    deadline: Duration,
) -> Duration {
    let t0 = Instant::now();
    for r in 1..=rounds {
        for (i, w) in src.iter_mut().enumerate() {
            *w = pattern(r, i);
        }
        ep.write(peer, src_id, 0, dst, 0, (src.len() * 8) as u64)
            .unwrap();
        ep.write_value(peer, epoch, 8, r).unwrap();
        ep.flush(peer).unwrap();
        wait_for(ep, ackw, 0, r, "initiator waiting for the ack", deadline);
    }
    t0.elapsed() / rounds as u32
}
