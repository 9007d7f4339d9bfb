//! The `Endpoint` conformance suite: every case of `conformance/cases.rs` over every endpoint
//! that can open here. Test `<opener>::<case>` runs the case alone in a child process with the
//! opener's environment (`conformance::run`); an opener that cannot open on this machine (no
//! `net` provider in fi_getinfo, no CUDA driver) is skipped with its reason printed.
//!
//! Openers: `tcp` (tcp;ofi_rxm, the loopback domain named as ibDev would), `tcp_default` (no
//! provider or domain named: must land on loopback), `net` (libfabric's `net` provider), `shm`,
//! `shm_sar` (FI_SHM_DISABLE_CMA=1: large writes by shm's SAR protocol, uncut), `staged_tcp` and `staged_shm` (MSCCLPP_TEST_FORCE_STAGING=1: every region staged through
//! host memory as GPU memory without FI_HMEM is), `mr_endpoint_tcp` and `mr_endpoint_shm`
//! (MSCCLPP_TEST_FORCE_MR_ENDPOINT=1: the FI_MR_ENDPOINT registration sequence), and `p2p`
//! (CUDA IPC on device 0, device memory; needs a CUDA driver and device).
//!
//! Direct libfabric openers (but `shm_sar`) cap a single write at 64 KiB and the staged ones use a 64 KiB
//! ring with 8 record slots, so that chunking, wrapping and flow control run in every case.

mod common;
mod conformance;

use conformance::{cases, run, Opener};
use mscclpp::transport::{self, Endpoint, MemKind};

const CHUNK: &str = "65536";

/// A write larger than the 64 KiB chunk (three chunks and a piece).
const NET_BIG: usize = 3 * 65536 + 5;
/// A write well above shm's inject size (4 KiB), uncut: many passes of its SAR protocol.
const SAR_BIG: usize = (1 << 20) + 5;
/// A write four times the 64 KiB staging ring, and a piece.
const STAGED_BIG: usize = 4 * 65536 + 40;

fn open_lo() -> mscclpp::error::Result<Box<dyn Endpoint>> {
    transport::net::open(Some("lo"), false, None)
}

fn open_default() -> mscclpp::error::Result<Box<dyn Endpoint>> {
    let ep = transport::net::open(None, false, None)?;
    assert!(
        ep.describe().contains("/lo"),
        "default choice should be the loopback domain of a software provider: {}",
        ep.describe()
    );
    Ok(ep)
}

fn open_shm() -> mscclpp::error::Result<Box<dyn Endpoint>> {
    transport::net::open(None, true, None)
}

fn everywhere() -> Result<(), String> {
    Ok(())
}

/// A libfabric endpoint on host memory, writes cut at 64 KiB.
fn direct(
    env: &'static [(&'static str, &'static str)],
    open: fn() -> mscclpp::error::Result<Box<dyn Endpoint>>,
    proof: &'static [&'static str],
) -> Opener {
    Opener {
        env,
        open,
        mem: MemKind::Host,
        big: NET_BIG,
        libfabric: true,
        proof,
        available: everywhere,
    }
}

mod openers {
    use super::*;

    // libfabric 1.x serves RDM over tcp as `tcp;ofi_rxm`, 2.x's tcp provider does it itself:
    // the opened provider's name starts with `tcp` either way, on the loopback domain.
    const TCP: &str = "net: opened tcp";
    const LO: &str = " domain lo ";
    const SHM: &str = "net: opened shm domain ";
    const CHUNKED: &str = "chunk 65536";
    const STAGED: [&str; 2] = [
        "(staging forced for testing)",
        "host memory, staged (MSCCLPP_TEST_FORCE_STAGING=1)",
    ];
    const MR_ENDPOINT: &str = "(FI_MR_ENDPOINT forced for testing)";

    pub fn tcp() -> Opener {
        direct(
            &[
                ("MSCCLPP_NET_PROVIDER", "tcp"),
                ("MSCCLPP_NET_MAX_CHUNK", CHUNK),
            ],
            open_lo,
            &[TCP, LO, CHUNKED],
        )
    }

    pub fn tcp_default() -> Opener {
        direct(
            &[("MSCCLPP_NET_MAX_CHUNK", CHUNK)],
            open_default,
            &[TCP, LO, CHUNKED],
        )
    }

    pub fn net() -> Opener {
        Opener {
            available: || common::provider_listed("net"),
            ..direct(
                &[
                    ("MSCCLPP_NET_PROVIDER", "net"),
                    ("MSCCLPP_NET_MAX_CHUNK", CHUNK),
                ],
                || transport::net::open(None, false, None),
                &["net: opened net domain ", CHUNKED],
            )
        }
    }

