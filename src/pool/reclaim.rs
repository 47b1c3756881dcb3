//! Reclaiming memory: harvesting pending frees, handing them over,
//! flushing streams' dirty memory, retiring empty slabs, and trimming.
//!
//! None of this runs on the fast path. Harvesting and handover never block
//! the host; only `trim` (an explicit call) and pool teardown wait for
//! events.

use super::event_order::{Mark, Progress, Sweep};
use super::heap::Tag;
use super::pending::{Pending, Waits};
use super::{HeapState, PoolShared, Stream, StreamCore};
use crate::error::{Error, Result};
use crate::ptr::EventHandle;
use parking_lot::Mutex;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;

impl PoolShared {
    /// Whether everything in `w` completed (never, while a stream is
    /// unrecorded; not while a capture is underway, unless nothing needs
    /// a query). Queries only the events that its streams' order does
    /// not already settle (see `event_order.rs`); `progress` carries what
    /// this pass found pending.
    pub(super) fn waits_done_in(&self, w: &Waits, progress: &mut Progress) -> bool {
        if !w.unrecorded.is_empty() {
            return false;
        }
        let events_done = w.events.iter().enumerate().all(|(i, &e)| {
            let mark = w.mark(i);
            if mark.is_some_and(Mark::known_done) {
                return true;
            }
            if mark.is_some_and(|m| progress.skips(m, e)) {
                return false;
            }
            let done = self.event_done(e);
            match mark {
                Some(m) if done => m.completed(),
                Some(m) => progress.found_pending(m, e),
                None if !done => progress.unmarked_pending = true,
                None => {}
            }
            done
        });
        events_done && w.promised.iter().all(|p| self.promise_done_in(p, progress))
    }

    /// Settles the marked events of `records` stream by stream.
    fn sweep(&self, records: &[Pending], progress: &mut Progress) {
        let mut sweep = Sweep::default();
        let mut note = |w: &Waits| {
            for (i, &e) in w.events.iter().enumerate() {
                if let Some(m) = w.mark(i) {
                    sweep.note(e, m);
                }
            }
        };
        let mut groups = false;
        for p in records {
            match p {
                Pending::Slots { waits, .. } | Pending::Classes { waits, .. } => note(waits),
                Pending::Group { .. } => groups = true,
            }
        }
        if groups {
            let h = self.heap.lock();
            for p in records {
                if let Pending::Group { id } = p {
                    if let Some(w) = h.group_events.get(id) {
                        note(w);
                    }
                }
            }
        }
        sweep.settle(progress, |e| self.event_done(e));
    }

    /// [`PoolShared::waits_done_in`] on its own, in a pass that may be
    /// `urgent` (its promises get probes at once, see `probes.rs`) or
    /// `fresh` (no hold applies, see `event_order.rs`).
    pub(super) fn waits_done(&self, w: &Waits, urgent: bool, fresh: bool) -> bool {
        self.waits_done_in(w, &mut Progress::new(urgent, fresh))
    }

    pub(super) fn recycle_events(&self, w: Waits) {
        self.events.give_back_all(w.events);
    }

    /// Orders `stream` after everything in `w` on the device.
    pub(super) fn wait_on(&self, stream: &Stream, w: &Waits) -> Result<()> {
        if !w.unrecorded.is_empty() {
            return Err(Error::InvalidArgument(
                "memory with unrecorded uses cannot be handed over".into(),
            ));
        }
        let order = &stream.core().order;
        let wait = |e: EventHandle| -> Result<()> {
            self.outside_capture(|| self.backend.stream_wait_event(self.dev, stream.handle(), e))
                .ok_or_else(|| self.capture_error("a handover"))?
        };
        for (i, &e) in w.events.iter().enumerate() {
            // Work on the stream already runs after its own events.
            if !w.needs_no_wait(i, order) {
                wait(e)?;
            }
        }
        // A promise is waited on through the oldest probe that covers it
        // (recorded soon after the free, it completes as early as the
        // free's own event would), else an event recorded now on its
        // stream, which then serves as that stream's probe. (Only slot
        // records carry promises, and their handovers run outside the heap
        // lock: see `HeapState::insert_group`.)
        for p in &w.promised {
            if p.mark.known_done() || Arc::ptr_eq(&p.mark.order, order) {
                continue;
            }
            if let Some(e) = self.covering_probe(&p.mark) {
                wait(e)?;
                continue;
            }
            let (e, mark) = self.record_on(&p.core)?;
            let waited = wait(e);
            match mark {
                Some(mark) => self.add_probe(&mark, e),
                // A queued wait keeps the event's state: it can be reused.
                None => self.events.give_back(e),
            }
            waited?;
        }
        Ok(())
    }

