//! The large path: best fit over one virtual-address space per device, with
//! physical memory mapped granule by granule (or plain segments where the
//! device has no virtual memory management).
//!
//! Every address of the reservation is in exactly one range: allocated (a
//! large block or a slab) or free. Free ranges carry a [`Tag`] saying who may
//! reuse them without further ordering:
//!
//! * `Clean`: every earlier use has completed; any stream may take it.
//! * `Dirty(s)`: freed on stream slot `s` with no other users; stream `s` may
//!   take it at once (its later work is ordered after the free), others not.
//! * `Pending(id)`: waits on the events of pending group `id`; it becomes
//!   `Clean` when they complete, or is handed to a stream that waits on them.
//!
//! Adjacent free ranges with equal tags are always merged. Physical memory:
//! a granule is mapped while any allocated range overlaps it (`users > 0`);
//! when its users drop to zero it stays mapped ("idle") until its chunk is
//! needed elsewhere or trimmed. Only idle granules lying wholly inside one
//! `Clean` range are ever unmapped, so no pending work can touch an unmapped
//! address. A chunk taken from an idle granule is remapped under any new
//! range (stitching): a large request is served whenever enough physical
//! memory is held, whatever the layout.
//!
//! This file holds the heap's state and its allocate/free/owner interface;
//! the concepts it builds on have a file each: `free_ranges` (the free-range
//! index and the placement policy), `physical` (which chunk backs each
//! granule), `stitch` (backing a range from idle memory elsewhere, and the
//! quarantine of stolen chunks' old mappings), `map_job` (the mapping a
//! backed range needs, made with the heap lock released) and `audit`
//! (figures, snapshots and the consistency check).

use super::addr_index::{AddrIndex, Span};
use super::granule_set::GranuleSet;
use super::size_class::ALIGN;
use super::size_index::SizeIndex;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::ptr::{ChunkHandle, DevicePtr};
use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::BTreeMap;
use std::sync::Arc;

mod audit;
mod free_ranges;
mod ipc;
mod map_job;
mod pause;
mod physical;
mod stitch;
mod stitch_share;
#[cfg(test)]
mod tests;

pub(crate) use audit::Piece;
pub(crate) use map_job::{MapDone, MapJob};
use physical::{granule_span, shared_granules};
pub(crate) use stitch::GranuleRuns;
use stitch::{push_run, StealCtx};
pub(crate) use stitch_share::StitchShare;

/// Who may reuse a free range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Tag {
    /// Any stream.
    Clean,
    /// Stream slot `s` only, until flushed.
    Dirty(u16),
    /// Waits on pending group `id`.
    Pending(u32),
}

/// A free range's length and tag.
type FreeRange = Span<Tag>;

/// The free ranges covering one granule `(addr, len, tag)`: usually one to
/// three, kept on the stack (stitching asks for the cover of every idle
/// granule it considers).
type Cover = smallvec::SmallVec<[(u64, u64, Tag); 4]>;

#[derive(Debug, Clone, Copy, Default)]
struct Granule {
    chunk: Option<ChunkHandle>,
    /// For a quarantined granule: the chunk its old mapping still maps
    /// (stolen by aliasing; the chunk now also backs a new address).
    alias: Option<ChunkHandle>,
    /// Allocated ranges overlapping part of this granule. A granule that
    /// one allocated range covers whole has no other user and counts 0
    /// here: taking or freeing a range of many granules updates the idle
    /// set of its whole granules a word at a time, not granule by granule.
    users: u32,
}

// One per heap, never moved on a hot path: boxing the large variant would
// only add an indirection to every granule lookup.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum Physical {
    /// One reservation; chunks mapped per granule.
    Vmm {
        base: u64,
        len: u64,
        granules: Vec<Granule>,
        /// Chunks held but unmapped.
        spare: Vec<ChunkHandle>,
        /// Mapped granules with no users.
        idle: GranuleSet,
        /// Granules whose chunk was stolen while old uses may still run:
        /// still mapped at the backend, excluded from every range.
        quarantine: GranuleSet,
        /// Mapped granules (chunk present), for counting any span's with
        /// popcounts.
        mapped: GranuleSet,
    },
    /// Plain segments (`cuMemAlloc`), base -> len; ranges never cross them.
    Segments { segs: BTreeMap<u64, u64> },
}

