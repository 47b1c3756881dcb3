//! The order of a stream's events: what one completed (or pending) event
//! says about the others recorded on the same stream, so that harvesting
//! queries each stream's events once instead of every pending record's.
//!
//! A stream runs its work in order, so of two events recorded on one
//! stream the earlier completes first. [`EventOrder`] numbers the events a
//! pool records on a stream; a [`Mark`] is one event's number.
//!
//! Invariants:
//! - Numbers are taken under the order's lock, around the record call
//!   itself, so a lower number was recorded earlier on the stream (two
//!   threads recording on one stream cannot swap their order).
//! - `done` only grows, and every event numbered `<= done` has completed:
//!   it is raised only to the number of an event a query found complete.
//! - A [`Progress`] lives for one harvest pass: an event found pending
//!   there makes every later event of its stream pending for the rest of
//!   the pass without a query (none of them can have completed before it).
//!   A pass first queries each stream's latest pending event:
//!   when it completed, so did all the stream's earlier ones, and the pass
//!   makes one query for that stream.
//! - A "pending" answer holds across passes, for [`PENDING_HOLDS`] and
//!   doubling while the stream stays pending, up to
//!   [`PENDING_HOLDS_AT_MOST`]: within the hold of a query that found an
//!   event pending, that event and the later ones of its stream count as
//!   pending without a query ([`Mark::recently_pending`]), and a stream
//!   query takes the stream as busy ([`EventOrder::busy_lately`]). A hold
//!   only ever delays a release: nothing is taken as complete that a
//!   query or a host wait did not find complete, and a fresh pass
//!   ([`Progress::new`]) applies none.
//! - Events recorded elsewhere than on the stream's own handle (another
//!   thread's per-thread default stream is recorded on the legacy one)
//!   carry no mark: they are always queried.
//! - A promise ([`Mark::promise`]) is the mark of an event not recorded
//!   yet: the next one recorded on the stream completes it. Promises are
//!   made under the order's lock and refused once the stream retired
//!   ([`EventOrder::retire`] says whether one is still uncovered then, so
//!   that an event is recorded while the handle is sure to be valid).

use crate::error::Result;
use crate::ptr::EventHandle;
use parking_lot::Mutex;
use smallvec::SmallVec;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::Duration;

/// How recently a query must have found one of a stream's events
/// complete for the stream to count as progressing (see
/// [`EventOrder::progressing`]).
const PROGRESS_WINDOW: Duration = Duration::from_millis(50);

/// How long a query's "pending" stands for the event it asked about and
/// the later ones of its stream, at first: each query that finds the
/// stream still pending once the hold ran out doubles it, up to
/// [`PENDING_HOLDS_AT_MOST`], and a query that finds one of its events
/// complete starts it again from here. Harvest passes run every few
/// microseconds under load, each asking about every stream that holds
/// freed memory, while work on a busy stream takes tens of microseconds
/// or more: without the hold, most queries (0.24 us each on an H200)
/// repeat an answer that cannot have changed. A release waits at most
/// about as long again as its event had been found pending, and never
/// more than the longest hold.
pub(crate) const PENDING_HOLDS: Duration = Duration::from_micros(10);

/// The longest hold (see [`PENDING_HOLDS`]): a stalled stream is asked
/// about once per this much time. It stays under the work a busy stream
/// runs between frees, or its freed memory comes back late and the pool
/// holds more: 8 streams running 50 us kernels on 10% of allocations
/// (`stress --kernel-percent 10 --kernel-us 50`, 6 seeds) peaked 10-20%
/// higher with 1 ms, 6% with 100 us, and as with no hold with 50 us.
pub(crate) const PENDING_HOLDS_AT_MOST: Duration = Duration::from_micros(50);

/// How recently a query must have found one of a stream's events pending
/// for a sweep to ask about the stream's oldest event first (see
/// [`Sweep::settle`]).
const BUSY_WINDOW: Duration = Duration::from_micros(100);

pub(crate) use crate::clock::now_ns;