    /// Releases every pending record whose events completed, without blocking.
    ///
    /// One pass at a time (the gate's lock). Records the last pass kept
    /// back are walked again only when one of the earliest events they
    /// wait for completed (see [`HarvestGate`]); new records always are.
    pub(super) fn harvest(&self) -> usize {
        // Nothing can be queried during a capture: skip the walk.
        if self.capture.underway() {
            return 0;
        }
        self.harvest_with(self.harvest_gate.lock(), Pass::Explicit)
    }

    /// [`PoolShared::harvest`] asking about every event afresh, with no
    /// "pending" answer held from an earlier pass (see `event_order.rs`):
    /// an explicit [`DevicePool::harvest`](super::DevicePool::harvest)
    /// releases everything whose uses completed.
    pub(super) fn harvest_now(&self) -> usize {
        if self.capture.underway() {
            return 0;
        }
        self.harvest_with(self.harvest_gate.lock(), Pass::Fresh)
    }

    /// [`PoolShared::harvest`] for the maintenance step: promises get
    /// probes at most once per interval (see `probes.rs`).
    pub(super) fn harvest_background(&self) -> usize {
        if self.capture.underway() {
            return 0;
        }
        self.harvest_with(self.harvest_gate.lock(), Pass::Background)
    }

    /// [`PoolShared::harvest`] unless another thread is harvesting (then
    /// 0 at once): for the allocation paths, which look for memory and
    /// need not wait for a pass that another thread runs anyway. It looks
    /// at every kept record (see [`HarvestGate`]).
    pub(super) fn try_harvest(&self) -> usize {
        if self.capture.underway() {
            return 0;
        }
        match self.harvest_gate.try_lock() {
            Some(gate) => self.harvest_with(gate, Pass::SlowPath),
            None => 0,
        }
    }

    /// Called after each `record_stream`'d free, outside every pool lock:
    /// every [`HARVEST_PACE`]th, the freeing thread runs a harvest that
    /// asks afresh, unless another thread is running one. Such frees are
    /// what fills the pending list, and a user never calls `harvest`:
    /// with only the slow paths and the maintenance thread harvesting,
    /// serving on 8 streams with `record_stream` had 2-3x the allocation
    /// p99 (1x8: 2.3 -> 5.6-7.4 µs; docs/BENCHMARKS.md §5).
    pub(super) fn pace_harvest(&self) {
        let n = self.recorded_frees.fetch_add(1, Relaxed);
        if n % HARVEST_PACE != HARVEST_PACE - 1 || self.capture.underway() || self.is_torn_down() {
            return;
        }
        if let Some(gate) = self.harvest_gate.try_lock() {
            self.harvest_with(gate, Pass::Fresh);
        }
    }

