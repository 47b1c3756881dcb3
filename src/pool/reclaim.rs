//! Reclaiming memory: harvesting pending frees, handing them over,
//! flushing streams' dirty memory, retiring empty slabs, and trimming.
//!
//! None of this runs on the fast path. Harvesting and handover never block
//! the host; only `trim` (an explicit call) and pool teardown wait for
//! events.

use super::heap::Tag;
use super::pending::{Pending, Waits};
use super::stream::STREAM_SLOTS;
use super::{HeapState, PoolShared, Stream};
use crate::error::{Error, Result};
use crate::ptr::StreamHandle;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;

impl PoolShared {
    /// Whether everything in `w` completed (never, while a stream is unrecorded).
    pub(super) fn waits_done(&self, w: &Waits) -> bool {
        w.unrecorded.is_empty()
            && w.events
                .iter()
                .all(|&e| match self.backend.query_event(self.dev, e) {
                    Ok(done) => done,
                    Err(err) => {
                        tracing::warn!(device = self.dev, "cuEventQuery failed: {err}");
                        false
                    }
                })
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
        for &e in &w.events {
            self.backend
                .stream_wait_event(self.dev, stream.handle(), e)?;
        }
        Ok(())
    }

    /// Releases every pending record whose events completed, without blocking.
    pub(super) fn harvest(&self) -> usize {
        let mut released = self.harvest_quarantine();
        if self.pending.is_empty() {
            return released;
        }
        for p in self.pending.take_all() {
            match p {
                Pending::Slots {
                    class,
                    slots,
                    waits,
                    bytes,
                } => {
                    if self.waits_done(&waits) {
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
                Pending::Group { id } => {
                    let mut h = self.heap.lock();
                    let done = h.group_events.get(&id).is_none_or(|w| self.waits_done(w));
                    if done {
                        h.heap.complete_pending(id);
                        if let Some(w) = h.group_events.remove(&id) {
                            self.recycle_events(w);
                        }
                        released += 1;
                    } else {
                        drop(h);
                        self.pending.push(Pending::Group { id });
                    }
                }
            }
        }
        released
    }

    /// Unmaps aliased granules whose old uses completed.
    pub(super) fn harvest_quarantine(&self) -> usize {
        let mut h = self.heap.lock();
        if h.quarantine.is_empty() {
            return 0;
        }
        let q = std::mem::take(&mut h.quarantine);
        let mut released = 0;
        for (w, gs) in q {
            if self.waits_done(&w) {
                h.heap.release_quarantine(&gs);
                self.recycle_events(w);
                released += 1;
            } else {
                h.quarantine.push((w, gs));
            }
        }
        released
    }

    /// Takes pending slots of `class` for `stream` by ordering the stream
    /// after their events on the device (no host sync).
    pub(super) fn handover_slots(&self, class: usize, stream: &Stream) -> Option<u32> {
        let slot = stream.slot()? as usize;
        let mut records = self.pending.take_all().into_iter();
        while let Some(p) = records.next() {
            match p {
                Pending::Slots {
                    class: c,
                    slots,
                    waits,
                    bytes,
                } if c as usize == class && waits.unrecorded.is_empty() => {
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
    pub(super) fn flush_slot(&self, slot: usize, handle: StreamHandle) {
        for class in 0..self.slabs.classes.len() {
            let idxs = self.slabs.take_dirty(class, slot);
            if !idxs.is_empty() {
                self.park_slots(class, idxs, handle, &[]);
            }
        }
        let mut h = self.heap.lock();
        for (_, addr) in h.exact.drain_slot(slot as u16) {
            h.heap
                .free(addr, Tag::Dirty(slot as u16))
                .expect("parked ranges are allocated");
        }
        if let Some((id, _)) = h.heap.flush_dirty(slot as u16) {
            let waits = self.record_events(handle, &[]);
            h.group_events.insert(id, waits);
            drop(h);
            self.pending.push(Pending::Group { id });
        }
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
        for slot in 0..STREAM_SLOTS {
            if let Some(h) = self.streams.handle(slot) {
                self.flush_slot(slot, h);
            }
        }
        true
    }

    /// Makes free memory reusable across streams and classes: flushes every
    /// stream's dirty memory (the requester gets its own back by handover),
    /// harvests, and retires empty slabs.
    pub(super) fn reclaim(&self) {
        super::magazine::flush_for(self);
        for slot in 0..STREAM_SLOTS {
            if let Some(h) = self.streams.handle(slot) {
                self.flush_slot(slot, h);
            }
        }
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
        // No maintenance step in between: one that flushed streams after
        // the flush below would leave pending memory behind.
        let _gate = self.maint_gate.lock();
        super::magazine::flush_for(self);
        for slot in 0..STREAM_SLOTS {
            if let Some(h) = self.streams.handle(slot) {
                self.flush_slot(slot, h);
            }
        }
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
                self.backend.sync_event(self.dev, e)?;
            }
            for &s in &w.unrecorded {
                self.backend.sync_stream(self.dev, s)?;
            }
            Ok(())
        };
        let mut result = Ok(());
        for p in records {
            let r = match &p {
                Pending::Slots { waits, .. } => sync(waits).map(|()| {
                    let Pending::Slots { waits, .. } = &p else {
                        unreachable!()
                    };
                    waits.clone()
                }),
                Pending::Group { id } => {
                    let h = self.heap.lock();
                    let w = h.group_events.get(id).cloned().unwrap_or_default();
                    drop(h);
                    sync(&w).map(|()| w)
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

    pub(super) fn mark_synced(p: Pending, heap: &Mutex<HeapState>) -> Pending {
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
            Pending::Group { id } => {
                if let Some(w) = heap.lock().group_events.get_mut(&id) {
                    w.unrecorded.clear();
                }
                Pending::Group { id }
            }
        }
    }

    /// A stream is going away: park what it freed, then destroy it if owned.
    pub(crate) fn retire_stream(&self, handle: StreamHandle, slot: Option<u16>, owned: bool) {
        if let Some(s) = slot {
            self.flush_slot(s as usize, handle);
            if owned {
                self.streams.release(s);
            }
        }
        if owned {
            if let Err(e) = self.backend.destroy_stream(self.dev, handle) {
                tracing::warn!(device = self.dev, "cuStreamDestroy failed: {e}");
            }
        }
    }
}
