//! The fragmentation workload: fragment a simulated device, then compact it
//! under concurrent load, verifying every byte.
//!
//! 1. **Fragment.** Allocate `blocks` movable blocks of log-uniform random
//!    sizes, write a pattern unique to each (a delayed simulated kernel
//!    under a pin), then free a random half. Reserved memory stays at the
//!    peak while live bytes halve.
//! 2. **Compact under load.** The calling thread runs `passes` bounded
//!    passes (`compact()` with `pass_blocks` blocks at most, waiting for
//!    each), while `load_threads` threads keep allocating, writing,
//!    verifying and freeing movable blocks of their own on their own
//!    streams, and pin survivors of step 1 to verify them (cancelling their
//!    moves when a pass is moving them).
//! 3. **Finish.** Stop the load, free its blocks, wait for those frees
//!    (`trim`), run passes until one finds nothing, and measure again; then verify every survivor (a pin
//!    and a verify kernel each), wait, and read the simulator's integrity
//!    and fault counters, and audit the pool.

use super::{CompactOptions, MovableBlock};
use crate::backend::sim::SimBackend;
use crate::backend::Backend;
use crate::config::{PoolConfig, SimConfig};
use crate::error::Result;
use crate::pool::{DevicePool, Stream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Parameters of [`run`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct FragmentOptions {
    /// Simulated device memory.
    pub capacity_bytes: u64,
    /// Movable blocks allocated before half are freed.
    pub blocks: usize,
    /// Smallest and largest request (log-uniform in between).
    pub min_size: u64,
    /// See `min_size`.
    pub max_size: u64,
    /// Compaction passes run under load.
    pub passes: usize,
    /// Most blocks one pass moves.
    pub pass_blocks: usize,
    /// Threads making concurrent traffic during the passes.
    pub load_threads: usize,
    /// Seed of every random choice.
    pub seed: u64,
}

impl Default for FragmentOptions {
    fn default() -> Self {
        FragmentOptions {
            capacity_bytes: 8 << 30,
            blocks: 60_000,
            min_size: 1 << 10,
            max_size: 128 << 10,
            passes: 1000,
            pass_blocks: 16,
            load_threads: 2,
            seed: 1,
        }
    }
}

/// Live and reserved bytes at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Usage {
    /// Requested bytes of live blocks.
    pub live_bytes: u64,
    /// Device memory the pool holds.
    pub reserved_bytes: u64,
    /// `reserved_bytes / live_bytes`.
    pub ratio: f64,
}

/// What [`run`] measured.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct FragmentReport {
    /// The options used.
    pub options: Option<FragmentOptions>,
    /// After fragmenting, before any pass.
    pub before: Usage,
    /// After the passes, with the load's blocks freed.
    pub after: Usage,
    /// Bytes and blocks moved by all passes.
    pub bytes_moved: u64,
    /// See `bytes_moved`.
    pub blocks_moved: u64,
    /// Moves cancelled by pins of the load threads (or frees).
    pub moves_cancelled: u64,
    /// `compact()` calls made, and how many of them committed a pass that
    /// moved blocks.
    pub compact_calls: u64,
    /// See `compact_calls`.
    pub passes: u64,
    /// Of `passes`, those run while the load threads ran.
    pub passes_under_load: u64,
    /// Wall time of the passes that moved blocks (plan, device copy, commit).
    pub pass_us_mean: f64,
    /// See `pass_us_mean`.
    pub pass_us_p50: f64,
    /// See `pass_us_mean`.
    pub pass_us_max: f64,
    /// Operations of the load threads (allocations, pins, frees).
    pub load_ops: u64,
    /// Bytes that verify kernels found wrong (must be 0).
    pub integrity_errors: u64,
    /// Accesses of unmapped memory by simulated work (must be 0).
    pub device_faults: u64,
    /// The pool's audit after the run (`None`: passed).
    pub audit_error: Option<String>,
    /// Allocations, frees and load operations in all.
    pub ops: u64,
    /// Median `alloc_movable` latency of the fragmenting phase, ns.
    pub p50_ns: u64,
    /// 99th percentile of the same, ns.
    pub p99_ns: u64,
    /// Peak requested bytes.
    pub peak_live_bytes: u64,
    /// Peak device memory held.
    pub peak_reserved_bytes: u64,
    /// Host-blocking syncs the pool made while the fragmenting phase
    /// allocated and freed (must be 0).
    pub host_syncs_on_alloc_path: u64,
    /// Device memory still held after every block was freed and the pool
    /// trimmed (must be 0).
    pub leaked_bytes: u64,
}

