//! Streams as the pool sees them.
//!
//! Three layers, each owning the next:
//!
//! - [`StreamCore`] owns the backend handle: a stream the pool made is
//!   destroyed when the last core reference goes. Cores are held by the
//!   user's [`Stream`]s, by the streams recorded for a block
//!   (`record_stream`) and by pending frees whose event could not be
//!   recorded, so the pool never records on, waits on or syncs a handle
//!   that is dead or re-used: a stream recorded for a block lives until
//!   that block's free has recorded its event on it.
//! - `StreamInner` is the pool's view of one live stream: its core, its
//!   slot (which indexes the per-stream dirty stacks) and the pool. When the
//!   last [`Stream`] clone goes (per-thread caches hold clones too), the
//!   stream *retires*: what it freed moves to the pending list behind one
//!   event recorded on it, and only then is its slot free for another
//!   stream. A stream's end is thus an ordering point that never blocks
//!   the host.
//! - [`StreamRegistry`] maps slots to live streams by weak reference, so a
//!   flush of every stream (maintenance, trim, reclaim) holds each stream
//!   strongly while it records on it: a stream ends either before such a
//!   flush sees it or after the flush is done with it.
//!
//! Invariants:
//! 1. A slot is free only after its stream retired (flushed); a new stream
//!    never inherits another stream's dirty memory.
//! 2. Every handle the pool passes to the backend belongs to a core it holds.
//! 3. Default streams: the legacy default stream (0 or
//!    [`StreamHandle::LEGACY`]) is one stream shared by all threads and is
//!    used like any other; the per-thread default stream
//!    ([`StreamHandle::PER_THREAD`]) names a different stream on every
//!    thread, so it gets no slot (its frees wait on an event recorded by the
//!    freeing thread, on that thread's stream) and it is bound to the thread
//!    that wrapped it.
//! 4. After the pool's teardown no core calls the driver: teardown destroys
//!    the streams it made and marks their cores dead.

use super::event_order::EventOrder;
use super::PoolShared;
use crate::backend::Backend;
use crate::ptr::StreamHandle;
use parking_lot::Mutex;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Acquire, Ordering::Release};
use std::sync::{Arc, Weak};
use std::thread::ThreadId;

/// Stream slots per device. Streams beyond this still work; their frees
/// take the pending path (one event each) instead of the dirty stacks.
pub(crate) const STREAM_SLOTS: usize = 64;

/// A backend stream handle and its ownership.
pub(crate) struct StreamCore {
    pub(crate) device: usize,
    pub(crate) handle: StreamHandle,
    /// Made by the pool (destroyed with the last core reference).
    owned: bool,
    /// The host thread of a per-thread default stream.
    pub(crate) thread: Option<ThreadId>,
    backend: Arc<dyn Backend>,
    /// Set once the handle must not be used any more (destroyed by the
    /// pool's teardown).
    dead: AtomicBool,
    /// The numbering of the events the pool records on this stream.
    pub(crate) order: Arc<EventOrder>,
}

impl StreamCore {
    pub(crate) fn new(
        backend: Arc<dyn Backend>,
        device: usize,
        handle: StreamHandle,
        owned: bool,
    ) -> StreamCore {
        let handle = handle.canonical();
        StreamCore {
            device,
            handle,
            owned,
            thread: (handle == StreamHandle::PER_THREAD).then(|| std::thread::current().id()),
            backend,
            dead: AtomicBool::new(false),
            order: Arc::default(),
        }
    }

    /// Whether the handle may still be used.
    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Acquire)
    }

    /// Destroys an owned stream now (pool teardown); later drops make no
    /// driver call. Returns whether it destroyed anything.
    pub(crate) fn kill(&self) -> bool {
        if !self.owned || self.dead.swap(true, Release) {
            return false;
        }
        if let Err(e) = self.backend.destroy_stream(self.device, self.handle) {
            tracing::warn!(device = self.device, "cuStreamDestroy failed: {e}");
        }
        true
    }
}

