//! Every environment variable the library reads, read once per process, validated, in one
//! place. A bad value is kept as a [`Config::problems`] line naming the variable, the value and
//! what is used instead; the log reports those lines once, when it starts (`log::enabled`).
//!
//! Other modules take their settings from [`get`] (or from a [`NetConfig`] / [`P2pConfig`]
//! handed to them, so that a test can open an endpoint with settings of its own without
//! touching the process environment). `tests/config_vars.rs` checks that README's table of
//! variables names exactly [`VARIABLES`].

use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// Every variable read here (`every_variable_read_is_listed` keeps it complete); README's
/// table of variables is checked against it.
pub const VARIABLES: &[&str] = &[
    "MSCCLPP_DEBUG",
    "MSCCLPP_BOOTSTRAP_TIMEOUT",
    "MSCCLPP_BOOTSTRAP_SECRET",
    "MSCCLPP_BOOTSTRAP_QUOTA_MB",
    "MSCCLPP_SOCKET_IFNAME",
    "MSCCLPP_WAIT_TIMEOUT",
    "MSCCLPP_DEVICE_WAIT_TIMEOUT",
    "MSCCLPP_WAIT_MODE",
    "MSCCLPP_HANG_REPORT",
    "MSCCLPP_DISABLE_CUDA",
    "MSCCLPP_NET_PROVIDER",
    "FI_PROVIDER",
    "MSCCLPP_IBDEV_MAP",
    "MSCCLPP_NET_IFACE",
    "MSCCLPP_NET_ADDR",
    "MSCCLPP_NET_TX_DEPTH",
    "MSCCLPP_NET_MAX_CHUNK",
    "MSCCLPP_NET_RAILS",
    "MSCCLPP_NET_STRIPE_CHUNK",
    "MSCCLPP_NET_DELIVERY_COMPLETE",
    "MSCCLPP_NET_CQ_SIGNALS",
    "MSCCLPP_NET_HMEM",
    "MSCCLPP_NET_STAGING_BYTES",
    "MSCCLPP_NET_STAGING_SLOTS",
    "MSCCLPP_NET_STAGING_CHUNK",
    "MSCCLPP_NET_STAGING_BOUNCE",
    "MSCCLPP_SHM_INLINE_BYTES",
    "MSCCLPP_P2P_ENGINE",
    "MSCCLPP_P2P_SM_MAX_BYTES",
    "MSCCLPP_P2P_SM_BLOCKS",
    "MSCCLPP_P2P_SM_LINGER_US",
    "MSCCLPP_P2P_SM_SOLO_BYTES",
    "MSCCLPP_P2P_SM_SHARED",
    "MSCCLPP_P2P_SM_POLL_NS",
    "MSCCLPP_P2P_SM_SELFTEST",
    "MSCCLPP_P2P_DONE_WORD",
    "MSCCLPP_P2P_DIRECT_BYTES",
    "MSCCLPP_P2P_DIRECT_BLOCK_BYTES",
    "MSCCLPP_P2P_FLAG",
    "MSCCLPP_P2P_STATS",
    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "MSCCLPP_TEST_FORCE_STAGING",
    "MSCCLPP_TEST_FORCE_MR_ENDPOINT",
    "MSCCLPP_TEST_SYSFS_ROOT",
    "MSCCLPP_TEST_PROXY_PANIC",
    "MSCCLPP_TEST_UNORDERED",
    "MSCCLPP_TEST_ROOMY",
];

/// `MSCCLPP_NET_RAILS`: default and largest value.
pub const DEFAULT_RAILS: usize = 4;
pub const MAX_RAILS: usize = 16;
/// `MSCCLPP_P2P_DIRECT_BYTES`: default and largest value. A direct put is copied by the one
/// thread that calls it, so the default is where that copy stops arriving sooner than a put
/// handed to the proxy (the estimate, and how the GPU check measures it: docs/DESIGN-NOTES.md,
/// "The direct path"); the limit keeps a misconfigured thread from copying megabytes alone.
pub const P2P_DIRECT_BYTES: u64 = 4096;
pub const P2P_DIRECT_MAX: u64 = 1 << 20;
/// `MSCCLPP_P2P_DIRECT_BLOCK_BYTES`: default and largest value. A block put is copied by every
/// thread of the calling block, so its crossing with the proxy lies where a block's copy
/// stops arriving sooner (measured by the GPU check's `pingpong --block --sweep`:
/// docs/DESIGN-NOTES.md, "The direct path").
pub const P2P_DIRECT_BLOCK_BYTES: u64 = 512 << 10;
pub const P2P_DIRECT_BLOCK_MAX: u64 = 1 << 30;
/// `MSCCLPP_NET_STRIPE_CHUNK`: default and smallest value.
pub const DEFAULT_STRIPE_CHUNK: u64 = 1 << 20;
pub const MIN_STRIPE_CHUNK: u64 = 4096;

/// How much the library logs (`MSCCLPP_DEBUG`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    Off,
    Warn,
    Info,
    Trace,
}

