//! PyTorch's CUDA caching allocator (`DeviceCachingAllocator` of
//! `c10/cuda/CUDACachingAllocator.cpp`, PyTorch 2.x), ported: its placement
//! policy, its segments and its driver calls, on a simulated device.
//!
//! What is ported, function for function:
//! - `malloc`: `round_size` (512 B, `roundup_power2_divisions`), the pool
//!   (small for rounded sizes up to 1 MiB, else large), best fit
//!   (`get_free_block`: the smallest free block of the same stream, lowest
//!   address on ties; `max_split_size` keeps oversize blocks for oversize
//!   requests within `max_non_split_rounding_size`; with expandable segments
//!   the size a block could grow to counts), then on a miss: garbage
//!   collection (with a memory fraction and a threshold), a new segment
//!   (`alloc_block`: 2 MiB small, 20 MiB for 1–10 MiB, else rounded to
//!   2 MiB), and on out of memory `release_available_cached_blocks` then
//!   `release_cached_blocks`, each followed by one more try.
//! - `alloc_found_block` with `should_split`; `free_block` merging with both
//!   neighbours; `release_block`, `release_blocks`,
//!   `garbage_collect_cached_blocks`, `emptyCache`.
//! - Expandable segments ([`super::torch_expandable`]).
//!
//! - `record_stream` and its event-deferred frees
//!   ([`super::torch_events`]), where the caller supplies the streams'
//!   events (the stress peer; traces have none).
//!
//! Not modelled (no trace in `../shared/traces` exercises them):
//! CUDA-graph private pools, IPC, free-memory callbacks. Where PyTorch would
//! hand an expandable block to `release_block` (which asserts it never
//! gets one: `release_available_cached_blocks` and garbage collection with
//! expandable segments), the port skips the expandable block.
//!
//! Invariants (besides those of the private `blocks` module: block links
//! and pool membership):
//! - `total_allocated_memory` (reserved bytes) is the sum of the sizes of
//!   live `cuMemAlloc` segments plus mapped expandable pages, and equals the
//!   simulated device's used bytes.
//! - Every allocated block is in `active` under its address; no free block
//!   is.
//! - Within a segment, no two free blocks of the same mapping state are
//!   neighbours (frees merge).

use rustc_hash::FxHashMap;

use super::blocks::{Arena, Block, BlockPool, Id};
use super::device::SimDevice;
use super::torch_events::StreamEvents;
use super::torch_expandable::ExpandableSegment;
use super::{allocation_size, DriverCalls, PeerAllocator, TorchConfig, SMALL_SIZE};
use gpupool::{Error, Result};

/// What a segment event did (the `action` of PyTorch's trace entries).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SegmentAction {
    /// `segment_alloc`: a `cudaMalloc` segment.
    SegmentAlloc,
    /// `segment_free`: a `cudaFree` of a segment.
    SegmentFree,
    /// `segment_map`: pages mapped into an expandable segment.
    SegmentMap,
    /// `segment_unmap`: pages unmapped from an expandable segment.
    SegmentUnmap,
}

impl SegmentAction {
    /// PyTorch's name of the action.
    pub fn as_str(self) -> &'static str {
        match self {
            SegmentAction::SegmentAlloc => "segment_alloc",
            SegmentAction::SegmentFree => "segment_free",
            SegmentAction::SegmentMap => "segment_map",
            SegmentAction::SegmentUnmap => "segment_unmap",
        }
    }

    /// The action named `name` by PyTorch, if it is a segment action.
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "segment_alloc" => SegmentAction::SegmentAlloc,
            "segment_free" => SegmentAction::SegmentFree,
            "segment_map" => SegmentAction::SegmentMap,
            "segment_unmap" => SegmentAction::SegmentUnmap,
            _ => return None,
        })
    }

    /// Whether reserved bytes grow.
    pub fn grows(self) -> bool {
        matches!(
            self,
            SegmentAction::SegmentAlloc | SegmentAction::SegmentMap
        )
    }
}

/// A segment event as PyTorch would record it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct SegmentEvent {
    /// What happened.
    pub action: SegmentAction,
    /// Start of the range.
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// Stream of the segment.
    pub stream: u64,
}

