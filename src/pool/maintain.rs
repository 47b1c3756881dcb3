//! The maintenance step a background thread runs for each pool.
//!
//! A maintenance thread (see `Runtime`) calls [`DevicePool::maintain`]
//! every few milliseconds. Each call harvests completed pending frees
//! without blocking, and notices whether the pool saw any traffic since the
//! previous call. Idle detection costs the fast path nothing: it compares
//! the alloc and free counters between calls instead of stamping a clock on
//! every operation.
//!
//! It also services compaction without blocking: it harvests movable frees
//! and commits a pass whose event completed. When `idle_ms` is set and the
//! pool has been idle that long, it starts one bounded pass (not waiting
//! for it); it keeps starting passes on later calls while they find blocks
//! to move, and stops for the rest of the idle period once a pass finds
//! nothing, so an idle, compact pool costs nothing.

use super::{CompactReport, DevicePool};
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
    /// Compaction work of this call: commits of finished passes, and the
    /// idle-time pass it started, if any (`None` when nothing happened).
    pub compaction: Option<CompactReport>,
}

/// Traffic seen by the previous `maintain` call.
#[derive(Debug)]
pub(crate) struct IdleState {
    /// Allocations plus frees when last measured.
    pub(super) ops: u64,
    since: Instant,
    /// An idle pass found nothing to move in this idle period.
    compacted: bool,
}

impl Default for IdleState {
    fn default() -> Self {
        IdleState {
            ops: 0,
            since: Instant::now(),
            compacted: false,
        }
    }
}

impl DevicePool {
    /// One maintenance step: harvests completed frees (never blocks the
    /// host) and measures how long the pool has been idle. Meant for one
    /// background thread per pool; calls from several threads are safe but
    /// share one idle clock.
    ///
    /// While a CUDA graph capture is underway on the device it does nothing
    /// but notice the end of captures it detected (see `capture.rs`).
    pub fn maintain(&self) -> MaintainReport {
        self.shared.poll_detected();
        if self.shared.capture.underway() {
            return MaintainReport::default();
        }
        let flushed = self.shared.flush_streams_if_grown();
        let harvested = self.shared.harvest_background();
        // The per-thread counter shards only: `stats()` would also walk
        // the heap under its lock, every tick, stalling allocations.
        let ops = self.shared.counters.traffic();
        let now = Instant::now();
        let mut idle = self.shared.idle.lock();
        if ops != idle.ops {
            idle.ops = ops;
            idle.since = now;
            idle.compacted = false;
        }
        let idle_for = now - idle.since;
        let mut compaction = Some(self.shared.movable().service(&self.shared));
        // Regions emptied by passes that asked to give them back (each
        // pass keeps its caller's choice, see `CompactOptions::release`).
        if let Some(c) = compaction.as_mut().filter(|c| c.regions_released > 0) {
            c.bytes_released += self.shared.release_cached_memory();
        }
        let due = self.shared.cfg().idle.is_some_and(|d| idle_for >= d);
        if due && !idle.compacted {
            match self.shared.movable().idle_pass(&self.shared) {
                Ok(r) => {
                    // Nothing planned and nothing in flight: compact for now.
                    idle.compacted = r.blocks_planned == 0 && !r.in_flight;
                    compaction = Some(merge(compaction.unwrap_or_default(), r));
                }
                Err(e) => {
                    tracing::warn!(device = self.device(), "idle compaction failed: {e}");
                    idle.compacted = true;
                }
            }
        }
        MaintainReport {
            harvested,
            flushed,
            idle_for,
            compaction: compaction
                .filter(|r| r.committed || r.blocks_planned > 0 || r.regions_released > 0),
        }
    }
}

/// Sums the service step's report and the pass's.
fn merge(a: CompactReport, b: CompactReport) -> CompactReport {
    CompactReport {
        blocks_moved: a.blocks_moved + b.blocks_moved,
        bytes_moved: a.bytes_moved + b.bytes_moved,
        blocks_planned: b.blocks_planned,
        bytes_planned: b.bytes_planned,
        moves_cancelled: a.moves_cancelled + b.moves_cancelled,
        regions_released: a.regions_released + b.regions_released,
        bytes_released: a.bytes_released + b.bytes_released,
        committed: a.committed || b.committed,
        in_flight: b.in_flight,
        duration: a.duration + b.duration,
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