/// Settings of the libfabric transport (`transport::net`). Tests open endpoints with one of
/// their own (`NetEndpoint::open`): the environment is shared by the tests of a process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetConfig {
    /// `MSCCLPP_NET_PROVIDER`, else `FI_PROVIDER` unless that is an exclusion list (`^...`):
    /// the providers to consider, in order.
    pub providers: Option<Vec<String>>,
    /// `MSCCLPP_NET_IFACE`: the interface (the domain name of socket providers).
    pub iface: Option<String>,
    /// `MSCCLPP_IBDEV_MAP`: `from=to` pairs for the `ibDev` names programs pass (see
    /// [`NetConfig::map_ibdev`]), in the order given.
    pub ibdev_map: Vec<(String, String)>,
    /// `MSCCLPP_NET_ADDR`: the local address to bind (node + FI_SOURCE).
    pub addr: Option<String>,
    /// `MSCCLPP_NET_TX_DEPTH`: outstanding operations per endpoint (default: the provider's).
    pub tx_depth: Option<usize>,
    /// `MSCCLPP_NET_MAX_CHUNK`: the largest single write (default: the provider's max_msg).
    pub max_chunk: Option<u64>,
    /// `MSCCLPP_NET_RAILS`: the most NICs one endpoint stripes over when the library chooses
    /// them (1..=16; 1 = one NIC). Named rails (`ibDev` `a+b`) are all used.
    pub rails: usize,
    /// `MSCCLPP_NET_STRIPE_CHUNK`: bytes per stripe of a put spread over several rails; a put
    /// of at most this many bytes goes on the first rail alone.
    pub stripe_chunk: u64,
    /// `MSCCLPP_NET_DELIVERY_COMPLETE=0` turns it off: flush then means locally complete.
    pub delivery_complete: bool,
    /// `MSCCLPP_NET_CQ_SIGNALS=0` turns off signals carried as remote CQ data
    /// (`transport::net::signals`): every signal is then an 8-byte write of its own.
    pub cq_signals: bool,
    /// `MSCCLPP_NET_HMEM`: when GPU memory is registered with FI_HMEM (see [`Hmem`]).
    pub hmem: Hmem,
    /// `MSCCLPP_NET_STAGING_BYTES`: bytes of each peer's staging ring.
    pub staging_bytes: Option<u64>,
    /// `MSCCLPP_NET_STAGING_SLOTS`: records in each staging inbox.
    pub staging_slots: Option<u64>,
    /// `MSCCLPP_NET_STAGING_CHUNK`: bytes per staged chunk (default: a quarter of the ring).
    pub staging_chunk: Option<u64>,
    /// `MSCCLPP_NET_STAGING_BOUNCE`: pinned bounce slots (one chunk each) for staged sources.
    pub staging_bounce: Option<u64>,
    /// `MSCCLPP_TEST_FORCE_STAGING=1` (tests): host regions staged as GPU memory is.
    pub force_staging: bool,
    /// `MSCCLPP_TEST_FORCE_STAGING=source` (tests): host regions registered as they are, but
    /// every write from one copied out through the bounce slots first, as from GPU memory
    /// without FI_HMEM: a staged source into a peer's host memory.
    pub force_staged_source: bool,
    /// `MSCCLPP_TEST_FORCE_MR_ENDPOINT=1` (tests): the FI_MR_ENDPOINT registration sequence.
    pub force_mr_endpoint: bool,
    /// `MSCCLPP_TEST_SYSFS_ROOT` (tests): where the PCI topology is read from, for choosing
    /// the NIC nearest to a rank's GPU (default `/sys`).
    pub sysfs_root: String,
    /// `MSCCLPP_TEST_UNORDERED=efa|psm3[:seed]` (tests): a layer over the real provider that
    /// delays and reorders writes and their completions as far as that profile allows, and
    /// enforces its rules (`transport::net::unordered`).
    pub unordered: Option<Unordered>,
}

/// A provider the unordered test layer plays (`MSCCLPP_TEST_UNORDERED`), by its rules in
/// docs/PROVIDERS.md (`transport::net::unordered` says how each is played).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnorderedProfile {
    /// HPE Slingshot's cxi: every write ordered; remote CQ data on a write refused; provider
    /// keys, offsets, FI_MR_ENDPOINT.
    Cxi,
    /// EFA's RDM endpoint (efa-rdm): no write ordered after another, no FI_FENCE; 4-byte remote
    /// CQ data without receives, repeated on every segment of a write above the segment size
    /// (small in tests); every local buffer needs its descriptor (FI_MR_LOCAL).
    Efa,
    /// psm3: two writes ordered when both are below 4 KiB; no FI_FENCE.
    Psm3,
    /// verbs RC through rxm: two writes ordered when both are below the port's largest message
    /// (small in tests); 4-byte remote CQ data; FI_MR_LOCAL; no FI_FENCE.
    Verbs,
}

/// `MSCCLPP_TEST_UNORDERED`: the profile, and the seed of its choices (None: from the clock
/// and pid, logged so that a failing run can be repeated).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unordered {
    pub profile: UnorderedProfile,
    pub seed: Option<u64>,
}

impl Default for NetConfig {
    fn default() -> Self {
        NetConfig {
            providers: None,
            iface: None,
            ibdev_map: Vec::new(),
            addr: None,
            tx_depth: None,
            max_chunk: None,
            rails: DEFAULT_RAILS,
            stripe_chunk: DEFAULT_STRIPE_CHUNK,
            delivery_complete: true,
            cq_signals: true,
            hmem: Hmem::Auto,
            staging_bytes: None,
            staging_slots: None,
            staging_chunk: None,
            staging_bounce: None,
            force_staging: false,
            force_staged_source: false,
            force_mr_endpoint: false,
            sysfs_root: "/sys".into(),
            unordered: None,
        }
    }
}

/// When GPU memory goes to the provider with FI_HMEM rather than staged through pinned host
/// memory (`MSCCLPP_NET_HMEM`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hmem {
    /// `auto` (default): where the provider registers CUDA memory, except on providers where
    /// FI_HMEM was measured slower than staging (`transport::net`, bench/RESULTS.md).
    Auto,
    /// `1`: wherever the provider registers CUDA memory.
    Always,
    /// `0`: never; GPU memory is always staged.
    Never,
}

/// How a wait that lasts spends its time (`MSCCLPP_WAIT_MODE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitMode {
    /// `auto` (default): polls, unless this host runs more ranks than the process has cores
    /// (`sync::note_ranks_on_host`); then waits that last nap between their polls.
    Auto,
    /// `poll`: never naps in waits for a peer or the provider (spins and yields).
    Poll,
    /// `sleep`: naps in waits that last, however many cores there are.
    Sleep,
}

/// When the library writes a hang report (`MSCCLPP_HANG_REPORT`; `comm::hang`): the pending
/// waits and signal counts of every rank of a communicator, combined into one summary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HangReport {
    /// When a host wait times out (or the proxy reports a kernel's wait past the timeout).
    pub on_timeout: bool,
    /// On `SIGUSR1` (a handler is installed with the first communicator, chaining any handler
    /// the program had; see `comm::hang::signal`).
    pub on_signal: bool,
    /// Every this often, by each rank that has had a wait pending for at least as long.
    pub every: Option<Duration>,
}

impl Default for HangReport {
    /// `signal`: on timeouts and on `SIGUSR1`, nothing periodic.
    fn default() -> Self {
        HangReport {
            on_timeout: true,
            on_signal: true,
            every: None,
        }
    }
}

/// What an `ibDev` name resolved to (`NetConfig::map_ibdev`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum IbDev {
    /// The library's own choice of domain (`ibDev` NULL, or mapped to `auto`).
    Auto,
    /// This domain or fabric name, as the program passed it (no mapping applies).
    Named(String),
    /// This domain or fabric name, which `MSCCLPP_IBDEV_MAP` maps the program's name to.
    Mapped { from: String, to: String },
    /// `MSCCLPP_IBDEV_MAP` maps the program's name to `auto`.
    MappedAuto { from: String },
}

