//! Free ranges of one tag ordered by `(len, addr)`: the heap's best-fit
//! index.
//!
//! A single ordered set over every free range costs a full-depth tree
//! descent for each insert, removal and search, and the large path does
//! several per allocation. Here the ranges are split into size bins, TLSF
//! style (sixteen bins per power of two, so each bin spans at most 1/16 of
//! its sizes), each bin a sorted vector, with a bitmap of non-empty bins.
//! Every range of bin `i` is shorter than every range of bin `j > i`, so
//! walking the bins in order and each bin in order visits the ranges in
//! exactly the order of one global set: best fit stays exact (smallest
//! length, then lowest address), only cheaper. A search jumps to the first
//! non-empty bin with one bit scan; an insert or removal is a binary search
//! and a short move inside one bin. A bin that grows past [`TREE_AT`]
//! ranges becomes an ordered tree (and a vector again below
//! [`VEC_AT`]): workloads that leave thousands of equal-length fragments
//! (every 256-byte leftover lands in one bin) made each insert a memmove of
//! tens of kilobytes — memmove was 9% of the instructions of RMM's
//! random_allocations at 10^5.
//!
//! Small indexes (most pending groups hold a handful of ranges) stay one
//! sorted vector and switch to bins once they hold [`BIN_AT`] ranges, so an
//! index costs nothing but its vector until it is busy.
//!
//! An index may have a *floor*: ranges shorter than it are counted (in
//! [`SizeIndex::len`] and [`SizeIndex::bytes`]) but not stored, because no
//! request it answers is that short. The heap's requests are never shorter
//! than the smallest large block or slab (32 KiB + 256 and 64 KiB by
//! default), while best fit leaves thousands of leftovers of a few hundred
//! bytes between live blocks until a neighbour's free merges them away:
//! stored, they filled the bins' vectors and trees, and every split and
//! merge paid for them (RMM's random_allocations at 10^5: 10 k free
//! ranges of one stream, most under 4 KiB). Whoever needs every range of
//! such an index (turning a stream's ranges into a pending group) finds the
//! unstored ones by address and stores them first
//! ([`SizeIndex::store_all`]).

use std::collections::BTreeSet;

/// Bits of the length below its leading one that pick the bin.
const SUB_BITS: u32 = 4;
const SUB: usize = 1 << SUB_BITS;
/// Bins for every `u64` length: 16 for lengths under 16, then 16 per power
/// of two.
const BINS: usize = (64 - SUB_BITS as usize + 1) * SUB;
const WORDS: usize = BINS.div_ceil(64);
/// Ranges at which a plain set switches to bins.
const BIN_AT: usize = 64;
/// Ranges at which one bin's vector becomes a tree. A vector's binary
/// search touches fewer cache lines than a tree's descent and its shift is
/// a sequential move, so vectors pay up to a few kilobytes: in RMM's
/// random_allocations at 10^5, 256 against 128 cut the L2-sized misses per
/// operation from 3.14 to 3.07 and the instructions from 641 to 636 (64
/// and 32 cost more of both; 512 and 1024 cut a few more misses for many
/// more L1 misses and instructions).
const TREE_AT: usize = 256;
/// Ranges at which one bin's tree becomes a vector again.
const VEC_AT: usize = 64;

/// The bin of ranges of `len` bytes; non-decreasing in `len`.
#[inline]
fn bin_of(len: u64) -> usize {
    if len < SUB as u64 {
        return len as usize;
    }
    let fl = 63 - len.leading_zeros();
    let sub = (len >> (fl - SUB_BITS)) as usize & (SUB - 1);
    ((fl - SUB_BITS + 1) as usize) * SUB + sub
}

/// One bin: a sorted vector while short, an ordered tree while long.
#[derive(Debug, Clone)]
enum Bin {
    Sorted(Vec<(u64, u64)>),
    Tree(BTreeSet<(u64, u64)>),
}

impl Bin {
    #[inline]
    fn insert(&mut self, r: (u64, u64)) -> bool {
        match self {
            Bin::Sorted(v) => {
                let added = sorted_insert(v, r);
                if v.len() > TREE_AT {
                    *self = Bin::Tree(std::mem::take(v).into_iter().collect());
                }
                added
            }
            Bin::Tree(t) => t.insert(r),
        }
    }

