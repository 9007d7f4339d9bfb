//! Staging records, the wire format of `staging/`: what a writer puts into a peer's inbox per
//! chunk of data or per value, and the check word that tells a complete record from a torn
//! (partly arrived) one. A leaf: `blob.rs` sizes inboxes by it and `ops.rs` its inline area.

/// One record in a peer's inbox: 8 little-endian words (see [`Record`]).
pub(crate) const RECORD_BYTES: usize = 64;
/// Mixed into the record check word, so that a zeroed slot never passes as a record.
const CHECK_SALT: u64 = 0x4d53_5354_4147_4531; // "MSSTAGE1"

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `arg` bytes from ring position `ring_pos` to `region` + `off`.
    Data = 1,
    /// The 8-byte value `arg` to `region` + `off`.
    Value = 2,
}

/// A record: `seq` (from 1, one series per writer and receiving endpoint), kind and target
/// region id, offset, size or value, ring position, then a check word over the others that a
/// torn (partly arrived) record fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Record {
    pub seq: u64,
    pub kind: Kind,
    pub region: u32,
    pub off: u64,
    pub arg: u64,
    pub ring_pos: u64,
}

fn check_word(w: &[u64]) -> u64 {
    // A 64-bit mix (splitmix-style) of every word: a record that is part old, part new fails it
    // except with negligible probability.
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15;
    for &x in w {
        h = (h ^ x).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h ^= h >> 31;
    }
    h ^ CHECK_SALT
}

impl Record {
    fn words(&self) -> [u64; 8] {
        let mut w = [
            self.seq,
            self.kind as u64 | (self.region as u64) << 32,
            self.off,
            self.arg,
            self.ring_pos,
            0,
            0,
            0,
        ];
        w[7] = check_word(&w[..7]);
        w
    }

    pub fn encode(&self) -> [u8; RECORD_BYTES] {
        let mut b = [0u8; RECORD_BYTES];
        for (i, w) in self.words().iter().enumerate() {
            b[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
        }
        b
    }

    /// A record from its 8 words as read from memory (little-endian); None if the check word
    /// does not match (not written yet, or only partly) or the kind is unknown.
    pub fn decode(raw: &[u64; 8]) -> Option<Record> {
        let w = raw.map(u64::from_le);
        if check_word(&w[..7]) != w[7] || w[5] != 0 || w[6] != 0 {
            return None;
        }
        let kind = match w[1] & 0xff {
            1 => Kind::Data,
            2 => Kind::Value,
            _ => return None,
        };
        if (w[1] >> 8) & 0xff_ffff != 0 {
            return None;
        }
        Some(Record {
            seq: w[0],
            kind,
            region: (w[1] >> 32) as u32,
            off: w[2],
            arg: w[3],
            ring_pos: w[4],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_roundtrip_and_torn_records() {
        let r = Record {
            seq: 42,
            kind: Kind::Data,
            region: 7,
            off: 1 << 33,
            arg: 4096,
            ring_pos: 128,
        };
        let b = r.encode();
        let mut w = [0u64; 8];
        for (i, x) in w.iter_mut().enumerate() {
            *x = u64::from_ne_bytes(b[i * 8..i * 8 + 8].try_into().unwrap());
        }
        assert_eq!(Record::decode(&w), Some(r));
        // Any word from an older record (a torn arrival) fails the check.
        for i in 0..8 {
            let mut t = w;
            t[i] ^= 1;
            assert_eq!(Record::decode(&t), None, "word {i}");
        }
        assert_eq!(Record::decode(&[0; 8]), None, "a zeroed slot is no record");
        let v = Record {
            kind: Kind::Value,
            ..r
        };
        assert_eq!(Record::decode(&v.words().map(u64::to_le)), Some(v));
    }
}