/// Figures the audit and the stats read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct HeapFigures {
    /// Physical bytes held.
    pub reserved: u64,
    /// Bytes of allocated ranges (large blocks and slabs).
    pub allocated: u64,
    /// Free bytes in mapped memory by tag kind.
    pub free_clean: u64,
    pub free_dirty: u64,
    pub free_pending: u64,
    /// Bytes of chunks held unmapped.
    pub spare: u64,
    /// Bytes of chunks given back but still mapped at quarantined
    /// addresses (held until their old uses complete).
    pub deferred: u64,
    /// Bytes of paused allocated ranges (in `allocated`, not backed).
    pub paused: u64,
}

/// The per-device large-path heap. Not thread safe by itself: the pool holds
/// it under one mutex (per device, never shared across devices).
#[derive(Debug)]
pub(crate) struct Heap {
    dev: usize,
    backend: Arc<dyn Backend>,
    gran: u64,
    phys: Physical,
    by_addr: AddrIndex<Tag>,
    by_tag: FxHashMap<Tag, SizeIndex>,
    /// Set while a CUDA graph capture is underway on the device (see
    /// `pool/capture.rs`): no unmap, no release of physical memory
    /// (stitching steals nothing; idle release, trimming, quarantine and
    /// pausing wait). Read and written under the heap lock.
    pub(crate) capture_hold: bool,
    /// No request is shorter: the `Clean` and `Dirty` size indexes count
    /// free ranges under it without storing them (see `size_index.rs`).
    /// `Pending` ones store every range (harvesting walks them).
    request_floor: u64,
    /// Allocated ranges: addr -> len.
    allocated: FxHashMap<u64, u64>,
    reserved: u64,
    allocated_bytes: u64,
    next_pending: u32,
    /// Per stream slot, a count raised whenever free memory joins
    /// `Dirty(slot)` (`insert_free`): unchanged between two reads, no
    /// range joined in between (see [`Heap::clean_dirty_if`]).
    dirty_gen: Vec<u64>,
    /// Granules quarantined since the last `take_quarantine`, as runs.
    fresh_quarantine: GranuleRuns,
    /// Quarantined old mappings per chunk. The driver frees a chunk's
    /// memory only once it is released *and* unmapped everywhere, so a
    /// chunk the heap gives back while an old mapping of it is quarantined
    /// is still device memory held: it waits in `deferred`, counted in
    /// `reserved`, until its last quarantined mapping goes.
    aliases: FxHashMap<ChunkHandle, u32>,
    deferred: FxHashSet<ChunkHandle>,
    /// Pending groups whose memory was aliased since the last
    /// `take_steal_waits`: the requesting stream must wait on them.
    fresh_waits: Vec<u32>,
    /// Mappings planned and not yet published (`map_job.rs`).
    in_flight: u32,
    /// Pending groups completed while a mapping was out (cleared when none
    /// is): a piece it cut out of one returns clean.
    completed_during_jobs: Vec<u32>,
    /// Pending groups that cannot be waited on (an event record failed):
    /// never handed over nor stitched, whatever `pending_ok` says.
    blocked: FxHashSet<u32>,
    /// Device allocations made (chunks or segments).
    pub device_allocs: u64,
    /// Device frees made.
    pub device_frees: u64,
    /// Peer devices granted access to every mapped chunk (see `peer.rs`).
    peers: Vec<usize>,
    /// The most device memory the heap may hold (`max_bytes`, `fraction`,
    /// `set_memory_limit`; see `limits.rs`): consulted before every chunk
    /// or segment is created.
    pub(crate) limit: super::limits::Limit,
    /// Paused allocated ranges, addr -> len, and their bytes (`pause.rs`).
    paused: FxHashMap<u64, u64>,
    paused_bytes: u64,
    /// Granules stitching may steal, in units of the heap's reserved
    /// granules, before the next request that would steal grows the
    /// device memory instead (`stitch_budget`; 0: always steal).
    pub(crate) stitch_budget: f64,
    /// Granules stolen since the heap last grew in place of a steal.
    stolen_since_growth: u64,
    /// The device refused the chunks a growth planned: the next plan
    /// steals instead (see `plan_back`).
    growth_refused: bool,
    /// The share of wall time stealing may take (`stitch_share`).
    pub(crate) stitch_share: StitchShare,
}

fn align_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

