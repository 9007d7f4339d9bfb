//! Socket helpers where every blocking call is bounded by a deadline.

use crate::error::Error;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// Time left until `deadline`, or a TimedOut error once it has passed.
pub(crate) fn left(deadline: Instant) -> io::Result<Duration> {
    let d = deadline.saturating_duration_since(Instant::now());
    if d.is_zero() {
        Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"))
    } else {
        Ok(d)
    }
}

/// Turns an I/O failure of a bootstrap step into the error its cause deserves: a peer that
/// went away is Remote, one that never answered is Timeout, anything else is a local System
/// error. `what` names the step, the rank and the address.
pub(crate) fn classify(e: io::Error, what: String, timeout: Duration) -> Error {
    use io::ErrorKind::*;
    match e.kind() {
        TimedOut | WouldBlock => Error::timeout(what, timeout),
        UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe | ConnectionRefused
        | NotConnected => Error::remote(format!("{what}: {e}")),
        _ => Error::sys(what, e),
    }
}

fn retryable_connect(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionRefused
            | ConnectionReset
            | ConnectionAborted
            | TimedOut
            | WouldBlock
            | Interrupted
    ) || matches!(
        e.raw_os_error(),
        Some(libc::EHOSTUNREACH) | Some(libc::ENETUNREACH) | Some(libc::EAGAIN)
    )
}

/// Whether `s` is connected to its own address. TCP allows it: a connect to a local port that
/// nobody listens on can be handed that very port as its ephemeral source port, and the two
/// halves of the handshake then meet (a "simultaneous open" with itself). A rank retrying
/// towards a root that has not bound its port yet would take its own hello for the root's
/// answer, and hold the port the root is about to bind (the likely cause of a CI run of 32
/// ranks on one host that failed within a second, its root's port inside the ephemeral range).
pub(crate) fn connected_to_itself(s: &TcpStream) -> bool {
    matches!((s.local_addr(), s.peer_addr()), (Ok(l), Ok(p)) if l == p)
}

/// Connects once, within `timeout`. A connection to itself is refused, as the port's owner
/// would have refused it: nobody listens there (dropping it frees the port for a root that is
/// about to bind it).
fn connect_within(addr: &SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    let s = TcpStream::connect_timeout(addr, timeout)?;
    if connected_to_itself(&s) {
        return Err(io::Error::new(
            io::ErrorKind::ConnectionRefused,
            format!("{addr}: connected to itself (nobody listens there)"),
        ));
    }
    s.set_nodelay(true)?;
    Ok(s)
}

/// Connects once, within the deadline (`connect_within`).
pub(crate) fn connect(addr: &SocketAddr, deadline: Instant) -> io::Result<TcpStream> {
    connect_within(addr, left(deadline)?)
}

/// Connects to the first of `addrs` that answers, retrying with backoff until the deadline
/// (the root may start after the other ranks). Non-transient errors end it at once.
pub(crate) fn connect_retry(addrs: &[SocketAddr], deadline: Instant) -> io::Result<TcpStream> {
    let mut pause = Duration::from_millis(5);
    let mut last = io::Error::new(io::ErrorKind::TimedOut, "no address to connect to");
    // Ends: at the deadline (each round either returns or sleeps, and `left` fails once the
    // deadline passed), or on a non-retryable error.
    loop {
        for a in addrs {
            let per_try = left(deadline)?.min(Duration::from_secs(5));
            match connect_within(a, per_try) {
                Ok(s) => return Ok(s),
                Err(e) if retryable_connect(&e) => last = e,
                Err(e) => return Err(e),
            }
        }
        let rest = match left(deadline) {
            Ok(r) => r,
            Err(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("gave up at the deadline; last error: {last}"),
                ))
            }
        };
        std::thread::sleep(pause.min(rest));
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

/// Writes all of `buf` before the deadline (the socket must be in blocking mode).
pub(crate) fn write_all_by(s: &TcpStream, mut buf: &[u8], deadline: Instant) -> io::Result<()> {
    // Ends: when the buffer is written, on an error, or at the deadline (`left` fails).
    while !buf.is_empty() {
        s.set_write_timeout(Some(left(deadline)?))?;
        match (&*s).write(buf) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "send timed out"))
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Fills `buf` before the deadline (blocking socket); EOF first is UnexpectedEof. Bytes that
/// have already arrived are taken even once the deadline has passed.
pub(crate) fn read_exact_by(s: &TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut at = 0;
    // Ends: when full, on EOF or an error, or at the deadline (after it, each read waits 1 ms
    // at most and the first one that finds nothing ends it).
    while at < buf.len() {
        let wait = left(deadline).unwrap_or(Duration::from_millis(1));
        s.set_read_timeout(Some(wait))?;
        match (&*s).read(&mut buf[at..]) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed by the peer",
                ))
            }
            Ok(n) => at += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "receive timed out"))
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// poll(2) over `fds` for at most `timeout` (None: until an event). EINTR counts as a wake-up
/// with no events; callers loop and re-check their deadlines.
pub(crate) fn poll(fds: &mut [libc::pollfd], timeout: Option<Duration>) -> io::Result<usize> {
    let ms = match timeout {
        None => -1,
        // Round up, so a short wait does not become a busy loop of zero-timeout polls.
        Some(d) => d.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32,
    };
    // SAFETY: `fds` is a valid, writable slice of pollfd for its length.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if rc >= 0 {
        return Ok(rc as usize);
    }
    let e = io::Error::last_os_error();
    if e.kind() == io::ErrorKind::Interrupted {
        return Ok(0);
    }
    Err(e)
}

pub(crate) fn pollfd(fd: &impl AsRawFd) -> libc::pollfd {
    libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }
}

/// As [`read_some`], without blocking even on a socket in blocking mode (`MSG_DONTWAIT`): for
/// the reader's copy of an outgoing connection, whose mode the sending side sets.
pub(crate) fn read_nowait(s: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
    // Ends: first non-EINTR result.
    loop {
        // SAFETY: `buf` is writable for its length; the descriptor is open while `s` lives.
        let n = unsafe {
            libc::recv(
                s.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Reads what is available without blocking: Ok(0) is EOF, WouldBlock means nothing yet.
pub(crate) fn read_some(s: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    // Ends: first non-EINTR result.
    loop {
        match s.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            r => return r,
        }
    }
}