/// The numbering of one stream's events.
#[derive(Debug, Default)]
pub(crate) struct EventOrder {
    /// The last number given.
    last: Mutex<u64>,
    /// Every event numbered up to this one has completed.
    done: AtomicU64,
    /// When a query last found a later event of the stream complete
    /// ([`now_ns`]; 0: never).
    progressed_at: AtomicU64,
    /// The highest promised number (written under `last`'s lock).
    promised: AtomicU64,
    /// No promise is made any more (written under `last`'s lock).
    retired: AtomicBool,
    /// When a probe was last recorded on the stream ([`now_ns`]; 0: never).
    pub(crate) probed_at: AtomicU64,
    /// The stream's probes in flight, `(number, event)` (see `probes.rs`).
    pub(crate) probes: Mutex<SmallVec<[(u64, EventHandle); 2]>>,
    /// The number of the last event a query found pending, and when
    /// ([`now_ns`]; 0: never): see [`Mark::recently_pending`]. The time is
    /// stored after the number, and read before it.
    pending_seq: AtomicU64,
    pending_at: AtomicU64,
    /// The current hold, in nanoseconds (0: [`PENDING_HOLDS`]).
    hold_ns: AtomicU64,
    /// When a stream query last found the stream busy (0: never).
    busy_at: AtomicU64,
}

/// An event's place in its stream's order.
#[derive(Debug, Clone)]
pub(crate) struct Mark {
    pub(crate) order: Arc<EventOrder>,
    pub(crate) seq: u64,
}

impl PartialEq for Mark {
    fn eq(&self, other: &Mark) -> bool {
        Arc::ptr_eq(&self.order, &other.order) && self.seq == other.seq
    }
}

impl EventOrder {
    /// Whether a query found one of the stream's events complete in the
    /// last [`PROGRESS_WINDOW`] before `now`: evidence that work queued
    /// on it drains. A stalled stream (a communication stream blocked on a
    /// peer, a hung kernel) shows none, and the pool does not make another
    /// stream wait on it while it can grow instead.
    pub(crate) fn progressing(&self, now: u64) -> bool {
        let t = self.progressed_at.load(Relaxed);
        t != 0 && now.saturating_sub(t) <= PROGRESS_WINDOW.as_nanos() as u64
    }

    /// Whether the stream was found busy less than the hold before `now`,
    /// by a stream query or by a query of one of its events: it is taken
    /// as busy without asking (see [`PENDING_HOLDS`]).
    pub(crate) fn busy_lately(&self, now: u64) -> bool {
        let hold = self.hold();
        let within = |at: u64| at != 0 && now.saturating_sub(at) < hold;
        within(self.busy_at.load(Relaxed)) || within(self.pending_at.load(Relaxed))
    }

    /// A stream query found the stream busy at `now`.
    pub(crate) fn found_busy(&self, now: u64) {
        self.extend_hold(self.busy_at.load(Relaxed), now);
        self.busy_at.store(now.max(1), Relaxed);
    }

    /// A stream query found the stream idle: the hold starts afresh.
    pub(crate) fn found_idle(&self) {
        if self.hold_ns.load(Relaxed) != 0 {
            self.hold_ns.store(0, Relaxed);
        }
    }

    /// Sets the hold for a "busy" or "pending" answer at `now`, the last
    /// such answer of the same kind having come at `last` (0: never):
    /// doubled if that one's hold ran out just now (within as long
    /// again), else the first hold.
    fn extend_hold(&self, last: u64, now: u64) {
        let hold = self.hold();
        let next = if last != 0 && now.saturating_sub(last) < 2 * hold {
            (2 * hold).min(PENDING_HOLDS_AT_MOST.as_nanos() as u64)
        } else {
            PENDING_HOLDS.as_nanos() as u64
        };
        self.hold_ns.store(next, Relaxed);
    }

    /// Whether a query found one of the stream's events pending within
    /// `window` before `now`.
    fn found_pending_since(&self, now: u64, window: Duration) -> bool {
        let at = self.pending_at.load(Relaxed);
        at != 0 && now.saturating_sub(at) < window.as_nanos() as u64
    }

    /// How long a "pending" answer stands now (see [`PENDING_HOLDS`]).
    fn hold(&self) -> u64 {
        match self.hold_ns.load(Relaxed) {
            0 => PENDING_HOLDS.as_nanos() as u64,
            h => h,
        }
    }

    /// Whether every event numbered up to `seq` is known complete.
    pub(crate) fn done_through(&self, seq: u64) -> bool {
        self.done.load(Acquire) >= seq
    }

