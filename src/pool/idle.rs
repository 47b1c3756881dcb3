//! Opportunistic reuse: memory another stream freed, made clean for every
//! stream by asking that stream whether it is idle (`cuStreamQuery`), with
//! no event, no wait and no pending group (`cudaMallocAsync`'s
//! opportunistic reuse, found by asking the stream).
//!
//! A stream's freed large memory sits in two places: parked for its own
//! reuse (`stream_large.rs`) and in the heap as `Dirty(slot)` ranges. Both
//! serve only that stream until its uses are known to be complete. When a
//! request misses, [`PoolShared::query_idle`] asks each stream that holds
//! some, the requester's own only beside others (two cheap driver calls
//! each, outside every lock: a capture check first, as a query would
//! invalidate a capture the pool was not told of, then the query), and
//! [`PoolShared::unpark_reusing`], under the heap lock, cleans the idle
//! streams' `Dirty` ranges and gives every parked range to the heap, an
//! idle stream's as `Clean`. Parked ranges of an idle stream go in clean
//! at once: parked as `Dirty` and cleaned after, each range was merged
//! twice (on 8 idle streams, a fifth of the serving workload's run). The
//! flush that may follow (`reclaim_knowing_busy`) takes the busy answers
//! as given and does not ask those streams again (with streams behind
//! the host, a third fewer queries per operation).
//!
//! Invariant: memory is made clean only if it was freed before the query
//! that found its stream idle. What each stream held is counted before
//! the query, and a count that moved since leaves its memory as it is:
//! the heap's `dirty_gen` for `Dirty(slot)` ranges, each parking shard's
//! park count for parked ranges (read under the shard's lock at the
//! drain). Everything freed up to a count was enqueued before the free,
//! hence before the query, which saw it complete.

use super::heap::Tag;
use super::stream_large::SHARDS;
use super::{HeapState, PoolShared, Stream, StreamCore};

/// A stream found idle, held (so its slot stays its own, and its handle
/// valid, until what it freed is settled), with what it held when asked.
struct Idle {
    slot: u16,
    /// `Dirty(slot)`'s join count, if it had dirty ranges.
    dirty_gen: Option<u64>,
    /// Its parking shards' park counts, if it had parked ranges.
    parks: Option<[u64; SHARDS]>,
    _stream: Stream,
}

/// The streams a query found idle (see the file's comment), and the
/// slots of those it found busy.
#[derive(Default)]
pub(super) struct IdleStreams(Vec<Idle>, Vec<u16>);

impl IdleStreams {
    pub(super) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The slots of the streams found busy: a flush right after need not
    /// ask them again (it would take their memory as idle only on a yes,
    /// and a no is what it assumes without asking).
    pub(super) fn busy(&self) -> &[u16] {
        &self.1
    }

    /// Whether shard `k` of `slot`'s parked ranges, with park count
    /// `puts` now, holds only ranges parked before `slot` was asked.
    fn parked_before(&self, slot: u16, k: usize, puts: u64) -> bool {
        self.0
            .iter()
            .any(|i| i.slot == slot && i.parks.is_some_and(|p| p[k] == puts))
    }
}

impl PoolShared {
    /// Whether every operation enqueued on the stream of `core` so far has
    /// completed (`cuStreamQuery`). Never asked of a dead stream (its
    /// handle may be gone) nor of another thread's per-thread default
    /// stream; first `cuStreamIsCapturing` (a query would invalidate a
    /// capture the pool was not told of), and the query itself inside the
    /// capture handshake: a capture that begins meanwhile sees it in
    /// flight, or it sees the capture. An error reads as busy. A stream
    /// found busy lately is not asked again until its hold runs out (see
    /// `event_order.rs`): a miss asks every stream holding freed memory,
    /// and a busy stream's answer cannot change within microseconds.
    pub(super) fn stream_idle(&self, core: &StreamCore) -> bool {
        if core.is_dead()
            || core
                .thread
                .is_some_and(|t| t != std::thread::current().id())
        {
            return false;
        }
        let now = super::event_order::now_ns();
        if core.order.busy_lately(now) {
            return false;
        }
        let (dev, h) = (self.dev, core.handle);
        let idle = matches!(self.backend.stream_capturing(dev, h), Ok(false))
            && matches!(
                self.outside_capture(|| self.backend.query_stream(dev, h)),
                Some(Ok(true))
            );
        if idle {
            core.order.found_idle();
        } else {
            core.order.found_busy(now);
        }
        idle
    }

