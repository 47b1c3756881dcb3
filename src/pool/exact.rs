//! Large ranges freed on a stream, kept whole for exact-size reuse.
//!
//! Training loops allocate the same tensor sizes step after step. A large
//! block freed on its own stream is parked here, still allocated in the
//! heap, under `(stream slot, length)`; the next request of that length on
//! that stream takes it back in O(1), without best fit, splitting,
//! coalescing or granule bookkeeping. Reuse on the same stream needs no
//! event (stream order covers it), exactly like the heap's `Dirty` ranges.
//!
//! Parked ranges are given to the heap (as `Dirty(slot)` free ranges, where
//! they coalesce) whenever a request cannot be served from memory the heap
//! already backs, before a stream is flushed, and before any reclaim, so
//! parking never makes the pool grow or strands memory.

use rustc_hash::FxHashMap;

/// Parked ranges by `(slot, len)`.
#[derive(Debug, Default)]
pub(crate) struct ExactCache {
    map: FxHashMap<(u16, u64), Vec<u64>>,
    /// Bytes parked.
    pub bytes: u64,
}

impl ExactCache {
    /// A parked range of exactly `len` bytes freed on `slot`.
    #[inline]
    pub(crate) fn take(&mut self, slot: u16, len: u64) -> Option<u64> {
        let v = self.map.get_mut(&(slot, len))?;
        let addr = v.pop()?;
        self.bytes -= len;
        Some(addr)
    }

    /// Parks a range freed on `slot`.
    #[inline]
    pub(crate) fn put(&mut self, slot: u16, len: u64, addr: u64) {
        self.map.entry((slot, len)).or_default().push(addr);
        self.bytes += len;
    }

    /// Removes and returns every parked range as `(slot, len, addr)`.
    pub(crate) fn drain(&mut self) -> Vec<(u16, u64, u64)> {
        self.bytes = 0;
        let mut out = Vec::new();
        for ((slot, len), v) in self.map.drain() {
            out.extend(v.into_iter().map(|a| (slot, len, a)));
        }
        out
    }

    /// Removes and returns the ranges parked by `slot` as `(len, addr)`.
    pub(crate) fn drain_slot(&mut self, slot: u16) -> Vec<(u64, u64)> {
        let keys: Vec<(u16, u64)> = self.map.keys().filter(|k| k.0 == slot).copied().collect();
        let mut out = Vec::new();
        for k in keys {
            if let Some(v) = self.map.remove(&k) {
                self.bytes -= k.1 * v.len() as u64;
                out.extend(v.into_iter().map(|a| (k.1, a)));
            }
        }
        out
    }

    /// Every parked address.
    pub(crate) fn addrs(&self) -> impl Iterator<Item = u64> + '_ {
        self.map.values().flatten().copied()
    }

    /// Whether nothing is parked.
    pub(crate) fn is_empty(&self) -> bool {
        self.bytes == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_sizes_per_slot_lifo_and_byte_count() {
        let mut c = ExactCache::default();
        c.put(0, 512, 0x1000);
        c.put(0, 512, 0x2000);
        c.put(1, 512, 0x3000);
        c.put(0, 1024, 0x4000);
        assert_eq!(c.bytes, 2560);
        assert_eq!(c.take(0, 512), Some(0x2000));
        assert_eq!(c.take(0, 768), None);
        assert_eq!(c.take(2, 512), None);
        let mut s0 = c.drain_slot(0);
        s0.sort_unstable();
        assert_eq!(s0, vec![(512, 0x1000), (1024, 0x4000)]);
        assert_eq!(c.bytes, 512);
        assert_eq!(c.drain(), vec![(1, 512, 0x3000)]);
        assert!(c.is_empty());
    }
}