    /// The stream retires: no more promises. Whether one made earlier is
    /// not covered by a recorded event yet (the caller records one).
    pub(crate) fn retire(&self) -> bool {
        let last = self.last.lock();
        self.retired.store(true, Relaxed);
        self.promised.load(Relaxed) > *last
    }

    /// Runs `record` (one event record on the stream) and numbers the event.
    pub(crate) fn record(
        self: &Arc<Self>,
        record: impl FnOnce() -> Result<EventHandle>,
    ) -> Result<(EventHandle, Mark)> {
        let mut last = self.last.lock();
        let ev = record()?;
        *last += 1;
        Ok((
            ev,
            Mark {
                order: self.clone(),
                seq: *last,
            },
        ))
    }
}

impl Mark {
    /// The mark the next event recorded on `order` will get: once it is
    /// known done, so is all work queued on the stream before now.
    pub(crate) fn next(order: &Arc<EventOrder>) -> Mark {
        Mark {
            order: order.clone(),
            seq: *order.last.lock() + 1,
        }
    }

    /// A promise on `order`: the mark of the next event recorded there,
    /// which completes once all work queued on the stream before now has.
    /// `None` once the stream retired (record an event instead).
    pub(crate) fn promise(order: &Arc<EventOrder>) -> Option<Mark> {
        let last = order.last.lock();
        if order.retired.load(Relaxed) {
            return None;
        }
        let seq = *last + 1;
        order.promised.fetch_max(seq, Relaxed);
        Some(Mark {
            order: order.clone(),
            seq,
        })
    }

    /// Whether the event is known complete (no query needed).
    pub(crate) fn known_done(&self) -> bool {
        self.order.done_through(self.seq)
    }

    /// Whether a query found this event, or an earlier one of its stream,
    /// pending less than [`PENDING_HOLDS`] before `now`: it is taken as
    /// pending without a query (see the file's invariants).
    pub(crate) fn recently_pending(&self, now: u64) -> bool {
        let o = &*self.order;
        let at = o.pending_at.load(Acquire);
        at != 0 && now.saturating_sub(at) < o.hold() && self.seq >= o.pending_seq.load(Relaxed)
    }

    /// A query found the event pending at `now`: the hold doubles if the
    /// stream was found pending when the last one began and it ran out
    /// just now (within as long again), else starts afresh.
    pub(crate) fn found_pending(&self, now: u64) {
        let o = &*self.order;
        o.extend_hold(o.pending_at.load(Relaxed), now);
        o.pending_seq.store(self.seq, Relaxed);
        o.pending_at.store(now.max(1), Release);
    }

    /// A query found the event complete: so are the earlier ones.
    pub(crate) fn completed(&self) {
        self.order.found_idle();
        if self.order.done.fetch_max(self.seq, AcqRel) < self.seq {
            self.order.progressed_at.store(now_ns(), Relaxed);
        }
    }
}

/// What one harvest pass learned: per stream order, the earliest event
/// found pending (with its handle, so that the next harvest can ask
/// whether it completed: see `HarvestGate`), and whether an event without
/// a mark was found pending.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    pending: SmallVec<[(Mark, EventHandle); 8]>,
    /// An unmarked event was found pending: its completion says nothing
    /// about any stream's order, so only a full pass can notice it.
    pub(crate) unmarked_pending: bool,
    /// The pass serves an allocation that needs memory now: it records
    /// probes without waiting for their interval (see `probes.rs`).
    pub(crate) urgent: bool,
    /// The pass's clock ([`now_ns`]), read at its first use (0: not yet).
    now: u64,
    /// The pass asks about every event afresh, no hold applying: an
    /// explicit `DevicePool::harvest` releases all that completed.
    pub(crate) fresh: bool,
}

impl Progress {
    /// A pass's start (see the fields).
    pub(crate) fn new(urgent: bool, fresh: bool) -> Progress {
        Progress {
            urgent,
            fresh,
            ..Progress::default()
        }
    }

    /// Whether a "pending" answer of an earlier pass still holds for `m`
    /// (never in a fresh pass).
    pub(crate) fn held(&mut self, m: &Mark) -> bool {
        !self.fresh && m.recently_pending(self.now())
    }