impl IbDev {
    /// The domain to open (None: the library's choice).
    pub fn domain(&self) -> Option<&str> {
        match self {
            IbDev::Named(d) | IbDev::Mapped { to: d, .. } => Some(d),
            IbDev::Auto | IbDev::MappedAuto { .. } => None,
        }
    }
}

impl NetConfig {
    /// The domain for the `ibDev` name a program passed: the first `from=to` pair whose `from`
    /// is that name, else a `*=to` pair; `to` is a domain or fabric name, or `auto`. A name no
    /// pair maps stays as it is; NULL is always the library's choice.
    pub fn map_ibdev(&self, name: Option<&str>) -> IbDev {
        let Some(name) = name else {
            return IbDev::Auto;
        };
        let pair = self
            .ibdev_map
            .iter()
            .find(|(f, _)| f == name)
            .or_else(|| self.ibdev_map.iter().find(|(f, _)| f == "*"));
        match pair {
            None => IbDev::Named(name.to_string()),
            Some((_, to)) if to == "auto" => IbDev::MappedAuto {
                from: name.to_string(),
            },
            Some((_, to)) => IbDev::Mapped {
                from: name.to_string(),
                to: to.clone(),
            },
        }
    }
}

/// Settings of the CUDA IPC transport (`transport::p2p`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct P2pConfig {
    /// `MSCCLPP_P2P_ENGINE` is not `ce`: the SM copy engine takes small puts and flags.
    pub sm_engine: bool,
    /// `MSCCLPP_P2P_SM_MAX_BYTES`: the largest put the SM engine takes.
    pub sm_max_bytes: u64,
    /// `MSCCLPP_P2P_SM_BLOCKS`: the engine's blocks (1..=128).
    pub sm_blocks: u32,
    /// `MSCCLPP_P2P_SM_LINGER_US`: how long the engine stays resident without work.
    pub sm_linger: Duration,
    /// `MSCCLPP_P2P_SM_SOLO_BYTES`: puts up to this size are copied by one block.
    pub sm_solo_bytes: u64,
    /// `MSCCLPP_P2P_SM_POLL_NS`: the engine's pause between polls (at most 1 ms).
    pub sm_poll_ns: u32,
    /// `MSCCLPP_P2P_SM_SELFTEST=1`: time the engine's round trips once it starts.
    pub sm_selftest: bool,
    /// `MSCCLPP_P2P_DONE_WORD=0` turns it off: flush waits for the proxy to retire its Sync.
    pub done_word: bool,
    /// `MSCCLPP_P2P_DIRECT_BYTES`: kernels do puts of at most this many bytes, and signals and
    /// flushes, with their own stores into the peer's mapped memory when nothing of the
    /// connection is in the proxy's hands (docs/DESIGN.md 3.2); 0: every operation through
    /// the proxy. At most [`P2P_DIRECT_MAX`].
    pub direct_bytes: u64,
    /// `MSCCLPP_P2P_DIRECT_BLOCK_BYTES`: the same for a put copied by a whole block
    /// (`putBlock()`); 0: block puts go through the proxy. At most [`P2P_DIRECT_BLOCK_MAX`].
    pub direct_block_bytes: u64,
    /// `MSCCLPP_P2P_FLAG=copy`: flags by an 8-byte copy instead of `cuStreamWriteValue64`.
    pub flag_by_copy: bool,
    /// `MSCCLPP_P2P_STATS=1`: log driver call times and engine timings at close.
    pub stats: bool,
    /// `MSCCLPP_P2P_SM_SHARED=1`: the SM engine also carries work to a peer on this process's
    /// own GPU when an MPS daemon serves it (their kernels then run at once). Off by default:
    /// measured 1.55x faster at a 1 MiB all-gather, but the copy engines' work could then stop
    /// completing (bench/RESULTS.md, session 12). Without MPS it stays off for such peers.
    pub sm_shared: bool,
    /// `CUDA_MPS_PIPE_DIRECTORY` (CUDA's own variable; default `/tmp/nvidia-mps`): where an MPS
    /// daemon that this process's CUDA would use keeps its control socket.
    pub mps_pipe_dir: String,
    /// `CUDA_DEVICE_MAX_CONNECTIONS` (CUDA's own variable; unset: CUDA's default of 8): how many
    /// hardware work queues this process's streams share. At 1, the proxy's copies and the
    /// SM engine queue behind the program's own running kernel (measured: bench/RESULTS.md,
    /// session 13), so a kernel that waits for a P2P transfer stalls it; read to say so.
    pub cuda_max_connections: Option<u32>,
}

impl Default for P2pConfig {
    fn default() -> Self {
        P2pConfig {
            sm_engine: true,
            sm_max_bytes: 2 << 20,
            sm_blocks: 8,
            sm_linger: Duration::from_micros(500),
            sm_solo_bytes: 64 << 10,
            sm_poll_ns: 0,
            sm_selftest: false,
            done_word: true,
            direct_bytes: P2P_DIRECT_BYTES,
            direct_block_bytes: P2P_DIRECT_BLOCK_BYTES,
            flag_by_copy: false,
            stats: false,
            sm_shared: false,
            mps_pipe_dir: "/tmp/nvidia-mps".to_string(),
            cuda_max_connections: None,
        }
    }
}

