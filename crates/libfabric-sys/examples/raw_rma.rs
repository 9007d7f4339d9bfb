//! Raw libfabric RMA baseline: what the provider itself delivers, without libmscclpp.
//!
//! Two processes (this program re-executes itself as the target) on one host, one RDM endpoint
//! each. Measures
//!   - `fi_write` bandwidth, 4 KiB .. 64 MiB: a window of writes in flight, then an 8-byte flag
//!     write ordered after them (WAW) that the target echoes back; the clock stops at the echo,
//!     so every byte has arrived;
//!   - the 8-byte put half round trip: ping-pong of flag writes, each side polling its memory
//!     (`--data-first`: an 8-byte data write before each flag, what a putWithSignal sends;
//!     the bandwidth phase's closing flag then carries one too).
//!
//!   - with `--exchange MIN:MAX:FACTOR` instead: what `sendrecv_perf` (c_examples/perf) does
//!     with 2 ranks, as its same-run peer: per iteration both sides write the size's bytes and
//!     then a flag (ordered after them) to each other and wait for the other's flag; rows in
//!     nccl-tests' format (time: mean per iteration of `--exchange-iters`, 20, after 5 warm-up).
//!
//! Usage: cargo run --release -p libfabric-sys --example raw_rma -- [--provider tcp|shm|net|...]
//!        [--domain NAME] [--dc] [--data-first] [--iters N] [--min-kib K] [--max-mib M]
//!        [--volume-mib V] [--exchange MIN:MAX:FACTOR [--exchange-iters N]]
//! Each size from `--min-kib` (4) to `--max-mib` (64) moves `--volume-mib` (256) MiB in
//! 8..4000 writes: on a 2-core VM a single run's bandwidth moves by 20%, and more volume per
//! size narrows that.
//! `--provider` matches the provider name or its core (tcp = tcp;ofi_rxm); socket providers
//! use the loopback domain unless `--domain` says otherwise. `--dc` adds FI_DELIVERY_COMPLETE
//! to every write (what libmscclpp does where the provider accepts it). `--cuda`: the bulk
//! writes go from and to CUDA device memory of GPU 0 registered with FI_HMEM (the provider
//! must report FI_HMEM; flags stay in host memory): the provider's own speed on GPU buffers,
//! the baseline for libmscclpp's FI_HMEM path. `--pinned`: the bulk writes go from and to
//! host memory that the CUDA driver allocated pinned (`cuMemHostAlloc`, as libmscclpp's staging
//! rings and bounce slots are), registered as plain host memory: the provider's speed on them.
//! `--spread`: successive bulk writes of a size go to successive offsets across the whole
//! 64 MiB buffer (instead of alternating between its first two slots), so that every write
//! reads and writes memory that is no longer in the CPU's caches, as fresh data would be; by
//! default a 4 MiB run keeps rewriting 16 MiB that the caches hold.

use libfabric_sys::*;
use std::ffi::{c_void, CStr};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::ptr;
use std::time::{Duration, Instant};

const MAX_SIZE: usize = 64 << 20;
const WINDOW: usize = 16;
const DEADLINE: Duration = Duration::from_secs(60);

#[derive(Clone)]
struct Opts {
    provider: String,
    domain: Option<String>,
    dc: bool,
    /// Latency: an 8-byte data write before each flag (what putWithSignal sends).
    data_first: bool,
    iters: usize,
    min_kib: usize,
    max_mib: usize,
    volume_mib: usize,
    /// Bulk writes between CUDA device buffers registered with FI_HMEM.
    cuda: bool,
    /// Bulk writes between pinned host buffers from cuMemHostAlloc.
    pinned: bool,
    /// Bulk writes cycle over the whole buffer (cache-cold data) instead of two slots.
    spread: bool,
    /// `--exchange`: bytes from, to, and the factor between sizes.
    exchange: Option<(usize, usize, usize)>,
    exchange_iters: usize,
    child: bool,
}

/// "8", "4K", "64M" -> bytes.
fn bytes(s: &str) -> Option<usize> {
    let (num, mult) = match s.as_bytes().last()? {
        b'K' | b'k' => (&s[..s.len() - 1], 1 << 10),
        b'M' | b'm' => (&s[..s.len() - 1], 1 << 20),
        _ => (s, 1),
    };
    num.parse::<usize>().ok().map(|n| n * mult)
}

