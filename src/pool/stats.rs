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

use super::thread_state::{my_shard, SHARDS};
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

/// A snapshot of one pool's statistics. The byte figures mean what
/// PyTorch's `torch.cuda.memory_stats()` means by the same names:
/// `requested_bytes` (sizes asked for) <= `allocated_bytes` (their rounded
/// sizes) <= `active_bytes` (plus freed blocks not yet reusable) <=
/// `reserved_bytes` (device memory held); and
/// `reserved + paused = allocated + pending + cached + overhead`, exactly.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct PoolStats {
    /// Device index.
    pub device: usize,
    /// Sizes asked for by the live blocks (PyTorch's `requested_bytes`).
    pub requested_bytes: Stat,
    /// Rounded sizes of the live blocks (slot or range sizes; PyTorch's
    /// `allocated_bytes`).
    pub allocated_bytes: Stat,
    /// Live blocks plus blocks freed but not yet reusable because their
    /// last use on some stream may still run: `allocated + pending`
    /// (PyTorch's `active_bytes`).
    pub active_bytes: Stat,
    /// Device memory held by the pool (physical chunks plus plain segments;
    /// PyTorch's `reserved_bytes`).
    pub reserved_bytes: Stat,
    /// Reserved bytes free for reuse now (free slots, free mapped ranges,
    /// spare chunks).
    pub cached_bytes: Stat,
    /// Freed bytes waiting for their last use to complete.
    pub pending_bytes: Stat,
    /// Reserved bytes no block can use (slab tails).
    pub overhead_bytes: u64,
    /// Rounded bytes of paused blocks ([`DevicePool::pause`](crate::DevicePool::pause)):
    /// live and counted in `allocated_bytes`, but their physical memory went
    /// back to the device (not in `reserved_bytes`).
    pub paused_bytes: u64,
    /// Free memory that cannot go back to the device without moving live
    /// blocks (PyTorch's `inactive_split_bytes`, "inactive, non-releasable"):
    /// free slots and free mapped ranges that share a slab or a granule
    /// with live or pending memory, i.e. the cached bytes that
    /// [`DevicePool::trim`](crate::DevicePool::trim) keeps.
    pub inactive_split_bytes: Stat,
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
    #[serde(skip_serializing)]
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
    /// Harvests that found pending records. Diagnostics, as
    /// `heap_lock_acquisitions` is.
    #[serde(skip_serializing)]
    pub num_harvests: u64,
    /// Of those, the ones that walked the records; the rest were skipped,
    /// as nothing could have completed since the last walk (`HarvestGate`).
    #[serde(skip_serializing)]
    pub num_harvest_walks: u64,
    /// Small allocations that found no slot in the thread's magazine nor
    /// the stream's stacks and took the slow path (other streams' idle
    /// slots, a harvest, a new slab, ...). Diagnostics: in steady state on
    /// one stream, nearly none.
    pub num_small_slow_paths: u64,
    /// Large allocations that neither the stream's parked ranges nor the
    /// heap's backed memory served at once, and took the slow path
    /// (unparking, reclaim, handover, growth, stitching).
    pub num_large_slow_paths: u64,
    /// Reclaim passes: each flushes every stream's dirty memory (small
    /// slots and heap ranges, one event per busy stream), harvests and
    /// retires empty slabs. Run by allocations that missed (large ones
    /// before growing, any at capacity), compaction and `pause`.
    pub num_reclaims: u64,
    /// Host-blocking syncs made on this device so far (by anyone).
    pub host_syncs: u64,
    /// `(reserved - requested) / reserved`, 0 when nothing is reserved.
    pub fragmentation: f64,
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
    /// Requested bytes of live blocks.
    pub requested: AtomicI64,
    /// Rounded bytes of live blocks.
    pub allocated: AtomicI64,
    pub allocs: AtomicI64,
    pub frees: AtomicI64,
    /// `allocated` plus the bytes of slots in this thread's magazines.
    /// The magazine figure is `held - allocated`: a slot moving between a
    /// magazine and a live block (the fast lane) changes `allocated`
    /// alone, one counter update fewer per allocation and per free.
    pub held: AtomicI64,
    /// This shard's own high-water mark of `allocated`.
    high: AtomicI64,
}

