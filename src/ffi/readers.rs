//! How a call reaches the live runtime without a shared atomic
//! read-modify-write, and how `gpupool_shutdown` and stream removals wait
//! for the calls that may still use what they take away.
//!
//! Why: the sharded read lock every call took cost two locked
//! instructions a call, 27 of the 77 ns of a 4 KiB `gpupool_alloc` +
//! `gpupool_free` pair through `libgpupool.so` (measured 2026-12-05 by
//! reading the state without it). The scheme is userspace RCU's
//! membarrier flavour (asymmetric Dekker):
//!
//! - Each thread that calls in gets a *reader slot*: a counter only that
//!   thread writes, odd while it is inside a call that took the state
//!   from [`LIVE`].
//! - A call: counter to odd (release), a light barrier (a compiler
//!   fence where the kernel has `membarrier`, a full fence elsewhere),
//!   load [`LIVE`]; null sends it to the locked path (which reports "not
//!   initialized" or "shut down"); after the call, counter to even
//!   (release).
//! - A writer (holding the global write lock, which excludes the locked
//!   path): makes its change (clears [`LIVE`]; raises a stream epoch),
//!   then [`synchronize`]: a heavy barrier (`membarrier`, a full fence on
//!   every running thread of the process), then, for each slot found
//!   odd, waits until its counter moves.
//!
//! Invariants:
//! 1. Light and heavy barriers pair like two `SeqCst` fences: a reader
//!    either sees the writer's change or the writer sees its odd counter
//!    and waits for it, so after [`synchronize`] no call uses the old
//!    state (or a removed stream) any more.
//! 2. A slot has one owner thread at a time. A thread returns its slot
//!    when it exits (a thread-local guard); calls it makes after that,
//!    from other thread-local destructors, take the locked path.
//! 3. Slots are never freed (reused through a free list, so their number
//!    is the most threads ever inside gpupool at once): a writer may read
//!    any slot at any time.
//! 4. [`synchronize`] never runs inside a call on its own thread (its own
//!    counter would be odd): init, shutdown and the grace period of a
//!    stream removal all refuse or defer from inside a call.

use super::state::State;
use super::thread::{with_thread, FfiThread};
use crossbeam_utils::CachePadded;
use parking_lot::Mutex;
use std::cell::Cell;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicPtr, AtomicU64};

/// The live state (the box inside the global `Live` value), null while
/// there is none. Written only under the global write lock.
pub(super) static LIVE: AtomicPtr<State> = AtomicPtr::new(std::ptr::null_mut());

/// One thread's reader counter (padded: threads write their own lines).
pub(super) type ReaderSlot = CachePadded<AtomicU64>;

/// Every slot ever made (invariant 3).
static SLOTS: Mutex<Vec<&'static ReaderSlot>> = Mutex::new(Vec::new());
/// Slots of threads that exited, for the next threads.
static FREE: Mutex<Vec<&'static ReaderSlot>> = Mutex::new(Vec::new());

/// Gives the thread's slot back when the thread exits.
struct SlotGuard(Cell<Option<&'static ReaderSlot>>);

impl Drop for SlotGuard {
    fn drop(&mut self) {
        if let Some(slot) = self.0.take() {
            // Later calls on this thread (from other destructors) take the
            // locked path: the slot may have a new owner by then.
            with_thread(|t| t.reader.set(None));
            FREE.lock().push(slot);
        }
    }
}

thread_local! {
    static GUARD: SlotGuard = const { SlotGuard(Cell::new(None)) };
}

/// This thread's slot, made or reused on its first call; `None` once the
/// thread's guard is gone (thread exit).
#[cold]
#[inline(never)]
fn register(t: &FfiThread) -> Option<&'static ReaderSlot> {
    GUARD
        .try_with(|g| {
            // The record's slot is `None` only before the first call (and
            // after the guard's drop, when `try_with` fails): the guard
            // holds none yet.
            debug_assert!(g.0.get().is_none());
            let slot = FREE.lock().pop().unwrap_or_else(|| {
                let slot: &'static ReaderSlot =
                    Box::leak(Box::new(CachePadded::new(AtomicU64::new(0))));
                // Listed before its first use, so a writer that could
                // miss its odd counter cannot miss the slot (invariant 1).
                SLOTS.lock().push(slot);
                slot
            });
            g.0.set(Some(slot));
            t.reader.set(Some(slot));
            slot
        })
        .ok()
}

