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

/// Parked ranges `(len, addr)` by stream slot and class, oldest first.
///
/// The lists are dense arrays, `slots[slot][class]`, grown on demand: a
/// take or a park indexes them directly, and a miss looks at the next
/// classes' lists, which sit beside its own (a hash map keyed by
/// `(slot, class)` paid a probe and a likely cache miss for each).
#[derive(Debug, Default)]
pub(crate) struct ExactCache {
    slots: Vec<SlotLists>,
    /// Ranges parked.
    count: usize,
    /// Bytes parked.
    pub bytes: u64,
    /// One slot's addresses while [`ExactCache::drain_sorted`] hands them
    /// over (kept for its capacity).
    scratch: Vec<u64>,
}

/// One stream slot's class lists, with a bitmap of the non-empty ones so
/// that giving everything back visits only those (a large block's class
/// is in the thousands).
#[derive(Debug, Default)]
struct SlotLists {
    lists: Vec<Vec<(u64, u64)>>,
    nonempty: Vec<u64>,
}

impl SlotLists {
    /// The newest range of class `c`, if any.
    #[inline]
    fn pop(&mut self, c: usize) -> Option<(u64, u64)> {
        let r = self.lists.get_mut(c)?.pop()?;
        self.note_taken(c);
        Some(r)
    }

    /// Clears the bit of class `c` if its list became empty.
    #[inline]
    fn note_taken(&mut self, c: usize) {
        if self.lists[c].is_empty() {
            self.nonempty[c / 64] &= !(1 << (c % 64));
        }
    }

    #[inline]
    fn push(&mut self, c: usize, r: (u64, u64)) {
        if self.lists.len() <= c {
            self.lists.resize_with(c + 1, Vec::new);
            self.nonempty.resize((c + 1).div_ceil(64), 0);
        }
        self.lists[c].push(r);
        self.nonempty[c / 64] |= 1 << (c % 64);
    }

    /// Empties every list (keeping its capacity), passing each range to `f`.
    fn drain_each(&mut self, mut f: impl FnMut(u64, u64)) {
        for w in 0..self.nonempty.len() {
            let mut bits = std::mem::take(&mut self.nonempty[w]);
            while bits != 0 {
                let c = w * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                for (l, a) in self.lists[c].drain(..) {
                    f(l, a);
                }
            }
        }
    }
}

impl ExactCache {
    /// A parked range of `len` bytes or a little more (its class or one of
    /// the next [`NEXT_CLASSES`]), freed on `slot`: `(addr, its length)`.
    #[inline]
    pub(crate) fn take(&mut self, slot: u16, len: u64) -> Option<(u64, u64)> {
        let class = class_of(len) as usize;
        let sl = self.slots.get_mut(slot as usize)?;
        let own = sl.lists.get_mut(class).and_then(|v| take_in_class(v, len));
        let hit = match own {
            Some(hit) => {
                sl.note_taken(class);
                hit
            }
            // Every range of a higher class is longer than `len`: the newest.
            None => (class + 1..=class + NEXT_CLASSES as usize).find_map(|c| sl.pop(c))?,
        };
        self.bytes -= hit.0;
        self.count -= 1;
        Some((hit.1, hit.0))
    }

    /// Parks a range of `len` bytes freed on `slot`.
    #[inline]
    pub(crate) fn put(&mut self, slot: u16, len: u64, addr: u64) {
        let slot = slot as usize;
        if self.slots.len() <= slot {
            self.slots.resize_with(slot + 1, SlotLists::default);
        }
        self.slots[slot].push(class_of(len) as usize, (len, addr));
        self.bytes += len;
        self.count += 1;
    }

    /// Removes every parked range, passing each to `f` as
    /// `(slot, len, addr)` (the pool gives ranges back with
    /// [`ExactCache::drain_sorted`]). The class lists keep their capacity: a cache
    /// emptied this way refills at once (freeing every list made each
    /// refill regrow hundreds of vectors, 4% of the instructions of
    /// random_allocations).
    #[cfg(test)]
    pub(crate) fn drain_each(&mut self, mut f: impl FnMut(u16, u64, u64)) {
        self.bytes = 0;
        self.count = 0;
        for (slot, sl) in self.slots.iter_mut().enumerate() {
            sl.drain_each(|l, a| f(slot as u16, l, a));
        }
    }