fn opts() -> Opts {
    let mut o = Opts {
        provider: "tcp".into(),
        domain: None,
        dc: false,
        data_first: false,
        iters: 10_000,
        min_kib: 4,
        max_mib: MAX_SIZE >> 20,
        volume_mib: 256,
        cuda: false,
        pinned: false,
        spread: false,
        exchange: None,
        exchange_iters: 20,
        child: false,
    };
    let mut a = std::env::args().skip(1);
    while let Some(x) = a.next() {
        match x.as_str() {
            "--provider" => o.provider = a.next().expect("--provider NAME"),
            "--domain" => o.domain = a.next(),
            "--dc" => o.dc = true,
            "--data-first" => o.data_first = true,
            "--iters" => o.iters = a.next().and_then(|s| s.parse().ok()).expect("--iters N"),
            "--min-kib" => o.min_kib = a.next().and_then(|s| s.parse().ok()).expect("--min-kib K"),
            "--max-mib" => {
                o.max_mib = a
                    .next()
                    .and_then(|s| s.parse().ok())
                    .filter(|m| *m <= MAX_SIZE >> 20)
                    .expect("--max-mib M (at most 64)")
            }
            "--volume-mib" => {
                o.volume_mib = a
                    .next()
                    .and_then(|s| s.parse().ok())
                    .expect("--volume-mib V")
            }
            "--exchange" => {
                let v = a.next().unwrap_or_default();
                let p: Vec<Option<usize>> = v.split(':').map(bytes).collect();
                o.exchange = match p[..] {
                    [Some(b), Some(e), Some(f)] if b > 0 && b <= e && e <= MAX_SIZE && f > 1 => {
                        Some((b, e, f))
                    }
                    _ => panic!("--exchange MIN:MAX:FACTOR (bytes, K/M suffixes, MAX at most 64M)"),
                }
            }
            "--exchange-iters" => {
                o.exchange_iters = a
                    .next()
                    .and_then(|s| s.parse().ok())
                    .filter(|n| *n > 0)
                    .expect("--exchange-iters N")
            }
            "--cuda" => o.cuda = true,
            "--pinned" => o.pinned = true,
            "--spread" => o.spread = true,
            "--child" => o.child = true,
            "-h" | "--help" => {
                println!("raw_rma [--provider NAME] [--domain NAME] [--dc] [--data-first] [--cuda | --pinned] [--spread] [--iters N] [--min-kib K] [--max-mib M] [--volume-mib V] [--exchange MIN:MAX:FACTOR [--exchange-iters N]]");
                std::process::exit(0);
            }
            other => panic!("unknown argument {other}"),
        }
    }
    o
}

