//! Promises and probes: a free that must wait for a stream's uses records
//! no event there; one event per stream, a probe, later covers every such
//! free at once.
//!
//! A free used on streams (`record_stream`) must not be reused by another
//! stream before those streams' uses complete. PyTorch records one event
//! per stream at every such free. Here a small slot's free (`returning.rs`)
//! takes a *promise* on each ordinary stream instead ([`Mark::promise`];
//! a large block's free still records events: with promises there, a
//! 600 s soak's reserved memory kept growing): the number the stream's
//! next recorded event will get. Every event recorded on the stream after
//! the free comes after the free's uses there, so the first one recorded
//! and found complete completes the promise, and every other promise made
//! on that stream before it.
//!
//! Who records, at most one probe per stream per *probe interval*
//! (`PoolConfig::probe_interval`, 500 µs) outside an allocation's slow
//! path:
//! - the free itself, when its stream had none for an interval (a quiet
//!   stream's probe then completes as early as PyTorch's event would, and
//!   its completion is the evidence that the stream progresses);
//! - a pass that finds a promise not known done (a harvest, a stream
//!   settling its returning slots) and no probe in flight that covers it:
//!   at once for an allocation's slow path (it needs the memory now), else
//!   once the interval has passed;
//! - a handover that must wait on a promise: it waits on the oldest probe
//!   covering it, or records an event there now, which joins the probes;
//! - the host paths (trim, the way to out of memory, teardown) wait on the
//!   covering probe, or record one and wait.
//!
//! A stream that many frees touch costs one event per interval or round
//! trip, not one per free.
//!
//! A per-thread default stream of another thread cannot be recorded on
//! from every thread, a retired stream takes no promise (its handle may
//! go), and a dead one none either: those frees record their events at
//! once, as before. A retiring stream with an uncovered promise records a
//! probe while its handle is valid (`StreamInner`'s drop).
//!
//! Invariants:
//! 1. A promise is complete only when an event numbered at or after its
//!    mark on its stream was found complete (`Mark::completed`).
//! 2. A probe is in its stream's `EventOrder::probes` from its record
//!    until a query finds it complete or the teardown; its event is in no
//!    other waits. The order is in the pool's `probed` list exactly while
//!    that list is not empty (both change under the order's lock), so
//!    teardown finds every probe of streams already gone.
//! 3. No driver call runs under a probes lock. Locks nest order's
//!    `probes`, then the pool's `probed`, never the other way round.
//!
//! A query locks only its own stream's list: streams do not share a lock
//! or scan each other's probes.

use super::event_order::{now_ns, Mark, Progress};
use super::pending::{Promise, Promises, Waits};
use super::{PoolShared, StreamCore};
use crate::ptr::EventHandle;
use smallvec::SmallVec;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

impl PoolShared {
    /// Whether a stream whose last probe was recorded at `last` (0: never)
    /// may get another at `now` outside an allocation's slow path: at most
    /// a few thousand events a second per stream, and memory behind a
    /// promise waits about the interval at most for its probe.
    fn probe_due(&self, last: u64, now: u64) -> bool {
        last == 0 || now.saturating_sub(last) >= self.cfg.probe_interval.as_nanos() as u64
    }

    /// What a free waits for on `streams`: a promise on each stream that
    /// can take one, an event on the others.
    pub(super) fn waits_on(&self, streams: &[&Arc<StreamCore>]) -> Waits {
        let mut promised = Promises::new();
        let mut direct: SmallVec<[Arc<StreamCore>; 2]> = SmallVec::new();
        for &c in streams {
            let mark = (c.thread.is_none() && !c.is_dead())
                .then(|| Mark::promise(&c.order))
                .flatten();
            match mark {
                Some(mark) => promised.push(Promise {
                    core: c.clone(),
                    mark,
                }),
                None => direct.push(c.clone()),
            }
        }
        // A stream quiet for an interval gets its probe now, at the free
        // (as PyTorch's event would be): it completes as early, and it is
        // the evidence that the stream progresses (`drains_soon`).
        let now = now_ns();
        for p in &promised {
            let order = &p.mark.order;
            let last = order.probed_at.load(Relaxed);
            if self.probe_due(last, now)
                && order
                    .probed_at
                    .compare_exchange(last, now, Relaxed, Relaxed)
                    .is_ok()
            {
                self.record_probe(&p.core);
            }
        }
        let mut w = self.record_events_on(&direct);
        w.promised = promised;
        w
    }

    /// Whether promise `p` is known done, within a pass that learned
    /// `progress`. If not: queries its stream's probes in flight, records
    /// one when none is and the interval has passed, and notes in
    /// `progress` what the next pass must look at.
    pub(super) fn promise_done_in(&self, p: &Promise, progress: &mut Progress) -> bool {
        if p.mark.known_done() {
            return true;
        }
        if progress.known_pending(&p.mark) {
            return false;
        }
        // Twice at most: a probe recorded in the first round is queried
        // in the second (an idle stream completes the promise at once).
        for round in 0..2 {
            let in_flight = self.query_probes(&p.mark, progress);
            if p.mark.known_done() {
                return true;
            }
            match in_flight {
                // One that covers it, or an older one (the next probe is
                // recorded once it is done): nothing changes before it
                // completes, which the next pass asks first.
                Some((m, ev)) => {
                    progress.note_pending(&m, ev);
                    return false;
                }
                None => {
                    let due = progress.urgent
                        || self.probe_due(p.mark.order.probed_at.load(Relaxed), now_ns());
                    if round == 1 || !due || self.capture.underway() {
                        break;
                    }
                    self.record_probe(&p.core);
                }
            }
        }
        // Nothing in flight covers it: the next pass looks again.
        progress.unmarked_pending = true;
        false
    }