/// The whole configuration of this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// `MSCCLPP_DEBUG`: WARN (default), INFO, TRACE, or NONE/OFF.
    pub log_level: LogLevel,
    /// `MSCCLPP_BOOTSTRAP_TIMEOUT` (seconds > 0); see [`bootstrap_timeout`].
    pub bootstrap_timeout: Option<Duration>,
    /// `MSCCLPP_WAIT_TIMEOUT` (seconds > 0); see [`wait_timeout`].
    pub wait_timeout: Option<Duration>,
    /// `MSCCLPP_DEVICE_WAIT_TIMEOUT` (seconds >= 0; 0: None, no bound); see
    /// [`device_wait_timeout`].
    pub device_wait_timeout: Option<Duration>,
    /// `MSCCLPP_WAIT_MODE`: how waits that last spend their time (see [`WaitMode`]).
    pub wait_mode: WaitMode,
    /// `MSCCLPP_HANG_REPORT`: `signal` (default: on timeouts and `SIGUSR1`), `timeout` (on
    /// timeouts only: no signal handler), `off`, or seconds (as `signal`, and every so often
    /// while a wait lasts that long).
    pub hang_report: HangReport,
    /// `MSCCLPP_SOCKET_IFNAME`: interfaces for the unique id's root address.
    pub socket_ifname: Option<String>,
    /// `MSCCLPP_BOOTSTRAP_SECRET`: a secret every rank of an `ip:port` communicator shares,
    /// mixed into its magic (`bootstrap::frame::addr_magic_with`).
    pub bootstrap_secret: Option<String>,
    /// `MSCCLPP_BOOTSTRAP_QUOTA_MB` (MiB, default 256): bytes of tagged messages one peer may
    /// leave unread in this rank's bootstrap mailbox before it is dropped as a flood.
    pub bootstrap_quota: u64,
    /// `MSCCLPP_DISABLE_CUDA=1`: host mode even where a CUDA driver exists.
    pub disable_cuda: bool,
    /// `MSCCLPP_SHM_INLINE_BYTES` (default [`SHM_INLINE_BYTES`], at most [`SHM_INLINE_MAX`]; 0 turns it
    /// off): SHM puts over host memory up to this size, on an idle connection, go inline through
    /// the peer's ring (`transport::inbox`).
    pub shm_inline_bytes: u64,
    pub net: NetConfig,
    pub p2p: P2pConfig,
    /// `MSCCLPP_TEST_PROXY_PANIC=N` (tests; unset or 0: never): the proxy's work panics at its
    /// N-th trigger (each FIFO counts its own), to show what a bug there does.
    pub test_proxy_panic: Option<u64>,
    /// `MSCCLPP_TEST_ROOMY=1` (tests): the host counts as having two cores per rank whatever
    /// it has (`sync::host_is_tight` stays false), so that what runs only there (inline puts
    /// that wait for room, short parks aside) is tested on a small machine too.
    pub test_roomy: bool,
    /// One line per variable whose value could not be used: name, value, what is used instead.
    pub problems: Vec<String>,
}

/// The largest SHM put that may go inline (`MSCCLPP_SHM_INLINE_BYTES` at most; the ring of
/// `transport::inbox` is sized for records of this size).
pub const SHM_INLINE_MAX: u64 = 16 << 10;

/// SHM puts over host memory up to this size go inline through the peer's ring when the
/// connection is idle (`MSCCLPP_SHM_INLINE_BYTES`).
pub const SHM_INLINE_BYTES: u64 = SHM_INLINE_MAX;

/// The bootstrap timeout when nothing sets it.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a kernel's wait may last when `MSCCLPP_DEVICE_WAIT_TIMEOUT` is unset: long enough
/// for any correct program (a peer writing a checkpoint for minutes; PyTorch's NCCL watchdog,
/// the usual outer bound of a training job's collectives, waits 10 minutes, so it reports
/// first), short enough that a deadlocked job frees its GPUs within the hour instead of at
/// the scheduler's wall-clock limit. The warning comes at the wait timeout, long before.
pub const DEFAULT_DEVICE_WAIT_TIMEOUT: Duration = Duration::from_secs(30 * 60);
/// Caps a configured timeout so that deadline arithmetic cannot overflow.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(365 * 24 * 3600);

/// Reads one variable at a time, keeping what was wrong.
struct Reader<'a> {
    get: &'a dyn Fn(&str) -> Option<String>,
    problems: Vec<String>,
}

impl Reader<'_> {
    /// The value, trimmed; `None` when unset or empty.
    fn text(&self, name: &str) -> Option<String> {
        (self.get)(name)
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    }

    fn bad(&mut self, name: &str, value: &str, expected: &str, instead: impl std::fmt::Display) {
        self.problems.push(format!(
            "ignoring {name}={value:?}: expected {expected}; using {instead}"
        ));
    }

    /// A number; a value that does not parse is reported and `None` is used.
    fn num<T: FromStr>(&mut self, name: &str, instead: &str) -> Option<T> {
        let s = self.text(name)?;
        match s.parse() {
            Ok(v) => Some(v),
            Err(_) => {
                self.bad(name, &s, "a non-negative integer", instead);
                None
            }
        }
    }

    /// A byte count up to `max` (more is `max`, said as a problem); unset or unusable is
    /// `default`.
    fn bytes_capped(&mut self, name: &str, default: u64, max: u64) -> u64 {
        match self.num::<u64>(name, &default.to_string()) {
            Some(b) if b > max => {
                self.problems.push(format!(
                    "{name}={b} is over the {max}-byte limit; using {max}"
                ));
                max
            }
            Some(b) => b,
            None => default,
        }
    }

    /// Seconds > 0 (fractions allowed), capped at [`MAX_TIMEOUT`].
    fn secs(&mut self, name: &str, instead: &str) -> Option<Duration> {
        let s = self.text(name)?;
        match parse_secs(&s) {
            Some(d) => Some(d),
            None => {
                self.bad(name, &s, "a number of seconds > 0", instead);
                None
            }
        }
    }

    /// Seconds >= 0 (fractions allowed, capped at [`MAX_TIMEOUT`]); `0` is None (no bound);
    /// unset or unusable is `default`.
    fn secs_or_zero(&mut self, name: &str, default: Option<Duration>) -> Option<Duration> {
        let Some(s) = self.text(name) else {
            return default;
        };
        if s.parse::<f64>().is_ok_and(|v| v == 0.0) {
            return None;
        }
        match parse_secs(&s) {
            Some(d) => Some(d),
            None => {
                let instead = default.map_or("no bound".into(), |d| format!("{d:?}"));
                self.bad(name, &s, "a number of seconds >= 0 (0: no bound)", instead);
                default
            }
        }
    }

    /// `0` or `1`; unset is `default`.
    fn flag(&mut self, name: &str, default: bool) -> bool {
        match self.text(name).as_deref() {
            None => default,
            Some("1") => true,
            Some("0") => false,
            Some(s) => {
                let s = s.to_string();
                self.bad(name, &s, "0 or 1", default as u8);
                default
            }
        }
    }

    /// Comma-separated `from=to` pairs, each side non-empty; a malformed pair is reported and
    /// left out, the others kept.
    fn pairs(&mut self, name: &str) -> Vec<(String, String)> {
        let Some(s) = self.text(name) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            match item.split_once('=').map(|(f, t)| (f.trim(), t.trim())) {
                Some((f, t)) if !f.is_empty() && !t.is_empty() && !t.contains('=') => {
                    out.push((f.to_string(), t.to_string()))
                }
                _ => self.problems.push(format!(
                    "ignoring {item:?} in {name}={s:?}: expected from=to (a name a program passes as ibDev, or *, = a libfabric domain or fabric name, or auto)"
                )),
            }
        }
        out
    }

    /// `cxi`, `efa`, `psm3` or `verbs`, optionally `:seed`; unset (or `0`) is `None`.
    fn unordered(&mut self, name: &str) -> Option<Unordered> {
        let s = self.text(name)?;
        let (p, seed) = match s.split_once(':') {
            Some((p, n)) => (p.trim().to_ascii_lowercase(), Some(n.trim())),
            None => (s.to_ascii_lowercase(), None),
        };
        let profile = match p.as_str() {
            "0" => return None,
            "cxi" => UnorderedProfile::Cxi,
            "efa" => UnorderedProfile::Efa,
            "psm3" => UnorderedProfile::Psm3,
            "verbs" => UnorderedProfile::Verbs,
            _ => {
                self.bad(
                    name,
                    &s,
                    "cxi, efa, psm3 or verbs, optionally :seed",
                    "the real provider alone",
                );
                return None;
            }
        };
        let seed = match seed.map(str::parse::<u64>) {
            None => None,
            Some(Ok(n)) => Some(n),
            Some(Err(_)) => {
                self.bad(
                    name,
                    &s,
                    "a seed that is a non-negative integer",
                    "a seed from the clock",
                );
                None
            }
        };
        Some(Unordered { profile, seed })
    }

    /// One of `choices` (case-insensitive), returned lower-case; unset is `None`.
    fn choice(&mut self, name: &str, choices: &[&str], instead: &str) -> Option<String> {
        let s = self.text(name)?;
        let l = s.to_ascii_lowercase();
        if choices.contains(&l.as_str()) {
            return Some(l);
        }
        self.bad(name, &s, &format!("one of {}", choices.join(", ")), instead);
        None
    }
}

