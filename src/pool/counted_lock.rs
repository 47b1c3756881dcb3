//! The device heap's mutex, counting its acquisitions.
//!
//! The large path and every slow path of a device take this one lock; how
//! often they do per operation is the figure that says whether the pool
//! stays a pool under many streams (issue 21: no device-wide lock in steady
//! state). One relaxed atomic add per acquisition, next to a lock that
//! already writes its own cache line.

use parking_lot::{Mutex, MutexGuard};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// A mutex that counts how often it was taken.
#[derive(Debug)]
pub(crate) struct CountedMutex<T> {
    inner: Mutex<T>,
    taken: AtomicU64,
}

impl<T> CountedMutex<T> {
    pub(crate) fn new(value: T) -> Self {
        CountedMutex {
            inner: Mutex::new(value),
            taken: AtomicU64::new(0),
        }
    }

    /// Takes the lock (counted).
    #[inline]
    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        self.taken.fetch_add(1, Relaxed);
        self.inner.lock()
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

    #[test]
    fn every_lock_is_counted() {
        let m = CountedMutex::new(0u32);
        for _ in 0..3 {
            *m.lock() += 1;
        }
        assert_eq!((*m.lock(), m.acquisitions()), (3, 4));
    }
}
