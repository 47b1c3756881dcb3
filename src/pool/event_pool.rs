//! Idle events for reuse, and events that several pending records share.
//!
//! Every event the pool records comes from here and goes back here once
//! nothing waits on it: creating one is a driver call (`cuEventCreate`),
//! recording an idle one is the only cost of a free's wait.
//!
//! A stream's flush (`reclaim.rs`) makes two records, its small slots and
//! its heap group, covering the same frees on the same stream. One event
//! recorded after both covers both: it is *shared* by the two records
//! ([`EventPool::share`]), and each record gives it back when it is done
//! with it; it is idle again after the last one.
//!
//! Invariants:
//! 1. An event is idle (in `idle`) at most once, and only when no record
//!    holds it: a shared event goes back on its last holder's give-back,
//!    never before (an idle event is recorded again, anywhere, and a
//!    holder still querying it would read that later work's state).
//! 2. `shared` lists exactly the events with more than one holder left;
//!    `shared_len` is its length, read first so that a give-back of an
//!    unshared event (nearly all of them) takes no map lock.
//!
//! A slow-path structure: each call takes a short mutex.

use crate::ptr::EventHandle;
use parking_lot::Mutex;
use rustc_hash::FxHashMap as HashMap;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::{Acquire, Release};

#[derive(Debug, Default)]
pub(crate) struct EventPool {
    idle: Mutex<Vec<EventHandle>>,
    /// Holders left beyond one, by shared event.
    shared: Mutex<HashMap<EventHandle, usize>>,
    shared_len: AtomicUsize,
}

impl EventPool {
    /// An idle event, if any.
    pub(crate) fn take(&self) -> Option<EventHandle> {
        self.idle.lock().pop()
    }

    /// Marks `e`, held by one record now, as held by `holders` records in
    /// all: it goes idle after as many give-backs.
    pub(crate) fn share(&self, e: EventHandle, holders: usize) {
        if holders <= 1 {
            return;
        }
        let mut m = self.shared.lock();
        *m.entry(e).or_insert(0) += holders - 1;
        self.shared_len.store(m.len(), Release);
    }

    /// A holder is done with `e`: idle again unless another still holds it.
    pub(crate) fn give_back(&self, e: EventHandle) {
        if self.shared_len.load(Acquire) > 0 {
            let mut m = self.shared.lock();
            if let Some(left) = m.get_mut(&e) {
                *left -= 1;
                if *left == 0 {
                    m.remove(&e);
                }
                self.shared_len.store(m.len(), Release);
                return;
            }
        }
        let mut idle = self.idle.lock();
        // Invariant 1 (a few dozen events at most are ever created).
        debug_assert!(!idle.contains(&e), "event {e:?} given back twice");
        idle.push(e);
    }

    /// Gives back every event of `events` (see [`EventPool::give_back`]).
    pub(crate) fn give_back_all(&self, events: impl IntoIterator<Item = EventHandle>) {
        for e in events {
            self.give_back(e);
        }
    }

    /// Teardown: every idle event, and every event still shared (its
    /// holders are gone with the pending records), each once.
    pub(crate) fn drain(&self) -> Vec<EventHandle> {
        let mut all = std::mem::take(&mut *self.idle.lock());
        let mut m = self.shared.lock();
        all.extend(m.drain().map(|(e, _)| e));
        self.shared_len.store(0, Release);
        all.sort_unstable();
        all.dedup();
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_event_goes_idle_after_its_last_holder() {
        let p = EventPool::default();
        let (a, b) = (EventHandle(7), EventHandle(8));
        p.share(a, 2);
        p.give_back(a);
        assert_eq!(p.take(), None, "one holder left: not idle");
        p.give_back(b);
        assert_eq!(p.take(), Some(b), "an unshared event goes idle at once");
        p.give_back(a);
        assert_eq!(p.take(), Some(a));
        assert_eq!(p.take(), None, "idle once only");
    }

    #[test]
    fn teardown_drains_shared_events_once() {
        let p = EventPool::default();
        p.share(EventHandle(1), 3);
        p.give_back(EventHandle(1));
        p.give_back(EventHandle(2));
        assert_eq!(p.drain(), vec![EventHandle(1), EventHandle(2)]);
        assert!(p.drain().is_empty());
    }
}
