//! Hang reports: what every rank of a communicator waits for, combined into one summary that
//! names the cycle, e.g. `rank 0 waits for signal 18 from rank 1 (has 17); rank 1 waits for
//! signal 5 from rank 0 (has 4): cycle 0 -> 1 -> 0`, written at WARN by the rank that asked.
//!
//! A rank's report (`rank.rs`) is its pending waits (host threads' from `host::pending`,
//! kernels' from `ProxyWork::device_pending_waits`) and, per connection, the signals it issued,
//! sent and received. The rank that asks collects the others' over the bootstrap; each rank's
//! mailbox thread answers for it (`bootstrap::Bootstrap::gather_reports`), so ranks whose
//! threads and kernels are stuck answer too, and a rank that does not is named with why.
//! `summary.rs` combines them (a pure function).
//!
//! When: a host wait that times out, or a kernel's wait the proxy finds past the host wait
//! timeout (both through `proxy::request_hang_report`); `SIGUSR1` (`signal.rs`); and, with
//! `MSCCLPP_HANG_REPORT=<seconds>`, every so often while a rank has a wait that long. One
//! reporter thread per process writes them, so no caller waits for one; it runs while the
//! process has a communicator set up and ends with the last one. Destroy writes a report still
//! wanted for its communicator before it tears anything down, and waits for one being written
//! (at most the report's bound): a program that destroys its communicator after a timeout
//! gets the report first.

mod rank;
mod signal;
mod summary;

pub(crate) use rank::{weak_work, ConnView, SlotView, Source};
pub use rank::{ConnCounts, RankReport, Waiting};
pub use summary::{summarize, Answer, Summary};

use crate::sync::{lock, write};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Why a report of a communicator is wanted.
#[derive(Clone, Debug)]
pub(crate) enum Wanted {
    /// Written whatever it finds; the reason says who asked.
    Always(String),
    /// Written only if this rank has a wait pending for at least this long (the periodic
    /// report).
    IfStuck(Duration),
}

/// The most a report waits for the other ranks' answers: a live rank's mailbox thread answers
/// within milliseconds; one that does not by then is named as silent.
fn bound() -> Duration {
    crate::config::bootstrap_timeout().min(Duration::from_secs(5))
}

/// The communicators with a report source, and whether the reporter thread runs.
struct Reporter {
    sources: Vec<Weak<Source>>,
    running: bool,
}

static REPORTER: Mutex<Reporter> = Mutex::new(Reporter {
    sources: Vec::new(),
    running: false,
});

/// The reporter's pipe (read end, write end), non-blocking, open for the process's lifetime
/// (the signal handler may write to it at any time); None if it could not be made.
fn pipe() -> Option<(i32, i32)> {
    static PIPE: OnceLock<Option<(i32, i32)>> = OnceLock::new();
    *PIPE.get_or_init(|| {
        let mut fds = [0i32; 2];
        // SAFETY: pipe2 writes two descriptors into `fds`.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
            crate::warn!(
                "hang report: cannot make the reporter's pipe ({}): reports only at destroy",
                std::io::Error::last_os_error()
            );
            return None;
        }
        crate::proxy::set_reporter_wake(fds[1]);
        Some((fds[0], fds[1]))
    })
}

/// Makes `src` the report source of its communicator: peers' requests are answered from it,
/// and the reporter thread writes its reports.
pub(crate) fn open(src: Source) -> Arc<Source> {
    let src = Arc::new(src);
    if let Some(b) = src.boot.upgrade() {
        let s = src.clone();
        b.set_report_source(Some(Arc::new(move || s.local().encode())));
    }
    let cfg = crate::config::get().hang_report;
    if cfg.on_signal {
        signal::install();
    }
    let Some((rfd, _)) = pipe() else { return src };
    let mut r = lock(&REPORTER);
    r.sources.retain(|w| w.strong_count() > 0);
    r.sources.push(Arc::downgrade(&src));
    if !r.running {
        match std::thread::Builder::new()
            .name("mscclpp-hang".into())
            .spawn(move || run(rfd))
        {
            Ok(_) => r.running = true,
            Err(e) => crate::warn!("hang report: cannot start the reporter thread: {e}"),
        }
    }
    src
}

/// Destroy's first step: writes a report still wanted for `src`'s communicator (or waits for
/// the one being written), then closes the source: nothing behind its pointers is read again.
pub(crate) fn close(src: &Arc<Source>) {
    let busy = lock(&src.busy);
    route_requests();
    let wanted = lock(&src.wanted).take();
    if let Some(w) = wanted {
        write_report(src, &w);
    }
    *write(&src.alive) = false;
    drop(busy);
    if let Some(b) = src.boot.upgrade() {
        b.set_report_source(None);
    }
    lock(&REPORTER)
        .sources
        .retain(|w| w.strong_count() > 0 && !std::ptr::eq(w.as_ptr(), Arc::as_ptr(src)));
    // The thread ends once no communicator is left.
    crate::proxy::wake_reporter();
}