    /// A harvest pass of kind `pass` (see [`Pass`]).
    fn harvest_with(
        &self,
        mut gate: parking_lot::MutexGuard<'_, HarvestGate>,
        pass: Pass,
    ) -> usize {
        let (urgent, settle_urgent, fresh, walk) = pass.flags();
        let mut released = self.harvest_quarantine(&mut Progress::new(false, fresh));
        released += self.settle_all_returning(settle_urgent, fresh);
        if self.no_pending() {
            return released;
        }
        self.counters.harvests.fetch_add(1, Relaxed);
        let epoch = self.kept.epoch();
        let mut progress = Progress::new(urgent, fresh);
        let mut records = self.pending.take_all();
        if !walk && gate.kept_unchanged(epoch, &mut progress, |e| self.event_done(e)) {
            // What the kept records wait for is pending: the pass starts
            // from that knowledge and looks at the new records only.
            gate.seed(&mut progress);
        } else {
            gate.walk_all();
            records.append(&mut self.kept.take_for_harvest());
            self.counters.harvest_walks.fetch_add(1, Relaxed);
        }
        let mut kept = Vec::new();
        // A few queries per stream settle every marked event (see
        // `event_order.rs`); what is left unmarked is queried below.
        self.sweep(&records, &mut progress);
        let mut groups = Vec::new();
        for p in records {
            match p {
                Pending::Slots {
                    class,
                    slots,
                    waits,
                    bytes,
                } => {
                    if self.waits_done_in(&waits, &mut progress) {
                        self.slabs.push_clean(class as usize, &slots);
                        self.counters.pending_slot_bytes.fetch_sub(bytes, Relaxed);
                        self.recycle_events(waits);
                        released += 1;
                    } else {
                        kept.push(Pending::Slots {
                            class,
                            slots,
                            waits,
                            bytes,
                        });
                    }
                }
                Pending::Classes {
                    parts,
                    waits,
                    bytes,
                } => {
                    if self.waits_done_in(&waits, &mut progress) {
                        for (class, slots) in &parts {
                            self.slabs.push_clean(*class as usize, slots);
                        }
                        self.counters.pending_slot_bytes.fetch_sub(bytes, Relaxed);
                        self.recycle_events(waits);
                        released += 1;
                    } else {
                        kept.push(Pending::Classes {
                            parts,
                            waits,
                            bytes,
                        });
                    }
                }
                Pending::Group { id } => groups.push(id),
            }
        }
        if !groups.is_empty() {
            // Every heap group of the pass under one lock.
            let mut h = self.heap.lock();
            for id in groups {
                let done = h
                    .group_events
                    .get(&id)
                    .is_none_or(|w| self.waits_done_in(w, &mut progress));
                if done {
                    h.heap.complete_pending(id);
                    if let Some(w) = h.group_events.remove(&id) {
                        self.recycle_events(w);
                    }
                    released += 1;
                } else {
                    kept.push(Pending::Group { id });
                }
            }
        }
        self.kept.put(kept);
        gate.update(epoch, progress);
        released
    }

    /// Whether no record is pending (racy: a hint for skipping work).
    pub(super) fn no_pending(&self) -> bool {
        self.pending.is_empty() && self.kept.is_empty()
    }

    /// Every pending record, new and kept, for a caller that puts back
    /// (on the list) what it does not release.
    pub(super) fn take_pending_records(&self) -> Vec<Pending> {
        let mut all = self.kept.take();
        all.append(&mut self.pending.take_all());
        all
    }

    /// Unmaps aliased granules whose old uses completed.
    pub(super) fn harvest_quarantine(&self, progress: &mut Progress) -> usize {
        if !self.quarantined.load(Acquire) {
            return 0;
        }
        let mut h = self.heap.lock();
        if h.heap.capture_hold {
            return 0;
        }
        if h.quarantine.is_empty() {
            self.quarantined.store(false, Release);
            return 0;
        }
        let q = std::mem::take(&mut h.quarantine);
        let mut released = 0;
        for (w, gs) in q {
            if self.waits_done_in(&w, progress) {
                h.heap.release_quarantine(&gs);
                self.recycle_events(w);
                released += 1;
            } else {
                h.quarantine.push((w, gs));
            }
        }
        if h.quarantine.is_empty() {
            self.quarantined.store(false, Release);
        }
        released
    }

    /// Takes pending slots of `class` for `stream` by ordering the stream
    /// after their events on the device (no host sync): records whose
    /// streams drain soon first (see `Waits::drains_soon`), then any.
    pub(super) fn handover_slots(&self, class: usize, stream: &Stream) -> Option<u32> {
        let (order, now) = (&stream.core().order, super::event_order::now_ns());
        self.handover_slots_if(class, stream, |w| w.drains_soon(order, now))
            .or_else(|| self.handover_slots_if(class, stream, |w| w.unrecorded.is_empty()))
    }

