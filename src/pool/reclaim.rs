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
use std::collections::HashMap;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
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
        w.events.iter().enumerate().all(|(i, &e)| {
            let mark = w.mark(i);
            if mark.is_some_and(Mark::known_done) {
                return true;
            }
            if mark.is_some_and(|m| progress.known_pending(m)) {
                return false;
            }
            let done = self.event_done(e);
            if let Some(m) = mark {
                if done {
                    m.completed();
                } else {
                    progress.note_pending(m);
                }
            }
            done
        })
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
                Pending::Slots { waits, .. } | Pending::Orphans { waits, .. } => note(waits),
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

    /// [`PoolShared::waits_done_in`] on its own.
    pub(super) fn waits_done(&self, w: &Waits) -> bool {
        self.waits_done_in(w, &mut Progress::default())
    }

    pub(super) fn recycle_events(&self, w: Waits) {
        for e in w.events {
            self.event_pool.lock().push(e);
        }
    }

    /// Orders `stream` after everything in `w` on the device.
    pub(super) fn wait_on(&self, stream: &Stream, w: &Waits) -> Result<()> {
        if !w.unrecorded.is_empty() {
            return Err(Error::InvalidArgument(
                "memory with unrecorded uses cannot be handed over".into(),
            ));
        }
        let order = &stream.core().order;
        for (i, &e) in w.events.iter().enumerate() {
            // Work on the stream already runs after its own events.
            if w.needs_no_wait(i, order) {
                continue;
            }
            self.outside_capture(|| self.backend.stream_wait_event(self.dev, stream.handle(), e))
                .ok_or_else(|| self.capture_error("a handover"))??;
        }
        Ok(())
    }

    /// Releases every pending record whose events completed, without blocking.
    pub(super) fn harvest(&self) -> usize {
        // Nothing can be queried during a capture: skip the walk.
        if self.capture.underway() {
            return 0;
        }
        let mut progress = Progress::default();
        let mut released = self.harvest_quarantine(&mut progress);
        if self.pending.is_empty() {
            return released;
        }
        // A few queries per stream settle every marked event (see
        // `event_order.rs`); what is left unmarked is queried below.
        let records = self.pending.take_all();
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
                        self.pending.push(Pending::Slots {
                            class,
                            slots,
                            waits,
                            bytes,
                        });
                    }
                }
                Pending::Orphans {
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
                        self.pending.push(Pending::Orphans {
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
                    self.pending.push(Pending::Group { id });
                }
            }
        }
        released
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
        let mut records = self.pending.take_all().into_iter();
        while let Some(p) = records.next() {
            match p {
                Pending::Slots {
                    class: c,
                    slots,
                    waits,
                    bytes,
                } if c as usize == class && usable(&waits) => {
                    if let Err(e) = self.wait_on(stream, &waits) {
                        tracing::warn!(device = self.dev, "handover failed: {e}");
                        self.pending.push(Pending::Slots {
                            class: c,
                            slots,
                            waits,
                            bytes,
                        });
                        continue;
                    }
                    self.counters.pending_slot_bytes.fetch_sub(bytes, Relaxed);
                    self.counters.handovers.fetch_add(1, Relaxed);
                    self.recycle_events(waits);
                    for other in records {
                        self.pending.push(other);
                    }
                    let (first, rest) = slots.split_first()?;
                    self.slabs.push_dirty_many(class, slot, rest);
                    return Some(*first);
                }
                other => self.pending.push(other),
            }
        }
        None
    }

    /// Moves the memory that stream slot `slot` freed onto the pending list,
    /// with one event recorded on that stream, so that other streams can
    /// reuse it once the event completes.
    pub(super) fn flush_slot(&self, slot: usize, core: &Arc<StreamCore>) {
        for class in 0..self.slabs.classes.len() {
            let idxs = self.slabs.take_dirty(class, slot);
            if !idxs.is_empty() {
                self.park_slots(class, idxs, core, &[]);
            }
        }
        let mut h = self.heap.lock();
        for (_, addr) in h.exact.drain_slot(slot as u16) {
            h.heap
                .free(addr, Tag::Dirty(slot as u16))
                .expect("parked ranges are allocated");
        }
        let Some((id, _)) = h.heap.flush_dirty(slot as u16) else {
            return;
        };
        // The event is recorded outside the heap lock (no driver call runs
        // under it). Until then the group reads as unrecorded on this
        // stream: nothing hands it over or steals its granules, and only a
        // host sync of the stream (the way to out of memory) completes it.
        h.group_events.insert(
            id,
            Waits {
                unrecorded: vec![core.clone()],
                ..Waits::default()
            },
        );
        drop(h);
        let waits = self.record_events(core, &[]);
        let mut h = self.heap.lock();
        match h.group_events.get_mut(&id) {
            Some(w) => {
                *w = waits;
                drop(h);
                self.pending.push(Pending::Group { id });
            }
            // Completed on the host meanwhile.
            None => {
                drop(h);
                self.recycle_events(waits);
            }
        }
    }

    /// Flushes the dirty memory of every live stream (see `flush_slot`).
    /// Each stream is held while it is flushed, so none is destroyed under
    /// the flush; the last reference may retire a stream here, after its
    /// flush and outside every lock.
    pub(crate) fn flush_all_streams(&self) {
        // What a flush makes pending cannot be harvested during a capture,
        // and a capturing stream must not record: wait for its end.
        if self.capture.underway() {
            return;
        }
        let live = self.streams.live();
        for s in &live {
            if let Some(slot) = s.slot() {
                self.flush_slot(slot as usize, s.core());
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
        super::magazine::flush_for(self);
        self.flush_all_streams();
        self.harvest();
        self.retire_empty_slabs();
    }

    /// Returns every slab whose slots are all on its class's clean stack to
    /// the heap.
    pub(super) fn retire_empty_slabs(&self) -> u64 {
        let mut h = self.heap.lock();
        let mut freed = 0;
        for class in 0..self.slabs.classes.len() {
            let clean = self.slabs.take_clean(class);
            if clean.is_empty() {
                continue;
            }
            let mut per_slab: HashMap<u32, Vec<u32>> = HashMap::new();
            for idx in clean {
                per_slab
                    .entry(self.slabs.slab_of(idx))
                    .or_default()
                    .push(idx);
            }
            let mut keep = Vec::new();
            for (id, idxs) in per_slab {
                let (base, c, n) = self.slabs.slab_info(id);
                if idxs.len() as u32 == n && c == class {
                    self.slab_index.remove(base, self.slabs.slab_bytes(class));
                    self.slabs.retire(id);
                    h.free_slab_ids[class].push(id);
                    h.heap
                        .free(base, Tag::Clean)
                        .expect("slabs are allocated ranges");
                    h.slab_bytes -= self.slabs.slab_bytes(class);
                    h.slab_tail_bytes -= self.slabs.tail_bytes(class);
                    freed += self.slabs.slab_bytes(class);
                } else {
                    keep.extend(idxs);
                }
            }
            self.slabs.push_clean(class, &keep);
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
        let records = self.pending.take_all();
        let sync = |w: &Waits| -> Result<()> {
            for &e in &w.events {
                self.host_sync_event(e)?;
            }
            for s in &w.unrecorded {
                if !s.is_dead() {
                    self.host_sync_stream(s.handle)?;
                }
            }
            Ok(())
        };
        let mut result = Ok(());
        for p in records {
            let r = match &p {
                Pending::Slots { waits, .. } | Pending::Orphans { waits, .. } => sync(waits),
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
                Pending::Slots {
                    class,
                    slots,
                    waits,
                    bytes,
                }
            }
            Pending::Orphans {
                parts,
                mut waits,
                bytes,
            } => {
                waits.unrecorded.clear();
                Pending::Orphans {
                    parts,
                    waits,
                    bytes,
                }
            }
            Pending::Group { id } => {
                if let Some(w) = heap.lock().group_events.get_mut(&id) {
                    w.unrecorded.clear();
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
