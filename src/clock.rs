//! One process-wide monotonic clock in nanoseconds, shared by the pool
//! (stream progress, probe intervals) and the simulator (stalls that end
//! on the clock).

use std::sync::LazyLock;
use std::time::Instant;

/// Nanoseconds on a process-wide monotonic clock, never 0 (so 0 can mean
/// "never" or "none" where it is stored).
pub(crate) fn now_ns() -> u64 {
    static BASE: LazyLock<Instant> = LazyLock::new(Instant::now);
    BASE.elapsed().as_nanos() as u64 + 1
}