/// Notes that a report of `src`'s communicator is wanted; a report written whatever it finds
/// wins over a periodic one.
fn want(src: &Source, w: Wanted) {
    let mut cur = lock(&src.wanted);
    if !matches!(*cur, Some(Wanted::Always(_))) {
        *cur = Some(w);
    }
}

/// Hands the requests made below (`proxy::request_hang_report`) to their communicators; a
/// request for a communicator that is gone is dropped.
fn route_requests() {
    let reqs = crate::proxy::take_hang_requests();
    if reqs.is_empty() {
        return;
    }
    let sources: Vec<Arc<Source>> = lock(&REPORTER)
        .sources
        .iter()
        .filter_map(Weak::upgrade)
        .collect();
    for (head, why) in reqs {
        if let Some(s) = sources
            .iter()
            .find(|s| s.slots.iter().any(|x| x.head == head))
        {
            want(s, Wanted::Always(why));
        }
    }
}

/// The reporter thread. Ends when no communicator is left (checked at every wake-up; `close`
/// wakes it).
fn run(rfd: i32) {
    let every = crate::config::get().hang_report.every;
    let mut tick = every.map(|d| Instant::now() + d);
    loop {
        let wait = tick.map(|t| t.saturating_duration_since(Instant::now()));
        let mut fd = libc::pollfd {
            fd: rfd,
            events: libc::POLLIN,
            revents: 0,
        };
        // Rounded up, so that the tick is not polled for in a loop of zero timeouts.
        let ms = wait.map_or(-1, |d| d.as_millis().min(i32::MAX as u128 - 1) as i32 + 1);
        // SAFETY: one valid pollfd. EINTR and errors only end this round early.
        unsafe { libc::poll(&mut fd, 1, ms) };
        let mut b = [0u8; 64];
        // Ends: the pipe is empty (EAGAIN) or failing.
        // SAFETY: reads into a live buffer of its length.
        while unsafe { libc::read(rfd, b.as_mut_ptr().cast(), b.len()) } > 0 {}
        let sources: Vec<Arc<Source>> = {
            let mut r = lock(&REPORTER);
            r.sources.retain(|w| w.strong_count() > 0);
            if r.sources.is_empty() {
                r.running = false;
                return;
            }
            r.sources.iter().filter_map(Weak::upgrade).collect()
        };
        if signal::take() {
            for s in &sources {
                want(s, Wanted::Always("SIGUSR1".into()));
            }
        }
        route_requests();
        if let (Some(t), Some(d)) = (tick, every) {
            if Instant::now() >= t {
                for s in &sources {
                    want(s, Wanted::IfStuck(d));
                }
                tick = Some(Instant::now() + d);
            }
        }
        for s in &sources {
            let busy = lock(&s.busy);
            let wanted = lock(&s.wanted).take();
            if let (Some(w), true) = (wanted, *crate::sync::read(&s.alive)) {
                write_report(s, &w);
            }
            drop(busy);
        }
    }
}

/// Collects every rank's report, combines them and writes the summary at WARN. The caller
/// holds `src.busy`.
fn write_report(src: &Source, w: &Wanted) {
    let local = src.local();
    let why = match w {
        Wanted::Always(why) => why.clone(),
        Wanted::IfStuck(d) => {
            let stuck = local
                .waits
                .iter()
                .any(|x| x.ended.is_none() && x.wait.waited >= *d);
            if !stuck {
                return;
            }
            format!("a wait has lasted {d:?} (MSCCLPP_HANG_REPORT)")
        }
    };
    let Some(boot) = src.boot.upgrade() else {
        return;
    };
    let t0 = Instant::now();
    let answers = boot.gather_reports(bound());
    drop(boot);
    let took = t0.elapsed();
    let mut all = vec![(src.rank, Answer::Report(local))];
    for (r, a) in answers {
        let a = match a {
            Ok(b) if b.is_empty() => Answer::Report(RankReport {
                rank: r,
                notes: vec!["no connections set up (nothing to report)".into()],
                ..Default::default()
            }),
            Ok(b) => match RankReport::decode(&b, r, src.nranks) {
                Ok(rep) => Answer::Report(rep),
                Err(e) => Answer::None(format!("malformed report: {e}")),
            },
            Err(why) => Answer::None(why),
        };
        all.push((r, a));
    }
    all.sort_by_key(|x| x.0);
    let answered = all
        .iter()
        .filter(|x| matches!(x.1, Answer::Report(_)))
        .count();
    let s = summarize(&all);
    let n = src
        .written
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        + 1;
    let me = src.rank;
    crate::warn!(
        "hang report {n} of rank {me} ({why}): {answered} of {} ranks answered in {took:.2?}; {} cycle(s)",
        src.nranks,
        s.cycles.len()
    );
    for l in &s.lines {
        crate::warn!("hang report {n} of rank {me}: {l}");
    }
}
