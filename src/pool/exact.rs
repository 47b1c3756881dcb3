//! Large ranges freed on a stream, kept whole for reuse by size class.
//!
//! Training loops allocate the same tensor sizes step after step; serving
//! and random workloads allocate sizes that differ by a few hundred bytes.
//! A large block freed on its own stream is parked here, still allocated in
//! the heap, under `(stream slot, size class)`, where a class spans 1/64 of
//! a power of two. The next request on that stream whose length falls in
//! the class takes a parked range at least that long back in O(1), without
//! best fit, splitting, coalescing or granule bookkeeping: an exact length
//! if one of the most recent few is, else the shortest that fits, else the
//! newest range of one of the next [`NEXT_CLASSES`] classes. The block
//! keeps the whole range, so reuse costs at most 3/64 of it (4.7%, against
//! up to 25% for the small classes) while it lives. Reuse on the same
//! stream needs no event (stream order covers it), exactly like the heap's
//! `Dirty` ranges.
//!
//! Why the next classes: a workload whose sizes vary (serving, RMM's
//! random_allocations) rarely finds its own class stocked, and every miss
//! costs a best fit and, later, a merge in the heap (about ten times a
//! parked hit). Measured on random_allocations at 10^5 (sizes uniform to
//! 1 MiB): hits rise from 56 k to 81 k of 97 k allocations per repetition
//! and the instructions of the loop fall by a quarter, for 1% more peak
//! reserved memory; training traces repeat exact sizes and do not change
//! (docs/BENCHMARKS.md).
//!
//! Parked ranges are given to the heap (as `Dirty(slot)` free ranges, where
//! they coalesce) whenever a request cannot be served from memory the heap
//! already backs, before a stream is flushed, and before any reclaim, so
//! parking never makes the pool grow or strands memory.

use rustc_hash::FxHashMap;

/// Bits below a length's leading one that pick its class: 64 classes per
/// power of two.
const CLASS_BITS: u32 = 6;
/// Parked ranges of a class looked at for an exact length, newest first.
const SCAN: usize = 8;
/// Classes above a request's own whose parked ranges may serve it (each
/// adds at most 1/64 of a power of two to what the block holds).
pub(crate) const NEXT_CLASSES: u32 = 2;

/// The parking class of `len`: lengths in one class differ by less than
/// 1/64 of the smallest of them.
#[inline]
fn class_of(len: u64) -> u32 {
    let fl = 63 - len.max(1).leading_zeros();
    if fl < CLASS_BITS {
        return len as u32;
    }
    let sub = (len >> (fl - CLASS_BITS)) as u32 & ((1 << CLASS_BITS) - 1);
    (fl - CLASS_BITS + 1) * (1 << CLASS_BITS) + sub
}

/// Parked ranges `(len, addr)` by `(slot, class)`, oldest first.
#[derive(Debug, Default)]
pub(crate) struct ExactCache {
    map: FxHashMap<(u16, u32), Vec<(u64, u64)>>,
    /// Bytes parked.
    pub bytes: u64,
}

impl ExactCache {
    /// A parked range of `len` bytes or a little more (its class or one of
    /// the next [`NEXT_CLASSES`]), freed on `slot`: `(addr, its length)`.
    #[inline]
    pub(crate) fn take(&mut self, slot: u16, len: u64) -> Option<(u64, u64)> {
        let class = class_of(len);
        if let Some(hit) = self.take_in_class(slot, class, len) {
            return Some(hit);
        }
        // Every range of a higher class is longer than `len`: the newest.
        for c in class + 1..=class + NEXT_CLASSES {
            if let Some((l, addr)) = self.map.get_mut(&(slot, c)).and_then(Vec::pop) {
                self.bytes -= l;
                return Some((addr, l));
            }
        }
        None
    }

    /// A parked range of class `class` at least `len` long.
    #[inline]
    fn take_in_class(&mut self, slot: u16, class: u32, len: u64) -> Option<(u64, u64)> {
        let v = self.map.get_mut(&(slot, class))?;
        let mut best: Option<usize> = None;
        for i in (0..v.len()).rev().take(SCAN) {
            let l = v[i].0;
            if l == len {
                best = Some(i);
                break;
            }
            if l > len && best.is_none_or(|b| l < v[b].0) {
                best = Some(i);
            }
        }
        if best.is_none() && v.len() > SCAN {
            // Older entries: the shortest that fits.
            best = (0..v.len() - SCAN)
                .filter(|&i| v[i].0 >= len)
                .min_by_key(|&i| v[i].0);
        }
        // (An emptied list keeps its key and capacity: the same class
        // comes back at once in a loop.)
        let (l, addr) = v.remove(best?);
        self.bytes -= l;
        Some((addr, l))
    }