/// One block of a [`SegmentInfo`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct BlockInfo {
    /// Address.
    pub addr: u64,
    /// Bytes (rounded).
    pub size: u64,
    /// Bytes asked for (0 for a free block).
    pub requested: u64,
    /// Allocated (else free).
    pub allocated: bool,
}

/// A segment as PyTorch's `snapshot()` reports it (for expandable segments:
/// one per contiguous mapped range).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SegmentInfo {
    /// Start address.
    pub addr: u64,
    /// Bytes.
    pub total_size: u64,
    /// Stream.
    pub stream: u64,
    /// Small pool (else large).
    pub small: bool,
    /// Part of an expandable segment.
    pub expandable: bool,
    /// Blocks in address order.
    pub blocks: Vec<BlockInfo>,
}

/// A segment that exists before the port starts (see
/// [`TorchAllocator::with_segments`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeedSegment {
    /// Start address.
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// Stream.
    pub stream: u64,
    /// Small pool (else large).
    pub small: bool,
    /// Allocated blocks: `(addr, block size, requested size)`; the ranges
    /// between them are free.
    pub live: Vec<(u64, u64, u64)>,
}

/// Counters PyTorch keeps in `DeviceStats` that a replay reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct TorchStats {
    /// Blocks handed out.
    pub num_allocs: u64,
    /// Blocks taken back.
    pub num_frees: u64,
    /// Segments allocated or ranges mapped (`num_device_alloc`).
    pub num_device_alloc: u64,
    /// Segments freed or ranges unmapped (`num_device_free`).
    pub num_device_free: u64,
    /// Allocations retried after releasing every cached block.
    pub num_alloc_retries: u64,
    /// Allocations refused.
    pub num_ooms: u64,
    /// Bytes of allocated blocks (rounded sizes).
    pub allocated_bytes: u64,
}

/// The port; see the [module docs](self).
#[derive(Debug, Clone)]
pub struct TorchAllocator {
    pub(super) cfg: TorchConfig,
    pub(super) arena: Arena,
    pub(super) small: BlockPool,
    pub(super) large: BlockPool,
    /// Allocated blocks by address (PyTorch keeps them in
    /// `ska::flat_hash_map`s; a fast hash keeps the port comparable).
    active: FxHashMap<u64, Id>,
    pub(super) device: SimDevice,
    /// Reserved bytes (PyTorch's `total_allocated_memory`).
    pub(super) total_allocated_memory: u64,
    peak_reserved: u64,
    set_fraction: bool,
    allowed_memory_maximum: u64,
    /// Expandable segments by slot (`None` once released).
    pub(super) expandable: Vec<Option<ExpandableSegment>>,
    log_segments: bool,
    segment_log: Vec<SegmentEvent>,
    pub(super) stats: TorchStats,
    /// Freed blocks waiting on events, by the stream each was recorded on
    /// (`cuda_events`), oldest first.
    pub(super) cuda_events: FxHashMap<u64, std::collections::VecDeque<(u64, Id)>>,
    /// Events no block waits on (PyTorch's `EventPool`).
    pub(super) event_pool: Vec<u64>,
}

impl TorchAllocator {
    /// An empty allocator (no segments) with the given settings, on device
    /// 0.
    pub fn new(cfg: TorchConfig) -> Self {
        Self::on_device(0, cfg)
    }

    /// An empty allocator on simulated device `index` (devices' addresses
    /// never overlap).
    pub fn on_device(index: usize, cfg: TorchConfig) -> Self {
        let set_fraction = cfg.memory_fraction.is_some();
        let allowed_memory_maximum = cfg
            .memory_fraction
            .map_or(0, |f| (f * cfg.capacity_bytes as f64) as u64);
        let mut device = SimDevice::new(index, cfg.capacity_bytes);
        device.driver_time = cfg.driver_time.clone();
        TorchAllocator {
            device,
            cfg,
            arena: Arena::default(),
            small: BlockPool::new(true),
            large: BlockPool::new(false),
            active: FxHashMap::default(),
            total_allocated_memory: 0,
            peak_reserved: 0,
            set_fraction,
            allowed_memory_maximum,
            expandable: Vec::new(),
            log_segments: false,
            segment_log: Vec::new(),
            stats: TorchStats::default(),
            cuda_events: FxHashMap::default(),
            event_pool: Vec::new(),
        }
    }

