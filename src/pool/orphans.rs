//! Orphans: slots that other threads' magazines held for a stream when it
//! retired.
//!
//! A retiring stream can flush its own dirty stacks and the retiring
//! thread's magazine, but not the magazines of other threads (thread-local,
//! unreachable). Those slots were freed on the stream before it retired,
//! so they are safe for every stream once everything enqueued on it up to
//! its retirement has completed: the retirement records one *tomb* event
//! (`bury`), and each magazine hands its slots over when it is next
//! emptied (`adopt_orphans`, on eviction or thread exit). When every holder
//! has handed over and the tomb is set, the slots become one pending record
//! waiting on the tomb event, harvested like any other.
//!
//! Either side may come first: a magazine may find its stream gone before
//! the retirement has recorded the tomb. Invariant: a tomb's slots reach
//! the pending list exactly once, when `returned == expected`, with the
//! tomb's event; a torn-down pool takes nothing.

use super::pending::{Pending, Waits};
use super::PoolShared;
use rustc_hash::FxHashMap as HashMap;
use std::sync::atomic::Ordering::Relaxed;

/// One retired stream's orphans.
#[derive(Debug, Default)]
pub(crate) struct Tomb {
    /// Set by the retirement: the event and how many magazines held slots.
    pub(crate) waits: Option<(Waits, usize)>,
    /// Magazines that handed over so far, and their slots by class.
    returned: usize,
    parts: Vec<(u16, Vec<u32>)>,
}

impl Tomb {
    /// The slots handed over so far, by class.
    pub(crate) fn parts(&self) -> &[(u16, Vec<u32>)] {
        &self.parts
    }
}

/// Tombs by retired stream (the address of its `StreamInner`, which stays
/// allocated while any magazine refers to it weakly).
pub(crate) type Tombs = HashMap<usize, Tomb>;

impl PoolShared {
    /// The retirement of stream `uid` left `holders` magazines with slots
    /// that must wait on `waits`.
    pub(crate) fn bury(&self, uid: usize, holders: usize, waits: Waits) {
        let done = {
            let mut t = self.tombs.lock();
            let tomb = t.entry(uid).or_default();
            tomb.waits = Some((waits, holders));
            Self::ripe(&mut t, uid)
        };
        if let Some(p) = done {
            self.pend_orphans(p);
        }
    }

    /// A magazine of retired stream `uid` hands over its slots (by class).
    pub(crate) fn adopt_orphans(&self, uid: usize, parts: Vec<(u16, Vec<u32>)>) {
        if self.is_torn_down() {
            return;
        }
        let bytes: u64 = parts
            .iter()
            .map(|(c, v)| v.len() as u64 * self.slabs.classes.size_of(*c as usize))
            .sum();
        self.counters.on_magazine(-(bytes as i64));
        self.counters.pending_slot_bytes.fetch_add(bytes, Relaxed);
        let done = {
            let mut t = self.tombs.lock();
            let tomb = t.entry(uid).or_default();
            tomb.returned += 1;
            tomb.parts.extend(parts);
            Self::ripe(&mut t, uid)
        };
        if let Some(p) = done {
            self.pend_orphans(p);
        }
    }

    /// The tomb of `uid`, removed, once every holder handed over.
    fn ripe(t: &mut Tombs, uid: usize) -> Option<Tomb> {
        let tomb = t.get(&uid)?;
        match &tomb.waits {
            Some((_, expected)) if tomb.returned >= *expected => t.remove(&uid),
            _ => None,
        }
    }

    fn pend_orphans(&self, tomb: Tomb) {
        let (waits, _) = tomb.waits.expect("ripe tombs have their event");
        let parts: Vec<(u16, Vec<u32>)> = tomb
            .parts
            .into_iter()
            .filter(|(_, v)| !v.is_empty())
            .collect();
        if parts.is_empty() {
            self.recycle_events(waits);
            return;
        }
        let bytes = parts
            .iter()
            .map(|(c, v)| v.len() as u64 * self.slabs.classes.size_of(*c as usize))
            .sum();
        self.counters.pending_frees.fetch_add(1, Relaxed);
        self.pending.push(Pending::Classes {
            parts,
            waits,
            bytes,
        });
    }
}
