//! Small slots on their way back to the stream that freed them, after
//! uses on other streams (`record_stream`): PyTorch's rule.
//!
//! A slot used on streams besides its own is freed behind those other
//! streams' uses (a promise on each, see `probes.rs`) and none on its
//! own: its own stream's later work is ordered after its own earlier
//! uses already. Once probes on those streams complete the promises,
//! the slot goes back to its stream's dirty stack (lock-free),
//! where that stream reuses it at once, or to the clean stack when an
//! event its stream recorded after the free is known complete too. The
//! general pending path recorded an event on the slot's own stream as
//! well and sent every such slot through the device's pending list.
//!
//! The owner stream settles its queue when its stacks miss (event queries
//! under its queue lock only, before the slow path); any harvest settles
//! every queue; a flush of the stream (maintenance, the way to out of
//! memory, its retirement) moves what is still waiting to the pending
//! list with the stream's dirty slots, behind the waits it had plus the
//! flush's event on the stream.
//!
//! Invariants:
//! 1. A queued slot is on no stack, in no magazine and on no pending
//!    record; the pool's pending slot bytes count it.
//! 2. An entry leaves its queue under the queue's lock, and is pushed on
//!    a stack under that same lock (settling), or taken by a flush of the
//!    slot, which takes the queue before the slot's dirty stacks: a
//!    retiring stream leaves nothing on its dirty stacks behind it.
//! 3. A queue's `count` is written under its lock, after each change, for
//!    readers that do not take it.
//! 4. Every entry's waits are recorded events or promises (a free with an
//!    unrecorded stream takes the general path), none on the owner stream.

use super::event_order::Mark;
use super::pending::Waits;
use super::PoolShared;
use crossbeam_utils::CachePadded;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// A slot waiting on other streams' uses before it goes back to the
/// stream that freed it.
#[derive(Debug)]
pub(crate) struct Entry {
    pub class: u16,
    pub idx: u32,
    /// The other streams' events.
    pub waits: Waits,
    /// The next event on the freeing stream after the free: once known
    /// done, the slot is clean for every stream.
    pub owner_done: Mark,
}

#[derive(Debug, Default)]
struct Queue {
    /// Oldest first.
    entries: Mutex<VecDeque<Entry>>,
    count: AtomicUsize,
}

/// Every stream slot's queue of returning slots.
#[derive(Debug)]
pub(crate) struct Returning {
    queues: Box<[CachePadded<Queue>]>,
    /// Entries in all queues (changed under a queue's lock): a harvest
    /// with none queued looks at no queue.
    total: CachePadded<AtomicUsize>,
}

/// A slot a settle gives back, and whether it is clean for every stream.
pub(crate) type Settled = (u16, u32, bool);

impl Returning {
    /// Queues for stream slots `0..slots`.
    pub(crate) fn new(slots: usize) -> Self {
        Returning {
            queues: (0..slots).map(|_| CachePadded::default()).collect(),
            total: CachePadded::default(),
        }
    }

    /// Queues `e`, freed on `slot`; `Err(e)` if the slot has no queue.
    pub(crate) fn push(&self, slot: u16, e: Entry) -> Result<(), Box<Entry>> {
        let Some(q) = self.queues.get(slot as usize) else {
            return Err(Box::new(e));
        };
        let mut entries = q.entries.lock();
        entries.push_back(e);
        q.count.store(entries.len(), Relaxed);
        self.total.fetch_add(1, Relaxed);
        Ok(())
    }

    /// Whether `slot` has entries (as last published).
    #[inline]
    pub(crate) fn has(&self, slot: u16) -> bool {
        self.queues
            .get(slot as usize)
            .is_some_and(|q| q.count.load(Relaxed) != 0)
    }

    /// Whether no slot has entries (as last published).
    pub(crate) fn is_empty(&self) -> bool {
        self.total.load(Relaxed) == 0
    }

    /// Every queued slot as `(class, idx)` (exact while no stream frees or
    /// settles).
    pub(crate) fn slots(&self) -> Vec<(u16, u32)> {
        let mut out = Vec::new();
        for q in self.queues.iter() {
            out.extend(q.entries.lock().iter().map(|e| (e.class, e.idx)));
        }
        out
    }

    /// Takes every entry of `slot` (a flush of its stream).
    pub(crate) fn drain(&self, slot: u16) -> Vec<Entry> {
        let Some(q) = self.queues.get(slot as usize) else {
            return Vec::new();
        };
        let mut entries = q.entries.lock();
        let out: Vec<Entry> = entries.drain(..).collect();
        q.count.store(0, Relaxed);
        self.total.fetch_sub(out.len(), Relaxed);
        out
    }

    /// Takes every entry of every slot (teardown).
    pub(crate) fn drain_all(&self) -> Vec<Entry> {
        (0..self.queues.len())
            .flat_map(|s| self.drain(s as u16))
            .collect()
    }

