//! Pool statistics, with the names PyTorch users know.
//!
//! Hot-path counters are sharded by thread (one cache line each): the first
//! [`SHARDS`]` - 1` threads that touch any pool each own a shard and update
//! it with plain loads and stores (a single writer needs no atomic
//! read-modify-write, the dearest instruction on the fast path); later
//! threads share the last shard with `fetch_add`. Totals are sums over
//! shards; peaks of the byte figures are sampled whenever a shard reaches a
//! new high of its own and on every slow path, which makes them exact for
//! single-threaded workloads and a lower bound otherwise.

use crossbeam_utils::CachePadded;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};

/// A current value and its peak.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Stat {
    /// Value now.
    pub current: u64,
    /// Highest value seen.
    pub peak: u64,
}

/// A snapshot of one pool's statistics.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct PoolStats {
    /// Device index.
    pub device: usize,
    /// Requested bytes of live blocks.
    pub allocated_bytes: Stat,
    /// Device memory held by the pool (physical chunks plus plain segments).
    pub reserved_bytes: Stat,
    /// Bytes of live blocks after rounding (slot or range sizes).
    pub active_bytes: Stat,
    /// Reserved bytes free for reuse now (free slots, free mapped ranges,
    /// spare chunks).
    pub cached_bytes: Stat,
    /// Freed bytes waiting for their last use to complete.
    pub pending_bytes: Stat,
    /// Reserved bytes no block can use (slab tails).
    pub overhead_bytes: u64,
    /// Rounded bytes of free slots and ranges not usable now:
    /// `active - allocated` (internal fragmentation).
    pub inactive_split_bytes: u64,
    /// Allocations served.
    pub num_allocs: u64,
    /// Frees taken.
    pub num_frees: u64,
    /// Physical allocations from the device (chunks or segments).
    pub num_device_allocs: u64,
    /// Allocations that needed new device memory (the rest were served
    /// from memory the pool already held).
    pub num_allocs_grown: u64,
    /// Physical frees to the device.
    pub num_device_frees: u64,
    /// Allocations that needed the reclaim path before succeeding or failing.
    pub num_alloc_retries: u64,
    /// Allocations that failed with out-of-memory.
    pub num_ooms: u64,
    /// Times the device's heap mutex was taken (the large path and every
    /// slow path): divided by operations, how device-wide the pool's
    /// locking is.
    pub heap_lock_acquisitions: u64,
    /// Times an allocation waited on the host for in-flight frees before
    /// giving up (the one host wait the alloc path may make: on the way to
    /// out of memory, waiting beats failing).
    pub num_oom_waits: u64,
    /// Host-blocking syncs those waits made.
    pub oom_host_syncs: u64,
    /// Frees parked on the pending list (cross-stream uses).
    pub num_pending_frees: u64,
    /// Pending blocks handed to another stream with a stream-wait-event.
    pub num_handovers: u64,
    /// Host-blocking syncs made on this device so far (by anyone).
    pub host_syncs: u64,
    /// `(reserved - allocated) / reserved`, 0 when nothing is reserved.
    pub fragmentation: f64,
}

/// Shards per pool.
pub(crate) const SHARDS: usize = 64;

static NEXT_THREAD: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

thread_local! {
    static THREAD: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
}

/// This thread's shard, and whether it owns it alone.
#[inline]
fn my_shard() -> (usize, bool) {
    // `try_with`: during thread exit (magazines emptied by TLS destructors)
    // this thread's id may be gone; the shared shard then takes the update.
    let n = THREAD
        .try_with(|t| {
            let v = t.get();
            if v != usize::MAX {
                return v;
            }
            let v = NEXT_THREAD.fetch_add(1, Relaxed);
            t.set(v);
            v
        })
        .unwrap_or(usize::MAX);
    if n < SHARDS - 1 {
        (n, true)
    } else {
        (SHARDS - 1, false)
    }
}

/// Adds to a counter: a plain load and store for a shard's only writer,
/// `fetch_add` for a shared shard.
#[inline]
fn bump(c: &AtomicI64, delta: i64, exclusive: bool) -> i64 {
    if exclusive {
        let v = c.load(Relaxed) + delta;
        c.store(v, Relaxed);
        v
    } else {
        c.fetch_add(delta, Relaxed) + delta
    }
}

/// One shard of hot counters.
#[derive(Debug, Default)]
pub(crate) struct Shard {
    pub allocated: AtomicI64,
    pub active: AtomicI64,
    pub allocs: AtomicI64,
    pub frees: AtomicI64,
    /// Bytes of slots held in this thread's magazines.
    pub magazine: AtomicI64,
    /// This shard's own high-water mark of `active`.
    high: AtomicI64,
}

