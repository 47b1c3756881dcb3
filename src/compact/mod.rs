//! Compaction: movable blocks, the pass planner, and on-demand and
//! idle-time defragmentation.
//!
//! ```text
//!  alloc_movable(size, s) ─► MovableBlock (a handle: index + generation)
//!        pin(s) ─► Pinned { ptr }  (in place until s passes the unpin)
//!  compact(opts) / maintain() after idle_ms
//!        plan (under the arena lock): close sparse regions, reserve
//!        destinations by best fit in the others, mark the blocks moving
//!        enqueue: compaction stream waits on each block's last-use events,
//!        one enqueue_moves batch, a completion event
//!        commit (once that event completed, checked without blocking):
//!        swap handle addresses, free the old ranges, give emptied regions
//!        back to the heap (and, with compact_release, to the device)
//! ```
//!
//! Only blocks from [`DevicePool::alloc_movable`] up to a quarter region
//! (512 KiB with 2 MiB granules) ever move; `alloc`, `alloc_raw`, the C ABI
//! and larger movable requests never do. `docs/ARCHITECTURE.md` gives the
//! safety argument step by step.
//!
//! Concurrency: the arena is one mutex per device, held for the planning
//! and enqueueing of a pass (a few non-blocking driver calls), for each
//! movable alloc/free/pin/unpin, and never while the device copies. A pin
//! on a block that an in-flight pass is moving *cancels* that block's move:
//! the pin gets the current (old) address, and the commit frees the
//! reserved destination instead of swapping. A block freed during a pass is
//! freed from its current range as usual; the commit sees its generation
//! changed and frees the destination.

pub(crate) mod arena;
pub mod fragment;
mod movable;
mod pass;
pub(crate) mod planner;

pub use crate::pool::CompactReport;
pub use movable::{MovableBlock, Pinned};

use crate::error::Result;
use crate::pool::{DevicePool, MovableArena, PoolShared};
use arena::ArenaState;
use parking_lot::{Mutex, MutexGuard};
use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// The movable arena of one pool: its state behind a mutex, and the held
/// bytes (pending frees and reserved destinations) readable without it.
#[derive(Debug)]
pub(crate) struct Arena {
    state: Mutex<ArenaState>,
    held: AtomicU64,
}

/// A locked arena; publishes the held bytes for `stats()` when dropped.
pub(crate) struct ArenaGuard<'a> {
    st: MutexGuard<'a, ArenaState>,
    held: &'a AtomicU64,
}

impl std::ops::Deref for ArenaGuard<'_> {
    type Target = ArenaState;
    fn deref(&self) -> &ArenaState {
        &self.st
    }
}

impl std::ops::DerefMut for ArenaGuard<'_> {
    fn deref_mut(&mut self) -> &mut ArenaState {
        &mut self.st
    }
}

impl Drop for ArenaGuard<'_> {
    fn drop(&mut self) {
        self.held.store(self.st.held_total, Relaxed);
    }
}

impl Arena {
    /// An empty arena whose regions are `region_bytes` (a power of two).
    pub(crate) fn new(region_bytes: u64) -> Arena {
        Arena {
            state: Mutex::new(ArenaState::new(region_bytes)),
            held: AtomicU64::new(0),
        }
    }

    pub(crate) fn lock(&self) -> ArenaGuard<'_> {
        ArenaGuard {
            st: self.state.lock(),
            held: &self.held,
        }
    }
}

/// The pool's paths (stats, audit, trim, teardown, maintenance) reach the
/// arena through the interface the pool defines.
impl MovableArena for Arena {
    fn held_bytes(&self) -> u64 {
        self.held.load(Relaxed)
    }

    fn audit(&self) -> std::result::Result<(u64, u64, u64, u64), String> {
        let st = self.lock();
        st.check()?;
        let f = st.figures();
        if f.2 != self.held.load(Relaxed) {
            return Err("published held bytes drifted".into());
        }
        Ok(f)
    }

    fn teardown(&self, pool: &PoolShared) {
        let mut st = self.lock();
        pass::sync_all(pool, &mut st);
        if let Some(s) = st.stream.take() {
            let _ = pool.be().destroy_stream(pool.dev(), s);
        }
        for e in st.entries.iter_mut() {
            for (_, ev) in e.last_use.drain(..) {
                pool.recycle_event(ev);
            }
        }
    }

    fn trim(&self, pool: &PoolShared) {
        pass::sync_all(pool, &mut self.lock());
    }

    fn service(&self, pool: &PoolShared) -> CompactReport {
        let t0 = Instant::now();
        let s = pass::service(pool, &mut self.lock());
        CompactReport {
            blocks_moved: s.blocks_moved,
            bytes_moved: s.bytes_moved,
            moves_cancelled: s.cancelled,
            regions_released: s.regions_released,
            committed: s.committed,
            duration: t0.elapsed(),
            ..Default::default()
        }
    }

