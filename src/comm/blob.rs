//! The connection-setup envelope: one rank's half of a connection, as sent to the peer over the
//! bootstrap, and the bootstrap tag spaces of setup's messages.

use crate::abi::mscclppTransport_t;
use crate::error::{Error, Result};
use crate::wire::{Reader, Writer};

const CONN_MAGIC: u32 = 0x4d53_434e; // "MSCN"
const WIRE_VERSION: u32 = 2;
// Bootstrap tag spaces (top byte) for the messages of connection setup; the low 32 bits carry
// the connection's tag. Public so that protocol tests can speak to a real rank.
/// Tag space of the [`ConnBlob`]s (`TAG_CONN | tag as u32`).
pub const TAG_CONN: u64 = 1 << 56;
/// Tag space of the setup acknowledgements (`b"ok"`).
pub const TAG_ACK: u64 = 2 << 56;
/// Tag space of the registered-buffer blobs.
pub const TAG_REG: u64 = 3 << 56;
/// Tag of "this rank has closed its mappings of your memory" at destroy (`comm::teardown`).
pub const TAG_UNMAPPED: u64 = 4 << 56;
/// Tag space of "this rank dropped its imports of registration n" (`mscclppUnregisterBuffer`,
/// `TAG_UNREG | tag as u32`): apart from `TAG_REG`, whose tags name the registration, so
/// that a peer unregistering another one is told at once rather than at the timeout.
pub const TAG_UNREG: u64 = 5 << 56;

/// One rank's half of a connection, sent to the peer on `TAG_CONN | tag` during setup: magic,
/// version, transport, tag, sender rank (u32 LE each), buffer size (u64 LE), then the
/// transport's endpoint address, data-region blob and epoch-region blob (u32 LE length, at
/// most `wire::MAX_FIELD` bytes each), then the name of the shared-memory object holding the
/// epoch block (SHM over host memory; empty otherwise, at most 64 bytes). The three blobs are
/// the transport's to validate; the name, `mem::SharedBlock::open`'s.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnBlob<'a> {
    pub transport: u32,
    pub tag: i32,
    pub rank: usize,
    pub size: u64,
    pub addr: &'a [u8],
    pub data: &'a [u8],
    pub epoch: &'a [u8],
    pub epoch_shm: &'a [u8],
}

impl<'a> ConnBlob<'a> {
    pub fn encode(&self) -> Vec<u8> {
        Writer::new()
            .u32(CONN_MAGIC)
            .u32(WIRE_VERSION)
            .u32(self.transport)
            .u32(self.tag as u32)
            .u32(self.rank as u32)
            .u64(self.size)
            .bytes(self.addr)
            .bytes(self.data)
            .bytes(self.epoch)
            .bytes(self.epoch_shm)
            .finish()
    }

    /// Parses the half that rank `from` sent for the connection this rank declared with `tag`
    /// and `transport`, and checks it against that declaration; `direct_epoch`: the transport
    /// accepts an epoch block offered by name (`transport::Caps::direct_epoch`). Pure: no I/O,
    /// no allocation beyond the error text; the blobs it returns borrow from `msg`.
    pub fn decode(
        msg: &'a [u8],
        from: usize,
        tag: i32,
        transport: mscclppTransport_t,
        direct_epoch: bool,
    ) -> Result<Self> {
        let mut rd = Reader::new(msg, "connection setup blob");
        let (magic, ver) = (rd.u32()?, rd.u32()?);
        if magic != CONN_MAGIC || ver != WIRE_VERSION {
            return Err(Error::remote(format!(
                "rank {from}: foreign connection blob (magic {magic:#x}, version {ver})"
            )));
        }
        let (tr, rtag, rank, size) = (rd.u32()?, rd.u32()? as i32, rd.u32()? as usize, rd.u64()?);
        let (addr, data, epoch, epoch_shm) = (rd.bytes()?, rd.bytes()?, rd.bytes()?, rd.bytes()?);
        rd.finish()?;
        if rank != from || rtag != tag {
            return Err(Error::remote(format!(
                "rank {from}: setup blob names rank {rank} tag {rtag}, expected rank {from} tag {tag}"
            )));
        }
        if tr != transport as u32 {
            return Err(Error::invalid_arg(format!(
                "connection to rank {from} tag {tag}: transports differ (here {transport:?}, peer {tr})"
            )));
        }
        if size == 0 {
            return Err(Error::remote(format!(
                "rank {from}: peer registered a 0-byte buffer"
            )));
        }
        if !epoch_shm.is_empty() && (!direct_epoch || epoch_shm.len() > 64) {
            return Err(Error::remote(format!(
                "rank {from}: setup blob names a shared epoch block ({} bytes) on a {transport:?} connection",
                epoch_shm.len()
            )));
        }
        Ok(ConnBlob {
            transport: tr,
            tag: rtag,
            rank,
            size,
            addr,
            data,
            epoch,
            epoch_shm,
        })
    }
}
