//! Logging: `MSCCLPP_DEBUG=WARN|INFO|TRACE` (default WARN; read by `config`) picks the level; every line goes to
//! the handler that `mscclppSetLogHandler` installed, or to stderr.

use crate::config::LogLevel;
use std::ffi::{c_char, CString};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, Ordering};
use std::sync::OnceLock;

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
#[repr(u8)]
pub enum Level {
    Warn = 1,
    Info = 2,
    Trace = 3,
}

impl Level {
    fn name(self) -> &'static str {
        match self {
            Level::Warn => "WARN",
            Level::Info => "INFO",
            Level::Trace => "TRACE",
        }
    }
}

/// 0 = not read yet; otherwise a `Level` (or 4 = off).
static LEVEL: AtomicU8 = AtomicU8::new(0);
const OFF: u8 = 4;

/// The installed handler (an `extern "C" fn(*const c_char)`), null for the default.
/// Stored with Release in `set_handler`, read with Acquire in `emit`.
static HANDLER: AtomicPtr<()> = AtomicPtr::new(std::ptr::null_mut());

/// The level from the configuration; on this first read, also reports the configuration's
/// problems (bad variable values, `config::Config::problems`) once, at WARN.
fn level_from_config() -> u8 {
    let c = crate::config::get();
    let cur = match c.log_level {
        LogLevel::Off => OFF,
        LogLevel::Warn => Level::Warn as u8,
        LogLevel::Info => Level::Info as u8,
        LogLevel::Trace => Level::Trace as u8,
    };
    // Several threads may race here and each store the same level; only the one that wins the
    // flag reports, so each problem appears once per process.
    static REPORTED: AtomicBool = AtomicBool::new(false);
    if cur != OFF && !REPORTED.swap(true, Ordering::Relaxed) {
        for p in &c.problems {
            emit(Level::Warn, format_args!("{p}"));
        }
    }
    cur
}

/// True when a line at `level` would be emitted (cheap: one relaxed load after the first call).
#[inline]
pub fn enabled(level: Level) -> bool {
    let mut cur = LEVEL.load(Ordering::Relaxed);
    if cur == 0 {
        cur = level_from_config();
        LEVEL.store(cur, Ordering::Relaxed);
    }
    cur != OFF && (level as u8) <= cur
}

pub type Handler = unsafe extern "C" fn(*const c_char);

pub fn set_handler(h: Option<Handler>) {
    let p = h.map_or(std::ptr::null_mut(), |f| f as *mut ());
    HANDLER.store(p, Ordering::Release);
}

fn host_name() -> &'static str {
    static HOST: OnceLock<String> = OnceLock::new();
    HOST.get_or_init(|| {
        let mut buf = [0u8; 256];
        // SAFETY: buf is writable for its length; gethostname NUL-terminates on success.
        let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
        if rc != 0 {
            return "?".into();
        }
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    })
}

/// Formats and delivers one line. Use the `warn!`/`info!`/`trace!` macros.
pub fn emit(level: Level, args: std::fmt::Arguments<'_>) {
    let line = format!(
        "{}:{}:{:?} MSCCLPP {} {}",
        host_name(),
        std::process::id(),
        std::thread::current().id(),
        level.name(),
        args
    );
    let c = CString::new(line.replace('\0', "\\0")).unwrap_or_default();
    let h = HANDLER.load(Ordering::Acquire);
    if h.is_null() {
        default_handler(&c);
    } else {
        // SAFETY: only `set_handler` stores into HANDLER, always from a valid `Handler`.
        let f: Handler = unsafe { std::mem::transmute::<*mut (), Handler>(h) };
        // SAFETY: `c` is a valid NUL-terminated string that outlives the call.
        unsafe { f(c.as_ptr()) };
    }
}

/// Writes one line to stderr.
pub fn default_handler(s: &std::ffi::CStr) {
    use std::io::Write;
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(s.to_bytes());
    let _ = err.write_all(b"\n");
}

#[macro_export]
macro_rules! warn {
    ($($arg:tt)*) => { if $crate::log::enabled($crate::log::Level::Warn) { $crate::log::emit($crate::log::Level::Warn, format_args!($($arg)*)) } };
}
#[macro_export]
macro_rules! info {
    ($($arg:tt)*) => { if $crate::log::enabled($crate::log::Level::Info) { $crate::log::emit($crate::log::Level::Info, format_args!($($arg)*)) } };
}
#[macro_export]
macro_rules! trace {
    ($($arg:tt)*) => { if $crate::log::enabled($crate::log::Level::Trace) { $crate::log::emit($crate::log::Level::Trace, format_args!($($arg)*)) } };
}