/// `MSCCLPP_HANG_REPORT`: `signal`, `timeout`, `off`, or seconds > 0 (at least 1).
fn hang_report(r: &mut Reader<'_>) -> HangReport {
    const NAME: &str = "MSCCLPP_HANG_REPORT";
    let d = HangReport::default();
    let Some(s) = r.text(NAME) else { return d };
    match s.to_ascii_lowercase().as_str() {
        "signal" => d,
        "timeout" => HangReport {
            on_signal: false,
            ..d
        },
        "off" | "0" => HangReport {
            on_timeout: false,
            on_signal: false,
            every: None,
        },
        _ => match parse_secs(&s) {
            // A report every few milliseconds would be all the log says.
            Some(t) => HangReport {
                every: Some(t.max(Duration::from_secs(1))),
                ..d
            },
            None => {
                r.bad(
                    NAME,
                    &s,
                    "signal, timeout, off or a number of seconds",
                    "signal",
                );
                d
            }
        },
    }
}

/// Parses seconds > 0 (fractions allowed), capped at [`MAX_TIMEOUT`].
pub fn parse_secs(s: &str) -> Option<Duration> {
    let v: f64 = s.trim().parse().ok()?;
    (v.is_finite() && v > 0.0).then(|| Duration::from_secs_f64(v.min(MAX_TIMEOUT.as_secs_f64())))
}

fn list(s: &str) -> Option<Vec<String>> {
    let v: Vec<String> = s
        .split(',')
        .map(|x| x.trim().to_string())
        .filter(|x| !x.is_empty())
        .collect();
    (!v.is_empty()).then_some(v)
}

impl Config {
    /// Reads the process environment now.
    pub fn from_env() -> Self {
        Self::from_lookup(&|k| std::env::var(k).ok())
    }

