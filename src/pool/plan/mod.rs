//! Learned steps: a stream's repeating sequence of large requests served
//! from a placement planned offline, with no heap lock and no driver call.
//!
//! Training loops and servers repeat the same requests every step. The
//! caller marks step boundaries ([`crate::DevicePool::mark_step`]); each
//! stream with a slot then goes through:
//!
//! ```text
//!  Off ──mark──► Recording ──mark──► Following ──mark (step followed)──► Following
//!                   ▲   (plan built,      │
//!                   │    arena allocated) │ mark (step departed from the plan)
//!                   └─────────────────────┘
//! ```
//!
//! *Recording* serves every request dynamically and logs each large
//! request's rounded length and lifetime on the stream's own clock. At the
//! next mark the blocks allocated and freed within the step are placed by
//! [`placement::place_around`] into an *arena*: laid in place over the
//! free memory the stream may take (what the recorded step freed), around
//! the blocks that outlive the step, when that needs fewer granules
//! backed than a fresh range; else one fresh range, allocated from the
//! heap like one large block. Either way the driver calls a new plan
//! needs are made at the mark. *Following* serves the k-th large request of each step at
//! its planned offset when its length is the recorded one; the first
//! request that differs ends following for the rest of the step (the
//! dynamic path serves it and the rest), and the next mark records anew.
//! Blocks that outlive the step are served dynamically in every step.
//!
//! Invariants:
//! 1. An arena is a set of allocated heap ranges, its *pieces* (owner
//!    word 0), that no other block overlaps; a planned block lies within
//!    the pieces, at the arena's origin plus its planned offset. An arena
//!    is named by its first piece's address.
//! 2. Live and fenced sub-ranges of an arena never overlap one another, and
//!    a planned block is handed out only where it overlaps neither (so a
//!    step that frees later than planned gets dynamic memory, not memory
//!    still in use).
//! 3. A sub-range freed on the arena's stream with no other users is
//!    reusable by that stream at once (stream order); freed otherwise, it is
//!    fenced behind events of its users until they complete (queried, never
//!    waited on by the host).
//! 4. An arena returns to the heap only with no live and no fenced
//!    sub-range: as `Dirty(slot)` while its stream lives, as a pending group
//!    behind the stream's last event once the stream retired (an orphan).
//! 5. Lock order: a slot's plan, then the heap. Nothing takes a slot's plan
//!    while holding the heap mutex, and the arena is allocated with no plan
//!    lock held (allocation may reclaim, which visits every plan).

mod placement;

use super::heap::Tag;
use super::pending::{Pending, Waits};
use super::stream::STREAM_SLOTS;
use super::{LargeLive, PoolShared, Stream, StreamCore};
use crossbeam_utils::CachePadded;
use parking_lot::{Mutex, RwLock};
use placement::Life;
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// The index's owner of an arena whose stream retired.
const ORPHAN: u16 = u16::MAX;

/// Recordings longer than this many large requests are dropped (no plan).
const MAX_RECORDED: usize = 1 << 18;

/// Figures of the learned steps of one device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PlanStats {
    /// Plans built (one per stream per recorded step).
    pub plans: u64,
    /// Large requests served from a plan.
    pub served: u64,
    /// Planned requests served dynamically because their planned range
    /// was still in use (a block freed later than in the recorded step).
    pub misses: u64,
    /// Steps that departed from their plan (a request of another length).
    pub departures: u64,
    /// Large requests of marked streams served dynamically (recording,
    /// after a departure, misses, blocks that outlive their step).
    pub dynamic: u64,
    /// Bytes of arenas held now.
    pub arena_bytes: u64,
    /// Bytes of live planned blocks now.
    pub live_bytes: u64,
    /// The last plan's arena length: its ratio to `last_peak_live_bytes`
    /// is the plan's overhead.
    pub last_arena_bytes: u64,
    /// The peak of the live bytes of the last planned step (no placement
    /// needs less).
    pub last_peak_live_bytes: u64,
}

