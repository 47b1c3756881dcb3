//! `Block`: an RAII device allocation, freed stream-ordered on drop.

use super::{DevicePool, Kind, Stream};
use crate::ptr::{DevicePtr, StreamHandle};
use parking_lot::Mutex;
use std::fmt;
use std::sync::OnceLock;

/// A live device allocation. Dropping it frees the memory, ordered after
/// the work enqueued so far on its stream and on every stream passed to
/// [`Block::record_stream`]; the host never waits.
pub struct Block<'a> {
    pool: &'a DevicePool,
    stream: &'a Stream,
    ptr: DevicePtr,
    size: usize,
    kind: Kind,
    extra: ExtraStreams,
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
            extra: ExtraStreams::default(),
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
        self.extra.record(self.pool.device(), self.stream, stream);
    }
}

impl Drop for Block<'_> {
    fn drop(&mut self) {
        // Read in place, not taken: a block used on no other stream (nearly
        // every one) then builds and drops no empty list on its free.
        let extra = self.extra.streams();
        self.pool
            .shared
            .free_block(self.ptr, self.kind, self.size as u64, self.stream, extra);
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

/// The streams other than its own that used a block (`record_stream`).
///
/// Rare, so the list is allocated on the first record: an unused one is
/// two words (a once flag and an empty box). That keeps [`Block`] at 64
/// bytes instead of 80: a training step holds thousands of blocks, and
/// RMM's `random_allocations` keeps 10^5 in one array (L2-sized cache
/// misses per operation there: 3.76 -> 3.50 under cachegrind).
/// Shared by [`Block`] and `MovableBlock`.
#[derive(Default)]
pub(crate) struct ExtraStreams(OnceLock<Box<Mutex<Vec<StreamHandle>>>>);

impl ExtraStreams {
    /// Adds `stream` once, unless it is `own`, the block's stream on device
    /// `dev`; a stream of another device is ignored with a warning (it
    /// cannot touch this memory).
    pub(crate) fn record(&self, dev: usize, own: &Stream, stream: &Stream) {
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
        let mut e = self.0.get_or_init(Box::default).lock();
        if !e.contains(&stream.handle()) {
            e.push(stream.handle());
        }
    }

    /// The recorded streams, leaving none (for a free that moves them).
    pub(crate) fn take(&mut self) -> Vec<StreamHandle> {
        self.0.take().map(|m| m.into_inner()).unwrap_or_default()
    }

    /// The recorded streams (for the free).
    pub(crate) fn streams(&mut self) -> &[StreamHandle] {
        self.0.get_mut().map_or(&[], |m| m.get_mut().as_slice())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unused_stream_list_is_two_words_and_a_block_fits_a_cache_line() {
        assert_eq!(std::mem::size_of::<ExtraStreams>(), 16);
        assert!(std::mem::size_of::<Block<'_>>() <= 64);
    }
}