    /// Takes the entries of `slot` whose waits are `done`, oldest first,
    /// up to the first that is not (as PyTorch's `process_events`), and
    /// hands them to `put` under the queue's lock (invariant 2); returns
    /// their waits. Skips the queue (none) while another thread holds it:
    /// that thread pushes or settles.
    fn settle(
        &self,
        slot: u16,
        mut done: impl FnMut(&Waits) -> bool,
        put: impl FnOnce(&[Settled]),
    ) -> Vec<Waits> {
        let mut out = Vec::new();
        let Some(q) = self.queues.get(slot as usize) else {
            return out;
        };
        if q.count.load(Relaxed) == 0 {
            return out;
        }
        let Some(mut entries) = q.entries.try_lock() else {
            return out;
        };
        let mut settled = Vec::new();
        while entries.front().is_some_and(|e| done(&e.waits)) {
            let e = entries.pop_front().expect("front exists");
            settled.push((e.class, e.idx, e.owner_done.known_done()));
            out.push(e.waits);
        }
        if !settled.is_empty() {
            put(&settled);
            self.total.fetch_sub(settled.len(), Relaxed);
        }
        q.count.store(entries.len(), Relaxed);
        out
    }
}

impl PoolShared {
    /// Gives back the slots of `slot`'s queue whose other streams' uses
    /// completed (queries only); whether any was.
    pub(super) fn settle_returning(&self, slot: u16) -> bool {
        if !self.returning.has(slot) || self.capture.underway() {
            return false;
        }
        // Not urgent: a miss has the slow path, and misses come often;
        // the stream's probes follow the interval (see `probes.rs`).
        let done = self.returning.settle(
            slot,
            |w| self.waits_done(w, false, false),
            |s| self.give_back(slot, s),
        );
        let any = !done.is_empty();
        for w in done {
            self.recycle_events(w);
        }
        any
    }

    /// [`PoolShared::settle_returning`] for every slot (a harvest): how
    /// many slots were given back.
    /// `urgent`: promises get probes at once (see `probes.rs`); `fresh`:
    /// no hold applies (see `event_order.rs`).
    pub(super) fn settle_all_returning(&self, urgent: bool, fresh: bool) -> usize {
        if self.returning.is_empty() || self.capture.underway() {
            return 0;
        }
        let mut n = 0;
        for slot in 0..super::STREAM_SLOTS as u16 {
            if !self.returning.has(slot) {
                continue;
            }
            let done = self.returning.settle(
                slot,
                |w| self.waits_done(w, urgent, fresh),
                |s| self.give_back(slot, s),
            );
            n += done.len();
            for w in done {
                self.recycle_events(w);
            }
        }
        n
    }

    /// Pushes settled slots on `slot`'s dirty stacks (clean ones on the
    /// clean stacks) and stops counting them as pending.
    fn give_back(&self, slot: u16, settled: &[Settled]) {
        for &(class, idx, clean) in settled {
            let class = class as usize;
            if clean {
                self.slabs.push_clean(class, &[idx]);
            } else {
                self.slabs.push_dirty(class, slot as usize, idx);
            }
            self.counters
                .pending_slot_bytes
                .fetch_sub(self.slabs.classes.size_of(class), Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn entry(idx: u32) -> Entry {
        Entry {
            class: 3,
            idx,
            waits: Waits::default(),
            owner_done: Mark::next(&Arc::default()),
        }
    }

    #[test]
    fn a_settle_gives_back_the_completed_front_in_order() {
        let r = Returning::new(2);
        for i in 1..=4 {
            r.push(1, entry(i)).expect("slot 1");
        }
        assert!(r.has(1) && !r.has(0) && !r.is_empty());
        // Entries 1 and 2 completed, 3 did not: 4 waits behind it even
        // though it completed (one query per miss, as PyTorch).
        let mut asked = Vec::new();
        let mut got = Vec::new();
        let done = r.settle(
            1,
            |_| {
                asked.push(());
                asked.len() != 3
            },
            |s| got.extend_from_slice(s),
        );
        assert_eq!(done.len(), 2);
        assert_eq!(asked.len(), 3);
        assert_eq!(got, vec![(3, 1, false), (3, 2, false)]);
        assert_eq!(r.slots(), vec![(3, 3), (3, 4)]);
        let left: Vec<u32> = r.drain(1).into_iter().map(|e| e.idx).collect();
        assert_eq!(left, vec![3, 4]);
        assert!(!r.has(1) && r.is_empty());
    }

    #[test]
    fn nothing_completed_gives_nothing_back() {
        let r = Returning::new(1);
        r.push(0, entry(7)).expect("slot 0");
        let done = r.settle(0, |_| false, |_| panic!("nothing completed"));
        assert!(done.is_empty());
        assert_eq!(r.slots(), vec![(3, 7)]);
    }

    #[test]
    fn a_slot_without_a_queue_gives_its_entry_back() {
        let r = Returning::new(1);
        let e = r.push(3, entry(9)).expect_err("no slot 3");
        assert_eq!(e.idx, 9);
        assert!(r.is_empty() && r.drain_all().is_empty());
    }
}
