//! Inline puts for SHM connections over host memory: a host thread that puts a few bytes on an
//! idle connection copies them, with their destination offset, into a ring in the peer's shared
//! epoch block, and its signal is the store into that block that lone signals already use
//! (`direct_flag`, proxy/conn.rs). The receiver copies each record into its buffer: its
//! `wait()` does, once it sees the signal, before it returns, and its proxy thread does between
//! rounds (for puts that no signal follows, and for the sender's flush). No trigger, no proxy
//! thread and no libfabric call on the way: an 8-byte `putWithSignal` answered by `wait()` took
//! 7.3 us half round trip through the proxies and the shm provider against 0.55 us for raw
//! `fi_write` on the same 2-core machine (bench/RESULTS.md).
//!
//! Tried first: copying into the peer's buffer by cross-memory attach (`process_vm_writev`).
//! One call costs 1.13 us on that machine for 8 bytes (a remote page-table walk and pinning),
//! so the half round trip stayed at 2.35 us, and it needs the kernel's ptrace permission and a
//! pid the writer must trust. The ring needs neither: each process writes only memory it maps.
//!
//! The ring is single-producer (the sender's proxy lock serializes its host threads) and
//! single-consumer (`Inbox::lock` serializes the receiver's waiters and proxy thread). A block
//! has a ring only where its owner has inline puts on (`MSCCLPP_SHM_INLINE_BYTES` > 0); a
//! sender writes records only into a block that has one. Layout
//! of the shared epoch block, beyond its 32 bytes of epoch ids (`epoch::EPOCH_BYTES`), each
//! word on a cache line of its own:
//!
//! | offset | what | written by |
//! |---|---|---|
//! | 64 | closed: the receiver's communicator is gone, nothing more will be taken | receiver |
//! | 128 | head: bytes of records written, ever | sender |
//! | 192 | tail: bytes of records applied, ever | receiver |
//! | 256 | room wanted: the sender waits for the receiver to apply records | sender |
//! | 4096.. | the ring, `RING_BYTES` | sender |
//!
//! A sender keeps at most `WINDOW` bytes of records unapplied: more go through the proxy, or,
//! for a put larger than `proxy::WAIT_FOR_ROOM_ABOVE` (the ring is the faster path for those),
//! wait a little for room (`proxy::conn::direct_put`), saying so in the block: the receiver's
//! waiters then apply records as they come, and its proxy thread keeps polling. Otherwise they
//! apply them in batches (a waiter at its signal, the proxy between rounds): applying each 4 KiB
//! record as it came cost a 4 KiB stream ~10% on 16 cores (the head and tail lines moving once
//! per record).
//!
//! A record is a header word (destination offset in the high 32 bits, length in the low 32)
//! and the data, padded to 8 bytes; a record never wraps: a header with length `PAD` sends the
//! consumer to the ring's start. The receiver checks every record against its own buffer (a
//! peer's bug is an error, never a stray write).

use crate::error::{Error, Result};
use crate::mem::SharedBlock;
use crate::sync::{lock, try_lock};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

const CLOSED_AT: usize = 64;
const HEAD_AT: usize = 128;
const TAIL_AT: usize = 192;
const WANTED_AT: usize = 256;
const RING_AT: usize = 4096;
/// Bytes of each connection's ring: twice `WINDOW` and a page, so that a record the window
/// allows also fits after the pad at the ring's end (the pad is shorter than the record).
pub const RING_BYTES: u64 = 2 * WINDOW + 4096;
/// Bytes of records a sender may have in the ring, not yet applied, and still add one (or three
/// records of its largest size, if more: two and a pad): a latency path, not a stream's. A
/// stream of small puts fills it and then takes the proxy, which first waits for the receiver
/// to apply what is there; with the whole ring as the
/// window, that wait (64 KiB copied by a receiver that was idle) made a 4 KiB put stream
/// slower than the proxy path alone.
pub const WINDOW: u64 = 16 << 10;
/// Bytes of a shared epoch block with its ring.
pub const BLOCK_BYTES: usize = RING_AT + RING_BYTES as usize;
/// The largest put a record may carry (the library's limit; `MSCCLPP_SHM_INLINE_BYTES` sets the
/// one in use, at most this).
pub const MAX_INLINE: u64 = crate::config::SHM_INLINE_MAX;
/// The length of a header that sends the consumer to the ring's start.
const PAD: u64 = u32::MAX as u64;