    fn handover_slots_if(
        &self,
        class: usize,
        stream: &Stream,
        usable: impl Fn(&Waits) -> bool,
    ) -> Option<u32> {
        let slot = stream.slot()? as usize;
        let mut records = self.take_pending_records().into_iter();
        while let Some(p) = records.next() {
            let fits = match &p {
                Pending::Slots {
                    class: c, waits, ..
                } => *c as usize == class && usable(waits),
                // A flush's record of several classes: the stream waits
                // once and takes them all (as its own dirty slots).
                Pending::Classes { parts, waits, .. } => {
                    parts.iter().any(|(c, _)| *c as usize == class) && usable(waits)
                }
                Pending::Group { .. } => false,
            };
            if !fits {
                self.pending.push(p);
                continue;
            }
            let waits = p.slot_waits().expect("a slots record");
            if let Err(e) = self.wait_on(stream, waits) {
                tracing::warn!(device = self.dev, "handover failed: {e}");
                self.pending.push(p);
                continue;
            }
            let (parts, waits, bytes) = p.into_slot_parts().expect("a slots record");
            self.counters.pending_slot_bytes.fetch_sub(bytes, Relaxed);
            self.counters.handovers.fetch_add(1, Relaxed);
            self.recycle_events(waits);
            for other in records {
                self.pending.push(other);
            }
            let mut first = None;
            for (c, slots) in parts {
                let mut slots = &slots[..];
                if c as usize == class && first.is_none() {
                    if let Some((f, rest)) = slots.split_first() {
                        first = Some(*f);
                        slots = rest;
                    }
                }
                self.slabs.push_dirty_many(c as usize, slot, slots);
            }
            return first;
        }
        None
    }

    /// Moves the memory that stream slot `slot` freed onto the pending list,
    /// with one event recorded on that stream, so that other streams can
    /// reuse it once the event completes; or, if the stream is idle when
    /// asked just before the record, makes it clean at once. Its two
    /// records (the small slots, and the heap group) share that event (see
    /// `event_pool.rs`): both are taken before it is recorded, so it
    /// covers both.
    pub(super) fn flush_slot(&self, slot: usize, core: &Arc<StreamCore>) {
        self.flush_slot_as(slot, core, false);
    }

    /// [`PoolShared::flush_slot`]; `known_busy`: a query just found the
    /// stream busy, and it is not asked again (only an idle answer changes
    /// what the flush does, and a stream busy microseconds ago rarely is).
    fn flush_slot_as(&self, slot: usize, core: &Arc<StreamCore>, known_busy: bool) {
        // The small slots first (any taken before the record is covered by
        // it). Slots still waiting on other streams (see `returning.rs`,
        // invariant 2): they join the stream's dirty slots, and their
        // waits the record's.
        let mut returned_waits = Waits::default();
        let mut returned: Vec<(u16, u32)> = Vec::new();
        for e in self.returning.drain(slot as u16) {
            returned.push((e.class, e.idx));
            returned_waits.absorb(e.waits);
        }
        // Every class's dirty slots behind the one event.
        let parts: Vec<(u16, Vec<u32>)> = (0..self.slabs.classes.len())
            .map(|class| {
                // A look before the swap: most of a stream's classes hold
                // nothing, and a reclaim flushes every stream.
                let mut idxs = if self.slabs.holds_dirty(class, slot) {
                    self.slabs.take_dirty(class, slot)
                } else {
                    Vec::new()
                };
                idxs.extend(
                    returned
                        .iter()
                        .filter(|&&(c, _)| c as usize == class)
                        .map(|&(_, i)| i),
                );
                (class as u16, idxs)
            })
            .filter(|(_, idxs)| !idxs.is_empty())
            .collect();
        // Then the heap's dirty ranges, as a group that reads as
        // unrecorded on this stream until the event is recorded (outside
        // the heap lock: no driver call runs under it). Until then nothing
        // hands it over or steals its granules, and only a host sync of the
        // stream (the way to out of memory) completes it. So the group is
        // made last, just before the record: other threads short of memory
        // grow the device beside it for as long as it stays unrecorded.
        let group = {
            let mut h = self.heap.lock();
            for (_, addr) in self.by_stream.drain_slot(slot as u16) {
                h.heap
                    .free(addr, Tag::Dirty(slot as u16))
                    .expect("parked ranges are allocated");
            }
            h.heap.flush_dirty(slot as u16).map(|(id, _)| {
                h.insert_group(
                    id,
                    Waits {
                        unrecorded: vec![core.clone()],
                        ..Waits::default()
                    },
                );
                id
            })
        };
        if parts.is_empty() && group.is_none() {
            return;
        }
        // Everything collected was freed before this query: if the stream
        // has run all its work, it is all clean now, with no event (slots
        // still waiting on other streams excepted: those take the record).
        if returned.is_empty() && !known_busy && self.stream_idle(core) {
            if let Some(id) = group {
                let mut h = self.heap.lock();
                // Unless a host sync of the stream completed it meanwhile.
                if h.group_events.remove(&id).is_some() {
                    h.heap.complete_pending(id);
                }
            }
            for (class, idxs) in &parts {
                self.slabs.push_clean(*class as usize, idxs);
            }
            return;
        }
        let waits = self.record_events(core, &[]);
        // Shared before the group publishes it: a holder that completes
        // first must not make it idle under the other.
        let both = group.is_some() && !parts.is_empty();
        if both {
            for &e in &waits.events {
                self.events.share(e, 2);
            }
        }
        // The group's waits, if it is still pending (a host sync may have
        // completed it meanwhile).
        let published = group.filter(|id| {
            let mut h = self.heap.lock();
            let Some(w) = h.group_events.get_mut(id) else {
                return false;
            };
            *w = Waits {
                events: waits.events.clone(),
                marks: waits.marks.clone(),
                unrecorded: waits.unrecorded.clone(),
                promised: Default::default(),
            };
            true
        });
        match published {
            Some(id) => self.pending.push(Pending::Group { id }),
            // Its hold goes with it.
            None if both => self.events.give_back_all(waits.events.iter().copied()),
            None => {}
        }
        if parts.is_empty() {
            if published.is_none() {
                self.recycle_events(waits);
            }
            return;
        }
        let mut slot_waits = waits;
        let bytes: u64 = parts
            .iter()
            .map(|(c, v)| v.len() as u64 * self.slabs.classes.size_of(*c as usize))
            .sum();
        let returned_bytes: u64 = returned
            .iter()
            .map(|&(c, _)| self.slabs.classes.size_of(c as usize))
            .sum();
        slot_waits.absorb(returned_waits);
        // The returning slots were counted as pending already.
        self.counters
            .pending_slot_bytes
            .fetch_add(bytes - returned_bytes, Relaxed);
        self.counters.pending_frees.fetch_add(1, Relaxed);
        self.pending.push(Pending::Classes {
            parts,
            waits: slot_waits,
            bytes,
        });
    }