    /// Parks a range of `len` bytes freed on `slot`.
    #[inline]
    pub(crate) fn put(&mut self, slot: u16, len: u64, addr: u64) {
        self.map
            .entry((slot, class_of(len)))
            .or_default()
            .push((len, addr));
        self.bytes += len;
    }

    /// Removes every parked range, passing each to `f` as
    /// `(slot, len, addr)`. The class lists keep their capacity: a cache
    /// emptied this way refills at once (freeing every list made each
    /// refill regrow hundreds of vectors, 4% of the instructions of
    /// random_allocations).
    pub(crate) fn drain_each(&mut self, mut f: impl FnMut(u16, u64, u64)) {
        self.bytes = 0;
        for (&(slot, _), v) in &mut self.map {
            for (l, a) in v.drain(..) {
                f(slot, l, a);
            }
        }
    }

    /// Removes and returns every parked range as `(slot, len, addr)`.
    #[cfg(test)]
    fn drain(&mut self) -> Vec<(u16, u64, u64)> {
        let mut out = Vec::new();
        self.drain_each(|s, l, a| out.push((s, l, a)));
        out
    }

    /// Removes and returns the ranges parked by `slot` as `(len, addr)`.
    pub(crate) fn drain_slot(&mut self, slot: u16) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        self.map.retain(|&(s, _), v| {
            if s == slot {
                out.append(v);
            }
            !v.is_empty()
        });
        self.bytes -= out.iter().map(|r| r.0).sum::<u64>();
        out
    }

    /// Every parked address.
    pub(crate) fn addrs(&self) -> impl Iterator<Item = u64> + '_ {
        self.map.values().flatten().map(|r| r.1)
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
        assert_eq!(c.take(0, 512), Some((0x2000, 512)));
        assert_eq!(c.take(0, 768), None);
        assert_eq!(c.take(2, 512), None);
        let mut s0 = c.drain_slot(0);
        s0.sort_unstable();
        assert_eq!(s0, vec![(512, 0x1000), (1024, 0x4000)]);
        assert_eq!(c.bytes, 512);
        assert_eq!(c.drain(), vec![(1, 512, 0x3000)]);
        assert!(c.is_empty());
    }

    #[test]
    fn a_class_serves_lengths_within_a_sixty_fourth() {
        let mib = 1u64 << 20;
        assert_eq!(class_of(mib), class_of(mib + mib / 64 - 256));
        assert_ne!(class_of(mib), class_of(mib + mib / 64));
        assert_ne!(class_of(mib - 256), class_of(mib));
        let mut c = ExactCache::default();
        c.put(0, mib + 8192, 0x10_0000);
        c.put(0, mib + 4096, 0x20_0000);
        c.put(0, mib + 12288, 0x30_0000);
        // Too long for a request of the class's top; the shortest that
        // fits otherwise; never a shorter range.
        assert_eq!(c.take(0, mib + 12544), None);
        assert_eq!(c.take(0, mib - 16384 - 256), None, "three classes down");
        assert_eq!(c.take(0, mib), Some((0x20_0000, mib + 4096)));
        assert_eq!(c.take(0, mib + 8192), Some((0x10_0000, mib + 8192)));
        assert_eq!(c.take(0, mib + 12288), Some((0x30_0000, mib + 12288)));
        assert!(c.is_empty());
    }

    #[test]
    fn a_request_takes_the_next_classes_when_its_own_is_empty() {
        let mib = 1u64 << 20;
        let step = mib / 64;
        let mut c = ExactCache::default();
        c.put(0, mib + 2 * step, 0x10_0000);
        c.put(0, mib + 2 * step + 512, 0x20_0000);
        c.put(0, mib + 3 * step, 0x30_0000);
        // Class of `mib` is empty: the newest range two classes up.
        assert_eq!(c.take(0, mib), Some((0x20_0000, mib + 2 * step + 512)));
        assert_eq!(c.take(0, mib), Some((0x10_0000, mib + 2 * step)));
        // Three classes up is too far.
        assert_eq!(c.take(0, mib), None);
        assert_eq!(c.take(0, mib + step), Some((0x30_0000, mib + 3 * step)));
        // Never from another stream.
        c.put(1, mib + step, 0x40_0000);
        assert_eq!(c.take(0, mib), None);
        assert!(!c.is_empty());
    }
}