/// The control word at `off` of a shared block of at least `BLOCK_BYTES`.
fn word(block: &SharedBlock, off: usize) -> &AtomicU64 {
    debug_assert!(off + 8 <= RING_AT && off % 8 == 0 && block.len() >= BLOCK_BYTES);
    // SAFETY: in the block's first page (page-aligned mapping), aligned; both processes touch
    // these words only atomically; the block lives as long as the borrow.
    unsafe { AtomicU64::from_ptr(block.ptr().add(off).cast()) }
}

/// Refuses a block too small to hold the ring (both sides make one only from a block of
/// `BLOCK_BYTES`; `word` and the ring's accesses rely on it).
fn check_block(block: &SharedBlock) -> Result<()> {
    if block.len() < BLOCK_BYTES {
        return Err(Error::internal(format!(
            "an inline-put ring needs a {BLOCK_BYTES}-byte block, not {}",
            block.len()
        )));
    }
    Ok(())
}

/// Bytes a record of `len` bytes of data takes in the ring.
fn record_bytes(len: u64) -> u64 {
    8 + len.next_multiple_of(8)
}

/// The sender's side: the peer's block, mapped here.
#[derive(Clone)]
pub struct Outbox {
    block: Arc<SharedBlock>,
    /// Bytes written so far (the sender's copy of `head`, which only it writes).
    head: u64,
    /// Our buffer on the connection, where puts read from.
    local_base: u64,
    /// Puts up to this size go inline.
    pub max_bytes: u64,
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Outbox(head {}, up to {} bytes)",
            self.head, self.max_bytes
        )
    }
}

/// What became of a record offered to the ring (`Outbox::put`).
#[derive(Debug, PartialEq, Eq)]
pub enum Put {
    /// Written and published.
    Written,
    /// Not written: the records not yet applied leave no room. The receiver applying them
    /// makes room.
    NoRoom,
    /// Not written, and never will be: the receiver is gone, or its tail is past our head
    /// (its bug).
    Refused,
}

/// Where the records an outbox wrote stand.
#[derive(Debug, PartialEq, Eq)]
pub enum Taken {
    /// The receiver applied every one.
    All,
    /// Some are still in the ring.
    Pending,
    /// The receiver's communicator is gone; what it had not taken is lost.
    Closed,
}

impl Outbox {
    /// `block`: the peer's shared epoch block, of `BLOCK_BYTES`; `local_base`: our buffer.
    pub fn new(block: Arc<SharedBlock>, local_base: u64, max_bytes: u64) -> Result<Self> {
        check_block(&block)?;
        let head = word(&block, HEAD_AT).load(Ordering::Relaxed);
        Ok(Outbox {
            block,
            head,
            local_base,
            max_bytes: max_bytes.min(MAX_INLINE),
        })
    }

    /// Writes a record of `size` bytes from our buffer at `src_off` for the peer's `dst_off`
    /// (both ranges checked by the caller). Nothing is written when the records not yet
    /// applied would exceed `WINDOW` or the ring lacks room (`NoRoom`), or the receiver is
    /// gone (`Refused`).
    pub fn put(&mut self, src_off: u64, dst_off: u64, size: u64) -> Put {
        debug_assert!(size <= MAX_INLINE && dst_off <= u32::MAX as u64);
        let base = self.block.ptr();
        if word(&self.block, CLOSED_AT).load(Ordering::Relaxed) != 0 {
            return Put::Refused;
        }
        let need = record_bytes(size);
        let pos = self.head % RING_BYTES;
        let to_end = RING_BYTES - pos;
        let pad = if need > to_end { to_end } else { 0 };
        // Acquire pairs with the consumer's Release of the tail: the records it freed were
        // read before we overwrite them.
        let tail = word(&self.block, TAIL_AT).load(Ordering::Acquire);
        // The peer writes the tail: one past our head is its bug, and no record goes there.
        let Some(used) = self.head.checked_sub(tail) else {
            return Put::Refused;
        };
        // An empty ring takes a record of any allowed size, and one more behind it (room for a
        // pad at the ring's end counted: 3 records): in a two-way exchange a rank's next put
        // comes before the peer applied its last one (with 8 KiB puts every second one took
        // the proxy, and the ones after it too, until a flush).
        let window = WINDOW.max(3 * record_bytes(self.max_bytes));
        let window_full = used != 0 && used + need > window;
        if window_full || used + pad + need > RING_BYTES {
            return Put::NoRoom;
        }
        // SAFETY: the ring is RING_BYTES at RING_AT of the block (checked in `new`); these bytes
        // lie between the tail and head + need, which the consumer does not read until the head
        // below is published. The source is `size` bytes of our registered buffer.
        unsafe {
            let ring = base.add(RING_AT);
            if pad > 0 {
                ring.add(pos as usize).cast::<u64>().write(PAD);
                self.head += pad;
            }
            let at = ring.add((self.head % RING_BYTES) as usize);
            std::ptr::copy_nonoverlapping(
                (self.local_base + src_off) as *const u8,
                at.add(8),
                size as usize,
            );
            at.cast::<u64>().write(dst_off << 32 | size);
        }
        self.head += need;
        // Release pairs with the consumer's Acquire of the head: the record is in place first.
        word(&self.block, HEAD_AT).store(self.head, Ordering::Release);
        Put::Written
    }

