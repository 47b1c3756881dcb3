//! Per-thread magazines: a few slots per size class, freed on one stream by
//! this thread and kept for its next allocations on that stream, with no
//! atomic instruction on either side.
//!
//! A magazine holds a clone of its stream (`Arc<StreamInner>`), so the
//! stream, its slot and its pool stay alive while the magazine has slots;
//! slots in a magazine are exactly like slots on that stream's dirty stack
//! (freed on that stream, reusable by it alone), only invisible to other
//! threads. A thread keeps magazines for its two most recent streams; the
//! older one is emptied into its stream's dirty stacks when a third stream
//! comes along, and all are emptied when the thread exits, before a trim or
//! an audit on this thread, when the pool reclaims on this thread, and when
//! the pool is dropped on this thread. A magazine of another, still running
//! thread keeps the pool's memory until that thread exits or calls
//! `DevicePool::flush_thread_cache` (as thread caches of host allocators do);
//! `thread_cache=false` turns magazines off.
//! Other threads' magazines hold at most [`CAP`] slots per class each,
//! which the pool's byte counters account for (as cached memory).

use super::stream::{Stream, StreamInner};
use super::PoolShared;
use std::cell::RefCell;
use std::sync::Arc;

/// Slots per class per magazine.
pub(crate) const CAP: usize = 16;

/// One class's slots.
#[derive(Debug, Clone, Copy)]
struct Rack {
    len: usize,
    slots: [u32; CAP],
}

/// The magazine of one (thread, stream).
struct Magazine {
    stream: Arc<StreamInner>,
    racks: Box<[Rack]>,
}

thread_local! {
    static MAGS: RefCell<[Option<Magazine>; 2]> = const { RefCell::new([None, None]) };
}

impl Magazine {
    fn new(stream: &Stream) -> Magazine {
        let n = stream.inner.pool.slabs.classes.len();
        Magazine {
            stream: stream.inner.clone(),
            racks: vec![
                Rack {
                    len: 0,
                    slots: [0; CAP]
                };
                n
            ]
            .into(),
        }
    }

    /// Moves the oldest `n` slots of `class` to the stream's dirty stack.
    fn spill(&mut self, class: usize, n: usize) {
        let pool = &self.stream.pool;
        let slot = self
            .stream
            .slot
            .expect("magazines are for streams with a slot") as usize;
        let r = &mut self.racks[class];
        let n = n.min(r.len);
        pool.slabs.push_dirty_many(class, slot, &r.slots[..n]);
        r.slots.copy_within(n..r.len, 0);
        r.len -= n;
        pool.counters
            .on_magazine(-((n as u64 * pool.slabs.classes.size_of(class)) as i64));
    }
}

impl Drop for Magazine {
    fn drop(&mut self) {
        for c in 0..self.racks.len() {
            let n = self.racks[c].len;
            if n > 0 {
                self.spill(c, n);
            }
        }
    }
}

#[inline]
fn same(m: &Option<Magazine>, stream: &Stream) -> bool {
    m.as_ref()
        .is_some_and(|m| Arc::ptr_eq(&m.stream, &stream.inner))
}

/// A slot of `class` this thread freed on `stream`, if it holds one.
#[inline]
pub(crate) fn take(stream: &Stream, class: usize) -> Option<u32> {
    MAGS.try_with(|m| {
        let mut m = m.try_borrow_mut().ok()?;
        let mag = m.iter_mut().find(|w| same(w, stream))?.as_mut()?;
        let r = &mut mag.racks[class];
        if r.len == 0 {
            return None;
        }
        r.len -= 1;
        let idx = r.slots[r.len];
        let pool = &mag.stream.pool;
        pool.counters
            .on_magazine(-(pool.slabs.classes.size_of(class) as i64));
        Some(idx)
    })
    .ok()
    .flatten()
}

/// Keeps a slot of `class` freed on `stream` (which must have a slot);
/// `false` if the caller must push it to the dirty stack itself.
#[inline]
pub(crate) fn put(stream: &Stream, class: usize, idx: u32) -> bool {
    MAGS.try_with(|m| {
        let Ok(mut m) = m.try_borrow_mut() else {
            return false;
        };
        if !same(&m[0], stream) {
            if same(&m[1], stream) {
                m.swap(0, 1);
            } else {
                // The older magazine is emptied (by its Drop) to make room.
                m[1] = m[0].take();
                m[0] = Some(Magazine::new(stream));
            }
        }
        let mag = m[0].as_mut().expect("bound above");
        if mag.racks[class].len == CAP {
            mag.spill(class, CAP / 2);
        }
        let r = &mut mag.racks[class];
        r.slots[r.len] = idx;
        r.len += 1;
        let pool = &mag.stream.pool;
        pool.counters
            .on_magazine(pool.slabs.classes.size_of(class) as i64);
        true
    })
    .unwrap_or(false)
}

/// Empties this thread's magazines that belong to `pool`.
pub(crate) fn flush_for(pool: &PoolShared) {
    let _ = MAGS.try_with(|m| {
        let taken: Vec<Magazine> = match m.try_borrow_mut() {
            Ok(mut m) => m
                .iter_mut()
                .filter(|w| {
                    w.as_ref()
                        .is_some_and(|w| std::ptr::eq(Arc::as_ptr(&w.stream.pool), pool))
                })
                .filter_map(Option::take)
                .collect(),
            Err(_) => Vec::new(),
        };
        // Dropped outside the borrow: dropping a stream may retire it.
        drop(taken);
    });
}
