//! PyTorch's expandable segments (`expandable_segments:True`), ported: the
//! `ExpandableSegment` (a virtual range reserved once, with physical pages
//! created and mapped on demand) and the allocator's functions that use it
//! (`find_expandable_block`, `map_block`, `try_allocate_expandable_block`,
//! `unmap_block`, `release_expandable_segment`).
//!
//! How PyTorch uses them: each stream and pool (small, large) gets one
//! segment whose address space covers 1 1/8 of the device's memory, so in
//! practice one per stream and pool. Pages are 2 MiB in the small pool and
//! 20 MiB in the large one. A request that no free block fits maps just
//! enough pages at the lowest address where free and unmapped space
//! together fit it: one `cuMemCreate` and one `cuMemMap` per page, then one
//! `cuMemSetAccess` over the new range (plus one per peer device). Pages
//! are unmapped (a `cuStreamSynchronize`, then `cuMemUnmap` and
//! `cuMemRelease` per page) only when every cached block is released: out
//! of memory, or `empty_cache()`. A segment with nothing mapped is then
//! given back (`cuMemAddressFree`).
//!
//! Invariants:
//! - `handles[i]` is true exactly when page `i` of the segment is created
//!   and mapped; `handles` never ends in false (trimmed).
//! - The blocks of a segment tile its whole address range: mapped blocks
//!   (free or allocated) over mapped pages, unmapped blocks over the rest;
//!   an unmapped block starts and ends on page boundaries.

use super::blocks::{Block, Id};
use super::device::SimDevice;
use super::torch::{SegmentAction, TorchAllocator};
use super::{LARGE_BUFFER, SMALL_BUFFER};

/// PyTorch's `ExpandableSegment`.
#[derive(Debug, Clone)]
pub(super) struct ExpandableSegment {
    base: u64,
    page: u64,
    max_pages: u64,
    handles: Vec<bool>,
    /// Peer devices that get access to every mapped range.
    peers: usize,
}

impl ExpandableSegment {
    /// Reserves the address space: `cuMemAddressReserve` of 1 1/8 of the
    /// device's memory, rounded up to whole pages.
    fn new(device: &mut SimDevice, page: u64, peers: usize) -> Self {
        let cap = device.capacity();
        let max_pages = (cap + cap / 8).div_ceil(page);
        let base = device.address_reserve(max_pages * page);
        ExpandableSegment {
            base,
            page,
            max_pages,
            handles: Vec::new(),
            peers,
        }
    }

    fn size(&self) -> u64 {
        self.max_pages * self.page
    }

    fn trim(&mut self) {
        while self.handles.last() == Some(&false) {
            self.handles.pop();
        }
    }

    /// `map`: creates and maps the pages covering `[ptr, ptr + size)`
    /// (`ptr` on a page boundary); returns the range mapped, of size 0 when
    /// the device ran out of memory (pages created by this call are released
    /// again).
    fn map(&mut self, device: &mut SimDevice, ptr: u64, size: u64) -> (u64, u64) {
        debug_assert_eq!((ptr - self.base) % self.page, 0);
        let begin = (ptr - self.base) / self.page;
        let end = (ptr + size - self.base).div_ceil(self.page);
        let at = self.base + begin * self.page;
        if begin == end {
            return (at, 0);
        }
        if self.handles.len() < end as usize {
            self.handles.resize(end as usize, false);
        }
        for i in begin..end {
            debug_assert!(!self.handles[i as usize]);
            if !device.mem_create(self.page) {
                for j in begin..i {
                    self.handles[j as usize] = false;
                    device.mem_release(self.page);
                }
                self.trim();
                return (at, 0);
            }
            self.handles[i as usize] = true;
        }
        for _ in begin..end {
            device.map(self.page);
        }
        let bytes = (end - begin) * self.page;
        for _ in 0..=self.peers {
            device.set_access(bytes);
        }
        (at, bytes)
    }