    pub fn shm() -> Opener {
        direct(
            &[("MSCCLPP_NET_MAX_CHUNK", CHUNK)],
            open_shm,
            &[SHM, CHUNKED],
        )
    }

    /// shm without cross-memory attach: writes above its inject size go by its SAR protocol,
    /// whose receiver moves on to the next command while the data still comes; the sender
    /// holds that command back until it is in (`order.rs`), so values after such writes, and
    /// riding on a small write right after one, are posted plain. Writes are not cut: here the
    /// provider's own order is what `value_after_data` and `value_rides_with_data` check.
    pub fn shm_sar() -> Opener {
        Opener {
            big: SAR_BIG,
            ..direct(
                &[("FI_SHM_DISABLE_CMA", "1")],
                open_shm,
                &[
                    SHM,
                    "plain after writes of any size",
                    "SAR protocol holds back",
                ],
            )
        }
    }

    /// The unordered test layer (`MSCCLPP_TEST_UNORDERED`) over a real provider: `layer` is
    /// `cxi` (every write ordered; remote CQ data on writes refused, which the endpoint must
    /// find out by trying: its log names the refusal), `efa` (nothing ordered), `psm3`
    /// (ordered below 4 KiB) or `verbs` (ordered below 16 KiB), as docs/PROVIDERS.md reads
    /// them.
    fn unordered(
        env: &'static [(&'static str, &'static str)],
        open: fn() -> mscclpp::error::Result<Box<dyn Endpoint>>,
        real: &'static str,
        layer: &'static str,
    ) -> Opener {
        let proof: &'static [&'static str] = match (real, layer) {
            (TCP, "cxi") => &[
                TCP,
                UNORDERED_CXI,
                "plain after writes of any size",
                CXI_REFUSED,
            ],
            (_, "cxi") => &[
                SHM,
                UNORDERED_CXI,
                "plain after writes of any size",
                CXI_REFUSED,
            ],
            (TCP, "efa") => &[TCP, UNORDERED_EFA, "after every write: posted once"],
            (_, "efa") => &[SHM, UNORDERED_EFA, "after every write: posted once"],
            (TCP, "verbs") => &[TCP, UNORDERED_VERBS, VERBS_BOUND],
            (_, "verbs") => &[SHM, UNORDERED_VERBS, VERBS_BOUND],
            (TCP, _) => &[
                TCP,
                UNORDERED_PSM3,
                "plain after writes of up to 4095 bytes",
            ],
            _ => &[
                SHM,
                UNORDERED_PSM3,
                "plain after writes of up to 4095 bytes",
            ],
        };
        direct(env, open, proof)
    }
    const UNORDERED_CXI: &str = "unordered test layer cxi-like";
    const UNORDERED_EFA: &str = "unordered test layer EFA-like";
    const UNORDERED_PSM3: &str = "unordered test layer psm3-like";
    const UNORDERED_VERBS: &str = "unordered test layer verbs-like";
    const CXI_REFUSED: &str =
        "the provider refused a write carrying remote CQ data to the endpoint itself";
    const VERBS_BOUND: &str = "plain after writes of up to 16383 bytes";

    pub fn unordered_cxi_tcp() -> Opener {
        unordered(
            &[
                ("MSCCLPP_TEST_UNORDERED", "cxi"),
                ("MSCCLPP_NET_PROVIDER", "tcp"),
                ("MSCCLPP_NET_MAX_CHUNK", CHUNK),
            ],
            open_lo,
            TCP,
            "cxi",
        )
    }

    pub fn unordered_cxi_shm() -> Opener {
        unordered(
            &[
                ("MSCCLPP_TEST_UNORDERED", "cxi"),
                ("MSCCLPP_NET_MAX_CHUNK", CHUNK),
            ],
            open_shm,
            SHM,
            "cxi",
        )
    }

    pub fn unordered_verbs_tcp() -> Opener {
        unordered(
            &[
                ("MSCCLPP_TEST_UNORDERED", "verbs"),
                ("MSCCLPP_NET_PROVIDER", "tcp"),
                ("MSCCLPP_NET_MAX_CHUNK", CHUNK),
            ],
            open_lo,
            TCP,
            "verbs",
        )
    }

    pub fn unordered_verbs_shm() -> Opener {
        unordered(
            &[
                ("MSCCLPP_TEST_UNORDERED", "verbs"),
                ("MSCCLPP_NET_MAX_CHUNK", CHUNK),
            ],
            open_shm,
            SHM,
            "verbs",
        )
    }

    /// A staged source (host memory copied out through 16 KiB bounce slots, as GPU memory
    /// without FI_HMEM is) into the peer's host memory, under a bounded provider's layer: a
    /// signal rides only where every chunk really written, and the riding one, are ordered.
    pub fn unordered_psm3_staged_source_tcp() -> Opener {
        direct(
            &[
                ("MSCCLPP_TEST_UNORDERED", "psm3"),
                ("MSCCLPP_NET_PROVIDER", "tcp"),
                ("MSCCLPP_TEST_FORCE_STAGING", "source"),
                ("MSCCLPP_NET_STAGING_CHUNK", "16384"),
            ],
            open_lo,
            &[TCP, UNORDERED_PSM3, STAGED_SOURCE],
        )
    }

    pub fn unordered_verbs_staged_source_shm() -> Opener {
        direct(
            &[
                ("MSCCLPP_TEST_UNORDERED", "verbs"),
                ("MSCCLPP_TEST_FORCE_STAGING", "source"),
                ("MSCCLPP_NET_STAGING_CHUNK", "16384"),
            ],
            open_shm,
            &[SHM, UNORDERED_VERBS, STAGED_SOURCE],
        )
    }
    const STAGED_SOURCE: &str = "writes from it staged through bounce slots";

    /// Two rails over loopback under the EFA-like layer: puts above 16 KiB striped over both,
    /// each rail unordered, a value on rail 0 only after the other rail's data is delivered.
    pub fn unordered_efa_rails_tcp() -> Opener {
        direct(
            &[
                ("MSCCLPP_TEST_UNORDERED", "efa"),
                ("MSCCLPP_NET_PROVIDER", "tcp"),
                ("MSCCLPP_NET_STRIPE_CHUNK", "16384"),
            ],
            || transport::net::open(Some("lo+lo"), false, None),
            &[TCP, UNORDERED_EFA, "over its 2 rails"],
        )
    }

    /// Two rails under the psm3-like layer (values riding on rail 0 where ordered).
    pub fn unordered_psm3_rails_tcp() -> Opener {
        direct(
            &[
                ("MSCCLPP_TEST_UNORDERED", "psm3"),
                ("MSCCLPP_NET_PROVIDER", "tcp"),
                ("MSCCLPP_NET_STRIPE_CHUNK", "16384"),
            ],
            || transport::net::open(Some("lo+lo"), false, None),
            &[TCP, UNORDERED_PSM3, "over its 2 rails"],
        )
    }

    pub fn unordered_efa_tcp() -> Opener {
        unordered(
            &[
                ("MSCCLPP_TEST_UNORDERED", "efa"),
                ("MSCCLPP_NET_PROVIDER", "tcp"),
                ("MSCCLPP_NET_MAX_CHUNK", CHUNK),
            ],
            open_lo,
            TCP,
            "efa",
        )
    }

    pub fn unordered_efa_shm() -> Opener {
        unordered(
            &[
                ("MSCCLPP_TEST_UNORDERED", "efa"),
                ("MSCCLPP_NET_MAX_CHUNK", CHUNK),
            ],
            open_shm,
            SHM,
            "efa",
        )
    }

    pub fn unordered_psm3_tcp() -> Opener {
        unordered(
            &[
                ("MSCCLPP_TEST_UNORDERED", "psm3"),
                ("MSCCLPP_NET_PROVIDER", "tcp"),
                ("MSCCLPP_NET_MAX_CHUNK", CHUNK),
            ],
            open_lo,
            TCP,
            "psm3",
        )
    }

    pub fn unordered_psm3_shm() -> Opener {
        unordered(
            &[
                ("MSCCLPP_TEST_UNORDERED", "psm3"),
                ("MSCCLPP_NET_MAX_CHUNK", CHUNK),
            ],
            open_shm,
            SHM,
            "psm3",
        )
    }

    /// Staging (every record drained to delivery) under the EFA-like layer.
    pub fn unordered_efa_staged_tcp() -> Opener {
        const ENV: [(&str, &str); 5] = [
            STAGING[0],
            STAGING[1],
            STAGING[2],
            ("MSCCLPP_NET_PROVIDER", "tcp"),
            ("MSCCLPP_TEST_UNORDERED", "efa"),
        ];
        Opener {
            big: STAGED_BIG,
            ..direct(&ENV, open_lo, &[TCP, STAGED[0], STAGED[1], UNORDERED_EFA])
        }
    }

    const STAGING: [(&str, &str); 3] = [
        ("MSCCLPP_TEST_FORCE_STAGING", "1"),
        ("MSCCLPP_NET_STAGING_BYTES", "65536"),
        ("MSCCLPP_NET_STAGING_SLOTS", "8"),
    ];

    pub fn staged_tcp() -> Opener {
        const ENV: [(&str, &str); 4] = [
            STAGING[0],
            STAGING[1],
            STAGING[2],
            ("MSCCLPP_NET_PROVIDER", "tcp"),
        ];
        Opener {
            big: STAGED_BIG,
            ..direct(&ENV, open_lo, &[TCP, LO, STAGED[0], STAGED[1]])
        }
    }

    pub fn staged_shm() -> Opener {
        Opener {
            big: STAGED_BIG,
            ..direct(&STAGING, open_shm, &[SHM, STAGED[0], STAGED[1]])
        }
    }

    pub fn mr_endpoint_tcp() -> Opener {
        direct(
            &[
                ("MSCCLPP_TEST_FORCE_MR_ENDPOINT", "1"),
                ("MSCCLPP_NET_PROVIDER", "tcp"),
                ("MSCCLPP_NET_MAX_CHUNK", CHUNK),
            ],
            open_lo,
            &[TCP, LO, MR_ENDPOINT, CHUNKED],
        )
    }

    pub fn mr_endpoint_shm() -> Opener {
        direct(
            &[
                ("MSCCLPP_TEST_FORCE_MR_ENDPOINT", "1"),
                ("MSCCLPP_NET_MAX_CHUNK", CHUNK),
            ],
            open_shm,
            &[SHM, MR_ENDPOINT, CHUNKED],
        )
    }

    pub fn p2p() -> Opener {
        Opener {
            env: &[],
            open: || transport::p2p::open(0),
            mem: MemKind::Device(0),
            // Above the SM engine's largest job (MSCCLPP_P2P_SM_MAX_BYTES, 2 MiB): the copy
            // engines then carry it.
            big: (2 << 20) + 24,
            libfabric: false,
            proof: &["p2p endpoint on CUDA device 0"],
            available: || {
                if !mscclpp::cuda::available() {
                    return Err("no CUDA driver here (mscclpp::cuda::available() is false)".into());
                }
                if mscclpp::cuda::device_count() < 1 {
                    return Err("the CUDA driver sees no device".into());
                }
                Ok(())
            },
        }
    }
}