/// All counters of one pool.
#[derive(Debug)]
pub(crate) struct Counters {
    shards: Box<[CachePadded<Shard>; SHARDS]>,
    pub peak_requested: AtomicU64,
    pub peak_allocated: AtomicU64,
    pub peak_active: AtomicU64,
    pub peak_inactive_split: AtomicU64,
    pub peak_reserved: AtomicU64,
    pub peak_cached: AtomicU64,
    pub peak_pending: AtomicU64,
    pub retries: AtomicU64,
    pub ooms: AtomicU64,
    pub oom_waits: AtomicU64,
    pub oom_host_syncs: AtomicU64,
    pub pending_frees: AtomicU64,
    pub handovers: AtomicU64,
    pub harvests: AtomicU64,
    pub harvest_walks: AtomicU64,
    pub small_slow: AtomicU64,
    pub large_slow: AtomicU64,
    pub reclaims: AtomicU64,
    pub grown: AtomicU64,
    /// Bytes of small slots on the pending list.
    pub pending_slot_bytes: AtomicU64,
    /// Peak of rounded live bytes (`allocated`) since the last
    /// [`Counters::take_window`] (the idle release policy's measure of
    /// what the last busy period needed).
    pub window_peak_active: AtomicU64,
}

impl Counters {
    pub(crate) fn new() -> Counters {
        Counters {
            shards: (0..SHARDS)
                .map(|_| CachePadded::new(Shard::default()))
                .collect::<Box<[_]>>()
                .try_into()
                .expect("SHARDS shards"),
            peak_requested: AtomicU64::new(0),
            peak_allocated: AtomicU64::new(0),
            peak_active: AtomicU64::new(0),
            peak_inactive_split: AtomicU64::new(0),
            peak_reserved: AtomicU64::new(0),
            peak_cached: AtomicU64::new(0),
            peak_pending: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            ooms: AtomicU64::new(0),
            oom_waits: AtomicU64::new(0),
            oom_host_syncs: AtomicU64::new(0),
            pending_frees: AtomicU64::new(0),
            handovers: AtomicU64::new(0),
            harvests: AtomicU64::new(0),
            harvest_walks: AtomicU64::new(0),
            small_slow: AtomicU64::new(0),
            large_slow: AtomicU64::new(0),
            reclaims: AtomicU64::new(0),
            grown: AtomicU64::new(0),
            pending_slot_bytes: AtomicU64::new(0),
            window_peak_active: AtomicU64::new(0),
        }
    }

    /// Counts an allocation of `requested` bytes taking `rounded` bytes.
    #[inline]
    pub(crate) fn on_alloc(&self, requested: u64, rounded: u64) {
        self.on_alloc_from(requested, rounded, false);
    }

    /// [`Counters::on_alloc`]; with `magazine`, the slot left this
    /// thread's magazine (one shard lookup for both counts).
    #[inline]
    pub(crate) fn on_alloc_from(&self, requested: u64, rounded: u64, magazine: bool) {
        let (i, own) = my_shard();
        self.on_alloc_in((i, own), requested, rounded, magazine);
    }

    /// [`Counters::on_alloc_from`] in shard `i` (`own`: this thread owns
    /// it), for a caller that knows its shard (a magazine caches it).
    #[inline(always)]
    pub(crate) fn on_alloc_in(
        &self,
        (i, own): (usize, bool),
        requested: u64,
        rounded: u64,
        magazine: bool,
    ) {
        let s = self.shard(i);
        if !magazine {
            bump(&s.held, rounded as i64, own);
        }
        bump(&s.allocs, 1, own);
        bump(&s.requested, requested as i64, own);
        let now = bump(&s.allocated, rounded as i64, own);
        if now > s.high.load(Relaxed) {
            s.high.fetch_max(now, Relaxed);
            self.sample_peaks();
        }
    }

    /// Counts a free.
    #[inline]
    pub(crate) fn on_free(&self, requested: u64, rounded: u64) {
        self.on_free_to(requested, rounded, false);
    }