/// All counters of one pool.
#[derive(Debug)]
pub(crate) struct Counters {
    shards: Box<[CachePadded<Shard>]>,
    pub peak_allocated: AtomicU64,
    pub peak_active: AtomicU64,
    pub peak_reserved: AtomicU64,
    pub peak_cached: AtomicU64,
    pub peak_pending: AtomicU64,
    pub retries: AtomicU64,
    pub ooms: AtomicU64,
    pub oom_waits: AtomicU64,
    pub oom_host_syncs: AtomicU64,
    pub pending_frees: AtomicU64,
    pub handovers: AtomicU64,
    pub grown: AtomicU64,
    /// Bytes of small slots on the pending list.
    pub pending_slot_bytes: AtomicU64,
    /// Peak of `active` since the last [`Counters::start_window`] (the idle
    /// release policy's measure of what the last busy period needed).
    pub window_peak_active: AtomicU64,
}

impl Counters {
    pub(crate) fn new() -> Counters {
        Counters {
            shards: (0..SHARDS)
                .map(|_| CachePadded::new(Shard::default()))
                .collect(),
            peak_allocated: AtomicU64::new(0),
            peak_active: AtomicU64::new(0),
            peak_reserved: AtomicU64::new(0),
            peak_cached: AtomicU64::new(0),
            peak_pending: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            ooms: AtomicU64::new(0),
            oom_waits: AtomicU64::new(0),
            oom_host_syncs: AtomicU64::new(0),
            pending_frees: AtomicU64::new(0),
            handovers: AtomicU64::new(0),
            grown: AtomicU64::new(0),
            pending_slot_bytes: AtomicU64::new(0),
            window_peak_active: AtomicU64::new(0),
        }
    }

    /// Counts an allocation of `requested` bytes taking `rounded` bytes.
    #[inline]
    pub(crate) fn on_alloc(&self, requested: u64, rounded: u64) {
        let (i, own) = my_shard();
        let s = &self.shards[i];
        bump(&s.allocs, 1, own);
        bump(&s.allocated, requested as i64, own);
        let now = bump(&s.active, rounded as i64, own);
        if now > s.high.load(Relaxed) {
            s.high.fetch_max(now, Relaxed);
            self.sample_peaks();
        }
    }

    /// Counts a free.
    #[inline]
    pub(crate) fn on_free(&self, requested: u64, rounded: u64) {
        let (i, own) = my_shard();
        let s = &self.shards[i];
        bump(&s.frees, 1, own);
        bump(&s.allocated, -(requested as i64), own);
        bump(&s.active, -(rounded as i64), own);
    }

    /// Counts bytes entering (+) or leaving (-) this thread's magazines.
    #[inline]
    pub(crate) fn on_magazine(&self, delta: i64) {
        let (i, own) = my_shard();
        bump(&self.shards[i].magazine, delta, own);
    }

    /// Bytes held in all threads' magazines.
    pub(crate) fn magazine_bytes(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| s.magazine.load(Relaxed))
            .sum::<i64>()
            .max(0) as u64
    }

    /// Sums of (allocated, active, allocs, frees) over shards.
    pub(crate) fn totals(&self) -> (u64, u64, u64, u64) {
        let (mut al, mut ac, mut n, mut f) = (0i64, 0i64, 0i64, 0i64);
        for s in self.shards.iter() {
            al += s.allocated.load(Relaxed);
            ac += s.active.load(Relaxed);
            n += s.allocs.load(Relaxed);
            f += s.frees.load(Relaxed);
        }
        (
            al.max(0) as u64,
            ac.max(0) as u64,
            n.max(0) as u64,
            f.max(0) as u64,
        )
    }

    /// Folds the current totals into the peaks.
    pub(crate) fn sample_peaks(&self) {
        let (al, ac, _, _) = self.totals();
        self.peak_allocated.fetch_max(al, Relaxed);
        self.peak_active.fetch_max(ac, Relaxed);
        self.window_peak_active.fetch_max(ac, Relaxed);
    }

    /// Starts a new peak window: the window peak becomes the current
    /// `active` total, and every shard's high-water mark drops to its
    /// current value so that the window's new highs are sampled again. The
    /// all-time peaks are untouched. Called by the maintenance thread when
    /// the pool goes idle, never on the fast path; a race with a shard's
    /// owner only makes one sample early or late.
    pub(crate) fn start_window(&self) -> u64 {
        for s in self.shards.iter() {
            s.high.store(s.active.load(Relaxed), Relaxed);
        }
        let (_, ac, _, _) = self.totals();
        self.window_peak_active.store(ac, Relaxed);
        ac
    }

    /// Resets every peak to the current value.
    pub(crate) fn reset_peaks(&self, reserved: u64, cached: u64, pending: u64) {
        let (al, ac, _, _) = self.totals();
        self.peak_allocated.store(al, Relaxed);
        self.peak_active.store(ac, Relaxed);
        self.peak_reserved.store(reserved, Relaxed);
        self.peak_cached.store(cached, Relaxed);
        self.peak_pending.store(pending, Relaxed);
        for s in self.shards.iter() {
            s.high.store(s.active.load(Relaxed), Relaxed);
        }
    }
}
