//! Free ranges by address: the heap's index for merging neighbours.
//!
//! Freeing a range merges it with the free ranges that end where it starts
//! and start where it ends, and splitting one keeps its head in place: the
//! range starting at an address, the range ending at one (the last start
//! before it), and for the slow paths the range covering an address.
//!
//! Inside one reservation (VMM mode) the ranges sit in short vectors sorted
//! by start, one per granule, with a bitmap of granules that hold any
//! ([`AddrIndex::for_reservation`]): every lookup is a binary search in one
//! small vector, and the range before an address is found in that
//! address's granule or, past empty ones, by a bitmap scan. The range after
//! a freed block usually starts in the block's own granule, so a merge
//! finds both neighbours in one vector. The vectors hold the ranges
//! themselves: a hash map from start to range beside them (kept before) cost
//! a likely cache miss for every lookup on top of the vector's, and in
//! RMM's random_allocations at 10^5 the index's misses per operation fell
//! by a third without it (see `git log`). (Before the vectors, one ordered
//! tree of tens of thousands of starts cost a full descent per change.)
//! Plain segments keep a hash map by start plus an ordered tree of starts.
//!
//! Invariant: the ranges never overlap; in VMM mode each vector is sorted
//! and holds exactly the starts inside its granule (the last one also those
//! past the end), and a granule's bit is set while its vector is non-empty.

use super::granule_set::GranuleSet;
use rustc_hash::FxHashMap;
use smallvec::SmallVec;
use std::collections::BTreeSet;

/// A free range's length and tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span<T> {
    /// Bytes.
    pub len: u64,
    /// Who may reuse it.
    pub tag: T,
}

/// One granule's ranges, sorted by start: up to two inline, so that a
/// lookup in most granules (86% of those in RMM's random_allocations at
/// 10^5 hold two or fewer) reads one cache line, not a vector header and
/// then its heap buffer; aligned so that line is its own.
#[derive(Debug, Clone)]
#[repr(align(64))]
struct Bucket<T>(SmallVec<[(u64, Span<T>); 2]>);

/// Ranges in `[base, base + buckets.len() << shift)`: bucket `i` holds
/// the ranges starting in `[base + i << shift, base + (i+1) << shift)`,
/// sorted by start, and `nonempty` has bit `i` set while it holds any.
#[derive(Debug, Clone)]
struct Buckets<T> {
    base: u64,
    shift: u32,
    buckets: Vec<Bucket<T>>,
    nonempty: GranuleSet,
    len: usize,
}

impl<T: Copy> Buckets<T> {
    /// The bucket of `a`, clamped to the last one.
    #[inline]
    fn of(&self, a: u64) -> Option<usize> {
        let i = (a.checked_sub(self.base)? >> self.shift) as usize;
        Some(i.min(self.buckets.len().checked_sub(1)?))
    }

    /// The bucket of `a` and the position of `a` in it (`Err`: where it
    /// would go).
    #[inline]
    fn find(&self, a: u64) -> Option<(usize, Result<usize, usize>)> {
        let i = self.of(a)?;
        Some((i, self.buckets[i].0.binary_search_by_key(&a, |e| e.0)))
    }

    #[inline]
    fn insert(&mut self, a: u64, s: Span<T>) {
        let (i, at) = self.find(a).expect("address inside the reservation");
        debug_assert!(at.is_err(), "free range at {a:#x} indexed twice");
        let at = match at {
            // (Replaced, as a map would.)
            Ok(at) => {
                self.buckets[i].0[at].1 = s;
                return;
            }
            Err(at) => at,
        };
        let b = &mut self.buckets[i].0;
        b.insert(at, (a, s));
        self.len += 1;
        if b.len() == 1 {
            self.nonempty.insert(i as u32);
        }
    }

    #[inline]
    fn remove(&mut self, a: u64) -> Option<Span<T>> {
        self.remove_if(a, |_| true)
    }

    /// Removes the range at `a` if `pred` holds for it, with one
    /// search of its bucket.
    #[inline]
    fn remove_if(&mut self, a: u64, pred: impl FnOnce(&Span<T>) -> bool) -> Option<Span<T>> {
        let (i, Ok(at)) = self.find(a)? else {
            return None;
        };
        let b = &mut self.buckets[i].0;
        if !pred(&b[at].1) {
            return None;
        }
        let (_, s) = b.remove(at);
        self.len -= 1;
        if b.is_empty() {
            self.nonempty.remove(i as u32);
        }
        Some(s)
    }

    #[inline]
    fn get(&self, a: u64) -> Option<Span<T>> {
        let (i, Ok(at)) = self.find(a)? else {
            return None;
        };
        Some(self.buckets[i].0[at].1)
    }

