//! Giving cached memory back without blocking the host: the primitives of
//! the runtime's idle release policy (see `Runtime` and
//! `PoolConfig::idle_release`).
//!
//! [`DevicePool::trim`] gives back everything but waits for pending frees
//! on the host. [`DevicePool::release_cache`] is its non-blocking sibling for
//! a background thread: what is still in flight on the device stays cached
//! and goes on a later call.

use super::DevicePool;
use std::sync::atomic::Ordering::Relaxed;

impl DevicePool {
    /// Gives idle cached memory back to the device without blocking the
    /// host: moves every stream's freed memory onto the pending list (one
    /// event per stream), harvests what completed, retires empty slabs and
    /// releases the physical memory no block uses. Memory whose last use
    /// is still running stays cached; a later call releases it. Slots
    /// cached in other threads' per-thread caches stay too. Returns the
    /// bytes given back.
    pub fn release_cache(&self) -> u64 {
        let sh = &self.shared;
        if sh.check_live().is_err() || sh.capture.underway() {
            return 0;
        }
        super::magazine::flush_for(sh);
        sh.flush_all_streams();
        sh.harvest();
        sh.retire_empty_slabs();
        sh.heap.lock().heap.release_cached()
    }

    /// Makes every freed byte reusable by any stream, keeping it (unlike
    /// [`DevicePool::trim`]): flushes every stream's freed memory onto the
    /// pending list, waits on the host for the pending frees' events, and
    /// harvests them. Blocks the host; for warm-up and checkpoints, never
    /// called on the alloc/free path.
    pub fn settle(&self) -> crate::error::Result<()> {
        let sh = &self.shared;
        sh.check_live()?;
        if sh.capture.underway() {
            return Err(sh.capture_error("settle"));
        }
        // No maintenance tick in between (as in `trim`): one harvesting
        // holds the pending records that the wait below must see.
        let _gate = sh.maint_gate.lock();
        super::magazine::flush_for(sh);
        sh.flush_all_streams();
        sh.sync_pending()?;
        sh.harvest();
        Ok(())
    }

    /// Excludes [`DevicePool::audit`] while held: the runtime's
    /// maintenance thread holds it for each tick.
    pub(crate) fn maintenance_gate(&self) -> parking_lot::MutexGuard<'_, ()> {
        self.shared.maint_gate.lock()
    }

    /// The peak of active (rounded live) bytes since the previous call (or
    /// since the pool was built), and starts a new window. The idle
    /// release policy's measure of what the last busy period needed. Exact
    /// for one allocating thread per pool, a lower bound otherwise (like
    /// the pool's other peaks).
    pub fn take_window_peak(&self) -> u64 {
        let c = &self.shared.counters;
        c.sample_peaks();
        let peak = c.window_peak_active.load(Relaxed);
        c.start_window();
        peak
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::sim::SimBackend;
    use crate::config::{PoolConfig, SimConfig};
    use crate::pool::DevicePool;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    fn pool() -> DevicePool {
        let be = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
        DevicePool::new(be, 0, PoolConfig::default()).unwrap()
    }

    #[test]
    fn window_peak_covers_the_busy_period_only() {
        let p = pool();
        let s = p.new_stream().unwrap();
        let big = p.alloc(32 << 20, &s).unwrap();
        drop(big);
        let first = p.take_window_peak();
        assert!(first >= 32 << 20, "{first}");
        let small = p.alloc(4 << 20, &s).unwrap();
        let second = p.take_window_peak();
        assert!((4 << 20..32 << 20).contains(&second), "{second}");
        drop(small);
        // A window with no traffic: the level at its start (nothing live).
        assert_eq!(p.take_window_peak(), 4 << 20);
        assert_eq!(p.take_window_peak(), 0);
    }

    #[test]
    fn release_cache_gives_back_freed_memory_without_host_syncs() {
        let p = pool();
        let s = p.new_stream().unwrap();
        drop(p.alloc(64 << 20, &s).unwrap());
        let reserved = p.stats().reserved_bytes.current;
        assert!(reserved >= 64 << 20);
        let syncs = p.backend().counters().host_syncs_of(0);
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut released = 0;
        while p.stats().reserved_bytes.current > 0 && Instant::now() < deadline {
            released += p.release_cache();
        }
        assert_eq!(released, reserved);
        assert_eq!(p.stats().reserved_bytes.current, 0);
        assert_eq!(p.backend().counters().host_syncs_of(0), syncs);
        p.audit().unwrap();
        // The pool grows again on demand.
        drop(p.alloc(8 << 20, &s).unwrap());
        assert!(p.stats().reserved_bytes.current >= 8 << 20);
    }
}
