//! The few pool internals compaction (`src/compact/`) builds on.
//!
//! Movable blocks live in regions that are ordinary heap allocations, taken
//! from clean memory only (any stream may use a movable block, so its
//! memory must be ordered for every stream), and freed back clean. Events
//! come from the pool's event pool; live bytes go through the pool's
//! counters, so `stats()` and `audit()` see movable memory like any other.

use super::heap::Tag;
use super::{DevicePool, Kind, PoolShared, Stream};
use crate::backend::Backend;
use crate::config::PoolConfig;
use crate::error::Result;
use crate::ptr::{DevicePtr, EventHandle, StreamHandle};
use std::sync::Arc;

impl DevicePool {
    /// The shared state, for the compaction module.
    pub(crate) fn shared(&self) -> &Arc<PoolShared> {
        &self.shared
    }
}

impl PoolShared {
    pub(crate) fn arena(&self) -> &crate::compact::Arena {
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
        self.record_on(s)
    }

    /// Records a pooled event on the compaction stream (a handle the arena
    /// owns and destroys itself).
    pub(crate) fn record_event_on_own(&self, s: StreamHandle) -> Result<EventHandle> {
        self.record_one(s)
    }

    /// Returns an event to the pool (its capture is no longer needed).
    pub(crate) fn recycle_event(&self, e: EventHandle) {
        self.event_pool.lock().push(e);
    }

    /// Whether `e` completed, without blocking (an error counts as not yet).
    pub(crate) fn event_done(&self, e: EventHandle) -> bool {
        match self.backend.query_event(self.dev, e) {
            Ok(done) => done,
            Err(err) => {
                tracing::warn!(device = self.dev, "cuEventQuery failed: {err}");
                false
            }
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
            Self::unpark(&mut h);
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
    /// range is clean.
    pub(crate) fn free_region(&self, addr: u64) {
        let mut h = self.heap.lock();
        let len = h
            .heap
            .free(addr, Tag::Clean)
            .expect("movable regions are allocated ranges");
        h.freed_regions.push((addr, len));
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
