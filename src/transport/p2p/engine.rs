//! The SM copy engine of the P2P transport: host side of `src/cuda/kernels/p2p_engine.cu`
//! (the protocol is described there).
//!
//! Why a kernel: a copy-engine copy takes 7-9 us from `cuMemcpyAsync` to its completion on the
//! machines measured, whatever its size up to ~1 MiB (bench/RESULTS.md, "driver costs"), which
//! puts a floor of ~15 us under a 1 MiB all-gather. A kernel that is already resident sees a
//! job ~1.5 us after the proxy posts it (a CPU -> kernel -> CPU round trip is 3 us) and copies
//! 512 KiB over NVLink in ~1.5 us.
//!
//! Life cycle, all driven by the proxy thread (the only caller; user threads calling
//! `mscclppRegisteredBufferWrite` hold the same endpoint lock):
//! - Off -> Starting: the first eligible put or flag launches the kernel (and itself goes by the
//!   copy engine); Starting -> On once every block checked in (`ALIVE`): only then are jobs
//!   posted, so a job never waits for a block that user kernels keep off the SMs.
//! - On -> Stopping: after `linger` without jobs, with every job done, the proxy raises `STOP`;
//!   Stopping -> Off once the kernel's stream is idle. An idle communicator thus holds no SMs,
//!   and whatever synchronizes the whole device in the user's code waits at most `linger` for
//!   the engine.
//! - Any state -> Off when the proxy stops or fails (`stop`, through `Endpoint::quiesce`):
//!   nothing of ours runs on the GPU after `mscclppProxyStop`.

use crate::config::P2pConfig;
use crate::cuda::{DeviceMem, Function, Module, PinnedHost, Stream, P2P_ENGINE_PTX};
use crate::error::{Error, Result};
use crate::sync::{Backoff, Policy};
use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Jobs in the ring (the proxy waits for room beyond that).
const RING: u32 = 256;
/// Bytes per job slot (`struct Job` of the kernel).
const JOB_BYTES: usize = 64;
/// Words of the control block: [STOP, ALIVE, DONE] (`enum` of the kernel), then from `STATS`
/// the kernel's timing sums: [grid jobs ns, grid jobs, other jobs ns, other jobs, then the grid
/// jobs' phases: ns until block 0's share was copied, then until every worker was done, then
/// until fenced and DONE].
const STOP: usize = 0;
const ALIVE: usize = 1;
const DONE: usize = 2;
const STATS: usize = 8;
const STAT_WORDS: usize = 7;
const CTRL_BYTES: usize = 128;
const THREADS: u32 = 1024;
/// The kernel's `dev[]`: 8 words.
const DEV_BYTES: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Off,
    Starting,
    On,
    Stopping,
}

pub struct Engine {
    // ManuallyDrop: freed only once the kernel that uses them has stopped (see Drop).
    module: ManuallyDrop<Module>,
    ring: ManuallyDrop<PinnedHost>,
    ctrl: ManuallyDrop<PinnedHost>,
    /// The kernel's `dev[]` words (device memory).
    counters: ManuallyDrop<DeviceMem>,
    func: Function,
    stream: Stream,
    blocks: u32,
    state: State,
    /// Sequence number of the next job (jobs are numbered from 1 over the engine's lifetime).
    next: u64,
    launches: u64,
    last_post: Instant,
    /// Puts up to this size go here (larger ones by the copy engines, which reach their peak
    /// bandwidth without taking SMs from the user's kernels).
    pub max_bytes: u64,
    linger: Duration,
    /// Jobs up to this size are block 0's alone (no grid-wide arrival to wait for).
    solo_bytes: u64,
    /// Pause between the kernel's polls of the ring (`MSCCLPP_P2P_SM_POLL_NS`).
    poll_sleep_ns: u32,
    /// The FIFO's done word (device address; 0: none), passed to the kernel at launch.
    done_word: u64,
    /// Timing sums of the kernels that ended (see `STATS`).
    timing_base: [u64; STAT_WORDS],
    /// The kernel records them (for the endpoint's `MSCCLPP_P2P_STATS=1` report).
    timing_on: bool,
    /// A `stop` failed with the kernel still running: its memory is leaked at drop, and drop
    /// does not wait for it a second time.
    gave_up: bool,
    /// Time the engine's round trips once it starts (`MSCCLPP_P2P_SM_SELFTEST=1`).
    selftest: bool,
    pub jobs: u64,
}

