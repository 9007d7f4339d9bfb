//! The P2P endpoint's settings from the environment, read where they were read before (at
//! `open`, at `use_done_word`). The SM engine reads its own (`MSCCLPP_P2P_ENGINE`,
//! `MSCCLPP_P2P_SM_*`) in `engine.rs`, through `env_u64`.

use super::ce::FlagMode;
use crate::cuda;

pub(super) fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

pub(super) fn flag_mode_from_env() -> FlagMode {
    match std::env::var("MSCCLPP_P2P_FLAG").as_deref() {
        Ok("copy") => FlagMode::Copy,
        _ if cuda::has_write_value64() => FlagMode::WriteValue,
        _ => FlagMode::Copy,
    }
}

/// `MSCCLPP_P2P_STATS=1`: time the driver calls (`Stats`), reported when the endpoint closes.
pub(super) fn stats_from_env() -> bool {
    std::env::var("MSCCLPP_P2P_STATS").is_ok_and(|v| v == "1")
}

/// `MSCCLPP_P2P_DONE_WORD=0`: never store the FIFO's done word (flush() waits for the proxy).
pub(super) fn done_word_off_by_env() -> bool {
    std::env::var("MSCCLPP_P2P_DONE_WORD").is_ok_and(|v| v == "0")
}