    /// Says whether this sender is waiting for room (`Inbox::room_wanted`). A hint: Relaxed.
    pub fn want_room(&self, wanted: bool) {
        word(&self.block, WANTED_AT).store(u64::from(wanted), Ordering::Relaxed);
    }

    /// Whether the receiver has applied every record written so far.
    pub fn taken(&self) -> Taken {
        // Closed first: the receiver applies what is there, then closes, so a tail read after
        // seeing it closed is final. Acquire pairs with its Release stores of both.
        let closed = word(&self.block, CLOSED_AT).load(Ordering::Acquire) != 0;
        if word(&self.block, TAIL_AT).load(Ordering::Acquire) == self.head {
            Taken::All
        } else if closed {
            Taken::Closed
        } else {
            Taken::Pending
        }
    }
}

/// The receiver's side: its own shared epoch block and the buffer records are applied to.
pub struct Inbox {
    block: Arc<SharedBlock>,
    buff: u64,
    len: u64,
    /// The rank that writes the records, for errors.
    peer: usize,
    /// One consumer at a time (waiters and the proxy thread); true once closed at destroy:
    /// nothing is applied any more (the user may free the buffer).
    lock: Mutex<bool>,
    /// Bytes of records applied, ever: the authoritative tail, in our own memory (the shared
    /// word is a copy for the sender, which could write it too: a tail it moved made the
    /// consumer read past the ring). Stored only by a drain, under `lock`; read without it by
    /// waiters, whose Acquire pairs with the drain's Release (its copies are visible).
    applied: AtomicU64,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Inbox(from rank {}, {} bytes)", self.peer, self.len)
    }
}

impl crate::fifo::Drain for Inbox {
    fn drain(&self) -> Result<()> {
        Inbox::drain(self)
    }
    fn drain_if_free(&self) -> Result<bool> {
        Inbox::drain_if_free(self)
    }
    fn room_wanted(&self) -> bool {
        Inbox::room_wanted(self)
    }
}

impl Inbox {
    /// # Safety
    /// `buff` must be `len` writable bytes for as long as the inbox is drained (the user's
    /// buffer, valid until the communicator is destroyed).
    pub unsafe fn new(block: Arc<SharedBlock>, buff: u64, len: u64, peer: usize) -> Result<Self> {
        check_block(&block)?;
        Ok(Inbox {
            block,
            buff,
            len,
            peer,
            lock: Mutex::new(false),
            applied: AtomicU64::new(0),
        })
    }

