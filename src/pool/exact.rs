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
//! they coalesce, or `Clean` ones where their stream was found idle, see
//! `idle.rs`) whenever a request cannot be served from memory the heap
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

/// One stream's parked ranges `(len, addr)` by class, oldest first, with
/// a bitmap of the non-empty classes so that giving everything back visits
/// only those (a large block's class is in the thousands). Each stream's
/// lists sit under that stream's own lock (`stream_large.rs`).
///
/// The lists are dense arrays, `lists[class]`, grown on demand: a take or
/// a park indexes them directly, and a miss looks at the next classes'
/// lists, which sit beside its own (a hash map keyed by `(slot, class)`
/// paid a probe and a likely cache miss for each).
#[derive(Debug, Default)]
pub(crate) struct ParkedLists {
    lists: Vec<Vec<(u64, u64)>>,
    nonempty: Vec<u64>,
    /// Ranges parked.
    pub(crate) count: usize,
    /// Bytes parked.
    pub(crate) bytes: u64,
    /// Ranges ever parked (never decreases): a drain compares it with a
    /// count read before a stream query (`stream_large.rs`).
    pub(crate) puts: u64,
}

impl ParkedLists {
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

    /// Parks a range of `len` bytes at `addr`.
    #[inline]
    pub(crate) fn put(&mut self, len: u64, addr: u64) {
        let c = class_of(len) as usize;
        if self.lists.len() <= c {
            self.lists.resize_with(c + 1, Vec::new);
            self.nonempty.resize((c + 1).div_ceil(64), 0);
        }
        self.lists[c].push((len, addr));
        self.nonempty[c / 64] |= 1 << (c % 64);
        self.count += 1;
        self.bytes += len;
        self.puts += 1;
    }

    /// A parked range of `len` bytes or a little more (its class or one of
    /// the next [`NEXT_CLASSES`]): `(addr, its length)`.
    #[inline]
    pub(crate) fn take(&mut self, len: u64) -> Option<(u64, u64)> {
        let class = class_of(len) as usize;
        let own = self
            .lists
            .get_mut(class)
            .and_then(|v| take_in_class(v, len));
        let hit = match own {
            Some(hit) => {
                self.note_taken(class);
                hit
            }
            // Every range of a higher class is longer than `len`: the newest.
            None => (class + 1..=class + NEXT_CLASSES as usize).find_map(|c| self.pop(c))?,
        };
        self.count -= 1;
        self.bytes -= hit.0;
        Some((hit.1, hit.0))
    }

    /// Empties every list, passing each range to `f` as `(len, addr)`. The
    /// class lists keep their capacity: a cache emptied this way refills
    /// at once (freeing every list made each refill regrow hundreds of
    /// vectors, 4% of the instructions of random_allocations).
    pub(crate) fn drain_each(&mut self, mut f: impl FnMut(u64, u64)) {
        self.count = 0;
        self.bytes = 0;
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

    /// Every parked address.
    pub(crate) fn addrs(&self) -> impl Iterator<Item = u64> + '_ {
        self.lists.iter().flatten().map(|r| r.1)
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

    fn drain(c: &mut ParkedLists) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        c.drain_each(|l, a| out.push((l, a)));
        out.sort_unstable();
        out
    }

    #[test]
    fn exact_sizes_lifo_and_byte_count() {
        let mut c = ParkedLists::default();
        c.put(512, 0x1000);
        c.put(512, 0x2000);
        c.put(1024, 0x4000);
        assert_eq!((c.bytes, c.count), (2048, 3));
        assert_eq!(c.take(512), Some((0x2000, 512)));
        assert_eq!(c.take(768), None);
        assert_eq!(c.bytes, 1536);
        assert_eq!(drain(&mut c), vec![(512, 0x1000), (1024, 0x4000)]);
        assert_eq!((c.bytes, c.count), (0, 0));
        assert!(c.take(512).is_none() && c.addrs().next().is_none());
        c.put(512, 0x7000);
        assert_eq!(c.take(512), Some((0x7000, 512)));
    }

    #[test]
    fn a_class_serves_lengths_within_a_sixty_fourth() {
        let mib = 1u64 << 20;
        assert_eq!(class_of(mib), class_of(mib + mib / 64 - 256));
        assert_ne!(class_of(mib), class_of(mib + mib / 64));
        assert_ne!(class_of(mib - 256), class_of(mib));
        let mut c = ParkedLists::default();
        c.put(mib + 8192, 0x10_0000);
        c.put(mib + 4096, 0x20_0000);
        c.put(mib + 12288, 0x30_0000);
        // Too long for a request of the class's top; the shortest that
        // fits otherwise; never a shorter range.
        assert_eq!(c.take(mib + 12544), None);
        assert_eq!(c.take(mib - 16384 - 256), None, "three classes down");
        assert_eq!(c.take(mib), Some((0x20_0000, mib + 4096)));
        assert_eq!(c.take(mib + 8192), Some((0x10_0000, mib + 8192)));
        assert_eq!(c.take(mib + 12288), Some((0x30_0000, mib + 12288)));
        assert_eq!(c.count, 0);
    }

    #[test]
    fn a_request_takes_the_next_classes_when_its_own_is_empty() {
        let mib = 1u64 << 20;
        let step = mib / 64;
        let mut c = ParkedLists::default();
        c.put(mib + 2 * step, 0x10_0000);
        c.put(mib + 2 * step + 512, 0x20_0000);
        c.put(mib + 3 * step, 0x30_0000);
        // Class of `mib` is empty: the newest range two classes up.
        assert_eq!(c.take(mib), Some((0x20_0000, mib + 2 * step + 512)));
        assert_eq!(c.take(mib), Some((0x10_0000, mib + 2 * step)));
        // Three classes up is too far.
        assert_eq!(c.take(mib), None);
        assert_eq!(c.take(mib + step), Some((0x30_0000, mib + 3 * step)));
    }

    #[test]
    fn takes_and_drains_match_a_plain_model() {
        // Random parks and takes of lengths from 256 B to 1 GiB; the lists
        // must give back exactly the ranges a plain list holds, and a take
        // must return a parked range that fits within the next classes.
        let mut c = ParkedLists::default();
        let mut model: Vec<(u64, u64)> = Vec::new();
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for step in 0..20_000u64 {
            let r = next();
            let len = 256 * (1 + (r >> 8) % (1 << ((r >> 40) % 23)));
            if r >> 60 < 9 {
                c.put(len, step << 32);
                model.push((len, step << 32));
            } else if let Some((addr, got)) = c.take(len) {
                let i = model.iter().position(|m| m.1 == addr).expect("was parked");
                assert_eq!(model[i].0, got);
                assert!(got >= len && class_of(got) <= class_of(len) + NEXT_CLASSES);
                model.swap_remove(i);
            } else {
                // Nothing at least `len` long within reach.
                let reach = class_of(len) + NEXT_CLASSES;
                assert!(!model.iter().any(|m| m.0 >= len && class_of(m.0) <= reach));
            }
            assert_eq!(c.bytes, model.iter().map(|m| m.0).sum::<u64>());
            assert_eq!(c.count, model.len());
            if step % 5_000 == 4_999 {
                model.sort_unstable();
                assert_eq!(drain(&mut c), model);
                model.clear();
            }
        }
    }
}
