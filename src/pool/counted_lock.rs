//! The device heap's mutex: counts its acquisitions, and waits for a held
//! lock by spinning briefly before it sleeps.
//!
//! Counting: the large path and every slow path of a device take this one
//! lock; how often they do per operation is the figure that says whether
//! the pool stays a pool under many streams (issue 21: no device-wide lock
//! in steady state). One relaxed atomic add per acquisition, next to a
//! lock that already writes its own cache line.
//!
//! Waiting: a slow path holds the lock for tens of microseconds (it moves
//! every stream's parked ranges into the heap, harvests, grows), while the
//! common critical section is a best-fit lookup of about a microsecond.
//! A thread that finds the lock held and goes to sleep at once (parking
//! after a few spins, as `parking_lot` does) then waits for the holder
//! *and* for its own wake-up, which on a loaded host costs as much again:
//! on two threads over 8 streams (`stress --workload serving`, this VM)
//! waits at the large path's first lock averaged 45-73 µs behind holds of
//! 20-25 µs, and set the allocation p99. So a waiter first spins, reading
//! the lock word only, for up to [`SPIN`], and sleeps only after that.
//! At most one thread spins at a time: with more threads than cores a
//! holder may be descheduled, and a crowd of spinners would keep it off
//! the cores; the others sleep as before.
//!
//! Invariants: `spinning` is true while a thread spins for this lock;
//! a spin never holds anything, so it cannot deadlock, only take at most
//! [`SPIN`] of one core per contended acquisition.

use parking_lot::{Mutex, MutexGuard};
use std::sync::atomic::{
    AtomicBool, AtomicU64, Ordering::Acquire, Ordering::Relaxed, Ordering::Release,
};
use std::time::{Duration, Instant};

/// The longest a waiter spins before it sleeps: about twice the mean hold
/// of a slow path (see the module docs).
pub(crate) const SPIN: Duration = Duration::from_micros(50);

/// A mutex that counts how often it was taken.
#[derive(Debug)]
pub(crate) struct CountedMutex<T> {
    inner: Mutex<T>,
    taken: AtomicU64,
    /// Whether a waiter spins now (at most one does).
    spinning: AtomicBool,
}

impl<T> CountedMutex<T> {
    pub(crate) fn new(value: T) -> Self {
        CountedMutex {
            inner: Mutex::new(value),
            taken: AtomicU64::new(0),
            spinning: AtomicBool::new(false),
        }
    }

    /// Takes the lock (counted).
    #[inline]
    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        self.taken.fetch_add(1, Relaxed);
        match self.inner.try_lock() {
            Some(g) => g,
            None => self.lock_contended(),
        }
    }

    /// The lock is held: spin for it (if no other thread spins), then
    /// sleep for it.
    #[cold]
    #[inline(never)]
    fn lock_contended(&self) -> MutexGuard<'_, T> {
        if !self.spinning.swap(true, Acquire) {
            let start = Instant::now();
            let got = loop {
                // Read-only while held: no write to the lock's cache line
                // until it looks free.
                if !self.inner.is_locked() {
                    if let Some(g) = self.inner.try_lock() {
                        break Some(g);
                    }
                }
                if start.elapsed() > SPIN {
                    break None;
                }
                for _ in 0..16 {
                    std::hint::spin_loop();
                }
            };
            self.spinning.store(false, Release);
            if let Some(g) = got {
                return g;
            }
        }
        self.inner.lock()
    }

    /// Runs `f` with the lock that `guard` holds released, then takes it
    /// again (counted): for driver calls that need no heap state
    /// (`heap/map_job.rs`). `guard` must come from this mutex.
    pub(crate) fn unlocked<R>(&self, guard: &mut MutexGuard<'_, T>, f: impl FnOnce() -> R) -> R {
        debug_assert!(std::ptr::eq(MutexGuard::mutex(guard), &self.inner));
        let r = MutexGuard::unlocked(guard, f);
        self.taken.fetch_add(1, Relaxed);
        r
    }

    /// Takes the lock without counting it: for observation (stats,
    /// audits, snapshots, pointer lookups), so that reading the figure does
    /// not change it.
    #[inline]
    pub(crate) fn lock_quiet(&self) -> MutexGuard<'_, T> {
        self.inner.lock()
    }

    /// Acquisitions so far.
    pub(crate) fn acquisitions(&self) -> u64 {
        self.taken.load(Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::CountedMutex;
    use std::sync::atomic::Ordering::Relaxed;

    #[test]
    fn every_lock_is_counted() {
        let m = CountedMutex::new(0u32);
        for _ in 0..3 {
            *m.lock() += 1;
        }
        assert_eq!((*m.lock(), m.acquisitions()), (3, 4));
    }

    /// Many threads on few cores, holds long enough that waiters spin out
    /// and sleep: every increment lands (the lock excludes), every
    /// acquisition is counted, and no spinner is left marked.
    #[test]
    fn contended_waiters_spin_then_sleep_and_exclude() {
        let m = CountedMutex::new(0u64);
        let (threads, rounds) = (8, 300);
        std::thread::scope(|s| {
            for t in 0..threads {
                let m = &m;
                s.spawn(move || {
                    for i in 0..rounds {
                        let mut g = m.lock();
                        let v = *g;
                        if (t + i) % 50 == 0 {
                            // Past the spin: the other waiters sleep.
                            std::thread::sleep(super::SPIN * 2);
                        }
                        *g = v + 1;
                    }
                });
            }
        });
        assert_eq!(*m.lock_quiet(), (threads * rounds) as u64);
        assert_eq!(m.acquisitions(), (threads * rounds) as u64);
        assert!(!m.spinning.load(Relaxed));
    }
}
