//! Per-thread magazines: a few slots per size class, freed on one stream by
//! this thread and kept for its next allocations on that stream, with no
//! atomic instruction on either side.
//!
//! Slots in a magazine are exactly like slots on that stream's dirty stack
//! (freed on that stream, reusable by it alone), only invisible to other
//! threads. A thread keeps magazines for its [`WAYS`] most recently freed-on
//! streams (a server thread takes requests for many streams in turn: with
//! two, it emptied and rebuilt a magazine on almost every free; with four,
//! one thread on eight streams spent a fifth of its pool time rebuilding
//! them, serving 1x8 at 181-202 ns per operation against 151-152). The
//! ways are ordered by the general path's last use (the fast lanes move
//! none); the last is emptied into its stream's dirty stacks when another
//! stream comes along, and all are emptied when the thread exits, before a trim or
//! an audit on this thread, when the pool reclaims on this thread, and when
//! the pool is dropped on this thread. `thread_cache=false` turns magazines
//! off. Other threads' magazines hold at most [`CAP`] slots per class
//! each, which the pool's byte counters account for (as cached memory).
//!
//! The fast lane ([`alloc_front`], [`free_front`]) serves the common case,
//! a pair on a stream this thread has a magazine for, from that magazine
//! alone: one thread-local access (the state of `thread_state.rs`), a
//! scan of the ways that ends at the first on one stream, the slot's
//! address and size word kept beside its index (no slab lookup: see
//! `small::SizeWord`), and the counts made in the shard id the magazine
//! cached. Anything else (a full or empty rack, a first use) takes
//! [`take`] or [`put`], which rotate and create magazines.
//!
//! Lifetimes. A magazine holds its stream and its pool *weakly*: a thread
//! that stays alive with full magazines keeps neither the stream (which
//! retires when its user drops it) nor the pool's device memory (which goes
//! when the runtime does). Invariants:
//! 1. While a magazine exists, its stream's `StreamInner::mag_holders`
//!    counts it; a stream that retires with holders left records a tomb
//!    event, and each holder later hands its slots to the pool as orphans
//!    that wait on that event (`PoolShared::adopt_orphans`), never to a
//!    dirty stack a new stream could inherit.
//! 2. A magazine's drop (thread exit included) touches host memory only:
//!    no driver call, and nothing at all once its pool is torn down.

use super::small::SizeWord;
use super::stream::{Stream, StreamInner};
use super::thread_state::{my_shard, state, STATE};
use super::PoolShared;
use std::sync::atomic::Ordering::AcqRel;
use std::sync::{Arc, Weak};

/// Slots per class per magazine.
pub(crate) const CAP: usize = 16;
const _: () = assert!(CAP.is_power_of_two());

/// Magazines per thread, most recently freed-on stream first.
const WAYS: usize = 8;

/// One class's slots, with their device addresses and size words.
/// Invariant: `words[i]` is the size word of `slots[i]` in the slabs of
/// the magazine's pool (every push takes it from that pool).
#[derive(Debug, Clone, Copy)]
struct Rack {
    len: usize,
    slots: [u32; CAP],
    addrs: [u64; CAP],
    words: [SizeWord; CAP],
}

impl Rack {
    // `len <= CAP` always; the masks below are the identity on the indices
    // used and spare the bounds checks (`CAP` is a power of two).
    #[inline]
    fn pop(&mut self) -> Option<(u32, u64, SizeWord)> {
        let n = self.len.checked_sub(1)?;
        self.len = n;
        let i = n & (CAP - 1);
        Some((self.slots[i], self.addrs[i], self.words[i]))
    }

    /// Drops the `n <= len` oldest entries (the rest move down, every
    /// array alike).
    fn drop_oldest(&mut self, n: usize) {
        self.slots.copy_within(n..self.len, 0);
        self.addrs.copy_within(n..self.len, 0);
        self.words.copy_within(n..self.len, 0);
        self.len -= n;
    }

    /// Pushes into a rack that is not full.
    #[inline]
    fn push(&mut self, idx: u32, addr: u64, word: SizeWord) {
        debug_assert!(self.len < CAP);
        let i = self.len & (CAP - 1);
        self.slots[i] = idx;
        self.addrs[i] = addr;
        self.words[i] = word;
        self.len += 1;
    }
}

/// The magazine of one (thread, stream).
pub(super) struct Magazine {
    stream: Weak<StreamInner>,
    /// `stream`'s address, compared on the fast lane (`Weak::as_ptr`
    /// checks for a dangling pointer first).
    stream_addr: usize,
    pool: Weak<PoolShared>,
    slot: u16,
    /// This thread's counter shard (`thread_state.rs`, invariant 2).
    shard: (usize, bool),
    racks: Box<[Rack]>,
}