    #[inline]
    fn get_mut(&mut self, a: u64) -> Option<&mut Span<T>> {
        let (i, Ok(at)) = self.find(a)? else {
            return None;
        };
        Some(&mut self.buckets[i].0[at].1)
    }

    #[inline]
    fn at_or_before(&self, a: u64) -> Option<(u64, Span<T>)> {
        let i = self.of(a)?;
        let here = &self.buckets[i].0;
        let k = here.partition_point(|e| e.0 <= a);
        if k > 0 {
            return Some(here[k - 1]);
        }
        let j = self
            .nonempty
            .last_at_or_before((i as u32).checked_sub(1)?)?;
        self.buckets[j as usize].0.last().copied()
    }

    /// [`Buckets::at_or_before`], for changing the range in place.
    #[inline]
    fn at_or_before_mut(&mut self, a: u64) -> Option<&mut (u64, Span<T>)> {
        let i = self.of(a)?;
        let k = self.buckets[i].0.partition_point(|e| e.0 <= a);
        if k > 0 {
            return Some(&mut self.buckets[i].0[k - 1]);
        }
        let j = self
            .nonempty
            .last_at_or_before((i as u32).checked_sub(1)?)?;
        self.buckets[j as usize].0.last_mut()
    }

    fn range(&self, lo: u64, hi: u64) -> impl Iterator<Item = (u64, Span<T>)> + '_ {
        let end = self.base + ((self.buckets.len() as u64) << self.shift);
        let (lo, hi) = (lo.max(self.base), hi.min(end));
        // An empty bucket range when nothing of [lo, hi) is inside.
        let (first, last) = if lo < hi {
            (
                self.of(lo).unwrap_or(0) as u32,
                self.of(hi - 1).unwrap_or(0) as u32 + 1,
            )
        } else {
            (0, 0)
        };
        self.nonempty
            .range(first, last)
            .flat_map(move |i| self.buckets[i as usize].0.iter().copied())
            .filter(move |&(s, _)| s >= lo && s < hi)
    }

    /// Whether every vector is sorted, in its own bucket, flagged, and
    /// the count agrees.
    fn consistent(&self) -> bool {
        let mut n = 0;
        for (i, Bucket(b)) in self.buckets.iter().enumerate() {
            n += b.len();
            if b.is_empty() == self.nonempty.contains(i as u32)
                || !b.windows(2).all(|w| w[0].0 < w[1].0)
                || b.iter().any(|e| self.of(e.0) != Some(i))
            {
                return false;
            }
        }
        n == self.len
    }
}

/// How the ranges are kept.
#[derive(Debug, Clone)]
enum Inner<T> {
    /// Any addresses: by start in a hash map, starts in order in a tree.
    Tree {
        starts: FxHashMap<u64, Span<T>>,
        order: BTreeSet<u64>,
    },
    /// Addresses inside one reservation.
    Buckets(Buckets<T>),
}

/// Free ranges keyed by start address.
#[derive(Debug, Clone)]
pub(crate) struct AddrIndex<T> {
    inner: Inner<T>,
}

impl<T> Default for AddrIndex<T> {
    fn default() -> Self {
        AddrIndex {
            inner: Inner::Tree {
                starts: FxHashMap::default(),
                order: BTreeSet::new(),
            },
        }
    }
}

impl<T: Copy> AddrIndex<T> {
    /// An empty index for ranges inside `[base, base + len)`, ordered by
    /// buckets of `1 << shift` bytes (a granule).
    pub(crate) fn for_reservation(base: u64, len: u64, shift: u32) -> Self {
        let n = len.div_ceil(1 << shift) as usize;
        AddrIndex {
            inner: Inner::Buckets(Buckets {
                base,
                shift,
                buckets: vec![Bucket(SmallVec::new()); n],
                nonempty: GranuleSet::new(n),
                len: 0,
            }),
        }
    }

    /// Adds a range starting at `addr`.
    #[inline]
    pub(crate) fn insert(&mut self, addr: u64, s: Span<T>) {
        debug_assert!(s.len > 0);
        match &mut self.inner {
            Inner::Tree { starts, order } => {
                let old = starts.insert(addr, s);
                debug_assert!(old.is_none(), "free range at {addr:#x} indexed twice");
                order.insert(addr);
            }
            Inner::Buckets(b) => b.insert(addr, s),
        }
    }

    /// Removes the range starting at `addr`.
    #[inline]
    pub(crate) fn remove(&mut self, addr: u64) -> Option<Span<T>> {
        match &mut self.inner {
            Inner::Tree { starts, order } => {
                let s = starts.remove(&addr)?;
                order.remove(&addr);
                Some(s)
            }
            Inner::Buckets(b) => b.remove(addr),
        }
    }

