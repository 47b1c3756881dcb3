//! The maintenance step a background thread runs for each pool.
//!
//! A maintenance thread (see `Runtime`) calls [`DevicePool::maintain`]
//! every few milliseconds. Each call harvests completed pending frees
//! without blocking, and notices whether the pool saw any traffic since the
//! previous call. Idle detection costs the fast path nothing: it compares
//! the alloc and free counters between calls instead of stamping a clock on
//! every operation.

use super::DevicePool;
use std::time::{Duration, Instant};

/// What one [`DevicePool::maintain`] call did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MaintainReport {
    /// Pending-free records released.
    pub harvested: usize,
    /// How long the pool has gone without an alloc or a free, as seen by
    /// successive `maintain` calls (zero when there was traffic since the
    /// last call).
    pub idle_for: Duration,
    /// Whether this step flushed the streams' dirty memory (it does after
    /// the pool grew; see `flush_streams_if_grown`).
    pub flushed: bool,
}

/// Traffic seen by the previous `maintain` call.
#[derive(Debug)]
pub(crate) struct IdleState {
    ops: u64,
    since: Instant,
}

impl Default for IdleState {
    fn default() -> Self {
        IdleState {
            ops: 0,
            since: Instant::now(),
        }
    }
}

impl DevicePool {
    /// One maintenance step: harvests completed frees (never blocks the
    /// host) and measures how long the pool has been idle. Meant for one
    /// background thread per pool; calls from several threads are safe but
    /// share one idle clock.
    pub fn maintain(&self) -> MaintainReport {
        let flushed = self.shared.flush_streams_if_grown();
        let harvested = self.shared.harvest();
        let s = self.shared.stats();
        let ops = s.num_allocs + s.num_frees;
        let now = Instant::now();
        let mut idle = self.shared.idle.lock();
        if ops != idle.ops {
            idle.ops = ops;
            idle.since = now;
        }
        MaintainReport {
            harvested,
            idle_for: now - idle.since,
            flushed,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::sim::SimBackend;
    use crate::config::{PoolConfig, SimConfig};
    use crate::pool::DevicePool;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn idle_clock_restarts_on_traffic() {
        let be = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
        let pool = DevicePool::new(be, 0, PoolConfig::default()).unwrap();
        let s = pool.new_stream().unwrap();
        pool.maintain();
        std::thread::sleep(Duration::from_millis(20));
        let r = pool.maintain();
        assert!(r.idle_for >= Duration::from_millis(20), "{r:?}");
        drop(pool.alloc(4096, &s).unwrap());
        let r = pool.maintain();
        assert_eq!(r.idle_for, Duration::ZERO);
    }

    #[test]
    fn maintain_harvests_cross_stream_frees() {
        let be = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
        let pool = DevicePool::new(be, 0, PoolConfig::default()).unwrap();
        let (a, b) = (pool.new_stream().unwrap(), pool.new_stream().unwrap());
        let blk = pool.alloc(1 << 20, &a).unwrap();
        blk.record_stream(&b);
        drop(blk);
        assert!(pool.stats().pending_bytes.current > 0);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut harvested = 0;
        while harvested == 0 && std::time::Instant::now() < deadline {
            harvested += pool.maintain().harvested;
        }
        assert!(harvested > 0);
        assert_eq!(pool.stats().pending_bytes.current, 0);
    }
}
