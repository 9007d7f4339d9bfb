//! The connection-setup envelope a peer sends (`comm::ConnBlob::decode`): whatever is accepted
//! names the expected rank, tag and transport and is the canonical encoding of itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mscclpp::abi::mscclppTransport_t;
use mscclpp::comm::ConnBlob;

fuzz_target!(|data: &[u8]| {
    for tr in [
        mscclppTransport_t::mscclppTransportIB,
        mscclppTransport_t::mscclppTransportSHM,
    ] {
        // The transports' `Caps::direct_epoch`: only SHM (and P2P) accept a shared epoch.
        let direct = tr == mscclppTransport_t::mscclppTransportSHM;
        if let Ok(b) = ConnBlob::decode(data, 1, 5, tr, direct) {
            assert_eq!((b.rank, b.tag, b.transport), (1, 5, tr as u32));
            assert!(b.size > 0);
            assert_eq!(b.encode(), data);
            assert!(b.epoch_shm.is_empty() || direct);
        }
    }
});