impl Engine {
    /// The engine of `device`, or None when it is turned off (`MSCCLPP_P2P_ENGINE=ce`, said at
    /// INFO) or cannot run (said at WARN once per process, then at INFO: a driver older than
    /// the PTX's ISA, a failed allocation).
    pub fn open(device: i32, cfg: &P2pConfig) -> Option<Engine> {
        if !cfg.sm_engine {
            crate::info!("p2p:cuda{device}: SM copy engine off (MSCCLPP_P2P_ENGINE=ce): every put by the copy engines");
            return None;
        }
        match Self::try_open(device, cfg) {
            Ok(e) => {
                crate::info!(
                    "p2p:cuda{device}: SM copy engine ready ({} blocks; puts up to {} bytes and flags; linger {:?})",
                    e.blocks,
                    e.max_bytes,
                    e.linger
                );
                Some(e)
            }
            Err(e) => {
                let msg = format!(
                    "p2p:cuda{device}: SM copy engine off ({e}; its PTX is ISA {}, which drivers of CUDA 12.0 and newer load): every P2P put and signal goes by the copy engines, which take longer to start each one",
                    ptx_isa()
                );
                // Relaxed: only "once" matters, nothing is published through the flag.
                if !OFF_WARNED.swap(true, Ordering::Relaxed) {
                    crate::warn!("{msg}");
                } else {
                    crate::info!("{msg}");
                }
                None
            }
        }
    }

    fn try_open(device: i32, cfg: &P2pConfig) -> Result<Engine> {
        let module = Module::load_ptx(device, P2P_ENGINE_PTX)?;
        let func = module.function(c"mscclpp_p2p_engine")?;
        let blocks = cfg.sm_blocks;
        // Allocated before the struct, so that a failure frees what was made (ManuallyDrop
        // would not).
        let stream = Stream::new(device)?;
        let ring = PinnedHost::zeroed(device, RING as usize * JOB_BYTES)?;
        let ctrl = PinnedHost::zeroed(device, CTRL_BYTES)?;
        let counters = DeviceMem::zeroed(device, DEV_BYTES)?;
        Ok(Engine {
            module: ManuallyDrop::new(module),
            ring: ManuallyDrop::new(ring),
            ctrl: ManuallyDrop::new(ctrl),
            counters: ManuallyDrop::new(counters),
            func,
            stream,
            blocks,
            state: State::Off,
            next: 1,
            launches: 0,
            last_post: Instant::now(),
            max_bytes: cfg.sm_max_bytes,
            linger: cfg.sm_linger,
            solo_bytes: cfg.sm_solo_bytes,
            poll_sleep_ns: cfg.sm_poll_ns,
            done_word: 0,
            timing_base: [0; STAT_WORDS],
            timing_on: cfg.stats,
            gave_up: false,
            selftest: cfg.sm_selftest,
            jobs: 0,
        })
    }

    /// Where job `done` values go (the FIFO's done word, `Fifo::done_word`): from the next
    /// launch on.
    pub fn set_done_word(&mut self, addr: u64) {
        self.done_word = addr;
    }

    /// The kernel's timing sums so far (see `STATS`): from the read of a job to its DONE.
    pub fn timing(&self) -> [u64; STAT_WORDS] {
        std::array::from_fn(|i| self.timing_base[i] + self.word(STATS + i).load(Ordering::Relaxed))
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        debug_assert!(i < CTRL_BYTES / 8);
        // SAFETY: ctrl holds CTRL_BYTES / 8 u64s, page aligned; shared with the kernel, which
        // only uses aligned 8-byte loads and stores on it.
        unsafe { AtomicU64::from_ptr(self.ctrl.host().cast::<u64>().add(i)) }
    }

    /// Last job the kernel finished. Acquire: pairs with its release store of DONE, after
    /// which every byte of that job (and its flag) is in the peer's memory.
    pub fn done(&self) -> u64 {
        self.word(DONE).load(Ordering::Acquire)
    }

