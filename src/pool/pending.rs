//! Frees that wait on events before their memory may be reused by any stream.
//!
//! A record is created when a block used on several streams is freed
//! (`record_stream`), when a stream's dirty memory is flushed so that other
//! streams can use it, and when a stream goes away. Records sit on a
//! [`PendingList`]; harvesting detaches the whole list, queries each
//! record's events without blocking, releases the completed ones and pushes
//! the rest back.

use super::event_order::{EventOrder, Mark};
use super::sync::{AtomicPtr, AtomicUsize};
use super::StreamCore;
use crate::ptr::EventHandle;
use smallvec::SmallVec;
use std::ptr;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};
use std::sync::Arc;

/// What a pending record holds back.
#[derive(Debug)]
pub(crate) enum Pending {
    /// Small slots of one class.
    Slots {
        /// Size class.
        class: u16,
        /// Slot indices.
        slots: Vec<u32>,
        /// What must complete first.
        waits: Waits,
        /// Slot bytes held back.
        bytes: u64,
    },
    /// Slots of several classes behind the same events: a stream's flush
    /// (its dirty slots of every class, one event) or the slots that other
    /// threads' magazines held for a stream when it retired (see
    /// `orphans.rs`).
    Classes {
        /// Slot indices by class.
        parts: SlotParts,
        /// What must complete first.
        waits: Waits,
        /// Slot bytes held back.
        bytes: u64,
    },
    /// Heap ranges of pending group `id`; its events are kept with the heap
    /// (under the heap lock) so that a handover can read them.
    Group {
        /// The heap's pending group id.
        id: u32,
    },
}

/// Small slots by size class.
pub(crate) type SlotParts = Vec<(u16, Vec<u32>)>;

impl Pending {
    /// The waits of a record of small slots.
    pub(crate) fn slot_waits(&self) -> Option<&Waits> {
        match self {
            Pending::Slots { waits, .. } | Pending::Classes { waits, .. } => Some(waits),
            Pending::Group { .. } => None,
        }
    }

    /// A record of small slots as its slots by class, waits and bytes.
    pub(crate) fn into_slot_parts(self) -> Option<(SlotParts, Waits, u64)> {
        match self {
            Pending::Slots {
                class,
                slots,
                waits,
                bytes,
            } => Some((vec![(class, slots)], waits, bytes)),
            Pending::Classes {
                parts,
                waits,
                bytes,
            } => Some((parts, waits, bytes)),
            Pending::Group { .. } => None,
        }
    }
}

/// A use on a stream that no event covers yet: done once the event
/// numbered `mark` on `core`'s stream, or a later one, completed (see
/// [`Mark::promise`] and `returning.rs` for the probes that complete it).
#[derive(Debug, Clone)]
pub(crate) struct Promise {
    pub core: Arc<StreamCore>,
    pub mark: Mark,
}

/// The promises of one free (usually one or two streams).
pub(crate) type Promises = SmallVec<[Promise; 2]>;

/// What a pending record waits for.
#[derive(Debug, Clone, Default)]
pub(crate) struct Waits {
    /// Events recorded at the free, one per stream that used the memory.
    pub events: Vec<EventHandle>,
    /// Each event's place in its stream's order (`marks[i]` is
    /// `events[i]`'s; `None`: always queried). Pushed only with the event
    /// ([`Waits::push`], [`Waits::absorb`]).
    pub marks: Vec<Option<Mark>>,
    /// Streams whose event could not be recorded: only a host sync of the
    /// stream (in `trim`) can release the memory. Held, so that the handle
    /// stays valid until then.
    pub unrecorded: Vec<Arc<StreamCore>>,
    /// Uses on streams where no event was recorded for them yet: a probe
    /// recorded later there covers them, or an event recorded when a
    /// stream must wait on them (handover).
    pub promised: Promises,
}

impl Waits {
    /// Adds a recorded event.
    pub(crate) fn push(&mut self, ev: EventHandle, mark: Option<Mark>) {
        self.events.push(ev);
        self.marks.push(mark);
    }

    /// Adds everything `other` waits for.
    pub(crate) fn absorb(&mut self, other: Waits) {
        self.events.extend(other.events);
        self.marks.extend(other.marks);
        self.unrecorded.extend(other.unrecorded);
        self.promised.extend(other.promised);
    }

    /// Whether the waits hold the same events and promises.
    pub(crate) fn same_as(&self, other: &Waits) -> bool {
        self.events == other.events
            && self.promised.len() == other.promised.len()
            && self
                .promised
                .iter()
                .zip(&other.promised)
                .all(|(a, b)| a.mark == b.mark)
    }

