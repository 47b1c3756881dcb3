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

/// Granules as runs `(first, count)`: quarantined granules come in runs
/// (a stitch aliases whole runs of idle granules), handled a run at a time.
pub(crate) type GranuleRuns = Vec<(u32, u32)>;

/// Appends granules `g0..g0 + n` to `runs`, extending the last run if they
/// follow it.
fn push_run(runs: &mut GranuleRuns, g0: u32, n: u32) {
    match runs.last_mut() {
        Some((s, m)) if *s + *m == g0 => *m += n,
        _ => runs.push((g0, n)),
    }
}

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

/// Free ranges of each tag that [`Heap::place`] compares: the shortest few.
const WIDTH: usize = 8;

/// Owner-word writes the heap holds back before making them in one pass
/// (see [`Heap::set_owner`]).
const OWNER_LOG: usize = 256;

/// The granules that `[start, start + len)` touches, `first..=last`, and
/// of those the ones it covers whole, `whole.0..whole.1` (empty if none).
/// The others, at most the first and the last, it shares.
#[inline]
fn granule_span(base: u64, gran: u64, start: u64, len: u64) -> (u32, u32, (u32, u32)) {
    let (s, e) = (start - base, start + len - base);
    let (first, last) = ((s / gran) as u32, ((e - 1) / gran) as u32);
    let lo = first + (s % gran != 0) as u32;
    let hi = if e % gran == 0 { last + 1 } else { last };
    (first, last, (lo, hi.max(lo)))
}

/// The shared granules of a span from [`granule_span`]: none, one or two.
#[inline]
fn shared_granules(first: u32, last: u32, whole: (u32, u32)) -> [Option<u32>; 2] {
    let head = (first < whole.0).then_some(first);
    let tail = (last >= whole.1 && (last > first || head.is_none())).then_some(last);
    [head, tail]
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
    /// No request is shorter: the `Clean` and `Dirty` size indexes count
    /// free ranges under it without storing them (see `size_index.rs`).
    /// `Pending` ones store every range (harvesting walks them).
    request_floor: u64,
    /// Allocated ranges: addr -> (len, the caller's owner word). One map
    /// serves both the heap and the pool's record of live large blocks,
    /// so a large allocation or free costs one hash lookup, not two.
    allocated: FxHashMap<u64, Allocated>,
    /// Owner-word writes not yet made, oldest first (see
    /// [`Heap::set_owner`]). Invariant: each names a range that is
    /// allocated now (a range leaves the map only after the log is
    /// applied), and applied in order they give every word its latest
    /// value.
    owner_log: Vec<(u64, u64)>,
    reserved: u64,
    allocated_bytes: u64,
    next_pending: u32,
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
}

/// An allocated range's length and the word its owner keeps with it.
#[derive(Debug, Clone, Copy)]
struct Allocated {
    len: u64,
    /// 0 until [`Heap::set_owner`]; the pool encodes live large blocks
    /// (and leaves the word of a range it parks: see `PoolShared::free_block`).
    owner: u64,
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

/// Who is asking, for deciding which idle granules may be stolen.
#[derive(Debug, Clone, Copy)]
struct StealCtx {
    slot: Option<u16>,
    pending_ok: bool,
}

/// A chunk taken from an idle granule.
#[derive(Debug)]
struct Stolen {
    g: u32,
    chunk: ChunkHandle,
    /// For a steal by aliasing, the index of its run's cover in the
    /// [`Steals`] (the free ranges the granule's pieces were cut from);
    /// `None` for a clean steal.
    run: Option<u32>,
}

/// The chunks one request steals, and the covers of its aliased runs.
#[derive(Debug, Default)]
struct Steals {
    stolen: Vec<Stolen>,
    covers: Vec<Cover>,
}

/// Two best-fit orders of free ranges `(len, addr)` merged into one, at
/// most `left` more.
struct BestFitMerge<I: Iterator> {
    a: Option<std::iter::Peekable<I>>,
    b: Option<std::iter::Peekable<I>>,
    left: usize,
}

impl<I: Iterator<Item = (u64, u64)>> Iterator for BestFitMerge<I> {
    type Item = (u64, u64);

    // Always inlined: it runs for every candidate of a large placement,
    // and as a call it cost 3% of random_allocations.
    #[inline(always)]
    fn next(&mut self) -> Option<(u64, u64)> {
        if self.left == 0 {
            return None;
        }
        let a = self.a.as_mut().and_then(|i| i.peek().copied());
        let b = self.b.as_mut().and_then(|i| i.peek().copied());
        let from_b = match (a, b) {
            (Some(a), Some(b)) => b < a,
            (None, Some(_)) => true,
            (_, None) => false,
        };
        let side = if from_b { &mut self.b } else { &mut self.a };
        let r = side.as_mut().and_then(Iterator::next)?;
        self.left -= 1;
        Some(r)
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
            request_floor,
            allocated: FxHashMap::default(),
            owner_log: Vec::with_capacity(OWNER_LOG),
            reserved: 0,
            allocated_bytes: 0,
            next_pending: 0,
            fresh_quarantine: Vec::new(),
            aliases: FxHashMap::default(),
            deferred: FxHashSet::default(),
            fresh_waits: Vec::new(),
            blocked: FxHashSet::default(),
            device_allocs: 0,
            device_frees: 0,
            peers: Vec::new(),
            limit: super::limits::Limit::default(),
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

    // ---- free-range bookkeeping ----------------------------------------------

    fn index_insert(&mut self, addr: u64, r: FreeRange) {
        self.by_addr.insert(addr, r);
        self.size_index(r.tag).insert(r.len, addr);
    }

    /// The size index of `tag`, made if it has none.
    #[inline]
    fn size_index(&mut self, tag: Tag) -> &mut SizeIndex {
        Self::size_index_in(&mut self.by_tag, self.request_floor, tag)
    }

    /// [`Heap::size_index`] over the map alone (for callers that hold other
    /// fields): `Clean` and `Dirty` indexes get the request floor,
    /// `Pending` ones none.
    #[inline]
    fn size_index_in(
        by_tag: &mut FxHashMap<Tag, SizeIndex>,
        request_floor: u64,
        tag: Tag,
    ) -> &mut SizeIndex {
        let floor = match tag {
            Tag::Pending(_) => 0,
            Tag::Clean | Tag::Dirty(_) => request_floor,
        };
        by_tag
            .entry(tag)
            .or_insert_with(|| SizeIndex::with_floor(floor))
    }

    /// Removes the size index of `tag` with every range stored in it (the
    /// unstored ones found by address), for callers that move them all.
    fn take_size_index(&mut self, tag: Tag) -> Option<SizeIndex> {
        let mut set = self.by_tag.remove(&tag)?;
        let floor = set.floor();
        if set.unstored() > 0 {
            let short: Vec<(u64, u64)> = self
                .by_addr
                .iter()
                .filter(|(_, r)| r.tag == tag && r.len < floor)
                .map(|(a, r)| (r.len, a))
                .collect();
            set.store_all(short);
        } else if floor > 0 {
            set.store_all([]);
        }
        Some(set)
    }

    fn index_remove(&mut self, addr: u64) -> FreeRange {
        let r = self.by_addr.remove(addr).expect("free range exists");
        let set = self.by_tag.get_mut(&r.tag).expect("tag set exists");
        set.remove(r.len, addr);
        if set.is_empty() && matches!(r.tag, Tag::Pending(_)) {
            self.by_tag.remove(&r.tag);
        }
        r
    }

    fn same_segment(&self, a: u64, b: u64) -> bool {
        Self::same_segment_in(&self.phys, a, b)
    }

    /// Whether `a` and `b` lie in the same plain segment (always, in VMM
    /// mode). A function of `phys` alone so callers can hold `by_addr`.
    fn same_segment_in(phys: &Physical, a: u64, b: u64) -> bool {
        match phys {
            Physical::Vmm { .. } => true,
            Physical::Segments { segs } => {
                let seg_of = |x: u64| segs.range(..=x).next_back().map(|(s, _)| *s);
                seg_of(a) == seg_of(b)
            }
        }
    }

    /// Inserts a free range and merges it with equal-tag neighbours: the
    /// one after by an exact lookup of its start, the one before as the
    /// last start before `addr` (see `addr_index.rs`); a merge with the
    /// range before extends that entry in place.
    fn insert_free(&mut self, addr: u64, len: u64, tag: Tag) {
        if len == 0 {
            return;
        }
        // Each neighbour is looked up once and removed or lengthened where
        // it was found (a lookup and then a change made two searches).
        let phys = &self.phys;
        let next = self.by_addr.remove_if(addr + len, |nr| {
            nr.tag == tag && Self::same_segment_in(phys, addr, addr + len)
        });
        // (`phys` is borrowed: the map alone.)
        let set = Self::size_index_in(&mut self.by_tag, self.request_floor, tag);
        let mut total = len;
        if let Some(nr) = next {
            set.remove(nr.len, addr + len);
            total += nr.len;
        }
        let prev = self.by_addr.extend_ending_at(addr, total, |pa, pr| {
            pr.tag == tag && Self::same_segment_in(phys, pa, addr)
        });
        if let Some((pa, plen)) = prev {
            set.relen(plen, plen + total, pa);
            return;
        }
        self.by_addr.insert(addr, FreeRange { len: total, tag });
        set.insert(total, addr);
    }

    /// Best fit for `len` bytes at `align` among ranges tagged `tag`:
    /// `(range len, range addr)`.
    fn best_in(&self, tag: Tag, len: u64, align: u64) -> Option<(u64, u64)> {
        let set = self.by_tag.get(&tag)?;
        let mut tried = 0;
        for (rlen, raddr) in set.at_least(len) {
            let start = align_up(raddr, align);
            if start + len <= raddr + rlen {
                return Some((rlen, raddr));
            }
            tried += 1;
            if tried > 64 {
                // Only aligned (slab) requests get here; a range that large
                // always fits.
                return set.at_least(len + align).next();
            }
        }
        None
    }

    /// Chooses where to put `len` bytes for stream slot `slot`: among the
    /// smallest free ranges that fit (clean, or dirty on that slot), and at
    /// either end of each, the placement that needs the fewest granules
    /// without physical memory, then the smallest range. Fewer unbacked
    /// granules means less stitching now and less memory held at the peak,
    /// because a block placed against a used granule shares it. Returns
    /// `(range len, range addr, start)`.
    fn place(&self, slot: Option<u16>, len: u64, align: u64) -> Option<(u64, u64, u64)> {
        let mut best: Option<(u64, u64, u64, u64)> = None; // (cost, rlen, raddr, start)
        for (rlen, raddr) in self.candidates(slot, len, align) {
            for start in self.ends(rlen, raddr, len, align) {
                let c = (self.unbacked(start, len), rlen, raddr, start);
                if best.is_none_or(|b| (c.0, c.1) < (b.0, b.1)) {
                    best = Some(c);
                }
            }
            // Ranges come shortest first: nothing later beats a fully
            // backed place.
            if best.is_some_and(|b| b.0 == 0) {
                break;
            }
        }
        match best {
            Some(b) => Some((b.1, b.2, b.3)),
            None => self.any_fit(slot, len, align),
        }
    }

    /// [`Heap::place`]'s choice when it needs no unbacked granule, else
    /// `None`, found without ranking the candidates: they are visited in
    /// `place`'s order, so the first fully backed placement is `place`'s
    /// too (nothing later can beat it).
    fn place_backed(&self, slot: Option<u16>, len: u64, align: u64) -> Option<(u64, u64, u64)> {
        let mut seen = false;
        for (rlen, raddr) in self.candidates(slot, len, align) {
            seen = true;
            for start in self.ends(rlen, raddr, len, align) {
                if self.fully_backed(start, len) {
                    return Some((rlen, raddr, start));
                }
            }
        }
        if seen {
            return None;
        }
        self.any_fit(slot, len, align)
            .filter(|&(_, _, start)| self.fully_backed(start, len))
    }

    /// The free ranges [`Heap::place`] compares for `len` bytes at `align`:
    /// the [`WIDTH`] shortest that fit of `Clean` and `Dirty(slot)`
    /// together, as `(len, addr)` in best-fit order (shortest, then lowest
    /// address). The two tags' indexes are merged as they are read.
    fn candidates(
        &self,
        slot: Option<u16>,
        len: u64,
        align: u64,
    ) -> impl Iterator<Item = (u64, u64)> + '_ {
        let fits = move |r: &(u64, u64)| align_up(r.1, align) + len <= r.1 + r.0;
        let of = |tag: Tag| {
            self.by_tag
                .get(&tag)
                .map(|set| set.at_least(len).filter(fits).peekable())
        };
        BestFitMerge {
            a: of(Tag::Clean),
            b: slot.and_then(|s| of(Tag::Dirty(s))),
            left: WIDTH,
        }
    }