    /// A query found `m` pending: the hold starts or grows (see
    /// [`Mark::found_pending`]).
    pub(crate) fn saw_pending(&mut self, m: &Mark) {
        m.found_pending(self.now());
    }

    /// The pass's time: one clock read per pass.
    pub(crate) fn now(&mut self) -> u64 {
        if self.now == 0 {
            self.now = now_ns().max(1);
        }
        self.now
    }

    /// Whether `m` need not be asked about in this pass: an earlier event
    /// of its stream was found pending in the pass, or recently by any
    /// pass (then it is noted as found pending here, so that the pass's
    /// earliest pending events stay complete).
    pub(crate) fn skips(&mut self, m: &Mark, ev: EventHandle) -> bool {
        if self.known_pending(m) {
            return true;
        }
        if self.held(m) {
            self.note_pending(m, ev);
            return true;
        }
        false
    }

    /// A query made in this pass found `ev` (numbered `m`) pending.
    pub(crate) fn found_pending(&mut self, m: &Mark, ev: EventHandle) {
        self.saw_pending(m);
        self.note_pending(m, ev);
    }

    /// Whether an earlier event of the same stream was found pending in
    /// this pass (so this one is pending too).
    pub(crate) fn known_pending(&self, m: &Mark) -> bool {
        self.pending
            .iter()
            .any(|(p, _)| Arc::ptr_eq(&p.order, &m.order) && p.seq <= m.seq)
    }

    /// A query found the event `ev` (numbered `m`) pending.
    pub(crate) fn note_pending(&mut self, m: &Mark, ev: EventHandle) {
        match self
            .pending
            .iter_mut()
            .find(|(p, _)| Arc::ptr_eq(&p.order, &m.order))
        {
            Some(entry) => {
                if m.seq < entry.0.seq {
                    *entry = (m.clone(), ev);
                }
            }
            None => self.pending.push((m.clone(), ev)),
        }
    }

    /// Per stream, the earliest event found pending: nothing the pass kept
    /// back can be released before one of these completes.
    pub(crate) fn into_earliest_pending(self) -> SmallVec<[(Mark, EventHandle); 8]> {
        self.pending
    }
}

/// The events of a pass's records whose completion is not known yet, by
/// stream: completed ones form a prefix of each stream's order, so a few
/// queries find the boundary (the oldest, the newest, then halving).
#[derive(Debug, Default)]
pub(crate) struct Sweep {
    per_order: SmallVec<[Vec<(EventHandle, Mark)>; 8]>,
}

impl Sweep {
    /// Considers one recorded event.
    pub(crate) fn note(&mut self, ev: EventHandle, m: &Mark) {
        if m.known_done() {
            return;
        }
        match self
            .per_order
            .iter_mut()
            .find(|v| Arc::ptr_eq(&v[0].1.order, &m.order))
        {
            Some(v) => v.push((ev, m.clone())),
            None => self.per_order.push(vec![(ev, m.clone())]),
        }
    }

