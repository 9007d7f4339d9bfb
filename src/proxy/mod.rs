//! Proxy threads: one per endpoint. Each polls its FIFO, checks every trigger against the
//! registered sizes, dispatches to its transport, retires the trigger, and keeps the transport
//! progressing when idle. A failure is sticky: stored once for the communicator, written to the
//! FIFO's abort word so producers stop waiting, and returned by `mscclppProxyStop`.

use crate::abi::{mscclppData, mscclppFlag, mscclppResult_t, mscclppSync};
use crate::error::{Error, Result};
use crate::fifo::{Fifo, Trigger};
use crate::transport::{Endpoint, MrId, PeerId, RemoteId};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The first error of a communicator's background work, kept until the comm is destroyed.
#[derive(Default)]
pub struct Sticky {
    first: Mutex<Option<(mscclppResult_t, String)>>,
}

impl Sticky {
    /// Records `e` unless an earlier error is already stored; returns the stored code.
    pub fn set(&self, code: mscclppResult_t, msg: String) -> mscclppResult_t {
        let mut g = lock(&self.first);
        if g.is_none() {
            crate::warn!("proxy error (sticky for this communicator): {msg}");
            *g = Some((code, msg));
        }
        g.as_ref().map(|x| x.0).unwrap_or(code)
    }
    pub fn get(&self) -> Option<(mscclppResult_t, String)> {
        lock(&self.first).clone()
    }
}

/// Locks a mutex, recovering from poisoning: a panicking proxy is already reported as an error.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Everything the proxy needs to act on one connection's triggers.
#[derive(Clone, Debug)]
pub struct ProxyConn {
    pub remote_rank: usize,
    pub peer: PeerId,
    pub src: MrId,
    pub local_size: u64,
    pub dst: RemoteId,
    pub remote_size: u64,
    /// The peer's epoch block; the signal count goes to offset 8 (`proxy`).
    pub remote_epoch: RemoteId,
    /// Flags sent so far: the value the next Flag writes is this + 1. Counting here rather than
    /// reading the producer's `device` epoch keeps the value in FIFO order with the data.
    pub signals: u64,
}

pub type SharedEndpoint = Arc<Mutex<Box<dyn Endpoint>>>;

/// What the thread owns while it runs; handed back by `join`.
pub struct ProxyWork {
    pub fifo: Fifo,
    pub conns: Vec<ProxyConn>,
    pub endpoint: SharedEndpoint,
    /// Polled for peers that died: their loss aborts every wait on this FIFO.
    pub boot: Arc<crate::bootstrap::Bootstrap>,
}

pub struct Running {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<(ProxyWork, Result<()>)>,
}

/// Starts a named proxy thread over `work`.
pub fn launch(name: String, work: ProxyWork, sticky: Arc<Sticky>) -> Result<Running> {
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let handle = std::thread::Builder::new()
        .name(name.clone())
        .spawn(move || {
            // The FIFO's device is the endpoint's: its copies and streams live in that
            // device's primary context.
            crate::cuda::bind_proxy_thread(work.fifo.device());
            let mut work = work;
            let r = run(&mut work, &stop2);
            if let Err(e) = &r {
                let code = crate::capi::result_of(e);
                sticky.set(code, format!("{name}: {e}"));
                work.fifo.abort_word().set(code);
            }
            (work, r)
        })
        .map_err(|e| Error::sys("spawning the proxy thread", e))?;
    Ok(Running { stop, handle })
}

impl Running {
    /// Asks the thread to finish the triggers already in the FIFO, then joins it.
    pub fn stop(self) -> (Option<ProxyWork>, Result<()>) {
        // Release pairs with the Acquire load in `run`'s loop condition.
        self.stop.store(true, Ordering::Release);
        match self.handle.join() {
            Ok((w, r)) => (Some(w), r),
            Err(_) => (None, Err(Error::internal("the proxy thread panicked"))),
        }
    }
}