    /// Reads every variable through `get` (a test passes a map).
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Self {
        let mut r = Reader {
            get,
            problems: Vec::new(),
        };
        let log_level = match r.choice(
            "MSCCLPP_DEBUG",
            &["warn", "info", "trace", "none", "off"],
            "WARN",
        ) {
            Some(s) if s == "info" => LogLevel::Info,
            Some(s) if s == "trace" => LogLevel::Trace,
            Some(s) if s == "none" || s == "off" => LogLevel::Off,
            _ => LogLevel::Warn,
        };
        let default_timeout = format!("{DEFAULT_TIMEOUT:?}");
        let net_default = NetConfig::default();
        let staging_forced = r.choice(
            "MSCCLPP_TEST_FORCE_STAGING",
            &["0", "1", "source"],
            "no staging forced",
        );
        let staging_forced = staging_forced.as_deref();
        let providers = r
            .text("MSCCLPP_NET_PROVIDER")
            .as_deref()
            .and_then(list)
            .or_else(|| {
                r.text("FI_PROVIDER")
                    .filter(|s| !s.starts_with('^'))
                    .as_deref()
                    .and_then(list)
            });
        let net = NetConfig {
            providers,
            iface: r.text("MSCCLPP_NET_IFACE"),
            ibdev_map: r.pairs("MSCCLPP_IBDEV_MAP"),
            addr: r.text("MSCCLPP_NET_ADDR"),
            tx_depth: r.num("MSCCLPP_NET_TX_DEPTH", "the provider's depth"),
            max_chunk: r.num("MSCCLPP_NET_MAX_CHUNK", "the provider's max_msg_size"),
            rails: r
                .num::<usize>("MSCCLPP_NET_RAILS", &DEFAULT_RAILS.to_string())
                .map_or(DEFAULT_RAILS, |n| n.clamp(1, MAX_RAILS)),
            stripe_chunk: r
                .num::<u64>(
                    "MSCCLPP_NET_STRIPE_CHUNK",
                    &DEFAULT_STRIPE_CHUNK.to_string(),
                )
                .map_or(DEFAULT_STRIPE_CHUNK, |n| n.max(MIN_STRIPE_CHUNK)),
            delivery_complete: r.flag(
                "MSCCLPP_NET_DELIVERY_COMPLETE",
                net_default.delivery_complete,
            ),
            cq_signals: r.flag("MSCCLPP_NET_CQ_SIGNALS", net_default.cq_signals),
            hmem: match r
                .choice("MSCCLPP_NET_HMEM", &["auto", "1", "0"], "auto")
                .as_deref()
            {
                Some("1") => Hmem::Always,
                Some("0") => Hmem::Never,
                _ => Hmem::Auto,
            },
            staging_bytes: r.num("MSCCLPP_NET_STAGING_BYTES", "the default"),
            staging_slots: r.num("MSCCLPP_NET_STAGING_SLOTS", "the default"),
            staging_chunk: r.num("MSCCLPP_NET_STAGING_CHUNK", "the default"),
            staging_bounce: r.num("MSCCLPP_NET_STAGING_BOUNCE", "the default"),
            force_staging: staging_forced == Some("1"),
            force_staged_source: staging_forced == Some("source"),
            force_mr_endpoint: r.flag(
                "MSCCLPP_TEST_FORCE_MR_ENDPOINT",
                net_default.force_mr_endpoint,
            ),
            sysfs_root: r
                .text("MSCCLPP_TEST_SYSFS_ROOT")
                .unwrap_or(net_default.sysfs_root),
            unordered: r.unordered("MSCCLPP_TEST_UNORDERED"),
        };
        let d = P2pConfig::default();
        let p2p = P2pConfig {
            sm_engine: r
                .choice("MSCCLPP_P2P_ENGINE", &["ce", "sm"], "sm")
                .as_deref()
                != Some("ce"),
            sm_max_bytes: r
                .num("MSCCLPP_P2P_SM_MAX_BYTES", &d.sm_max_bytes.to_string())
                .unwrap_or(d.sm_max_bytes),
            sm_blocks: r
                .num::<u32>("MSCCLPP_P2P_SM_BLOCKS", &d.sm_blocks.to_string())
                .unwrap_or(d.sm_blocks)
                .clamp(1, 128),
            sm_linger: r
                .num("MSCCLPP_P2P_SM_LINGER_US", "500")
                .map_or(d.sm_linger, Duration::from_micros),
            sm_solo_bytes: r
                .num("MSCCLPP_P2P_SM_SOLO_BYTES", &d.sm_solo_bytes.to_string())
                .unwrap_or(d.sm_solo_bytes),
            sm_poll_ns: r
                .num::<u64>("MSCCLPP_P2P_SM_POLL_NS", "0")
                .map_or(d.sm_poll_ns, |n| n.min(1_000_000) as u32),
            sm_selftest: r.flag("MSCCLPP_P2P_SM_SELFTEST", d.sm_selftest),
            done_word: r.flag("MSCCLPP_P2P_DONE_WORD", d.done_word),
            direct_bytes: r.bytes_capped(
                "MSCCLPP_P2P_DIRECT_BYTES",
                d.direct_bytes,
                P2P_DIRECT_MAX,
            ),
            direct_block_bytes: r.bytes_capped(
                "MSCCLPP_P2P_DIRECT_BLOCK_BYTES",
                d.direct_block_bytes,
                P2P_DIRECT_BLOCK_MAX,
            ),
            flag_by_copy: r
                .choice("MSCCLPP_P2P_FLAG", &["copy", "write"], "write")
                .as_deref()
                == Some("copy"),
            stats: r.flag("MSCCLPP_P2P_STATS", d.stats),
            sm_shared: r.flag("MSCCLPP_P2P_SM_SHARED", d.sm_shared),
            mps_pipe_dir: r.text("CUDA_MPS_PIPE_DIRECTORY").unwrap_or(d.mps_pipe_dir),
            cuda_max_connections: r.num("CUDA_DEVICE_MAX_CONNECTIONS", "CUDA's default"),
        };
        Config {
            log_level,
            bootstrap_timeout: r.secs("MSCCLPP_BOOTSTRAP_TIMEOUT", &default_timeout),
            wait_timeout: r.secs("MSCCLPP_WAIT_TIMEOUT", "the bootstrap timeout"),
            device_wait_timeout: r.secs_or_zero(
                "MSCCLPP_DEVICE_WAIT_TIMEOUT",
                Some(DEFAULT_DEVICE_WAIT_TIMEOUT),
            ),
            wait_mode: match r
                .choice("MSCCLPP_WAIT_MODE", &["auto", "poll", "sleep"], "auto")
                .as_deref()
            {
                Some("poll") => WaitMode::Poll,
                Some("sleep") => WaitMode::Sleep,
                _ => WaitMode::Auto,
            },
            hang_report: hang_report(&mut r),
            socket_ifname: r.text("MSCCLPP_SOCKET_IFNAME"),
            bootstrap_secret: r.text("MSCCLPP_BOOTSTRAP_SECRET"),
            bootstrap_quota: r
                .num::<u64>("MSCCLPP_BOOTSTRAP_QUOTA_MB", "256")
                .filter(|&m| m > 0)
                .unwrap_or(256)
                .saturating_mul(1 << 20),
            disable_cuda: r.flag("MSCCLPP_DISABLE_CUDA", false),
            shm_inline_bytes: r.bytes_capped(
                "MSCCLPP_SHM_INLINE_BYTES",
                SHM_INLINE_BYTES,
                SHM_INLINE_MAX,
            ),
            net,
            p2p,
            test_proxy_panic: r
                .num::<u64>("MSCCLPP_TEST_PROXY_PANIC", "no panic")
                .filter(|&n| n > 0),
            test_roomy: r.flag("MSCCLPP_TEST_ROOMY", false),
            problems: r.problems,
        }
    }
}

/// The process's configuration, read from the environment on first use.
pub fn get() -> &'static Config {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    CONFIG.get_or_init(Config::from_env)
}

/// Seconds set by [`set_bootstrap_timeout`]; 0 = not set. Relaxed: a plain value with no data
/// behind it.
static TIMEOUT_SET: AtomicU64 = AtomicU64::new(0);

/// The process-wide bootstrap timeout: [`set_bootstrap_timeout`] if called, else
/// `MSCCLPP_BOOTSTRAP_TIMEOUT`, else 30 s. Communicators read it when created.
pub fn bootstrap_timeout() -> Duration {
    let set = TIMEOUT_SET.load(Ordering::Relaxed);
    if set > 0 {
        return Duration::from_secs(set).min(MAX_TIMEOUT);
    }
    get().bootstrap_timeout.unwrap_or(DEFAULT_TIMEOUT)
}

/// Sets the bootstrap timeout for communicators created afterwards
/// (`mscclppSetBootstrapConnTimeout`); overrides the environment. `secs` must be > 0 (the
/// caller checks).
pub fn set_bootstrap_timeout(secs: u64) {
    TIMEOUT_SET.store(secs, Ordering::Relaxed);
}

/// How long host waits, and the proxy's waits for a provider or a device, may last before they
/// fail: `MSCCLPP_WAIT_TIMEOUT`, else the bootstrap timeout.
pub fn wait_timeout() -> Duration {
    get().wait_timeout.unwrap_or_else(bootstrap_timeout)
}