    /// Queries the probes in flight on `m`'s stream, newest first (one
    /// found complete completes the older ones), outside its lock; pools
    /// the events of those done. Returns the newest still in flight.
    /// In `progress`'s pass, a probe found pending recently counts as in
    /// flight without a query (see `event_order.rs`).
    fn query_probes(&self, m: &Mark, progress: &mut Progress) -> Option<(Mark, EventHandle)> {
        let mut mine = m.order.probes.lock().clone();
        if mine.is_empty() {
            return None;
        }
        mine.sort_unstable_by_key(|&(seq, _)| std::cmp::Reverse(seq));
        let mark = |seq| Mark {
            order: m.order.clone(),
            seq,
        };
        let mut in_flight = None;
        for (seq, ev) in mine {
            if m.order.done_through(seq) {
                break;
            }
            if !progress.held(&mark(seq)) {
                if self.event_done(ev) {
                    mark(seq).completed();
                    break;
                }
                progress.saw_pending(&mark(seq));
            }
            if in_flight.is_none() {
                in_flight = Some((mark(seq), ev));
            }
        }
        let done = {
            let mut probes = m.order.probes.lock();
            let mut done = SmallVec::<[EventHandle; 2]>::new();
            probes.retain(|&mut (seq, ev)| {
                let keep = !m.order.done_through(seq);
                if !keep {
                    done.push(ev);
                }
                keep
            });
            if probes.is_empty() && !done.is_empty() {
                self.probed.lock().retain(|o| !Arc::ptr_eq(o, &m.order));
            }
            done
        };
        self.events.give_back_all(done);
        in_flight
    }

    /// The event of the oldest probe in flight that covers mark `m`, for
    /// a stream to wait on. (Should it complete and be reused meanwhile,
    /// the wait only waits longer than it must.)
    pub(super) fn covering_probe(&self, m: &Mark) -> Option<EventHandle> {
        m.order
            .probes
            .lock()
            .iter()
            .filter(|&&(seq, _)| seq >= m.seq)
            .min_by_key(|&&(seq, _)| seq)
            .map(|&(_, ev)| ev)
    }

    /// Lists event `ev`, recorded on its stream as number `mark`, as a
    /// probe there.
    pub(super) fn add_probe(&self, mark: &Mark, ev: EventHandle) {
        let mut probes = mark.order.probes.lock();
        probes.push((mark.seq, ev));
        if probes.len() == 1 {
            self.probed.lock().push(mark.order.clone());
        }
    }

    /// Records a probe on `core`'s stream; a failed record is retried by a
    /// later pass (the promises wait).
    pub(super) fn record_probe(&self, core: &Arc<StreamCore>) {
        core.order.probed_at.store(now_ns(), Relaxed);
        match self.record_on(core) {
            Ok((ev, Some(mark))) => self.add_probe(&mark, ev),
            // Recorded on the legacy stream: says nothing of this order.
            Ok((ev, None)) => self.events.give_back(ev),
            Err(e) => tracing::warn!(device = self.dev, "recording a probe failed: {e}"),
        }
    }

    /// Blocks the host until every use `w` waits for completed (trim, the
    /// way to out of memory, teardown).
    pub(super) fn host_sync_waits(&self, w: &Waits) -> crate::error::Result<()> {
        for (i, &e) in w.events.iter().enumerate() {
            self.host_sync_event(e)?;
            // Known complete from here on: a "pending" answer that still
            // holds (`event_order.rs`) must not keep what the host waited
            // for from the harvest that follows.
            if let Some(m) = w.mark(i) {
                m.completed();
            }
        }
        for s in &w.unrecorded {
            if !s.is_dead() {
                self.host_sync_stream(s.handle)?;
            }
        }
        for p in &w.promised {
            self.host_complete(p)?;
        }
        Ok(())
    }

    /// Blocks the host until promise `p` is done: on a probe that covers
    /// it (a retired stream's handle may be gone; its retirement recorded
    /// one), else on one recorded now.
    fn host_complete(&self, p: &Promise) -> crate::error::Result<()> {
        let mut recorded = false;
        for _ in 0..3 {
            let in_flight = self.query_probes(&p.mark, &mut Progress::new(false, true));
            if p.mark.known_done() || p.core.is_dead() {
                return Ok(());
            }
            match in_flight {
                Some((m, ev)) if m.seq >= p.mark.seq => {
                    self.host_sync_event(ev)?;
                    m.completed();
                    return Ok(());
                }
                // An older one: done after this wait; look again.
                Some((_, ev)) => self.host_sync_event(ev)?,
                None if !recorded => {
                    self.record_probe(&p.core);
                    recorded = true;
                }
                None => break,
            }
        }
        // No probe could be recorded: the stream itself.
        self.host_sync_stream(p.core.handle)
    }

    /// Teardown: every probe's event waited for and pooled.
    pub(super) fn drain_probes(&self) {
        let orders = std::mem::take(&mut *self.probed.lock());
        for order in orders {
            let probes = std::mem::take(&mut *order.probes.lock());
            for (_, ev) in probes {
                let _ = self.host_sync_event(ev);
                self.events.give_back(ev);
            }
        }
    }
}