/// The learned-step state of one device.
#[derive(Debug)]
pub(crate) struct Plans {
    /// Set by the first mark: until then no large call looks here.
    on: AtomicBool,
    /// Padded: each stream locks its own on every large request.
    slots: Box<[CachePadded<Mutex<SlotPlan>>]>,
    /// Every arena piece: addr -> (len, owner slot or [`ORPHAN`]), for
    /// frees.
    index: RwLock<BTreeMap<u64, (u64, u16)>>,
    orphans: Mutex<Vec<Arena>>,
    plans: AtomicU64,
    arena_bytes: AtomicU64,
    last_arena: AtomicU64,
    last_peak: AtomicU64,
}

#[derive(Debug, Default)]
struct SlotPlan {
    state: State,
    /// The following arena (named by `Follow::arena`) and retiring ones.
    arenas: Vec<Arena>,
    /// Counted here, under the stream's own lock: no counter is shared
    /// between streams on the large path.
    served: u64,
    misses: u64,
    departures: u64,
    dynamic: u64,
}

#[derive(Debug, Default)]
enum State {
    #[default]
    Off,
    Recording(Recorder),
    Following(Follow),
}

#[derive(Debug, Default)]
struct Recorder {
    lives: Vec<Life>,
    /// Address of a block allocated in the step and not yet freed -> its life.
    open: FxHashMap<u64, u32>,
    clock: u32,
}

#[derive(Debug)]
struct Follow {
    /// This step as it goes: if it departs from the plan, the next mark
    /// plans from it at once (a changed step is learned in one step).
    rec: Recorder,
    lens: Vec<u64>,
    /// Planned offset of each request; `None` for blocks outliving the step.
    offsets: Vec<Option<u64>>,
    next: usize,
    departed: bool,
    /// The arena's name ([`Arena::id`]).
    arena: u64,
}

#[derive(Debug)]
struct Arena {
    /// Its name: the address of its first piece.
    id: u64,
    /// Where planned offsets count from.
    origin: u64,
    /// Its heap ranges `(addr, len)`, by address.
    pieces: Vec<(u64, u64)>,
    /// Bytes of its pieces.
    len: u64,
    live: BTreeMap<u64, Live>,
    /// Sub-ranges freed with other users: `(addr, len, their events)`.
    fenced: Vec<(u64, u64, Waits)>,
    /// Events an orphan's freed memory waits for (its stream's last work).
    tomb: Waits,
    retiring: bool,
    live_bytes: u64,
    fenced_bytes: u64,
}

/// A live planned block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Live {
    pub len: u64,
    pub requested: u64,
    pub raw: bool,
}

/// What the plan says of a large request.
pub(crate) enum Serve {
    /// Served at this address.
    Planned(u64),
    /// Serve it dynamically; `record`: tell [`PoolShared::plan_note_alloc`].
    Dynamic { record: bool },
}

impl Recorder {
    fn note_alloc(&mut self, addr: u64, len: u64) {
        if self.lives.len() >= MAX_RECORDED {
            *self = Recorder::default();
            return;
        }
        self.open.insert(addr, self.lives.len() as u32);
        self.lives.push(Life {
            len,
            start: self.clock,
            end: u32::MAX,
        });
        self.clock += 1;
    }

    fn note_free(&mut self, addr: u64) {
        if let Some(i) = self.open.remove(&addr) {
            self.lives[i as usize].end = self.clock;
            self.clock += 1;
        }
    }

    /// Whether the step has a block to plan (one allocated and freed in it).
    fn has_inner(&self) -> bool {
        self.lives.iter().any(|l| l.end != u32::MAX)
    }
}

impl State {
    /// The recorder of this step, if the stream records or follows.
    fn recorder(&mut self) -> Option<&mut Recorder> {
        match self {
            State::Off => None,
            State::Recording(r) => Some(r),
            State::Following(f) => Some(&mut f.rec),
        }
    }