impl fmt::Debug for StreamCore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamCore")
            .field("device", &self.device)
            .field("handle", &self.handle)
            .field("owned", &self.owned)
            .finish()
    }
}

impl Drop for StreamCore {
    fn drop(&mut self) {
        self.kill();
    }
}

#[derive(Debug)]
enum SlotState {
    Free,
    /// A stream holds the slot; the weak reference fails to upgrade while
    /// the stream retires, and the slot stays taken until it is released.
    Taken(Weak<StreamInner>),
}

/// The pool's live streams by slot.
#[derive(Debug)]
pub(crate) struct StreamRegistry {
    slots: Mutex<Vec<SlotState>>,
    /// Cores of the streams the pool made, for teardown.
    owned: Mutex<Vec<Weak<StreamCore>>>,
}

impl StreamRegistry {
    pub(crate) fn new() -> Self {
        StreamRegistry {
            slots: Mutex::new((0..STREAM_SLOTS).map(|_| SlotState::Free).collect()),
            owned: Mutex::new(Vec::new()),
        }
    }

    /// Registers a stream: a wrapped (not owned) handle that a live stream
    /// already wraps gets that stream; otherwise a new one, with a free slot
    /// if any (none for a per-thread default stream).
    pub(crate) fn register(&self, pool: &Arc<PoolShared>, core: StreamCore) -> Stream {
        let core = Arc::new(core);
        if core.owned {
            let mut owned = self.owned.lock();
            owned.retain(|w| w.strong_count() > 0);
            owned.push(Arc::downgrade(&core));
        }
        let slotless = core.thread.is_some();
        let mut slots = self.slots.lock();
        if !core.owned && !slotless {
            for s in slots.iter() {
                if let SlotState::Taken(w) = s {
                    if let Some(inner) = w.upgrade() {
                        if inner.core.handle == core.handle && !inner.core.owned {
                            return Stream { inner };
                        }
                    }
                }
            }
        }
        let free = if slotless {
            None
        } else {
            slots.iter().position(|s| matches!(s, SlotState::Free))
        };
        let inner = Arc::new(StreamInner {
            device: core.device,
            handle: core.handle,
            slot: free.map(|i| i as u16),
            core,
            pool: pool.clone(),
            mag_holders: AtomicUsize::new(0),
        });
        if let Some(i) = free {
            slots[i] = SlotState::Taken(Arc::downgrade(&inner));
        }
        Stream { inner }
    }

    /// Every live stream with a slot, held strongly (drop the list outside
    /// any pool lock: the last reference retires its stream).
    pub(crate) fn live(&self) -> Vec<Stream> {
        self.slots
            .lock()
            .iter()
            .filter_map(|s| match s {
                SlotState::Taken(w) => w.upgrade().map(|inner| Stream { inner }),
                SlotState::Free => None,
            })
            .collect()
    }

    /// The live stream in `slot`, held strongly (drop it outside any pool
    /// lock, as [`StreamRegistry::live`]'s list); `None` if the slot is
    /// free or its stream retiring.
    pub(crate) fn get(&self, slot: u16) -> Option<Stream> {
        match self.slots.lock().get(slot as usize)? {
            SlotState::Taken(w) => w.upgrade().map(|inner| Stream { inner }),
            SlotState::Free => None,
        }
    }

    /// Whether a stream is retiring: its slot is still taken, but its last
    /// reference is gone, and what it freed is flushed only when its
    /// retirement releases the slot (after the flush, under this lock).
    pub(crate) fn any_retiring(&self) -> bool {
        self.slots
            .lock()
            .iter()
            .any(|s| matches!(s, SlotState::Taken(w) if w.strong_count() == 0))
    }

    /// Frees a slot (its stream retired).
    fn release(&self, slot: u16) {
        self.slots.lock()[slot as usize] = SlotState::Free;
    }

