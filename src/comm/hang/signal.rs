//! `SIGUSR1` asks for a hang report of every communicator of the process.
//!
//! The handler does only async-signal-safe work: it sets an atomic flag, writes one byte into
//! the reporter thread's non-blocking pipe (`proxy::wake_reporter`), restores `errno`, and
//! calls the handler that was installed before it, if any (so a program's own `SIGUSR1`
//! handler keeps working). It is installed once per process, with the first communicator that
//! finishes setup, unless `MSCCLPP_HANG_REPORT` is `timeout` or `off`, or the program ignores
//! `SIGUSR1` (`SIG_IGN`: left alone). It is never removed: a handler the program installs later
//! replaces it (then `SIGUSR1` no longer asks for reports). Where `SIGUSR1` had its default
//! action (end the process), it no longer ends the process. Where the program had a handler,
//! ours keeps that handler's flags and mask (`action`).

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// Set by the handler (Release), taken by the reporter thread (Acquire): a report is wanted.
static SIGNALLED: AtomicBool = AtomicBool::new(false);
/// The action that was installed before ours, called after ours. Set once, before ours is
/// installed, so the handler only ever reads it initialised.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// True once since the last call if `SIGUSR1` arrived meanwhile.
pub(super) fn take() -> bool {
    SIGNALLED.swap(false, Ordering::Acquire)
}

/// Installs the handler, once per process (see the module's text).
pub(super) fn install() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: sigaction only reads `new` and writes `old`, both valid for the call.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: a query: a NULL new action changes nothing.
        if unsafe { libc::sigaction(libc::SIGUSR1, std::ptr::null(), &mut old) } != 0 {
            crate::warn!(
                "SIGUSR1: cannot read its action ({}): no hang report on SIGUSR1",
                std::io::Error::last_os_error()
            );
            return;
        }
        if old.sa_sigaction == libc::SIG_IGN {
            crate::info!("SIGUSR1 is ignored by this process: left alone (no hang report on SIGUSR1; MSCCLPP_HANG_REPORT)");
            return;
        }
        let _ = PREVIOUS.set(old);
        let new = action(&old);
        // SAFETY: `new` is a complete action with a valid handler; `old` was read above.
        let rc = unsafe { libc::sigaction(libc::SIGUSR1, &new, std::ptr::null_mut()) };
        if rc != 0 {
            crate::warn!(
                "SIGUSR1: cannot install the hang report's handler ({})",
                std::io::Error::last_os_error()
            );
            return;
        }
        let chained = old.sa_sigaction != libc::SIG_DFL;
        crate::info!(
            "SIGUSR1 writes a hang report of this process's communicators{} (MSCCLPP_HANG_REPORT=off or timeout leaves SIGUSR1 alone)",
            if chained {
                "; the handler the program installed before is still called"
            } else {
                ""
            }
        );
    });
}

/// Our action in place of `old`. Where the program installed a handler, the signal keeps the
/// behaviour the program chose for it: whether an interrupted system call resumes (a program
/// without `SA_RESTART`, CPython among them, relies on `EINTR` to break a blocking call),
/// whether it runs on the alternate stack (`SA_ONSTACK`: the Go runtime aborts on a handler
/// without it), whether it may nest (`SA_NODEFER`), and which signals are blocked while it
/// runs. Where `SIGUSR1` had its default action (nothing in the program waits for it), calls
/// it interrupts resume (`SA_RESTART`), on the alternate stack where there is one.
fn action(old: &libc::sigaction) -> libc::sigaction {
    // SAFETY: zeroed is a valid sigaction (empty mask, no flags), completed below.
    let mut new: libc::sigaction = unsafe { std::mem::zeroed() };
    new.sa_sigaction = on_signal as *const () as usize;
    if old.sa_sigaction == libc::SIG_DFL {
        new.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART | libc::SA_ONSTACK;
        // SAFETY: the mask is ours to fill.
        unsafe { libc::sigemptyset(&mut new.sa_mask) };
    } else {
        let kept = libc::SA_RESTART | libc::SA_ONSTACK | libc::SA_NODEFER;
        new.sa_flags = libc::SA_SIGINFO | (old.sa_flags & kept);
        new.sa_mask = old.sa_mask;
    }
    new
}

/// The `SIGUSR1` handler: async-signal-safe work only (see the module's text).
extern "C" fn on_signal(sig: c_int, info: *mut libc::siginfo_t, ctx: *mut c_void) {
    // SAFETY: errno is this thread's; saved and restored around the write below.
    let errno = unsafe { *libc::__errno_location() };
    SIGNALLED.store(true, Ordering::Release);
    crate::proxy::wake_reporter();
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
    let Some(old) = PREVIOUS.get() else { return };
    let h = old.sa_sigaction;
    if h == libc::SIG_DFL || h == libc::SIG_IGN {
        return;
    }
    if old.sa_flags & libc::SA_SIGINFO != 0 {
        // SAFETY: with SA_SIGINFO the previous action's handler has this signature; it gets
        // what the kernel gave us.
        let f: extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) =
            unsafe { std::mem::transmute(h) };
        f(sig, info, ctx);
    } else {
        // SAFETY: without SA_SIGINFO the previous handler takes the signal number only.
        let f: extern "C" fn(c_int) = unsafe { std::mem::transmute(h) };
        f(sig);
    }
}