    /// The recording to plan from at the next mark, if a new plan is due
    /// (recording, or following a step that departed).
    fn plan_due(&self) -> Option<&Recorder> {
        match self {
            State::Recording(r) => Some(r),
            State::Following(f) if f.departed || f.next != f.lens.len() => Some(&f.rec),
            _ => None,
        }
        .filter(|r| r.has_inner())
    }
}

impl Arena {
    fn new(origin: u64, pieces: Vec<(u64, u64)>) -> Arena {
        debug_assert!(!pieces.is_empty() && pieces.windows(2).all(|w| w[0].0 < w[1].0));
        Arena {
            id: pieces[0].0,
            origin,
            len: pieces.iter().map(|p| p.1).sum(),
            pieces,
            live: BTreeMap::new(),
            fenced: Vec::new(),
            tomb: Waits::default(),
            retiring: false,
            live_bytes: 0,
            fenced_bytes: 0,
        }
    }

    fn holds(&self, addr: u64) -> bool {
        let i = self.pieces.partition_point(|p| p.0 <= addr);
        i > 0 && addr < self.pieces[i - 1].0 + self.pieces[i - 1].1
    }

    fn is_empty(&self) -> bool {
        self.live.is_empty() && self.fenced.is_empty()
    }

    /// Whether `[addr, addr + len)` overlaps a live block (live blocks are
    /// disjoint: only the last one starting below the end can reach it).
    fn overlaps_live(&self, addr: u64, len: u64) -> bool {
        self.live
            .range(..addr + len)
            .next_back()
            .is_some_and(|(&a, l)| a + l.len > addr)
    }
}

impl Plans {
    pub(crate) fn new() -> Plans {
        Plans {
            on: AtomicBool::new(false),
            slots: (0..STREAM_SLOTS).map(|_| CachePadded::default()).collect(),
            index: RwLock::new(BTreeMap::new()),
            orphans: Mutex::new(Vec::new()),
            plans: AtomicU64::new(0),
            arena_bytes: AtomicU64::new(0),
            last_arena: AtomicU64::new(0),
            last_peak: AtomicU64::new(0),
        }
    }

    /// Whether any step was marked (one relaxed load on the large path).
    #[inline]
    pub(crate) fn enabled(&self) -> bool {
        self.on.load(Relaxed)
    }

    /// The figures, and the bytes of fenced sub-ranges (freed, waiting on
    /// other streams). Visits every stream's plan (not a fast call).
    pub(crate) fn stats_and_fenced(&self) -> (PlanStats, u64) {
        let mut st = PlanStats {
            plans: self.plans.load(Relaxed),
            arena_bytes: self.arena_bytes.load(Relaxed),
            last_arena_bytes: self.last_arena.load(Relaxed),
            last_peak_live_bytes: self.last_peak.load(Relaxed),
            ..PlanStats::default()
        };
        let mut fenced = 0;
        let mut add = |arenas: &[Arena]| {
            for a in arenas {
                st.live_bytes += a.live_bytes;
                fenced += a.fenced_bytes;
            }
        };
        for slot in self.slots.iter() {
            let p = slot.lock();
            add(&p.arenas);
            st.served += p.served;
            st.misses += p.misses;
            st.departures += p.departures;
            st.dynamic += p.dynamic;
        }
        add(&self.orphans.lock());
        (st, fenced)
    }

    pub(crate) fn stats(&self) -> PlanStats {
        self.stats_and_fenced().0
    }

    /// Bytes of fenced sub-ranges (freed, waiting on other streams).
    pub(crate) fn fenced_bytes(&self) -> u64 {
        if !self.enabled() {
            return 0;
        }
        self.stats_and_fenced().1
    }

    /// The owner of the arena holding `addr`, if any.
    pub(crate) fn owner_of(&self, addr: u64) -> Option<u16> {
        let idx = self.index.read();
        idx.range(..=addr)
            .next_back()
            .filter(|(&b, &(l, _))| addr < b + l)
            .map(|(_, &(_, o))| o)
    }

    /// Whether `addr` lies in an arena (a planned block freed already, or
    /// inside one).
    pub(crate) fn in_arena(&self, addr: u64) -> bool {
        self.owner_of(addr).is_some()
    }
}