    /// Destroys every stream the pool made that is still referenced (by a
    /// user, a thread cache or a recorded block) and marks it dead; for the
    /// pool's teardown, after the device work is done.
    pub(crate) fn kill_owned(&self) -> usize {
        let owned = std::mem::take(&mut *self.owned.lock());
        owned
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|c| c.kill())
            .count()
    }

    /// Cores of every live stream the pool knows (owned or wrapped), for
    /// teardown's device-wide wait.
    pub(crate) fn live_cores(&self) -> Vec<Arc<StreamCore>> {
        let mut cores: Vec<Arc<StreamCore>> =
            self.owned.lock().iter().filter_map(Weak::upgrade).collect();
        for s in self.live() {
            if !cores.iter().any(|c| Arc::ptr_eq(c, &s.inner.core)) {
                cores.push(s.inner.core.clone());
            }
        }
        cores
    }
}

/// A stream of one device, as the pool uses it.
///
/// Cheap to clone. A stream made by [`DevicePool::new_stream`](super::DevicePool::new_stream)
/// is destroyed once its last clone is gone and no block recorded on it
/// waits for it; before that, memory it freed moves to the pending list
/// behind an event recorded on it, so that no other stream reuses it early.
/// A wrapped stream ([`DevicePool::stream_from_raw`](super::DevicePool::stream_from_raw))
/// is released the same way when its last clone goes: drop every clone
/// before the stream's owner destroys it. Streams made by a pool end with
/// the pool: its teardown destroys those still alive.
#[derive(Clone)]
pub struct Stream {
    pub(crate) inner: Arc<StreamInner>,
}

pub(crate) struct StreamInner {
    pub(crate) device: usize,
    pub(crate) handle: StreamHandle,
    pub(crate) slot: Option<u16>,
    pub(crate) core: Arc<StreamCore>,
    pub(crate) pool: Arc<PoolShared>,
    /// Per-thread magazines that may hold slots freed on this stream
    /// (see `magazine.rs`).
    pub(crate) mag_holders: AtomicUsize,
}

impl Stream {
    /// The backend's handle (a `CUstream` on CUDA).
    pub fn handle(&self) -> StreamHandle {
        self.inner.handle
    }

    /// The device this stream belongs to.
    pub fn device(&self) -> usize {
        self.inner.device
    }

    #[inline]
    pub(crate) fn slot(&self) -> Option<u16> {
        self.inner.slot
    }

    #[inline]
    pub(crate) fn core(&self) -> &Arc<StreamCore> {
        &self.inner.core
    }

    #[inline]
    pub(crate) fn pool_ptr(&self) -> *const PoolShared {
        Arc::as_ptr(&self.inner.pool)
    }

    /// Whether `other`, passed to `record_stream` of a block of this
    /// stream, must be waited for: another stream of the same device. A
    /// stream of another device is ignored with a warning (it cannot touch
    /// this memory).
    pub(crate) fn records(&self, other: &Stream) -> bool {
        if other.device() != self.device() {
            tracing::warn!(
                "record_stream with a stream of device {} ignored",
                other.device()
            );
            return false;
        }
        !Arc::ptr_eq(&other.inner.core, &self.inner.core)
    }
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("device", &self.inner.device)
            .field("handle", &self.inner.handle)
            .field("slot", &self.inner.slot)
            .finish()
    }
}

impl Drop for StreamInner {
    fn drop(&mut self) {
        // Promises on this stream are covered while its handle is valid
        // (see `probes.rs`).
        if self.core.order.retire() && !self.core.is_dead() {
            self.pool.record_probe(&self.core);
        }
        if let Some(s) = self.slot {
            // This thread's magazine of the stream first: into the dirty
            // stacks that the retirement flushes.
            super::magazine::flush_stream(self);
            let holders = *self.mag_holders.get_mut();
            let uid = self as *const StreamInner as usize;
            self.pool.retire_stream(&self.core, s, uid, holders);
            self.pool.streams.release(s);
        }
    }
}