/// xorshift64*: small and deterministic.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    /// Log-uniform in `lo..=hi`.
    fn size(&mut self, lo: u64, hi: u64) -> u64 {
        let (a, b) = ((lo as f64).ln(), (hi as f64).ln());
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        ((a + u * (b - a)).exp() as u64).clamp(lo, hi)
    }
}

fn sim_of(pool: &DevicePool) -> &SimBackend {
    pool.backend()
        .as_any()
        .downcast_ref::<SimBackend>()
        .expect("the workload runs on the simulator")
}

/// Pins `b` on `s` and enqueues a pattern write (or verify) of `seed`.
fn touch(
    pool: &DevicePool,
    b: &MovableBlock<'_>,
    s: &Stream,
    seed: u64,
    write: bool,
) -> Result<()> {
    let sim = sim_of(pool);
    let p = b.pin(s);
    let delay = Duration::from_micros(seed % 50);
    if write {
        sim.launch_write_pattern(
            pool.device(),
            s.handle(),
            p.ptr(),
            b.size() as u64,
            seed,
            delay,
        )
    } else {
        sim.launch_verify_pattern(
            pool.device(),
            s.handle(),
            p.ptr(),
            b.size() as u64,
            seed,
            delay,
        )
        .map(|_| ())
    }
}

fn usage(pool: &DevicePool) -> Usage {
    let s = pool.stats();
    let live = s.requested_bytes.current;
    let reserved = s.reserved_bytes.current;
    Usage {
        live_bytes: live,
        reserved_bytes: reserved,
        ratio: if live == 0 {
            0.0
        } else {
            reserved as f64 / live as f64
        },
    }
}

