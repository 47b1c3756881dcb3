//! `Block`: an RAII device allocation, freed stream-ordered on drop.

use super::{DevicePool, Kind, Stream};
use crate::ptr::{DevicePtr, StreamHandle};
use parking_lot::Mutex;
use std::fmt;

/// A live device allocation. Dropping it frees the memory, ordered after
/// the work enqueued so far on its stream and on every stream passed to
/// [`Block::record_stream`]; the host never waits.
pub struct Block<'a> {
    pool: &'a DevicePool,
    stream: &'a Stream,
    ptr: DevicePtr,
    size: usize,
    kind: Kind,
    /// Other streams that used the block (rare; empty Vec allocates nothing).
    extra: Mutex<Vec<StreamHandle>>,
}

impl<'a> Block<'a> {
    pub(crate) fn new(
        pool: &'a DevicePool,
        stream: &'a Stream,
        ptr: DevicePtr,
        size: usize,
        kind: Kind,
    ) -> Self {
        Block {
            pool,
            stream,
            ptr,
            size,
            kind,
            extra: Mutex::new(Vec::new()),
        }
    }

    /// The device address (256-byte aligned).
    #[inline]
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// The requested size in bytes.
    #[inline]
    pub fn size(&self) -> usize {
        self.size
    }

    /// The stream the block was allocated on.
    pub fn stream(&self) -> &Stream {
        self.stream
    }

    /// Marks the block as used on `stream` too: its free will wait for the
    /// work enqueued on that stream up to the free. A stream of another
    /// device is ignored with a warning (it cannot touch this memory).
    pub fn record_stream(&self, stream: &Stream) {
        record_extra_stream(self.pool.device(), self.stream, &self.extra, stream);
    }
}

impl Drop for Block<'_> {
    fn drop(&mut self) {
        let extra = std::mem::take(self.extra.get_mut());
        self.pool
            .shared
            .free_block(self.ptr, self.kind, self.size as u64, self.stream, &extra);
    }
}

impl fmt::Debug for Block<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Block")
            .field("device", &self.pool.device())
            .field("ptr", &self.ptr)
            .field("size", &self.size)
            .field("stream", &self.stream.handle())
            .finish()
    }
}

/// `record_stream` of a block owned by `own` on device `dev`: adds
/// `stream` to `extra` once, unless it is the owner; a stream of another
/// device is ignored with a warning (it cannot touch this memory).
/// Shared by [`Block`] and `MovableBlock`.
pub(crate) fn record_extra_stream(
    dev: usize,
    own: &Stream,
    extra: &Mutex<Vec<StreamHandle>>,
    stream: &Stream,
) {
    if stream.device() != dev {
        tracing::warn!(
            "record_stream with a stream of device {} ignored",
            stream.device()
        );
        return;
    }
    if stream.handle() == own.handle() {
        return;
    }
    let mut e = extra.lock();
    if !e.contains(&stream.handle()) {
        e.push(stream.handle());
    }
}