    #[inline]
    fn remove(&mut self, r: (u64, u64)) -> bool {
        match self {
            Bin::Sorted(v) => sorted_remove(v, r),
            Bin::Tree(t) => {
                let hit = t.remove(&r);
                if t.len() < VEC_AT {
                    *self = Bin::Sorted(std::mem::take(t).into_iter().collect());
                }
                hit
            }
        }
    }

    #[inline]
    fn is_empty(&self) -> bool {
        match self {
            Bin::Sorted(v) => v.is_empty(),
            Bin::Tree(t) => t.is_empty(),
        }
    }

    /// Its ranges of at least `len` bytes, in order.
    #[inline]
    fn from(&self, len: u64) -> BinIter<'_> {
        match self {
            Bin::Sorted(v) => BinIter::Sorted(tail_from(v, len).iter()),
            Bin::Tree(t) => BinIter::Tree(t.range((len, 0)..)),
        }
    }
}

/// Iterator over one bin.
enum BinIter<'a> {
    Sorted(std::slice::Iter<'a, (u64, u64)>),
    Tree(std::collections::btree_set::Range<'a, (u64, u64)>),
}

impl Iterator for BinIter<'_> {
    type Item = (u64, u64);

    #[inline]
    fn next(&mut self) -> Option<(u64, u64)> {
        match self {
            BinIter::Sorted(i) => i.next().copied(),
            BinIter::Tree(i) => i.next().copied(),
        }
    }
}

/// Size bins with a bitmap of the non-empty ones.
#[derive(Debug, Clone)]
struct Bins {
    bins: Vec<Bin>,
    nonempty: [u64; WORDS],
}

/// Inserts `r` into sorted `v`; false if it was there.
#[inline]
fn sorted_insert(v: &mut Vec<(u64, u64)>, r: (u64, u64)) -> bool {
    match v.binary_search(&r) {
        Ok(_) => false,
        Err(i) => {
            v.insert(i, r);
            true
        }
    }
}

/// Removes `r` from sorted `v`; whether it was there.
#[inline]
fn sorted_remove(v: &mut Vec<(u64, u64)>, r: (u64, u64)) -> bool {
    match v.binary_search(&r) {
        Ok(i) => {
            v.remove(i);
            true
        }
        Err(_) => false,
    }
}

/// The part of sorted `v` at or after length `len`.
#[inline]
fn tail_from(v: &[(u64, u64)], len: u64) -> &[(u64, u64)] {
    &v[v.partition_point(|r| r.0 < len)..]
}

impl Bins {
    fn new() -> Bins {
        Bins {
            bins: vec![Bin::Sorted(Vec::new()); BINS],
            nonempty: [0; WORDS],
        }
    }

    /// The first non-empty bin at or after `b`.
    #[inline]
    fn next_nonempty(&self, b: usize) -> Option<usize> {
        let mut w = b / 64;
        if w >= WORDS {
            return None;
        }
        let mut word = self.nonempty[w] & (!0u64 << (b % 64));
        loop {
            if word != 0 {
                return Some(w * 64 + word.trailing_zeros() as usize);
            }
            w += 1;
            if w == WORDS {
                return None;
            }
            word = self.nonempty[w];
        }
    }

    #[inline]
    fn insert(&mut self, r: (u64, u64)) -> bool {
        let b = bin_of(r.0);
        self.nonempty[b / 64] |= 1 << (b % 64);
        self.bins[b].insert(r)
    }

    #[inline]
    fn remove(&mut self, r: (u64, u64)) -> bool {
        let b = bin_of(r.0);
        let set = &mut self.bins[b];
        let hit = set.remove(r);
        if set.is_empty() {
            self.nonempty[b / 64] &= !(1 << (b % 64));
        }
        hit
    }
}

#[derive(Debug, Clone)]
enum Repr {
    Plain(Vec<(u64, u64)>),
    Binned(Box<Bins>),
}

