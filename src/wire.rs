//! A tiny, bounds-checked binary encoding for setup blobs exchanged between ranks. Hand-written
//! because the blobs are a few fixed fields and byte strings: a serde format would add a
//! dependency and still need the same validation of sizes and values.

use crate::error::{Error, Result};

/// The largest byte string any setup blob may carry.
pub const MAX_FIELD: usize = 4096;

#[derive(Default)]
pub struct Writer(Vec<u8>);

impl Writer {
    pub fn new() -> Self {
        Writer(Vec::new())
    }
    pub fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(self, b: &[u8]) -> Self {
        assert!(
            b.len() <= MAX_FIELD,
            "setup field of {} bytes exceeds {MAX_FIELD}",
            b.len()
        );
        let mut s = self.u32(b.len() as u32);
        s.0.extend_from_slice(b);
        s
    }
    pub fn finish(self) -> Vec<u8> {
        self.0
    }
}

/// Reads fields in order; every read is checked, `finish` rejects trailing bytes.
pub struct Reader<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        Reader { buf, what }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.buf.len() < n {
            return Err(Error::remote(format!(
                "malformed {}: truncated ({} bytes left, {n} needed)",
                self.what,
                self.buf.len()
            )));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    pub fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.u32()? as usize;
        if n > MAX_FIELD {
            return Err(Error::remote(format!(
                "malformed {}: field of {n} bytes exceeds {MAX_FIELD}",
                self.what
            )));
        }
        self.take(n)
    }
    pub fn finish(self) -> Result<()> {
        if !self.buf.is_empty() {
            return Err(Error::remote(format!(
                "malformed {}: {} trailing bytes",
                self.what,
                self.buf.len()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn roundtrip() {
        let b = Writer::new().u32(7).u64(1 << 40).bytes(b"abc").finish();
        let mut r = Reader::new(&b, "test");
        assert_eq!(r.u32().unwrap(), 7);
        assert_eq!(r.u64().unwrap(), 1 << 40);
        assert_eq!(r.bytes().unwrap(), b"abc");
        r.finish().unwrap();
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut r = Reader::new(&data, "fuzz");
            let _ = r.u32().and_then(|_| r.bytes()).and_then(|_| r.u64());
        }
    }
}