    /// An allocator that starts with `segments` already allocated (as
    /// `cudaMalloc` segments, their allocated blocks live and everything
    /// between them free), as a snapshot recorded after warm-up found
    /// PyTorch. No driver call is counted for them. Default mode only:
    /// blocks must lie inside their segment and not overlap.
    pub fn with_segments(cfg: TorchConfig, segments: &[SeedSegment]) -> Result<Self> {
        if cfg.expandable_segments {
            return Err(Error::Unsupported(
                "seeding recorded segments into expandable segments".into(),
            ));
        }
        let mut a = TorchAllocator::new(cfg);
        for seg in segments {
            a.seed_segment(seg)?;
        }
        a.peak_reserved = a.total_allocated_memory;
        Ok(a)
    }

    fn seed_segment(&mut self, seg: &SeedSegment) -> Result<()> {
        let bad = |msg: String| Error::InvalidArgument(format!("segment {:#x}: {msg}", seg.addr));
        let end = seg.addr + seg.size;
        let mut live = seg.live.clone();
        live.sort_unstable();
        let mut pieces: Vec<(u64, u64, Option<u64>)> = Vec::new();
        let mut cursor = seg.addr;
        for &(addr, size, requested) in &live {
            if addr < cursor || addr + size > end || size == 0 {
                return Err(bad(format!(
                    "block {addr:#x} of {size} B overlaps another or leaves the segment"
                )));
            }
            if addr > cursor {
                pieces.push((cursor, addr - cursor, None));
            }
            pieces.push((addr, size, Some(requested)));
            cursor = addr + size;
        }
        if cursor < end {
            pieces.push((cursor, end - cursor, None));
        }
        let mut prev: Option<Id> = None;
        for (addr, size, requested) in pieces {
            let mut b = Block::new(addr, size, seg.stream, seg.small);
            b.prev = prev;
            let id = self.arena.insert(b);
            if let Some(p) = prev {
                self.arena[p].next = Some(id);
            }
            prev = Some(id);
            match requested {
                Some(r) => {
                    let b = &mut self.arena[id];
                    b.allocated = true;
                    b.requested = r;
                    self.stats.allocated_bytes += size;
                    self.active.insert(addr, id);
                }
                None => {
                    let (pool, arena) = self.pool_arena(seg.small);
                    pool.insert(arena, id);
                }
            }
        }
        self.device.reserve_above(seg.addr, seg.size);
        self.total_allocated_memory += seg.size;
        Ok(())
    }

    /// The settings.
    pub fn config(&self) -> &TorchConfig {
        &self.cfg
    }

    /// PyTorch's counters.
    pub fn stats(&self) -> TorchStats {
        self.stats
    }

    /// Starts (or stops) keeping the segment events PyTorch would record;
    /// [`TorchAllocator::take_segment_events`] hands them over.
    pub fn log_segment_events(&mut self, on: bool) {
        self.log_segments = on;
    }

    /// The segment events since the last call, in order.
    pub fn take_segment_events(&mut self) -> Vec<SegmentEvent> {
        std::mem::take(&mut self.segment_log)
    }

    /// Queues the addresses the simulated `cudaMalloc` returns next (`(size,
    /// addr)` in order; see [`super::validate`]).
    pub fn script_segment_addresses(&mut self, script: impl IntoIterator<Item = (u64, u64)>) {
        self.device.script_addresses(script);
    }

    /// The next expandable segment reserved starts at `addr` if that range
    /// is free (see [`super::validate`]); forgotten after the next call.
    pub(super) fn hint_next_reservation(&mut self, addr: u64) {
        self.device.hint_next_reservation(addr);
    }

    pub(super) fn clear_reservation_hint(&mut self) {
        self.device.clear_reservation_hint();
    }

    /// Addresses of the allocated blocks.
    pub fn live_addresses(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.active.keys().copied().collect();
        v.sort_unstable();
        v
    }