/// Free ranges `(len, addr)` of one tag, iterated in `(len, addr)` order.
#[derive(Debug, Clone, Default)]
pub(crate) struct SizeIndex {
    repr: Repr,
    /// Ranges held, stored or not.
    count: usize,
    /// Bytes held, stored or not.
    bytes: u64,
    /// Ranges shorter than this are counted, not stored (see the module
    /// docs); 0 stores every range.
    floor: u64,
    /// Ranges counted but not stored.
    unstored: usize,
}

impl Default for Repr {
    fn default() -> Self {
        Repr::Plain(Vec::new())
    }
}

impl SizeIndex {
    /// An empty index that stores only ranges of at least `floor` bytes.
    pub(crate) fn with_floor(floor: u64) -> SizeIndex {
        SizeIndex {
            floor,
            ..SizeIndex::default()
        }
    }

    /// Adds range `(len, addr)`.
    #[inline]
    pub(crate) fn insert(&mut self, len: u64, addr: u64) {
        self.count += 1;
        self.bytes += len;
        if len < self.floor {
            self.unstored += 1;
            return;
        }
        let added = match &mut self.repr {
            Repr::Plain(v) => sorted_insert(v, (len, addr)),
            Repr::Binned(b) => b.insert((len, addr)),
        };
        debug_assert!(added, "range {addr:#x} indexed twice");
        if self.count - self.unstored == BIN_AT {
            if let Repr::Plain(v) = &mut self.repr {
                let mut bins = Box::new(Bins::new());
                for r in std::mem::take(v) {
                    bins.insert(r);
                }
                self.repr = Repr::Binned(bins);
            }
        }
    }

    /// Removes range `(len, addr)`; whether it was there (a range under
    /// the floor is taken on trust: the heap's audit recounts them).
    #[inline]
    pub(crate) fn remove(&mut self, len: u64, addr: u64) -> bool {
        if len < self.floor {
            debug_assert!(self.unstored > 0, "no unstored range to remove");
            self.unstored -= 1;
            self.count -= 1;
            self.bytes -= len;
            return true;
        }
        let hit = match &mut self.repr {
            Repr::Plain(v) => sorted_remove(v, (len, addr)),
            Repr::Binned(b) => b.remove((len, addr)),
        };
        if hit {
            self.count -= 1;
            self.bytes -= len;
        }
        hit
    }

    /// Changes the length of range `(len, addr)` to `new_len`, as a
    /// removal and an insert would. Inside one sorted vector the range
    /// moves by a rotation of the ranges between its old and new places,
    /// not by two shifts of everything after them (a merge lengthens the
    /// range before a freed block, which mostly stays in its bin).
    #[inline]
    pub(crate) fn relen(&mut self, len: u64, new_len: u64, addr: u64) {
        if new_len == len {
            return;
        }
        if len < self.floor || new_len < self.floor {
            // Into or out of the unstored ones (or among them).
            self.remove(len, addr);
            self.insert(new_len, addr);
            return;
        }
        let v = match &mut self.repr {
            Repr::Plain(v) => Some(v),
            Repr::Binned(b) if bin_of(len) == bin_of(new_len) => match &mut b.bins[bin_of(len)] {
                Bin::Sorted(v) => Some(v),
                Bin::Tree(_) => None,
            },
            Repr::Binned(_) => None,
        };
        let Some(v) = v else {
            let hit = self.remove(len, addr);
            debug_assert!(hit, "range {addr:#x} not indexed");
            self.insert(new_len, addr);
            return;
        };
        let from = v.binary_search(&(len, addr));
        debug_assert!(from.is_ok(), "range {addr:#x} not indexed");
        let Ok(from) = from else { return };
        // (Never found: one range per address.)
        let to = v.binary_search(&(new_len, addr)).unwrap_or_else(|to| to);
        if to > from {
            v[from..to].rotate_left(1);
            v[to - 1] = (new_len, addr);
        } else {
            v[to..=from].rotate_right(1);
            v[to] = (new_len, addr);
        }
        self.bytes = self.bytes - len + new_len;
    }

    /// Ranges held, stored or not.
    pub(crate) fn len(&self) -> usize {
        self.count
    }

    /// The floor: shorter ranges are counted, not stored.
    pub(crate) fn floor(&self) -> u64 {
        self.floor
    }

    /// Ranges held but not stored (shorter than the floor).
    pub(crate) fn unstored(&self) -> usize {
        self.unstored
    }