    /// Copies every record written so far into the buffer. An error (a record that does not
    /// fit the ring or the buffer: the peer's bug) leaves the ring as it was.
    ///
    /// For a waiter that saw a signal: when it returns, every record published before the call
    /// has been applied, by this thread or by the consumer that held the lock. It never sleeps
    /// in the lock: a waiter parked in its futex while the proxy thread copied a record cost
    /// ~75 us per round trip (a debug build's 100,000-round ping-pong: 8 s, against 2.4 s
    /// without inline puts).
    pub fn drain(&self) -> Result<()> {
        // Acquire pairs with the producer's Release of the head: the records below it are in
        // place.
        let head = word(&self.block, HEAD_AT).load(Ordering::Acquire);
        let mut spins = 0u32;
        // Ends when the records are applied (here, or by the holder of the lock: a thread of
        // this process copying at most WINDOW bytes, which always finishes).
        loop {
            // Acquire pairs with a drain's Release of `applied`: its copies are visible.
            if self.applied.load(Ordering::Acquire) >= head {
                return Ok(());
            }
            if let Some(closed) = try_lock(&self.lock) {
                // Closed: the user may have freed the buffer.
                return if *closed { Ok(()) } else { self.drain_locked() };
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// The sender waits for room (`Outbox::want_room`): apply records as they come.
    pub fn room_wanted(&self) -> bool {
        // Relaxed: a hint; the records themselves are read after the head's Acquire.
        word(&self.block, WANTED_AT).load(Ordering::Relaxed) != 0
    }

    /// Applies what is there unless another consumer is at it (the proxy's rounds, and
    /// waiters before their signal; both come back for the rest). Returns whether it applied
    /// any record.
    pub fn drain_if_free(&self) -> Result<bool> {
        // Acquire pairs with the producer's Release of the head.
        let head = word(&self.block, HEAD_AT).load(Ordering::Acquire);
        if head == self.applied.load(Ordering::Relaxed) {
            return Ok(false);
        }
        match try_lock(&self.lock) {
            Some(closed) if !*closed => self.drain_locked().map(|()| true),
            _ => Ok(false),
        }
    }

    /// `drain`, by the holder of `lock`.
    fn drain_locked(&self) -> Result<()> {
        let base = self.block.ptr();
        // Relaxed: only drains store it, and they hold the lock (which orders them).
        let mut tail = self.applied.load(Ordering::Relaxed);
        let head = word(&self.block, HEAD_AT).load(Ordering::Acquire);
        if head < tail || head - tail > RING_BYTES {
            return Err(self.bad(format!("its ring says head {head}, tail {tail}")));
        }
        // Ends: each step advances the tail by at least 8 bytes, up to the head read above.
        while tail < head {
            let pos = tail % RING_BYTES;
            // SAFETY: pos is 8-aligned (records are multiples of 8) and inside the ring; the
            // producer wrote it before publishing `head`.
            let hdr = unsafe { base.add(RING_AT + pos as usize).cast::<u64>().read() };
            let (off, size) = (hdr >> 32, hdr & PAD);
            let step = if size == PAD {
                RING_BYTES - pos
            } else {
                let need = record_bytes(size);
                if size > MAX_INLINE || need > RING_BYTES - pos || tail + need > head {
                    return Err(self.bad(format!("a record of {size} bytes at {pos}")));
                }
                if off.checked_add(size).is_none_or(|end| end > self.len) {
                    return Err(self.bad(format!(
                        "a put of [{off}, {off}+{size}) into our {}-byte buffer",
                        self.len
                    )));
                }
                // SAFETY: the record's data lies in the ring (checked), the destination in
                // the buffer (checked; `new`'s contract).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        base.add(RING_AT + pos as usize + 8),
                        (self.buff + off) as *mut u8,
                        size as usize,
                    );
                }
                need
            };
            tail += step;
        }
        // Release, both: pairs with the producer's Acquire of the tail (room) and a flush's
        // (`Outbox::taken`), and with waiters' Acquire of `applied`: the copies come first.
        self.applied.store(tail, Ordering::Release);
        word(&self.block, TAIL_AT).store(tail, Ordering::Release);
        Ok(())
    }

    /// The communicator is going away: applies what is there, then tells the sender that
    /// nothing more will be taken; later drains do nothing (the user may free the buffer once
    /// destroy returns).
    pub fn close(&self) -> Result<()> {
        let mut closed = lock(&self.lock);
        if *closed {
            return Ok(());
        }
        let r = self.drain_locked();
        *closed = true;
        // Release pairs with the sender's Acquire in `Outbox::taken`.
        word(&self.block, CLOSED_AT).store(1, Ordering::Release);
        r
    }

    fn bad(&self, what: String) -> Error {
        Error::remote(format!(
            "rank {}: malformed inline put over SHM ({what})",
            self.peer
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(src: &[u8], dst: &mut [u8], max: u64) -> (Outbox, Inbox) {
        let block = Arc::new(SharedBlock::create(BLOCK_BYTES).unwrap());
        let out = Outbox::new(block.clone(), src.as_ptr() as u64, max).unwrap();
        // SAFETY: `dst` outlives the inbox in every test.
        let inb = unsafe { Inbox::new(block, dst.as_mut_ptr() as u64, dst.len() as u64, 1) };
        (out, inb.unwrap())
    }

    #[test]
    fn records_arrive_in_order_across_the_wrap() {
        let src: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut dst = vec![0u8; 4096];
        let (mut out, inb) = pair(&src, &mut dst, 4096);
        // Sizes that do not divide the ring: records meet its end and pad to its start.
        let mut expect = vec![0u8; 4096];
        for round in 0..200u64 {
            let size = [1u64, 8, 13, 1000, 4096, 333][round as usize % 6];
            let (s, d) = (
                round * 5 % (4096 - size + 1),
                round * 11 % (4096 - size + 1),
            );
            assert_eq!(out.put(s, d, size), Put::Written, "round {round}");
            expect[d as usize..(d + size) as usize]
                .copy_from_slice(&src[s as usize..(s + size) as usize]);
            assert_eq!(out.taken(), Taken::Pending);
            if round % 3 == 2 {
                inb.drain().unwrap();
                assert_eq!(out.taken(), Taken::All);
                assert_eq!(dst, expect, "round {round}");
            }
        }
    }

    #[test]
    fn two_records_of_the_largest_size_fit_the_window() {
        let src = vec![6u8; 16 << 10];
        let mut dst = vec![0u8; 16 << 10];
        let (mut out, inb) = pair(&src, &mut dst, 16 << 10);
        for round in 0..20 {
            assert_eq!(
                out.put(0, 0, 16 << 10),
                Put::Written,
                "round {round}: first"
            );
            assert_eq!(
                out.put(0, 0, 8 << 10),
                Put::Written,
                "round {round}: second, before the first is applied"
            );
            inb.drain().unwrap();
        }
        assert!(dst.iter().all(|b| *b == 6));
    }

    #[test]
    fn a_full_window_refuses_until_drained() {
        let src = vec![5u8; 4096];
        let mut dst = vec![0u8; 4096];
        let (mut out, inb) = pair(&src, &mut dst, 4096);
        let mut n = 0;
        while out.put(0, 0, 4096) == Put::Written {
            n += 1;
            assert!(n < 100);
        }
        assert_eq!(n, WINDOW / record_bytes(4096));
        assert_eq!(
            out.put(0, 0, 4096),
            Put::NoRoom,
            "room comes when the receiver applies"
        );
        inb.drain().unwrap();
        assert_eq!(out.put(0, 0, 4096), Put::Written);
        inb.drain().unwrap();
        assert!(dst.iter().all(|b| *b == 5));
    }

    #[test]
    fn a_bad_record_is_an_error_and_writes_nothing() {
        let src = vec![9u8; 64];
        let mut dst = vec![0u8; 64];
        let (mut out, inb) = pair(&src, &mut dst, 64);
        // What a buggy peer could write: a put past our buffer's end.
        assert_eq!(out.put(0, 60, 8), Put::Written);
        let e = inb.drain().unwrap_err().to_string();
        assert!(
            e.contains("malformed inline put") && e.contains("[60, 60+8)"),
            "{e}"
        );
        // A head that runs past the ring.
        word(&out.block, HEAD_AT).store(RING_BYTES * 3, Ordering::Release);
        assert!(inb.drain().unwrap_err().to_string().contains("head"));
        assert!(dst.iter().all(|b| *b == 0));
        // A tail the peer moved near the ring's end: the consumer keeps its own, so it reads
        // nothing past the ring (it saw a 16-byte record straddling the end, and read past it).
        word(&out.block, TAIL_AT).store(RING_BYTES - 4, Ordering::Release);
        word(&out.block, HEAD_AT).store(RING_BYTES + 12, Ordering::Release);
        assert!(inb.drain().is_err());
        // And a tail past the sender's head: no record goes out.
        word(&out.block, TAIL_AT).store(out.head + 8, Ordering::Release);
        assert_eq!(out.put(0, 0, 8), Put::Refused);
    }

    #[test]
    fn close_applies_what_is_there_then_refuses_more() {
        let src = vec![3u8; 16];
        let mut dst = vec![0u8; 16];
        let (mut out, inb) = pair(&src, &mut dst, 16);
        assert_eq!(out.put(0, 0, 16), Put::Written);
        inb.close().unwrap();
        assert_eq!(out.taken(), Taken::All);
        assert_eq!(
            out.put(0, 0, 16),
            Put::Refused,
            "nothing goes to a closed inbox"
        );
        assert!(dst.iter().all(|b| *b == 3));
        // A record that a buggy peer writes anyway is never applied.
        word(&out.block, CLOSED_AT).store(0, Ordering::Relaxed);
        assert_eq!(out.put(0, 0, 8), Put::Written);
        let src2 = [4u8; 8];
        out.local_base = src2.as_ptr() as u64;
        assert_eq!(out.put(0, 0, 8), Put::Written);
        inb.drain().unwrap();
        assert!(dst.iter().all(|b| *b == 3), "a closed inbox writes nothing");
        // Records left behind by a put that raced the close are reported as lost.
        word(&out.block, CLOSED_AT).store(1, Ordering::Relaxed);
        assert_eq!(out.taken(), Taken::Closed);
    }
}