impl PoolShared {
    /// The plan's answer for a large request of rounded `len` on `slot`.
    pub(super) fn plan_serve(
        &self,
        stream: &Stream,
        slot: u16,
        len: u64,
        live: LargeLive,
    ) -> Serve {
        let mut guard = self.plans.slots[slot as usize].lock();
        let p = &mut *guard;
        let f = match &mut p.state {
            State::Off => return Serve::Dynamic { record: false },
            State::Recording(_) => {
                p.dynamic += 1;
                return Serve::Dynamic { record: true };
            }
            State::Following(f) => f,
        };
        if f.departed {
            p.dynamic += 1;
            return Serve::Dynamic { record: true };
        }
        let k = f.next;
        f.next += 1;
        if f.lens.get(k) != Some(&len) {
            // The rest of the step is served dynamically: the arena goes
            // back to the heap as soon as it is empty (at once, when the
            // step departs at its first request), so that the dynamic path
            // can use its memory instead of growing beside it.
            f.departed = true;
            let id = f.arena;
            p.departures += 1;
            p.dynamic += 1;
            self.retire_arena(p, slot, id);
            return Serve::Dynamic { record: true };
        }
        let (Some(off), id) = (f.offsets[k], f.arena) else {
            p.dynamic += 1;
            return Serve::Dynamic { record: true };
        };
        let Some(arena) = p.arenas.iter_mut().find(|a| a.id == id) else {
            p.dynamic += 1;
            return Serve::Dynamic { record: true };
        };
        let addr = arena.origin + off;
        if arena.overlaps_live(addr, len) || !self.hand_over_fences(arena, addr, len, stream) {
            p.misses += 1;
            p.dynamic += 1;
            return Serve::Dynamic { record: true };
        }
        arena.live.insert(
            addr,
            Live {
                len,
                requested: live.requested,
                raw: live.raw,
            },
        );
        arena.live_bytes += len;
        p.served += 1;
        if let Some(r) = p.state.recorder() {
            r.note_alloc(addr, len);
        }
        Serve::Planned(addr)
    }

    /// Clears the fences in `[addr, addr + len)` for `stream`: those whose
    /// events completed are lifted; for the others `stream` waits on their
    /// events on the device (a handover, as for pending memory: no host
    /// wait). Returns `false`, leaving the rest in place, if a fence cannot
    /// be handed over (a use with no event, or a failed wait).
    fn hand_over_fences(&self, arena: &mut Arena, addr: u64, len: u64, stream: &Stream) -> bool {
        let mut i = 0;
        while i < arena.fenced.len() {
            let (a, l, w) = &arena.fenced[i];
            if *a < addr + len && addr < a + l {
                if !self.waits_done(w, false, false) && self.wait_on(stream, w).is_err() {
                    return false;
                }
                let (_, l, w) = arena.fenced.swap_remove(i);
                arena.fenced_bytes -= l;
                self.recycle_events(w);
                continue;
            }
            i += 1;
        }
        true
    }

    /// Lifts every fence of `arena` whose events completed.
    fn lift_fences(&self, arena: &mut Arena) {
        let mut i = 0;
        while i < arena.fenced.len() {
            if self.waits_done(&arena.fenced[i].2, false, false) {
                let (_, l, w) = arena.fenced.swap_remove(i);
                arena.fenced_bytes -= l;
                self.recycle_events(w);
                continue;
            }
            i += 1;
        }
    }

    /// Logs a dynamically served large block of a recording stream.
    pub(super) fn plan_note_alloc(&self, slot: u16, addr: u64, len: u64) {
        let mut p = self.plans.slots[slot as usize].lock();
        if let Some(r) = p.state.recorder() {
            r.note_alloc(addr, len);
        }
    }