/// A call reading the live state through its thread's slot: the state,
/// valid until the value is dropped (on return and on unwind), which
/// marks the end of the call on the slot.
pub(super) struct Reading {
    slot: &'static ReaderSlot,
    /// The counter's value after the call (even).
    after: u64,
    st: *const State,
}

impl Reading {
    /// The live state.
    #[inline(always)]
    pub(super) fn state(&self) -> &State {
        // SAFETY: `st` was the non-null LIVE read after this slot's
        // counter went odd; the writer that clears LIVE frees the state
        // only after `synchronize` saw the counter leave that odd value,
        // which happens no earlier than this value's drop (invariant 1).
        unsafe { &*self.st }
    }
}

impl Drop for Reading {
    #[inline(always)]
    fn drop(&mut self) {
        // Release: the call's reads of the state happen before a writer
        // that sees the even counter frees it.
        self.slot.store(self.after, Release);
    }
}

/// Enters a call on the live state through this thread's slot. `None`
/// when there is no live state or the thread has no slot: the caller
/// takes the locked path.
#[inline(always)]
pub(super) fn enter(t: &FfiThread) -> Option<Reading> {
    let slot = match t.reader.get() {
        Some(slot) => slot,
        None => register(t)?,
    };
    let n = slot.load(Relaxed);
    // Release, as the leaving store: a writer waiting for an odd value
    // may next read this call's odd value instead of the previous call's
    // even one, and must still see that previous call's reads done
    // (found by the loom model below; a plain store on x86 either way).
    slot.store(n + 1, Release);
    let mut r = Reading {
        slot,
        after: n + 2,
        st: std::ptr::null(),
    };
    swmr_barrier::light_barrier();
    r.st = LIVE.load(Acquire);
    // A null state: `r` drops here, the counter even again.
    (!r.st.is_null()).then_some(r)
}

/// Waits until every call that may have missed the caller's change (made
/// before this call) has returned (invariant 1). Never from inside a
/// call (invariant 4).
pub(super) fn synchronize() {
    swmr_barrier::heavy_barrier();
    let slots: Vec<&'static ReaderSlot> = SLOTS.lock().clone();
    for slot in slots {
        let n = slot.load(Acquire);
        if n % 2 == 1 {
            let mut spins = 0u32;
            while slot.load(Acquire) == n {
                if spins < 64 {
                    std::hint::spin_loop();
                    spins += 1;
                } else {
                    std::thread::yield_now();
                }
            }
        }
    }
}

/// A loom model of the protocol above: one thread makes two calls, the
/// other clears the live flag, waits as [`synchronize`] does and tears the
/// state down; loom reports any read of the state that the teardown races
/// with. A light/heavy barrier pair orders the two threads like two full
/// fences; loom models `SeqCst` fences as acquire-release only (too weak
/// for this store-fence-load pattern: it reports a race that cannot
/// happen), so each barrier is modelled as a read-modify-write of one
/// shared location, which puts the two in one total order as the pair
/// does.
#[cfg(all(test, loom))]
mod loom_model {
    use loom::cell::UnsafeCell;
    use loom::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};
    use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
    use loom::sync::Arc;

    #[test]
    fn loom_readers_never_read_a_torn_down_state() {
        loom::model(|| {
            let state = Arc::new(UnsafeCell::new(1u32));
            let live = Arc::new(AtomicBool::new(true));
            let slot = Arc::new(AtomicU64::new(0));
            let barrier = Arc::new(AtomicUsize::new(0));
            let reader = {
                let (state, live, slot) = (state.clone(), live.clone(), slot.clone());
                let barrier = barrier.clone();
                loom::thread::spawn(move || {
                    for _ in 0..2 {
                        // `enter`
                        let n = slot.load(Relaxed);
                        slot.store(n + 1, Release);
                        barrier.fetch_add(1, AcqRel);
                        if live.load(Acquire) {
                            // SAFETY: loom checks this read against the
                            // teardown's write below.
                            state.with(|v| assert_eq!(unsafe { *v }, 1));
                        }
                        // `Reading`'s drop
                        slot.store(n + 2, Release);
                    }
                })
            };
            // `gpupool_shutdown`: clear, then `synchronize`, then tear down.
            live.store(false, Release);
            barrier.fetch_add(1, AcqRel);
            let n = slot.load(Acquire);
            if n % 2 == 1 {
                while slot.load(Acquire) == n {
                    loom::thread::yield_now();
                }
            }
            // SAFETY: loom checks this write against the reader's reads.
            state.with_mut(|v| unsafe { *v = 0 });
            reader.join().unwrap();
        });
    }
}
