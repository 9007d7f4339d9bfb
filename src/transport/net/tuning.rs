//! Knobs of a `NetEndpoint` that are not part of the transport choice.

/// Knobs that are not part of the transport choice; `from_env` reads them for `open`, tests set
/// them directly (the environment is shared by the tests of one process).
#[derive(Clone, Debug, Default)]
pub struct Tuning {
    /// Operations in flight per endpoint (`MSCCLPP_NET_TX_DEPTH`); default: the provider's tx
    /// size within [16, 4096]. More than the provider's queue exercises the -FI_EAGAIN path.
    pub depth: Option<usize>,
    /// Largest single write (`MSCCLPP_NET_MAX_CHUNK`); default and upper bound: the
    /// provider's `max_msg_size`.
    pub max_chunk: Option<u64>,
    /// Run the FI_MR_ENDPOINT sequence on providers that did not ask for it, accepting
    /// -FI_ENOSYS (`MSCCLPP_TEST_FORCE_MR_ENDPOINT=1`; tests only).
    pub force_mr_endpoint: bool,
    /// Do not ask for FI_DELIVERY_COMPLETE (`MSCCLPP_NET_DELIVERY_COMPLETE=0`): cheaper
    /// completions, but a flush then only means "locally complete" (for measurements).
    pub no_delivery_complete: bool,
    /// Stage every user region through host memory with `memcpy`, as GPU memory without
    /// FI_HMEM is staged (`MSCCLPP_TEST_FORCE_STAGING=1`; tests only).
    pub force_staging: bool,
    /// Never register GPU memory with FI_HMEM: stage it (`MSCCLPP_NET_HMEM=0`).
    pub no_hmem: bool,
    /// Bytes of each staging ring (`MSCCLPP_NET_STAGING_BYTES`, default 8 MiB).
    pub staging_bytes: Option<u64>,
    /// Records in each staging inbox (`MSCCLPP_NET_STAGING_SLOTS`, default 256).
    pub staging_slots: Option<u64>,
}

impl Tuning {
    pub fn from_env() -> Self {
        let num = |k: &str| {
            std::env::var(k)
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
        };
        Tuning {
            depth: num("MSCCLPP_NET_TX_DEPTH").map(|n| n as usize),
            max_chunk: num("MSCCLPP_NET_MAX_CHUNK"),
            force_mr_endpoint: std::env::var("MSCCLPP_TEST_FORCE_MR_ENDPOINT")
                .is_ok_and(|v| v == "1"),
            no_delivery_complete: std::env::var("MSCCLPP_NET_DELIVERY_COMPLETE")
                .is_ok_and(|v| v == "0"),
            force_staging: std::env::var("MSCCLPP_TEST_FORCE_STAGING").is_ok_and(|v| v == "1"),
            no_hmem: std::env::var("MSCCLPP_NET_HMEM").is_ok_and(|v| v == "0"),
            staging_bytes: num("MSCCLPP_NET_STAGING_BYTES"),
            staging_slots: num("MSCCLPP_NET_STAGING_SLOTS"),
        }
    }
}