    /// A large free. Returns `true` when `addr` was a planned block (freed
    /// here); otherwise logs the free for a recording stream and returns
    /// `false` (the caller frees the block).
    pub(super) fn plan_free(&self, addr: u64, stream: &Stream, extra: &[Arc<StreamCore>]) -> bool {
        let Some(owner) = self.plans.owner_of(addr) else {
            if let Some(s) = stream.slot() {
                let mut p = self.plans.slots[s as usize].lock();
                if let Some(r) = p.state.recorder() {
                    r.note_free(addr);
                }
            }
            return false;
        };
        if owner == ORPHAN {
            let mut orphans = self.plans.orphans.lock();
            let i = orphans
                .iter()
                .position(|a| a.holds(addr))
                .expect("the index names only held arenas");
            let arena = &mut orphans[i];
            if let Some(l) = arena.live.remove(&addr) {
                arena.live_bytes -= l.len;
                let w = self.record_events(stream.core(), extra);
                arena.tomb.absorb(w);
            }
            if arena.live.is_empty() {
                let arena = orphans.swap_remove(i);
                drop(orphans);
                self.free_orphan(arena);
            }
            return true;
        }
        let mut p = self.plans.slots[owner as usize].lock();
        if stream.slot() == Some(owner) {
            if let Some(r) = p.state.recorder() {
                r.note_free(addr);
            }
        }
        let i = p
            .arenas
            .iter()
            .position(|a| a.holds(addr))
            .expect("the index names only held arenas");
        let arena = &mut p.arenas[i];
        if let Some(l) = arena.live.remove(&addr) {
            arena.live_bytes -= l.len;
            if stream.slot() != Some(owner) || !extra.is_empty() {
                let w = self.record_events(stream.core(), extra);
                arena.fenced.push((addr, l.len, w));
                arena.fenced_bytes += l.len;
            }
        }
        if arena.retiring {
            self.lift_fences(arena);
            if arena.is_empty() {
                let arena = p.arenas.swap_remove(i);
                self.free_arena(arena, owner);
            }
        }
        true
    }

    /// Marks a step boundary on every stream with a slot (see the module
    /// docs). The arena of a new plan is allocated here: the driver calls a
    /// new plan needs are made at the mark, not in the steps that follow.
    pub(super) fn mark_step(&self) {
        self.plans.on.store(true, Relaxed);
        let live = self.streams.live();
        let plans_due = live.iter().filter_map(Stream::slot).any(|s| {
            self.plans.slots[s as usize]
                .lock()
                .state
                .plan_due()
                .is_some()
        });
        if plans_due {
            // New arenas are due: every stream's freed memory goes to the
            // pending list first (one event per stream), so that each
            // arena can take what any stream freed in the recorded step,
            // by handover, instead of growing the pool beside it.
            self.flush_all_streams();
            self.harvest();
        }
        for s in &live {
            if let Some(slot) = s.slot() {
                self.mark_slot(s, slot);
            }
        }
        drop(live);
    }