    pub(super) fn log(&mut self, action: SegmentAction, addr: u64, size: u64, stream: u64) {
        if self.log_segments {
            self.segment_log.push(SegmentEvent {
                action,
                addr,
                size,
                stream,
            });
        }
    }

    pub(super) fn pool_arena(&mut self, small: bool) -> (&mut BlockPool, &mut Arena) {
        if small {
            (&mut self.small, &mut self.arena)
        } else {
            (&mut self.large, &mut self.arena)
        }
    }

    pub(super) fn pool(&self, small: bool) -> &BlockPool {
        if small {
            &self.small
        } else {
            &self.large
        }
    }

    pub(super) fn note_reserved(&mut self) {
        self.peak_reserved = self.peak_reserved.max(self.total_allocated_memory);
    }

    fn gc_enabled(&self) -> bool {
        self.set_fraction && self.cfg.garbage_collection_threshold > 0.0
    }

    /// `malloc`: a block of at least `orig` bytes on `stream`.
    pub fn malloc(&mut self, orig: u64, stream: u64) -> Result<u64> {
        self.malloc_inner(orig, stream, None)
    }

    /// `malloc` in a run with `record_stream`: first `process_events`, and
    /// `synchronize_and_free_events` before the cache is released on the
    /// way to out of memory.
    pub fn malloc_with_events(
        &mut self,
        orig: u64,
        stream: u64,
        events: &dyn StreamEvents,
    ) -> Result<u64> {
        self.process_events(events)?;
        self.malloc_inner(orig, stream, Some(events))
    }

    fn malloc_inner(
        &mut self,
        orig: u64,
        stream: u64,
        events: Option<&dyn StreamEvents>,
    ) -> Result<u64> {
        if orig == 0 {
            return Err(Error::InvalidSize {
                size: 0,
                why: "PyTorch's allocator hands out nothing for 0 bytes",
            });
        }
        let size = self.cfg.round_size(orig);
        let small = size <= SMALL_SIZE;
        let alloc_size = allocation_size(size);
        let mut block = self.get_free_block(small, stream, size);
        if block.is_none() {
            if self.gc_enabled() {
                self.garbage_collect_cached_blocks();
            }
            block = self.alloc_block(small, stream, size, alloc_size, false);
            if block.is_none() && self.release_available_cached_blocks(small, stream, size) {
                block = self.alloc_block(small, stream, size, alloc_size, false);
            }
            if block.is_none() {
                if let Some(ev) = events {
                    self.synchronize_and_free_events(ev)?;
                }
            }
            if block.is_none() && self.release_cached_blocks() {
                block = self.alloc_block(small, stream, size, alloc_size, true);
            }
        }
        let Some(id) = block else {
            self.stats.num_ooms += 1;
            let capacity = if self.set_fraction {
                self.allowed_memory_maximum
            } else {
                self.device.capacity()
            };
            return Err(Error::DeviceOutOfMemory {
                device: 0,
                requested: alloc_size,
                used: self.device.used(),
                capacity,
            });
        };
        let split = self
            .cfg
            .should_split(self.arena[id].small, self.arena[id].size, size);
        Ok(self.alloc_found_block(id, size, orig, stream, split))
    }

    /// `get_free_block`: best fit among the pool's free blocks of `stream`;
    /// the block leaves the pool.
    fn get_free_block(&mut self, small: bool, stream: u64, size: u64) -> Option<Id> {
        let gc = self.gc_enabled();
        let expandable_on = self.cfg.expandable_segments;
        let (max_split, max_round) = (
            self.cfg.max_split_size,
            self.cfg.max_non_split_rounding_size,
        );
        let arena = &self.arena;
        let pool = if small {
            &mut self.small
        } else {
            &mut self.large
        };
        if gc {
            pool.get_free_blocks_call_count += 1;
        }
        let mut it = pool
            .blocks
            .range((stream, size, 0)..)
            .take_while(|(k, _)| k.0 == stream)
            .map(|(_, &id)| id)
            .peekable();
        let mut found = it.next()?;
        if arena[found].expandable.is_some() {
            if expandable_on {
                // Best fit by the size a block could grow to: a block
                // followed by unmapped space may serve more than it holds.
                let grow = |id: Id| {
                    let b = &arena[id];
                    b.size
                        + b.next
                            .filter(|&n| !arena[n].mapped)
                            .map_or(0, |n| arena[n].size)
                };
                while arena[found].expandable.is_some() {
                    match it.peek() {
                        Some(&next) if grow(next) < grow(found) => {
                            found = next;
                            it.next();
                        }
                        _ => break,
                    }
                }
            } else {
                // Expandable segments were turned off: skip their blocks.
                found = it.find(|&id| arena[id].expandable.is_none())?;
            }
        }
        let bsize = arena[found].size;
        if size < max_split && bsize >= max_split {
            return None;
        }
        if size >= max_split && bsize >= size + max_round {
            return None;
        }
        pool.erase(arena, found);
        Some(found)
    }

