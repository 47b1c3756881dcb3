//! `Block`: an RAII device allocation, freed stream-ordered on drop.

use super::small::SizeWord;
use super::{DevicePool, Kind, Stream, StreamCore};
use crate::ptr::DevicePtr;
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{
    AtomicU64,
    Ordering::{Relaxed, Release},
};
use std::sync::Arc;

/// A live device allocation. Dropping it frees the memory, ordered after
/// the work enqueued so far on its stream and on every stream passed to
/// [`Block::record_stream`]; the host never waits.
///
/// Four words: the stream (which leads to its pool), the address, the
/// requested size (for a slab slot: the slot's size word, which holds it)
/// and one word packing where the memory came from with a flag for
/// recorded streams. A training step holds thousands of blocks,
/// and RMM's `random_allocations` keeps tens of thousands in one array,
/// picked at random: at 32 bytes two blocks share a cache line, where the
/// 64-byte layout (pool, stream list inline) spread one over two.
pub struct Block<'a> {
    stream: &'a Stream,
    ptr: DevicePtr,
    /// The requested size of a large block; for a small one (the
    /// [`Meta::SMALL`] bit) the bits of its slot's [`SizeWord`], where the
    /// pool keeps the requested size anyway: the free reads it there and
    /// hands the word back to the magazine, so neither side of the pair
    /// looks the slot up.
    size: usize,
    /// [`Meta`] bits; atomic only so that [`Block::record_stream`] can set
    /// [`Meta::RECORDED`] through a shared reference.
    meta: AtomicU64,
    _pool: PhantomData<&'a DevicePool>,
}

/// The packed [`Kind`] of a block, with a flag saying whether the pool
/// holds streams recorded for it.
struct Meta;

impl Meta {
    /// The block is a slab slot: class in bits 32..48, slot index below.
    const SMALL: u64 = 1 << 63;
    /// [`Block::record_stream`] added streams to the pool's table.
    const RECORDED: u64 = 1 << 62;

    #[inline]
    fn pack(kind: Kind) -> u64 {
        match kind {
            Kind::Small { idx, class } => Self::SMALL | (class as u64) << 32 | idx as u64,
            Kind::Large { len } => {
                debug_assert!(len < Self::RECORDED);
                len
            }
        }
    }

    #[inline]
    fn kind(w: u64) -> Kind {
        if w & Self::SMALL != 0 {
            Kind::Small {
                idx: w as u32,
                class: (w >> 32) as u16,
            }
        } else {
            Kind::Large {
                len: w & !Self::RECORDED,
            }
        }
    }
}

impl<'a> Block<'a> {
    /// A large block (see [`PoolShared::block`](super::PoolShared::block)).
    pub(crate) fn new(stream: &'a Stream, ptr: DevicePtr, size: usize, kind: Kind) -> Self {
        debug_assert!(matches!(kind, Kind::Large { .. }));
        Block {
            stream,
            ptr,
            size,
            meta: AtomicU64::new(Meta::pack(kind)),
            _pool: PhantomData,
        }
    }

    /// A slab slot of `stream`'s pool, with its size word, which holds
    /// the requested size.
    ///
    /// # Safety
    ///
    /// `word` is slot `idx`'s size word in the slabs of `stream`'s pool
    /// ([`Block::size`] and the free read it).
    #[inline(always)]
    pub(crate) unsafe fn small(
        stream: &'a Stream,
        ptr: DevicePtr,
        idx: u32,
        class: u16,
        word: SizeWord,
    ) -> Self {
        Block {
            stream,
            ptr,
            size: word.to_bits(),
            meta: AtomicU64::new(Meta::pack(Kind::Small { idx, class })),
            _pool: PhantomData,
        }
    }

    /// The requested size and, for a slab slot, its size word.
    #[inline(always)]
    fn requested(&self, meta: u64) -> (u64, Option<SizeWord>) {
        if meta & Meta::SMALL == 0 {
            return (self.size as u64, None);
        }
        let w = SizeWord::from_bits(self.size);
        // SAFETY: the word is in the slabs of this block's pool (`small`'s
        // contract), which the block's stream keeps alive (its `Arc`).
        (unsafe { w.requested() }, Some(w))
    }

    /// The device address (256-byte aligned).
    #[inline]
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// The requested size in bytes.
    #[inline]
    pub fn size(&self) -> usize {
        self.requested(self.meta.load(Relaxed)).0 as usize
    }

    /// The stream the block was allocated on.
    pub fn stream(&self) -> &Stream {
        self.stream
    }

    /// Marks the block as used on `stream` too: its free will wait for the
    /// work enqueued on that stream up to the free. A stream of another
    /// device is ignored with a warning (it cannot touch this memory).
    pub fn record_stream(&self, stream: &Stream) {
        if !self.stream.records(stream) {
            return;
        }
        // Rare, so the list lives in the pool's table (shared with raw
        // pointers), not in every block.
        self.stream
            .inner
            .pool
            .add_recorded_stream(self.ptr.addr(), stream.core());
        self.meta.fetch_or(Meta::RECORDED, Release);
    }
}

impl Drop for Block<'_> {
    #[inline]
    fn drop(&mut self) {
        let w = *self.meta.get_mut();
        let pool = &self.stream.inner.pool;
        if w & (Meta::SMALL | Meta::RECORDED) == Meta::SMALL {
            let Kind::Small { idx, class } = Meta::kind(w) else {
                unreachable!("the small bit is set");
            };
            let (requested, Some(word)) = self.requested(w) else {
                unreachable!("a small block has a size word");
            };
            if pool.free_small_front(self.ptr, idx, class, requested, self.stream, word) {
                return;
            }
        }
        self.free_general(w);
    }
}

impl Block<'_> {
    /// Every free the fast lane does not take (kept out of line, so that
    /// the lane's few instructions stay in `drop`).
    #[inline(never)]
    fn free_general(&self, w: u64) {
        let pool = &self.stream.inner.pool;
        // Dropped at the end, outside every pool lock: the last reference
        // to a recorded stream may destroy it (after its event is recorded).
        let extra: Vec<Arc<StreamCore>> = if w & Meta::RECORDED != 0 {
            pool.take_recorded_streams(self.ptr.addr())
        } else {
            Vec::new()
        };
        pool.free_block(
            self.ptr,
            Meta::kind(w),
            self.requested(w).0,
            self.stream,
            &extra,
        );
        if !extra.is_empty() {
            pool.pace_harvest();
        }
    }
}

impl fmt::Debug for Block<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Block")
            .field("device", &self.stream.device())
            .field("ptr", &self.ptr)
            .field("size", &self.size())
            .field("stream", &self.stream.handle())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_is_four_words() {
        assert_eq!(std::mem::size_of::<Block<'_>>(), 32);
    }

    #[test]
    fn kinds_round_trip_through_the_packed_word() {
        for kind in [
            Kind::Small { idx: 0, class: 0 },
            Kind::Small {
                idx: u32::MAX,
                class: u16::MAX,
            },
            Kind::Large { len: 256 },
            Kind::Large { len: 1 << 61 },
        ] {
            let w = Meta::pack(kind);
            assert_eq!(Meta::kind(w), kind);
            assert_eq!(Meta::kind(w | Meta::RECORDED), kind);
        }
    }
}