    fn mark_slot(&self, stream: &Stream, slot: u16) {
        let rec = {
            let mut p = self.plans.slots[slot as usize].lock();
            let p = &mut *p;
            for a in &mut p.arenas {
                self.lift_fences(a);
            }
            match std::mem::take(&mut p.state) {
                State::Off => {
                    p.state = State::Recording(Recorder::default());
                    return;
                }
                State::Following(mut f) if !f.departed && f.next == f.lens.len() => {
                    f.next = 0;
                    f.rec = Recorder::default();
                    p.state = State::Following(f);
                    return;
                }
                // Departed: plan anew from the step just run.
                State::Following(f) => {
                    self.retire_arena(p, slot, f.arena);
                    f.rec
                }
                State::Recording(r) => r,
            }
        };
        // Only blocks allocated and freed within the step are planned.
        let inner: Vec<(usize, Life)> = rec
            .lives
            .iter()
            .enumerate()
            .filter(|(_, l)| l.end != u32::MAX)
            .map(|(i, l)| (i, *l))
            .collect();
        let record_again = || {
            self.plans.slots[slot as usize].lock().state = State::Recording(Recorder::default());
        };
        if inner.is_empty() {
            return record_again();
        }
        let lives: Vec<Life> = inner.iter().map(|(_, l)| *l).collect();
        let (fresh_offs, total) = placement::place_around(&lives, &[]);
        let (origin, offs, pieces) = match self.arena_in_place(&lives, total, stream, slot) {
            Some(a) => a,
            None => {
                let arena = LargeLive {
                    requested: total,
                    raw: false,
                };
                match self.alloc_large(total, arena, stream) {
                    Ok((base, len)) => (base, fresh_offs, vec![(base, len)]),
                    Err(e) => {
                        tracing::debug!(device = self.dev, "no arena for a learned step: {e}");
                        return record_again();
                    }
                }
            }
        };
        let arena = Arena::new(origin, pieces);
        self.plans.last_arena.store(arena.len, Relaxed);
        self.plans
            .last_peak
            .store(placement::peak_live(&lives), Relaxed);
        let mut offsets = vec![None; rec.lives.len()];
        for ((i, _), off) in inner.iter().zip(offs) {
            offsets[*i] = Some(off);
        }
        {
            let mut index = self.plans.index.write();
            for &(a, l) in &arena.pieces {
                index.insert(a, (l, slot));
            }
        }
        self.plans.arena_bytes.fetch_add(arena.len, Relaxed);
        self.plans.plans.fetch_add(1, Relaxed);
        let id = arena.id;
        let mut p = self.plans.slots[slot as usize].lock();
        p.arenas.push(arena);
        p.state = State::Following(Follow {
            rec: Recorder::default(),
            lens: rec.lives.iter().map(|l| l.len).collect(),
            offsets,
            next: 0,
            departed: false,
            arena: id,
        });
    }

    /// The arena of a new plan for `lives` laid in place: over the free
    /// ranges `slot` may take (from the lowest up to the longest, the
    /// reservation's unused rest), around everything else, as
    /// `(origin, offsets, pieces)` with its pieces allocated. `None`, with
    /// nothing changed, unless it needs fewer granules backed than a fresh
    /// arena of `fresh_len` bytes would (the fresh arena is best when the
    /// step's memory is free in one range already), or when a piece cannot
    /// be backed.
    ///
    /// Why: blocks that live across the mark split what the recorded step
    /// freed into pieces, and a fresh arena then lands above them all and
    /// takes its physical memory from those pieces, one unmap and one map
    /// per granule (on lm-large-forward, 20,553 granules at the first mark).
    fn arena_in_place(
        &self,
        lives: &[Life],
        fresh_len: u64,
        stream: &Stream,
        slot: u16,
    ) -> Option<InPlace> {
        let min_len = lives.iter().map(|l| l.len).min()?;
        let mut h = self.heap.lock();
        if !h.heap.is_vmm() {
            return None;
        }
        // What the step freed is pending behind this stream's own events
        // (the mark flushed every stream): stream order covers it.
        let order = &stream.core().order;
        let own: rustc_hash::FxHashSet<u32> = h
            .group_events
            .iter()
            .filter(|(_, w)| w.ordered_before(order))
            .map(|(&id, _)| id)
            .collect();
        let mut gaps = h.heap.usable_ranges(slot, min_len, |id| own.contains(&id));
        // The longest range (the reservation's unused rest) holds whatever
        // goes above the others; ranges above it are left out.
        let top = (0..gaps.len()).max_by_key(|&i| gaps[i].1)?;
        if gaps[top].1 < fresh_len {
            return None;
        }
        gaps.truncate(top + 1);
        let origin = gaps[0].0;
        let mut fixed = Vec::new();
        let mut at = origin;
        for &(a, l) in &gaps {
            if a > at {
                fixed.push((at - origin, a - origin));
            }
            at = a + l;
        }
        let (offs, _) = placement::place_around(lives, &fixed);
        let (covered, pieces) = footprint(origin, lives, &offs, &gaps);
        // Every planned byte inside the free ranges (a block placed above
        // the topmost one's end would not be).
        if pieces.iter().map(|p| p.1).sum::<u64>() != covered {
            return None;
        }
        let unbacked = |h: &super::HeapState, &(a, l): &(u64, u64)| h.heap.unbacked(a, l);
        let need: u64 = pieces.iter().map(|p| unbacked(&h, p)).sum();
        let fresh = h.heap.unbacked_at_best_fit(fresh_len, slot)?;
        if need >= fresh {
            return None;
        }
        // Backed pieces first: backing the others may take idle granules
        // of free memory, never of a piece already taken.
        let mut order: Vec<(u64, usize)> = pieces
            .iter()
            .enumerate()
            .map(|(i, p)| (unbacked(&h, p), i))
            .collect();
        order.sort_unstable();
        let device_allocs = h.heap.device_allocs;
        let mut taken = Vec::with_capacity(pieces.len());
        let mut failed = false;
        for (_, i) in order {
            let (a, l) = pieces[i];
            let Some(r) = h.heap.alloc_at(a, l, slot, |id| own.contains(&id)) else {
                failed = true;
                break;
            };
            match self.finish_taken(&mut h, r, stream) {
                Ok(_) => taken.push(i),
                Err(e) => {
                    tracing::debug!(device = self.dev, "an arena piece in place: {e}");
                    failed = true;
                    break;
                }
            }
        }
        if failed {
            for i in taken {
                h.heap
                    .free(pieces[i].0, Tag::Dirty(slot))
                    .expect("a piece just taken is allocated");
            }
            return None;
        }
        if h.heap.device_allocs != device_allocs {
            self.counters.grown.fetch_add(1, Relaxed);
        }
        self.counters
            .peak_reserved
            .fetch_max(h.heap.reserved(), Relaxed);
        Some((origin, offs, pieces))
    }