/// A range the heap handed out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Taken {
    pub addr: u64,
    /// The tag the range had.
    pub from: Tag,
    /// Pending groups whose events the caller's stream must wait on before
    /// using the range (its own tag, or stolen granules).
    pub waits: Vec<u32>,
    /// Whether the range is safe for the requesting stream only (it was
    /// dirty on it, or aliases memory its old work may still touch).
    pub exclusive: bool,
}

/// Whether stream slot `slot` may take free memory tagged `t` with no
/// wait on the host (`group` says which pending groups its stream is
/// ordered after).
fn usable_tag(t: Tag, slot: u16, group: &impl Fn(u32) -> bool) -> bool {
    match t {
        Tag::Clean => true,
        Tag::Dirty(s) => s == slot,
        Tag::Pending(id) => group(id),
    }
}

impl Heap {
    /// A heap over a fresh reservation of `va_bytes` (VMM) or over segments,
    /// for requests of at least `request_floor` bytes (0: any).
    pub(crate) fn new(
        backend: Arc<dyn Backend>,
        dev: usize,
        va_bytes: u64,
        request_floor: u64,
    ) -> Result<Heap> {
        let info = backend.device_info(dev)?;
        let gran = info.granularity;
        let mut heap = Heap {
            dev,
            gran,
            phys: Physical::Segments {
                segs: BTreeMap::new(),
            },
            by_addr: AddrIndex::default(),
            by_tag: FxHashMap::default(),
            capture_hold: false,
            request_floor,
            allocated: FxHashMap::default(),
            reserved: 0,
            allocated_bytes: 0,
            next_pending: 0,
            dirty_gen: Vec::new(),
            fresh_quarantine: Vec::new(),
            aliases: FxHashMap::default(),
            deferred: FxHashSet::default(),
            fresh_waits: Vec::new(),
            in_flight: 0,
            completed_during_jobs: Vec::new(),
            growth_refused: false,
            blocked: FxHashSet::default(),
            device_allocs: 0,
            device_frees: 0,
            peers: Vec::new(),
            limit: super::limits::Limit::default(),
            paused: FxHashMap::default(),
            paused_bytes: 0,
            stitch_budget: 0.0,
            stolen_since_growth: 0,
            stitch_share: StitchShare::unlimited(),
            backend,
        };
        if info.vmm_supported {
            let len = align_up(va_bytes.max(gran), gran);
            let base = heap.backend.reserve_va(dev, len)?.addr();
            heap.phys = Physical::Vmm {
                base,
                len,
                granules: vec![Granule::default(); (len / gran) as usize],
                spare: Vec::new(),
                idle: GranuleSet::new((len / gran) as usize),
                quarantine: GranuleSet::new((len / gran) as usize),
                mapped: GranuleSet::new((len / gran) as usize),
            };
            if gran.is_power_of_two() {
                heap.by_addr = AddrIndex::for_reservation(base, len, gran.trailing_zeros());
            }
            heap.insert_free(base, len, Tag::Clean);
        }
        Ok(heap)
    }

    /// Base and length of the reservation (VMM mode).
    pub(crate) fn reservation(&self) -> Option<(u64, u64)> {
        match &self.phys {
            Physical::Vmm { base, len, .. } => Some((*base, *len)),
            Physical::Segments { .. } => None,
        }
    }

    /// Physical bytes held.
    pub(crate) fn reserved(&self) -> u64 {
        self.reserved
    }

    /// Like [`Heap::alloc`], but only where no granule needs physical
    /// memory: no device allocation, no stitching. `None` if no such place.
    pub(crate) fn alloc_backed(
        &mut self,
        len: u64,
        align: u64,
        slot: Option<u16>,
    ) -> Option<Taken> {
        let (rlen, raddr, start) = self.place_backed(slot, len, align)?;
        self.take(
            raddr,
            rlen,
            start,
            len,
            StealCtx {
                slot,
                pending_ok: false,
            },
        )
        .ok()
    }

    /// Whether free memory tagged dirty on stream slots other than `slot`
    /// adds up to at least `bytes`.
    pub(crate) fn dirty_elsewhere_at_least(&self, slot: Option<u16>, bytes: u64) -> bool {
        let sum: u64 = self
            .by_tag
            .iter()
            .filter(|(t, _)| matches!(t, Tag::Dirty(s) if Some(*s) != slot))
            .map(|(_, set)| set.bytes())
            .sum();
        sum >= bytes
    }