    /// Flushes the dirty memory of every live stream (see `flush_slot`).
    /// Each stream is held while it is flushed, so none is destroyed under
    /// the flush; the last reference may retire a stream here, after its
    /// flush and outside every lock.
    pub(crate) fn flush_all_streams(&self) {
        self.flush_all_streams_knowing_busy(&[]);
    }

    /// [`PoolShared::flush_all_streams`], the streams of slots in `busy`
    /// not asked whether they are idle (see `flush_slot`).
    fn flush_all_streams_knowing_busy(&self, busy: &[u16]) {
        // What a flush makes pending cannot be harvested during a capture,
        // and a capturing stream must not record: wait for its end.
        if self.capture.underway() {
            return;
        }
        let live = self.streams.live();
        for s in &live {
            if let Some(slot) = s.slot() {
                self.flush_slot_as(slot as usize, s.core(), busy.contains(&slot));
            }
        }
        drop(live);
    }

    /// If the pool grew since the last call, flushes every stream's dirty
    /// memory (without blocking: each flush records one event), so that
    /// the next harvest makes it clean for every stream. Returns whether it
    /// flushed. Called by the maintenance step: without it, memory freed on
    /// one stream is only reusable by the others after an out-of-memory
    /// retry, and each stream's cache grows until the device is full.
    pub(super) fn flush_streams_if_grown(&self) -> bool {
        if !self.flush_wanted.swap(false, Relaxed) {
            return false;
        }
        self.flush_all_streams();
        true
    }

    /// Makes free memory reusable across streams and classes: flushes every
    /// stream's dirty memory (the requester gets its own back by handover),
    /// harvests, and retires empty slabs.
    pub(super) fn reclaim(&self) {
        self.reclaim_knowing_busy(&[]);
    }

    /// [`PoolShared::reclaim`] right after a query found the streams of
    /// `busy` busy: their flushes record an event without asking again.
    pub(super) fn reclaim_knowing_busy(&self, busy: &[u16]) {
        self.counters.reclaims.fetch_add(1, Relaxed);
        super::magazine::flush_for(self);
        self.flush_all_streams_knowing_busy(busy);
        self.harvest();
        self.retire_empty_slabs();
    }