    /// [`Counters::on_free`]; with `magazine`, the slot went into this
    /// thread's magazine (one shard lookup for both counts).
    #[inline]
    pub(crate) fn on_free_to(&self, requested: u64, rounded: u64, magazine: bool) {
        self.on_free_in(my_shard(), requested, rounded, magazine);
    }

    /// [`Counters::on_free_to`] in shard `i` (see [`Counters::on_alloc_in`]).
    #[inline]
    pub(crate) fn on_free_in(
        &self,
        (i, own): (usize, bool),
        requested: u64,
        rounded: u64,
        magazine: bool,
    ) {
        let s = self.shard(i);
        bump(&s.frees, 1, own);
        bump(&s.requested, -(requested as i64), own);
        bump(&s.allocated, -(rounded as i64), own);
        if !magazine {
            bump(&s.held, -(rounded as i64), own);
        }
    }

    /// Shard `i` (a shard id, below [`SHARDS`]: the mask only spares the
    /// bounds check on the fast path).
    #[inline(always)]
    fn shard(&self, i: usize) -> &Shard {
        &self.shards[i & (SHARDS - 1)]
    }

    /// Counts bytes entering (+) or leaving (-) this thread's magazines.
    #[inline]
    pub(crate) fn on_magazine(&self, delta: i64) {
        let (i, own) = my_shard();
        bump(&self.shard(i).held, delta, own);
    }

    /// Bytes held in all threads' magazines.
    pub(crate) fn magazine_bytes(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| s.held.load(Relaxed) - s.allocated.load(Relaxed))
            .sum::<i64>()
            .max(0) as u64
    }

    /// Sums of (requested, allocated, allocs, frees) over shards: the
    /// requested and the rounded bytes of live blocks, and the counts.
    pub(crate) fn totals(&self) -> (u64, u64, u64, u64) {
        let (mut al, mut ac, mut n, mut f) = (0i64, 0i64, 0i64, 0i64);
        for s in self.shards.iter() {
            al += s.requested.load(Relaxed);
            ac += s.allocated.load(Relaxed);
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
        let (rq, al, _, _) = self.totals();
        self.peak_requested.fetch_max(rq, Relaxed);
        self.peak_allocated.fetch_max(al, Relaxed);
        self.window_peak_active.fetch_max(al, Relaxed);
    }

    /// Ends the peak window and starts the next: returns the ended
    /// window's peak, and the new window starts at the current `allocated`
    /// total, with every shard's high-water mark dropped to its current
    /// value so that the window's new highs are sampled again. The
    /// all-time peaks are untouched. Called by the maintenance thread when
    /// the pool goes idle, never on the fast path.
    ///
    /// No high is lost to a concurrent allocation: one that raises its
    /// shard's mark before the marks drop folds into the window that the
    /// swap below ends; one after, into the new window (or both). A load
    /// and a separate store would drop a high reached between them, and
    /// the idle release policy would then give back what the busy period
    /// had just needed.
    pub(crate) fn take_window(&self) -> u64 {
        self.sample_peaks();
        for s in self.shards.iter() {
            s.high.store(s.allocated.load(Relaxed), Relaxed);
        }
        let (_, now, _, _) = self.totals();
        self.window_peak_active.swap(now, Relaxed).max(now)
    }

    /// Allocations plus frees so far, summed over the shards.
    pub(crate) fn traffic(&self) -> u64 {
        let (_, _, allocs, frees) = self.totals();
        allocs + frees
    }

    /// Resets every peak to the current value (PyTorch's
    /// `reset_peak_memory_stats`): the byte figures the caller read under
    /// the same snapshot, and the live totals read here.
    pub(crate) fn reset_peaks(&self, now: &PeakReset) {
        let (rq, al, _, _) = self.totals();
        self.peak_requested.store(rq, Relaxed);
        self.peak_allocated.store(al, Relaxed);
        self.peak_active.store(now.active, Relaxed);
        self.peak_inactive_split.store(now.inactive_split, Relaxed);
        self.peak_reserved.store(now.reserved, Relaxed);
        self.peak_cached.store(now.cached, Relaxed);
        self.peak_pending.store(now.pending, Relaxed);
        for s in self.shards.iter() {
            s.high.store(s.allocated.load(Relaxed), Relaxed);
        }
    }
}

