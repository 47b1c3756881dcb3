//! The large path of a device pool: large requests served from the heap
//! (best fit over the device's virtual-address space, granules mapped on
//! demand), the order of fallbacks before out of memory, and the side
//! effects of taking pending memory (handover) or aliased granules.

use super::heap::{self, Tag};
use super::pending::{Pending, Waits};
use super::size_class::ALIGN;
use super::{HeapState, LargeLive, PoolShared, Stream};
use crate::error::Result;
use parking_lot::MutexGuard;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

/// Which pending memory a heap allocation may take (by handover, or by
/// stitching its idle granules); none while handover is off or a capture
/// is underway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PendingUse {
    /// None: backed memory and growth only.
    None,
    /// Groups whose streams drain soon (`Waits::drains_soon`): the step
    /// before growth.
    Draining,
    /// Any group that can be waited on: the device or the cap is full.
    Any,
}

/// How far above its live bytes the device may grow for a stream whose
/// parked ranges another stream took (see `alloc_large`): 32 MiB, or an
/// eighth of the live bytes where that is more. Within it, the streams of
/// a small working set keep a range each, as PyTorch's per-stream pools
/// do; a large working set's streams share, as before, and reserved
/// memory stays within an eighth of live bytes for this.
fn own_range_slack(live: u64) -> u64 {
    (32 << 20u64).max(live / 8)
}

