//! Streams as the pool sees them: a backend handle plus a small "stream
//! slot" that indexes the per-stream dirty stacks and stat shards.

use super::PoolShared;
use crate::ptr::StreamHandle;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::AcqRel, Ordering::Acquire};
use std::sync::Arc;

/// Stream slots per device. Streams beyond this still work; their frees
/// take the pending path (one event each) instead of the dirty stacks.
pub(crate) const STREAM_SLOTS: usize = 64;

/// Maps stream handles to slots with one CAS per registration.
#[derive(Debug)]
pub(crate) struct StreamRegistry {
    /// `handle + 1` per slot; 0 = free.
    slots: Box<[AtomicU64]>,
}

impl StreamRegistry {
    pub(crate) fn new() -> Self {
        StreamRegistry {
            slots: (0..STREAM_SLOTS).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// The slot of `h`, registering it if needed; `None` when all are taken.
    pub(crate) fn slot_of(&self, h: StreamHandle) -> Option<u16> {
        let key = h.0.wrapping_add(1);
        if let Some(i) = self.slots.iter().position(|s| s.load(Acquire) == key) {
            return Some(i as u16);
        }
        for (i, s) in self.slots.iter().enumerate() {
            if s.compare_exchange(0, key, AcqRel, Acquire).is_ok() {
                return Some(i as u16);
            }
            if s.load(Acquire) == key {
                return Some(i as u16);
            }
        }
        None
    }

    /// The stream registered at `slot`.
    pub(crate) fn handle(&self, slot: usize) -> Option<StreamHandle> {
        match self.slots[slot].load(Acquire) {
            0 => None,
            k => Some(StreamHandle(k - 1)),
        }
    }

    /// Frees a slot.
    pub(crate) fn release(&self, slot: u16) {
        self.slots[slot as usize].store(0, std::sync::atomic::Ordering::Release);
    }
}

/// A stream of one device, as the pool uses it.
///
/// Cheap to clone. A stream made by [`DevicePool::new_stream`](super::DevicePool::new_stream)
/// is destroyed when its last clone goes; before that, memory it freed is
/// flushed to the pending list so that no other stream reuses it early.
/// Blocks borrow their stream, so a stream outlives the blocks allocated
/// on it.
#[derive(Clone)]
pub struct Stream {
    pub(crate) inner: Arc<StreamInner>,
}

pub(crate) struct StreamInner {
    pub(crate) device: usize,
    pub(crate) handle: StreamHandle,
    pub(crate) slot: Option<u16>,
    pub(crate) owned: bool,
    pub(crate) pool: Arc<PoolShared>,
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
        other.handle() != self.handle()
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
        self.pool.retire_stream(self.handle, self.slot, self.owned);
    }
}