    /// Asks each stream that holds freed memory (dirty heap ranges or
    /// parked ranges) whether it is idle: the requester's
    /// own stream `own` too, but only beside another (what it freed is
    /// its own to reuse already, and clean serves only other streams; one
    /// stream alone is never asked). Takes the heap lock once to count,
    /// and no lock while it asks. None while a capture is underway.
    pub(super) fn query_idle(&self, own: Option<u16>) -> IdleStreams {
        if self.capture.underway() {
            return IdleStreams::default();
        }
        let dirty = self.heap.lock().heap.dirty_slots();
        let parks = self.by_stream.parked_slots();
        let mut slots: Vec<u16> = dirty
            .iter()
            .map(|d| d.0)
            .chain(parks.iter().map(|p| p.0))
            .collect();
        slots.sort_unstable();
        slots.dedup();
        if slots.iter().all(|&s| Some(s) == own) {
            return IdleStreams::default();
        }
        let (mut idle, mut busy) = (Vec::new(), Vec::new());
        for slot in slots {
            let Some(s) = self.streams.get(slot) else {
                continue;
            };
            if self.stream_idle(s.core()) {
                idle.push(Idle {
                    slot,
                    dirty_gen: dirty.iter().find(|d| d.0 == slot).map(|d| d.1),
                    parks: parks.iter().find(|p| p.0 == slot).map(|p| p.1),
                    _stream: s,
                });
            } else {
                busy.push(slot);
            }
        }
        IdleStreams(idle, busy)
    }

    /// Under the heap lock: the `Dirty` ranges of `idle` streams made
    /// clean (each merged with the clean ranges around it), then every
    /// parked range given to the heap, those of `idle` streams parked
    /// before they were asked as `Clean`, the others as `Dirty` of their
    /// slot. `(whether any range was unparked, whether any memory became
    /// clean)`.
    /// `own` (the requester's slot, if any) is not told that its ranges
    /// were taken (see [`StreamLarge::take_parks_taken`]).
    ///
    /// [`StreamLarge::take_parks_taken`]: super::stream_large::StreamLarge::take_parks_taken
    pub(super) fn unpark_reusing(
        &self,
        h: &mut HeapState,
        idle: &IdleStreams,
        own: Option<u16>,
    ) -> (bool, bool) {
        // Cleaned first: unparking into `Dirty(slot)` moves the slot's
        // count on, and the clean would find it stale.
        let mut cleaned = idle
            .0
            .iter()
            .filter_map(|i| Some(h.heap.clean_dirty_if(i.slot, i.dirty_gen?)))
            .sum::<u64>()
            > 0;
        if self.by_stream.nothing_parked() {
            return (false, cleaned);
        }
        self.by_stream.drain_sorted(
            |slot, k, puts| idle.parked_before(slot, k, puts),
            |slot, clean, ranges| {
                if Some(slot) != own {
                    self.by_stream.note_parks_taken(slot);
                }
                cleaned |= clean;
                let tag = if clean { Tag::Clean } else { Tag::Dirty(slot) };
                h.heap.free_many(ranges, tag);
            },
        );
        (true, cleaned)
    }

    /// A slot of `class` for a stream (slot `own`) that found none of its
    /// own, clean, nor harvested: another stream's dirty slots of the
    /// class, taken off its stack before asking it, made clean if it is
    /// idle (put back otherwise). Before a new slab: on 8 streams each
    /// stream's share of a class drifts, one stream's stack running dry
    /// while another's fills, and the small path made and retired
    /// about 100 thousand slabs a second where one stream made none.
    pub(super) fn take_idle_dirty(&self, class: usize, own: Option<usize>) -> Option<u32> {
        let slots = self.slabs.stacks[class].dirty.len();
        for k in 1..=slots {
            let slot = (own.unwrap_or(slots - 1) + k) % slots;
            if Some(slot) == own || !self.slabs.holds_dirty(class, slot) {
                continue;
            }
            // Held: its slot stays its own until the slots are settled.
            let Some(s) = self.streams.get(slot as u16) else {
                continue;
            };
            // A stream `stream_idle` would not ask: its stacks stay as
            // they are (no take and put back).
            if s.core().order.busy_lately(super::event_order::now_ns()) {
                continue;
            }
            // Taken before the query: all freed before it (the file's
            // invariant). Every class at once: one query pays for all.
            let taken = self.slabs.take_dirty_all(slot);
            let idle = !taken.is_empty() && self.stream_idle(s.core());
            for (c, idxs) in &taken {
                if idle {
                    self.slabs.push_clean(*c, idxs);
                } else {
                    self.slabs.push_dirty_many(*c, slot, idxs);
                }
            }
            if let Some(i) = idle.then(|| self.slabs.pop(class, own)).flatten() {
                return Some(i);
            }
        }
        None
    }

    /// Makes the dirty large ranges of idle streams clean for every
    /// stream, and unparks every parked range, an idle stream's clean
    /// (`own` as in [`PoolShared::query_idle`]): whether any memory
    /// became clean.
    pub(super) fn clean_idle_streams(&self, own: Option<u16>) -> bool {
        let idle = self.query_idle(own);
        if idle.is_empty() {
            return false;
        }
        let cleaned = self.unpark_reusing(&mut self.heap.lock(), &idle, own).1;
        // (The streams are dropped here, outside every lock.)
        drop(idle);
        cleaned
    }
}