    /// Advances the life cycle (see the module doc); true when jobs may be posted.
    pub fn ready(&mut self) -> Result<bool> {
        match self.state {
            State::Starting => {
                // Acquire pairs with block 0's release store of ALIVE.
                if self.word(ALIVE).load(Ordering::Acquire) == self.launches {
                    self.state = State::On;
                    self.last_post = Instant::now();
                    if self.launches == 1 && self.selftest {
                        self.selftest()?;
                    }
                } else if self.stream.query()? {
                    return Err(Error::internal(
                        "the SM copy engine exited before it started",
                    ));
                }
            }
            State::Stopping => {
                if self.stream.query()? {
                    self.state = State::Off;
                }
            }
            State::On | State::Off => {}
        }
        Ok(self.state == State::On)
    }

    /// The kernel runs and takes jobs (as `ready`, without advancing the life cycle).
    pub fn on(&self) -> bool {
        self.state == State::On
    }

    /// Launches the kernel if it is off (it becomes usable a few microseconds later).
    pub fn start(&mut self) -> Result<()> {
        if self.state != State::Off {
            return Ok(());
        }
        // Relaxed: the kernel of the last launch has exited (Off), and the launch below orders
        // this store before the new kernel's loads.
        self.word(STOP).store(0, Ordering::Relaxed);
        // The kernel's timing sums restart at 0 (it stores its own totals): keep the last
        // kernel's. Relaxed: that kernel has exited.
        for i in 0..STAT_WORDS {
            self.timing_base[i] += self.word(STATS + i).swap(0, Ordering::Relaxed);
        }
        self.stream
            .memset_u32(self.counters.ptr(), 0, DEV_BYTES as u64 / 4)?;
        self.launches += 1;
        let (mut ring, mut ctrl, mut dev) = (self.ring.dev(), self.ctrl.dev(), self.counters.ptr());
        let (mut size, mut first, mut launch) = (RING, self.next, self.launches);
        let (mut solo, mut sleep, mut done) = (self.solo_bytes, self.poll_sleep_ns, self.done_word);
        let mut timing = self.timing_on as u32;
        let mut params: [*mut c_void; 10] = [
            (&mut ring as *mut u64).cast(),
            (&mut ctrl as *mut u64).cast(),
            (&mut dev as *mut u64).cast(),
            (&mut size as *mut u32).cast(),
            (&mut first as *mut u64).cast(),
            (&mut launch as *mut u64).cast(),
            (&mut solo as *mut u64).cast(),
            (&mut sleep as *mut u32).cast(),
            (&mut done as *mut u64).cast(),
            (&mut timing as *mut u32).cast(),
        ];
        // SAFETY: the ten parameters match `mscclpp_p2p_engine(const Job*, u64*, u64*, u32,
        // u64, u64, u64, u32, u64*, u32)` in type and order; the proxy thread has the engine's
        // context current. What the kernel touches outlives it, on every path: ring, ctrl
        // and counters live in `self`, whose drop frees them only once the kernel is seen
        // ended and leaks them otherwise; the peers' memory it stores into is mapped by the
        // endpoint, whose drop closes the mappings only if this engine stopped (and leaks
        // them otherwise); the done word lives in the FIFO, which teardown frees only after
        // the endpoint reported nothing running on the GPU (`Endpoint::gpu_busy`), leaking it
        // otherwise.
        unsafe {
            self.stream
                .launch(self.func, self.blocks, THREADS, &mut params)
        }?;
        self.state = State::Starting;
        Ok(())
    }