    /// Free ranges stream slot `slot` may take with no wait on the host
    /// (`Clean`, `Dirty(slot)`, and `Pending(id)` where `group(id)`: the
    /// caller's stream is ordered after the group's uses) of at least
    /// `min_len` bytes, as `(addr, len)` by address: where a learned
    /// step's arena can be laid in place.
    pub(crate) fn usable_ranges(
        &self,
        slot: u16,
        min_len: u64,
        group: impl Fn(u32) -> bool,
    ) -> Vec<(u64, u64)> {
        let mut v: Vec<(u64, u64)> = self
            .by_tag
            .iter()
            .filter(|(t, _)| usable_tag(**t, slot, &group))
            .flat_map(|(_, set)| set.at_least(min_len).map(|(len, addr)| (addr, len)))
            .collect();
        v.sort_unstable();
        v
    }

    /// Takes exactly `[start, start + len)`, which must lie in one free
    /// range that [`Heap::usable_ranges`] lists for `slot` and `group`
    /// (else `None`, nothing changed), backing its granules as
    /// [`Heap::alloc`] does; a pending range's group is in
    /// [`Taken::waits`].
    pub(crate) fn alloc_at(
        &mut self,
        start: u64,
        len: u64,
        slot: u16,
        group: impl Fn(u32) -> bool,
    ) -> Option<Result<Taken>> {
        debug_assert!(len % ALIGN == 0 && start % ALIGN == 0 && len > 0);
        let (raddr, r) = self.by_addr.at_or_before(start)?;
        let usable = usable_tag(r.tag, slot, &group);
        if !usable || start + len > raddr + r.len {
            return None;
        }
        let ctx = StealCtx {
            slot: Some(slot),
            pending_ok: false,
        };
        Some(self.take(raddr, r.len, start, len, ctx))
    }

    /// The granules a fresh range of `len` bytes for `slot` would need
    /// backed, where [`Heap::alloc`] would place it (`None`: no range fits).
    pub(crate) fn unbacked_at_best_fit(&self, len: u64, slot: u16) -> Option<u64> {
        self.place(Some(slot), len, ALIGN)
            .map(|(_, _, start)| self.unbacked(start, len))
    }

    /// Whether the heap maps granules of one reservation (VMM), not
    /// plain segments.
    pub(crate) fn is_vmm(&self) -> bool {
        matches!(self.phys, Physical::Vmm { .. })
    }

    /// Takes `len` bytes at `align` from the best-fitting pending range
    /// that needs no new physical memory, for a stream that will wait on
    /// the range's group ([`Taken::waits`]) instead of the host; only
    /// groups `usable` accepts are considered. `None` if no pending range
    /// fits that way. Called before the pool grows, so
    /// that memory freed across streams is reused, not duplicated.
    pub(crate) fn alloc_pending_backed(
        &mut self,
        len: u64,
        align: u64,
        slot: Option<u16>,
        usable: impl Fn(u32) -> bool,
    ) -> Option<Result<Taken>> {
        let (rlen, raddr) = self
            .by_tag
            .iter()
            .filter(|(t, _)| matches!(t, Tag::Pending(id) if usable(*id)))
            .filter_map(|(_, set)| {
                set.at_least(len)
                    .find(|r| align_up(r.1, align) + len <= r.1 + r.0)
            })
            .filter(|&(_, raddr)| self.fully_backed(align_up(raddr, align), len))
            .min()?;
        let ctx = StealCtx {
            slot,
            pending_ok: true,
        };
        Some(self.take(raddr, rlen, align_up(raddr, align), len, ctx))
    }