    /// Finds, per stream, where completed events end, with `query` (true:
    /// complete): the oldest pending one goes into `progress`, the newest
    /// complete one settles the earlier ones. Returns the queries made.
    pub(crate) fn settle(
        self,
        progress: &mut Progress,
        mut query: impl FnMut(EventHandle) -> bool,
    ) -> usize {
        let mut queries = 0;
        for mut evs in self.per_order {
            evs.sort_unstable_by_key(|(_, m)| m.seq);
            evs.dedup_by_key(|(_, m)| m.seq);
            // evs[..lo] complete, evs[hi..] pending.
            let (mut lo, mut hi) = (0, evs.len());
            let busy = evs[0]
                .1
                .order
                .found_pending_since(progress.now(), BUSY_WINDOW);
            let mut probe = |i: usize, lo: &mut usize, hi: &mut usize| {
                if progress.skips(&evs[i].1, evs[i].0) {
                    *hi = i;
                    return;
                }
                queries += 1;
                if query(evs[i].0) {
                    evs[i].1.completed();
                    *lo = i + 1;
                } else {
                    progress.found_pending(&evs[i].1, evs[i].0);
                    *hi = i;
                }
            };
            // A stream found pending lately most likely still is: its
            // oldest event first (one query when pending). Any other has
            // most likely run everything: its newest first (one query
            // when complete, where oldest first made two).
            let (first, then) = if busy {
                (0, evs.len() - 1)
            } else {
                (evs.len() - 1, 0)
            };
            probe(first, &mut lo, &mut hi);
            if lo <= then && then < hi {
                probe(then, &mut lo, &mut hi);
            }
            while lo < hi {
                probe(lo + (hi - lo) / 2, &mut lo, &mut hi);
            }
        }
        queries
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(order: &Arc<EventOrder>, ev: u64) -> Mark {
        order.record(|| Ok(EventHandle(ev))).unwrap().1
    }

    #[test]
    fn a_stream_progresses_only_while_queries_find_its_events_complete() {
        let a = Arc::new(EventOrder::default());
        let (a1, a2) = (mark(&a, 1), mark(&a, 2));
        assert!(!a.progressing(now_ns()), "no completion seen yet");
        a2.completed();
        assert!(a.progressing(now_ns()));
        std::thread::sleep(PROGRESS_WINDOW + Duration::from_millis(10));
        assert!(!a.progressing(now_ns()), "nothing completed in the window");
        a1.completed();
        assert!(
            !a.progressing(now_ns()),
            "an event already known complete is no new progress"
        );
    }

    #[test]
    fn a_completed_event_completes_the_earlier_ones_of_its_stream_only() {
        let (a, b) = (
            Arc::new(EventOrder::default()),
            Arc::new(EventOrder::default()),
        );
        let a1 = mark(&a, 1);
        let a2 = mark(&a, 2);
        let a3 = mark(&a, 3);
        let b1 = mark(&b, 4);
        assert!(!a1.known_done() && !a2.known_done());
        a2.completed();
        assert!(a1.known_done() && a2.known_done());
        assert!(!a3.known_done(), "a later event is not implied");
        assert!(!b1.known_done(), "another stream is not implied");
        a1.completed();
        assert!(a2.known_done(), "done never goes back");
    }

    #[test]
    fn a_pending_event_makes_the_later_ones_of_its_stream_pending_for_the_pass() {
        let (a, b) = (
            Arc::new(EventOrder::default()),
            Arc::new(EventOrder::default()),
        );
        let (a1, a2, a3, b1) = (mark(&a, 1), mark(&a, 2), mark(&a, 3), mark(&b, 4));
        let mut p = Progress::default();
        p.note_pending(&a2, EventHandle(2));
        assert!(!p.known_pending(&a1), "an earlier event may have completed");
        assert!(p.known_pending(&a2) && p.known_pending(&a3));
        assert!(!p.known_pending(&b1));
        p.note_pending(&a3, EventHandle(3));
        p.note_pending(&a1, EventHandle(1));
        assert!(p.known_pending(&a1));
        let earliest: Vec<(u64, EventHandle)> = p
            .into_earliest_pending()
            .iter()
            .map(|(m, e)| (m.seq, *e))
            .collect();
        assert_eq!(
            earliest,
            vec![(a1.seq, EventHandle(1))],
            "one per stream, the earliest"
        );
    }

    /// A stream of `n` events of which the first `done` completed; returns
    /// the queries a sweep made and checks what it settled.
    fn sweep(n: usize, done: usize) -> usize {
        let order = Arc::new(EventOrder::default());
        let marks: Vec<Mark> = (0..n).map(|i| mark(&order, i as u64)).collect();
        let mut s = Sweep::default();
        for (i, m) in marks.iter().enumerate().rev() {
            s.note(EventHandle(i as u64), m);
        }
        let mut p = Progress::default();
        let q = s.settle(&mut p, |e| (e.0 as usize) < done);
        for (i, m) in marks.iter().enumerate() {
            let settled = if i < done {
                m.known_done()
            } else {
                p.known_pending(m)
            };
            assert!(settled, "n={n} done={done}: event {i} unsettled");
        }
        q
    }

    #[test]
    fn a_sweep_settles_every_event_with_few_queries() {
        for n in 1..40 {
            for done in 0..=n {
                let q = sweep(n, done);
                let bound = 2 + (usize::BITS - n.leading_zeros()) as usize;
                assert!(q <= bound, "n={n} done={done}: {q} queries");
            }
        }
        // A stream not found pending lately: its newest event first.
        assert_eq!(sweep(1000, 1000), 1, "all complete: one query");
        assert_eq!(sweep(1000, 0), 2, "newest, then oldest pending");
    }

    #[test]
    fn a_sweep_asks_a_stream_found_pending_lately_about_its_oldest_event_first() {
        let order = Arc::new(EventOrder::default());
        let old = mark(&order, 0);
        let marks: Vec<Mark> = (1..=100).map(|i| mark(&order, i)).collect();
        // Found pending just now, beyond the hold: asked again, oldest
        // first, and that one answer settles the stream.
        let t = 1_000_000_000;
        old.found_pending(t - 2 * PENDING_HOLDS.as_nanos() as u64);
        let mut s = Sweep::default();
        for (i, m) in marks.iter().enumerate() {
            s.note(EventHandle(i as u64 + 1), m);
        }
        let mut asked = Vec::new();
        let mut p = Progress {
            now: t,
            ..Progress::default()
        };
        let q = s.settle(&mut p, |e| {
            asked.push(e.0);
            false
        });
        assert_eq!((q, asked), (1, vec![1]), "the oldest alone");
        assert!(marks.iter().all(|m| p.known_pending(m)));
    }

    #[test]
    fn a_pending_answer_stands_for_its_stream_from_that_event_on_while_the_hold_lasts() {
        let (a, b) = (
            Arc::new(EventOrder::default()),
            Arc::new(EventOrder::default()),
        );
        let (a1, a2, a3, b1) = (mark(&a, 1), mark(&a, 2), mark(&a, 3), mark(&b, 4));
        let hold = PENDING_HOLDS.as_nanos() as u64;
        let t = 1_000_000;
        assert!(!a2.recently_pending(t), "nothing found yet");
        a2.found_pending(t);
        assert!(a2.recently_pending(t + hold - 1) && a3.recently_pending(t + 1));
        assert!(!a1.recently_pending(t + 1), "an earlier event may be done");
        assert!(!b1.recently_pending(t + 1), "another stream is not implied");
        assert!(!a2.recently_pending(t + hold), "the hold ran out");
        assert!(a.busy_lately(t + 1) && !b.busy_lately(t + 1));
        assert!(!a.busy_lately(t + hold));
    }

    #[test]
    fn the_hold_doubles_while_the_stream_stays_pending_and_starts_afresh_on_completion() {
        let a = Arc::new(EventOrder::default());
        let (a1, a2) = (mark(&a, 1), mark(&a, 2));
        let first = PENDING_HOLDS.as_nanos() as u64;
        let most = PENDING_HOLDS_AT_MOST.as_nanos() as u64;
        let mut t = 1_000_000;
        a2.found_pending(t);
        assert_eq!(a.hold(), first);
        // Asked again as each hold runs out, still pending: doubled, up
        // to the longest.
        let mut expect = first;
        for _ in 0..12 {
            t += a.hold();
            a2.found_pending(t);
            expect = (2 * expect).min(most);
            assert_eq!(a.hold(), expect);
        }
        assert_eq!(a.hold(), most);
        // A pending answer long after the last: the first hold again.
        a2.found_pending(t + 10 * most);
        assert_eq!(a.hold(), first);
        t += 10 * most;
        a2.found_pending(t + first);
        assert_eq!(a.hold(), 2 * first);
        a1.completed();
        assert_eq!(a.hold(), first, "a completion starts the hold afresh");
        // Stream queries share the hold.
        a.found_busy(t);
        a.found_busy(t + first);
        assert_eq!(a.hold(), 2 * first);
        assert!(a.busy_lately(t + 2 * first) && !a.busy_lately(t + 3 * first));
        a.found_idle();
        assert_eq!(a.hold(), first);
    }

    #[test]
    fn numbers_follow_the_record_order_across_threads() {
        let order = Arc::new(EventOrder::default());
        let seen = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let (order, seen) = (&order, &seen);
                s.spawn(move || {
                    for i in 0..1000 {
                        let (_, m) = order
                            .record(|| {
                                // The "record" happens under the lock: its
                                // position in `seen` is the stream order.
                                seen.lock().push(t * 1000 + i);
                                Ok(EventHandle(t * 1000 + i))
                            })
                            .unwrap();
                        let pos = seen.lock().iter().position(|&x| x == t * 1000 + i);
                        assert_eq!(pos.map(|p| p as u64 + 1), Some(m.seq));
                    }
                });
            }
        });
    }
}