/// A thread's magazines, most recently freed-on stream first.
pub(super) type Ways = [Option<Magazine>; WAYS];

/// No magazines (a thread's start).
pub(super) const NO_WAYS: Ways = [const { None }; WAYS];

impl Magazine {
    fn new(stream: &Stream) -> Magazine {
        let inner = &stream.inner;
        let n = inner.pool.slabs.classes.len();
        inner.mag_holders.fetch_add(1, AcqRel);
        Magazine {
            stream: Arc::downgrade(inner),
            stream_addr: Arc::as_ptr(inner) as usize,
            pool: Arc::downgrade(&inner.pool),
            slot: inner.slot.expect("magazines are for streams with a slot"),
            shard: my_shard(),
            racks: vec![
                Rack {
                    len: 0,
                    slots: [0; CAP],
                    addrs: [0; CAP],
                    words: [SizeWord::NONE; CAP],
                };
                n
            ]
            .into(),
        }
    }

    #[inline]
    fn is_of(&self, stream: &Stream) -> bool {
        // The weak reference keeps the allocation, so no other stream
        // has this address while the magazine exists.
        self.stream_addr == Arc::as_ptr(&stream.inner) as usize
    }

    /// Moves the oldest `n` slots of `class` to the stream's dirty stack
    /// (`pool` is the magazine's pool, alive).
    fn spill(&mut self, pool: &PoolShared, class: usize, n: usize) {
        let r = &mut self.racks[class];
        let n = n.min(r.len);
        pool.slabs
            .push_dirty_many(class, self.slot as usize, &r.slots[..n]);
        r.drop_oldest(n);
        pool.counters
            .on_magazine(-((n as u64 * pool.slabs.classes.size_of(class)) as i64));
    }

    /// Every slot, by class, leaving the magazine empty.
    fn take_all(&mut self) -> Vec<(u16, Vec<u32>)> {
        self.racks
            .iter_mut()
            .enumerate()
            .filter(|(_, r)| r.len > 0)
            .map(|(c, r)| {
                let v = r.slots[..r.len].to_vec();
                r.len = 0;
                (c as u16, v)
            })
            .collect()
    }
}

impl Drop for Magazine {
    fn drop(&mut self) {
        let Some(pool) = self.pool.upgrade() else {
            return;
        };
        match self.stream.upgrade() {
            Some(inner) => {
                // The stream lives (and holds its slot): its dirty stacks.
                if !pool.is_torn_down() {
                    for c in 0..self.racks.len() {
                        let n = self.racks[c].len;
                        if n > 0 {
                            self.spill(&pool, c, n);
                        }
                    }
                }
                inner.mag_holders.fetch_sub(1, AcqRel);
                // Dropping `inner` may retire the stream, which flushes
                // those stacks: no magazine borrow is held here.
            }
            None => {
                // The stream retired while this magazine held its slots.
                let parts = self.take_all();
                pool.adopt_orphans(self.stream.as_ptr() as usize, parts);
            }
        }
    }
}

/// `stream`'s magazine among this thread's, if it has one. The fast
/// lanes take any way, not only the front, and move none: a thread that
/// takes turns on three streams made every pair on the general path
/// (rotating its magazines, 2.2x the instructions of a pair on one
/// stream). The order of the ways is then that of the general path's
/// last use, which only eviction reads.
#[inline(always)]
fn find<'a>(m: &'a mut Ways, stream: &Stream) -> Option<&'a mut Magazine> {
    m.iter_mut().flatten().find(|g| g.is_of(stream))
}

/// The fast lane of an allocation: a slot of `class` from `stream`'s
/// magazine if this thread has one, counted as an allocation of `requested`
/// bytes taking `rounded`, with its address.
#[inline(always)]
pub(crate) fn alloc_front(
    stream: &Stream,
    class: usize,
    requested: u64,
) -> Option<(u32, u64, SizeWord)> {
    // SAFETY: the state is used within this call only.
    let t = unsafe { state() }?;
    let mut m = t.mags.try_borrow_mut().ok()?;
    let mag = find(&mut m, stream)?;
    let got = mag.racks.get_mut(class)?.pop()?;
    // The rounded size is read here, not by the caller: kept across the
    // lookups above it cost a register spill.
    let pool = &stream.inner.pool;
    let rounded = pool.slabs.classes.size_of(class);
    pool.counters
        .on_alloc_in(mag.shard, requested, rounded, true);
    Some(got)
}

