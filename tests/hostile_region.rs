//! A registered region is exactly its buffer, even against a peer that bypasses every check of
//! ours: the initiator imports a forged region blob (the real one with a larger length, another
//! key, a base below the region) through the `Endpoint` trait, so that our own range checks
//! pass, and writes outside the region. What stops the write is the provider's check at the
//! target. Each case runs on a fresh pair of endpoints in one process over tcp (tcp;ofi_rxm),
//! net and shm; the test prints what each provider does (error completion, silent drop, or
//! the wait timeout) and asserts the one thing that matters: no byte outside the registered
//! range changes. Afterwards a correct write still works.

mod common;
mod fault_util;

use common::*;
use fault_util::*;
use mscclpp::transport::{net, Endpoint, MemKind, PeerId, Region};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Words of the target allocation: [canary | region | canary], REGION bytes each.
const REGION: usize = 4096;
const WAIT_S: f64 = 2.0;

type Shared = Arc<Mutex<Box<dyn Endpoint>>>;

fn open() -> Box<dyn Endpoint> {
    let p = std::env::var("MSCCLPP_TEST_TRANSPORT").unwrap();
    if p == "shm" {
        net::open(None, true, None)
    } else {
        net::open(Some("lo"), false, None)
    }
    .unwrap()
}

/// The target: 3 * REGION bytes of which the middle REGION are registered; its endpoint is
/// progressed by a thread, as a proxy would.
struct Target {
    mem: Vec<u64>,
    ep: Shared,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Target {
    fn new() -> (Self, Vec<u8>, Vec<u8>) {
        let mut ep = open();
        let mem = vec![0u64; 3 * REGION / 8];
        let region = Region {
            addr: mem.as_ptr() as u64 + REGION as u64,
            len: REGION as u64,
            kind: MemKind::Host,
        };
        let (_, blob) = ep.register(region).unwrap();
        let addr = ep.address().unwrap();
        let ep: Shared = Arc::new(Mutex::new(ep));
        let stop = Arc::new(AtomicBool::new(false));
        let (ep2, stop2) = (ep.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            // Ends when `stop` is set (Release in Drop). Errors (a provider that drops the
            // connection of a bad writer) end it early: the writer's flush reports them.
            while !stop2.load(Ordering::Acquire) {
                if let Err(e) = ep2.lock().unwrap().progress() {
                    println!("target progress: {e}");
                    return;
                }
                std::thread::yield_now();
            }
        });
        let t = Target {
            mem,
            ep,
            stop,
            thread: Some(thread),
        };
        (t, blob, addr)
    }
    fn word(&self, i: usize) -> u64 {
        // SAFETY: in bounds and aligned; written by RMA, hence atomic.
        unsafe { AtomicU64::from_ptr(self.mem.as_ptr().add(i) as *mut u64) }.load(Ordering::Acquire)
    }
    /// Indices of non-zero words outside the registered region.
    fn canary_hits(&self) -> Vec<usize> {
        (0..self.mem.len())
            .filter(|&i| !(REGION / 8..2 * REGION / 8).contains(&i) && self.word(i) != 0)
            .collect()
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The byte offset of the u64 LE `v` inside `blob` (the only one at a 4-byte boundary).
fn find_u64(blob: &[u8], v: u64) -> usize {
    // Fields sit at multiples of 4 in every blob version.
    let at: Vec<usize> = (0..blob.len().saturating_sub(7))
        .step_by(4)
        .filter(|&i| blob[i..i + 8] == v.to_le_bytes())
        .collect();
    assert_eq!(at.len(), 1, "u64 {v:#x} in {blob:02x?}");
    at[0]
}

fn set_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// One forged write: returns what the initiator saw.
fn attempt(forge: &dyn Fn(&mut Vec<u8>, bool), off: u64, len: u64) -> (String, Vec<usize>, bool) {
    let (t, blob, taddr) = Target::new();
    let mut a = open();
    let peer: PeerId = a.add_peer(1, &taddr).unwrap();
    t.ep.lock()
        .unwrap()
        .add_peer(0, &a.address().unwrap())
        .unwrap();
    let virt = u32::from_le_bytes(blob[8..12].try_into().unwrap()) & 1 != 0;
    let mut forged = blob.clone();
    forge(&mut forged, virt);
    let src = vec![0xa5a5_a5a5_a5a5_a5a5u64; (len as usize).div_ceil(8).max(1)];
    let s = a
        .register(Region {
            addr: src.as_ptr() as u64,
            len: len.max(8),
            kind: MemKind::Host,
        })
        .unwrap()
        .0;
    let t0 = Instant::now();
    let outcome = match a.import(peer, &forged) {
        Err(e) => format!("import refused: {e}"),
        Ok(d) => match a.write(peer, s, 0, d, off, len) {
            Err(e) => format!("write refused: {e}"),
            Ok(()) => match a.flush(peer) {
                Ok(()) => format!("flush ok after {:?} (write dropped or done)", t0.elapsed()),
                Err(e) => format!("flush failed after {:?}: {e}", t0.elapsed()),
            },
        },
    };
    // Give a late write the time to land before looking.
    std::thread::sleep(Duration::from_millis(50));
    let hits = t.canary_hits();
    let landed = (REGION / 8..2 * REGION / 8).any(|i| t.word(i) != 0);
    drop(a);
    drop(t);
    (outcome, hits, landed)
}

fn body() {
    let provider = std::env::var("MSCCLPP_TEST_TRANSPORT").unwrap();
    let len_of = |b: &[u8]| find_u64(b, REGION as u64);
    // The key is the blob's last u64 (both blob versions so far end with base, len, key).
    type Forge = Box<dyn Fn(&mut Vec<u8>, bool)>;
    let cases: Vec<(&str, Forge, u64, u64)> = vec![
        (
            "length doubled, 8 B just past the end",
            Box::new(move |b: &mut Vec<u8>, _| {
                let at = len_of(b);
                set_u64(b, at, 2 * REGION as u64)
            }),
            REGION as u64,
            8,
        ),
        (
            "length doubled, 16 B across the end",
            Box::new(move |b: &mut Vec<u8>, _| {
                let at = len_of(b);
                set_u64(b, at, 2 * REGION as u64)
            }),
            REGION as u64 - 8,
            16,
        ),
        (
            "length 1 MiB, 4 KiB at +64 KiB",
            Box::new(move |b: &mut Vec<u8>, _| {
                let at = len_of(b);
                set_u64(b, at, 1 << 20)
            }),
            64 << 10,
            4096,
        ),
        (
            "wrong key, in range",
            Box::new(|b: &mut Vec<u8>, _| {
                let n = b.len();
                let k = u64::from_le_bytes(b[n - 8..].try_into().unwrap());
                set_u64(b, n - 8, k + 1000)
            }),
            0,
            8,
        ),
        (
            "base 4 KiB lower (virtual addressing) or offset near 2^64 (offset addressing)",
            Box::new(move |b: &mut Vec<u8>, virt| {
                let at = len_of(b);
                if virt {
                    let base = u64::from_le_bytes(b[at - 8..at].try_into().unwrap());
                    set_u64(b, at - 8, base - REGION as u64);
                    set_u64(b, at, 2 * REGION as u64);
                } else {
                    set_u64(b, at, u64::MAX);
                }
            }),
            0,
            8,
        ),
    ];
    let mut report = Vec::new();
    for (name, forge, off, len) in &cases {
        let off = if name.starts_with("base") {
            // Offset addressing: 8 bytes near the end of a forged 2^64-byte region (our own
            // range check wants off + len <= len of the region, which this passes).
            let (t, blob, _) = Target::new();
            drop(t);
            if u32::from_le_bytes(blob[8..12].try_into().unwrap()) & 1 != 0 {
                *off
            } else {
                u64::MAX - 15
            }
        } else {
            *off
        };
        let (outcome, hits, landed) = attempt(forge.as_ref(), off, *len);
        let line = format!("{provider}: {name}: {outcome}; inside the region: {landed}");
        println!("{line}");
        report.push(line);
        assert!(
            hits.is_empty(),
            "{provider}: {name}: the provider wrote outside the registered region, words {hits:?}"
        );
    }
    // A correct write still works after all that, on a fresh pair.
    let (outcome, hits, landed) = attempt(&|_, _| {}, 0, 64);
    assert!(outcome.starts_with("flush ok"), "{outcome}");
    assert!(landed && hits.is_empty());
    for l in report {
        println!("REGION-BOUNDS {l}");
    }
}

fn run(name: &str, provider: &str) {
    if skip_missing_provider(name, provider) {
        return;
    }
    if is_rank(name) {
        return body();
    }
    spawn(name, 1, &rank_env(provider, 5.0, WAIT_S)).expect_success(Duration::from_secs(55));
}

#[test]
fn forged_region_writes_stay_inside_tcp() {
    run("forged_region_writes_stay_inside_tcp", "tcp");
}
#[test]
fn forged_region_writes_stay_inside_net() {
    run("forged_region_writes_stay_inside_net", "net");
}
#[test]
fn forged_region_writes_stay_inside_shm() {
    run("forged_region_writes_stay_inside_shm", "shm");
}