    /// `alloc_block`: a new segment (or newly mapped pages) for the request.
    fn alloc_block(
        &mut self,
        small: bool,
        stream: u64,
        size: u64,
        alloc_size: u64,
        is_retry: bool,
    ) -> Option<Id> {
        if is_retry {
            self.stats.num_alloc_retries += 1;
        }
        if self.set_fraction
            && self.total_allocated_memory + alloc_size > self.allowed_memory_maximum
        {
            return None;
        }
        if self.cfg.expandable_segments {
            return self.try_allocate_expandable_block(stream, small, size);
        }
        let addr = self.device.mem_alloc(alloc_size)?;
        self.total_allocated_memory += alloc_size;
        self.note_reserved();
        self.stats.num_device_alloc += 1;
        self.log(SegmentAction::SegmentAlloc, addr, alloc_size, stream);
        Some(
            self.arena
                .insert(Block::new(addr, alloc_size, stream, small)),
        )
    }

    /// `alloc_found_block`: hands out the front of block `id` (splitting
    /// the rest off when `split`).
    fn alloc_found_block(&mut self, id: Id, size: u64, orig: u64, stream: u64, split: bool) -> u64 {
        let mut block = id;
        if split {
            let (addr, small, expandable, prev) = {
                let r = &self.arena[id];
                (r.addr, r.small, r.expandable, r.prev)
            };
            let mut b = Block::new(addr, size, stream, small);
            b.expandable = expandable;
            b.prev = prev;
            b.next = Some(id);
            let nid = self.arena.insert(b);
            if let Some(p) = prev {
                self.arena[p].next = Some(nid);
            }
            let rest = &mut self.arena[id];
            rest.prev = Some(nid);
            rest.addr += size;
            rest.size -= size;
            let (pool, arena) = self.pool_arena(small);
            pool.insert(arena, id);
            block = nid;
        }
        let b = &mut self.arena[block];
        b.allocated = true;
        b.requested = orig;
        let (addr, bsize) = (b.addr, b.size);
        self.active.insert(addr, block);
        self.stats.num_allocs += 1;
        self.stats.allocated_bytes += bsize;
        addr
    }

    /// `free`: the block at `addr` goes back to its pool, merged with free
    /// neighbours.
    pub fn free(&mut self, addr: u64) -> Result<()> {
        self.free_inner(addr, None)
    }

    /// `free` of a block that may have been used on other streams: it
    /// rejoins its pool once an event recorded on each of them completes.
    pub fn free_with_events(&mut self, addr: u64, events: &dyn StreamEvents) -> Result<()> {
        self.free_inner(addr, Some(events))
    }

    fn free_inner(&mut self, addr: u64, events: Option<&dyn StreamEvents>) -> Result<()> {
        let id = self.active_id(addr).ok_or(Error::UnknownPointer {
            ptr: addr,
            device: 0,
        })?;
        let deferred = !self.arena[id].stream_uses.is_empty();
        if deferred && events.is_none() {
            return Err(Error::InvalidArgument(
                "a block used on other streams is freed behind events: use free_with_events".into(),
            ));
        }
        self.active.remove(&addr);
        let b = &mut self.arena[id];
        b.allocated = false;
        b.requested = 0;
        self.stats.num_frees += 1;
        self.stats.allocated_bytes -= b.size;
        match events {
            Some(ev) if deferred => self.insert_events(id, ev),
            _ => {
                self.free_block(id);
                Ok(())
            }
        }
    }