/// The fast lane of a free: keeps the slot in `stream`'s magazine if this
/// thread has one with room, counted as a free; `false` if the caller must
/// take the general path. `word` is the slot's size word in the slabs of
/// `stream`'s pool (the rack's invariant).
#[inline(always)]
pub(crate) fn free_front(
    stream: &Stream,
    class: usize,
    idx: u32,
    addr: u64,
    requested: u64,
    word: SizeWord,
) -> bool {
    // SAFETY: the state is used within this call only.
    let Some(t) = (unsafe { state() }) else {
        return false;
    };
    let Ok(mut m) = t.mags.try_borrow_mut() else {
        return false;
    };
    let Some(mag) = find(&mut m, stream) else {
        return false;
    };
    let Some(r) = mag.racks.get_mut(class).filter(|r| r.len < CAP) else {
        return false;
    };
    r.push(idx, addr, word);
    let pool = &stream.inner.pool;
    let rounded = pool.slabs.classes.size_of(class);
    pool.counters
        .on_free_in(mag.shard, requested, rounded, true);
    true
}

/// A slot of `class` this thread freed on `stream`, with its address, if
/// it holds one in any magazine (the caller counts it out of the
/// magazine).
#[inline]
pub(crate) fn take(stream: &Stream, class: usize) -> Option<(u32, u64)> {
    STATE
        .try_with(|t| {
            let mut m = t.mags.try_borrow_mut().ok()?;
            let mag = find(&mut m, stream)?;
            // The caller counts the slot out of the magazine with its
            // allocation (`Counters::on_alloc_from`).
            mag.racks[class].pop().map(|(idx, addr, _)| (idx, addr))
        })
        .ok()
        .flatten()
}

/// Keeps a slot of `class` at `addr` freed on `stream` (which must have a
/// slot; the caller counts it in), bringing the stream's magazine to the
/// front; `false` if the caller must push it to the dirty stack itself.
#[inline]
pub(crate) fn put(stream: &Stream, class: usize, idx: u32, addr: u64) -> bool {
    let evicted = STATE.try_with(|t| {
        let Ok(mut m) = t.mags.try_borrow_mut() else {
            return (false, None);
        };
        let mut evicted = None;
        if !m[0].as_ref().is_some_and(|g| g.is_of(stream)) {
            match m
                .iter()
                .position(|w| w.as_ref().is_some_and(|g| g.is_of(stream)))
            {
                // To the front, the others one down.
                Some(i) => m[..=i].rotate_right(1),
                None => {
                    // The least recent magazine is emptied (by its Drop,
                    // outside the borrow) to make room.
                    evicted = m[WAYS - 1].take();
                    m.rotate_right(1);
                    m[0] = Some(Magazine::new(stream));
                }
            }
        }
        let pool = &stream.inner.pool;
        let mag = m[0].as_mut().expect("bound above");
        if mag.racks[class].len == CAP {
            mag.spill(pool, class, CAP / 2);
        }
        mag.racks[class].push(idx, addr, pool.slabs.size_word(idx));
        // The caller counts it in with the free
        // (`Counters::on_free_to`).
        (true, evicted)
    });
    match evicted {
        Ok((kept, evicted)) => {
            drop(evicted);
            kept
        }
        Err(_) => false,
    }
}

/// Empties this thread's magazines that belong to `pool`.
pub(crate) fn flush_for(pool: &PoolShared) {
    flush_where(|m| std::ptr::eq(m.pool.as_ptr(), pool));
}

/// Empties this thread's magazine of `stream` (it is retiring, so its
/// weak references no longer upgrade), if any: into its dirty stacks,
/// which the retirement flushes next.
pub(crate) fn flush_stream(stream: &StreamInner) {
    let _ = STATE.try_with(|t| {
        let Ok(mut m) = t.mags.try_borrow_mut() else {
            return;
        };
        for w in m.iter_mut() {
            if w.as_ref()
                .is_some_and(|g| std::ptr::eq(g.stream.as_ptr(), stream))
            {
                let mut mag = w.take().expect("checked above");
                if !stream.pool.is_torn_down() {
                    for c in 0..mag.racks.len() {
                        let n = mag.racks[c].len;
                        if n > 0 {
                            mag.spill(&stream.pool, c, n);
                        }
                    }
                }
                stream.mag_holders.fetch_sub(1, AcqRel);
                // Spilled and uncounted: its drop has nothing to do.
                mag.pool = Weak::new();
            }
        }
    });
}

fn flush_where(pick: impl Fn(&Magazine) -> bool) {
    let _ = STATE.try_with(|t| {
        let taken: Vec<Magazine> = match t.mags.try_borrow_mut() {
            Ok(mut m) => m
                .iter_mut()
                .filter(|w| w.as_ref().is_some_and(&pick))
                .filter_map(Option::take)
                .collect(),
            Err(_) => Vec::new(),
        };
        // Dropped outside the borrow.
        drop(taken);
    });
}