    /// `unmap`: unmaps the pages lying wholly inside `[ptr, ptr + size)`;
    /// returns the range unmapped (size 0: none).
    fn unmap(&mut self, device: &mut SimDevice, ptr: u64, size: u64) -> (u64, u64) {
        let begin = (ptr - self.base).div_ceil(self.page);
        let end = (ptr + size - self.base) / self.page;
        if begin >= end {
            return (ptr, 0);
        }
        // cuMemUnmap does not wait for the stream as cudaFree does: PyTorch
        // synchronizes the segment's stream first.
        device.stream_synchronize();
        for i in begin..end {
            debug_assert!(self.handles[i as usize]);
            self.handles[i as usize] = false;
            device.unmap(self.page);
            device.mem_release(self.page);
        }
        self.trim();
        (self.base + begin * self.page, (end - begin) * self.page)
    }
}

impl TorchAllocator {
    fn allocatable(&self, id: Option<Id>) -> bool {
        // As PyTorch: a block behind events is not free yet.
        id.is_some_and(|id| !self.arena[id].allocated && self.arena[id].event_count == 0)
    }

    /// `find_expandable_block`: the lowest-addressed run of free and
    /// unmapped blocks of `stream` in the pool with room for `size` bytes,
    /// starting at an unmapped block or the free block before it; a new
    /// segment when none has room.
    fn find_expandable_block(&mut self, stream: u64, small: bool, size: u64) -> Id {
        let room = |a: &TorchAllocator, mut id: Option<Id>| {
            let mut bytes = 0;
            while bytes < size && a.allocatable(id) {
                let b = &a.arena[id.expect("allocatable")];
                bytes += b.size;
                id = b.next;
            }
            bytes >= size
        };
        let unmapped: Vec<Id> = self
            .pool(small)
            .unmapped
            .range((stream, 0)..)
            .take_while(|(k, _)| k.0 == stream)
            .map(|(_, &id)| id)
            .collect();
        for mut c in unmapped {
            let prev = self.arena[c].prev;
            if self.allocatable(prev) {
                c = prev.expect("allocatable");
            }
            if room(self, Some(c)) {
                return c;
            }
        }
        let page = if small { SMALL_BUFFER } else { LARGE_BUFFER };
        let seg = ExpandableSegment::new(&mut self.device, page, self.cfg.peer_devices);
        let mut b = Block::new(seg.base, seg.size(), stream, small);
        b.mapped = false;
        b.expandable = Some(self.expandable.len());
        self.expandable.push(Some(seg));
        let id = self.arena.insert(b);
        let (pool, arena) = self.pool_arena(small);
        pool.insert_unmapped(arena, id);
        id
    }

    /// `map_block`: maps the first `size` bytes (whole pages) of the
    /// unmapped block `id`, which becomes a free mapped block merged with
    /// its free neighbours.
    fn map_block(&mut self, id: Id, size: u64) -> bool {
        let (ptr, bsize, stream, small, seg) = {
            let b = &self.arena[id];
            debug_assert!(!b.mapped && size <= b.size);
            (
                b.addr,
                b.size,
                b.stream,
                b.small,
                b.expandable.expect("expandable"),
            )
        };
        let (mptr, msize) =
            self.expandable[seg]
                .as_mut()
                .expect("live segment")
                .map(&mut self.device, ptr, size);
        if msize == 0 {
            return false;
        }
        debug_assert!(mptr == ptr && msize >= size);
        let (pool, arena) = self.pool_arena(small);
        pool.erase_unmapped(arena, id);
        self.arena[id].mapped = true;
        if msize < bsize {
            let mut rest = Block::new(ptr + msize, bsize - msize, stream, small);
            rest.mapped = false;
            rest.expandable = Some(seg);
            rest.prev = Some(id);
            rest.next = self.arena[id].next;
            let rid = self.arena.insert(rest);
            if let Some(n) = self.arena[rid].next {
                self.arena[n].prev = Some(rid);
            }
            self.arena[id].next = Some(rid);
            self.arena[id].size = msize;
            let (pool, arena) = self.pool_arena(small);
            pool.insert_unmapped(arena, rid);
        }
        let (prev, next) = (self.arena[id].prev, self.arena[id].next);
        self.try_merge_blocks(id, prev);
        self.try_merge_blocks(id, next);
        let (pool, arena) = self.pool_arena(small);
        pool.insert(arena, id);
        self.total_allocated_memory += msize;
        self.note_reserved();
        self.stats.num_device_alloc += 1;
        self.log(SegmentAction::SegmentMap, mptr, msize, stream);
        true
    }

