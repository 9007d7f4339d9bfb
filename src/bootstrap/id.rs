//! The 128 bytes of an `mscclppUniqueId`:
//!
//! | bytes   | field                                              |
//! |---------|----------------------------------------------------|
//! | 0       | version ([`ID_VERSION`])                           |
//! | 1..9    | magic, u64 LE, random and non-zero                 |
//! | 9..33   | root address ([`super::frame::encode_addr`])       |
//! | 33..37  | FNV-1a 32 of bytes 0..33, LE (catches corruption)  |
//! | 37..128 | zero                                               |

use super::frame::{decode_addr, encode_addr, ADDR_LEN};
use crate::abi::MSCCLPP_UNIQUE_ID_BYTES;
use std::io::{self, Read};
use std::net::SocketAddr;

pub(crate) const ID_VERSION: u8 = 1;
const ADDR_AT: usize = 9;
const SUM_AT: usize = ADDR_AT + ADDR_LEN;
const END: usize = SUM_AT + 4;

fn fnv32(b: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for &x in b {
        h ^= x as u32;
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

pub(crate) fn encode(magic: u64, root: &SocketAddr) -> [u8; MSCCLPP_UNIQUE_ID_BYTES] {
    let mut id = [0u8; MSCCLPP_UNIQUE_ID_BYTES];
    id[0] = ID_VERSION;
    id[1..9].copy_from_slice(&magic.to_le_bytes());
    id[ADDR_AT..SUM_AT].copy_from_slice(&encode_addr(root));
    let sum = fnv32(&id[..SUM_AT]);
    id[SUM_AT..END].copy_from_slice(&sum.to_le_bytes());
    id
}

/// (magic, root address), or why these bytes are not an id from `new_unique_id`.
pub(crate) fn decode(id: &[u8; MSCCLPP_UNIQUE_ID_BYTES]) -> Result<(u64, SocketAddr), String> {
    if id[0] != ID_VERSION {
        return Err(format!(
            "unique id has version byte {:#04x}, expected {ID_VERSION:#04x} (not made by mscclppGetUniqueId?)",
            id[0]
        ));
    }
    let sum = u32::from_le_bytes([id[SUM_AT], id[SUM_AT + 1], id[SUM_AT + 2], id[SUM_AT + 3]]);
    if sum != fnv32(&id[..SUM_AT]) || id[END..].iter().any(|&b| b != 0) {
        return Err("unique id is corrupted (checksum or padding mismatch)".into());
    }
    let mut m = [0u8; 8];
    m.copy_from_slice(&id[1..9]);
    let magic = u64::from_le_bytes(m);
    if magic == 0 {
        return Err("unique id has a zero magic".into());
    }
    let root = decode_addr(&id[ADDR_AT..SUM_AT]).map_err(|e| format!("unique id: {e}"))?;
    Ok((magic, root))
}

/// Eight bytes from the kernel's CSPRNG, never zero.
pub(crate) fn random_magic() -> io::Result<u64> {
    let mut b = [0u8; 8];
    // Ends: getrandom of 8 bytes returns them all at once (<= 256 bytes never come back short
    // once the pool is ready); EINTR retries, a short read or any other error falls back.
    let mut tries = 0;
    let got = loop {
        tries += 1;
        // SAFETY: `b` is writable for its length.
        let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
        if n == b.len() as isize {
            break true;
        }
        let e = io::Error::last_os_error();
        if n < 0 && e.kind() == io::ErrorKind::Interrupted && tries < 100 {
            continue;
        }
        break false;
    };
    if !got {
        std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    }
    Ok(u64::from_le_bytes(b).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_corruption() {
        let root: SocketAddr = "10.1.2.3:4567".parse().unwrap();
        let id = encode(0xfeed, &root);
        assert_eq!(decode(&id).unwrap(), (0xfeed, root));
        for at in 0..MSCCLPP_UNIQUE_ID_BYTES {
            let mut bad = id;
            bad[at] ^= 0x40;
            assert!(decode(&bad).is_err(), "flip at {at} accepted");
        }
        assert!(decode(&[0; MSCCLPP_UNIQUE_ID_BYTES]).is_err());
        assert!(decode(&[0xff; MSCCLPP_UNIQUE_ID_BYTES]).is_err());
        let v6: SocketAddr = "[::1]:9".parse().unwrap();
        assert_eq!(decode(&encode(3, &v6)).unwrap(), (3, v6));
    }

    #[test]
    fn magics_differ() {
        let a = random_magic().unwrap();
        let b = random_magic().unwrap();
        assert_ne!(a, b);
        assert_ne!(a, 0);
    }
}