impl PoolShared {
    /// A large range of `len` bytes (or, from the parking cache, up to
    /// 3/64 more): `(addr, its length)`.
    pub(super) fn alloc_large(
        &self,
        len: u64,
        live: LargeLive,
        stream: &Stream,
    ) -> Result<(u64, u64)> {
        let size = live.requested;
        // A range the stream parked: its lock alone, never the heap's.
        if let Some(r) = stream
            .slot()
            .and_then(|s| self.by_stream.take_parked(s, len, live))
        {
            return Ok(r);
        }
        let keep = |_: &mut HeapState, addr: u64| {
            if live.raw {
                self.by_stream.insert(stream.slot(), addr, len, live);
            }
            Ok((addr, len))
        };
        {
            let mut h = self.heap.lock();
            if let Some(t) = h.heap.alloc_backed(len, ALIGN, stream.slot()) {
                return keep(&mut h, t.addr);
            }
            // The stream's own parked ranges, merged with their neighbours
            // in the heap (still its own to reuse): a loop whose sizes
            // vary finds there what no parked range fits exactly, with no
            // query, event or driver call. (A stream repeating 3, 12 and
            // 5 MiB took the slow path once every three allocations.)
            if let Some(s) = stream.slot() {
                let hh = &mut h.heap;
                if self
                    .by_stream
                    .drain_slot_sorted(s, |ranges| hh.free_many(ranges, Tag::Dirty(s)))
                {
                    if let Some(t) = h.heap.alloc_backed(len, ALIGN, stream.slot()) {
                        return keep(&mut h, t.addr);
                    }
                }
            }
        }
        // The slow path from here on (events, growth, stitching): first,
        // is this stream capturing a graph the pool was not told about?
        self.counters.large_slow.fetch_add(1, Relaxed);
        self.detect_capture(stream);
        // A stream whose parked ranges another stream's slow path took
        // grows, if the device stays within `own_range_slack` of its live
        // bytes, instead of taking another's in turn: else one thread
        // taking turns on several streams hands one range round them, each
        // allocation a slow path with its stream queries (4 streams, one
        // 3 MiB block each: 3 driver calls and 3 heap locks a pair, for
        // ever).
        if stream
            .slot()
            .is_some_and(|s| self.by_stream.take_parks_taken(s))
        {
            let live = self.counters.totals().1;
            let mut h = self.heap.lock();
            if h.heap.reserved() + len <= live + own_range_slack(live) {
                if let Some(t) = self.heap_alloc_or_oom(&mut h, len, stream, PendingUse::None)? {
                    return keep(&mut h, t.addr);
                }
            }
        }
        // Parked ranges, merged with their neighbours, often fit where
        // none did: every stream's to the heap before any handover or
        // growth, clean for every stream where their streams have run all
        // their work, as are those streams' dirty ranges (a query each, no
        // event, no wait; see `idle.rs`).
        let idle = self.query_idle(stream.slot());
        let cleaned = {
            let mut h = self.heap.lock();
            let (unparked, cleaned) = self.unpark_reusing(&mut h, &idle, stream.slot());
            if unparked || cleaned {
                if let Some(t) = h.heap.alloc_backed(len, ALIGN, stream.slot()) {
                    return keep(&mut h, t.addr);
                }
            }
            cleaned
        };
        let busy = idle.busy().to_vec();
        drop(idle);
        // Memory whose uses are complete, by any stream, before growing:
        // other streams' dirty memory is flushed (one event per busy stream,
        // no wait) when it would cover the request, and completed frees are
        // harvested (queries only). Some dirty memory elsewhere is needed
        // however much is parked: with none, the flush would only make
        // this stream's own free memory pending, and every other thread
        // that shares the stream would grow the device beside it until
        // the event was recorded. Clean memory that still does not serve
        // the request is fragmented: the same reclaim retires empty slabs,
        // whose ranges merge with it (without it, reserved memory rose to
        // 1.75-1.95x live at 8 streams, and stitching with it).
        let flush_others = cleaned || {
            let h = self.heap.lock();
            h.heap.dirty_elsewhere_at_least(
                stream.slot(),
                len.saturating_sub(self.by_stream.parked_bytes()).max(1),
            )
        };
        if flush_others {
            self.reclaim_knowing_busy(&busy);
        } else if !self.no_pending() {
            self.try_harvest();
        }
        {
            let mut h = self.heap.lock();
            if let Some(t) = h.heap.alloc_backed(len, ALIGN, stream.slot()) {
                return keep(&mut h, t.addr);
            }
            if let Some(t) = self.own_pending(&mut h, len, stream).transpose()? {
                return keep(&mut h, t.addr);
            }
            // Pending memory whose streams are progressing: the wait on the
            // device ends soon, and the pool does not grow beside it (a
            // stream running behind the host keeps much of the device
            // pending). Never memory behind a stalled stream.
            if self.handover_ok() {
                let (order, now) = (&stream.core().order, super::event_order::now_ns());
                let soon = |w: &Waits| w.drains_soon(order, now);
                if let Some(t) = self.handover(&mut h, len, stream, soon)? {
                    return keep(&mut h, t.addr);
                }
            }
            // Then growth, before any other handover: a stream is made to
            // wait on a slow or stalled stream's work only when the device
            // (or the cap) has no room left, as `cudaMallocAsync` inserts
            // its internal dependencies only when it cannot map more.
            if let Some(t) = self.heap_alloc_or_oom(&mut h, len, stream, PendingUse::Draining)? {
                return keep(&mut h, t.addr);
            }
        }
        // Addresses of granules that stitching aliased (the quarantine) are
        // held until their old uses complete, and only a harvest frees
        // them. With no pending record to start one, a loop that stitches
        // uses the whole reservation up with them, and its requests would
        // take the at-capacity path below (a flush of every stream) on a
        // device far from full: harvest them (waiting for a harvest another
        // thread runs, which may be releasing them), and try growth again.
        if self.quarantined.load(Acquire) {
            self.harvest();
            let mut h = self.heap.lock();
            if let Some(t) = self.heap_alloc_or_oom(&mut h, len, stream, PendingUse::Draining)? {
                return keep(&mut h, t.addr);
            }
        }
        // At capacity: every stream's freed memory to the pending list,
        // completed frees harvested, then pending memory by handover (the
        // stream waits on the device, never the host).
        self.counters.retries.fetch_add(1, Relaxed);
        self.reclaim();
        {
            let mut h = self.heap.lock();
            if let Some(t) = h.heap.alloc_backed(len, ALIGN, stream.slot()) {
                return keep(&mut h, t.addr);
            }
            if let Some(t) = self.take_pending(&mut h, len, stream)? {
                return keep(&mut h, t.addr);
            }
        }
        // The way to out of memory: wait for what is in flight, then the
        // last attempts.
        self.wait_before_oom();
        let last = self.last_attempts(|| {
            let mut h = self.heap.lock();
            self.unpark(&mut h);
            match self.take_pending(&mut h, len, stream)? {
                Some(t) => keep(&mut h, t.addr).map(Some),
                None => Ok(None),
            }
        })?;
        last.ok_or_else(|| self.oom(size))
    }

