//! A lock-free stack of slot indices with a tagged head (ABA-safe).
//!
//! Slots are `u32` indices; the "next" link of each slot lives in a table
//! owned by the caller ([`Links`]), which never frees a link while the pool
//! lives, so a racing reader of a stale link reads valid memory.
//!
//! The head packs `(tag << 32) | index` into one `AtomicU64`. Every
//! successful push, pop or take bumps the tag, so a CAS that saw head `A`,
//! was preempted while `A` was popped and pushed again, fails because the
//! tag moved on: the classic ABA case cannot install a stale `next`.
//!
//! Invariants (checked by the loom model in `tests/loom_stack.rs`):
//! 1. Every index pushed is popped at most once per push.
//! 2. An index is never returned while it is still on the stack.
//! 3. `take_all` detaches the whole chain atomically; links inside the chain
//!    are then owned by the caller.

use super::sync::{AtomicU32, AtomicU64};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

/// The empty index.
pub const NIL: u32 = u32::MAX;

/// Where the `next` link of each slot index lives.
pub trait Links {
    /// The link of slot `idx`. Must return the same atomic for the life of
    /// the stack.
    fn link(&self, idx: u32) -> &AtomicU32;
}

/// A Treiber stack of slot indices with a tagged head.
#[derive(Debug)]
pub struct IndexStack {
    head: AtomicU64,
}

#[inline]
fn pack(tag: u32, idx: u32) -> u64 {
    ((tag as u64) << 32) | idx as u64
}

#[inline]
fn unpack(v: u64) -> (u32, u32) {
    ((v >> 32) as u32, v as u32)
}

impl Default for IndexStack {
    fn default() -> Self {
        Self::new()
    }
}

impl IndexStack {
    /// An empty stack.
    pub fn new() -> Self {
        IndexStack {
            head: AtomicU64::new(pack(0, NIL)),
        }
    }

    /// Whether the stack looked empty at the moment of the load.
    #[inline]
    pub fn is_empty(&self) -> bool {
        unpack(self.head.load(Relaxed)).1 == NIL
    }

    /// Pushes one index.
    #[inline]
    pub fn push<L: Links + ?Sized>(&self, links: &L, idx: u32) {
        self.push_chain(links, idx, idx);
    }

    /// Pushes a chain `first -> ... -> last` already linked through `links`.
    pub fn push_chain<L: Links + ?Sized>(&self, links: &L, first: u32, last: u32) {
        let mut cur = self.head.load(Relaxed);
        loop {
            let (tag, idx) = unpack(cur);
            links.link(last).store(idx, Relaxed);
            // Release: the link store (and whatever the caller wrote about
            // the slots) is visible to the thread that pops them.
            match self.head.compare_exchange_weak(
                cur,
                pack(tag.wrapping_add(1), first),
                Release,
                Relaxed,
            ) {
                Ok(_) => return,
                Err(now) => cur = now,
            }
        }
    }

    /// Pops one index, or `None` when empty.
    #[inline]
    pub fn pop<L: Links + ?Sized>(&self, links: &L) -> Option<u32> {
        let mut cur = self.head.load(Acquire);
        loop {
            let (tag, idx) = unpack(cur);
            if idx == NIL {
                return None;
            }
            // May be stale if `idx` was popped meanwhile; then the tag has
            // changed and the CAS below fails.
            let next = links.link(idx).load(Relaxed);
            match self.head.compare_exchange_weak(
                cur,
                pack(tag.wrapping_add(1), next),
                Acquire,
                Acquire,
            ) {
                Ok(_) => return Some(idx),
                Err(now) => cur = now,
            }
        }
    }

    /// Detaches the whole chain; returns its first index (or [`NIL`]). The
    /// caller walks it through `links`.
    pub fn take_all(&self) -> u32 {
        let mut cur = self.head.load(Acquire);
        loop {
            let (tag, idx) = unpack(cur);
            if idx == NIL {
                return NIL;
            }
            match self.head.compare_exchange_weak(
                cur,
                pack(tag.wrapping_add(1), NIL),
                Acquire,
                Acquire,
            ) {
                Ok(_) => return idx,
                Err(now) => cur = now,
            }
        }
    }
}

/// Walks a detached chain, collecting its indices.
pub fn collect_chain<L: Links + ?Sized>(links: &L, mut first: u32, out: &mut Vec<u32>) {
    while first != NIL {
        out.push(first);
        first = links.link(first).load(Relaxed);
    }
}

/// Links chain `idxs` in order; returns `(first, last)`, or `None` if empty.
pub fn link_chain<L: Links + ?Sized>(links: &L, idxs: &[u32]) -> Option<(u32, u32)> {
    let (&first, &last) = (idxs.first()?, idxs.last()?);
    for w in idxs.windows(2) {
        links.link(w[0]).store(w[1], Relaxed);
    }
    Some((first, last))
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    struct VecLinks(Vec<AtomicU32>);
    impl Links for VecLinks {
        fn link(&self, idx: u32) -> &AtomicU32 {
            &self.0[idx as usize]
        }
    }

    fn links(n: u32) -> VecLinks {
        VecLinks((0..n).map(|_| AtomicU32::new(NIL)).collect())
    }

    #[test]
    fn lifo_order_and_empty() {
        let l = links(8);
        let s = IndexStack::new();
        assert!(s.is_empty());
        assert_eq!(s.pop(&l), None);
        for i in 0..8 {
            s.push(&l, i);
        }
        for i in (0..8).rev() {
            assert_eq!(s.pop(&l), Some(i));
        }
        assert!(s.is_empty());
    }

    #[test]
    fn chains_push_and_take_whole() {
        let l = links(10);
        let s = IndexStack::new();
        let (f, t) = link_chain(&l, &[3, 1, 4]).unwrap();
        s.push_chain(&l, f, t);
        s.push(&l, 9);
        let mut out = Vec::new();
        collect_chain(&l, s.take_all(), &mut out);
        assert_eq!(out, vec![9, 3, 1, 4]);
        assert!(s.is_empty());
        assert_eq!(s.take_all(), NIL);
    }

    #[test]
    fn threads_never_lose_or_duplicate_an_index() {
        const N: u32 = 4096;
        let l = std::sync::Arc::new(links(N));
        let s = std::sync::Arc::new(IndexStack::new());
        for i in 0..N {
            s.push(&*l, i);
        }
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let (l, s) = (l.clone(), s.clone());
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        let a = s.pop(&*l);
                        let b = s.pop(&*l);
                        if let Some(a) = a {
                            s.push(&*l, a);
                        }
                        if let Some(b) = b {
                            s.push(&*l, b);
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let mut out = Vec::new();
        collect_chain(&*l, s.take_all(), &mut out);
        out.sort_unstable();
        assert_eq!(out, (0..N).collect::<Vec<_>>());
    }
}