    /// Stores the unstored ranges, `ranges` as `(len, addr)` (the caller
    /// found them by address), and drops the floor: afterwards the index
    /// iterates every range it holds.
    pub(crate) fn store_all(&mut self, ranges: impl IntoIterator<Item = (u64, u64)>) {
        let (floor, unstored) = (self.floor, self.unstored);
        self.floor = 0;
        self.count -= unstored;
        self.unstored = 0;
        let mut found = 0;
        for (len, addr) in ranges {
            debug_assert!(len < floor, "range {addr:#x} was stored");
            self.bytes -= len;
            self.insert(len, addr);
            found += 1;
        }
        debug_assert_eq!(found, unstored, "unstored ranges not all found");
    }

    /// Whether no range is held.
    pub(crate) fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Bytes of the ranges held.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Ranges of at least `len` bytes, shortest first (then lowest address).
    #[inline]
    pub(crate) fn at_least(&self, len: u64) -> Iter<'_> {
        debug_assert!(
            len >= self.floor || self.unstored == 0,
            "a search under the floor would miss unstored ranges"
        );
        match &self.repr {
            Repr::Plain(v) => Iter {
                bins: None,
                bin: 0,
                cur: BinIter::Sorted(tail_from(v, len).iter()),
            },
            Repr::Binned(b) => {
                let first = bin_of(len);
                Iter {
                    bins: Some(b),
                    bin: first,
                    cur: b.bins[first].from(len),
                }
            }
        }
    }

    /// Every stored range, shortest first (every range once
    /// [`SizeIndex::store_all`] ran, or if nothing is under the floor).
    pub(crate) fn iter(&self) -> Iter<'_> {
        self.at_least(0)
    }
}

/// Iterator of [`SizeIndex::at_least`].
pub(crate) struct Iter<'a> {
    bins: Option<&'a Bins>,
    bin: usize,
    /// The part of the current bin still to visit.
    cur: BinIter<'a>,
}