    /// Backed memory pending only behind this stream's own events (its
    /// dirty memory, flushed): the stream reuses it with no wait, as stream
    /// order already puts new work after those uses. Not during a capture.
    fn own_pending(
        &self,
        h: &mut HeapState,
        len: u64,
        stream: &Stream,
    ) -> Option<Result<heap::Taken>> {
        if self.capture.underway() {
            return None;
        }
        let order = &stream.core().order;
        let events = &h.group_events;
        let r = h
            .heap
            .alloc_pending_backed(len, ALIGN, stream.slot(), |id| {
                events.get(&id).is_some_and(|w| w.ordered_before(order))
            })?;
        Some(self.finish_taken(h, r, stream))
    }

    /// A large request that neither backed memory nor growth serves (the
    /// device or the cap is full), in order: a backed pending range by
    /// handover, a run of adjacent backed ranges with different tags
    /// (`handover_run`), then the heap's best fit, whose stitching may also
    /// take idle granules of pending memory (the stream waits on their
    /// groups on the device). Out of memory is `None`.
    fn take_pending(
        &self,
        h: &mut MutexGuard<'_, HeapState>,
        len: u64,
        stream: &Stream,
    ) -> Result<Option<heap::Taken>> {
        // Streams that drain first: a stalled one's memory is the last
        // taken before the host waits.
        let (order, now) = (&stream.core().order, super::event_order::now_ns());
        let soon = |w: &Waits| w.drains_soon(order, now);
        if let Some(t) = self.handover(h, len, stream, soon)? {
            return Ok(Some(t));
        }
        let any = |w: &Waits| w.unrecorded.is_empty();
        if let Some(t) = self.handover(h, len, stream, any)? {
            return Ok(Some(t));
        }
        self.heap_alloc_or_oom(h, len, stream, PendingUse::Any)
    }

    /// A backed pending range, or a run of backed ranges (`handover_run`),
    /// of groups that are `usable`, taken by handover.
    fn handover(
        &self,
        h: &mut HeapState,
        len: u64,
        stream: &Stream,
        usable: impl Fn(&Waits) -> bool + Copy,
    ) -> Result<Option<heap::Taken>> {
        match self.handover_backed(h, len, ALIGN, stream, usable) {
            Some(Ok(t)) => return Ok(Some(t)),
            Some(Err(e)) if !e.is_oom() => return Err(e),
            _ => {}
        }
        self.handover_run(h, len, stream, usable).transpose()
    }