    /// Returns every slab whose slots are all on its class's clean stack to
    /// the heap. The other clean slots go back in the order they were
    /// taken (the stack's reuse order is kept).
    pub(super) fn retire_empty_slabs(&self) -> u64 {
        let mut h = self.heap.lock();
        let mut freed = 0;
        let mut ids: Vec<u32> = Vec::new();
        let mut retired: Vec<u32> = Vec::new();
        for class in 0..self.slabs.classes.len() {
            // Nothing pushed since the last pass: no slab turned empty.
            let pushes = self.slabs.clean_pushes(class);
            if h.clean_pushes_seen[class] == pushes {
                continue;
            }
            h.clean_pushes_seen[class] = pushes;
            let mut clean = self.slabs.take_clean(class);
            if clean.is_empty() {
                continue;
            }
            // Clean slots per slab, by sorting their slab ids (a slot
            // index holds its slab id): no map, no list per slab.
            ids.clear();
            ids.extend(clean.iter().map(|&i| self.slabs.slab_of(i)));
            ids.sort_unstable();
            retired.clear();
            for run in ids.chunk_by(|a, b| a == b) {
                let id = run[0];
                let (base, c, n) = self.slabs.slab_info(id);
                if run.len() as u32 == n && c == class {
                    self.slab_index.remove(base, self.slabs.slab_bytes(class));
                    self.slabs.retire(id);
                    h.free_slab_ids[class].push(id);
                    h.heap
                        .free(base, Tag::Clean)
                        .expect("slabs are allocated ranges");
                    h.slab_bytes -= self.slabs.slab_bytes(class);
                    h.slab_tail_bytes -= self.slabs.tail_bytes(class);
                    freed += self.slabs.slab_bytes(class);
                    retired.push(id);
                }
            }
            if !retired.is_empty() {
                // `retired` is sorted: its ids came in `ids`' order.
                clean.retain(|&i| retired.binary_search(&self.slabs.slab_of(i)).is_err());
            }
            self.slabs.push_clean_back(class, &clean);
        }
        freed
    }

    pub(super) fn trim(&self) -> Result<u64> {
        self.check_live()?;
        if self.capture.underway() {
            return Err(self.capture_error("trim"));
        }
        // No maintenance step in between: one that flushed streams after
        // the flush below would leave pending memory behind.
        let _gate = self.maint_gate.lock();
        super::magazine::flush_for(self);
        self.plan_release_idle();
        self.flush_all_streams();
        self.sync_pending()?;
        self.movable.trim(self);
        self.harvest();
        self.retire_empty_slabs();
        Ok(self.heap.lock().heap.release_cached())
    }

    /// Blocks until every pending record's uses completed (trim and teardown only).
    pub(super) fn sync_pending(&self) -> Result<()> {
        let records = self.take_pending_records();
        let sync = |w: &Waits| self.host_sync_waits(w);
        let mut result = Ok(());
        for p in records {
            let r = match &p {
                Pending::Slots { waits, .. } | Pending::Classes { waits, .. } => sync(waits),
                Pending::Group { id } => {
                    let h = self.heap.lock();
                    let w = h.group_events.get(id).cloned().unwrap_or_default();
                    drop(h);
                    sync(&w)
                }
            };
            match r {
                Ok(_) => {
                    // Done: strip unrecorded streams (now synced) so harvest releases it.
                    self.pending.push(Self::mark_synced(p, &self.heap));
                }
                Err(e) => {
                    self.pending.push(p);
                    result = Err(e);
                }
            }
        }
        // Quarantined granules last: their events may follow the groups'.
        let q = std::mem::take(&mut self.heap.lock().quarantine);
        for (w, gs) in q {
            match sync(&w) {
                Ok(()) => {
                    self.heap.lock().heap.release_quarantine(&gs);
                    self.recycle_events(w);
                }
                Err(e) => {
                    self.heap.lock().quarantine.push((w, gs));
                    result = Err(e);
                }
            }
        }
        result
    }

