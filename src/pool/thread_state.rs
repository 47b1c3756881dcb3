//! What each thread keeps across pools: its counter shard id and its
//! magazines, in one thread-local.
//!
//! One thread-local, not two, for two reasons. The small fast path makes
//! one TLS access per call (a magazine caches its thread's shard id, so
//! counting needs no second lookup). And the two end in a known order when
//! the thread exits: fields drop in declaration order, so the magazines
//! are emptied first, while the id is still this thread's, and the id is
//! given back after. Invariants:
//! 1. A shard id below [`SHARDS`]` - 1` has one owner thread at a time,
//!    which updates that shard with plain loads and stores; every other
//!    thread (and this one once its state is being destroyed) uses the
//!    shared last shard with atomic adds.
//! 2. An id is given back only after every magazine of the thread is gone,
//!    so an id cached in a magazine is never used by two threads at once.

use super::magazine::Ways;
use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// Counter shards per pool (and shard ids in use at once, the last one
/// shared).
pub(crate) const SHARDS: usize = 64;

/// Shard ids of threads that exited, for the next new threads: a process
/// whose threads come and go (worker pools, a thread per request) keeps
/// using owned shards instead of piling every thread past the first
/// [`SHARDS`]` - 1` onto the shared one (measured before this: 4 KiB pairs
/// fell from 120 M to 6 M operations per second once 63 threads had
/// existed).
static FREE_IDS: parking_lot::Mutex<Vec<usize>> = parking_lot::Mutex::new(Vec::new());
static NEXT_THREAD: AtomicUsize = AtomicUsize::new(0);

/// This thread's shard id (`usize::MAX` until its first counter update),
/// given back when the thread exits.
pub(super) struct ShardId(Cell<usize>);

impl Drop for ShardId {
    fn drop(&mut self) {
        let id = self.0.get();
        if id < SHARDS - 1 {
            // The mutex orders this thread's last plain stores to the
            // shard before the next owner's first loads.
            FREE_IDS.lock().push(id);
        }
    }
}

/// One thread's state. Field order is drop order (invariant 2).
pub(super) struct ThreadState {
    pub mags: RefCell<Ways>,
    shard: ShardId,
}

thread_local! {
    pub(super) static STATE: ThreadState = const {
        ThreadState {
            mags: RefCell::new(super::magazine::NO_WAYS),
            shard: ShardId(Cell::new(usize::MAX)),
        }
    };
}

/// This thread's state; `None` while it is destroyed or after.
///
/// The thread-local is only looked up inside `try_with`, and the caller's
/// work runs outside it: a large closure inside `try_with` (or passed to
/// a helper) made LLVM keep it out of line, a call with its prologue on
/// every small allocation and free.
///
/// # Safety
///
/// The reference must not be kept past the caller's return (it is not
/// `'static`: the state goes when the thread exits).
#[inline(always)]
pub(super) unsafe fn state<'a>() -> Option<&'a ThreadState> {
    let p: *const ThreadState = STATE.try_with(|t| t as *const ThreadState).ok()?;
    // SAFETY: `try_with` found this thread's state alive, and only this
    // thread's exit destroys it, which cannot begin while the caller runs
    // on the thread (the caller keeps the reference no longer); no other
    // thread ever reaches this state.
    Some(unsafe { &*p })
}

/// This thread's shard, and whether it owns it alone.
#[inline]
pub(super) fn my_shard() -> (usize, bool) {
    // `try_with`: while this thread's state is destroyed (its magazines
    // emptied) or after, the shared shard takes the update.
    let n = STATE
        .try_with(|t| {
            let v = t.shard.0.get();
            if v != usize::MAX {
                return v;
            }
            let v = FREE_IDS
                .lock()
                .pop()
                .unwrap_or_else(|| NEXT_THREAD.fetch_add(1, Relaxed));
            t.shard.0.set(v);
            v
        })
        .unwrap_or(usize::MAX);
    if n < SHARDS - 1 {
        (n, true)
    } else {
        (SHARDS - 1, false)
    }
}

/// The calling thread's counter shard: distinct among the first
/// [`SHARDS`]` - 1` live threads, shared above (for sharding other
/// per-thread state, `stream_large.rs`).
#[inline]
pub(crate) fn thread_index() -> usize {
    my_shard().0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_that_come_and_go_keep_owning_their_shards() {
        // Many more threads than shards, one after the other: each gets a
        // shard of its own (ids of exited threads are reused), never the
        // shared one that takes atomic adds.
        for _ in 0..3 * SHARDS {
            let own = std::thread::spawn(|| my_shard().1)
                .join()
                .expect("no panic");
            assert!(own, "a new thread fell onto the shared shard");
        }
    }
}
