//! Finding the slab that holds an address, for raw frees (the C ABI and
//! PyTorch path, which only have a pointer).
//!
//! Over a VMM reservation the index is one flat table with an entry per
//! 64 KiB unit ([`MIN_SLAB`]): the header of the slab there, or null. A
//! lookup is one plain load, so a raw free reaches its slot's word in
//! three dependent loads (entry, header, word; it was seven through a
//! two-level table of ids and the id's header chunk). The table is
//! allocated zeroed, so the system hands out its pages on first touch: a
//! 141 GB device with the default `va_factor` of 4 reserves 69 MB of
//! address space for it and commits a page per 32 MiB of addresses that
//! ever held a slab (under strict overcommit, `vm.overcommit_memory=2`,
//! all 69 MB count against the commit limit). A lookup racing a slab's retirement may see the old
//! header; the caller then finds the slab unused (base 0) or elsewhere,
//! and treats the pointer as not live. In segment mode (no single
//! reservation) a B-tree behind a read-write lock does the same job.
//!
//! Invariant: every non-null entry points at a header of the pool's
//! `Slabs`, which never moves or goes while the pool lives (the caller
//! dereferences it on that ground).

use super::small::{Slab, MIN_SLAB};
use parking_lot::RwLock;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicPtr, Ordering::Acquire, Ordering::Release};

/// Address -> slab header.
#[derive(Debug)]
pub(crate) enum SlabIndex {
    /// Direct table over `[base, base + len)`, one entry per unit.
    Table {
        base: u64,
        units: Box<[AtomicPtr<Slab>]>,
    },
    /// Slab base -> header, for segment mode.
    Tree(RwLock<BTreeMap<u64, usize>>),
}

/// `n` null entries, allocated zeroed (the system's zero pages until
/// written: see the file's docs).
fn zeroed_units(n: usize) -> Box<[AtomicPtr<Slab>]> {
    if n == 0 {
        return Box::new([]);
    }
    let layout = std::alloc::Layout::array::<AtomicPtr<Slab>>(n).expect("a table that fits");
    // SAFETY: `layout` has a non-zero size (n > 0 entries of 8 bytes).
    let p = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<AtomicPtr<Slab>>();
    if p.is_null() {
        std::alloc::handle_alloc_error(layout);
    }
    // SAFETY: `p` holds `n` zeroed entries allocated with the global
    // allocator at the layout of `[AtomicPtr<Slab>; n]`, and all zero bytes
    // are a valid (null) `AtomicPtr`; the box takes sole ownership.
    unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, n)) }
}

impl SlabIndex {
    /// A table over a reservation, or a tree when there is none.
    pub(crate) fn new(reservation: Option<(u64, u64)>) -> SlabIndex {
        match reservation {
            Some((base, len)) => SlabIndex::Table {
                base,
                units: zeroed_units(len.div_ceil(MIN_SLAB) as usize),
            },
            None => SlabIndex::Tree(RwLock::new(BTreeMap::new())),
        }
    }

    fn set(&self, base: u64, bytes: u64, value: *const Slab) {
        match self {
            SlabIndex::Table { base: b, units, .. } => {
                let first = ((base - b) / MIN_SLAB) as usize;
                for u in &units[first..first + (bytes / MIN_SLAB) as usize] {
                    u.store(value.cast_mut(), Release);
                }
            }
            SlabIndex::Tree(t) => {
                let mut t = t.write();
                if value.is_null() {
                    t.remove(&base);
                } else {
                    t.insert(base, value as usize);
                }
            }
        }
    }

    /// Records the slab of header `h` at `[base, base + bytes)`.
    pub(crate) fn insert(&self, base: u64, bytes: u64, h: *const Slab) {
        self.set(base, bytes, h);
    }

    /// Forgets the slab at `[base, base + bytes)`.
    pub(crate) fn remove(&self, base: u64, bytes: u64) {
        self.set(base, bytes, std::ptr::null());
    }

    /// The header of the slab whose range may hold `addr` (the caller
    /// checks bounds and liveness), if any.
    #[inline]
    pub(crate) fn lookup(&self, addr: u64) -> Option<*const Slab> {
        match self {
            SlabIndex::Table { base, units, .. } => {
                let u = (addr.wrapping_sub(*base) / MIN_SLAB) as usize;
                // Below the base, the subtraction wraps far past the end.
                let p = units.get(u)?.load(Acquire);
                (!p.is_null()).then_some(p.cast_const())
            }
            SlabIndex::Tree(t) => Self::lookup_tree(t, addr),
        }
    }

    /// [`SlabIndex::lookup`] without a reservation (out of line: the
    /// table is the fast path).
    #[inline(never)]
    fn lookup_tree(t: &RwLock<BTreeMap<u64, usize>>, addr: u64) -> Option<*const Slab> {
        t.read()
            .range(..=addr)
            .next_back()
            .map(|(_, &h)| h as *const Slab)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_and_tree_agree() {
        let base = 1u64 << 40;
        let (a, b) = (Slab::default(), Slab::default());
        let (pa, pb): (*const Slab, *const Slab) = (&a, &b);
        for idx in [SlabIndex::new(Some((base, 1 << 32))), SlabIndex::new(None)] {
            idx.insert(base + (3 << 20), 256 << 10, pa);
            idx.insert(base + (600 << 20), 2 << 20, pb);
            assert_eq!(idx.lookup(base + (3 << 20) + 1000), Some(pa));
            assert_eq!(idx.lookup(base + (600 << 20) + (2 << 20) - 1), Some(pb));
            idx.remove(base + (3 << 20), 256 << 10);
            assert_ne!(idx.lookup(base + (3 << 20)), Some(pa));
        }
        let t = SlabIndex::new(Some((base, 1 << 32)));
        assert_eq!(t.lookup(base - 1), None);
        assert_eq!(t.lookup(0), None);
        assert_eq!(t.lookup(base + (5 << 30)), None);
        assert_eq!(t.lookup(base + (1 << 20)), None);
        t.insert(base + (1 << 32) - (64 << 10), 64 << 10, pa);
        assert_eq!(t.lookup(base + (1 << 32) - 1), Some(pa));
        assert_eq!(t.lookup(base + (1 << 32)), None);
    }
}