    /// The block allocated at `addr`, if any.
    pub(super) fn active_id(&self, addr: u64) -> Option<Id> {
        self.active.get(&addr).copied()
    }

    /// `free_block`.
    pub(super) fn free_block(&mut self, id: Id) {
        let (prev, next) = (self.arena[id].prev, self.arena[id].next);
        self.try_merge_blocks(id, prev);
        self.try_merge_blocks(id, next);
        let small = self.arena[id].small;
        let (pool, arena) = self.pool_arena(small);
        pool.insert(arena, id);
    }

    /// `try_merge_blocks`: `src`, a free neighbour of `dst` in the same
    /// mapping state, joins `dst`. Returns the bytes taken over (0: none).
    /// `dst` must be in no pool set.
    pub(super) fn try_merge_blocks(&mut self, dst: Id, src: Option<Id>) -> u64 {
        let Some(src) = src else { return 0 };
        let (s_alloc, s_mapped, s_small) = {
            let s = &self.arena[src];
            // A block behind events is in no pool yet (PyTorch checks
            // `event_count` and `stream_uses` here too).
            (s.allocated || s.event_count > 0, s.mapped, s.small)
        };
        if s_alloc || s_mapped != self.arena[dst].mapped {
            return 0;
        }
        let (pool, arena) = self.pool_arena(s_small);
        if s_mapped {
            pool.erase(arena, src);
        } else {
            pool.erase_unmapped(arena, src);
        }
        let s = self.arena.remove(src);
        if self.arena[dst].prev == Some(src) {
            self.arena[dst].addr = s.addr;
            self.arena[dst].prev = s.prev;
            if let Some(p) = s.prev {
                self.arena[p].next = Some(dst);
            }
        } else {
            self.arena[dst].next = s.next;
            if let Some(n) = s.next {
                self.arena[n].prev = Some(dst);
            }
        }
        self.arena[dst].size += s.size;
        s.size
    }

    /// `release_block`: `cudaFree` of a whole free `cudaMalloc` segment.
    fn release_block(&mut self, id: Id) {
        let (addr, size, stream, small) = {
            let b = &self.arena[id];
            debug_assert!(b.expandable.is_none() && !b.is_split() && !b.allocated);
            (b.addr, b.size, b.stream, b.small)
        };
        self.stats.num_device_free += 1;
        self.log(SegmentAction::SegmentFree, addr, size, stream);
        self.device.mem_free(addr);
        self.total_allocated_memory -= size;
        let (pool, arena) = self.pool_arena(small);
        pool.erase(arena, id);
        self.arena.remove(id);
    }

    /// `release_available_cached_blocks`: with a `max_split_size`, frees
    /// oversize cached segments of `stream` (one large enough, else the
    /// largest ones down until enough), so that a retry may succeed.
    fn release_available_cached_blocks(&mut self, small: bool, stream: u64, size: u64) -> bool {
        let max_split = self.cfg.max_split_size;
        if max_split == u64::MAX || self.cfg.expandable_segments {
            return false;
        }
        let key = size.max(max_split);
        let one = self
            .pool(small)
            .blocks
            .range((stream, key, 0)..)
            .next()
            .filter(|(k, _)| k.0 == stream)
            .map(|(_, &id)| id);
        if let Some(id) = one {
            self.release_block(id);
            return true;
        }
        let mut released = 0;
        let mut cursor = (stream, key, 0);
        while released < key {
            let Some((&k, &id)) = self.pool(small).blocks.range(..cursor).next_back() else {
                break;
            };
            if k.0 != stream || k.1 < max_split {
                break;
            }
            released += k.1;
            cursor = k;
            self.release_block(id);
        }
        released >= key
    }

    /// `release_cached_blocks` (also `emptyCache`): frees every cached
    /// segment that is wholly free, and unmaps every free page of expandable
    /// segments (releasing the segments left empty).
    pub fn release_cached_blocks(&mut self) -> bool {
        self.release_blocks(false);
        self.release_blocks(true);
        true
    }

