//! Giving cached memory back without blocking the host: the primitives of
//! the runtime's idle release policy (see `Runtime` and
//! `PoolConfig::idle_release`).
//!
//! [`DevicePool::trim`] gives back everything but waits for pending frees
//! on the host. [`DevicePool::release_cache`] is its non-blocking sibling for
//! a background thread: what is still in flight on the device stays cached
//! and goes on a later call.

use super::DevicePool;

impl DevicePool {
    /// Gives idle cached memory back to the device without blocking the
    /// host: moves every stream's freed memory onto the pending list (one
    /// event per stream), harvests what completed, retires empty slabs and
    /// releases the physical memory no block uses. Memory whose last use
    /// is still running stays cached; a later call releases it. Slots
    /// cached in other threads' per-thread caches stay too. Returns the
    /// bytes given back.
    pub fn release_cache(&self) -> u64 {
        self.release_cache_while(|| true, 0).unwrap_or(0)
    }

    /// [`DevicePool::release_cache`], keeping `keep` bytes cached: gives
    /// back whole granules (or segments), spare chunks first and then idle
    /// memory from the top of the reservation down, while the cached bytes
    /// stay at or above `keep` (`PoolStats::cached_bytes`). What a busy
    /// period about to come back needs stays mapped. Returns the bytes
    /// given back.
    pub fn release_cache_above(&self, keep: u64) -> u64 {
        self.release_cache_while(|| true, keep).unwrap_or(0)
    }

    /// [`DevicePool::release_cache_above`] unless the pool saw an
    /// allocation or a free after its last `maintain` call measured it
    /// idle: `None` then, and nothing is given back. The idle release
    /// policy decides on that measure; without the check, a busy period
    /// starting in between would lose the memory it had just asked for.
    pub(crate) fn release_cache_above_if_quiet(&self, keep: u64) -> Option<u64> {
        let seen = self.shared.idle.lock().ops;
        self.release_cache_while(|| self.shared.counters.traffic() == seen, keep)
    }

    /// The release, given up (`None`) where `go` fails before it starts or
    /// under the heap lock just before the bytes go back, so memory cached
    /// by traffic after that check stays cached.
    fn release_cache_while(&self, go: impl Fn() -> bool, keep: u64) -> Option<u64> {
        let sh = &self.shared;
        if sh.check_live().is_err() || sh.capture.underway() {
            return Some(0);
        }
        if !go() {
            return None;
        }
        super::magazine::flush_for(sh);
        sh.flush_all_streams();
        sh.harvest();
        sh.retire_empty_slabs();
        // Nothing kept: everything releasable, however the cached count
        // (which also holds free slab slots no release gives) compares.
        let limit = match keep {
            0 => u64::MAX,
            _ => self.stats().cached_bytes.current.saturating_sub(keep),
        };
        let mut heap = sh.heap.lock();
        go().then(|| heap.heap.release_cached_up_to(limit))
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
        self.shared.counters.take_window()
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::sim::SimBackend;
    use crate::backend::Call;
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

    /// A release that keeps `keep` bytes cached gives back whole granules
    /// from the top of the cache down to it, and the next request of the
    /// kept size needs no device memory.
    #[test]
    fn release_cache_above_keeps_what_it_is_asked_to() {
        let p = pool();
        let s = p.new_stream().unwrap();
        let gran = p.info().granularity;
        drop(p.alloc(64 << 20, &s).unwrap());
        p.settle().unwrap();
        assert_eq!(p.stats().cached_bytes.current, 64 << 20);
        let keep = 10 * gran + gran / 2;
        assert_eq!(p.release_cache_above(keep), (64 << 20) - 11 * gran);
        assert_eq!(p.stats().cached_bytes.current, 11 * gran);
        assert_eq!(p.release_cache_above(keep), 0, "nothing above keep");
        let creates = p.backend().counters().get(Call::MemCreate);
        drop(p.alloc((10 * gran) as usize, &s).unwrap());
        assert_eq!(p.backend().counters().get(Call::MemCreate), creates);
        p.settle().unwrap();
        p.audit().unwrap();
        assert_eq!(p.release_cache(), 11 * gran);
        assert_eq!(p.stats().reserved_bytes.current, 0);
    }

    /// The idle release policy's release holds back when traffic came
    /// after `maintain` measured the pool idle, and goes ahead once a
    /// later measure saw that traffic.
    #[test]
    fn a_quiet_release_gives_nothing_back_after_traffic_since_the_idle_measure() {
        let p = pool();
        let s = p.new_stream().unwrap();
        drop(p.alloc(32 << 20, &s).unwrap());
        p.settle().unwrap();
        p.maintain();
        drop(p.alloc(16 << 20, &s).unwrap());
        let reserved = p.stats().reserved_bytes.current;
        assert_eq!(p.release_cache_above_if_quiet(0), None);
        assert_eq!(p.stats().reserved_bytes.current, reserved);
        p.settle().unwrap();
        p.maintain();
        assert_eq!(p.release_cache_above_if_quiet(0), Some(reserved));
        assert_eq!(p.stats().reserved_bytes.current, 0);
    }
}