impl Iterator for Iter<'_> {
    type Item = (u64, u64);

    #[inline]
    fn next(&mut self) -> Option<(u64, u64)> {
        loop {
            if let Some(r) = self.cur.next() {
                return Some(r);
            }
            let bins = self.bins?;
            let b = bins.next_nonempty(self.bin + 1)?;
            self.bin = b;
            self.cur = bins.bins[b].from(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn bins_are_monotonic_and_fine() {
        let mut last = 0;
        for len in (1..5000u64).chain((13..64).map(|s| 1u64 << s)) {
            let b = bin_of(len);
            assert!(b >= last, "bin of {len} went down");
            assert!(b < BINS);
            last = b;
        }
        assert_eq!(bin_of(u64::MAX), BINS - 1);
        // One bin spans at most 1/16 of its lengths.
        assert_ne!(bin_of(1 << 20), bin_of((1 << 20) + (1 << 16)));
        assert_eq!(bin_of(1 << 20), bin_of((1 << 20) + (1 << 16) - 1));
    }

    #[test]
    fn a_crowded_bin_becomes_a_tree_and_a_vector_again() {
        let mut idx = SizeIndex::default();
        // Odd addresses first, so that the tree holds interleaved inserts.
        let addrs: Vec<u64> = (0..300u64).map(|i| (i * 7919) % 300).collect();
        for &a in &addrs {
            idx.insert(256, a * 256);
        }
        idx.insert(512, 0);
        let Repr::Binned(b) = &idx.repr else {
            panic!("binned")
        };
        assert!(matches!(b.bins[bin_of(256)], Bin::Tree(_)));
        let got: Vec<u64> = idx.at_least(256).map(|r| r.1).take(3).collect();
        assert_eq!(got, vec![0, 256, 512]);
        assert_eq!(idx.at_least(257).next(), Some((512, 0)));
        for &a in &addrs[..290] {
            assert!(idx.remove(256, a * 256));
        }
        let Repr::Binned(b) = &idx.repr else {
            panic!("binned")
        };
        assert!(matches!(b.bins[bin_of(256)], Bin::Sorted(_)));
        let mut rest: Vec<u64> = addrs[290..].iter().map(|a| a * 256).collect();
        rest.sort_unstable();
        let got: Vec<u64> = idx.at_least(1).map(|r| r.1).collect();
        assert_eq!(&got[..10], &rest[..]);
        assert_eq!(idx.len(), 11);
    }

    /// Runs `ops` on an index with `floor` and on an ordered set holding
    /// every range; the index must count every range, store exactly those
    /// at or over the floor, iterate them in the set's order, and after
    /// `store_all` iterate everything.
    fn matches_ordered_set(
        floor: u64,
        ops: Vec<(bool, u64, u64)>,
        probe: u64,
    ) -> Result<(), proptest::test_runner::TestCaseError> {
        let mut idx = SizeIndex::with_floor(floor);
        let mut model = std::collections::BTreeSet::new();
        for (ins, len, a) in ops {
            // Many equal lengths, so that single bins cross the switch
            // to a tree and back.
            let len = len.next_power_of_two() >> (a % 3) | (a % 7);
            let len = if a % 2 == 0 { 4096 } else { len };
            let r = (len.max(1), a * 4096);
            if ins && !model.contains(&r) && a % 5 != 0 {
                model.insert(r);
                idx.insert(r.0, r.1);
            } else if !ins || model.is_empty() {
                let first = model.iter().nth((a as usize) % model.len().max(1)).copied();
                if let Some(f) = first {
                    model.remove(&f);
                    prop_assert!(idx.remove(f.0, f.1));
                }
                if floor <= 1 {
                    prop_assert!(!idx.remove(1, u64::MAX));
                }
            } else if let Some(&f) = model.iter().nth((a as usize) % model.len()) {
                // A length change in place, as a free's merge makes.
                let d = len % 5000;
                let new = if a % 2 == 0 {
                    f.0 + d
                } else {
                    f.0.saturating_sub(d).max(1)
                };
                if new == f.0 || !model.contains(&(new, f.1)) {
                    model.remove(&f);
                    model.insert((new, f.1));
                    idx.relen(f.0, new, f.1);
                }
            }
            prop_assert_eq!(idx.len(), model.len());
            prop_assert_eq!(idx.unstored(), model.iter().filter(|r| r.0 < floor).count());
        }
        let probe = probe.max(floor);
        let want: Vec<_> = model.range((probe, 0)..).copied().collect();
        let got: Vec<_> = idx.at_least(probe).collect();
        prop_assert_eq!(got, want);
        let stored: Vec<_> = idx.at_least(floor).collect();
        prop_assert_eq!(
            stored,
            model.range((floor, 0)..).copied().collect::<Vec<_>>()
        );
        prop_assert_eq!(idx.bytes(), model.iter().map(|r| r.0).sum::<u64>());
        idx.store_all(model.iter().copied().filter(|r| r.0 < floor));
        prop_assert_eq!((idx.floor(), idx.unstored()), (0, 0));
        let all: Vec<_> = idx.iter().collect();
        prop_assert_eq!(all, model.iter().copied().collect::<Vec<_>>());
        prop_assert_eq!(idx.len(), model.len());
        prop_assert_eq!(idx.bytes(), model.iter().map(|r| r.0).sum::<u64>());
        Ok(())
    }

    proptest! {
        /// The index iterates exactly like one ordered set, in both
        /// representations (the sequence crosses the switch to bins).
        #[test]
        fn behaves_like_one_ordered_set(
            ops in proptest::collection::vec((any::<bool>(), 1u64..1 << 26, 0u64..400), 1..900),
            probe in 1u64..1 << 26,
        ) {
            matches_ordered_set(0, ops, probe)?;
        }

        /// With a floor: ranges under it are counted, not stored, and
        /// `store_all` brings them back; lengths cross the floor both
        /// ways by merges and splits.
        #[test]
        fn a_floor_counts_short_ranges_without_storing_them(
            ops in proptest::collection::vec((any::<bool>(), 1u64..1 << 26, 0u64..400), 1..900),
            probe in 1u64..1 << 26,
            floor in prop_oneof![Just(4097u64), Just(1u64 << 16), Just(1u64 << 22)],
        ) {
            matches_ordered_set(floor, ops, probe)?;
        }
    }
}