    /// Whether new work on the stream numbered by `order` is already
    /// ordered after every use: each event was recorded on that stream or
    /// is known complete, and none is unrecorded. Such memory is that
    /// stream's to reuse with no wait at all (stream order).
    pub(crate) fn ordered_before(&self, order: &Arc<EventOrder>) -> bool {
        self.unrecorded.is_empty()
            && self.marks.len() == self.events.len()
            && self.marks.iter().all(|m| {
                m.as_ref()
                    .is_some_and(|m| m.known_done() || Arc::ptr_eq(&m.order, order))
            })
            && self
                .promised
                .iter()
                .all(|p| p.mark.known_done() || Arc::ptr_eq(&p.mark.order, order))
    }

    /// Whether the stream numbered by `order` may wait on these uses
    /// before the pool grows: each event is that stream's own, known
    /// complete, or on a stream that is progressing
    /// ([`EventOrder::progressing`] at `now`); none is unrecorded.
    pub(crate) fn drains_soon(&self, order: &Arc<EventOrder>, now: u64) -> bool {
        self.unrecorded.is_empty()
            && self.marks.len() == self.events.len()
            && self.marks.iter().all(|m| {
                m.as_ref().is_some_and(|m| {
                    m.known_done() || Arc::ptr_eq(&m.order, order) || m.order.progressing(now)
                })
            })
            && self.promised.iter().all(|p| {
                let m = &p.mark;
                m.known_done() || Arc::ptr_eq(&m.order, order) || m.order.progressing(now)
            })
    }

    /// Whether `events[i]` needs no device-side wait by the stream
    /// numbered by `order` (recorded on it, or known complete).
    pub(crate) fn needs_no_wait(&self, i: usize, order: &Arc<EventOrder>) -> bool {
        self.mark(i)
            .is_some_and(|m| m.known_done() || Arc::ptr_eq(&m.order, order))
    }

    /// The mark of `events[i]`.
    pub(crate) fn mark(&self, i: usize) -> Option<&Mark> {
        self.marks.get(i).and_then(Option::as_ref)
    }
}

struct Node<T> {
    value: T,
    next: *mut Node<T>,
}

/// A lock-free multi-producer list with whole-list removal.
///
/// `push` is a CAS loop on the head; `take_all` swaps the head with null
/// and owns the detached chain. Nodes are never popped one at a time, so
/// no thread can read a node another thread freed, and ABA cannot arise:
/// a CAS in `push` only installs a node the pusher owns, linked to the head
/// it saw, and a concurrent `take_all` makes that CAS fail.
///
/// Invariant (loom model in `tests/loom_pool.rs`): every pushed value is
/// returned by exactly one `take_all` (or dropped with the list).
pub(crate) struct PendingList<T> {
    head: AtomicPtr<Node<T>>,
    len: AtomicUsize,
}

// SAFETY: the list owns its values and hands each to exactly one thread
// (`take_all`); sending it between threads sends the values.
unsafe impl<T: Send> Send for PendingList<T> {}
// SAFETY: all shared access goes through atomics; values move in and out
// by ownership, never by shared reference.
unsafe impl<T: Send> Sync for PendingList<T> {}

impl<T> std::fmt::Debug for PendingList<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingList")
            .field("len", &self.len())
            .finish()
    }
}

impl<T> Default for PendingList<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> PendingList<T> {
    /// An empty list.
    pub(crate) fn new() -> Self {
        PendingList {
            head: AtomicPtr::new(ptr::null_mut()),
            len: AtomicUsize::new(0),
        }
    }

    /// Records on the list (approximate under concurrency).
    pub(crate) fn len(&self) -> usize {
        self.len.load(Relaxed)
    }

    /// Whether the list looked empty.
    pub(crate) fn is_empty(&self) -> bool {
        self.head.load(Acquire).is_null()
    }

    /// Adds a value.
    pub(crate) fn push(&self, value: T) {
        let node = Box::into_raw(Box::new(Node {
            value,
            next: ptr::null_mut(),
        }));
        let mut head = self.head.load(Relaxed);
        loop {
            // SAFETY: `node` came from Box::into_raw above and is not yet
            // shared: only this thread writes it until the CAS publishes it.
            unsafe { (*node).next = head };
            match self
                .head
                .compare_exchange_weak(head, node, Release, Relaxed)
            {
                Ok(_) => break,
                Err(h) => head = h,
            }
        }
        self.len.fetch_add(1, Relaxed);
    }

    /// Detaches every value, most recent first.
    pub(crate) fn take_all(&self) -> Vec<T> {
        let mut cur = self.head.swap(ptr::null_mut(), AcqRel);
        let mut out = Vec::new();
        while !cur.is_null() {
            // SAFETY: the swap made this thread the only owner of the chain;
            // each node was created by Box::into_raw in `push`, and its
            // fields were published by the Release CAS (Acquire above).
            let node = unsafe { Box::from_raw(cur) };
            cur = node.next;
            out.push(node.value);
        }
        self.len.fetch_sub(out.len(), Relaxed);
        out
    }
}

impl<T> Drop for PendingList<T> {
    fn drop(&mut self) {
        drop(self.take_all());
    }
}