/// One module per opener, one test per case in it: `<opener>::<case>`.
macro_rules! suite {
    ($($opener:ident),* $(,)?) => {$(
        mod $opener {
            use super::*;
            fn go(case: &str, body: fn(&Opener)) {
                run(stringify!($opener), openers::$opener(), case, body)
            }
            #[test]
            fn bytes_arrive() {
                go("bytes_arrive", cases::bytes_arrive)
            }
            #[test]
            fn value_after_data() {
                go("value_after_data", cases::value_after_data)
            }
            #[test]
            fn value_rides_with_data() {
                go("value_rides_with_data", cases::value_rides_with_data)
            }
            #[test]
            fn flush_means_arrived() {
                go("flush_means_arrived", cases::flush_means_arrived)
            }
            #[test]
            fn many_small_writes() {
                go("many_small_writes", cases::many_small_writes)
            }
            #[test]
            fn malformed_blobs_rejected() {
                go("malformed_blobs_rejected", cases::malformed_blobs_rejected)
            }
            #[test]
            fn out_of_range_refused() {
                go("out_of_range_refused", cases::out_of_range_refused)
            }
            #[test]
            fn register_twice_same_id() {
                go("register_twice_same_id", cases::register_twice_same_id)
            }
            #[test]
            fn two_peers() {
                go("two_peers", cases::two_peers)
            }
        }
    )*};
}

suite!(
    tcp,
    tcp_default,
    net,
    shm,
    shm_sar,
    staged_tcp,
    staged_shm,
    unordered_cxi_tcp,
    unordered_cxi_shm,
    unordered_efa_tcp,
    unordered_efa_shm,
    unordered_psm3_tcp,
    unordered_psm3_shm,
    unordered_verbs_tcp,
    unordered_verbs_shm,
    unordered_efa_staged_tcp,
    unordered_psm3_staged_source_tcp,
    unordered_verbs_staged_source_shm,
    unordered_efa_rails_tcp,
    unordered_psm3_rails_tcp,
    mr_endpoint_tcp,
    mr_endpoint_shm,
    p2p,
);