    /// Retires the arena `id` of `slot`: freed now if empty, else when its
    /// last block goes.
    fn retire_arena(&self, p: &mut SlotPlan, slot: u16, id: u64) {
        let Some(i) = p.arenas.iter().position(|a| a.id == id) else {
            return;
        };
        p.arenas[i].retiring = true;
        if p.arenas[i].is_empty() {
            let a = p.arenas.swap_remove(i);
            self.free_arena(a, slot);
        }
    }

    /// Gives an empty arena of a live stream back to the heap.
    fn free_arena(&self, a: Arena, slot: u16) {
        debug_assert!(a.is_empty());
        self.forget_pieces(&a);
        let mut h = self.heap.lock();
        for &(addr, _) in &a.pieces {
            h.heap
                .free(addr, Tag::Dirty(slot))
                .expect("an arena's pieces are allocated");
        }
    }

    /// Takes `a`'s pieces out of the index and its bytes out of the count.
    fn forget_pieces(&self, a: &Arena) {
        let mut index = self.plans.index.write();
        for (addr, _) in &a.pieces {
            index.remove(addr);
        }
        self.plans.arena_bytes.fetch_sub(a.len, Relaxed);
    }

    /// Gives an orphan arena with no live block back to the heap, behind its
    /// retired stream's last event, the events of its frees and its fences.
    fn free_orphan(&self, mut a: Arena) {
        let mut waits = std::mem::take(&mut a.tomb);
        for (_, _, w) in a.fenced.drain(..) {
            waits.absorb(w);
        }
        self.forget_pieces(&a);
        let mut h = self.heap.lock();
        let id = h.heap.new_pending_group();
        for &(addr, _) in &a.pieces {
            h.heap
                .free(addr, Tag::Pending(id))
                .expect("an arena's pieces are allocated");
        }
        h.insert_group(id, waits);
        drop(h);
        self.counters.pending_frees.fetch_add(1, Relaxed);
        self.pending.push(Pending::Group { id });
    }