    /// `torch.cuda.empty_cache()`.
    pub fn empty_cache(&mut self) {
        self.release_cached_blocks();
    }

    fn release_blocks(&mut self, small: bool) {
        let ids: Vec<Id> = self.pool(small).blocks.values().copied().collect();
        let mut to_unmap = Vec::new();
        for id in ids {
            let b = &self.arena[id];
            if b.expandable.is_some() {
                to_unmap.push(id);
            } else if !b.is_split() {
                self.release_block(id);
            }
        }
        for id in to_unmap {
            debug_assert!(self.arena.contains(id));
            self.unmap_block(id);
            let b = &self.arena[id];
            if !b.mapped && !b.is_split() {
                self.release_expandable_segment(id);
            }
        }
    }

    /// `garbage_collect_cached_blocks`: above the threshold share of the
    /// allowed memory, frees wholly free large segments that have waited
    /// longer than average (in best-fit searches) until enough is freed.
    fn garbage_collect_cached_blocks(&mut self) {
        let threshold =
            (self.cfg.garbage_collection_threshold * self.allowed_memory_maximum as f64) as u64;
        if self.total_allocated_memory <= threshold {
            return;
        }
        let target = self.total_allocated_memory - threshold;
        let now = self.large.get_free_blocks_call_count;
        let freeable = |b: &Block| !b.is_split() && b.expandable.is_none();
        let (mut total_age, mut count) = (0u64, 0u64);
        for &id in self.large.blocks.values() {
            let b = &self.arena[id];
            if freeable(b) {
                total_age += now - b.gc_count_base;
                count += 1;
            }
        }
        let (mut reclaimed, mut freed) = (0u64, true);
        while reclaimed < target && freed && count > 0 {
            let age_threshold = total_age as f64 / count as f64;
            freed = false;
            let ids: Vec<Id> = self.large.blocks.values().copied().collect();
            for id in ids {
                let b = &self.arena[id];
                let age = now - b.gc_count_base;
                if freeable(b) && age as f64 >= age_threshold {
                    freed = true;
                    reclaimed += b.size;
                    total_age -= age;
                    count -= 1;
                    self.release_block(id);
                }
            }
        }
    }

    /// The segments as PyTorch's `snapshot()` lists them, by address.
    pub fn segments(&self) -> Vec<SegmentInfo> {
        let mut out = Vec::new();
        for (_, head) in self.arena.iter() {
            if !head.mapped || head.prev.is_some_and(|p| self.arena[p].mapped) {
                continue;
            }
            let mut seg = SegmentInfo {
                addr: head.addr,
                total_size: 0,
                stream: head.stream,
                small: head.small,
                expandable: head.expandable.is_some(),
                blocks: Vec::new(),
            };
            let mut cur = Some(head);
            while let Some(b) = cur.filter(|b| b.mapped) {
                seg.total_size += b.size;
                seg.blocks.push(BlockInfo {
                    addr: b.addr,
                    size: b.size,
                    requested: b.requested,
                    allocated: b.allocated,
                });
                cur = b.next.map(|n| &self.arena[n]);
            }
            out.push(seg);
        }
        out.sort_by_key(|s| s.addr);
        out
    }
}

impl PeerAllocator for TorchAllocator {
    fn name(&self) -> &'static str {
        if self.cfg.expandable_segments {
            "torch_expandable"
        } else {
            "torch"
        }
    }

    fn alloc(&mut self, size: u64, stream: u64) -> Result<u64> {
        self.malloc(size, stream)
    }

    fn free(&mut self, addr: u64) -> Result<()> {
        TorchAllocator::free(self, addr)
    }

    fn reserved_bytes(&self) -> u64 {
        self.total_allocated_memory
    }

    fn peak_reserved_bytes(&self) -> u64 {
        self.peak_reserved
    }

    fn reset_peak(&mut self) {
        self.peak_reserved = self.total_allocated_memory;
    }

    fn driver_calls(&self) -> DriverCalls {
        self.device.counter.calls.clone()
    }

    fn driver_bytes(&self) -> DriverCalls {
        self.device.counter.bytes.clone()
    }
}

#[cfg(test)]
mod tests;