    /// Removes the range starting at `addr` if `pred` holds for it: one
    /// lookup where a `get` and then a `remove` made two (a free's merge
    /// with the range after it).
    #[inline]
    pub(crate) fn remove_if(
        &mut self,
        addr: u64,
        pred: impl FnOnce(&Span<T>) -> bool,
    ) -> Option<Span<T>> {
        match &mut self.inner {
            Inner::Tree { starts, order } => {
                if !pred(starts.get(&addr)?) {
                    return None;
                }
                order.remove(&addr);
                starts.remove(&addr)
            }
            Inner::Buckets(b) => b.remove_if(addr, pred),
        }
    }

    /// Lengthens by `more` the range ending at `end` if `pred` holds for it
    /// (`(start, range)`), found and changed in one lookup (a free's merge
    /// with the range before it); returns its start and old length.
    #[inline]
    pub(crate) fn extend_ending_at(
        &mut self,
        end: u64,
        more: u64,
        pred: impl FnOnce(u64, &Span<T>) -> bool,
    ) -> Option<(u64, u64)> {
        let last = end.checked_sub(1)?;
        let (a, s) = match &mut self.inner {
            Inner::Tree { starts, order } => {
                let a = *order.range(..=last).next_back()?;
                (a, starts.get_mut(&a).expect("ordered starts are indexed"))
            }
            Inner::Buckets(b) => {
                let e = b.at_or_before_mut(last)?;
                (e.0, &mut e.1)
            }
        };
        if a + s.len != end || !pred(a, s) {
            return None;
        }
        let old = s.len;
        s.len += more;
        Some((a, old))
    }

    /// The range starting at `addr`.
    #[inline]
    pub(crate) fn get(&self, addr: u64) -> Option<Span<T>> {
        match &self.inner {
            Inner::Tree { starts, .. } => starts.get(&addr).copied(),
            Inner::Buckets(b) => b.get(addr),
        }
    }

    #[inline]
    fn get_mut(&mut self, addr: u64) -> Option<&mut Span<T>> {
        match &mut self.inner {
            Inner::Tree { starts, .. } => starts.get_mut(&addr),
            Inner::Buckets(b) => b.get_mut(addr),
        }
    }

    /// The range ending at `end`: the last one starting before it, if it
    /// reaches exactly there.
    #[inline]
    pub(crate) fn range_ending_at(&self, end: u64) -> Option<(u64, Span<T>)> {
        let (a, s) = self.at_or_before(end.checked_sub(1)?)?;
        (a + s.len == end).then_some((a, s))
    }

    /// Changes the length of the range at `addr` (its start stays).
    #[inline]
    pub(crate) fn set_len(&mut self, addr: u64, len: u64) {
        debug_assert!(len > 0);
        self.get_mut(addr).expect("free range exists").len = len;
    }

    /// Changes the tag of the range at `addr`.
    #[inline]
    pub(crate) fn set_tag(&mut self, addr: u64, tag: T) {
        self.get_mut(addr).expect("free range exists").tag = tag;
    }

    /// The range starting at or before `addr` with the highest start (it
    /// covers `addr` if it reaches past it).
    #[inline]
    pub(crate) fn at_or_before(&self, addr: u64) -> Option<(u64, Span<T>)> {
        match &self.inner {
            Inner::Tree { starts, order } => {
                let a = *order.range(..=addr).next_back()?;
                Some((a, starts[&a]))
            }
            Inner::Buckets(b) => b.at_or_before(addr),
        }
    }