    fn idle_pass(&self, pool: &PoolShared) -> Result<CompactReport> {
        let opts = CompactOptions {
            wait: false,
            ..CompactOptions::from_config(pool.cfg())
        };
        run(pool, opts)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The movable arena of `pool`, installed in the pool's slot on first use.
pub(crate) fn arena_of(pool: &PoolShared) -> &Arena {
    pool.movable()
        .get_or_install(|region_bytes| Box::new(Arena::new(region_bytes)))
        .as_any()
        .downcast_ref::<Arena>()
        .expect("only compaction installs a pool's movable arena")
}

/// Options of one compaction pass ([`DevicePool::compact`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompactOptions {
    /// Most bytes the pass moves (`compact_max_bytes`).
    pub max_bytes: u64,
    /// Most blocks the pass moves (`compact_max_blocks`).
    pub max_blocks: usize,
    /// Give the memory the pass empties back to the device
    /// (`compact_release`); otherwise it stays cached in the pool. The
    /// pass keeps this choice when another call (a later `compact`,
    /// `maintain`) commits it.
    pub release: bool,
    /// Block the host until an earlier pass in flight completed, then
    /// until this pass's moves complete, and commit them before returning.
    /// Without it nothing waits: the pass commits at a later `compact`,
    /// `maintain` or movable allocation that finds its event complete.
    /// (Either way, memory of freed blocks whose last uses are still queued
    /// is not free room yet for this pass.)
    pub wait: bool,
}

impl Default for CompactOptions {
    /// The defaults of [`crate::PoolConfig`], waiting for the pass.
    fn default() -> Self {
        let c = crate::PoolConfig::default();
        CompactOptions {
            max_bytes: c.compact_max_bytes,
            max_blocks: c.compact_max_blocks,
            release: c.compact_release,
            wait: true,
        }
    }
}

impl CompactOptions {
    /// The bounds and release policy of a pool's configuration.
    pub fn from_config(cfg: &crate::PoolConfig) -> Self {
        CompactOptions {
            max_bytes: cfg.compact_max_bytes,
            max_blocks: cfg.compact_max_blocks,
            release: cfg.compact_release,
            wait: true,
        }
    }
}

/// Lifetime totals of a pool's compaction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CompactTotals {
    /// Passes committed.
    pub passes: u64,
    /// Bytes and blocks moved by them.
    pub bytes_moved: u64,
    /// See `bytes_moved`.
    pub blocks_moved: u64,
    /// Moves cancelled by pins or frees.
    pub moves_cancelled: u64,
    /// Regions given back to the heap by passes.
    pub regions_released: u64,
}

/// Bytes of movable memory now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct MovableUsage {
    /// Regions held by the movable arena.
    pub regions: u64,
    /// Bytes of those regions.
    pub region_bytes: u64,
    /// Rounded bytes of live movable blocks in them.
    pub live_bytes: u64,
}

impl DevicePool {
    /// Runs one bounded compaction pass now (see the module docs of
    /// [`crate::compact`]). First commits a finished earlier pass. With
    /// `opts.wait` (the default) the host waits for the pass's moves — this
    /// explicit call is, like `trim`, allowed to block — and commits them;
    /// allocations, frees and pins on other threads are never blocked
    /// longer than the planning step.
    pub fn compact(&self, opts: CompactOptions) -> Result<CompactReport> {
        if self.capture_underway() {
            return Err(crate::error::Error::InvalidArgument(format!(
                "compaction while a CUDA graph capture is underway on device {}",
                self.device()
            )));
        }
        run(self.shared(), opts)
    }

    /// Lifetime compaction totals of this pool.
    pub fn compact_totals(&self) -> CompactTotals {
        let t = arena_of(self.shared()).lock().totals;
        CompactTotals {
            passes: t.passes,
            bytes_moved: t.bytes_moved,
            blocks_moved: t.blocks_moved,
            moves_cancelled: t.cancelled,
            regions_released: t.regions_released,
        }
    }

    /// Movable memory now.
    pub fn movable_usage(&self) -> MovableUsage {
        let st = arena_of(self.shared()).lock();
        let (region_bytes, live, _, _) = st.figures();
        MovableUsage {
            regions: st.regions.len() as u64,
            region_bytes,
            live_bytes: live,
        }
    }
}

/// One [`DevicePool::compact`] call on `shared`.
fn run(shared: &PoolShared, opts: CompactOptions) -> Result<CompactReport> {
    shared.ensure_live()?;
    let t0 = Instant::now();
    let reserved0 = shared.reserved_now();
    let arena = arena_of(shared);
    let mut r = CompactReport::default();
    let budget = planner::Budget {
        max_bytes: opts.max_bytes,
        max_blocks: opts.max_blocks,
    };
    let mut st = arena.lock();
    if opts.wait {
        if let Some(p) = &st.pass {
            // Finish the earlier pass first, so that this call can run
            // one. The lock is not held while the host waits. (Frees
            // whose last uses are still queued are not waited for: that
            // would tie this call to the users' streams.)
            let ev = p.done;
            drop(st);
            pass::sync_pass(shared, ev)?;
            st = arena.lock();
        }
    }
    absorb(&mut r, pass::service(shared, &mut st));
    let started = pass::start(shared, &mut st, budget, opts.release)?;
    if let Some(s) = started {
        r.blocks_planned = s.blocks;
        r.bytes_planned = s.bytes;
        if opts.wait {
            let ev = st.pass.as_ref().expect("just started").done;
            drop(st);
            pass::sync_pass(shared, ev)?;
            st = arena.lock();
            absorb(&mut r, pass::service(shared, &mut st));
        }
    }
    r.in_flight = st.pass.is_some();
    drop(st);
    // The regions emptied by passes that asked for it (this one's, if it
    // committed, or an earlier one's committed here).
    if r.regions_released > 0 {
        shared.release_cached_memory();
    }
    r.bytes_released = reserved0.saturating_sub(shared.reserved_now());
    r.duration = t0.elapsed();
    Ok(r)
}

fn absorb(r: &mut CompactReport, s: pass::Serviced) {
    r.blocks_moved += s.blocks_moved;
    r.bytes_moved += s.bytes_moved;
    r.moves_cancelled += s.cancelled;
    r.regions_released += s.regions_released;
    r.committed |= s.committed;
}