    /// Posts a job (`size` 0: a flag alone) and returns its sequence number. Only when
    /// `ready()`. `done` (non-zero) goes to the done word once the job is done. Waits, bounded,
    /// while the ring is full.
    pub fn post(
        &mut self,
        (dst, src, size): (u64, u64, u64),
        flag: Option<(u64, u64)>,
        done: u64,
    ) -> Result<u64> {
        debug_assert_eq!(self.state, State::On);
        let k = self.next;
        // Job k reuses the slot of job k - RING: wait until that one is done.
        if k > RING as u64 {
            self.wait(k - RING as u64, "room in the SM copy engine's ring")?;
        }
        let slot = (k % RING as u64) as usize;
        // SAFETY: slot < RING; the ring holds RING jobs of JOB_BYTES, 8-byte aligned. The kernel
        // uses this slot only once it reads k in both sequence words, stored last below.
        let w = |i: usize| unsafe {
            AtomicU64::from_ptr(self.ring.host().add(slot * JOB_BYTES).cast::<u64>().add(i))
        };
        let (fa, fv) = flag.unwrap_or((0, 0));
        for (i, v) in [dst, src, size, fa, fv, done].into_iter().enumerate() {
            w(i + 1).store(v, Ordering::Relaxed);
        }
        // Release: the fields above are visible before either sequence number (the kernel
        // takes a slot whose two numbers both read k; each lies in one 32-byte half of it).
        w(7).store(k, Ordering::Release);
        w(0).store(k, Ordering::Release);
        self.next += 1;
        self.jobs += 1;
        self.last_post = Instant::now();
        Ok(k)
    }

    /// Waits until job `seq` is done. Ends then, with an error if the kernel stopped or failed
    /// first, or at `MSCCLPP_WAIT_TIMEOUT`.
    pub fn wait(&self, seq: u64, what: &str) -> Result<()> {
        // Spins: the engine answers in microseconds. The stream and the clock are read every
        // 4096 polls.
        let mut b = Backoff::new(Policy::SPIN, crate::config::wait_timeout());
        while self.done() < seq {
            if b.polls() % 4096 == 4095 {
                if self.stream.query()? && self.done() < seq {
                    return Err(Error::internal(format!(
                        "the SM copy engine exited with job {seq} not done ({what})"
                    )));
                }
                b.check(|| format!("waiting for {what}{}", crate::cuda::queue_hint()))?;
            }
            b.pause();
        }
        Ok(())
    }

    /// Returns once every flag the kernel stored so far is delivered (a flag may land after its
    /// job's DONE): a barrier job while the kernel runs; the end of a kernel that is stopping.
    pub fn order_flags(&mut self) -> Result<()> {
        match self.state {
            State::On => {
                let k = self.post((0, 0, 0), None, 0)?;
                self.wait(k, "the SM copy engine's earlier flags")
            }
            State::Stopping => {
                self.stream.wait(|| "the SM copy engine to stop".into())?;
                self.state = State::Off;
                Ok(())
            }
            // Starting follows Off: the kernel that stored earlier flags has finished.
            State::Starting | State::Off => Ok(()),
        }
    }

    /// `MSCCLPP_P2P_SM_SELFTEST=1`: once the kernel is up, times 2000 flag jobs whose flag is
    /// a word of our own pinned memory (CPU -> kernel -> CPU) and 2000 empty jobs (post ->
    /// DONE seen), and logs the medians: the engine's share of a signal's latency.
    fn selftest(&mut self) -> Result<()> {
        let probe = 4; // a spare word of ctrl
        let mut flag = Vec::with_capacity(2000);
        let mut done = Vec::with_capacity(2000);
        for i in 1..=2000u64 {
            let t = Instant::now();
            self.post((0, 0, 0), Some((self.ctrl.dev() + 8 * probe as u64, i)), 0)?;
            // Acquire pairs with the kernel's store of the probe; ends within the wait bound.
            let b = Backoff::new(Policy::SPIN, crate::config::wait_timeout());
            while self.word(probe).load(Ordering::Acquire) != i {
                b.check(|| "the engine self-test".into())?;
                std::hint::spin_loop();
            }
            flag.push(t.elapsed());
            let t = Instant::now();
            let k = self.post((0, 0, 0), None, 0)?;
            self.wait(k, "the engine self-test")?;
            done.push(t.elapsed());
        }
        flag.sort();
        done.sort();
        crate::info!(
            "SM copy engine self-test: flag round trip CPU -> kernel -> CPU median {:?}; barrier job post -> DONE median {:?}",
            flag[1000],
            done[1000]
        );
        Ok(())
    }

