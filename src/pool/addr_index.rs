//! Free ranges by address: the heap's index for merging neighbours.
//!
//! Freeing a range merges it with the free ranges that end where it starts
//! and start where it ends, and splitting one keeps its head in place. With
//! one ordered map, each of those lookups is a full tree descent. Here exact
//! lookups go to hash maps instead: one by start, one by end (so the
//! neighbour before is found in O(1), as boundary tags find it in a host
//! allocator), and only the set of starts is ordered, for the slow paths
//! that ask which range covers an address. Growing or shrinking a range at
//! its end — the common merge and split — leaves that ordered set alone.
//!
//! Invariant: `starts`, `ends` and `order` describe the same ranges, which
//! never overlap.

use rustc_hash::FxHashMap;
use std::collections::BTreeSet;

/// A free range's length and tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span<T> {
    /// Bytes.
    pub len: u64,
    /// Who may reuse it.
    pub tag: T,
}

/// Free ranges keyed by start address.
#[derive(Debug, Clone)]
pub(crate) struct AddrIndex<T> {
    starts: FxHashMap<u64, Span<T>>,
    /// End address -> start address.
    ends: FxHashMap<u64, u64>,
    order: BTreeSet<u64>,
}

impl<T> Default for AddrIndex<T> {
    fn default() -> Self {
        AddrIndex {
            starts: FxHashMap::default(),
            ends: FxHashMap::default(),
            order: BTreeSet::new(),
        }
    }
}

impl<T: Copy> AddrIndex<T> {
    /// Adds a range starting at `addr`.
    #[inline]
    pub(crate) fn insert(&mut self, addr: u64, s: Span<T>) {
        debug_assert!(s.len > 0);
        let old = self.starts.insert(addr, s);
        debug_assert!(old.is_none(), "free range at {addr:#x} indexed twice");
        self.ends.insert(addr + s.len, addr);
        self.order.insert(addr);
    }

    /// Removes the range starting at `addr`.
    #[inline]
    pub(crate) fn remove(&mut self, addr: u64) -> Option<Span<T>> {
        let s = self.starts.remove(&addr)?;
        self.ends.remove(&(addr + s.len));
        self.order.remove(&addr);
        Some(s)
    }

    /// The range starting at `addr`.
    #[inline]
    pub(crate) fn get(&self, addr: u64) -> Option<Span<T>> {
        self.starts.get(&addr).copied()
    }

    /// The start of the range ending at `end`.
    #[inline]
    pub(crate) fn start_of_range_ending_at(&self, end: u64) -> Option<u64> {
        self.ends.get(&end).copied()
    }

    /// Changes the length of the range at `addr` (its start stays).
    #[inline]
    pub(crate) fn set_len(&mut self, addr: u64, len: u64) {
        debug_assert!(len > 0);
        let s = self.starts.get_mut(&addr).expect("free range exists");
        self.ends.remove(&(addr + s.len));
        s.len = len;
        self.ends.insert(addr + len, addr);
    }

    /// Changes the tag of the range at `addr`.
    #[inline]
    pub(crate) fn set_tag(&mut self, addr: u64, tag: T) {
        self.starts.get_mut(&addr).expect("free range exists").tag = tag;
    }

    /// The range starting at or before `addr` with the highest start (it
    /// covers `addr` if it reaches past it).
    pub(crate) fn at_or_before(&self, addr: u64) -> Option<(u64, Span<T>)> {
        let &a = self.order.range(..=addr).next_back()?;
        Some((a, self.starts[&a]))
    }

    /// Ranges starting in `[lo, hi)`, in address order.
    pub(crate) fn starting_in(
        &self,
        lo: u64,
        hi: u64,
    ) -> impl Iterator<Item = (u64, Span<T>)> + '_ {
        self.order
            .range(lo..hi.max(lo))
            .map(|a| (*a, self.starts[a]))
    }

    /// Every range, in address order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, Span<T>)> + '_ {
        self.order.iter().map(|a| (*a, self.starts[a]))
    }

    /// Ranges held.
    pub(crate) fn len(&self) -> usize {
        self.starts.len()
    }

    /// Whether the three maps agree (for the audit).
    pub(crate) fn consistent(&self) -> bool {
        self.starts.len() == self.ends.len()
            && self.starts.len() == self.order.len()
            && self
                .starts
                .iter()
                .all(|(a, s)| self.ends.get(&(a + s.len)) == Some(a) && self.order.contains(a))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookups_by_start_end_and_order() {
        let mut ix: AddrIndex<u8> = AddrIndex::default();
        ix.insert(
            0x3000,
            Span {
                len: 0x1000,
                tag: 1,
            },
        );
        ix.insert(0x1000, Span { len: 0x800, tag: 2 });
        assert_eq!(ix.start_of_range_ending_at(0x4000), Some(0x3000));
        assert_eq!(ix.start_of_range_ending_at(0x1800), Some(0x1000));
        assert_eq!(ix.at_or_before(0x2fff).map(|r| r.0), Some(0x1000));
        assert_eq!(ix.at_or_before(0x3000).map(|r| r.0), Some(0x3000));
        assert_eq!(ix.at_or_before(0xfff), None);
        ix.set_len(0x1000, 0x2000);
        assert_eq!(ix.start_of_range_ending_at(0x1800), None);
        assert_eq!(ix.start_of_range_ending_at(0x3000), Some(0x1000));
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
        assert_eq!(ix.remove(0x1000).map(|s| s.len), Some(0x2000));
        assert_eq!(ix.start_of_range_ending_at(0x3000), None);
        assert_eq!(ix.len(), 1);
        assert!(ix.consistent());
    }
}