    pub(super) fn mark_synced(
        p: Pending,
        heap: &super::counted_lock::CountedMutex<HeapState>,
    ) -> Pending {
        match p {
            Pending::Slots {
                class,
                slots,
                mut waits,
                bytes,
            } => {
                waits.unrecorded.clear();
                waits.promised.clear();
                Pending::Slots {
                    class,
                    slots,
                    waits,
                    bytes,
                }
            }
            Pending::Classes {
                parts,
                mut waits,
                bytes,
            } => {
                waits.unrecorded.clear();
                waits.promised.clear();
                Pending::Classes {
                    parts,
                    waits,
                    bytes,
                }
            }
            Pending::Group { id } => {
                if let Some(w) = heap.lock().group_events.get_mut(&id) {
                    w.unrecorded.clear();
                    w.promised.clear();
                }
                Pending::Group { id }
            }
        }
    }

    /// The stream of slot `slot` retires (its last [`Stream`] clone went):
    /// what it freed moves to the pending list behind one event recorded
    /// on it, before its slot is freed and before its core (which the
    /// caller holds) can destroy it. A torn-down pool has nothing to flush
    /// and makes no driver call.
    ///
    /// `holders` other threads' magazines may still hold slots the stream
    /// freed: they wait, as orphans, on a tomb event recorded here.
    pub(crate) fn retire_stream(
        &self,
        core: &Arc<StreamCore>,
        slot: u16,
        uid: usize,
        holders: usize,
    ) {
        if self.is_torn_down() {
            return;
        }
        self.plan_retire_slot(slot, core);
        self.flush_slot(slot as usize, core);
        if holders > 0 {
            let waits = self.record_events(core, &[]);
            self.bury(uid, holders, waits);
        }
    }
}

/// Records a harvest pass kept back (their uses were not complete), held
/// apart from the list of new records so that the next pass can leave
/// them alone while nothing they wait for completed (see
/// [`HarvestGate`]).
///
/// Locked only briefly and never while another lock is taken (`census`
/// calls [`PoolShared::take_pending_records`] under the heap lock).
#[derive(Debug, Default)]
pub(crate) struct KeptRecords {
    records: Mutex<Vec<Pending>>,
    len: AtomicUsize,
    /// Raised whenever kept records are taken by anyone but a harvest, or
    /// their waits change outside a harvest ([`KeptRecords::touch`]).
    epoch: AtomicU64,
}

impl KeptRecords {
    fn epoch(&self) -> u64 {
        self.epoch.load(Acquire)
    }

    /// Something kept may be releasable now without one of its streams'
    /// earliest pending events completing (a group completed on the
    /// host): the next harvest walks every record.
    pub(crate) fn touch(&self) {
        self.epoch.fetch_add(1, AcqRel);
    }

    fn is_empty(&self) -> bool {
        self.len.load(Relaxed) == 0
    }

    /// Takes every kept record for a caller other than a harvest (the
    /// next harvest walks them all).
    fn take(&self) -> Vec<Pending> {
        self.touch();
        self.take_for_harvest()
    }

    /// Takes every kept record for a harvest, which puts back what it
    /// keeps and says what that waits for.
    fn take_for_harvest(&self) -> Vec<Pending> {
        let mut r = self.records.lock();
        self.len.store(0, Relaxed);
        std::mem::take(&mut *r)
    }

    fn put(&self, mut more: Vec<Pending>) {
        let mut r = self.records.lock();
        r.append(&mut more);
        self.len.store(r.len(), Relaxed);
    }
}

/// Who runs a harvest pass, and so how it runs:
/// - `urgent` (an allocation's slow path, an explicit harvest): the
///   pending records' promises get probes at once, not after the probe
///   interval; `settle_urgent`: those of the returning slots too (not on
///   an allocation's path: a returning slot is its stream's, which settles
///   it when its stacks miss). See `probes.rs`.
/// - `fresh`: no "pending" answer of an earlier pass holds (see
///   `event_order.rs`).
/// - `walk`: every kept record is looked at, whatever the gate says (see
///   [`HarvestGate`]).
#[derive(Debug, Clone, Copy)]
enum Pass {
    /// [`PoolShared::harvest`]: reclaim, trim, explicit calls.
    Explicit,
    /// [`PoolShared::harvest_now`] and the paced passes after
    /// `record_stream`'d frees.
    Fresh,
    /// The maintenance step.
    Background,
    /// An allocation's slow path ([`PoolShared::try_harvest`]).
    SlowPath,
}