    /// Times the kernel was launched.
    pub fn launches(&self) -> u64 {
        self.launches
    }

    /// Every posted job is done.
    pub fn idle(&self) -> bool {
        self.done() + 1 >= self.next
    }

    /// Called when the proxy is idle: stops the kernel after `linger` without jobs.
    pub fn idle_tick(&mut self) -> Result<()> {
        self.ready()?;
        if self.state == State::On && self.idle() && self.last_post.elapsed() > self.linger {
            // Release: the kernel sees STOP only between jobs, and every job is done.
            self.word(STOP).store(1, Ordering::Release);
            self.state = State::Stopping;
        }
        Ok(())
    }
}

impl Engine {
    /// Ends the kernel (after its posted jobs), bounded by `MSCCLPP_WAIT_TIMEOUT`; a later job
    /// launches it again. Off when this returns Ok.
    pub fn stop(&mut self) -> Result<()> {
        if self.state == State::Off {
            return Ok(());
        }
        let waited = self.wait(self.next - 1, "the SM copy engine's last jobs");
        // Release: as in idle_tick. A kernel still Starting sees it as soon as it runs.
        self.word(STOP).store(1, Ordering::Release);
        if let Err(e) = self.stream.wait(|| "the SM copy engine to stop".into()) {
            self.gave_up = true;
            return Err(e);
        }
        self.state = State::Off;
        waited
    }

    /// The kernel is known to have ended (or was never launched).
    pub fn is_off(&self) -> bool {
        self.state == State::Off
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let mut stopped = self.state == State::Off;
        // A stop that already gave up is not waited for a second time.
        if !stopped && !self.gave_up {
            match self.stop() {
                Ok(()) => stopped = true,
                Err(e) if self.state == State::Off => {
                    crate::warn!("{e}");
                    stopped = true;
                }
                Err(e) => crate::warn!("{e}; its memory is leaked rather than freed under it"),
            }
        } else if !stopped {
            crate::warn!("the SM copy engine's kernel did not stop: its job ring, control block and counters are leaked rather than freed under it");
        }
        if stopped {
            // SAFETY: each field is dropped once, here, and never used again; the kernel that
            // used them has finished (or was never launched).
            unsafe {
                ManuallyDrop::drop(&mut self.counters);
                ManuallyDrop::drop(&mut self.ctrl);
                ManuallyDrop::drop(&mut self.ring);
                ManuallyDrop::drop(&mut self.module);
            }
        }
    }
}

/// Set once the engine's failure to start was logged at WARN (`Engine::open`).
static OFF_WARNED: AtomicBool = AtomicBool::new(false);

/// The PTX ISA the embedded engine declares (its `.version` line), for the log.
fn ptx_isa() -> &'static str {
    P2P_ENGINE_PTX
        .lines()
        .find_map(|l| l.trim().strip_prefix(".version "))
        .unwrap_or("unknown")
}

#[cfg(test)]
mod tests {
    use super::{ptx_isa, P2P_ENGINE_PTX};

    /// The kernel `start` launches, with the parameters it passes, in the embedded PTX (a
    /// change to one side without the other would launch with garbage arguments).
    #[test]
    fn ptx_entry_matches_the_launch() {
        let entry = P2P_ENGINE_PTX
            .split(".visible .entry mscclpp_p2p_engine(")
            .nth(1)
            .expect("entry mscclpp_p2p_engine in the PTX");
        let params: Vec<&str> = entry[..entry.find(')').expect("parameter list")]
            .lines()
            .filter_map(|l| l.trim().strip_prefix(".param ."))
            .map(|l| l.split_whitespace().next().unwrap_or(""))
            .collect();
        assert_eq!(
            params,
            ["u64", "u64", "u64", "u32", "u64", "u64", "u64", "u32", "u64", "u32"]
        );
        // ISA 8.0 loads on drivers of CUDA 12.0 and newer; CUDA 13's nvcc writes 9.0, which
        // drivers older than 13.0 refuse (scripts/gen-ptx.sh sets the line).
        assert_eq!(ptx_isa(), "8.0", "the PTX's ISA (scripts/gen-ptx.sh)");
    }
}