    /// Ranges starting in `[lo, hi)`, in address order.
    pub(crate) fn starting_in(
        &self,
        lo: u64,
        hi: u64,
    ) -> Box<dyn Iterator<Item = (u64, Span<T>)> + '_> {
        match &self.inner {
            Inner::Tree { starts, order } => {
                Box::new(order.range(lo..hi.max(lo)).map(move |&a| (a, starts[&a])))
            }
            Inner::Buckets(b) => Box::new(b.range(lo, hi)),
        }
    }

    /// Every range, in address order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, Span<T>)> + '_ {
        self.starting_in(0, u64::MAX)
    }

    /// Ranges held.
    pub(crate) fn len(&self) -> usize {
        match &self.inner {
            Inner::Tree { starts, .. } => starts.len(),
            Inner::Buckets(b) => b.len,
        }
    }

    /// Whether the index's parts agree (for the audit).
    pub(crate) fn consistent(&self) -> bool {
        match &self.inner {
            Inner::Tree { starts, order } => {
                starts.len() == order.len() && starts.keys().all(|a| order.contains(a))
            }
            Inner::Buckets(b) => b.consistent(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bucket of the heap's ranges, with its two inline, is one cache line.
    #[test]
    fn a_bucket_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<Bucket<crate::pool::heap::Tag>>(), 64);
    }

    #[test]
    fn lookups_by_start_end_and_order() {
        lookups_by_start_end_and_order_in(AddrIndex::default());
        lookups_by_start_end_and_order_in(AddrIndex::for_reservation(0, 0x10_0000, 12));
    }

    /// Bucketed order against the tree, on random inserts and removals
    /// of non-overlapping ranges.
    #[test]
    fn buckets_order_like_a_tree() {
        let (base, shift) = (0x7000_0000u64, 16);
        let mut b: AddrIndex<u8> = AddrIndex::for_reservation(base, 64 << shift, shift);
        let mut t: AddrIndex<u8> = AddrIndex::default();
        let mut x = 99u64;
        for _ in 0..4_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            // Slots of 4 KiB, ranges of one slot: never overlapping.
            let a = base + ((x >> 20) % (64 << 4)) * 4096;
            if t.get(a).is_some() {
                assert_eq!(b.remove(a), t.remove(a));
            } else {
                let sp = Span { len: 4096, tag: 0 };
                b.insert(a, sp);
                t.insert(a, sp);
            }
            let p = base.saturating_sub(4096) + (x >> 7) % ((66 << shift) + 8192);
            assert_eq!(b.at_or_before(p), t.at_or_before(p), "at or before {p:#x}");
            let q = p + (x >> 40) % (3 << shift);
            let got: Vec<u64> = b.starting_in(p, q).map(|r| r.0).collect();
            let want: Vec<u64> = t.starting_in(p, q).map(|r| r.0).collect();
            assert_eq!(got, want, "starting in [{p:#x}, {q:#x})");
        }
        assert_eq!(b.len(), t.len());
        assert!(b.consistent() && t.consistent());
        assert!(b.iter().eq(t.iter()));
    }

    fn lookups_by_start_end_and_order_in(mut ix: AddrIndex<u8>) {
        ix.insert(
            0x3000,
            Span {
                len: 0x1000,
                tag: 1,
            },
        );
        ix.insert(0x1000, Span { len: 0x800, tag: 2 });
        assert_eq!(ix.range_ending_at(0x4000).map(|r| r.0), Some(0x3000));
        assert_eq!(ix.range_ending_at(0x1800).map(|r| r.0), Some(0x1000));
        assert_eq!(ix.at_or_before(0x2fff).map(|r| r.0), Some(0x1000));
        assert_eq!(ix.at_or_before(0x3000).map(|r| r.0), Some(0x3000));
        assert_eq!(ix.at_or_before(0xfff), None);
        ix.set_len(0x1000, 0x2000);
        assert_eq!(ix.range_ending_at(0x1800).map(|r| r.0), None);
        assert_eq!(ix.range_ending_at(0x3000).map(|r| r.0), Some(0x1000));
        ix.set_tag(0x3000, 7);
        assert_eq!(
            ix.get(0x3000),
            Some(Span {
                len: 0x1000,
                tag: 7
            })
        );
        let all: Vec<u64> = ix.iter().map(|r| r.0).collect();
        assert_eq!(all, vec![0x1000, 0x3000]);
        assert_eq!(ix.starting_in(0x1001, 0x4000).count(), 1);
        assert!(ix.consistent());
        // One-lookup merges: a failed test changes nothing.
        assert_eq!(ix.remove_if(0x3000, |s| s.tag == 1), None);
        assert_eq!(ix.extend_ending_at(0x3000, 0x10, |_, s| s.tag == 9), None);
        assert_eq!(ix.extend_ending_at(0x2fff, 0x10, |_, _| true), None);
        assert_eq!(
            ix.extend_ending_at(0x3000, 0x10, |a, _| a == 0x1000),
            Some((0x1000, 0x2000))
        );
        assert_eq!(ix.get(0x1000).map(|s| s.len), Some(0x2010));
        ix.set_len(0x1000, 0x2000);
        let r = ix.remove_if(0x3000, |s| s.tag == 7);
        assert_eq!(r.map(|s| s.len), Some(0x1000));
        assert_eq!(ix.get(0x3000), None);
        ix.insert(0x3000, r.expect("removed"));
        assert_eq!(ix.remove(0x1000).map(|s| s.len), Some(0x2000));
        assert_eq!(ix.range_ending_at(0x3000).map(|r| r.0), None);
        assert_eq!(ix.len(), 1);
        assert!(ix.consistent());
    }
}