impl Pass {
    /// `(urgent, settle_urgent, fresh, walk)`, as above.
    fn flags(self) -> (bool, bool, bool, bool) {
        match self {
            Pass::Explicit => (true, true, false, false),
            Pass::Fresh => (true, true, true, false),
            Pass::Background => (false, false, false, false),
            Pass::SlowPath => (true, false, false, true),
        }
    }
}

/// What the last harvest pass learned about the records it kept back:
/// per stream, the earliest event found pending.
///
/// A kept record cannot be released before each of its pending events
/// completes, and each of those is, in its stream's order, no earlier than
/// that stream's earliest pending event (the pass's sweep settles every
/// marked event of every record, stream by stream). So while none of the
/// earliest events completed, the kept records need no new look: a pass
/// queries one event per stream and walks only the new records. On a
/// device with many streams this is most passes (serving with 8 streams:
/// 94% of full walks released nothing).
///
/// The gate only ever skips work that would have released nothing, so an
/// error in it would delay reuse and never hand memory out early; as a
/// bound on such a delay, every [`FULL_PASS_EVERY`]th pass walks all.
///
/// A pass for an allocation's slow path ([`PoolShared::try_harvest`])
/// walks every kept record regardless: it needs memory now, and the slow
/// path already costs microseconds. With busy streams the gate let kept
/// records pile up: serving on 8 streams with 200 µs kernels after 10% of
/// allocations kept 150-400 records, walked in 60-250 µs when a pass did
/// walk. With the slow paths walking, the allocation p99 fell from
/// 148-155 µs to 119-126 µs, the large allocations' from 176-186 µs to
/// 143-148 µs, and peak reserved was 195-262 MB against 231-271 MB
/// (`stress --workload serving --threads 1 --streams 8 --kernel-percent
/// 10 --kernel-us 200`, seeds 3-4, four runs each, 2026-12-07); no change
/// outside the noise with 50 µs kernels or none. The price: records kept
/// behind a stalled stream are walked by every slow path, at about half
/// a microsecond each (those walks measured 0.25-1 µs a record).
#[derive(Debug, Default)]
pub(crate) struct HarvestGate {
    /// The kept records' epoch when the last pass ended; `None`: no
    /// knowledge to go by (an unmarked event was pending), walk all.
    epoch: Option<u64>,
    /// Per stream, the earliest event the last pass found pending.
    earliest: smallvec::SmallVec<[(Mark, EventHandle); 8]>,
    /// Passes since the last full walk.
    partial: u32,
}

/// `record_stream`'d frees per harvest their threads run (see
/// [`PoolShared::pace_harvest`]): about one pass per 200 operations of
/// the serving workload with 30% of its blocks recorded, as often as a
/// stress thread used to call `harvest` itself.
const HARVEST_PACE: u32 = 32;

/// A harvest walks every record at least this often.
const FULL_PASS_EVERY: u32 = 32;

impl HarvestGate {
    /// Whether the kept records are as the last pass left them and none
    /// of the earliest events they wait for completed (`query`, unless
    /// one was found pending recently: see `event_order.rs`). Settles an
    /// event it finds complete.
    fn kept_unchanged(
        &mut self,
        epoch: u64,
        progress: &mut Progress,
        mut query: impl FnMut(EventHandle) -> bool,
    ) -> bool {
        if self.epoch != Some(epoch) || self.partial >= FULL_PASS_EVERY {
            return false;
        }
        for (m, e) in &self.earliest {
            if m.known_done() {
                return false;
            }
            if progress.held(m) {
                continue;
            }
            if query(*e) {
                m.completed();
                return false;
            }
            progress.saw_pending(m);
        }
        true
    }

    /// Starts a partial pass from the events known pending.
    fn seed(&mut self, progress: &mut Progress) {
        self.partial += 1;
        for (m, e) in self.earliest.drain(..) {
            progress.note_pending(&m, e);
        }
    }

    /// Starts a pass over every record.
    fn walk_all(&mut self) {
        self.partial = 0;
        self.earliest.clear();
    }

    /// Remembers what a pass that started at `epoch` found pending.
    fn update(&mut self, epoch: u64, progress: Progress) {
        self.epoch = (!progress.unmarked_pending).then_some(epoch);
        self.earliest = progress.into_earliest_pending();
    }
}