fn run(w: &mut ProxyWork, stop: &AtomicBool) -> Result<()> {
    let mut idle: u32 = 0;
    let mut idle_since = Instant::now();
    let mut stop_seen: Option<Instant> = None;
    let mut last_watch = Instant::now();
    loop {
        if last_watch.elapsed() > PEER_WATCH_PERIOD {
            last_watch = Instant::now();
            check_peers(w)?;
        }
        match w.fifo.peek() {
            Some(words) => {
                idle = 0;
                let t = Trigger::decode(words);
                handle(w, &t)?;
                w.fifo.pop(t.ty & mscclppSync != 0);
            }
            None => {
                // Acquire pairs with `Running::stop`. The FIFO is empty: finish once asked.
                if stop.load(Ordering::Acquire) {
                    // A producer may have taken a ticket and not yet written its slot; give it
                    // a short grace period, then finish.
                    let t0 = *stop_seen.get_or_insert_with(Instant::now);
                    if t0.elapsed() > Duration::from_millis(20) {
                        let mut ep = crate::proxy::lock(&w.endpoint);
                        let mut peers: Vec<PeerId> = w.conns.iter().map(|c| c.peer).collect();
                        peers.sort_unstable();
                        peers.dedup();
                        for p in peers {
                            ep.flush(p)?;
                        }
                        return Ok(());
                    }
                }
                lock(&w.endpoint).progress()?;
                if idle == 0 {
                    idle_since = Instant::now();
                }
                idle = idle.saturating_add(1);
                backoff(idle, idle_since);
            }
        }
    }
}

/// How often the proxy asks the bootstrap whether a connected peer vanished.
const PEER_WATCH_PERIOD: Duration = Duration::from_millis(10);

/// Fails when a peer of one of this proxy's connections died (no goodbye on its bootstrap
/// connection): the caller turns that into the sticky error and the abort word.
fn check_peers(w: &ProxyWork) -> Result<()> {
    match w.boot.lost_peer() {
        Some((rank, why)) if w.conns.iter().any(|c| c.remote_rank == rank) => {
            Err(Error::remote(format!("peer lost: {why}")))
        }
        _ => Ok(()),
    }
}

/// Idle policy: spin, then yield for a while (hands the core to producers and peers on an
/// oversubscribed machine without a sleep's timer slack), then short naps so that an idle
/// communicator does not hold a core; the first trigger after a long idle pays <= ~70 us.
fn backoff(idle: u32, idle_since: Instant) {
    if idle < 128 {
        std::hint::spin_loop();
    } else if idle_since.elapsed() < Duration::from_millis(20) {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(20));
    }
}

/// Checks one trigger against the connection's registered sizes, then acts on it.
fn handle(w: &mut ProxyWork, t: &Trigger) -> Result<()> {
    let nconns = w.conns.len();
    let c = w.conns.get_mut(t.conn_id).ok_or_else(|| {
        Error::invalid_arg(format!(
            "trigger for connection {} but this proxy has {nconns}",
            t.conn_id
        ))
    })?;
    if t.ty == 0 || t.ty & !(mscclppData | mscclppFlag | mscclppSync) != 0 {
        return Err(Error::invalid_arg(format!(
            "trigger with unknown type {:#x}",
            t.ty
        )));
    }
    let mut ep = lock(&w.endpoint);
    if t.ty & mscclppData != 0 {
        check_range("source", t.src_off, t.size, c.local_size, c.remote_rank)?;
        check_range(
            "destination",
            t.dst_off,
            t.size,
            c.remote_size,
            c.remote_rank,
        )?;
        ep.write(c.peer, c.src, t.src_off, c.dst, t.dst_off, t.size)?;
    }
    if t.ty & mscclppFlag != 0 {
        c.signals += 1;
        ep.write_value(c.peer, c.remote_epoch, 8, c.signals)?;
    }
    if t.ty & mscclppSync != 0 {
        ep.flush(c.peer)?;
    }
    Ok(())
}

fn check_range(side: &str, off: u64, size: u64, limit: u64, peer: usize) -> Result<()> {
    if size == 0 || off.checked_add(size).is_none_or(|end| end > limit) {
        return Err(Error::invalid_arg(format!(
            "put refused: {side} range [{off}, {off}+{size}) is outside the {limit}-byte buffer registered on the connection to rank {peer}"
        )));
    }
    Ok(())
}