/// How long a kernel's `wait()`, `flush()` or push into a full FIFO may last before it ends
/// and the communicator fails (`MSCCLPP_DEVICE_WAIT_TIMEOUT`, default
/// [`DEFAULT_DEVICE_WAIT_TIMEOUT`]); None: no bound, the 2023 behaviour. Read when a FIFO is
/// made.
pub fn device_wait_timeout() -> Option<Duration> {
    get().device_wait_timeout
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn with(vars: &[(&str, &str)]) -> Config {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(&move |k| m.get(k).cloned())
    }

    #[test]
    fn seconds() {
        assert_eq!(parse_secs("5"), Some(Duration::from_secs(5)));
        assert_eq!(parse_secs(" 2.5 "), Some(Duration::from_millis(2500)));
        assert_eq!(parse_secs("1e30"), Some(MAX_TIMEOUT));
        for bad in ["", "0", "-3", "abc", "NaN", "inf", "5s"] {
            assert_eq!(parse_secs(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn defaults_when_nothing_is_set() {
        let c = with(&[]);
        assert!(c.problems.is_empty(), "{:?}", c.problems);
        assert_eq!(c.log_level, LogLevel::Warn);
        assert_eq!(c.p2p, P2pConfig::default());
        assert!(c.net.delivery_complete && c.net.hmem == Hmem::Auto && !c.net.force_staging);
        assert_eq!((c.bootstrap_timeout, c.wait_timeout), (None, None));
        assert_eq!(c.device_wait_timeout, Some(DEFAULT_DEVICE_WAIT_TIMEOUT));
        assert_eq!(c.hang_report, HangReport::default());
        assert_eq!(c.test_proxy_panic, None);
    }

    #[test]
    fn device_wait_timeout_zero_is_unbounded_and_bad_keeps_the_default() {
        let get = |v: &str| with(&[("MSCCLPP_DEVICE_WAIT_TIMEOUT", v)]);
        assert_eq!(get("0").device_wait_timeout, None);
        assert_eq!(get("0.0").device_wait_timeout, None);
        assert_eq!(get("5").device_wait_timeout, Some(Duration::from_secs(5)));
        assert_eq!(
            get("0.5").device_wait_timeout,
            Some(Duration::from_millis(500))
        );
        assert_eq!(get("1e30").device_wait_timeout, Some(MAX_TIMEOUT));
        for bad in ["-1", "soon", "inf"] {
            let c = get(bad);
            assert_eq!(
                c.device_wait_timeout,
                Some(DEFAULT_DEVICE_WAIT_TIMEOUT),
                "{bad}"
            );
            assert!(
                c.problems.len() == 1
                    && c.problems[0].contains("MSCCLPP_DEVICE_WAIT_TIMEOUT")
                    && c.problems[0].contains("using 1800s"),
                "{bad}: {:?}",
                c.problems
            );
        }
    }

    #[test]
    fn hang_report_values() {
        let h = |v: &str| with(&[("MSCCLPP_HANG_REPORT", v)]);
        let on = HangReport::default();
        assert!(on.on_timeout && on.on_signal && on.every.is_none());
        assert_eq!(h("SIGNAL").hang_report, on);
        assert_eq!(
            h("timeout").hang_report,
            HangReport {
                on_signal: false,
                ..on
            }
        );
        for off in ["off", "0"] {
            let c = h(off).hang_report;
            assert!(!c.on_timeout && !c.on_signal && c.every.is_none(), "{off}");
        }
        assert_eq!(h("30").hang_report.every, Some(Duration::from_secs(30)));
        assert_eq!(h("0.01").hang_report.every, Some(Duration::from_secs(1)));
        let bad = h("often");
        assert_eq!(bad.hang_report, on);
        assert!(
            bad.problems[0].contains("MSCCLPP_HANG_REPORT")
                && bad.problems[0].contains("using signal"),
            "{:?}",
            bad.problems
        );
    }

    #[test]
    fn good_values_are_taken() {
        let c = with(&[
            ("MSCCLPP_DEBUG", "info"),
            ("MSCCLPP_BOOTSTRAP_TIMEOUT", " 2.5 "),
            ("MSCCLPP_WAIT_TIMEOUT", "1e30"),
            ("MSCCLPP_NET_PROVIDER", "tcp, shm,"),
            ("MSCCLPP_NET_TX_DEPTH", "16"),
            ("MSCCLPP_NET_HMEM", "0"),
            ("MSCCLPP_P2P_ENGINE", "CE"),
            ("MSCCLPP_P2P_SM_BLOCKS", "1000"),
            ("MSCCLPP_P2P_FLAG", "copy"),
            ("MSCCLPP_P2P_DIRECT_BYTES", "0"),
            ("MSCCLPP_P2P_SM_SHARED", "1"),
            ("MSCCLPP_NET_STAGING_CHUNK", "1000"),
            ("MSCCLPP_NET_STAGING_BOUNCE", "8"),
            ("CUDA_DEVICE_MAX_CONNECTIONS", "1"),
            ("MSCCLPP_TEST_PROXY_PANIC", "3"),
        ]);
        assert!(c.problems.is_empty(), "{:?}", c.problems);
        assert_eq!(c.test_proxy_panic, Some(3));
        assert!(c.p2p.sm_shared);
        assert_eq!(c.p2p.cuda_max_connections, Some(1));
        assert_eq!(
            (c.net.staging_chunk, c.net.staging_bounce),
            (Some(1000), Some(8))
        );
        assert_eq!(c.log_level, LogLevel::Info);
        assert_eq!(c.bootstrap_timeout, Some(Duration::from_millis(2500)));
        assert_eq!(c.wait_timeout, Some(MAX_TIMEOUT));
        assert_eq!(c.net.providers, Some(vec!["tcp".into(), "shm".into()]));
        assert_eq!(c.net.tx_depth, Some(16));
        assert_eq!(c.net.hmem, Hmem::Never);
        assert!(!c.p2p.sm_engine && c.p2p.flag_by_copy && c.p2p.direct_bytes == 0);
        assert_eq!(c.p2p.sm_blocks, 128);
    }

    /// A byte count read by `Reader::bytes_capped`: its default unset, 0 and a plain value
    /// as given, one over `max` is `max` with one problem naming it, garbage the default with
    /// one problem.
    fn check_capped_bytes(name: &str, field: fn(&Config) -> u64, default: u64, max: u64) {
        let get = |v: &str| with(&[(name, v)]);
        assert_eq!(field(&with(&[])), default, "{name}");
        assert_eq!(field(&get("0")), 0, "{name}");
        assert_eq!(field(&get("65536")), 65536, "{name}");
        let c = get("4294967296");
        assert_eq!(field(&c), max, "{name}");
        assert!(
            c.problems.len() == 1 && c.problems[0].contains(name),
            "{:?}",
            c.problems
        );
        let c = get("lots");
        assert_eq!(field(&c), default, "{name}");
        assert_eq!(c.problems.len(), 1, "{:?}", c.problems);
    }

    #[test]
    fn p2p_direct_limits_default_zero_means_off_and_limit() {
        check_capped_bytes(
            "MSCCLPP_P2P_DIRECT_BYTES",
            |c| c.p2p.direct_bytes,
            P2P_DIRECT_BYTES,
            P2P_DIRECT_MAX,
        );
        check_capped_bytes(
            "MSCCLPP_P2P_DIRECT_BLOCK_BYTES",
            |c| c.p2p.direct_block_bytes,
            P2P_DIRECT_BLOCK_BYTES,
            P2P_DIRECT_BLOCK_MAX,
        );
        // Each limit is its own setting.
        let c = with(&[("MSCCLPP_P2P_DIRECT_BLOCK_BYTES", "0")]);
        assert_eq!(c.p2p.direct_bytes, P2P_DIRECT_BYTES);
    }

    #[test]
    fn unordered_profiles_and_seeds() {
        let u = |v: &str| with(&[("MSCCLPP_TEST_UNORDERED", v)]);
        assert_eq!(u("0").net.unordered, None);
        assert_eq!(
            u("EFA").net.unordered,
            Some(Unordered {
                profile: UnorderedProfile::Efa,
                seed: None
            })
        );
        assert_eq!(
            u("psm3:42").net.unordered,
            Some(Unordered {
                profile: UnorderedProfile::Psm3,
                seed: Some(42)
            })
        );
        let c = u("ucx");
        assert_eq!(c.net.unordered, None);
        assert!(
            c.problems[0].contains("MSCCLPP_TEST_UNORDERED"),
            "{:?}",
            c.problems
        );
        assert_eq!(
            u("cxi").net.unordered.map(|x| x.profile),
            Some(UnorderedProfile::Cxi)
        );
        assert_eq!(
            u("Verbs:7").net.unordered,
            Some(Unordered {
                profile: UnorderedProfile::Verbs,
                seed: Some(7)
            })
        );
        let c = u("efa:x");
        assert_eq!(c.net.unordered.map(|x| x.seed), Some(None));
        assert_eq!(c.problems.len(), 1);
    }

    #[test]
    fn fi_provider_exclusion_list_is_not_a_choice() {
        assert_eq!(with(&[("FI_PROVIDER", "^tcp")]).net.providers, None);
        assert_eq!(
            with(&[("FI_PROVIDER", "verbs")]).net.providers,
            Some(vec!["verbs".to_string()])
        );
    }

    #[test]
    fn bad_values_are_reported_by_name_with_what_is_used() {
        let c = with(&[
            ("MSCCLPP_BOOTSTRAP_TIMEOUT", "-3"),
            ("MSCCLPP_WAIT_TIMEOUT", "soon"),
            ("MSCCLPP_NET_TX_DEPTH", "many"),
            ("MSCCLPP_NET_DELIVERY_COMPLETE", "no"),
            ("MSCCLPP_NET_HMEM", "yes"),
            ("MSCCLPP_DEBUG", "LOUD"),
            ("MSCCLPP_P2P_ENGINE", "gpu"),
            ("CUDA_DEVICE_MAX_CONNECTIONS", "one"),
        ]);
        assert_eq!(c.p2p.cuda_max_connections, None);
        assert_eq!(c.bootstrap_timeout, None);
        assert_eq!(c.wait_timeout, None);
        assert_eq!(c.net.tx_depth, None);
        assert!(c.net.delivery_complete, "a bad flag keeps its default");
        assert_eq!(c.net.hmem, Hmem::Auto, "a bad choice keeps its default");
        assert_eq!(c.log_level, LogLevel::Warn);
        assert!(c.p2p.sm_engine);
        assert_eq!(c.problems.len(), 8, "{:#?}", c.problems);
        for (name, value, instead) in [
            ("MSCCLPP_BOOTSTRAP_TIMEOUT", "\"-3\"", "using 30s"),
            (
                "MSCCLPP_WAIT_TIMEOUT",
                "\"soon\"",
                "using the bootstrap timeout",
            ),
            (
                "MSCCLPP_NET_TX_DEPTH",
                "\"many\"",
                "using the provider's depth",
            ),
            ("MSCCLPP_NET_DELIVERY_COMPLETE", "\"no\"", "using 1"),
            ("MSCCLPP_NET_HMEM", "\"yes\"", "using auto"),
            ("MSCCLPP_DEBUG", "\"LOUD\"", "using WARN"),
            ("MSCCLPP_P2P_ENGINE", "\"gpu\"", "using sm"),
            (
                "CUDA_DEVICE_MAX_CONNECTIONS",
                "\"one\"",
                "using CUDA's default",
            ),
        ] {
            assert!(
                c.problems
                    .iter()
                    .any(|p| p.contains(name) && p.contains(value) && p.contains(instead)),
                "no problem line for {name}: {:#?}",
                c.problems
            );
        }
    }

    #[test]
    fn ibdev_map_pairs_and_lookup() {
        let c = with(&[(
            "MSCCLPP_IBDEV_MAP",
            " mlx5_ib0 = lo , bad, =x, y=, mlx5_ib1=auto, *=eth0,a=b=c",
        )]);
        let n = &c.net;
        assert_eq!(
            n.ibdev_map,
            vec![
                ("mlx5_ib0".into(), "lo".into()),
                ("mlx5_ib1".into(), "auto".into()),
                ("*".into(), "eth0".into())
            ]
        );
        assert_eq!(c.problems.len(), 4, "{:#?}", c.problems);
        assert!(c.problems.iter().all(|p| p.contains("MSCCLPP_IBDEV_MAP")));
        assert_eq!(n.map_ibdev(None), IbDev::Auto);
        assert_eq!(
            n.map_ibdev(Some("mlx5_ib0")),
            IbDev::Mapped {
                from: "mlx5_ib0".into(),
                to: "lo".into()
            }
        );
        assert_eq!(
            n.map_ibdev(Some("mlx5_ib1")),
            IbDev::MappedAuto {
                from: "mlx5_ib1".into()
            }
        );
        assert_eq!(n.map_ibdev(Some("other")).domain(), Some("eth0"));
        let plain = with(&[]).net;
        assert_eq!(
            plain.map_ibdev(Some("mlx5_ib0")),
            IbDev::Named("mlx5_ib0".into())
        );
    }

    #[test]
    fn every_variable_read_is_listed() {
        let seen = std::sync::Mutex::new(Vec::new());
        Config::from_lookup(&|k| {
            seen.lock().unwrap().push(k.to_string());
            None
        });
        let mut seen = seen.into_inner().unwrap();
        seen.sort();
        seen.dedup();
        let mut listed: Vec<String> = VARIABLES.iter().map(|s| s.to_string()).collect();
        listed.sort();
        assert_eq!(seen, listed);
    }
}