    /// Where in free range `(rlen, raddr)` a block of `len` bytes at
    /// `align` may go, preferred end first: blocks smaller than a granule
    /// go to the high end, so that small blocks collect together instead
    /// of pinning granules between large ones; larger ones to the low end.
    fn ends(&self, rlen: u64, raddr: u64, len: u64, align: u64) -> [u64; 2] {
        let lo = align_up(raddr, align);
        let hi = ((raddr + rlen - len) / align * align).max(lo);
        if len < self.gran {
            [hi, lo]
        } else {
            [lo, hi]
        }
    }

    /// The first range of `Clean` or `Dirty(slot)` large enough for `len`
    /// bytes at any alignment, at its aligned start: only aligned (slab)
    /// requests can find no candidate that fits, and this serves them.
    fn any_fit(&self, slot: Option<u16>, len: u64, align: u64) -> Option<(u64, u64, u64)> {
        let mut any = self.best_in(Tag::Clean, len, align);
        if let Some(d) = slot.and_then(|s| self.best_in(Tag::Dirty(s), len, align)) {
            any = Some(any.map_or(d, |a| a.min(d)));
        }
        any.map(|(rlen, raddr)| (rlen, raddr, align_up(raddr, align)))
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
        let mut seen: Vec<u64> = Vec::new();
        let seeds = self
            .by_tag
            .iter()
            .filter(|(t, _)| matches!(t, Tag::Pending(id) if usable(*id)))
            .flat_map(|(_, set)| set.iter().map(|(_, addr)| addr));
        for seed in seeds {
            // The first free, usable range of the neighbourhood.
            let mut lo = seed;
            while let Some((pa, pr)) = self.by_addr.range_ending_at(lo) {
                if !ok(pr.tag) || !self.same_segment(pa, lo) {
                    break;
                }
                lo = pa;
            }
            if seen.contains(&lo) {
                continue;
            }
            seen.push(lo);
            // Its backed runs, left to right.
            let mut a = lo;
            while let Some(r) = self.by_addr.get(a).filter(|r| ok(r.tag)) {
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

    /// Whether every granule of `[start, start+len)` has physical memory
    /// (`unbacked(start, len) == 0`, without counting: always in segment
    /// mode).
    #[inline]
    fn fully_backed(&self, start: u64, len: u64) -> bool {
        let Physical::Vmm { base, mapped, .. } = &self.phys else {
            return true;
        };
        let first = ((start - base) / self.gran) as u32;
        let last = ((start + len - 1 - base) / self.gran) as u32;
        mapped.all_in(first, last + 1)
    }

    /// Granules of `[start, start+len)` with no physical memory (0 in
    /// segment mode, where free memory is always backed).
    #[inline]
    fn unbacked(&self, start: u64, len: u64) -> u64 {
        let Physical::Vmm {
            base,
            mapped,
            granules,
            ..
        } = &self.phys
        else {
            return 0;
        };
        let first = ((start - base) / self.gran) as usize;
        let last = ((start + len - 1 - base) / self.gran) as usize;
        // Most blocks span a granule or two: look at them directly; the
        // bitmap answers for long spans a word (64 granules) at a time.
        if last - first < 4 {
            return granules[first..=last]
                .iter()
                .filter(|g| g.chunk.is_none())
                .count() as u64;
        }
        (last - first + 1) as u64 - mapped.count_in(first as u32, last as u32 + 1) as u64
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
            match self.take(raddr, rlen, start, len, ctx) {
                Ok(t) => return Ok(t),
                Err(e) if e.is_oom() => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.expect("at least one candidate was tried"))
    }

    /// Removes `[start, start+len)` from free range `(raddr, rlen)`,
    /// keeping its head and tail free with the same tag; returns the range.
    /// Neither piece can merge with anything: the range's neighbours were
    /// already unmergeable (equal-tag neighbours are always merged), and the
    /// taken part lies between the pieces. So the head keeps the range's
    /// entry, resized in place.
    fn split_free(&mut self, raddr: u64, rlen: u64, start: u64, len: u64) -> FreeRange {
        let (head, tail) = (start - raddr, raddr + rlen - start - len);
        let r = self.by_addr.get(raddr).expect("free range exists");
        debug_assert_eq!(r.len, rlen);
        if head > 0 {
            self.by_addr.set_len(raddr, head);
        } else {
            self.by_addr.remove(raddr);
        }
        if tail > 0 {
            self.by_addr.insert(
                start + len,
                FreeRange {
                    len: tail,
                    tag: r.tag,
                },
            );
        }
        let set = self.by_tag.get_mut(&r.tag).expect("tag set exists");
        set.remove(rlen, raddr);
        if head > 0 {
            set.insert(head, raddr);
        }
        if tail > 0 {
            set.insert(tail, start + len);
        }
        if set.is_empty() && matches!(r.tag, Tag::Pending(_)) {
            self.by_tag.remove(&r.tag);
        }
        r
    }

    /// Takes `len` bytes at `align` out of free range `(raddr, rlen)`.
    fn take(
        &mut self,
        raddr: u64,
        rlen: u64,
        start: u64,
        len: u64,
        ctx: StealCtx,
    ) -> Result<Taken> {
        debug_assert!(start >= raddr && start + len <= raddr + rlen);
        // Put the unused head and tail back first, so that idle granules in
        // them can be stolen to back the taken part.
        let r = self.split_free(raddr, rlen, start, len);
        let aliased = match self.back(start, len, ctx) {
            Ok(a) => a,
            Err(e) => {
                self.insert_free(start, len, r.tag);
                return Err(e);
            }
        };
        // A granule backed by an aliased chunk shares physical memory with
        // old uses that only the requesting stream is ordered after: the free
        // rest of that granule is for that stream alone.
        if let (Some(slot), Physical::Vmm { base, .. }) = (ctx.slot, &self.phys) {
            // Only the first and the last granule can have a free rest;
            // the aliased granules lie inside the span, so the first one is
            // aliased if it is the lowest aliased, the last if the highest.
            let (first, last, _) = granule_span(*base, self.gran, start, len);
            let head = aliased.map(|a| a.0).filter(|&g| g == first);
            let tail = aliased
                .map(|a| a.1)
                .filter(|&g| g == last && Some(g) != head);
            for g in [head, tail].into_iter().flatten() {
                self.retag_granule(g, start, len, Tag::Dirty(slot));
            }
        }
        self.allocated.insert(start, Allocated { len, owner: 0 });
        self.allocated_bytes += len;
        let waits = match r.tag {
            Tag::Pending(id) => vec![id],
            _ => Vec::new(),
        };
        let exclusive = r.tag != Tag::Clean || aliased.is_some();
        Ok(Taken {
            addr: start,
            from: r.tag,
            waits,
            exclusive,
        })
    }

    /// Retags the free parts of granule `g` outside `[start, start+len)`.
    fn retag_granule(&mut self, g: u32, start: u64, len: u64, tag: Tag) {
        let Physical::Vmm { base, .. } = &self.phys else {
            return;
        };
        let (gs, ge) = (
            *base + g as u64 * self.gran,
            *base + (g as u64 + 1) * self.gran,
        );
        for (lo, hi) in [(gs, start.min(ge)), ((start + len).max(gs), ge)] {
            if lo < hi {
                self.retag(lo, hi, tag);
            }
        }
    }

    /// Gives the free memory in `[lo, hi)` the tag `tag`.
    fn retag(&mut self, lo: u64, hi: u64, tag: Tag) {
        let first = self.by_addr.at_or_before(lo).map_or(lo, |(a, _)| a);
        let hits: Vec<(u64, FreeRange)> = self
            .by_addr
            .starting_in(first, hi)
            .filter(|(a, r)| a + r.len > lo)
            .collect();
        for (a, r) in hits {
            if r.tag == tag {
                continue;
            }
            self.index_remove(a);
            let (s, e) = (a.max(lo), (a + r.len).min(hi));
            self.insert_free(a, s - a, r.tag);
            self.insert_free(e, a + r.len - e, r.tag);
            self.insert_free(s, e - s, tag);
        }
    }

    /// In segment mode, adds a segment that fits `len` at `align`; in VMM
    /// mode the reservation is exhausted.
    fn grow_segments(&mut self, len: u64, align: u64) -> Result<(u64, u64)> {
        let Physical::Segments { .. } = self.phys else {
            return Err(Error::DeviceOutOfMemory {
                device: self.dev,
                requested: len,
                used: self.reserved,
                capacity: self.reserved,
            });
        };
        // PyTorch's segment sizes: small requests share 20 MiB segments.
        let want = if len < (10 << 20) { 20 << 20 } else { len };
        let seg_len = align_up(want + if align > ALIGN { align } else { 0 }, self.gran);
        // Under a memory limit, a small request's segment shrinks to fit.
        let seg_len = self.limit.fit_segment(
            self.reserved,
            seg_len,
            align_up(len + align, self.gran),
            self.gran,
        );
        self.limit.admit(self.dev, self.reserved, seg_len)?;
        let base = self.backend.alloc_segment(self.dev, seg_len)?.addr();
        tracing::debug!(device = self.dev, bytes = seg_len, "segment allocated");
        self.device_allocs += 1;
        self.reserved += seg_len;
        if let Physical::Segments { segs } = &mut self.phys {
            segs.insert(base, seg_len);
        }
        self.index_insert(
            base,
            FreeRange {
                len: seg_len,
                tag: Tag::Clean,
            },
        );
        Ok((seg_len, base))
    }

    /// Makes `[start, start+len)` backed: maps a chunk under every granule
    /// that has none. Chunks come from the spare list, from idle granules
    /// (stolen), and only then from the device. All device allocations are
    /// made before anything is stolen, so a shortfall fails cleanly.
    /// Returns the lowest and the highest granule backed by an aliased
    /// chunk (see [`Heap::steal_aliased_run`]), if any.
    fn back(&mut self, start: u64, len: u64, ctx: StealCtx) -> Result<Option<(u32, u32)>> {
        if !matches!(self.phys, Physical::Vmm { .. }) {
            return Ok(None);
        }
        self.count_users(start, len, true);
        // Mask compares, no count: most takes are of backed places, and
        // the runs below give the count of the others.
        if self.fully_backed(start, len) {
            return Ok(None);
        }
        let Physical::Vmm { base, mapped, .. } = &self.phys else {
            unreachable!("VMM checked above")
        };
        let (first, last, _) = granule_span(*base, self.gran, start, len);
        // The unbacked granules as runs `(first, count)`, ascending, read
        // off the mapped set a word at a time. Their granules in order are
        // "the needed granules": position `p` of that order gets chunk
        // `p`. (Stealing below takes idle granules only, never these.)
        let mut runs: smallvec::SmallVec<[(u32, u32); 8]> = smallvec::SmallVec::new();
        let mut g = first;
        while g <= last {
            g += mapped.run_len(g, last + 1);
            if g > last {
                break;
            }
            let n = mapped.gap_len(g, last + 1);
            runs.push((g, n));
            g += n;
        }
        let need_len: usize = runs.iter().map(|r| r.1 as usize).sum();
        debug_assert_eq!(need_len as u64, self.unbacked(start, len));
        let mut victims = self.stealable(ctx, need_len.saturating_sub(self.spare_len()));
        let reusable = self.spare_len() + victims.iter().map(|v| v.1 as usize).sum::<usize>();
        let shortfall = need_len.saturating_sub(reusable);
        if let Err(e) = self
            .limit
            .admit(self.dev, self.reserved, shortfall as u64 * self.gran)
        {
            self.drop_users(start, len);
            return Err(e);
        }
        let mut created = Vec::with_capacity(shortfall);
        for _ in 0..shortfall {
            match self.backend.create_chunk(self.dev, self.gran) {
                Ok(c) => created.push(c),
                Err(e) => {
                    for c in created {
                        let _ = self.backend.release_chunk(self.dev, c);
                    }
                    self.drop_users(start, len);
                    return Err(e);
                }
            }
        }
        self.device_allocs += created.len() as u64;
        self.reserved += created.len() as u64 * self.gran;
        if !created.is_empty() {
            tracing::debug!(
                device = self.dev,
                chunks = created.len(),
                reserved = self.reserved,
                "device memory grown"
            );
        }
        if let Physical::Vmm { spare, .. } = &mut self.phys {
            spare.extend(created);
        }
        // Spare chunks and device allocations now cover all but the victims'
        // share; steal that share in runs of adjacent granules.
        let mut keep = need_len.saturating_sub(self.spare_len());
        victims.retain_mut(|v| {
            v.1 = v.1.min(keep as u32);
            keep -= v.1 as usize;
            v.1 > 0
        });
        let mut steals = Steals {
            stolen: Vec::with_capacity(victims.iter().map(|v| v.1 as usize).sum()),
            covers: Vec::new(),
        };
        if let Err(e) = self.steal_all(&victims, &mut steals) {
            self.unsteal_all(steals);
            self.drop_users(start, len);
            return Err(e);
        }
        // Every needed granule's chunk, in order: the spare chunks first
        // (as `take_spare` pops them), then the stolen ones, last stolen
        // first. Stealing took exactly the rest, so one vector serves
        // every run as a slice.
        let from_spare = self.spare_len().min(need_len);
        let mut chunks = Vec::with_capacity(need_len);
        chunks.extend((0..from_spare).map_while(|_| self.take_spare()));
        chunks.extend(steals.stolen.iter().rev().map(|st| st.chunk));
        debug_assert_eq!(chunks.len(), need_len, "counted as stealable above");
        // Consecutive granules are mapped as one run: one access grant each.
        let mut i = 0;
        for (k, &(g0, n)) in runs.iter().enumerate() {
            let n = n as usize;
            if let Err(e) = self.map_run_at(g0, &chunks[i..i + n]) {
                // All or nothing: the runs this call already mapped are
                // unmapped again (no work ever saw their addresses), so an
                // aliased chunk never stays under a new address that could
                // go back to the free ranges while its old uses run. Then
                // every chunk goes back where it came from: spare ones to
                // the spare list (in the order they were popped from it),
                // stolen ones to their granules (an aliased one to its old
                // mapping, which it never left), and the chunks created for
                // this call to the device.
                let kept = self.unmap_fresh_runs(&runs[..k]);
                if kept > 0 {
                    // A driver that maps but cannot unmap: the chunks stay
                    // where they are, mapped (a leak, never an alias).
                    tracing::error!(
                        device = self.dev,
                        granules = kept,
                        "rolling back a stitch: unmap failed; granules stay mapped"
                    );
                    self.drop_users(start, len);
                    return Err(e);
                }
                for &c in chunks[..from_spare].iter().rev() {
                    self.push_spare(c);
                }
                self.unsteal_all(steals);
                for _ in 0..shortfall {
                    match self.take_spare() {
                        Some(c) => self.release_chunk(c),
                        None => break,
                    }
                }
                self.drop_users(start, len);
                return Err(e);
            }
            i += n;
        }
        // Stolen chunk `k` backs needed granule `from_spare +
        // stolen.len() - 1 - k` (last stolen first): the lowest aliased
        // granule is that of the last aliased steal, the highest that of
        // the first.
        let stolen = &steals.stolen;
        let granule_of = |k: usize| {
            let mut p = from_spare + stolen.len() - 1 - k;
            for &(g0, n) in &runs {
                if p < n as usize {
                    return g0 + p as u32;
                }
                p -= n as usize;
            }
            unreachable!("a needed granule lies in a run")
        };
        let is_aliased = |st: &Stolen| st.run.is_some();
        Ok(stolen.iter().rposition(is_aliased).map(|lo| {
            let hi = stolen.iter().position(is_aliased).expect("one is aliased");
            (granule_of(lo), granule_of(hi))
        }))
    }

    /// Steals the chunks of `victims` (runs of idle granules in
    /// ascending order, each with its steal kind, as from
    /// [`Heap::stealable`]). Stops at the first clean granule that cannot
    /// be unmapped.
    fn steal_all(&mut self, victims: &[(u32, u32, bool)], out: &mut Steals) -> Result<()> {
        for &(g0, n, clean) in victims {
            if clean {
                for g in g0..g0 + n {
                    let Some(chunk) = self.unmap_granule(g) else {
                        return Err(Error::backend(
                            "cuMemUnmap",
                            "could not unmap an idle granule to stitch it",
                        ));
                    };
                    out.stolen.push(Stolen {
                        g,
                        chunk,
                        run: None,
                    });
                }
            } else {
                self.steal_aliased_run(g0, n, out);
            }
        }
        Ok(())
    }

    fn spare_len(&self) -> usize {
        match &self.phys {
            Physical::Vmm { spare, .. } => spare.len(),
            Physical::Segments { .. } => 0,
        }
    }

    fn push_spare(&mut self, c: ChunkHandle) {
        if let Physical::Vmm { spare, .. } = &mut self.phys {
            spare.push(c);
        }
    }

    /// Undoes [`Heap::back`]'s count of users for `[start, start + len)`:
    /// granules left with no user that hold memory become idle.
    fn drop_users(&mut self, start: u64, len: u64) {
        self.count_users(start, len, false);
    }

    /// Counts `[start, start + len)` as a user of its granules (`add`) or
    /// no longer (`!add`), keeping the idle set exact: a granule is idle
    /// while it holds memory and no allocated range overlaps it. Shared
    /// granules (at most the first and the last) count their users; the
    /// ones the range covers whole change a word of the set at a time.
    #[inline(always)]
    fn count_users(&mut self, start: u64, len: u64, add: bool) {
        let Physical::Vmm {
            base,
            granules,
            idle,
            mapped,
            ..
        } = &mut self.phys
        else {
            return;
        };
        let (first, last, whole) = granule_span(*base, self.gran, start, len);
        for g in shared_granules(first, last, whole).into_iter().flatten() {
            let gr = &mut granules[g as usize];
            if add {
                gr.users += 1;
                if gr.users == 1 {
                    idle.remove(g);
                }
            } else {
                gr.users -= 1;
                if gr.users == 0 && gr.chunk.is_some() {
                    idle.insert(g);
                }
            }
        }
        if whole.0 < whole.1 {
            if add {
                idle.remove_range(whole.0, whole.1);
            } else {
                idle.insert_range_of(whole.0, whole.1, mapped);
            }
        }
    }

    /// Maps `chunks` under granules `g0..`, all or nothing.
    fn map_run_at(&mut self, g0: u32, chunks: &[ChunkHandle]) -> Result<()> {
        let Physical::Vmm {
            base,
            granules,
            mapped,
            ..
        } = &mut self.phys
        else {
            unreachable!("VMM only")
        };
        let va = DevicePtr(*base + g0 as u64 * self.gran);
        self.backend.map_run(self.dev, va, self.gran, chunks)?;
        // Access is per mapping: peers get it on every new one.
        if !self.peers.is_empty() {
            let bytes = chunks.len() as u64 * self.gran;
            if let Err(e) = self.backend.set_access(self.dev, va, bytes, &self.peers) {
                let _ = self
                    .backend
                    .unmap_run(self.dev, va, self.gran, chunks.len() as u64);
                return Err(e);
            }
        }
        for (k, &c) in chunks.iter().enumerate() {
            granules[g0 as usize + k].chunk = Some(c);
        }
        mapped.insert_range(g0, g0 + chunks.len() as u32);
        Ok(())
    }

    /// Unmaps runs of granules that the current stitch mapped and clears
    /// their chunks (the caller puts those back). Returns the granules
    /// that could not be unmapped (left mapped, chunks kept).
    fn unmap_fresh_runs(&mut self, runs: &[(u32, u32)]) -> u32 {
        let mut kept = 0;
        for &(g0, n) in runs {
            let Physical::Vmm {
                base,
                granules,
                mapped,
                ..
            } = &mut self.phys
            else {
                return 0;
            };
            let va = DevicePtr(*base + g0 as u64 * self.gran);
            if self
                .backend
                .unmap_run(self.dev, va, self.gran, n as u64)
                .is_err()
            {
                kept += n;
                continue;
            }
            for g in g0..g0 + n {
                granules[g as usize].chunk = None;
            }
            mapped.remove_range(g0, g0 + n);
        }
        kept
    }

    fn take_spare(&mut self) -> Option<ChunkHandle> {
        match &mut self.phys {
            Physical::Vmm { spare, .. } => spare.pop(),
            Physical::Segments { .. } => None,
        }
    }

    /// The free ranges covering granule `g`: `(addr, len, tag)`, or `None`
    /// if part of it is not free.
    fn granule_cover(&self, g: u32) -> Option<Cover> {
        let Physical::Vmm { base, .. } = &self.phys else {
            return None;
        };
        self.cover(
            *base + g as u64 * self.gran,
            *base + (g as u64 + 1) * self.gran,
        )
    }

    /// The free ranges covering `[gs, ge)` in address order, or `None` if
    /// part of it is not free.
    fn cover(&self, gs: u64, ge: u64) -> Option<Cover> {
        let mut out = Cover::new();
        let (a, r) = self.by_addr.at_or_before(gs)?;
        if a + r.len <= gs {
            return None;
        }
        out.push((a, r.len, r.tag));
        let mut cursor = a + r.len;
        while cursor < ge {
            let r = self.by_addr.get(cursor)?;
            out.push((cursor, r.len, r.tag));
            cursor += r.len;
        }
        Some(out)
    }

    /// Whether granule `g` lies wholly inside clean free memory.
    fn granule_is_clean(&self, g: u32) -> bool {
        self.granule_cover(g)
            .is_some_and(|c| c.iter().all(|p| p.2 == Tag::Clean))
    }

    /// How an idle granule covered by free ranges of `tags` can be stolen
    /// under `ctx`: `Some(true)` clean (unmap now), `Some(false)` by
    /// aliasing (free for `ctx.slot` after waiting), `None` not at all.
    fn kind_of(&self, tags: impl Iterator<Item = Tag> + Clone, ctx: StealCtx) -> Option<bool> {
        if tags.clone().all(|t| t == Tag::Clean) {
            return Some(true);
        }
        let ok = tags.into_iter().all(|t| match t {
            Tag::Clean => true,
            Tag::Dirty(s) => Some(s) == ctx.slot,
            Tag::Pending(id) => ctx.pending_ok && !self.blocked.contains(&id),
        });
        // Aliasing leaves the rest of the granule to the requesting stream
        // alone, which needs a stream slot to express.
        (ok && ctx.slot.is_some()).then_some(false)
    }

    /// Up to `want` idle granules stealable under `ctx`, ascending, as
    /// runs `(first, count, clean)` of adjacent granules of one kind.
    /// Idle granules mostly come in runs inside one long free range (a
    /// freed large block): the granules wholly inside the range that
    /// covered the previous one take its kind without a lookup, a word of
    /// the idle set at a time.
    fn stealable(&self, ctx: StealCtx, want: usize) -> Vec<(u32, u32, bool)> {
        let Physical::Vmm { idle, base, .. } = &self.phys else {
            return Vec::new();
        };
        let mut out: Vec<(u32, u32, bool)> = Vec::new();
        let mut found = 0usize;
        // The last range of the previous cover: (start, end, kind alone).
        let mut last: Option<(u64, u64, Option<bool>)> = None;
        let mut next = 0u64;
        while found < want {
            let Some(g) = idle.first_at_or_after(next) else {
                break;
            };
            let g = g as u32;
            let (gs, ge) = (
                *base + g as u64 * self.gran,
                *base + (g as u64 + 1) * self.gran,
            );
            let (kind, n) = match last {
                Some((a, e, k)) if a <= gs && ge <= e => {
                    // This granule and the idle ones right after it that
                    // still lie wholly inside that range.
                    let end = ((e - *base) / self.gran) as u32;
                    (k, idle.run_len(g, end).max(1))
                }
                _ => match self.granule_cover(g) {
                    Some(cover) => {
                        let &(a, l, t) = cover.last().expect("a cover is never empty");
                        last = Some((a, a + l, self.kind_of(std::iter::once(t), ctx)));
                        (self.kind_of(cover.iter().map(|p| p.2), ctx), 1)
                    }
                    None => (None, 1),
                },
            };
            next = g as u64 + n as u64;
            let Some(k) = kind else {
                continue;
            };
            let n = n.min((want - found) as u32);
            found += n as usize;
            match out.last_mut() {
                Some((g0, m, c)) if *c == k && *g0 + *m == g => *m += n,
                _ => out.push((g, n, k)),
            }
        }
        out
    }

    /// Takes the chunks of idle granules `g0..g0+n` for new mappings
    /// (stitching) while their last uses may still run (dirty on the
    /// requesting stream, or pending): each granule keeps its old mapping,
    /// so that work can finish; its address range is quarantined until an
    /// event recorded on the requesting stream completes, then unmapped
    /// ([`Heap::release_quarantine`]). The requesting stream's new work is
    /// ordered after the old uses (same stream, or a wait on the pending
    /// groups, queued for [`Heap::take_steal_waits`]), so the aliased bytes
    /// are never used twice at once. The free ranges covering the run are
    /// cut once for the whole run, not once per granule: stitching a large
    /// block usually steals a few long runs.
    fn steal_aliased_run(&mut self, g0: u32, n: u32, out: &mut Steals) {
        let Physical::Vmm { base, .. } = &self.phys else {
            unreachable!("VMM only")
        };
        let (rs, re) = (
            *base + g0 as u64 * self.gran,
            *base + (g0 + n) as u64 * self.gran,
        );
        let cover = self.cover(rs, re).expect("idle granules are free");
        for &(a, l, tag) in &cover {
            self.index_remove(a);
            if let Tag::Pending(id) = tag {
                self.fresh_waits.push(id);
            }
            self.insert_free(a, rs.saturating_sub(a), tag);
            if a + l > re {
                self.insert_free(re, a + l - re, tag);
            }
        }
        let Physical::Vmm {
            granules,
            idle,
            quarantine,
            mapped,
            ..
        } = &mut self.phys
        else {
            unreachable!()
        };
        let run = Some(out.covers.len() as u32);
        out.covers.push(cover);
        mapped.remove_range(g0, g0 + n);
        idle.remove_range(g0, g0 + n);
        quarantine.insert_range(g0, g0 + n);
        push_run(&mut self.fresh_quarantine, g0, n);
        for g in g0..g0 + n {
            let gr = &mut granules[g as usize];
            let chunk = gr.chunk.take().expect("idle granules are mapped");
            gr.alias = Some(chunk);
            *self.aliases.entry(chunk).or_default() += 1;
            out.stolen.push(Stolen { g, chunk, run });
        }
    }

    /// Undoes every steal of `steals` whose chunk was not mapped.
    fn unsteal_all(&mut self, steals: Steals) {
        for st in steals.stolen {
            self.unsteal(st, &steals.covers);
        }
    }

    /// Undoes a steal whose chunk could not be mapped.
    fn unsteal(&mut self, st: Stolen, covers: &[Cover]) {
        let Some(run) = st.run else {
            // A clean steal: the old mapping is gone; keep the chunk spare.
            self.push_spare(st.chunk);
            return;
        };
        let Physical::Vmm {
            base,
            granules,
            idle,
            quarantine,
            mapped,
            ..
        } = &mut self.phys
        else {
            return;
        };
        granules[st.g as usize].chunk = Some(st.chunk);
        granules[st.g as usize].alias = None;
        match self.aliases.get_mut(&st.chunk) {
            Some(n) if *n > 1 => *n -= 1,
            _ => {
                self.aliases.remove(&st.chunk);
            }
        }
        mapped.insert(st.g);
        idle.insert(st.g);
        quarantine.remove(st.g);
        // Out of its quarantine run, which may split in two.
        if let Some(k) = self
            .fresh_quarantine
            .iter()
            .position(|&(s, n)| s <= st.g && st.g < s + n)
        {
            let (s, n) = self.fresh_quarantine[k];
            let (before, after) = (st.g - s, s + n - st.g - 1);
            match (before, after) {
                (0, 0) => {
                    self.fresh_quarantine.remove(k);
                }
                (0, _) => self.fresh_quarantine[k] = (st.g + 1, after),
                (_, 0) => self.fresh_quarantine[k] = (s, before),
                _ => {
                    self.fresh_quarantine[k] = (s, before);
                    self.fresh_quarantine.insert(k + 1, (st.g + 1, after));
                }
            }
        }
        // The granule's free pieces: its run's cover, clipped to it.
        let gs = *base + st.g as u64 * self.gran;
        let ge = gs + self.gran;
        for &(a, l, tag) in &covers[run as usize] {
            let (ps, pe) = (a.max(gs), (a + l).min(ge));
            if ps < pe {
                self.insert_free(ps, pe - ps, tag);
            }
        }
    }

    /// Sets the pending groups that may not be handed over or stitched
    /// (see the `blocked` field).
    pub(crate) fn set_blocked(&mut self, ids: impl IntoIterator<Item = u32>) {
        self.blocked.clear();
        self.blocked.extend(ids);
    }

    /// Pending groups aliased since the last call (whether or not the
    /// allocation then succeeded): the requesting stream must wait on them
    /// before the quarantine event is recorded.
    pub(crate) fn take_steal_waits(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.fresh_waits)
    }

    /// Granules aliased since the last call; the caller records one event
    /// on the requesting stream and releases them when it completes.
    pub(crate) fn take_quarantine(&mut self) -> GranuleRuns {
        std::mem::take(&mut self.fresh_quarantine)
    }

    /// Unmaps quarantined granules (runs, as from
    /// [`Heap::take_quarantine`]) whose old uses completed and frees their
    /// addresses (clean, with no physical memory behind them).
    /// Adjacent granules become free as one range (one index update per
    /// run, not per granule).
    pub(crate) fn release_quarantine(&mut self, runs: &[(u32, u32)]) {
        let Physical::Vmm { base, .. } = &self.phys else {
            return;
        };
        let base = *base;
        // Stitching quarantines granules in ascending order, so the runs
        // are nearly always sorted already: copy and sort only if not.
        let mut copy = Vec::new();
        let sorted = if runs.is_sorted() {
            runs
        } else {
            copy.extend_from_slice(runs);
            copy.sort_unstable();
            &copy[..]
        };
        let mut k = 0;
        while k < sorted.len() {
            // Adjacent runs are released as one.
            let (g0, mut n) = sorted[k];
            k += 1;
            while k < sorted.len() && sorted[k].0 == g0 + n {
                n += sorted[k].1;
                k += 1;
            }
            let mut chunks = Vec::with_capacity(n as usize);
            if let Physical::Vmm {
                quarantine,
                granules,
                ..
            } = &mut self.phys
            {
                quarantine.remove_range(g0, g0 + n);
                chunks.extend((g0..g0 + n).filter_map(|g| granules[g as usize].alias.take()));
            }
            let va = base + g0 as u64 * self.gran;
            if let Err(e) = self
                .backend
                .unmap_run(self.dev, DevicePtr(va), self.gran, n as u64)
            {
                tracing::error!(
                    device = self.dev,
                    "unmap of quarantined granules failed: {e}"
                );
            }
            // Chunks given back meanwhile are free once this was their last
            // old mapping.
            for c in chunks {
                let last = match self.aliases.get_mut(&c) {
                    Some(k) if *k > 1 => {
                        *k -= 1;
                        false
                    }
                    _ => {
                        self.aliases.remove(&c);
                        true
                    }
                };
                if last && self.deferred.remove(&c) {
                    self.release_chunk(c);
                }
            }
            self.insert_free(va, n as u64 * self.gran, Tag::Clean);
        }
    }

    /// Grants `peers` access to every mapped granule, and to every granule
    /// mapped from now on. VMM mode only (segments need
    /// `cuCtxEnablePeerAccess`, which the backend seam does not offer):
    /// `Unsupported` otherwise. On an error the earlier peer set stays.
    pub(crate) fn set_peers(&mut self, peers: &[usize]) -> Result<()> {
        let Physical::Vmm { base, granules, .. } = &self.phys else {
            return Err(Error::Unsupported(
                "peer access to plain segments (no VMM)".into(),
            ));
        };
        // One grant per run of mapped granules: access is set per address
        // range, and one call may span every mapping in it.
        let mut g = 0;
        while g < granules.len() {
            if granules[g].chunk.is_none() {
                g += 1;
                continue;
            }
            let start = g;
            while g < granules.len() && granules[g].chunk.is_some() {
                g += 1;
            }
            let va = *base + start as u64 * self.gran;
            let bytes = (g - start) as u64 * self.gran;
            self.backend
                .set_access(self.dev, DevicePtr(va), bytes, peers)?;
        }
        self.peers = peers.to_vec();
        Ok(())
    }

    /// Unmaps an idle granule and returns its chunk.
    fn unmap_granule(&mut self, g: u32) -> Option<ChunkHandle> {
        let Physical::Vmm {
            base,
            granules,
            idle,
            mapped,
            ..
        } = &mut self.phys
        else {
            return None;
        };
        let va = *base + g as u64 * self.gran;
        let chunk = granules[g as usize].chunk?;
        if let Err(e) = self.backend.unmap(self.dev, DevicePtr(va), self.gran) {
            tracing::warn!(device = self.dev, "unmap of an idle granule failed: {e}");
            return None;
        }
        granules[g as usize].chunk = None;
        mapped.remove(g);
        idle.remove(g);
        Some(chunk)
    }

    fn unmap_granule_to_spare(&mut self, g: u32) {
        if let Some(c) = self.unmap_granule(g) {
            self.push_spare(c);
        }
    }

    // ---- freeing and tags -----------------------------------------------------------

    /// The length of the allocated range at `addr`, if any.
    pub(crate) fn allocated_len(&self, addr: u64) -> Option<u64> {
        self.allocated.get(&addr).map(|a| a.len)
    }

    /// Sets the owner word of the allocated range at `addr`, soon: the
    /// write waits in a short log, made with the others when the log
    /// fills, before any range leaves the map and before any word is read.
    ///
    /// A parked range taken back (the pool's usual reuse) was freed at
    /// random some time ago, so its map entry is cold: written at once,
    /// its misses (1.5 L2-sized misses per reuse in RMM's
    /// random_allocations at 10^5) held up the allocation, and the
    /// heap lock's release waited on them. Made in a pass, one after the
    /// other, independent lookups overlap (see `free_many`).
    #[inline]
    pub(crate) fn set_owner(&mut self, addr: u64, owner: u64) {
        debug_assert!(
            self.allocated.contains_key(&addr),
            "no allocated range at {addr:#x}"
        );
        self.owner_log.push((addr, owner));
        if self.owner_log.len() >= OWNER_LOG {
            self.apply_owners();
        }
    }

    /// Sets the owner word of a range taken in this same critical section
    /// at once (its entry was just written, so it is in cache; no log entry
    /// can name it: none names a range that was not allocated).
    #[inline]
    pub(crate) fn set_taken_owner(&mut self, addr: u64, owner: u64) {
        debug_assert!(
            !self.owner_log.iter().any(|e| e.0 == addr),
            "range {addr:#x} has a logged owner write"
        );
        Self::write_owner(&mut self.allocated, addr, owner);
    }

    /// Makes the logged owner-word writes, oldest first.
    fn apply_owners(&mut self) {
        for (addr, owner) in self.owner_log.drain(..) {
            Self::write_owner(&mut self.allocated, addr, owner);
        }
    }

    /// Writes the owner word of allocated range `addr` in `allocated`.
    #[inline]
    fn write_owner(allocated: &mut FxHashMap<u64, Allocated>, addr: u64, owner: u64) {
        let a = allocated.get_mut(&addr);
        debug_assert!(a.is_some(), "no allocated range at {addr:#x}");
        if let Some(a) = a {
            a.owner = owner;
        }
    }

    /// The length and owner word of the allocated range at `addr`.
    pub(crate) fn allocated_at(&mut self, addr: u64) -> Option<(u64, u64)> {
        self.apply_owners();
        self.allocated.get(&addr).map(|a| (a.len, a.owner))
    }

    /// Allocated ranges with a non-zero owner word: `(addr, len, owner)`.
    pub(crate) fn owned(&mut self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.apply_owners();
        self.allocated
            .iter()
            .filter(|(_, a)| a.owner != 0)
            .map(|(&addr, a)| (addr, a.len, a.owner))
    }

    /// Whether `addr` lies in free memory of the heap.
    pub(crate) fn is_free(&self, addr: u64) -> bool {
        matches!(self.by_addr.at_or_before(addr), Some((a, r)) if addr < a + r.len)
    }

    /// Returns an allocated range with `tag`.
    pub(crate) fn free(&mut self, addr: u64, tag: Tag) -> Result<u64> {
        self.apply_owners();
        let len = self
            .allocated
            .remove(&addr)
            .map(|a| a.len)
            .ok_or(Error::UnknownPointer {
                ptr: addr,
                device: self.dev,
            })?;
        self.allocated_bytes -= len;
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
        self.apply_owners();
        let mut lens = Vec::with_capacity(addrs.len());
        for &addr in addrs {
            let len = self
                .allocated
                .remove(&addr)
                .expect("range is allocated")
                .len;
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

    /// A new, empty pending group id (for ranges freed with `record_stream`).
    pub(crate) fn new_pending_group(&mut self) -> u32 {
        let id = self.next_pending;
        self.next_pending = self.next_pending.wrapping_add(1);
        id
    }

    /// Marks every range of pending group `id` clean (its events completed).
    pub(crate) fn complete_pending(&mut self, id: u32) {
        let Some(set) = self.by_tag.remove(&Tag::Pending(id)) else {
            return;
        };
        for (_, addr) in set.iter() {
            let r = self.by_addr.remove(addr).expect("indexed");
            self.insert_free(addr, r.len, Tag::Clean);
        }
    }

    // ---- giving memory back ------------------------------------------------------------

    /// Releases every unmapped spare chunk, every idle clean granule and
    /// (segment mode) every wholly free clean segment to the device. Returns
    /// the bytes released.
    pub(crate) fn release_cached(&mut self) -> u64 {
        let before = self.reserved;
        match &self.phys {
            Physical::Vmm { idle, .. } => {
                let idle: Vec<u32> = idle.iter().collect();
                for g in idle {
                    if self.granule_is_clean(g) {
                        self.unmap_granule_to_spare(g);
                    }
                }
                let spare = match &mut self.phys {
                    Physical::Vmm { spare, .. } => std::mem::take(spare),
                    Physical::Segments { .. } => unreachable!(),
                };
                for c in spare {
                    self.release_chunk(c);
                }
            }
            Physical::Segments { segs } => {
                let free: Vec<(u64, u64)> = segs
                    .iter()
                    .filter(|(b, l)| matches!(self.by_addr.get(**b), Some(r) if r.tag == Tag::Clean && r.len == **l))
                    .map(|(b, l)| (*b, *l))
                    .collect();
                for (b, l) in free {
                    if let Err(e) = self.backend.free_segment(self.dev, DevicePtr(b)) {
                        tracing::warn!(device = self.dev, "cuMemFree failed: {e}");
                        continue;
                    }
                    self.index_remove(b);
                    if let Physical::Segments { segs } = &mut self.phys {
                        segs.remove(&b);
                    }
                    self.reserved -= l;
                    self.device_frees += 1;
                }
            }
        }
        if before != self.reserved {
            tracing::debug!(
                device = self.dev,
                released = before - self.reserved,
                "cached memory released"
            );
        }
        before - self.reserved
    }

    /// Gives one unmapped chunk back to the device. A chunk the driver
    /// refuses stays held, on the spare list (it is still counted in
    /// `reserved`), with a warning.
    fn release_chunk(&mut self, c: ChunkHandle) {
        if self.aliases.contains_key(&c) {
            // Still mapped at a quarantined address: the device frees it
            // only when that goes (`release_quarantine`), so it stays held.
            self.deferred.insert(c);
            return;
        }
        match self.backend.release_chunk(self.dev, c) {
            Ok(()) => {
                self.reserved -= self.gran;
                self.device_frees += 1;
            }
            Err(e) => {
                tracing::warn!(device = self.dev, "cuMemRelease failed: {e}");
                self.push_spare(c);
            }
        }
    }

    /// Releases to the device the physical memory of idle, clean granules
    /// lying wholly inside `[lo, hi)` (the rest of the cache stays).
    /// Returns the bytes released.
    pub(crate) fn release_range(&mut self, lo: u64, hi: u64) -> u64 {
        let Physical::Vmm { base, idle, .. } = &self.phys else {
            return 0;
        };
        let first = (lo.saturating_sub(*base)).div_ceil(self.gran) as u32;
        let end = (hi.saturating_sub(*base) / self.gran) as u32;
        let gs: Vec<u32> = idle.range(first, end).collect();
        let before = self.reserved;
        for g in gs {
            if !self.granule_is_clean(g) {
                continue;
            }
            if let Some(c) = self.unmap_granule(g) {
                self.release_chunk(c);
            }
        }
        before - self.reserved
    }

    /// The largest request that can be served without new device memory:
    /// the longest run of free, backed memory (not pending), or a free range
    /// backed by stitching spare and idle chunks, whichever is larger.
    pub(crate) fn largest_free(&self) -> u64 {
        let mut best = 0;
        let mut longest_range = 0;
        for (a, r) in self.by_addr.iter() {
            if matches!(r.tag, Tag::Pending(_)) {
                continue;
            }
            longest_range = longest_range.max(r.len);
            for (_, l) in self.mapped_parts(a, r.len) {
                best = best.max(l);
            }
        }
        let stitchable = match &self.phys {
            Physical::Vmm { spare, idle, .. } => (spare.len() + idle.len()) as u64 * self.gran,
            Physical::Segments { .. } => 0,
        };
        best.max(longest_range.min(stitchable))
    }

    // ---- audit -------------------------------------------------------------------------

    /// Recomputes every figure from the structures (slow; for stats and tests).
    pub(crate) fn figures(&self) -> HeapFigures {
        let mut f = HeapFigures {
            reserved: self.reserved,
            allocated: self.allocated_bytes,
            ..Default::default()
        };
        for (addr, r) in self.by_addr.iter() {
            let mapped = self.mapped_bytes_in(addr, r.len);
            match r.tag {
                Tag::Clean => f.free_clean += mapped,
                Tag::Dirty(_) => f.free_dirty += mapped,
                Tag::Pending(_) => f.free_pending += mapped,
            }
        }
        if let Physical::Vmm { spare, .. } = &self.phys {
            f.spare = spare.len() as u64 * self.gran;
        }
        f.deferred = self.deferred.len() as u64 * self.gran;
        f
    }

    /// Each tag's size index against a recount of the address index: its
    /// ranges and bytes, the unstored ones (under its floor), and every
    /// stored range present there with that tag and length.
    fn check_size_indexes(&self) -> std::result::Result<(), String> {
        let mut recount: FxHashMap<Tag, (usize, u64, usize)> = FxHashMap::default();
        for (_, r) in self.by_addr.iter() {
            let floor = self.by_tag.get(&r.tag).map_or(0, |s| s.floor());
            let e = recount.entry(r.tag).or_default();
            e.0 += 1;
            e.1 += r.len;
            e.2 += (r.len < floor) as usize;
        }
        for (tag, set) in &self.by_tag {
            let (n, bytes, short) = recount.get(tag).copied().unwrap_or_default();
            if (set.len(), set.bytes(), set.unstored()) != (n, bytes, short) {
                return Err(format!(
                    "{tag:?} size index holds {} ranges ({} unstored, {} bytes); \
                     the address index {n} ({short} under the floor, {bytes} bytes)",
                    set.len(),
                    set.unstored(),
                    set.bytes()
                ));
            }
            if matches!(tag, Tag::Pending(_)) && set.floor() > 0 {
                return Err(format!("{tag:?} size index has a floor"));
            }
            for (len, addr) in set.at_least(set.floor()) {
                if self.by_addr.get(addr) != Some(FreeRange { len, tag: *tag }) {
                    return Err(format!(
                        "{tag:?} size index holds {addr:#x}+{len}, not free so"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Bytes of `[addr, addr+len)` that lie in mapped granules.
    fn mapped_bytes_in(&self, addr: u64, len: u64) -> u64 {
        self.mapped_parts(addr, len).iter().map(|p| p.1).sum()
    }

    /// Checks the heap's structural invariants; returns a description of the
    /// first violation.
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        if let Some(&(a, _)) = self
            .owner_log
            .iter()
            .find(|e| !self.allocated.contains_key(&e.0))
        {
            return Err(format!(
                "an owner write is logged for {a:#x}, not allocated"
            ));
        }
        // Free and allocated ranges do not overlap and merge rules hold.
        let mut spans: Vec<(u64, u64, Option<Tag>)> = self
            .by_addr
            .iter()
            .map(|(a, r)| (a, r.len, Some(r.tag)))
            .collect();
        if !self.by_addr.consistent() {
            return Err("address index: start, end and order maps disagree".into());
        }
        spans.extend(self.allocated.iter().map(|(&a, l)| (a, l.len, None)));
        if let Physical::Vmm {
            base, quarantine, ..
        } = &self.phys
        {
            spans.extend(
                quarantine
                    .iter()
                    .map(|g| (base + g as u64 * self.gran, self.gran, None)),
            );
        }
        spans.sort_unstable_by_key(|s| s.0);
        for w in spans.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(format!("ranges overlap at {:#x} and {:#x}", w[0].0, w[1].0));
            }
            if w[0].0 + w[0].1 == w[1].0
                && w[0].2.is_some()
                && w[0].2 == w[1].2
                && self.same_segment(w[0].0, w[1].0)
            {
                return Err(format!(
                    "equal-tag free ranges at {:#x} and {:#x} not merged",
                    w[0].0, w[1].0
                ));
            }
        }
        let tagged: usize = self.by_tag.values().map(|s| s.len()).sum();
        if tagged != self.by_addr.len() {
            return Err(format!(
                "tag index has {tagged} ranges, address index {}",
                self.by_addr.len()
            ));
        }
        self.check_size_indexes()?;
        if self.allocated.values().map(|a| a.len).sum::<u64>() != self.allocated_bytes {
            return Err("allocated byte count drifted".into());
        }
        let f = self.figures();
        let accounted = f.allocated + f.free_clean + f.free_dirty + f.free_pending + f.spare;
        if accounted != f.reserved {
            return Err(format!(
                "reserved {} != allocated + free mapped + spare = {accounted}",
                f.reserved
            ));
        }
        match &self.phys {
            Physical::Vmm {
                base,
                len,
                granules,
                idle,
                mapped,
                ..
            } => {
                if let (Some(first), Some(last)) = (spans.first(), spans.last()) {
                    if first.0 != *base || last.0 + last.1 != base + len {
                        return Err("ranges do not cover the reservation".into());
                    }
                }
                let covered: u64 = spans.iter().map(|s| s.1).sum();
                if covered != *len {
                    return Err(format!("ranges cover {covered} of {len} bytes"));
                }
                for (a, l) in self.allocated.iter().map(|(a, l)| (a, l.len)) {
                    let first = (a - base) / self.gran;
                    let last = (a + l - 1 - base) / self.gran;
                    if (first..=last).any(|g| granules[g as usize].chunk.is_none()) {
                        return Err(format!("allocated range {a:#x} is not fully mapped"));
                    }
                }
                // Users recounted from the allocated ranges: shared
                // granules count them, whole ones are covered by one.
                let mut users = vec![0u32; granules.len()];
                let mut whole = vec![false; granules.len()];
                for (&a, al) in self.allocated.iter() {
                    let (first, last, w) = granule_span(*base, self.gran, a, al.len);
                    for g in shared_granules(first, last, w).into_iter().flatten() {
                        users[g as usize] += 1;
                    }
                    for g in w.0..w.1 {
                        whole[g as usize] = true;
                    }
                }
                for (g, gr) in granules.iter().enumerate() {
                    if gr.users != users[g] || (whole[g] && users[g] != 0) {
                        return Err(format!(
                            "granule {g} counts {} users, the allocated ranges say {}{}",
                            gr.users,
                            users[g],
                            if whole[g] {
                                " (and one covers it whole)"
                            } else {
                                ""
                            }
                        ));
                    }
                    if mapped.contains(g as u32) != gr.chunk.is_some() {
                        return Err(format!("mapped set wrong for granule {g}"));
                    }
                    let is_idle = users[g] == 0 && !whole[g] && gr.chunk.is_some();
                    if is_idle != idle.contains(g as u32) {
                        return Err(format!("idle set wrong for granule {g}"));
                    }
                }
            }
            Physical::Segments { segs } => {
                let total: u64 = segs.values().sum();
                if total != self.reserved {
                    return Err("segment bytes != reserved".into());
                }
            }
        }
        Ok(())
    }

    /// Every allocated range (for snapshots).
    pub(crate) fn allocated_ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.allocated.iter().map(|(&a, l)| (a, l.len))
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

/// One piece of the heap's address space, for snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Piece {
    /// An allocated range (a large block or a slab).
    Allocated,
    /// A free range with its tag.
    Free(Tag),
}

impl Heap {
    /// Every backed piece of the address space in address order, free ranges
    /// clipped to mapped memory, split into runs of adjacent backed memory
    /// (one run per segment in segment mode).
    pub(crate) fn layout(&self) -> Vec<Vec<(u64, u64, Piece)>> {
        let mut items: Vec<(u64, u64, Piece)> = self
            .allocated
            .iter()
            .map(|(&a, l)| (a, l.len, Piece::Allocated))
            .collect();
        for (a, r) in self.by_addr.iter() {
            for (s, l) in self.mapped_parts(a, r.len) {
                items.push((s, l, Piece::Free(r.tag)));
            }
        }
        items.sort_unstable_by_key(|i| i.0);
        let mut runs: Vec<Vec<(u64, u64, Piece)>> = Vec::new();
        for it in items {
            match runs.last_mut() {
                Some(run)
                    if {
                        let last = run.last().expect("runs are non-empty");
                        last.0 + last.1 == it.0 && self.same_segment(last.0, it.0)
                    } =>
                {
                    run.push(it)
                }
                _ => runs.push(vec![it]),
            }
        }
        runs
    }

    /// The parts of `[addr, addr+len)` backed by physical memory.
    fn mapped_parts(&self, addr: u64, len: u64) -> Vec<(u64, u64)> {
        let Physical::Vmm { base, granules, .. } = &self.phys else {
            return vec![(addr, len)];
        };
        let mut out: Vec<(u64, u64)> = Vec::new();
        let end = addr + len;
        let mut g = (addr - base) / self.gran;
        loop {
            let gs = base + g * self.gran;
            if gs >= end {
                break;
            }
            if granules[g as usize].chunk.is_some() {
                let (s, e) = (addr.max(gs), end.min(gs + self.gran));
                match out.last_mut() {
                    Some(last) if last.0 + last.1 == s => last.1 += e - s,
                    _ => out.push((s, e - s)),
                }
            }
            g += 1;
        }
        out
    }
}

impl Heap {
    /// Cached bytes [`Heap::release_cached`] can give back (after the
    /// streams' frees are flushed): idle granules, spare chunks and chunks
    /// waiting on quarantined mappings, or wholly free segments. The rest
    /// of the free memory shares a granule or a segment with allocated
    /// ranges (PyTorch's "inactive split" memory).
    pub(crate) fn releasable_bytes(&self) -> u64 {
        match &self.phys {
            Physical::Vmm { idle, spare, .. } => {
                (idle.len() + spare.len() + self.deferred.len()) as u64 * self.gran
            }
            Physical::Segments { segs } => segs
                .iter()
                .filter(|(b, l)| matches!(self.by_addr.get(**b), Some(r) if r.len == **l))
                .map(|(_, l)| *l)
                .sum(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::sim::{SimBackend, SimConfig};

    const MIB: u64 = 1 << 20;

    /// A stitch whose unbacked granules form two runs, with the second
    /// run's map failing: the first run, already mapped with chunks stolen
    /// by aliasing from another stream's dirty memory, must be unmapped
    /// again and every chunk put back, so that no other stream can take an
    /// aliased chunk under a clean address while its old uses run.
    #[test]
    fn a_failed_second_run_unmaps_the_first_and_puts_every_chunk_back() {
        let sim = Arc::new(
            SimBackend::new(SimConfig {
                devices: 1,
                capacity_bytes: 64 * MIB,
                granularity: 2 * MIB,
                ..Default::default()
            })
            .unwrap(),
        );
        let mut heap = Heap::new(sim.clone(), 0, 256 * MIB, 0).unwrap();
        let (base, _) = heap.reservation().unwrap();
        // Granules 0..6 backed and freed clean; 6..10 dirty on slot 0.
        let x = heap.alloc(12 * MIB, ALIGN, Some(0), false).unwrap();
        let z = heap.alloc(8 * MIB, ALIGN, Some(0), false).unwrap();
        assert_eq!((x.addr, z.addr), (base, base + 12 * MIB));
        heap.free(x.addr, Tag::Clean).unwrap();
        heap.free(z.addr, Tag::Dirty(0)).unwrap();
        // Holes at granules 0..2 and 4..6: two unbacked runs around 2..4.
        assert_eq!(heap.release_range(base, base + 4 * MIB), 4 * MIB);
        assert_eq!(heap.release_range(base + 8 * MIB, base + 12 * MIB), 4 * MIB);
        sim.set_capacity_limit(0, Some(heap.reserved())).unwrap();
        let layout = heap.layout();
        let reserved = heap.reserved();
        // Run one maps two chunks; the third map (run two) fails.
        sim.fail_nth_map(0, 3).unwrap();
        let r = heap.alloc(12 * MIB, ALIGN, Some(0), false);
        assert!(matches!(r, Err(Error::InjectedFault(_))), "{r:?}");
        sim.fail_nth_map(0, 0).unwrap();
        heap.check().unwrap();
        assert_eq!(heap.layout(), layout, "the failed stitch changed the heap");
        assert_eq!(heap.reserved(), reserved);
        assert!(
            heap.take_quarantine().is_empty(),
            "aliased granules left quarantined"
        );
        // Backed memory is where it was: granules 2..4 (clean) and 6..10
        // (dirty on slot 0), nothing under the holes.
        let backed: Vec<(u64, u64)> = layout
            .iter()
            .flatten()
            .map(|&(a, l, _)| (a - base, l))
            .collect();
        assert_eq!(backed, vec![(4 * MIB, 4 * MIB), (12 * MIB, 8 * MIB)]);
        // The retry succeeds.
        let ok = heap.alloc(12 * MIB, ALIGN, Some(0), false).unwrap();
        assert_eq!(ok.addr, base);
        heap.check().unwrap();
    }
}