    /// `try_allocate_expandable_block`: maps what a request of `size`
    /// bytes needs and returns the free block that holds it (out of the
    /// pool), or `None` when the device is out of memory.
    pub(super) fn try_allocate_expandable_block(
        &mut self,
        stream: u64,
        small: bool,
        size: u64,
    ) -> Option<Id> {
        let mut c = self.find_expandable_block(stream, small, size);
        if !self.arena[c].mapped {
            let want = self.arena[c].size.min(size);
            if !self.map_block(c, want) {
                return None;
            }
        }
        while self.arena[c].size < size {
            let remaining = size - self.arena[c].size;
            let next = self.arena[c].next.expect("room was found");
            let want = remaining.min(self.arena[next].size);
            if !self.map_block(next, want) {
                return None;
            }
            // `c` merged into `next`.
            c = next;
        }
        let (pool, arena) = self.pool_arena(self.arena[c].small);
        pool.erase(arena, c);
        Some(c)
    }

    /// `unmap_block`: unmaps the whole pages of the free mapped block `id`;
    /// the partial pages at either end stay mapped as free blocks.
    pub(super) fn unmap_block(&mut self, id: Id) {
        let (ptr, size, stream, small, seg) = {
            let b = &self.arena[id];
            (
                b.addr,
                b.size,
                b.stream,
                b.small,
                b.expandable.expect("expandable"),
            )
        };
        let (uptr, usize_) =
            self.expandable[seg]
                .as_mut()
                .expect("live segment")
                .unmap(&mut self.device, ptr, size);
        if usize_ == 0 {
            return;
        }
        let (pool, arena) = self.pool_arena(small);
        pool.erase(arena, id);
        let before = uptr - ptr;
        if before > 0 {
            let mut b = Block::new(ptr, before, stream, small);
            b.expandable = Some(seg);
            b.prev = self.arena[id].prev;
            b.next = Some(id);
            let bid = self.arena.insert(b);
            if let Some(p) = self.arena[bid].prev {
                self.arena[p].next = Some(bid);
            }
            self.arena[id].prev = Some(bid);
            let (pool, arena) = self.pool_arena(small);
            pool.insert(arena, bid);
        }
        let after = size - (before + usize_);
        if after > 0 {
            let mut b = Block::new(uptr + usize_, after, stream, small);
            b.expandable = Some(seg);
            b.prev = Some(id);
            b.next = self.arena[id].next;
            let aid = self.arena.insert(b);
            if let Some(n) = self.arena[aid].next {
                self.arena[n].prev = Some(aid);
            }
            self.arena[id].next = Some(aid);
            let (pool, arena) = self.pool_arena(small);
            pool.insert(arena, aid);
        }
        let b = &mut self.arena[id];
        b.addr = uptr;
        b.size = usize_;
        b.mapped = false;
        let (prev, next) = (b.prev, b.next);
        self.try_merge_blocks(id, prev);
        self.try_merge_blocks(id, next);
        let (pool, arena) = self.pool_arena(small);
        pool.insert_unmapped(arena, id);
        self.total_allocated_memory -= usize_;
        self.stats.num_device_free += 1;
        self.log(SegmentAction::SegmentUnmap, uptr, usize_, stream);
    }

    /// `release_expandable_segment`: gives back the address space of a
    /// segment with nothing mapped (its one block is `id`).
    pub(super) fn release_expandable_segment(&mut self, id: Id) {
        let (small, seg) = {
            let b = &self.arena[id];
            (b.small, b.expandable.expect("expandable"))
        };
        let s = self.expandable[seg].take().expect("live segment");
        debug_assert_eq!(self.arena[id].size, s.size());
        debug_assert!(s.handles.is_empty());
        self.device.address_free(s.base);
        let (pool, arena) = self.pool_arena(small);
        pool.erase_unmapped(arena, id);
        self.arena.remove(id);
    }
}

#[cfg(test)]
mod tests {
    use super::super::{PeerAllocator, TorchConfig};
    use super::*;

    const MIB: u64 = 1 << 20;

    fn expandable(capacity: u64) -> TorchAllocator {
        let mut a = TorchAllocator::new(TorchConfig {
            capacity_bytes: capacity,
            ..TorchConfig::with_mode(true)
        });
        a.log_segment_events(true);
        a
    }