    /// Removes every parked range, passing each slot's addresses to `f` at
    /// once, ascending: freed in that order, ranges that sit side by side
    /// (often parked neighbours) merge while their index entries are still
    /// cached, and the granules' records are read in order, where class
    /// order visited them at random (the lengths are the heap's to give:
    /// bare addresses sort in half the instructions of `(addr, len)` pairs).
    pub(crate) fn drain_sorted(&mut self, mut f: impl FnMut(u16, &[u64])) {
        self.bytes = 0;
        self.count = 0;
        let ExactCache { slots, scratch, .. } = self;
        for (slot, sl) in slots.iter_mut().enumerate() {
            scratch.clear();
            sl.drain_each(|_, a| scratch.push(a));
            if scratch.is_empty() {
                continue;
            }
            scratch.sort_unstable();
            f(slot as u16, scratch);
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
        let Some(sl) = self.slots.get_mut(slot as usize) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        sl.drain_each(|l, a| out.push((l, a)));
        self.bytes -= out.iter().map(|r| r.0).sum::<u64>();
        self.count -= out.len();
        out
    }

    /// Every parked address.
    pub(crate) fn addrs(&self) -> impl Iterator<Item = u64> + '_ {
        self.slots
            .iter()
            .flat_map(|sl| sl.lists.iter().flatten())
            .map(|r| r.1)
    }

    /// Whether nothing is parked.
    pub(crate) fn is_empty(&self) -> bool {
        self.count == 0
    }
}

/// A parked range of list `v` (one class) at least `len` long, as
/// `(len, addr)`: an exact length among the newest [`SCAN`], else the
/// shortest that fits among them, else the shortest that fits of the
/// older ones.
#[inline]
fn take_in_class(v: &mut Vec<(u64, u64)>, len: u64) -> Option<(u64, u64)> {
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
    // (An emptied list keeps its capacity: the same class comes back at
    // once in a loop.) The newest is the usual pick: no shift for it.
    let i = best?;
    Some(if i + 1 == v.len() {
        v.pop().expect("index in range")
    } else {
        v.remove(i)
    })
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
    fn drain_sorted_gives_each_slot_ascending_and_empties() {
        let mut c = ExactCache::default();
        for (i, a) in [0x9000u64, 0x1000, 0x5000, 0x3000].into_iter().enumerate() {
            c.put((i % 2) as u16, 512 << i, a);
        }
        let mut got = Vec::new();
        c.drain_sorted(|s, addrs| got.push((s, addrs.to_vec())));
        assert_eq!(
            got,
            vec![(0, vec![0x5000, 0x9000]), (1, vec![0x1000, 0x3000])]
        );
        assert!(c.is_empty() && c.bytes == 0 && c.take(0, 512).is_none());
        c.put(1, 512, 0x7000);
        assert_eq!(c.take(1, 512), Some((0x7000, 512)));
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

    #[test]
    fn takes_and_drains_match_a_plain_model() {
        // Random parks and takes over three slots and lengths from 256 B to
        // 1 GiB; the cache must give back exactly the ranges a plain list
        // holds, and a take must return a parked range of its slot that
        // fits within the next classes.
        let mut c = ExactCache::default();
        let mut model: Vec<(u16, u64, u64)> = Vec::new();
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for step in 0..20_000u64 {
            let r = next();
            let slot = (r % 3) as u16;
            let len = 256 * (1 + (r >> 8) % (1 << ((r >> 40) % 23)));
            if r >> 60 < 9 {
                c.put(slot, len, step << 32);
                model.push((slot, len, step << 32));
            } else if let Some((addr, got)) = c.take(slot, len) {
                let i = model.iter().position(|m| m.2 == addr).expect("was parked");
                assert_eq!((model[i].0, model[i].1), (slot, got));
                assert!(got >= len && class_of(got) <= class_of(len) + NEXT_CLASSES);
                model.swap_remove(i);
            } else {
                // Nothing of this slot at least `len` long within reach.
                let reach = class_of(len) + NEXT_CLASSES;
                assert!(!model
                    .iter()
                    .any(|m| m.0 == slot && m.1 >= len && class_of(m.1) <= reach));
            }
            assert_eq!(c.bytes, model.iter().map(|m| m.1).sum::<u64>());
            if step % 5_000 == 4_999 {
                let mut all = c.drain();
                all.sort_unstable();
                model.sort_unstable();
                assert_eq!(all, model);
                assert!(c.is_empty() && c.addrs().next().is_none());
                model.clear();
            }
        }
    }
}