/// Runs the workload on a fresh one-device simulator.
pub fn run(opts: &FragmentOptions) -> Result<FragmentReport> {
    let be: Arc<dyn Backend> = Arc::new(SimBackend::new(SimConfig {
        devices: 1,
        capacity_bytes: opts.capacity_bytes,
        ..SimConfig::default()
    })?);
    let cfg = PoolConfig {
        compact_max_blocks: opts.pass_blocks,
        ..PoolConfig::default()
    };
    let pool = DevicePool::new(be.clone(), 0, cfg)?;
    let main = pool.new_stream()?;
    let mut rng = Rng::new(opts.seed);

    // 1. Fragment.
    let syncs_before = pool.stats().host_syncs;
    let mut alloc_ns = Vec::with_capacity(opts.blocks);
    let mut blocks: Vec<(MovableBlock<'_>, u64)> = Vec::with_capacity(opts.blocks);
    for i in 0..opts.blocks {
        let size = rng.size(opts.min_size, opts.max_size);
        let t = Instant::now();
        let b = pool.alloc_movable(size as usize, &main)?;
        alloc_ns.push(t.elapsed().as_nanos() as u64);
        let seed = opts.seed << 32 | i as u64;
        touch(&pool, &b, &main, seed, true)?;
        blocks.push((b, seed));
    }
    let mut survivors = Vec::with_capacity(opts.blocks / 2 + 1);
    for (b, seed) in blocks {
        if rng.below(2) == 0 {
            survivors.push((b, seed));
        }
    }
    let host_syncs_on_alloc_path = pool.stats().host_syncs - syncs_before;
    let freed = (opts.blocks - survivors.len()) as u64;
    // The writes must be done before other streams verify the blocks.
    be.sync_stream(0, main.handle())?;
    let before = usage(&pool);

    // 2. Compact under load.
    let stop = AtomicBool::new(false);
    let load_ops = AtomicU64::new(0);
    let mut rep = FragmentReport {
        options: Some(opts.clone()),
        before,
        ..Default::default()
    };
    let mut pass_us = Vec::new();
    let pass_opts = CompactOptions {
        max_blocks: opts.pass_blocks,
        ..CompactOptions::from_config(pool.config())
    };
    let load_result: Result<()> = std::thread::scope(|sc| {
        let mut handles = Vec::new();
        for t in 0..opts.load_threads {
            let (pool, survivors, stop, load_ops) = (&pool, &survivors, &stop, &load_ops);
            let seed = opts.seed ^ (t as u64 + 1) << 48;
            let (lo, hi) = (opts.min_size, opts.max_size);
            handles.push(sc.spawn(move || load(pool, survivors, stop, load_ops, seed, lo, hi)));
        }
        let run = (|| -> Result<()> {
            for _ in 0..opts.passes {
                let r = pool.compact(pass_opts)?;
                rep.compact_calls += 1;
                absorb(&mut rep, &r, &mut pass_us);
            }
            rep.passes_under_load = rep.passes;
            Ok(())
        })();
        stop.store(true, Relaxed);
        for h in handles {
            h.join().expect("load thread panicked")?;
        }
        run
    });
    load_result?;
    rep.load_ops = load_ops.load(Relaxed);

    // 3. Finish: passes until nothing moves, then measure and verify.
    // The load's last frees wait on its streams' final work: let them
    // complete (trim waits for pending frees), so the passes see that room.
    pool.trim()?;
    // Passes terminate (see `planner.rs`); the bound only guards the run.
    for _ in 0..100 * opts.blocks.max(100) {
        let r = pool.compact(pass_opts)?;
        rep.compact_calls += 1;
        absorb(&mut rep, &r, &mut pass_us);
        if r.blocks_planned == 0 && !r.in_flight {
            break;
        }
    }
    rep.after = usage(&pool);
    for (b, seed) in &survivors {
        touch(&pool, b, &main, *seed, false)?;
    }
    be.sync_stream(0, main.handle())?;
    let sim = sim_of(&pool);
    rep.integrity_errors = sim.integrity_errors(0);
    rep.device_faults = sim.device_faults(0);
    rep.audit_error = pool.audit().err();
    pass_us.sort_by(f64::total_cmp);
    if !pass_us.is_empty() {
        rep.pass_us_mean = pass_us.iter().sum::<f64>() / pass_us.len() as f64;
        rep.pass_us_p50 = pass_us[pass_us.len() / 2];
        rep.pass_us_max = pass_us[pass_us.len() - 1];
    }
    alloc_ns.sort_unstable();
    if !alloc_ns.is_empty() {
        rep.p50_ns = alloc_ns[alloc_ns.len() / 2];
        rep.p99_ns = alloc_ns[alloc_ns.len() * 99 / 100];
    }
    rep.host_syncs_on_alloc_path = host_syncs_on_alloc_path;
    rep.ops = opts.blocks as u64 + freed + rep.load_ops;
    let st = pool.stats();
    rep.peak_live_bytes = st.requested_bytes.peak;
    rep.peak_reserved_bytes = st.reserved_bytes.peak;
    drop(survivors);
    pool.trim()?;
    rep.leaked_bytes = pool.stats().reserved_bytes.current;
    Ok(rep)
}

fn absorb(rep: &mut FragmentReport, r: &super::CompactReport, pass_us: &mut Vec<f64>) {
    rep.bytes_moved += r.bytes_moved;
    rep.blocks_moved += r.blocks_moved;
    rep.moves_cancelled += r.moves_cancelled;
    if r.blocks_moved > 0 {
        rep.passes += 1;
        pass_us.push(r.duration.as_secs_f64() * 1e6);
    }
}

/// One load thread: its own stream and blocks; allocates, writes,
/// verifies and frees, and pins survivors to verify them.
fn load(
    pool: &DevicePool,
    survivors: &[(MovableBlock<'_>, u64)],
    stop: &AtomicBool,
    ops: &AtomicU64,
    seed: u64,
    lo: u64,
    hi: u64,
) -> Result<()> {
    let s = pool.new_stream()?;
    let mut rng = Rng::new(seed);
    let mut mine: Vec<(MovableBlock<'_>, u64)> = Vec::new();
    let mut n = 0u64;
    let t0 = Instant::now();
    while !stop.load(Relaxed) && t0.elapsed() < Duration::from_secs(600) {
        n += 1;
        match rng.below(10) {
            0..=3 if mine.len() < 64 => {
                let b = pool.alloc_movable(rng.size(lo, hi) as usize, &s)?;
                let sd = seed ^ n;
                touch(pool, &b, &s, sd, true)?;
                mine.push((b, sd));
            }
            0..=5 if !mine.is_empty() => {
                let i = rng.below(mine.len() as u64) as usize;
                let (b, sd) = mine.swap_remove(i);
                touch(pool, &b, &s, sd, false)?;
            }
            6..=7 if !mine.is_empty() => {
                let i = rng.below(mine.len() as u64) as usize;
                touch(pool, &mine[i].0, &s, mine[i].1, false)?;
            }
            _ if !survivors.is_empty() => {
                let (b, sd) = &survivors[rng.below(survivors.len() as u64) as usize];
                touch(pool, b, &s, *sd, false)?;
            }
            _ => {}
        }
        ops.fetch_add(1, Relaxed);
        if n % 32 == 0 {
            // Keep the stream's queue short, as a real training step does
            // (the host would otherwise run ever further ahead of the
            // device), and let the passes run between bursts.
            pool.backend().sync_stream(pool.device(), s.handle())?;
        }
    }
    for (b, sd) in mine.drain(..) {
        touch(pool, &b, &s, sd, false)?;
    }
    Ok(())
}