/// The current byte figures [`Counters::reset_peaks`] starts the peaks from.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PeakReset {
    pub active: u64,
    pub inactive_split: u64,
    pub reserved: u64,
    pub cached: u64,
    pub pending: u64,
}

impl PeakReset {
    /// The current figures of `s`.
    pub(crate) fn of(s: &PoolStats) -> PeakReset {
        PeakReset {
            active: s.active_bytes.current,
            inactive_split: s.inactive_split_bytes.current,
            reserved: s.reserved_bytes.current,
            cached: s.cached_bytes.current,
            pending: s.pending_bytes.current,
        }
    }
}

/// The byte figures of one pool read now, from which [`Counters::derive`]
/// makes a [`PoolStats`].
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Figures {
    pub device: usize,
    /// Requested bytes of live blocks.
    pub requested: u64,
    /// Rounded bytes of live blocks.
    pub allocated: u64,
    pub reserved: u64,
    pub pending: u64,
    pub cached: u64,
    pub overhead: u64,
    /// Cached bytes that cannot be given back without moving live blocks.
    pub inactive_split: u64,
    /// Rounded bytes of paused blocks (allocated, not reserved).
    pub paused: u64,
}

impl Counters {
    /// Folds `f` into the peaks and makes the statistics: every byte
    /// figure with its peak, and the counters this struct keeps (the
    /// caller fills in the counts kept elsewhere).
    pub(crate) fn derive(&self, f: &Figures) -> PoolStats {
        self.sample_peaks();
        let active = f.allocated + f.pending;
        self.peak_active.fetch_max(active, Relaxed);
        self.peak_inactive_split
            .fetch_max(f.inactive_split, Relaxed);
        self.peak_reserved.fetch_max(f.reserved, Relaxed);
        self.peak_cached.fetch_max(f.cached, Relaxed);
        self.peak_pending.fetch_max(f.pending, Relaxed);
        let stat = |current, peak: &AtomicU64| Stat {
            current,
            peak: peak.load(Relaxed).max(current),
        };
        PoolStats {
            device: f.device,
            requested_bytes: stat(f.requested, &self.peak_requested),
            allocated_bytes: stat(f.allocated, &self.peak_allocated),
            active_bytes: stat(active, &self.peak_active),
            reserved_bytes: stat(f.reserved, &self.peak_reserved),
            cached_bytes: stat(f.cached, &self.peak_cached),
            pending_bytes: stat(f.pending, &self.peak_pending),
            overhead_bytes: f.overhead,
            paused_bytes: f.paused,
            inactive_split_bytes: stat(f.inactive_split, &self.peak_inactive_split),
            num_allocs_grown: self.grown.load(Relaxed),
            num_alloc_retries: self.retries.load(Relaxed),
            num_ooms: self.ooms.load(Relaxed),
            num_oom_waits: self.oom_waits.load(Relaxed),
            oom_host_syncs: self.oom_host_syncs.load(Relaxed),
            num_pending_frees: self.pending_frees.load(Relaxed),
            num_handovers: self.handovers.load(Relaxed),
            num_harvests: self.harvests.load(Relaxed),
            num_harvest_walks: self.harvest_walks.load(Relaxed),
            num_small_slow_paths: self.small_slow.load(Relaxed),
            num_large_slow_paths: self.large_slow.load(Relaxed),
            num_reclaims: self.reclaims.load(Relaxed),
            fragmentation: if f.reserved == 0 {
                0.0
            } else {
                (f.reserved - f.requested.min(f.reserved)) as f64 / f.reserved as f64
            },
            ..PoolStats::default()
        }
    }
}