    /// For a request that no single free range serves: `len` bytes at
    /// `align` in a run of adjacent free, backed ranges whose tags differ
    /// (`Clean`, `Dirty(slot)`, or `Pending(id)` with `usable(id)`), which
    /// never merge with each other. Returns the start and the pending
    /// groups in `[start, start+len)`; of the runs that fit, the one with
    /// the fewest such groups, then the shortest. Nothing changes: once the
    /// stream waits on those groups, [`Heap::take_run`] takes the place.
    ///
    /// Only runs holding pending memory are looked at: each is found from
    /// one of its pending ranges by walking neighbours with exact address
    /// lookups, so the cost follows the pending memory, not the heap (a
    /// pool with no pending frees pays nothing; a scan of every free range
    /// here made each growth O(ranges)).
    pub(crate) fn find_run(
        &self,
        len: u64,
        align: u64,
        slot: u16,
        usable: impl Fn(u32) -> bool,
    ) -> Option<(u64, Vec<u32>)> {
        let ok = |t: Tag| match t {
            Tag::Clean => true,
            Tag::Dirty(s) => s == slot,
            Tag::Pending(id) => usable(id),
        };
        // The current run: backed, free, usable pieces `(addr, len, tag)`
        // adjacent in address order.
        let mut run: Vec<(u64, u64, Tag)> = Vec::new();
        let mut best: Option<(usize, u64, u64, Vec<u32>)> = None; // (groups, run len, start, ids)
        let mut consider = |run: &[(u64, u64, Tag)]| {
            let Some(&(lo, _, _)) = run.first() else {
                return;
            };
            let &(la, ll, _) = run.last().expect("non-empty");
            let start = align_up(lo, align);
            if start + len > la + ll {
                return;
            }
            let mut ids: Vec<u32> = run
                .iter()
                .filter(|p| p.0 < start + len && p.0 + p.1 > start)
                .filter_map(|p| match p.2 {
                    Tag::Pending(id) => Some(id),
                    _ => None,
                })
                .collect();
            ids.sort_unstable();
            ids.dedup();
            let key = (ids.len(), la + ll - lo);
            if best.as_ref().is_none_or(|b| key < (b.0, b.1)) {
                best = Some((key.0, key.1, start, ids));
            }
        };
        // Seeds in address order: each walk runs from its neighbourhood's
        // first range to its last, so a later seed below where the last
        // walk ended lies in a neighbourhood already walked, whole, and
        // every range is walked once however many pending ranges a
        // neighbourhood holds (walking left from each seed made a
        // neighbourhood of n of them cost n^2). In address order, the
        // walks' lookups also visit the address index in order (in the
        // groups' hash order, its binary searches missed the cache): on 8
        // busy streams, this function's share of the run fell from
        // 9.4-10.3% to 6.9-8.2% of samples. Of equal runs, the lowest wins.
        let mut seeds: Vec<u64> = self
            .by_tag
            .iter()
            .filter(|(t, _)| matches!(t, Tag::Pending(id) if usable(*id)))
            .flat_map(|(_, set)| set.iter().map(|(_, addr)| addr))
            .collect();
        seeds.sort_unstable();
        let mut walked_to = 0;
        for seed in seeds {
            if seed < walked_to {
                continue;
            }
            // The first free, usable range of the neighbourhood.
            let mut lo = seed;
            while let Some((pa, pr)) = self.by_addr.range_ending_at(lo) {
                if !ok(pr.tag) || !self.same_segment(pa, lo) {
                    break;
                }
                lo = pa;
            }
            // Its backed runs, left to right.
            let mut a = lo;
            while let Some(r) = self.by_addr.get(a).filter(|r| ok(r.tag)) {
                walked_to = a + r.len;
                for (pa, pl) in self.mapped_parts(a, r.len) {
                    let joins = run
                        .last()
                        .is_some_and(|&(la, ll, _)| la + ll == pa && self.same_segment(la, pa));
                    if !joins {
                        consider(&run);
                        run.clear();
                    }
                    run.push((pa, pl, r.tag));
                }
                if !self.same_segment(a, a + r.len) {
                    break;
                }
                a += r.len;
            }
            consider(&run);
            run.clear();
        }
        best.map(|b| (b.2, b.3))
    }

    /// Takes `[start, start+len)`, a place [`Heap::find_run`] returned,
    /// for stream slot `slot`, whose stream already waits on the pending
    /// groups found there: the pieces become `Dirty(slot)` (reusable by
    /// that stream alone, which is now ordered after their earlier uses),
    /// merge, and the range is taken. `None` (nothing changed) if the
    /// place is no longer free and backed.
    pub(crate) fn take_run(&mut self, start: u64, len: u64, slot: u16) -> Option<Taken> {
        let first = self.by_addr.at_or_before(start).map_or(start, |(a, _)| a);
        let mut covered = 0;
        for (a, r) in self.by_addr.starting_in(first, start + len) {
            if matches!(r.tag, Tag::Dirty(s) if s != slot) {
                return None;
            }
            covered += (a + r.len).min(start + len).saturating_sub(a.max(start));
        }
        if covered != len || !self.fully_backed(start, len) {
            return None;
        }
        self.retag(start, start + len, Tag::Dirty(slot));
        let (raddr, r) = self.by_addr.at_or_before(start)?;
        let rlen = r.len;
        let ctx = StealCtx {
            slot: Some(slot),
            pending_ok: false,
        };
        self.take(raddr, rlen, start, len, ctx).ok()
    }

