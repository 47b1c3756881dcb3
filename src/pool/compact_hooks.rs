//! The narrow interface between the pool and the compaction built on it
//! (`src/compact/`), in both directions, defined here so that the pool
//! never names the compaction layer.
//!
//! Downwards, the few pool internals compaction uses: movable blocks live
//! in regions that are ordinary heap allocations, taken from clean memory
//! only (any stream may use a movable block, so its memory must be ordered
//! for every stream), and freed back clean. Events come from the pool's
//! event pool; live bytes go through the pool's counters, so `stats()` and
//! `audit()` see movable memory like any other.
//!
//! Upwards, [`MovableArena`]: what the pool's own paths (statistics, audit,
//! trim, teardown, the maintenance step) ask of the movable memory. The
//! pool holds one in a [`MovableSlot`], empty until compaction installs its
//! arena on the pool's first movable allocation or pass; an empty slot
//! holds nothing, and every call on it is a no-op.

use super::heap::Tag;
use super::{DevicePool, Kind, PoolShared, Stream};
use crate::backend::Backend;
use crate::config::PoolConfig;
use crate::error::Result;
use crate::ptr::{DevicePtr, EventHandle, StreamHandle};
use std::any::Any;
use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// What one `DevicePool::compact` call (or an idle-time pass) did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CompactReport {
    /// Blocks and bytes whose moves were committed during this call (the
    /// pass it started, when it waited, and any earlier pass it found done).
    pub blocks_moved: u64,
    /// See `blocks_moved`.
    pub bytes_moved: u64,
    /// Blocks and bytes of the pass this call enqueued (0 when there was
    /// nothing to move or another pass was still in flight).
    pub blocks_planned: u64,
    /// See `blocks_planned`.
    pub bytes_planned: u64,
    /// Planned moves dropped at commit: a pin cancelled them, or the block
    /// was freed meanwhile.
    pub moves_cancelled: u64,
    /// Movable regions emptied and given back to the pool's heap.
    pub regions_released: u64,
    /// Device memory given back to the device by this call.
    pub bytes_released: u64,
    /// Whether a pass was committed during this call.
    pub committed: bool,
    /// Whether a pass is still in flight when the call returns.
    pub in_flight: bool,
    /// Wall time of the call.
    #[serde(serialize_with = "ser_duration")]
    pub duration: Duration,
}

fn ser_duration<S: serde::Serializer>(d: &Duration, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// The movable memory of one pool as the pool's own paths see it:
/// implemented by compaction's arena (`compact::Arena`).
pub(crate) trait MovableArena: Any + Send + Sync + fmt::Debug {
    /// Bytes held back now: movable frees waiting on events and
    /// destinations reserved by a pass (counted as pending in the stats).
    fn held_bytes(&self) -> u64;
    /// Checks the arena and returns (region bytes, live, held, free).
    fn audit(&self) -> std::result::Result<(u64, u64, u64, u64), String>;
    /// Synchronizes pending movable frees and any pass in flight (`trim`).
    fn trim(&self, pool: &PoolShared);
    /// Synchronizes and releases everything pending, and destroys what the
    /// arena created on the device (pool teardown).
    fn teardown(&self, pool: &PoolShared);
    /// The non-blocking step of `maintain`: harvests movable frees whose
    /// events completed and commits a pass that finished.
    fn service(&self, pool: &PoolShared) -> CompactReport;
    /// Starts one bounded pass with the pool's configured bounds, without
    /// waiting for it (the idle-time pass of `maintain`).
    fn idle_pass(&self, pool: &PoolShared) -> Result<CompactReport>;
    /// The arena itself, for the compaction module that installed it.
    fn as_any(&self) -> &dyn Any;
}

/// A pool's movable arena, once compaction installed one.
pub(crate) struct MovableSlot {
    region_bytes: u64,
    arena: OnceLock<Box<dyn MovableArena>>,
}

impl fmt::Debug for MovableSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MovableSlot")
            .field("region_bytes", &self.region_bytes)
            .field("arena", &self.arena.get())
            .finish()
    }
}

impl MovableSlot {
    /// An empty slot for an arena of `region_bytes` regions.
    pub(crate) fn new(region_bytes: u64) -> Self {
        MovableSlot {
            region_bytes,
            arena: OnceLock::new(),
        }
    }

    /// The arena, installing the one `make` builds (given the region size:
    /// the larger of the device's granularity and 2 MiB, a power of two)
    /// on the first call.
    pub(crate) fn get_or_install(
        &self,
        make: impl FnOnce(u64) -> Box<dyn MovableArena>,
    ) -> &dyn MovableArena {
        self.arena.get_or_init(|| make(self.region_bytes)).as_ref()
    }

    /// See [`MovableArena::held_bytes`]; 0 while empty.
    pub(crate) fn held_bytes(&self) -> u64 {
        self.arena.get().map_or(0, |a| a.held_bytes())
    }

    /// See [`MovableArena::audit`]; all zero while empty.
    pub(crate) fn audit(&self) -> std::result::Result<(u64, u64, u64, u64), String> {
        self.arena.get().map_or(Ok((0, 0, 0, 0)), |a| a.audit())
    }

    /// See [`MovableArena::trim`].
    pub(crate) fn trim(&self, pool: &PoolShared) {
        if let Some(a) = self.arena.get() {
            a.trim(pool);
        }
    }

    /// See [`MovableArena::teardown`].
    pub(crate) fn teardown(&self, pool: &PoolShared) {
        if let Some(a) = self.arena.get() {
            a.teardown(pool);
        }
    }

