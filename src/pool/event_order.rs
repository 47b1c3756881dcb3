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
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::Duration;

/// How recently a query must have found one of a stream's events
/// complete for the stream to count as progressing (see
/// [`EventOrder::progressing`]).
const PROGRESS_WINDOW: Duration = Duration::from_millis(50);

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

    /// A query found the event complete: so are the earlier ones.
    pub(crate) fn completed(&self) {
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
}

impl Progress {
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
            let mut probe = |i: usize, lo: &mut usize, hi: &mut usize| {
                queries += 1;
                if query(evs[i].0) {
                    evs[i].1.completed();
                    *lo = i + 1;
                } else {
                    progress.note_pending(&evs[i].1, evs[i].0);
                    *hi = i;
                }
            };
            // Most passes find the oldest still pending (one query) or
            // everything complete (two).
            probe(0, &mut lo, &mut hi);
            if lo < hi {
                probe(hi - 1, &mut lo, &mut hi);
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
        assert_eq!(sweep(1000, 0), 1, "oldest pending: one query");
        assert_eq!(sweep(1000, 1000), 2, "all complete: two queries");
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