    // ---- allocation --------------------------------------------------------------

    /// Takes `len` bytes (a multiple of 256) aligned to `align` for a stream
    /// in slot `slot`. With `pending_ok`, pending memory may be used too: the
    /// caller must then order its stream after the groups in
    /// [`Taken::waits`]. Grows physical memory as needed. On failure nothing
    /// changes, except that granules in [`Heap::take_quarantine`] may have
    /// been aliased (they need an event all the same).
    pub(crate) fn alloc(
        &mut self,
        len: u64,
        align: u64,
        slot: Option<u16>,
        pending_ok: bool,
    ) -> Result<Taken> {
        let once = |heap: &mut Heap| {
            let (t, job) = heap.alloc_planned(len, align, slot, pending_ok)?;
            heap.map_now(t, job)
        };
        match once(self) {
            Err(_) if self.growth_refused() => once(self),
            r => r,
        }
    }

    /// [`Heap::alloc`], with the mapping the range needs (if any) left to
    /// the caller: run it with no lock held ([`MapJob::run`]), then hand
    /// it to [`Heap::finish_alloc`]. Until then the range is allocated
    /// but not yet usable.
    pub(crate) fn alloc_planned(
        &mut self,
        len: u64,
        align: u64,
        slot: Option<u16>,
        pending_ok: bool,
    ) -> Result<(Taken, Option<Box<MapJob>>)> {
        debug_assert!(len % ALIGN == 0 && len > 0);
        let mut candidates: Vec<(u64, u64, u64)> =
            self.place(slot, len, align).into_iter().collect();
        if pending_ok {
            let tags: Vec<Tag> = self
                .by_tag
                .keys()
                .copied()
                .filter(|t| matches!(t, Tag::Pending(id) if !self.blocked.contains(id)))
                .collect();
            if let Some((rlen, raddr)) = tags
                .into_iter()
                .filter_map(|t| self.best_in(t, len, align))
                .min()
            {
                candidates.push((rlen, raddr, align_up(raddr, align)));
            }
        }
        if candidates.is_empty() {
            let (rlen, raddr) = self.grow_segments(len, align)?;
            candidates.push((rlen, raddr, align_up(raddr, align)));
        }
        let ctx = StealCtx { slot, pending_ok };
        let mut last = None;
        for (rlen, raddr, start) in candidates {
            match self.take_planned(raddr, rlen, start, len, ctx) {
                Ok(t) => return Ok(t),
                Err(e) if e.is_oom() => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.expect("at least one candidate was tried"))
    }

    /// Takes `len` bytes at `align` out of free range `(raddr, rlen)`,
    /// backing it here, under the lock.
    fn take(
        &mut self,
        raddr: u64,
        rlen: u64,
        start: u64,
        len: u64,
        ctx: StealCtx,
    ) -> Result<Taken> {
        let (t, job) = self.take_planned(raddr, rlen, start, len, ctx)?;
        self.map_now(t, job)
    }

    /// Runs and publishes the mapping `t` needs, if any, under the lock.
    fn map_now(&mut self, t: Taken, job: Option<Box<MapJob>>) -> Result<Taken> {
        match job {
            None => Ok(t),
            Some(job) => {
                let done = job.run();
                self.finish_alloc(t, job, done)
            }
        }
    }

    /// Takes `len` bytes at `align` out of free range `(raddr, rlen)`,
    /// with the mapping its unbacked granules need, if any, for the
    /// caller to run and publish (`map_job.rs`).
    fn take_planned(
        &mut self,
        raddr: u64,
        rlen: u64,
        start: u64,
        len: u64,
        ctx: StealCtx,
    ) -> Result<(Taken, Option<Box<MapJob>>)> {
        debug_assert!(start >= raddr && start + len <= raddr + rlen);
        // Put the unused head and tail back first, so that idle granules in
        // them can be stolen to back the taken part.
        let r = self.split_free(raddr, rlen, start, len);
        let job = match self.plan_back(start, len, ctx) {
            Ok(job) => job,
            Err(e) => {
                self.insert_free(start, len, r.tag);
                return Err(e);
            }
        };
        self.allocated.insert(start, len);
        self.allocated_bytes += len;
        let waits = match r.tag {
            Tag::Pending(id) => vec![id],
            _ => Vec::new(),
        };
        // A granule backed by an aliased chunk shares physical memory with
        // old uses that only the requesting stream is ordered after: the
        // range (and the free rest of that granule, `publish_back`) is for
        // that stream alone.
        let aliased = job.as_ref().is_some_and(|j| j.aliased.is_some());
        let exclusive = r.tag != Tag::Clean || aliased;
        let t = Taken {
            addr: start,
            from: r.tag,
            waits,
            exclusive,
        };
        Ok((t, job))
    }

    /// Publishes the mapping of a range [`Heap::alloc_planned`] took
    /// (`done`, from [`MapJob::run`]). On a failure the range is free
    /// again, as it was, and nothing else changed, except that granules
    /// in [`Heap::take_quarantine`] may have been aliased.
    pub(crate) fn finish_alloc(
        &mut self,
        t: Taken,
        job: Box<MapJob>,
        done: MapDone,
    ) -> Result<Taken> {
        let len = job.len;
        match self.publish_back(job, done) {
            Ok(_) => Ok(t),
            Err(e) => {
                self.allocated.remove(&t.addr);
                self.allocated_bytes -= len;
                self.insert_free(t.addr, len, t.from);
                Err(e)
            }
        }
    }

    // ---- freeing and tags -----------------------------------------------------------

    /// The length of the allocated range at `addr`, if any.
    pub(crate) fn allocated_len(&self, addr: u64) -> Option<u64> {
        self.allocated.get(&addr).copied()
    }

    /// Whether `addr` lies in free memory of the heap.
    pub(crate) fn is_free(&self, addr: u64) -> bool {
        matches!(self.by_addr.at_or_before(addr), Some((a, r)) if addr < a + r.len)
    }

    /// Returns an allocated range with `tag`.
    pub(crate) fn free(&mut self, addr: u64, tag: Tag) -> Result<u64> {
        let len = self.allocated.remove(&addr).ok_or(Error::UnknownPointer {
            ptr: addr,
            device: self.dev,
        })?;
        self.allocated_bytes -= len;
        if !self.paused.is_empty() {
            self.unpause_on_free(addr);
        }
        self.insert_free(addr, len, tag);
        self.drop_users(addr, len);
        Ok(len)
    }

    /// Returns the allocated ranges at `addrs` (best ascending: see below)
    /// with `tag`, as
    /// [`Heap::free`] of each in turn would, in two passes: the allocated
    /// map and the granules' users, then the free-range indexes. The first
    /// pass's lookups (each a likely cache miss) are independent of one
    /// another, and back to back the processor overlaps them; interleaved
    /// with the merges they waited on each other's misses.
    pub(crate) fn free_many(&mut self, addrs: &[u64], tag: Tag) {
        // Inline for the usual few (a stream's own parked ranges): a
        // steady loop allocates nothing on the host.
        let mut lens: smallvec::SmallVec<[u64; 16]> =
            smallvec::SmallVec::with_capacity(addrs.len());
        for &addr in addrs {
            let len = self.allocated.remove(&addr).expect("range is allocated");
            self.allocated_bytes -= len;
            self.drop_users(addr, len);
            lens.push(len);
        }
        // Ranges that touch (often parked neighbours) go in as one run:
        // the result is the same merged range, for one merge's index work.
        let mut i = 0;
        while i < addrs.len() {
            let (start, mut end) = (addrs[i], addrs[i] + lens[i]);
            i += 1;
            while i < addrs.len()
                && addrs[i] == end
                && Self::same_segment_in(&self.phys, start, end)
            {
                end += lens[i];
                i += 1;
            }
            self.insert_free(start, end - start, tag);
        }
    }

    /// Retags every `Dirty(slot)` range as a new pending group; returns the
    /// group id and its bytes, or `None` if the slot had nothing dirty.
    pub(crate) fn flush_dirty(&mut self, slot: u16) -> Option<(u32, u64)> {
        // Emptied dirty sets stay indexed (a busy stream fills them again).
        if self.by_tag.get(&Tag::Dirty(slot))?.is_empty() {
            return None;
        }
        // With every range stored: harvesting walks the group's ranges.
        let set = self
            .take_size_index(Tag::Dirty(slot))
            .expect("looked up above");
        let id = self.next_pending;
        self.next_pending = self.next_pending.wrapping_add(1);
        let bytes = set.bytes();
        for (_, addr) in set.iter() {
            self.by_addr.set_tag(addr, Tag::Pending(id));
        }
        self.by_tag.insert(Tag::Pending(id), set);
        Some((id, bytes))
    }

    /// The stream slots with dirty free memory, each with its
    /// [`Heap::dirty_gen`] count now.
    pub(crate) fn dirty_slots(&self) -> Vec<(u16, u64)> {
        self.by_tag
            .iter()
            .filter_map(|(t, set)| match *t {
                Tag::Dirty(s) if !set.is_empty() => Some(s),
                _ => None,
            })
            .map(|s| (s, self.dirty_gen(s)))
            .collect()
    }

    /// How many times free memory joined `Dirty(slot)`.
    pub(crate) fn dirty_gen(&self, slot: u16) -> u64 {
        self.dirty_gen.get(slot as usize).copied().unwrap_or(0)
    }

    /// Notes that free memory joined `Dirty(slot)`.
    #[inline]
    pub(super) fn note_dirty(&mut self, slot: u16) {
        let i = slot as usize;
        if i >= self.dirty_gen.len() {
            self.dirty_gen.resize(i + 1, 0);
        }
        self.dirty_gen[i] += 1;
    }

    /// Makes every `Dirty(slot)` range clean (merged with its clean
    /// neighbours) if none joined since `gen` was read: the caller found
    /// the slot's stream idle after that read, so every use of those
    /// ranges (and every wait the stream made for aliased memory in them)
    /// has completed. Returns the bytes cleaned (0: the count moved on,
    /// or nothing was dirty).
    pub(crate) fn clean_dirty_if(&mut self, slot: u16, gen: u64) -> u64 {
        if self.dirty_gen(slot) != gen {
            return 0;
        }
        // With every range stored (the short ones found by address).
        let Some(set) = self.take_size_index(Tag::Dirty(slot)) else {
            return 0;
        };
        self.make_clean(&set);
        set.bytes()
    }

    /// Makes every range of `set` (taken out of its tag's index) clean,
    /// each merged with the clean ranges around it, those of `set`
    /// cleaned before it included.
    fn make_clean(&mut self, set: &SizeIndex) {
        for (_, addr) in set.iter() {
            let r = self.by_addr.remove(addr).expect("indexed");
            self.insert_free(addr, r.len, Tag::Clean);
        }
    }

    /// A new, empty pending group id (for ranges freed with `record_stream`).
    pub(crate) fn new_pending_group(&mut self) -> u32 {
        let id = self.next_pending;
        self.next_pending = self.next_pending.wrapping_add(1);
        id
    }

    /// Marks every range of pending group `id` clean (its events completed).
    pub(crate) fn complete_pending(&mut self, id: u32) {
        if let Some(set) = self.by_tag.remove(&Tag::Pending(id)) {
            self.make_clean(&set);
        }
        if self.in_flight > 0 {
            // Pieces of the group a mapping job cut out return clean.
            self.completed_during_jobs.push(id);
        }
    }

    /// `t`, or `Clean` for a pending group that completed while a mapping
    /// job held pieces of it out of the free ranges (`map_job.rs`).
    pub(super) fn live_tag(&self, t: Tag) -> Tag {
        match t {
            Tag::Pending(id) if self.completed_during_jobs.contains(&id) => Tag::Clean,
            t => t,
        }
    }

    /// Gives everything back to the device (pool teardown). Allocated ranges
    /// must be gone.
    pub(crate) fn teardown(&mut self) {
        let mut q = GranuleRuns::new();
        if let Physical::Vmm { quarantine, .. } = &self.phys {
            for g in quarantine.iter() {
                push_run(&mut q, g, 1);
            }
        }
        self.release_quarantine(&q);
        let ranges: Vec<(u64, u64)> = self.allocated_ranges().collect();
        for (a, _) in ranges {
            let _ = self.free(a, Tag::Clean);
        }
        let pend: Vec<Tag> = self
            .by_tag
            .keys()
            .copied()
            .filter(|t| *t != Tag::Clean)
            .collect();
        for t in pend {
            if let Some(set) = self.take_size_index(t) {
                for (_, addr) in set.iter() {
                    let r = self.by_addr.remove(addr).expect("indexed");
                    self.insert_free(addr, r.len, Tag::Clean);
                }
            }
        }
        self.release_cached();
        if let Physical::Vmm { base, len, .. } = self.phys {
            if let Err(e) = self.backend.free_va(self.dev, DevicePtr(base), len) {
                tracing::warn!(device = self.dev, "cuMemAddressFree failed: {e}");
            }
        }
    }
}