    /// See [`MovableArena::service`]; nothing done while empty.
    pub(crate) fn service(&self, pool: &PoolShared) -> CompactReport {
        self.arena
            .get()
            .map_or_else(CompactReport::default, |a| a.service(pool))
    }

    /// See [`MovableArena::idle_pass`]; nothing to move while empty.
    pub(crate) fn idle_pass(&self, pool: &PoolShared) -> Result<CompactReport> {
        self.arena
            .get()
            .map_or_else(|| Ok(CompactReport::default()), |a| a.idle_pass(pool))
    }
}

impl DevicePool {
    /// The shared state, for the compaction module.
    pub(crate) fn shared(&self) -> &Arc<PoolShared> {
        &self.shared
    }
}

impl PoolShared {
    /// The slot of the pool's movable arena.
    pub(crate) fn movable(&self) -> &MovableSlot {
        &self.movable
    }

    pub(crate) fn dev(&self) -> usize {
        self.dev
    }

    pub(crate) fn be(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    pub(crate) fn cfg(&self) -> &PoolConfig {
        &self.cfg
    }

    /// `Error::Shutdown` once the pool is shut down.
    pub(crate) fn ensure_live(&self) -> Result<()> {
        self.check_live()
    }

    /// An ordinary (never moved) allocation, for movable requests too
    /// large for the arena.
    pub(crate) fn alloc_plain(&self, size: u64, stream: &Stream) -> Result<(DevicePtr, Kind)> {
        self.alloc(size, stream, false)
    }

    /// Checks liveness, the stream's pool and the size, as `alloc` does.
    pub(crate) fn check_request(&self, size: u64, stream: &Stream) -> Result<()> {
        self.check_live()?;
        self.check_stream(stream)?;
        self.check_size(size)
    }

    /// Whether `stream` belongs to this pool.
    pub(crate) fn owns_stream(&self, stream: &Stream) -> bool {
        self.check_stream(stream).is_ok()
    }

    pub(crate) fn count_alloc(&self, requested: u64, rounded: u64) {
        self.counters.on_alloc(requested, rounded);
    }

    pub(crate) fn count_free(&self, requested: u64, rounded: u64) {
        self.counters.on_free(requested, rounded);
    }

    /// Records a pooled event on `s`.
    pub(crate) fn record_event_on(&self, s: &super::StreamCore) -> Result<EventHandle> {
        Ok(self.record_on(s)?.0)
    }

    /// Records a pooled event on the compaction stream (a handle the arena
    /// owns and destroys itself).
    pub(crate) fn record_event_on_own(&self, s: StreamHandle) -> Result<EventHandle> {
        self.record_one(s)
    }

    /// Returns an event to the pool (its capture is no longer needed).
    pub(crate) fn recycle_event(&self, e: EventHandle) {
        self.events.give_back(e);
    }

    /// Whether `e` completed, without blocking (an error counts as not yet).
    /// Never queried while a CUDA graph capture is underway (not yet, then).
    pub(crate) fn event_done(&self, e: EventHandle) -> bool {
        match self.outside_capture(|| self.backend.query_event(self.dev, e)) {
            Some(Ok(done)) => done,
            Some(Err(err)) => {
                tracing::warn!(device = self.dev, "cuEventQuery failed: {err}");
                false
            }
            None => false,
        }
    }

    /// Takes `bytes` of clean memory aligned to `bytes` from the heap, for
    /// a movable region. On shortage it harvests and reclaims once (as the
    /// small path does) and then reports the pool's OOM.
    pub(crate) fn alloc_region(&self, bytes: u64) -> Result<u64> {
        for attempt in 0..2 {
            let mut h = self.heap.lock();
            if let Some(t) = h.heap.alloc_backed(bytes, bytes, None) {
                return Ok(t.addr);
            }
            self.unpark(&mut h);
            // No stream slot: only clean memory, never aliased granules.
            match h.heap.alloc(bytes, bytes, None, false) {
                Ok(t) => {
                    debug_assert!(t.waits.is_empty() && h.heap.take_quarantine().is_empty());
                    self.counters
                        .peak_reserved
                        .fetch_max(h.heap.reserved(), std::sync::atomic::Ordering::Relaxed);
                    return Ok(t.addr);
                }
                Err(e) if !e.is_oom() => return Err(e),
                Err(_) if attempt == 0 => {
                    drop(h);
                    self.counters
                        .retries
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    self.reclaim();
                }
                Err(_) => {}
            }
        }
        Err(self.oom(bytes))
    }

    /// Gives an empty region back to the heap. Every use of its memory has
    /// completed (the arena frees ranges only after their events), so the
    /// range is clean. With `release`, its physical memory goes back to the
    /// device at the next [`PoolShared::release_cached_memory`]; without,
    /// it stays cached for the next allocations.
    pub(crate) fn free_region(&self, addr: u64, release: bool) {
        let mut h = self.heap.lock();
        let len = h
            .heap
            .free(addr, Tag::Clean)
            .expect("movable regions are allocated ranges");
        if release {
            h.freed_regions.push((addr, len));
        }
    }

    /// Releases to the device the physical memory of the regions emptied
    /// since the last call (where still idle): what compaction freed, not
    /// the rest of the pool's cache, which the next steps reuse. Returns
    /// the bytes.
    pub(crate) fn release_cached_memory(&self) -> u64 {
        let mut h = self.heap.lock();
        let regions = std::mem::take(&mut h.freed_regions);
        regions
            .into_iter()
            .map(|(a, l)| h.heap.release_range(a, a + l))
            .sum()
    }

    /// Device memory held now.
    pub(crate) fn reserved_now(&self) -> u64 {
        self.heap.lock_quiet().heap.reserved()
    }
}