fn cstr(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: libfabric strings are NUL-terminated and live as long as their info.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn ck(what: &str, rc: i64) {
    if rc != 0 {
        // SAFETY: fi_strerror returns a static string.
        let s = cstr(unsafe { fi_strerror((-rc) as i32) });
        panic!("{what} failed: {s} ({rc})");
    }
}

/// One side: endpoint, registered buffer (data, then an 8-byte flag, then 8-byte staging).
struct Side {
    info: *mut fi_info,
    ep: *mut fid_ep,
    cq: *mut fid_cq,
    av: *mut fid_av,
    mr: *mut fid_mr,
    domain: *mut fid_domain,
    fabric: *mut fid_fabric,
    buf: Vec<u64>,
    desc: *mut c_void,
    virt: bool,
    key: u64,
    peer: fi_addr_t,
    peer_base: u64,
    peer_key: u64,
    dc: bool,
    data_first: bool,
    outstanding: usize,
    ctx: Box<[fi_context2; 64]>,
    /// `--cuda`: the bulk buffer in device memory, and the peer's (base, key) of its own.
    gpu: Option<Gpu>,
    peer_gpu: (u64, u64),
}

/// A CUDA device buffer of GPU 0 registered with FI_HMEM_CUDA (`--cuda`), or pinned host
/// memory from the CUDA driver registered as host memory (`--pinned`).
struct Gpu {
    dptr: u64,
    mr: *mut fid_mr,
    desc: *mut c_void,
    key: u64,
}

impl Gpu {
    /// `len` bytes of device memory, written (so that no page is untouched), registered.
    fn new(domain: *mut fid_domain, len: usize, requested_key: u64, pinned: bool) -> Gpu {
        use cudarc::driver::sys as cu;
        let cuck = |what: &str, r: cu::CUresult| {
            assert_eq!(r, cu::CUresult::CUDA_SUCCESS, "{what}");
        };
        // SAFETY: the driver is present (checked first); every out-pointer is a local; the
        // primary context stays retained for the process's life; the iovec and attr outlive
        // the registration call, which copies them.
        unsafe {
            assert!(
                cu::is_culib_present(),
                "--cuda needs the CUDA driver (libcuda)"
            );
            cuck("cuInit", cu::cuInit(0));
            let mut dev = 0;
            cuck("cuDeviceGet", cu::cuDeviceGet(&mut dev, 0));
            let mut ctx = ptr::null_mut();
            cuck(
                "cuDevicePrimaryCtxRetain",
                cu::cuDevicePrimaryCtxRetain(&mut ctx, dev),
            );
            cuck("cuCtxSetCurrent", cu::cuCtxSetCurrent(ctx));
            let mut dptr: cu::CUdeviceptr = 0;
            if pinned {
                let mut p: *mut c_void = ptr::null_mut();
                cuck(
                    "cuMemHostAlloc",
                    cu::cuMemHostAlloc(&mut p, len, cu::CU_MEMHOSTALLOC_PORTABLE),
                );
                ptr::write_bytes(p.cast::<u8>(), 1, len);
                dptr = p as u64;
            } else {
                cuck("cuMemAlloc", cu::cuMemAlloc_v2(&mut dptr, len));
                cuck("cuMemsetD8", cu::cuMemsetD8_v2(dptr, 1, len));
                cuck("cuCtxSynchronize", cu::cuCtxSynchronize());
            }
            let iov = iovec {
                iov_base: dptr as *mut c_void,
                iov_len: len,
            };
            let mut attr = fi_mr_attr {
                iov_count: 1,
                access: (FI_WRITE | FI_REMOTE_WRITE) as u64,
                requested_key,
                iface: if pinned { FI_HMEM_SYSTEM } else { FI_HMEM_CUDA },
                ..Default::default()
            };
            mr_attr_set_iov(&mut attr, &iov);
            if !pinned {
                attr.device.cuda = 0;
            }
            let mut mr = ptr::null_mut();
            ck(
                "fi_mr_regattr(FI_HMEM_CUDA)",
                fi_mr_regattr(domain, &attr, 0, &mut mr) as i64,
            );
            Gpu {
                dptr,
                mr,
                desc: fi_mr_desc(mr),
                key: fi_mr_key(mr),
            }
        }
    }
}

const FLAG_OFF: usize = MAX_SIZE;
const STAGE_OFF: usize = MAX_SIZE + 8;

impl Side {
    fn open(o: &Opts) -> Side {
        // SAFETY (whole function): plain libfabric setup; every out-pointer is a local or a
        // field, every struct passed is initialised, and the info list outlives its use.
        unsafe {
            let h = fi_allocinfo();
            (*h).caps =
                (FI_RMA | FI_WRITE | FI_REMOTE_WRITE) as u64 | if o.cuda { FI_HMEM } else { 0 };
            (*h).mode = FI_CONTEXT | FI_CONTEXT2;
            (*(*h).ep_attr).type_ = FI_EP_RDM;
            (*(*h).domain_attr).mr_mode = (FI_MR_LOCAL
                | FI_MR_VIRT_ADDR
                | FI_MR_ALLOCATED
                | FI_MR_PROV_KEY
                | if o.cuda { FI_MR_HMEM } else { 0 })
                as i32;
            (*(*h).domain_attr).threading = FI_THREAD_DOMAIN;
            (*(*h).tx_attr).msg_order = FI_ORDER_RMA_WAW | FI_ORDER_WAW as u64;
            if o.dc {
                (*(*h).tx_attr).op_flags = FI_DELIVERY_COMPLETE as u64;
            }
            let mut list = ptr::null_mut();
            ck(
                "fi_getinfo",
                fi_getinfo(FI_VERSION(1, 17), ptr::null(), ptr::null(), 0, h, &mut list) as i64,
            );
            fi_freeinfo(h);
            // First info whose provider (or its core) matches and whose domain fits; socket
            // providers default to loopback IPv4.
            let mut pick = ptr::null_mut();
            let mut p = list;
            while !p.is_null() {
                let i = &*p;
                let prov = cstr((*i.fabric_attr).prov_name);
                let dom = cstr((*i.domain_attr).name);
                let fab = cstr((*i.fabric_attr).name);
                let prov_ok = prov == o.provider || prov.split(';').next() == Some(&o.provider);
                let dom_ok = match &o.domain {
                    Some(d) => *d == dom || *d == fab,
                    None => {
                        i.addr_format != FI_SOCKADDR_IN && i.addr_format != FI_SOCKADDR_IN6
                            || (i.addr_format == FI_SOCKADDR_IN && fab.starts_with("127."))
                    }
                };
                if prov_ok && dom_ok {
                    pick = p;
                    break;
                }
                p = i.next;
            }
            assert!(
                !pick.is_null(),
                "no RDM+RMA info for provider {} domain {:?}",
                o.provider,
                o.domain
            );
            let info = fi_dupinfo(pick);
            fi_freeinfo(list);
            let mut s = Side {
                info,
                ep: ptr::null_mut(),
                cq: ptr::null_mut(),
                av: ptr::null_mut(),
                mr: ptr::null_mut(),
                domain: ptr::null_mut(),
                fabric: ptr::null_mut(),
                // Written, not just allocated: a zeroed Vec comes from calloc as untouched pages,
                // which the kernel maps to its one zero page, so every transfer would read the
                // same cache-hot 4 KiB (shm's process_vm_readv ran ~2.5x faster that way than
                // from real memory). The flag words after MAX_SIZE start at 0.
                buf: (0..(MAX_SIZE + 64) / 8)
                    .map(|i| {
                        if i < MAX_SIZE / 8 {
                            0x0101_0101_0101_0101u64
                        } else {
                            0
                        }
                    })
                    .collect(),
                desc: ptr::null_mut(),
                virt: (*(*info).domain_attr).mr_mode as u32 & FI_MR_VIRT_ADDR != 0,
                key: 0,
                peer: 0,
                peer_base: 0,
                peer_key: 0,
                dc: o.dc,
                data_first: o.data_first,
                outstanding: 0,
                ctx: Box::new([fi_context2::default(); 64]),
                gpu: None,
                peer_gpu: (0, 0),
            };
            ck(
                "fi_fabric",
                fi_fabric((*info).fabric_attr, &mut s.fabric, ptr::null_mut()) as i64,
            );
            ck(
                "fi_domain",
                fi_domain(s.fabric, info, &mut s.domain, ptr::null_mut()) as i64,
            );
            let mut av_attr = fi_av_attr {
                type_: FI_AV_TABLE,
                ..Default::default()
            };
            ck(
                "fi_av_open",
                fi_av_open(s.domain, &mut av_attr, &mut s.av, ptr::null_mut()) as i64,
            );
            let mut cq_attr = fi_cq_attr {
                size: 1024,
                format: FI_CQ_FORMAT_CONTEXT,
                wait_obj: FI_WAIT_NONE,
                ..Default::default()
            };
            ck(
                "fi_cq_open",
                fi_cq_open(s.domain, &mut cq_attr, &mut s.cq, ptr::null_mut()) as i64,
            );
            ck(
                "fi_endpoint",
                fi_endpoint(s.domain, info, &mut s.ep, ptr::null_mut()) as i64,
            );
            ck(
                "fi_ep_bind av",
                fi_ep_bind(s.ep, &mut (*s.av).fid, 0) as i64,
            );
            ck(
                "fi_ep_bind cq",
                fi_ep_bind(s.ep, &mut (*s.cq).fid, (FI_TRANSMIT | FI_RECV) as u64) as i64,
            );
            // A dead process that had our pid may have left its shm files (EBUSY otherwise).
            libfabric_sys::remove_stale_shm_files();
            ck("fi_enable", fi_enable(s.ep) as i64);
            let bytes = s.buf.len() * 8;
            ck(
                "fi_mr_reg",
                fi_mr_reg(
                    s.domain,
                    s.buf.as_ptr().cast(),
                    bytes,
                    (FI_WRITE | FI_REMOTE_WRITE) as u64,
                    0,
                    1 + o.child as u64,
                    0,
                    &mut s.mr,
                    ptr::null_mut(),
                ) as i64,
            );
            s.key = fi_mr_key(s.mr);
            s.desc = fi_mr_desc(s.mr);
            if o.cuda || o.pinned {
                s.gpu = Some(Gpu::new(s.domain, MAX_SIZE, 11 + o.child as u64, o.pinned));
            }
            s
        }
    }

    fn describe(&self) -> String {
        // SAFETY: info is valid for the life of self.
        unsafe {
            format!(
                "{} domain {} ({})",
                cstr((*(*self.info).fabric_attr).prov_name),
                cstr((*(*self.info).domain_attr).name),
                cstr((*(*self.info).fabric_attr).name)
            )
        }
    }

    /// "hexaddr base key" for the peer.
    fn card(&self) -> String {
        let mut buf = vec![0u8; 256];
        let mut len = buf.len();
        // SAFETY: ep open; buf writable for len bytes.
        ck("fi_getname", unsafe {
            fi_getname(&mut (*self.ep).fid, buf.as_mut_ptr().cast(), &mut len)
        } as i64);
        buf.truncate(len);
        let hex: String = buf.iter().map(|b| format!("{b:02x}")).collect();
        let base = if self.virt {
            self.buf.as_ptr() as u64
        } else {
            0
        };
        let (gbase, gkey) = self
            .gpu
            .as_ref()
            .map_or((0, 0), |g| (if self.virt { g.dptr } else { 0 }, g.key));
        format!("{hex} {base} {} {gbase} {gkey}", self.key)
    }

    fn connect(&mut self, card: &str) {
        let mut it = card.split_whitespace();
        let hex = it.next().expect("address");
        let raw: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        self.peer_base = it.next().unwrap().parse().unwrap();
        self.peer_key = it.next().unwrap().parse().unwrap();
        self.peer_gpu = (
            it.next().unwrap().parse().unwrap(),
            it.next().unwrap().parse().unwrap(),
        );
        // SAFETY: av open; raw is one address of this provider's format.
        let n = unsafe {
            fi_av_insert(
                self.av,
                raw.as_ptr().cast(),
                1,
                &mut self.peer,
                0,
                ptr::null_mut(),
            )
        };
        assert_eq!(n, 1, "fi_av_insert");
    }

    /// Reads completions; returns how many.
    fn poll(&mut self) -> usize {
        let mut e = [fi_cq_entry::default(); 16];
        // SAFETY: cq open, room for 16 context entries.
        let rc = unsafe { fi_cq_read(self.cq, e.as_mut_ptr().cast(), 16) } as i64;
        if rc > 0 {
            self.outstanding -= rc as usize;
            return rc as usize;
        }
        if rc == -(FI_EAGAIN as i64) {
            return 0;
        }
        let mut err = fi_cq_err_entry::default();
        // SAFETY: cq open.
        unsafe { fi_cq_readerr(self.cq, &mut err, 0) };
        // SAFETY: static string.
        panic!(
            "completion error: {}",
            cstr(unsafe { fi_strerror(err.err) })
        );
    }

    /// Posts a write of `len` bytes at local offset `loff` to remote offset `roff`, retrying
    /// on -FI_EAGAIN after progressing.
    fn write(&mut self, loff: usize, roff: usize, len: usize) {
        let host = (
            self.buf.as_ptr() as u64,
            self.desc,
            self.peer_base,
            self.peer_key,
        );
        self.write_in(host, loff, roff, len)
    }

    /// A bulk write: between the device buffers with `--cuda`, else as `write`.
    fn write_bulk(&mut self, loff: usize, roff: usize, len: usize) {
        match &self.gpu {
            Some(g) => {
                let dev = (g.dptr, g.desc, self.peer_gpu.0, self.peer_gpu.1);
                self.write_in(dev, loff, roff, len)
            }
            None => self.write(loff, roff, len),
        }
    }

    /// Posts a write from `base + loff` (registered with `desc`) to the peer's `(rbase, rkey)`
    /// region at `roff`, retrying on -FI_EAGAIN after progressing.
    fn write_in(
        &mut self,
        (base, desc, rbase, rkey): (u64, *mut c_void, u64, u64),
        loff: usize,
        roff: usize,
        len: usize,
    ) {
        let t0 = Instant::now();
        let iov = iovec {
            iov_base: (base as usize + loff) as *mut c_void,
            iov_len: len,
        };
        let rma = fi_rma_iov {
            addr: rbase + roff as u64,
            len,
            key: rkey,
        };
        let mut desc = desc;
        let slot = self.outstanding % self.ctx.len();
        let msg = fi_msg_rma {
            msg_iov: &iov,
            desc: &mut desc,
            iov_count: 1,
            addr: self.peer,
            rma_iov: &rma,
            rma_iov_count: 1,
            context: (&mut self.ctx[slot] as *mut fi_context2).cast(),
            data: 0,
        };
        let flags = FI_COMPLETION as u64
            | if self.dc {
                FI_DELIVERY_COMPLETE as u64
            } else {
                0
            };
        loop {
            // SAFETY: msg and what it points to live through the call; the source is in the
            // registered buffer, which outlives the operation.
            let rc = unsafe { fi_writemsg(self.ep, &msg, flags) } as i64;
            if rc == 0 {
                break;
            }
            assert_eq!(rc, -(FI_EAGAIN as i64), "fi_writemsg: {rc}");
            self.poll();
            assert!(t0.elapsed() < DEADLINE, "write stuck on -FI_EAGAIN");
        }
        self.outstanding += 1;
    }

    fn flag(&self) -> u64 {
        // SAFETY: in bounds, aligned; written by the peer through RMA.
        unsafe {
            std::sync::atomic::AtomicU64::from_ptr(self.buf.as_ptr().add(FLAG_OFF / 8) as *mut u64)
        }
        .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Sends `v` to the peer's flag word (from our staging word: one flag in flight at a time
    /// in this protocol, each preceded by waiting for the previous flag's echo).
    fn send_flag(&mut self, v: u64) {
        if self.data_first {
            // Ordered before the flag by WAW, as our putWithSignal's data write is.
            self.write(0, 0, 8);
        }
        self.buf[STAGE_OFF / 8] = v;
        self.write(STAGE_OFF, FLAG_OFF, 8);
    }

    /// Waits until our flag reaches `v`, progressing.
    fn wait_flag(&mut self, v: u64) {
        let t0 = Instant::now();
        while self.flag() < v {
            self.poll();
            assert!(t0.elapsed() < DEADLINE, "flag {v} never arrived");
        }
    }

    fn drain(&mut self) {
        let t0 = Instant::now();
        while self.outstanding > 0 {
            self.poll();
            assert!(t0.elapsed() < DEADLINE, "completions never arrived");
        }
    }
}

impl Drop for Side {
    fn drop(&mut self) {
        // SAFETY: each object is open and closed once, in dependency order.
        unsafe {
            if let Some(g) = &self.gpu {
                fi_close(&mut (*g.mr).fid);
            }
            fi_close(&mut (*self.mr).fid);
            fi_close(&mut (*self.ep).fid);
            fi_close(&mut (*self.cq).fid);
            fi_close(&mut (*self.av).fid);
            fi_close(&mut (*self.domain).fid);
            fi_close(&mut (*self.fabric).fid);
            fi_freeinfo(self.info);
        }
    }
}

/// `--exchange`, run by both sides alike: per size, warm-up then timed iterations of "write
/// the size's bytes and a flag to the peer, wait for its flag"; flags count iterations on both
/// sides, so the n-th wait is for the peer's n-th. `print`: the side that prints the rows.
fn exchange(s: &mut Side, o: &Opts, print: bool) {
    let (b, e, f) = o.exchange.expect("--exchange");
    if print {
        println!(
            "# raw libfabric sendrecv (fi_write then a flag, both ways, then wait for the peer's flag): {}, 2 processes",
            s.describe()
        );
        println!("#\n#                                                   out-of-place");
        println!(
            "#       size         count      type   redop    root     time   algbw   busbw #wrong"
        );
        println!("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)");
    }
    let mut v = 0u64;
    let mut size = b;
    let mut sum = 0.0;
    let mut rows = 0;
    while size <= e {
        for n in [5, o.exchange_iters] {
            let t = Instant::now();
            for _ in 0..n {
                v += 1;
                s.write_bulk(0, 0, size);
                s.send_flag(v);
                s.wait_flag(v);
                s.drain();
            }
            let us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
            if print && n == o.exchange_iters {
                let bw = size as f64 / us / 1e3;
                sum += bw;
                rows += 1;
                println!(
                    "{size:>12}  {size:>12}  {:>8}  {:>6}  {:>6}  {us:>7.2}  {bw:>6.2}  {bw:>6.2}  {:>6}",
                    "uint8", "none", -1, "N/A"
                );
            }
        }
        size *= f;
    }
    if print {
        println!(
            "# Avg bus bandwidth    : {} \n#",
            if rows > 0 { sum / rows as f64 } else { 0.0 }
        );
    }
}

/// Target: echo every new flag value back until u64::MAX (or, with `--exchange`, the same
/// schedule as the parent).
fn child(o: &Opts) {
    let mut s = Side::open(o);
    println!("{}", s.card());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    s.connect(line.trim());
    if o.exchange.is_some() {
        return exchange(&mut s, o, false);
    }
    let mut last = 0;
    let mut t0 = Instant::now();
    // Ends on the u64::MAX flag, or when nothing arrives for DEADLINE.
    loop {
        s.poll();
        let v = s.flag();
        if v != last {
            last = v;
            s.drain();
            s.send_flag(v);
            t0 = Instant::now();
            if v == u64::MAX {
                s.drain();
                break;
            }
        }
        assert!(t0.elapsed() < DEADLINE, "target idle too long");
    }
}

fn main() {
    let o = opts();
    if o.child {
        return child(&o);
    }
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    args.push("--child".into());
    let mut kid = Command::new(std::env::current_exe().unwrap())
        .args(&args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawning the target process");
    let mut s = Side::open(&o);
    let mut out = BufReader::new(kid.stdout.take().unwrap());
    let mut card = String::new();
    out.read_line(&mut card).unwrap();
    s.connect(card.trim());
    writeln!(kid.stdin.as_mut().unwrap(), "{}", s.card()).unwrap();
    if o.exchange.is_some() {
        exchange(&mut s, &o, true);
        let st = kid.wait().unwrap();
        assert!(st.success(), "target process failed: {st}");
        return;
    }

    println!(
        "raw libfabric RMA baseline: {}, 2 processes, delivery-complete {}, {} buffers{}",
        s.describe(),
        if o.dc { "on" } else { "off" },
        if o.cuda {
            "CUDA device (FI_HMEM)"
        } else if o.pinned {
            "pinned host (cuMemHostAlloc)"
        } else {
            "host"
        },
        if o.spread {
            ", writes spread over 64 MiB"
        } else {
            ""
        }
    );
    let mut v = 0u64;
    // Warm-up (connection setup) and the 8-byte half round trip.
    for _ in 0..100 {
        v += 1;
        s.send_flag(v);
        s.wait_flag(v);
        s.drain();
    }
    let mut lat: Vec<f64> = Vec::with_capacity(o.iters);
    for _ in 0..o.iters {
        v += 1;
        let t = Instant::now();
        s.send_flag(v);
        s.wait_flag(v);
        lat.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        s.drain();
    }
    lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let pct = |p: f64| lat[((lat.len() - 1) as f64 * p) as usize];

    println!(
        "{:>10} {:>7} {:>10} {:>8}",
        "size", "iters", "time_ms", "GB/s"
    );
    let mut size = o.min_kib << 10;
    while size <= o.max_mib << 20 {
        let iters = ((o.volume_mib << 20) / size).clamp(8, 4000);
        for timed in [false, true] {
            let n = if timed { iters } else { iters.min(8) };
            let t = Instant::now();
            for k in 0..n {
                // Keep at most WINDOW writes in flight.
                while s.outstanding >= WINDOW {
                    s.poll();
                }
                let slots = if o.spread { MAX_SIZE / size } else { 2 };
                let off = if size * 2 <= MAX_SIZE {
                    (k % slots) * size
                } else {
                    0
                };
                s.write_bulk(off, off, size);
            }
            // The flag is ordered after the data (WAW); its echo means all data arrived.
            v += 1;
            s.send_flag(v);
            s.wait_flag(v);
            s.drain();
            if timed {
                let secs = t.elapsed().as_secs_f64();
                let label = if size >= 1 << 20 {
                    format!("{} MiB", size >> 20)
                } else {
                    format!("{} KiB", size >> 10)
                };
                println!(
                    "{label:>10} {n:>7} {:>10.2} {:>8.2}",
                    secs * 1e3,
                    (size * n) as f64 / secs / 1e9
                );
            }
        }
        size *= 4;
    }
    let what = if o.data_first {
        "8 B put + flag"
    } else {
        "8 B put"
    };
    println!(
        "{what} half round trip: median {:.2} us, p10 {:.2} us, p99 {:.2} us ({} round trips)",
        pct(0.5),
        pct(0.1),
        pct(0.99),
        lat.len()
    );
    s.send_flag(u64::MAX);
    s.wait_flag(u64::MAX);
    s.drain();
    let st = kid.wait().unwrap();
    assert!(st.success(), "target process failed: {st}");
}
