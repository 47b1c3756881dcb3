//! Memory limits and the out-of-memory observer.
//!
//! A pool never holds more device memory than its limit: the smaller of
//! `max_bytes` and `fraction` times the device's memory (both from
//! [`PoolConfig`]), or what
//! [`DevicePool::set_memory_limit`] set at run time. The heap consults the
//! limit ([`Limit::admit`]) before it creates a physical chunk or a segment
//! and refuses with [`Error::DeviceOutOfMemory`], the error a full device
//! gives: so the pool's out-of-memory path (reclaim, wait for in-flight
//! frees, retry) applies unchanged, and an allocation that still does not
//! fit fails with [`Error::OutOfMemory`].
//!
//! `initial_bytes` is reserved and mapped when the pool is built (it stays
//! cached: trimming may give it back).
//!
//! [`DevicePool::on_oom`] registers a callback that every out-of-memory
//! error calls once, with its report, before it is returned.

use super::{DevicePool, PoolShared};
use crate::config::PoolConfig;
use crate::error::{Error, OomReport, Result};
use parking_lot::RwLock;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// No limit.
const NONE: u64 = u64::MAX;

/// The most device memory one heap may hold, shared between the heap (which
/// reads it before growing) and the pool (which sets it). `u64::MAX`: none.
#[derive(Debug, Clone)]
pub(crate) struct Limit(Arc<AtomicU64>);

impl Default for Limit {
    fn default() -> Self {
        Limit(Arc::new(AtomicU64::new(NONE)))
    }
}

impl Limit {
    /// The limit in bytes, if any.
    pub(crate) fn get(&self) -> Option<u64> {
        Some(self.0.load(Relaxed)).filter(|&b| b != NONE)
    }

    /// Sets (`Some`) or lifts (`None`) the limit.
    pub(crate) fn set(&self, bytes: Option<u64>) {
        self.0.store(bytes.unwrap_or(NONE), Relaxed);
    }

    /// `Ok` when a heap holding `held` bytes may take `more`; otherwise the
    /// device-out-of-memory error a full device would give, naming the
    /// limit as the capacity.
    pub(crate) fn admit(&self, dev: usize, held: u64, more: u64) -> Result<()> {
        let cap = self.0.load(Relaxed);
        if more == 0 || held.saturating_add(more) <= cap {
            return Ok(());
        }
        tracing::debug!(
            device = dev,
            held,
            more,
            limit = cap,
            "memory limit reached"
        );
        Err(Error::DeviceOutOfMemory {
            device: dev,
            requested: more,
            used: held,
            capacity: cap,
        })
    }

    /// The length of a new segment: `want`, or under the limit the room
    /// left (whole granules) when that still holds `min` bytes.
    pub(crate) fn fit_segment(&self, held: u64, want: u64, min: u64, gran: u64) -> u64 {
        let cap = self.0.load(Relaxed);
        if held.saturating_add(want) <= cap {
            return want;
        }
        let room = cap.saturating_sub(held) / gran * gran;
        if room >= min {
            room
        } else {
            want
        }
    }
}

/// The limit the configuration sets for a device of `total` bytes:
/// the smaller of `max_bytes` and `fraction * total`.
pub(crate) fn configured(cfg: &PoolConfig, total: u64) -> Option<u64> {
    let by_fraction = cfg.memory_fraction.map(|f| (total as f64 * f) as u64);
    match (cfg.max_bytes, by_fraction) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// A callback told of every out-of-memory error.
pub type OomCallback = Box<dyn Fn(&OomReport) + Send + Sync>;

/// The pool's limit handle and its out-of-memory observer.
#[derive(Default)]
pub(crate) struct PoolLimits {
    pub(crate) limit: Limit,
    on_oom: RwLock<Option<Arc<OomCallback>>>,
}

impl std::fmt::Debug for PoolLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolLimits")
            .field("limit", &self.limit.get())
            .field("on_oom", &self.on_oom.read().is_some())
            .finish()
    }
}

impl PoolLimits {
    /// Tells the observer, if any, of an out-of-memory error. Called with
    /// no pool lock held, so the callback may read the pool's statistics;
    /// a panic in it is caught and logged.
    pub(crate) fn report_oom(&self, report: &OomReport) {
        let cb = self.on_oom.read().clone();
        if let Some(cb) = cb {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cb(report)));
            if r.is_err() {
                tracing::error!(
                    device = report.device,
                    "the out-of-memory callback panicked"
                );
            }
        }
    }
}

impl PoolShared {
    /// Reserves and maps `cfg.initial_bytes` (whole granules), then leaves
    /// it cached: called once, when the pool is built.
    pub(crate) fn reserve_initial(&self) -> Result<()> {
        let want = self.cfg.initial_bytes;
        if want == 0 {
            return Ok(());
        }
        let gran = self.info.granularity.max(1);
        let len = want.div_ceil(gran) * gran;
        // Taken and given back at once: the granules (or the segment) stay
        // mapped, idle and clean.
        let mut h = self.heap.lock();
        let t = h.heap.alloc(len, gran, None, false)?;
        h.heap.free(t.addr, super::heap::Tag::Clean)?;
        Ok(())
    }
}

impl DevicePool {
    /// The memory limit in force: the most device memory this pool holds
    /// (`None`: no limit but the device).
    pub fn memory_limit(&self) -> Option<u64> {
        self.shared.limits.limit.get()
    }

    /// Sets the pool's memory limit at run time (`None`: no limit but the
    /// device), replacing `max_bytes` and `fraction`. Lowering it below the
    /// memory held now first gives cached memory back (as
    /// [`DevicePool::trim`] does, which waits for pending frees); whatever
    /// live blocks still hold stays, and the pool then refuses to grow
    /// until it is under the limit again. Returns the bytes given back.
    pub fn set_memory_limit(&self, bytes: Option<u64>) -> Result<u64> {
        self.shared.check_live()?;
        self.shared.limits.limit.set(bytes);
        match bytes {
            Some(b) if self.reserved_bytes() > b => self.trim(),
            _ => Ok(0),
        }
    }

    /// Registers `callback`, called once for every out-of-memory error of
    /// this pool (with the error's report) before the error is returned,
    /// replacing any earlier one. It runs on the allocating thread with no
    /// pool lock held; it must not allocate from this pool (that could
    /// fail again and recurse). A panic in it is caught.
    pub fn on_oom(&self, callback: OomCallback) {
        *self.shared.limits.on_oom.write() = Some(Arc::new(callback));
    }

    /// Removes the out-of-memory callback.
    pub fn clear_on_oom(&self) {
        *self.shared.limits.on_oom.write() = None;
    }
}