    /// [`PoolShared::heap_alloc`] for a large block, with out of memory as
    /// `None` (the caller tries harder) and other errors passed on.
    fn heap_alloc_or_oom(
        &self,
        h: &mut MutexGuard<'_, HeapState>,
        len: u64,
        stream: &Stream,
        pending: PendingUse,
    ) -> Result<Option<heap::Taken>> {
        match self.heap_alloc(h, len, ALIGN, stream, pending) {
            Ok(t) => Ok(Some(t)),
            Err(e) if e.is_oom() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Gives every parked large range to the heap (see `stream_large.rs`);
    /// whether there was any.
    /// Runs under the heap lock (the slot locks nest inside it).
    pub(super) fn unpark(&self, h: &mut HeapState) -> bool {
        if self.by_stream.nothing_parked() {
            return false;
        }
        self.by_stream.drain_sorted(
            |_, _, _| false,
            |slot, _, ranges| h.heap.free_many(ranges, Tag::Dirty(slot)),
        );
        true
    }

    /// One heap allocation for `stream`, with its side effects handled:
    /// the stream waits on any pending groups it takes memory from, and
    /// granules aliased by stitching get an event on the stream. The
    /// driver maps new memory with the heap lock released (`h` is
    /// unlocked meanwhile, see `heap/map_job.rs`).
    pub(super) fn heap_alloc(
        &self,
        h: &mut MutexGuard<'_, HeapState>,
        len: u64,
        align: u64,
        stream: &Stream,
        pending: PendingUse,
    ) -> Result<heap::Taken> {
        let device_allocs = h.heap.device_allocs;
        let pending_ok = pending != PendingUse::None && self.handover_ok();
        // One plan, its driver calls with the lock released, and its
        // publication; the blocked groups are set under the lock of the
        // plan that reads them (another request sets its own meanwhile).
        let once = |h: &mut MutexGuard<'_, HeapState>| {
            if pending_ok {
                self.set_blocked(h, pending, stream);
            }
            match h.heap.alloc_planned(len, align, stream.slot(), pending_ok) {
                Ok((t, Some(job))) => {
                    let capture = self.mapping_job();
                    let done = self.heap.unlocked(h, || job.run());
                    drop(capture);
                    h.heap.finish_alloc(t, job, done)
                }
                r => r.map(|(t, _)| t),
            }
        };
        // A growth the device refused is planned again, stealing.
        let r = match once(h) {
            Err(_) if h.heap.growth_refused() => once(h),
            r => r,
        };
        if h.heap.device_allocs != device_allocs {
            self.counters.grown.fetch_add(1, Relaxed);
            // Grew while other streams sit on freed memory: have the
            // maintenance step make it reusable by all (a single-stream
            // workload never pays for this).
            if h.heap.dirty_elsewhere_at_least(stream.slot(), 1) {
                self.flush_wanted.store(true, Relaxed);
            }
            self.counters
                .peak_reserved
                .fetch_max(h.heap.reserved(), Relaxed);
        }
        self.finish_taken(h, r, stream)
    }

    /// Sets the pending groups a heap allocation for `stream` may not
    /// take. A group with a stream whose event could not be recorded
    /// cannot be waited on (only `trim` releases it): the heap must
    /// neither hand it over nor stitch its granules. Before growth
    /// (`Draining`), neither may a group behind a stream that is not
    /// draining.
    fn set_blocked(&self, h: &mut HeapState, pending: PendingUse, stream: &Stream) {
        let (order, now) = (&stream.core().order, super::event_order::now_ns());
        let HeapState {
            heap, group_events, ..
        } = h;
        heap.set_blocked(
            group_events
                .iter()
                .filter(|(_, w)| match pending {
                    PendingUse::Draining => !w.drains_soon(order, now),
                    _ => !w.unrecorded.is_empty(),
                })
                .map(|(&id, _)| id),
        );
    }

    /// Memory the heap already backs, from a pending range handed over:
    /// the stream waits on the range's events on the device (see
    /// `finish_taken`). `None` when handover is off or nothing fits.
    fn handover_backed(
        &self,
        h: &mut HeapState,
        len: u64,
        align: u64,
        stream: &Stream,
        usable: impl Fn(&Waits) -> bool,
    ) -> Option<Result<heap::Taken>> {
        if !self.handover_ok() {
            return None;
        }
        // Groups with a stream whose event could not be recorded cannot be
        // waited on: only trim releases them.
        let events = &h.group_events;
        let r = h
            .heap
            .alloc_pending_backed(len, align, stream.slot(), |id| {
                events.get(&id).is_some_and(&usable)
            })?;
        Some(self.finish_taken(h, r, stream))
    }

    /// Memory the heap already backs, from a run of adjacent free ranges
    /// with different tags (clean, dirty on this stream, pending groups),
    /// for a request no single free range serves: such neighbours never
    /// merge, so without this their memory is stranded and the pool grows
    /// beside it. The stream first waits on the run's pending groups on
    /// the device (no host sync), then takes the run. `None` when handover
    /// is off, the stream has no slot, or no run fits.
    fn handover_run(
        &self,
        h: &mut HeapState,
        len: u64,
        stream: &Stream,
        usable: impl Fn(&Waits) -> bool,
    ) -> Option<Result<heap::Taken>> {
        if !self.handover_ok() {
            return None;
        }
        let slot = stream.slot()?;
        // As in `handover_backed`: groups with an unrecorded stream cannot
        // be waited on.
        let events = &h.group_events;
        let (start, ids) = h
            .heap
            .find_run(len, ALIGN, slot, |id| events.get(&id).is_some_and(&usable))?;
        for id in &ids {
            let w = h.group_events.get(id).cloned().unwrap_or_default();
            // Nothing is taken yet: a failed wait leaves the heap as it was
            // (the waits already made only delay the stream).
            if let Err(e) = self.wait_on(stream, &w) {
                return Some(Err(e));
            }
        }
        let t = h.heap.take_run(start, len, slot)?;
        if !ids.is_empty() {
            self.counters.handovers.fetch_add(1, Relaxed);
        }
        Some(Ok(t))
    }

    /// The side effects of a heap allocation: the stream waits on any
    /// pending groups it takes memory from, and granules aliased by
    /// stitching get an event on the stream.
    pub(super) fn finish_taken(
        &self,
        h: &mut HeapState,
        r: Result<heap::Taken>,
        stream: &Stream,
    ) -> Result<heap::Taken> {
        // Order the stream after every pending group it takes memory from
        // (its range's own, and those of aliased granules) *before* the
        // quarantine event is recorded on it: that event then completes only
        // after every old use of the aliased chunks.
        let mut ids = h.heap.take_steal_waits();
        if let Ok(t) = &r {
            ids.extend(&t.waits);
        }
        ids.sort_unstable();
        ids.dedup();
        let mut waited = Ok(());
        for id in &ids {
            let w = h.group_events.get(id).cloned().unwrap_or_default();
            if let Err(e) = self.wait_on(stream, &w) {
                waited = Err(e);
                break;
            }
        }
        if let Err(e) = &waited {
            // A device-side wait failed: wait on the host instead (an error
            // path, like the way to out of memory), which orders everything
            // after those uses just as well.
            tracing::warn!(
                device = self.dev,
                "cuStreamWaitEvent failed ({e}); waiting on the host"
            );
            if self.sync_groups(h, &ids).is_ok() {
                waited = Ok(());
            }
        }
        let q = h.heap.take_quarantine();
        if !q.is_empty() {
            let waits = match waited {
                Ok(()) => self.record_events(stream.core(), &[]),
                // Without the waits, only trim (which syncs everything
                // pending first) may release these granules.
                Err(_) => Waits {
                    events: Vec::new(),
                    marks: Vec::new(),
                    unrecorded: vec![stream.core().clone()],
                    promised: Default::default(),
                },
            };
            h.quarantine.push((waits, q));
            self.quarantined.store(true, Release);
        }
        let t = r?;
        if let Err(e) = waited {
            // The range may hold chunks of pending memory whose uses neither
            // this stream nor the host could wait for: it goes back as a
            // pending group of its own that only `trim` (which syncs every
            // pending use first) releases, never under its old tag.
            let id = h.heap.new_pending_group();
            h.heap
                .free(t.addr, Tag::Pending(id))
                .expect("just allocated");
            h.insert_group(
                id,
                Waits {
                    events: Vec::new(),
                    marks: Vec::new(),
                    unrecorded: vec![stream.core().clone()],
                    promised: Default::default(),
                },
            );
            self.pending.push(Pending::Group { id });
            return Err(e);
        }
        if !ids.is_empty() {
            self.counters.handovers.fetch_add(1, Relaxed);
        }
        Ok(t)
    }

    /// Waits on the host for every pending heap group's uses and makes its
    /// memory clean, whether or not its record is on the pending list (a
    /// harvesting thread may hold it: it then finds the group done).
    /// Out-of-memory path only.
    pub(super) fn complete_groups_on_host(&self) {
        let groups: Vec<(u32, Waits)> = {
            let h = self.heap.lock();
            h.group_events
                .iter()
                .map(|(&id, w)| (id, w.clone()))
                .collect()
        };
        for (id, w) in groups {
            if self.host_sync_waits(&w).is_err() {
                continue;
            }
            let mut h = self.heap.lock();
            // Still the same group (not completed and replaced meanwhile).
            let same = h.group_events.get(&id).is_some_and(|now| now.same_as(&w));
            if same {
                h.heap.complete_pending(id);
                if let Some(w) = h.group_events.remove(&id) {
                    self.recycle_events(w);
                }
                // Its record, still listed, is now done: the next harvest
                // must walk (see `HarvestGate`).
                self.kept.touch();
            }
        }
    }

    /// Blocks the host until every use of pending groups `ids` completed
    /// (error paths only).
    fn sync_groups(&self, h: &HeapState, ids: &[u32]) -> Result<()> {
        for id in ids {
            if let Some(w) = h.group_events.get(id) {
                self.host_sync_waits(w)?;
            }
        }
        Ok(())
    }
}