    /// A stream retires (before its dirty memory is flushed): its empty
    /// arenas go back to the heap as its dirty memory; the others become
    /// orphans behind an event of its last work.
    pub(super) fn plan_retire_slot(&self, slot: u16, core: &Arc<StreamCore>) {
        if !self.plans.enabled() {
            return;
        }
        let arenas = {
            let mut p = self.plans.slots[slot as usize].lock();
            p.state = State::Off;
            std::mem::take(&mut p.arenas)
        };
        for mut a in arenas {
            self.lift_fences(&mut a);
            if a.is_empty() {
                self.free_arena(a, slot);
                continue;
            }
            a.tomb = self.record_events(core, &[]);
            if a.live.is_empty() {
                self.free_orphan(a);
                continue;
            }
            {
                let mut index = self.plans.index.write();
                for (addr, _) in &a.pieces {
                    if let Some(e) = index.get_mut(addr) {
                        e.1 = ORPHAN;
                    }
                }
            }
            self.plans.orphans.lock().push(a);
        }
    }

    /// Memory is short (the way to out of memory, `trim`): every empty
    /// arena goes back to the heap and its stream records anew at the next
    /// mark. Returns the bytes given back.
    pub(super) fn plan_release_idle(&self) -> u64 {
        if !self.plans.enabled() {
            return 0;
        }
        let mut freed = 0;
        for slot in 0..STREAM_SLOTS as u16 {
            let mut p = self.plans.slots[slot as usize].lock();
            let p = &mut *p;
            let mut i = 0;
            while i < p.arenas.len() {
                self.lift_fences(&mut p.arenas[i]);
                if !p.arenas[i].is_empty() {
                    i += 1;
                    continue;
                }
                let a = p.arenas.swap_remove(i);
                if matches!(&p.state, State::Following(f) if f.arena == a.id) {
                    p.state = State::Recording(Recorder::default());
                }
                freed += a.len;
                self.free_arena(a, slot);
            }
        }
        freed
    }

    /// Pool teardown: forgets every plan (the heap gives the memory back)
    /// and returns fenced events to the pool's event cache.
    pub(super) fn plan_teardown(&self) {
        let mut arenas: Vec<Arena> = std::mem::take(&mut *self.plans.orphans.lock());
        for slot in self.plans.slots.iter() {
            let mut p = slot.lock();
            p.state = State::Off;
            arenas.append(&mut p.arenas);
        }
        for a in arenas {
            self.recycle_events(a.tomb);
            for (_, _, w) in a.fenced {
                self.recycle_events(w);
            }
        }
        self.plans.index.write().clear();
        self.plans.arena_bytes.store(0, Relaxed);
    }
}

/// An arena laid in place: `(origin, offsets, pieces)`.
type InPlace = (u64, Vec<u64>, Vec<(u64, u64)>);

/// The ranges planned blocks cover (`origin + offset`), merged, and cut
/// where one free range of `gaps` ends and the next begins: the pieces of
/// an arena laid in place, each inside one free range, by address; with
/// the bytes the blocks cover (more than the pieces' if some lie outside
/// every free range).
fn footprint(
    origin: u64,
    lives: &[Life],
    offs: &[u64],
    gaps: &[(u64, u64)],
) -> (u64, Vec<(u64, u64)>) {
    let mut iv: Vec<(u64, u64)> = offs
        .iter()
        .zip(lives)
        .map(|(&o, l)| (origin + o, origin + o + l.len))
        .collect();
    iv.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::new();
    for (lo, hi) in iv {
        match merged.last_mut() {
            Some(last) if lo <= last.1 => last.1 = last.1.max(hi),
            _ => merged.push((lo, hi)),
        }
    }
    let covered = merged.iter().map(|(lo, hi)| hi - lo).sum();
    let mut pieces = Vec::new();
    let mut g = 0;
    for (lo, hi) in merged {
        while g < gaps.len() && gaps[g].0 + gaps[g].1 <= lo {
            g += 1;
        }
        let mut k = g;
        while k < gaps.len() && gaps[k].0 < hi {
            let (a, b) = (lo.max(gaps[k].0), hi.min(gaps[k].0 + gaps[k].1));
            if a < b {
                pieces.push((a, b - a));
            }
            k += 1;
        }
    }
    (covered, pieces)
}