impl PoolStats {
    /// The statistics as `torch.cuda.memory_stats()` gives them: flat keys
    /// such as `allocated_bytes.all.current`, sorted, with PyTorch's
    /// meanings. The byte figures are `requested_bytes`, `allocated_bytes`,
    /// `active_bytes`, `reserved_bytes` and `inactive_split_bytes` (each
    /// `.all.current` and `.all.peak`); the counts are
    /// `allocation.all.{current,allocated,freed}`, `num_alloc_retries`,
    /// `num_ooms`, `num_device_alloc` and `num_device_free`. gpupool's own
    /// figures follow under the same scheme (`cached_bytes.all.*`,
    /// `pending_bytes.all.*`, `overhead_bytes.all.current`,
    /// `paused_bytes.all.current`,
    /// `num_oom_waits`, `num_pending_frees`, `num_handovers`,
    /// `num_small_slow_paths`, `num_large_slow_paths`, `num_reclaims`,
    /// `host_syncs`). PyTorch's `large_pool`/`small_pool` splits and the
    /// cumulative `.allocated`/`.freed` byte counts are not kept.
    pub fn memory_stats(&self) -> std::collections::BTreeMap<String, u64> {
        let mut m = std::collections::BTreeMap::new();
        for (name, s) in [
            ("requested_bytes", self.requested_bytes),
            ("allocated_bytes", self.allocated_bytes),
            ("active_bytes", self.active_bytes),
            ("reserved_bytes", self.reserved_bytes),
            ("inactive_split_bytes", self.inactive_split_bytes),
            ("cached_bytes", self.cached_bytes),
            ("pending_bytes", self.pending_bytes),
        ] {
            m.insert(format!("{name}.all.current"), s.current);
            m.insert(format!("{name}.all.peak"), s.peak);
        }
        m.insert("overhead_bytes.all.current".into(), self.overhead_bytes);
        m.insert("paused_bytes.all.current".into(), self.paused_bytes);
        let live = self.num_allocs.saturating_sub(self.num_frees);
        m.insert("allocation.all.current".into(), live);
        m.insert("allocation.all.allocated".into(), self.num_allocs);
        m.insert("allocation.all.freed".into(), self.num_frees);
        for (k, v) in [
            ("num_alloc_retries", self.num_alloc_retries),
            ("num_ooms", self.num_ooms),
            ("num_device_alloc", self.num_device_allocs),
            ("num_device_free", self.num_device_frees),
            ("num_oom_waits", self.num_oom_waits),
            ("num_pending_frees", self.num_pending_frees),
            ("num_handovers", self.num_handovers),
            ("num_small_slow_paths", self.num_small_slow_paths),
            ("num_large_slow_paths", self.num_large_slow_paths),
            ("num_reclaims", self.num_reclaims),
            ("host_syncs", self.host_syncs),
        ] {
            m.insert(k.into(), v);
        }
        m
    }
}

impl super::PoolShared {
    /// The pool's statistics now (see [`PoolStats`]).
    pub(super) fn stats(&self) -> PoolStats {
        let (requested, allocated, allocs, frees) = self.counters.totals();
        let (reserved, heap_pending, overhead, device_allocs, device_frees, releasable, paused) = {
            let h = self.heap.lock_quiet();
            let f = h.heap.figures();
            (
                f.reserved,
                f.free_pending,
                h.slab_tail_bytes,
                h.heap.device_allocs,
                h.heap.device_frees,
                h.heap.releasable_bytes(),
                f.paused,
            )
        };
        let pending = heap_pending
            + self.counters.pending_slot_bytes.load(Relaxed)
            + self.movable.held_bytes()
            + self.plans.fenced_bytes();
        // Paused blocks are allocated but hold no device memory.
        let cached = (reserved + paused).saturating_sub(allocated + pending + overhead);
        let figures = Figures {
            device: self.dev,
            requested,
            allocated,
            reserved,
            pending,
            cached,
            overhead,
            inactive_split: cached.saturating_sub(releasable),
            paused,
        };
        PoolStats {
            num_allocs: allocs,
            num_frees: frees,
            num_device_allocs: device_allocs,
            num_device_frees: device_frees,
            heap_lock_acquisitions: self.heap.acquisitions(),
            host_syncs: self.backend.counters().host_syncs_of(self.dev),
            ..self.counters.derive(&figures)
        }
    }
}
