//! Finding the slab that holds an address, for raw frees (the C ABI and
//! PyTorch path, which only have a pointer).
//!
//! Over a VMM reservation the index is a two-level table of slab ids per
//! 64 KiB unit ([`MIN_SLAB`]): leaves are allocated on first use and
//! installed with a CAS, so lookups are a few plain loads and never lock.
//! A lookup racing a slab's retirement may see the old id; the caller then
//! finds the slab unused (base 0) and treats the pointer as not live. In
//! segment mode (no single reservation) a B-tree behind a read-write lock
//! does the same job.

use super::small::MIN_SLAB;
use parking_lot::RwLock;
use std::collections::BTreeMap;
use std::sync::atomic::{
    AtomicPtr, AtomicU32, Ordering::AcqRel, Ordering::Acquire, Ordering::Release,
};

/// Units per leaf (a leaf covers 256 MiB of addresses).
const LEAF: usize = 4096;

/// A lazily allocated leaf of slab ids (`id + 1`, 0 for none).
type Leaf = [AtomicU32; LEAF];

/// Address -> slab id.
#[derive(Debug)]
pub(crate) enum SlabIndex {
    /// Direct table over `[base, base + len)`.
    Table {
        base: u64,
        len: u64,
        leaves: Box<[AtomicPtr<Leaf>]>,
    },
    /// Slab base -> id, for segment mode.
    Tree(RwLock<BTreeMap<u64, u32>>),
}

impl SlabIndex {
    /// A table over a reservation, or a tree when there is none.
    pub(crate) fn new(reservation: Option<(u64, u64)>) -> SlabIndex {
        match reservation {
            Some((base, len)) => {
                let units = len.div_ceil(MIN_SLAB) as usize;
                let leaves = (0..units.div_ceil(LEAF))
                    .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                    .collect();
                SlabIndex::Table { base, len, leaves }
            }
            None => SlabIndex::Tree(RwLock::new(BTreeMap::new())),
        }
    }

    fn leaf(leaves: &[AtomicPtr<Leaf>], i: usize, create: bool) -> Option<&Leaf> {
        let mut p = leaves[i].load(Acquire);
        if p.is_null() {
            if !create {
                return None;
            }
            let fresh = Box::into_raw(Box::new(std::array::from_fn(|_| AtomicU32::new(0))));
            match leaves[i].compare_exchange(std::ptr::null_mut(), fresh, AcqRel, Acquire) {
                Ok(_) => p = fresh,
                Err(existing) => {
                    // SAFETY: `fresh` came from Box::into_raw above and lost
                    // the race, so no other thread ever saw it.
                    drop(unsafe { Box::from_raw(fresh) });
                    p = existing;
                }
            }
        }
        // SAFETY: leaves are only freed in Drop (with `&mut self`), so a
        // non-null pointer read here stays valid for the borrow of `self`.
        Some(unsafe { &*p })
    }

    fn set(&self, base: u64, bytes: u64, value: u32) {
        match self {
            SlabIndex::Table {
                base: b, leaves, ..
            } => {
                let first = ((base - b) / MIN_SLAB) as usize;
                for u in first..first + (bytes / MIN_SLAB) as usize {
                    let leaf = Self::leaf(leaves, u / LEAF, true).expect("created on demand");
                    leaf[u % LEAF].store(value, Release);
                }
            }
            SlabIndex::Tree(t) => {
                let mut t = t.write();
                if value == 0 {
                    t.remove(&base);
                } else {
                    t.insert(base, value - 1);
                }
            }
        }
    }

    /// Records slab `id` at `[base, base + bytes)`.
    pub(crate) fn insert(&self, base: u64, bytes: u64, id: u32) {
        self.set(base, bytes, id + 1);
    }

    /// Forgets the slab at `[base, base + bytes)`.
    pub(crate) fn remove(&self, base: u64, bytes: u64) {
        self.set(base, bytes, 0);
    }

    /// The slab id whose range may hold `addr` (the caller checks bounds
    /// and liveness), if any.
    #[inline]
    pub(crate) fn lookup(&self, addr: u64) -> Option<u32> {
        match self {
            SlabIndex::Table { base, len, leaves } => {
                if addr < *base || addr >= base + len {
                    return None;
                }
                let u = ((addr - base) / MIN_SLAB) as usize;
                let p = leaves.get(u / LEAF)?.load(Acquire);
                if p.is_null() {
                    return None;
                }
                // SAFETY: as in `leaf`: a non-null leaf is freed only in
                // Drop (`&mut self`), so it outlives this borrow of `self`.
                let v = unsafe { &*p }[u % LEAF].load(Acquire);
                v.checked_sub(1)
            }
            SlabIndex::Tree(t) => Self::lookup_tree(t, addr),
        }
    }

    /// [`SlabIndex::lookup`] without a reservation (out of line: the
    /// table is the fast path).
    #[inline(never)]
    fn lookup_tree(t: &RwLock<BTreeMap<u64, u32>>, addr: u64) -> Option<u32> {
        t.read().range(..=addr).next_back().map(|(_, &id)| id)
    }
}

impl Drop for SlabIndex {
    fn drop(&mut self) {
        if let SlabIndex::Table { leaves, .. } = self {
            for l in leaves.iter() {
                let p = l.load(Acquire);
                if !p.is_null() {
                    // SAFETY: each leaf was made by Box::into_raw and
                    // installed once; `&mut self` means no reader is left.
                    drop(unsafe { Box::from_raw(p) });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_and_tree_agree() {
        let base = 1u64 << 40;
        for idx in [SlabIndex::new(Some((base, 1 << 32))), SlabIndex::new(None)] {
            idx.insert(base + (3 << 20), 256 << 10, 7);
            idx.insert(base + (600 << 20), 2 << 20, 9);
            assert_eq!(idx.lookup(base + (3 << 20) + 1000), Some(7));
            assert_eq!(idx.lookup(base + (600 << 20) + (2 << 20) - 1), Some(9));
            idx.remove(base + (3 << 20), 256 << 10);
            assert_ne!(idx.lookup(base + (3 << 20)), Some(7));
        }
        let t = SlabIndex::new(Some((base, 1 << 32)));
        assert_eq!(t.lookup(base - 1), None);
        assert_eq!(t.lookup(base + (5 << 30)), None);
        assert_eq!(t.lookup(base + (1 << 20)), None);
    }
}
