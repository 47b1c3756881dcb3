//! Looking inside a pool: the audit that recounts every structure, and
//! snapshots in PyTorch's layout.

use super::heap::{Piece, Tag};
use super::pending::Pending;
use super::small::Slab;
use super::snapshot::{BlockInfo, BlockState, HistoryEvent, SegmentInfo, Snapshot};
use super::stream::STREAM_SLOTS;
use super::{PoolShared, PoolStats};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering::Relaxed;

/// Where every free slot is, found by detaching and re-pushing each stack
/// and the pending list (exact only while no other thread uses the pool).
pub(crate) struct SlotCensus {
    /// Slots on clean or dirty stacks.
    pub free: HashSet<u32>,
    /// Slots on the pending list.
    pub pending: HashSet<u32>,
    /// Bytes of each.
    pub free_bytes: u64,
    pub pending_bytes: u64,
    /// The first inconsistency seen (a slot in two places, a record whose
    /// byte count is wrong, a group without events).
    pub problem: Option<String>,
}

impl PoolShared {
    fn census(&self, group_events_ok: impl Fn(u32) -> bool) -> SlotCensus {
        let mut c = SlotCensus {
            free: HashSet::new(),
            pending: HashSet::new(),
            free_bytes: 0,
            pending_bytes: 0,
            problem: None,
        };
        let mut place: HashMap<u32, &'static str> = HashMap::new();
        let mut note = |c: &mut SlotCensus, idx: u32, at: &'static str| {
            if let Some(other) = place.insert(idx, at) {
                c.problem
                    .get_or_insert(format!("slot {idx} is both on {other} and on {at}"));
            }
        };
        for class in 0..self.slabs.classes.len() {
            let size = self.slabs.classes.size_of(class);
            let clean = self.slabs.take_clean(class);
            for &i in &clean {
                note(&mut c, i, "a clean stack");
                c.free.insert(i);
                c.free_bytes += size;
            }
            self.slabs.push_clean(class, &clean);
            for s in 0..STREAM_SLOTS {
                let d = self.slabs.take_dirty(class, s);
                for &i in &d {
                    note(&mut c, i, "a dirty stack");
                    c.free.insert(i);
                    c.free_bytes += size;
                }
                self.slabs.push_dirty_many(class, s, &d);
            }
        }
        let records = self.take_pending_records();
        for p in &records {
            match p {
                Pending::Slots {
                    class,
                    slots,
                    bytes,
                    ..
                } => {
                    let b = slots.len() as u64 * self.slabs.classes.size_of(*class as usize);
                    if b != *bytes {
                        c.problem
                            .get_or_insert(format!("pending record claims {bytes} B, holds {b} B"));
                    }
                    for &i in slots {
                        note(&mut c, i, "the pending list");
                        c.pending.insert(i);
                    }
                    c.pending_bytes += b;
                }
                Pending::Classes { parts, bytes, .. } => {
                    let mut b = 0;
                    for (class, slots) in parts {
                        b += slots.len() as u64 * self.slabs.classes.size_of(*class as usize);
                        for &i in slots {
                            note(&mut c, i, "the pending list");
                            c.pending.insert(i);
                        }
                    }
                    if b != *bytes {
                        c.problem
                            .get_or_insert(format!("orphan record claims {bytes} B, holds {b} B"));
                    }
                    c.pending_bytes += b;
                }
                Pending::Group { id } => {
                    if !group_events_ok(*id) {
                        c.problem
                            .get_or_insert(format!("pending group {id} has no events"));
                    }
                }
            }
        }
        for p in records {
            self.pending.push(p);
        }
        // Slots on their way back to the streams that freed them.
        for (class, idx) in self.returning.slots() {
            note(&mut c, idx, "a returning queue");
            c.pending.insert(idx);
            c.pending_bytes += self.slabs.classes.size_of(class as usize);
        }
        // Orphans handed over by magazines whose tomb is not ripe yet.
        for t in self.tombs.lock().values() {
            for (class, slots) in t.parts() {
                c.pending_bytes += slots.len() as u64 * self.slabs.classes.size_of(*class as usize);
                for &i in slots {
                    note(&mut c, i, "a tomb");
                    c.pending.insert(i);
                }
            }
        }
        for &i in place.keys() {
            if self.slabs.slab_info(self.slabs.slab_of(i)).0 == 0 {
                c.problem
                    .get_or_insert(format!("slot {i} of a retired slab is still free-listed"));
            }
        }
        c
    }

    pub(crate) fn audit(&self) -> std::result::Result<PoolStats, String> {
        // The runtime's maintenance thread waits while the audit runs.
        let _gate = self.maint_gate.lock();
        super::magazine::flush_for(self);
        // Movable regions are heap allocations; their free extents are
        // cached bytes and their held bytes are pending (see src/compact/).
        let (mv_regions, mv_live, _, mv_free) = self.movable.audit()?;
        // Mappings under way (`heap/map_job.rs`) publish within driver
        // calls' time; one still out after a second (a job abandoned by a
        // panic) fails the check below.
        let since = std::time::Instant::now();
        let h = loop {
            let h = self.heap.lock_quiet();
            if h.heap.in_flight() == 0 || since.elapsed().as_secs() >= 1 {
                break h;
            }
            drop(h);
            std::thread::yield_now();
        };
        h.heap.check()?;
        let f = h.heap.figures();
        let c = self.census(|id| h.group_events.contains_key(&id));
        if let Some(p) = c.problem {
            return Err(p);
        }
        // Live slot bytes = slab bytes - free - pending - tails.
        // Slots in other threads' magazines are free but on no stack.
        let magazines = self.counters.magazine_bytes();
        let live_slots =
            h.slab_bytes - c.free_bytes - c.pending_bytes - h.slab_tail_bytes - magazines;
        // Arenas of learned steps are heap ranges holding planned blocks.
        let plan = self.plans.stats();
        let plan_fenced = self.plans.fenced_bytes();
        let parked = self.by_stream.parked_bytes();
        let large_live = f.allocated - h.slab_bytes - parked - mv_regions - plan.arena_bytes;
        // Raw blocks are listed (typed ones are not), planned ones
        // included; the heap counts the arenas of those.
        let raw_ranges = self.by_stream.live_bytes();
        let (requested, allocated, _, _) = self.counters.totals();
        drop(h);
        if raw_ranges > large_live + plan.live_bytes {
            return Err(format!(
                "live raw large blocks span {raw_ranges} B, the heap holds {large_live} B for large blocks and the arenas {} B",
                plan.live_bytes
            ));
        }
        if allocated != large_live + live_slots + mv_live + plan.live_bytes {
            return Err(format!(
                "allocated counter {allocated} != live large ranges {large_live} + live slots {live_slots} + live movable {mv_live} + live planned {}",
                plan.live_bytes
            ));
        }
        if requested > allocated {
            return Err(format!(
                "requested {requested} exceeds allocated {allocated}"
            ));
        }
        if c.pending_bytes != self.counters.pending_slot_bytes.load(Relaxed) {
            return Err("pending slot byte counter drifted".into());
        }
        let stats = self.stats();
        let plan_free = plan.arena_bytes - plan.live_bytes - plan_fenced;
        let cached = f.free_clean
            + f.free_dirty
            + f.spare
            + c.free_bytes
            + parked
            + magazines
            + mv_free
            + plan_free;
        let sum = stats.allocated_bytes.current
            + stats.pending_bytes.current
            + cached
            + stats.overhead_bytes;
        // Paused blocks are allocated but hold no device memory.
        let held = stats.reserved_bytes.current + stats.paused_bytes;
        if sum != held || cached != stats.cached_bytes.current {
            return Err(format!(
                "reserved {} + paused {} != allocated {} + pending {} + cached {cached} + overhead {}",
                stats.reserved_bytes.current,
                stats.paused_bytes,
                stats.allocated_bytes.current,
                stats.pending_bytes.current,
                stats.overhead_bytes
            ));
        }
        Ok(stats)
    }

    pub(crate) fn snapshot(&self) -> Snapshot {
        let _gate = self.maint_gate.lock();
        super::magazine::flush_for(self);
        let stats = self.stats();
        let h = self.heap.lock_quiet();
        let census = self.census(|_| true);

        let parked: HashSet<u64> = self.by_stream.parked_addrs().into_iter().collect();
        let mut segments = Vec::new();
        for run in h.heap.layout() {
            let mut blocks: Vec<BlockInfo> = Vec::new();
            for (addr, len, piece) in run {
                match piece {
                    Piece::Allocated => {
                        let slab = self
                            .slab_at(addr)
                            .filter(|h| h.base_holding(addr) == Some(addr))
                            .map(Slab::id);
                        if let Some(id) = slab {
                            self.push_large_segment(&mut segments, std::mem::take(&mut blocks));
                            segments.push(self.slab_segment(id, &census));
                            continue;
                        }
                        let (requested, state) = if parked.contains(&addr) {
                            (0, BlockState::Inactive)
                        } else {
                            (
                                self.by_stream
                                    .get(None, addr)
                                    // Typed blocks are not listed: their range.
                                    .map_or(len, |e| e.live.requested),
                                BlockState::ActiveAllocated,
                            )
                        };
                        blocks.push(BlockInfo {
                            address: addr,
                            size: len,
                            requested_size: requested,
                            state,
                        });
                    }
                    Piece::Free(tag) => {
                        let state = if matches!(tag, Tag::Pending(_)) {
                            BlockState::ActivePendingFree
                        } else {
                            BlockState::Inactive
                        };
                        blocks.push(BlockInfo {
                            address: addr,
                            size: len,
                            requested_size: 0,
                            state,
                        });
                    }
                }
            }
            self.push_large_segment(&mut segments, blocks);
        }
        drop(h);
        Snapshot {
            device: self.dev,
            segments,
            stats,
            history: self.history(),
        }
    }

    fn push_large_segment(&self, segments: &mut Vec<SegmentInfo>, blocks: Vec<BlockInfo>) {
        let Some(first) = blocks.first() else { return };
        let live = blocks
            .iter()
            .filter(|b| b.state == BlockState::ActiveAllocated);
        segments.push(SegmentInfo {
            device: self.dev,
            address: first.address,
            total_size: blocks.iter().map(|b| b.size).sum(),
            allocated_size: live.clone().map(|b| b.size).sum(),
            requested_size: live.map(|b| b.requested_size).sum(),
            segment_type: "large",
            slot_size: 0,
            blocks,
        });
    }

    fn slab_segment(&self, id: u32, census: &SlotCensus) -> SegmentInfo {
        let (base, class, n) = self.slabs.slab_info(id);
        let size = self.slabs.classes.size_of(class);
        let first = self
            .slabs
            .slot_at(id, base)
            .expect("a slab's first slot")
            .idx;
        let mut blocks: Vec<BlockInfo> = (0..n)
            .map(|k| {
                let idx = first + k;
                let (state, requested) = if census.pending.contains(&idx) {
                    (BlockState::ActivePendingFree, 0)
                } else if census.free.contains(&idx) {
                    (BlockState::Inactive, 0)
                } else {
                    (BlockState::ActiveAllocated, self.slabs.requested(idx))
                };
                BlockInfo {
                    address: base + k as u64 * size,
                    size,
                    requested_size: requested,
                    state,
                }
            })
            .collect();
        let tail = self.slabs.tail_bytes(class);
        if tail > 0 {
            blocks.push(BlockInfo {
                address: base + n as u64 * size,
                size: tail,
                requested_size: 0,
                state: BlockState::Inactive,
            });
        }
        let live = blocks
            .iter()
            .filter(|b| b.state == BlockState::ActiveAllocated);
        SegmentInfo {
            device: self.dev,
            address: base,
            total_size: self.slabs.slab_bytes(class),
            allocated_size: live.clone().map(|b| b.size).sum(),
            requested_size: live.map(|b| b.requested_size).sum(),
            segment_type: "small",
            slot_size: size,
            blocks,
        }
    }

    /// A copy of the recorded history.
    pub(crate) fn history(&self) -> Vec<HistoryEvent> {
        self.history.lock().events.clone()
    }
}