    #[test]
    fn large_requests_map_20_mib_pages_and_reuse_them() {
        let mut a = expandable(1 << 30);
        let x = a.alloc(30 * MIB, 0).unwrap();
        assert_eq!(a.reserved_bytes(), 40 * MIB, "two 20 MiB pages");
        let c = a.driver_calls();
        assert_eq!(c["cuMemAddressReserve"], 1);
        assert_eq!(c["cuMemCreate"], 2);
        assert_eq!(c["cuMemMap"], 2);
        assert_eq!(c["cuMemSetAccess"], 1);
        // The next request continues the same segment, right after.
        let y = a.alloc(10 * MIB, 0).unwrap();
        assert_eq!(y, x + 30 * MIB);
        assert_eq!(a.reserved_bytes(), 40 * MIB);
        let z = a.alloc(5 * MIB, 0).unwrap();
        assert_eq!(z, y + 10 * MIB, "maps one more page at the end");
        assert_eq!(a.reserved_bytes(), 60 * MIB);
        assert_eq!(a.driver_calls()["cuMemMap"], 3);
        a.free(x).unwrap();
        a.free(y).unwrap();
        a.free(z).unwrap();
        let segs = a.segments();
        assert_eq!(segs.len(), 1, "one mapped range");
        assert_eq!(segs[0].total_size, 60 * MIB);
        assert_eq!(segs[0].blocks.len(), 1, "frees merged");
        // Warm: the same requests again make no driver call.
        let before = a.driver_calls();
        for s in [30 * MIB, 10 * MIB, 5 * MIB] {
            a.alloc(s, 0).unwrap();
        }
        assert_eq!(a.driver_calls(), before);
    }

    #[test]
    fn empty_cache_unmaps_free_pages_and_releases_empty_segments() {
        let mut a = expandable(1 << 30);
        let x = a.alloc(4096, 0).unwrap();
        let y = a.alloc(3 * MIB, 0).unwrap();
        assert_eq!(a.reserved_bytes(), 2 * MIB + 20 * MIB);
        a.free(y).unwrap();
        a.empty_cache();
        assert_eq!(a.reserved_bytes(), 2 * MIB, "the large page went back");
        let c = a.driver_calls();
        assert_eq!(c["cuMemUnmap"], 1);
        assert_eq!(c["cuMemRelease"], 1);
        assert_eq!(c["cuStreamSynchronize"], 1);
        assert_eq!(c["cuMemAddressFree"], 1, "the large segment is empty");
        a.free(x).unwrap();
        a.empty_cache();
        assert_eq!(a.reserved_bytes(), 0);
        assert_eq!(a.driver_calls()["cuMemAddressFree"], 2);
        let ev: Vec<_> = a.take_segment_events().iter().map(|e| e.action).collect();
        assert_eq!(
            ev,
            [
                SegmentAction::SegmentMap,
                SegmentAction::SegmentMap,
                SegmentAction::SegmentUnmap,
                SegmentAction::SegmentUnmap
            ]
        );
    }

    #[test]
    fn out_of_memory_unmaps_other_streams_pages_and_retries() {
        let mut a = expandable(60 * MIB);
        let x = a.alloc(40 * MIB, 1).unwrap();
        a.free(x).unwrap();
        // Stream 2 cannot use stream 1's cached pages without unmapping them.
        let y = a.alloc(40 * MIB, 2).unwrap();
        assert!(y != x);
        assert_eq!(a.reserved_bytes(), 40 * MIB);
        assert_eq!(a.stats().num_alloc_retries, 1);
        assert!(a.alloc(40 * MIB, 2).unwrap_err().is_oom());
    }

    #[test]
    fn partial_pages_stay_mapped_when_unmapping() {
        let mut a = expandable(1 << 30);
        let keep = a.alloc(2 * MIB, 0).unwrap();
        let x = a.alloc(50 * MIB, 0).unwrap();
        assert_eq!(a.reserved_bytes(), 60 * MIB);
        a.free(x).unwrap();
        a.empty_cache();
        // Pages 1 and 2 are wholly free; page 0 holds `keep`.
        assert_eq!(a.reserved_bytes(), 20 * MIB);
        let segs = a.segments();
        assert_eq!(segs.len(), 1);
        assert_eq!(segs[0].blocks[0].addr, keep);
        assert_eq!(segs[0].blocks[1].size, 18 * MIB, "the rest of page 0, free");
    }
}
