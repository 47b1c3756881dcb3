//! Micro-benchmarks run by `gpupool bench`, side by side with baselines in
//! the same run.
//!
//! Everything runs on the simulator in accounting mode
//! ([`SimBacking::Accounting`]): the pool's alloc/free paths only do
//! bookkeeping on the host, so simulated memory would add nothing but page
//! faults. The baselines ([`baselines`]) are written for these benchmarks
//! only and are not part of the product. PyTorch's caching allocator runs
//! beside them as a live peer ([`torch_peer`]: the replay port behind
//! PyTorch's per-device mutex) in the pair benchmarks (`torch_small`,
//! `torch_large`) and in `random_allocations` (`ns_per_op_torch`).
//!
//! Three measurements:
//!
//! * **`pair_ns`**: median nanoseconds of one alloc + free pair on one
//!   thread. Each sample times a batch of pairs with [`Instant`]; the report
//!   gives the median over samples of (batch time / batch size). gpupool
//!   small uses a 4 KiB [`Block`] (alloc, then drop);
//!   gpupool large a 4 MiB block whose range was freed on the same stream
//!   just before (the cached case); the baselines use the same sizes.
//! * **`threads`**: for 1..=N threads (N = available cores, at least 2),
//!   each thread doing 4 KiB alloc + free pairs on its own stream of one
//!   shared pool (the pool's fast path is per stream), against all threads
//!   sharing one [`MutexBestFit`]. Throughput is
//!   in operations per second, where an operation is one alloc or one free
//!   (a pair is two), over the wall time from a common start barrier to the
//!   last thread's end. Each row also gives the threads' CPU time over
//!   threads x wall time: on a machine shared with other work (load above
//!   the core count) that share falls and the scaling figures mean little.
//! * **`random_allocations`**: RAPIDS RMM's `random_allocations` benchmark:
//!   `2n` steps; each draws a size uniform in `[1, 1 MiB]` (RMM's smallest
//!   `max_size`) and allocates with probability 73% while fewer than `n`
//!   allocations were made in total and live bytes stay under 16000 MiB
//!   (RMM's `max_usage`); otherwise it frees a uniformly chosen live
//!   allocation; what is live at the end is freed. `ns_per_op` is the wall
//!   time of the whole run (random numbers and bookkeeping included, as in
//!   RMM) over the allocs and frees made. The pool is warmed by one untimed
//!   run first, as Google Benchmark's repeated iterations warm RMM's pool;
//!   the figure is the median of the timed runs.

pub mod baselines;
pub mod gpu;
pub mod multi_stream;
pub mod torch_peer;

use crate::backend::sim::SimBacking;
use crate::config::{BackendKind, PoolConfig, SimConfig};
use crate::error::{Error, Result};
use crate::pool::{Block, DevicePool};
use crate::runtime::Runtime;
use crate::trace::peers::TorchConfig;
use baselines::{MutexBestFit, OffsetAllocatorPool};
use std::fmt;
use std::hint::black_box;
use std::sync::Barrier;
use std::time::Instant;
use torch_peer::TorchPeer;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Request size of the small-pair and thread measurements.
pub const SMALL_BYTES: u64 = 4 * KIB;
/// Request size of the large (cached) pair measurement.
pub const LARGE_BYTES: u64 = 4 * MIB;
/// Largest request of `random_allocations` (RMM's smallest `max_size`).
pub const RANDOM_MAX_BYTES: u64 = MIB;
/// Live-byte cap of `random_allocations` (RMM's `max_usage`, 16000 MiB).
pub const RANDOM_MAX_USAGE: u64 = 16_000 * MIB;
/// Simulated device capacity of every benchmark pool.
pub const CAPACITY_BYTES: u64 = 64 * GIB;

/// What to run.
#[derive(Debug, Clone, Default)]
pub struct BenchOptions {
    /// Fewer iterations, for tests and CI smoke runs (a few seconds even in
    /// a debug build); `random_allocations` then runs `n` = 10^3 and 10^4
    /// only.
    pub quick: bool,
    /// Most threads of the `threads` table (default: the available cores,
    /// at least 2).
    pub max_threads: Option<usize>,
    /// The cost table for the report's modeled driver time (default: the
    /// published costs).
    pub driver_costs: crate::backend::CostTable,
}

/// The report of `gpupool bench --json`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct BenchReport {
    /// Whether this was a quick run.
    pub quick: bool,
    /// Where it ran.
    pub machine: MachineInfo,
    /// Median alloc + free pair times, one thread.
    pub pair_ns: PairNs,
    /// Throughput by thread count.
    pub threads: Vec<ThreadsRow>,
    /// RMM's random_allocations benchmark, by `n`.
    pub random_allocations: Vec<RandomAllocationsRow>,
    /// RMM's multi_stream_allocations benchmark, by stream count (see
    /// [`multi_stream`]).
    pub multi_stream_allocations: Vec<multi_stream::MultiStreamRow>,
    /// The project's performance targets against the figures above.
    pub targets: Vec<Target>,
    /// Driver calls the benchmarks' pools made while they ran (from
    /// building each pool to its last benchmark step; teardown left out),
    /// by CUDA driver name.
    pub driver_calls: std::collections::BTreeMap<&'static str, u64>,
    /// Modeled driver time of those calls in milliseconds.
    pub driver_ms: f64,
    /// Wall time of the whole run in seconds.
    pub seconds: f64,
}

/// Where the benchmark ran.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct MachineInfo {
    /// Cores available to this process.
    pub cores: usize,
    /// CPU architecture.
    pub arch: String,
    /// Operating system.
    pub os: String,
    /// `release` or `debug` (debug figures mean little).
    pub profile: String,
    /// The backend the pools ran on.
    pub backend: String,
    /// The 1-minute load average when the run started (Linux; `null`
    /// elsewhere). Above a fraction of `cores`, other work shared the CPUs.
    pub load_average: Option<f64>,
    /// The share of all CPUs' time that the hypervisor gave to other
    /// guests during the run ("steal" in Linux's `/proc/stat`; `null`
    /// where unreadable). Above a few percent, the figures mean little.
    pub steal_share: Option<f64>,
}

/// Median nanoseconds of one alloc + free pair, single thread.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PairNs {
    /// gpupool, [`SMALL_BYTES`] block (`alloc` + drop).
    pub gpupool_small: f64,
    /// gpupool, [`LARGE_BYTES`] block from a range cached on the stream.
    pub gpupool_large: f64,
    /// The PyTorch-style baseline, [`SMALL_BYTES`].
    pub mutex_best_fit: f64,
    /// The `offset-allocator` baseline, [`SMALL_BYTES`].
    pub offset_allocator: f64,
    /// gpupool, [`SMALL_BYTES`] through `alloc_raw` + `free_raw` (the FFI path).
    pub gpupool_small_raw: f64,
    /// The PyTorch-style baseline, [`LARGE_BYTES`].
    pub mutex_best_fit_large: f64,
    /// PyTorch's caching allocator (the port, behind its device mutex),
    /// [`SMALL_BYTES`].
    pub torch_small: f64,
    /// PyTorch's caching allocator, [`LARGE_BYTES`] (a cached block).
    pub torch_large: f64,
    /// Request size of the small figures.
    pub small_bytes: u64,
    /// Request size of the large figures.
    pub large_bytes: u64,
}

/// One row of the thread table.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ThreadsRow {
    /// Threads, each on its own stream.
    pub threads: usize,
    /// gpupool operations (allocs + frees) per second, all threads.
    pub gpupool_ops_per_sec: f64,
    /// The mutex baseline's operations per second, all threads.
    pub mutex_best_fit_ops_per_sec: f64,
    /// The PyTorch port's operations per second, all threads, each thread
    /// on its own stream (PyTorch keys cached blocks by stream) behind the
    /// device's one mutex, as PyTorch takes it.
    pub torch_ops_per_sec: f64,
    /// gpupool throughput over the PyTorch port's, same thread count.
    pub gpupool_vs_torch: f64,
    /// gpupool throughput over its 1-thread throughput.
    pub gpupool_vs_1_thread: f64,
    /// gpupool throughput over the mutex baseline's, same thread count.
    pub gpupool_vs_mutex: f64,
    /// The mutex baseline's throughput over its 1-thread throughput.
    pub mutex_vs_1_thread: f64,
    /// Share of the wall time gpupool's threads were on a CPU (thread CPU
    /// time over threads x wall time). Well under 1 means the machine was
    /// oversubscribed (other processes ran), so the scaling figures
    /// understate the pool.
    pub gpupool_cpu_share: f64,
    /// The same for the mutex baseline; here waits for the lock (futex
    /// sleeps) lower it too.
    pub mutex_best_fit_cpu_share: f64,
}

/// One row of RMM's random_allocations benchmark.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RandomAllocationsRow {
    /// Allocations made in total (RMM's `num_allocations`).
    pub n: u64,
    /// gpupool nanoseconds per operation (alloc or free).
    pub ns_per_op: f64,
    /// The mutex baseline's nanoseconds per operation.
    pub mutex_best_fit_ns_per_op: f64,
    /// PyTorch's caching allocator's nanoseconds per operation.
    pub ns_per_op_torch: f64,
    /// The baseline's time over gpupool's.
    pub mutex_vs_gpupool: f64,
    /// Operations per run (allocs + frees).
    pub ops: u64,
    /// Largest request size in bytes.
    pub max_size_bytes: u64,
}

/// A performance target of the project and whether this run met it.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Target {
    /// What is measured.
    pub name: String,
    /// The goal, e.g. `<= 40`.
    pub goal: String,
    /// The figure measured.
    pub measured: f64,
    /// Whether the goal was met.
    pub met: bool,
}

/// Iteration counts of one run.
#[derive(Debug, Clone)]
struct Plan {
    samples: usize,
    batch: usize,
    warmup: usize,
    gpupool_thread_pairs: u64,
    mutex_thread_pairs: u64,
    thread_reps: usize,
    random: &'static [(u64, usize)],
}

impl Plan {
    fn new(quick: bool) -> Plan {
        if quick {
            Plan {
                samples: 15,
                batch: 200,
                warmup: 1_000,
                gpupool_thread_pairs: 20_000,
                mutex_thread_pairs: 5_000,
                thread_reps: 1,
                random: &[(1_000, 1), (10_000, 1)],
            }
        } else {
            Plan {
                samples: 301,
                batch: 1_000,
                warmup: 20_000,
                gpupool_thread_pairs: 2_000_000,
                mutex_thread_pairs: 300_000,
                thread_reps: 5,
                random: &[(1_000, 51), (10_000, 11), (100_000, 5)],
            }
        }
    }
}

/// A small, fast, seeded generator (SplitMix64), so that runs repeat exactly
/// and every allocator sees the same request sequence.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    #[inline]
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    #[inline]
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn baseline_oom(which: &'static str) -> Error {
    Error::backend(which, "baseline allocator out of memory")
}

thread_local! {
    /// Driver calls of the benchmark pools dropped on this thread so far
    /// (each `run` reads its own thread's tally, so parallel runs in tests
    /// do not mix).
    static DRIVER: std::cell::RefCell<crate::backend::BackendCounters> =
        std::cell::RefCell::default();
}

/// A benchmark's runtime: when dropped, its backend's driver calls are
/// added to this thread's tally ([`BenchReport::driver_calls`]).
pub(crate) struct Tallied(Runtime);

impl std::ops::Deref for Tallied {
    type Target = Runtime;
    fn deref(&self) -> &Runtime {
        &self.0
    }
}

impl Drop for Tallied {
    fn drop(&mut self) {
        let c = self.0.backend().counters();
        DRIVER.with(|d| d.borrow_mut().add(&c));
    }
}

/// A pool on one simulated device in accounting mode.
fn sim_runtime() -> Result<Tallied> {
    Runtime::builder()
        .backend(BackendKind::Sim(SimConfig {
            devices: 1,
            capacity_bytes: CAPACITY_BYTES,
            backing: SimBacking::Accounting,
            ..Default::default()
        }))
        .config(PoolConfig::default())
        .build()
        .map(Tallied)
}

/// Median ns per call of `pair` over `plan.samples` batches.
fn median_pair_ns(plan: &Plan, mut pair: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..plan.warmup {
        pair()?;
    }
    let mut per_pair = Vec::with_capacity(plan.samples);
    for _ in 0..plan.samples {
        let t = Instant::now();
        for _ in 0..plan.batch {
            pair()?;
        }
        per_pair.push(t.elapsed().as_nanos() as f64 / plan.batch as f64);
    }
    Ok(median(&mut per_pair))
}

fn pair_ns(plan: &Plan) -> Result<PairNs> {
    let rt = sim_runtime()?;
    let dev = rt.device(0)?;
    let s = dev.new_stream()?;
    let (small, large) = (SMALL_BYTES as usize, LARGE_BYTES as usize);
    let gpupool_small = median_pair_ns(plan, || {
        let b = dev.alloc(small, &s)?;
        black_box(b.ptr());
        Ok(())
    })?;
    let gpupool_small_raw = median_pair_ns(plan, || {
        let p = dev.alloc_raw(small, &s)?;
        dev.free_raw(black_box(p), &s)
    })?;
    // The warm-up frees the range on `s`: every timed pair reuses it.
    let gpupool_large = median_pair_ns(plan, || {
        let b = dev.alloc(large, &s)?;
        black_box(b.ptr());
        Ok(())
    })?;
    let best_fit = MutexBestFit::new(CAPACITY_BYTES);
    let mutex_pair = |size: u64| {
        let a = best_fit
            .alloc(size)
            .ok_or_else(|| baseline_oom("mutex_best_fit"))?;
        best_fit.free(black_box(a));
        Ok(())
    };
    let mutex_best_fit = median_pair_ns(plan, || mutex_pair(SMALL_BYTES))?;
    let mutex_best_fit_large = median_pair_ns(plan, || mutex_pair(LARGE_BYTES))?;
    let torch = torch_peer_pool();
    let torch_pair = |size: u64| {
        let a = torch.alloc(0, size, 0)?;
        torch.free(black_box(a))
    };
    let torch_small = median_pair_ns(plan, || torch_pair(SMALL_BYTES))?;
    let torch_large = median_pair_ns(plan, || torch_pair(LARGE_BYTES))?;
    let offset = OffsetAllocatorPool::new(CAPACITY_BYTES);
    let offset_allocator = median_pair_ns(plan, || {
        let a = offset
            .alloc(SMALL_BYTES)
            .ok_or_else(|| baseline_oom("offset_allocator"))?;
        offset.free(black_box(a));
        Ok(())
    })?;
    Ok(PairNs {
        gpupool_small,
        gpupool_large,
        mutex_best_fit,
        offset_allocator,
        gpupool_small_raw,
        mutex_best_fit_large,
        torch_small,
        torch_large,
        small_bytes: SMALL_BYTES,
        large_bytes: LARGE_BYTES,
    })
}

/// CPU time of the calling thread, in seconds.
fn thread_cpu_secs() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return f64::NAN;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// The 1-minute load average (Linux), if readable.
fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// All CPUs' `(steal, total)` time in ticks so far (Linux), if readable.
fn cpu_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    let ticks: Vec<u64> = line
        .split_whitespace()
        .map(|t| t.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal (guest time is
    // already inside user and nice).
    let steal = *ticks.get(7)?;
    Some((steal, ticks.iter().take(8).sum()))
}

/// The share of CPU time stolen between two [`cpu_ticks`] readings.
fn steal_share(before: Option<(u64, u64)>, after: Option<(u64, u64)>) -> Option<f64> {
    let ((s0, t0), (s1, t1)) = (before?, after?);
    (t1 > t0).then(|| s1.saturating_sub(s0) as f64 / (t1 - t0) as f64)
}

/// Throughput of one timed thread run.
#[derive(Debug, Clone, Copy)]
struct Throughput {
    ops_per_sec: f64,
    /// Thread CPU time over (threads x wall time).
    cpu_share: f64,
}

/// Runs `pairs` calls of `pair(i)` on each of `threads` threads after a
/// common barrier; returns operations (2 per pair) per second and the share
/// of the wall time the threads spent on a CPU.
fn timed_threads(
    threads: usize,
    warmup: usize,
    pairs: u64,
    pair: impl Fn(usize) -> Result<()> + Sync,
) -> Result<Throughput> {
    let barrier = Barrier::new(threads);
    let spans = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..threads)
            .map(|i| {
                let (barrier, pair) = (&barrier, &pair);
                sc.spawn(move || -> Result<(Instant, Instant, f64)> {
                    let warm = (0..warmup).try_for_each(|_| pair(i));
                    // Everyone reaches the barrier, even after an error.
                    barrier.wait();
                    warm?;
                    let (t0, c0) = (Instant::now(), thread_cpu_secs());
                    for _ in 0..pairs {
                        pair(i)?;
                    }
                    Ok((t0, Instant::now(), thread_cpu_secs() - c0))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect::<Result<Vec<_>>>()
    })?;
    let start = spans.iter().map(|s| s.0).min().expect("threads >= 1");
    let end = spans.iter().map(|s| s.1).max().expect("threads >= 1");
    let secs = (end - start).as_secs_f64().max(1e-9);
    let cpu: f64 = spans.iter().map(|s| s.2).sum();
    Ok(Throughput {
        ops_per_sec: 2.0 * pairs as f64 * threads as f64 / secs,
        cpu_share: (cpu / (secs * threads as f64)).min(1.0),
    })
}

/// The run of median throughput out of `reps`.
fn median_of(reps: usize, mut f: impl FnMut() -> Result<Throughput>) -> Result<Throughput> {
    let mut v = (0..reps.max(1)).map(|_| f()).collect::<Result<Vec<_>>>()?;
    v.sort_by(|a, b| a.ops_per_sec.total_cmp(&b.ops_per_sec));
    Ok(v[v.len() / 2])
}

fn gpupool_threads(dev: &DevicePool, plan: &Plan, threads: usize) -> Result<Throughput> {
    let streams = (0..threads)
        .map(|_| dev.new_stream())
        .collect::<Result<Vec<_>>>()?;
    median_of(plan.thread_reps, || {
        timed_threads(threads, plan.warmup, plan.gpupool_thread_pairs, |i| {
            let b = dev.alloc(SMALL_BYTES as usize, &streams[i])?;
            black_box(b.ptr());
            Ok(())
        })
    })
}

fn mutex_threads(plan: &Plan, threads: usize) -> Result<Throughput> {
    let a = MutexBestFit::new(CAPACITY_BYTES);
    median_of(plan.thread_reps, || {
        timed_threads(threads, plan.warmup, plan.mutex_thread_pairs, |_| {
            let p = a
                .alloc(SMALL_BYTES)
                .ok_or_else(|| baseline_oom("mutex_best_fit"))?;
            a.free(black_box(p));
            Ok(())
        })
    })
}

fn torch_threads(plan: &Plan, threads: usize) -> Result<Throughput> {
    let torch = torch_peer_pool();
    median_of(plan.thread_reps, || {
        timed_threads(threads, plan.warmup, plan.mutex_thread_pairs, |t| {
            let a = torch.alloc(0, SMALL_BYTES, t as u64 + 1)?;
            torch.free(black_box(a))
        })
    })
}

fn threads_table(plan: &Plan, max_threads: usize) -> Result<Vec<ThreadsRow>> {
    let rt = sim_runtime()?;
    let dev = rt.device(0)?;
    let mut rows: Vec<ThreadsRow> = Vec::new();
    for t in 1..=max_threads {
        let g = gpupool_threads(dev, plan, t)?;
        let m = mutex_threads(plan, t)?;
        let tp = torch_threads(plan, t)?;
        let (g1, m1) = rows.first().map_or((g.ops_per_sec, m.ops_per_sec), |r| {
            (r.gpupool_ops_per_sec, r.mutex_best_fit_ops_per_sec)
        });
        rows.push(ThreadsRow {
            threads: t,
            gpupool_ops_per_sec: g.ops_per_sec,
            mutex_best_fit_ops_per_sec: m.ops_per_sec,
            torch_ops_per_sec: tp.ops_per_sec,
            gpupool_vs_torch: g.ops_per_sec / tp.ops_per_sec,
            gpupool_vs_1_thread: g.ops_per_sec / g1,
            gpupool_vs_mutex: g.ops_per_sec / m.ops_per_sec,
            mutex_vs_1_thread: m.ops_per_sec / m1,
            gpupool_cpu_share: g.cpu_share,
            mutex_best_fit_cpu_share: m.cpu_share,
        });
    }
    Ok(rows)
}

/// An allocator driven by [`random_allocations`].
/// What `random_allocations` drives. A handle knows its size, as RMM's
/// loop keeps `{pointer, size}` per live allocation.
trait RandomTarget {
    type Handle;
    /// `Ok(None)`: out of memory (the step frees instead, as in RMM).
    fn alloc(&mut self, size: u64) -> Result<Option<Self::Handle>>;
    fn size(h: &Self::Handle) -> u64;
    fn free(&mut self, h: Self::Handle);
}

struct GpupoolTarget<'a> {
    dev: &'a DevicePool,
    stream: &'a crate::pool::Stream,
}

impl<'a> RandomTarget for GpupoolTarget<'a> {
    type Handle = Block<'a>;
    fn alloc(&mut self, size: u64) -> Result<Option<Block<'a>>> {
        match self.dev.alloc(size as usize, self.stream) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.is_oom() => Ok(None),
            Err(e) => Err(e),
        }
    }
    fn size(h: &Block<'a>) -> u64 {
        h.size() as u64
    }
    fn free(&mut self, h: Block<'a>) {
        drop(h);
    }
}

impl RandomTarget for &MutexBestFit {
    /// `(address, size)`, RMM's pair.
    type Handle = (u64, u64);
    fn alloc(&mut self, size: u64) -> Result<Option<(u64, u64)>> {
        Ok(MutexBestFit::alloc(self, size).map(|a| (a, size)))
    }
    fn size(h: &(u64, u64)) -> u64 {
        h.1
    }
    fn free(&mut self, h: (u64, u64)) {
        MutexBestFit::free(self, h.0);
    }
}

impl RandomTarget for &TorchPeer {
    /// `(address, size)`.
    type Handle = (u64, u64);
    fn alloc(&mut self, size: u64) -> Result<Option<(u64, u64)>> {
        match TorchPeer::alloc(self, 0, size, 0) {
            Ok(a) => Ok(Some((a, size))),
            Err(e) if e.is_oom() => Ok(None),
            Err(e) => Err(e),
        }
    }
    fn size(h: &(u64, u64)) -> u64 {
        h.1
    }
    fn free(&mut self, h: (u64, u64)) {
        TorchPeer::free(self, h.0).expect("the torch peer frees what it handed out");
    }
}

/// The PyTorch port on one simulated device of [`CAPACITY_BYTES`], default
/// settings.
fn torch_peer_pool() -> TorchPeer {
    TorchPeer::new(
        1,
        TorchConfig {
            capacity_bytes: CAPACITY_BYTES,
            ..TorchConfig::default()
        },
    )
}

/// One run of RMM's random_allocations; returns (operations, seconds).
fn random_allocations<T: RandomTarget>(t: &mut T, n: u64, seed: u64) -> Result<(u64, f64)> {
    const ALLOC_PERCENT: u64 = 73;
    let mut rng = Rng::new(seed);
    let mut live: Vec<T::Handle> = Vec::with_capacity(n as usize);
    let (mut count, mut bytes, mut ops) = (0u64, 0u64, 0u64);
    let start = Instant::now();
    for _ in 0..2 * n {
        let size = 1 + rng.below(RANDOM_MAX_BYTES);
        let do_alloc = live.is_empty()
            || (rng.below(100) < ALLOC_PERCENT && count < n && bytes + size < RANDOM_MAX_USAGE);
        if do_alloc {
            ops += 1;
            if let Some(h) = t.alloc(size)? {
                live.push(h);
                count += 1;
                bytes += size;
                continue;
            }
        }
        if !live.is_empty() {
            let i = rng.below(live.len() as u64) as usize;
            let h = live.swap_remove(i);
            bytes -= T::size(&h);
            t.free(h);
            ops += 1;
        }
    }
    for h in live.drain(..) {
        t.free(h);
        ops += 1;
    }
    Ok((ops, start.elapsed().as_secs_f64()))
}

/// Warm-up run, then the median ns/op of `reps` timed runs.
fn random_ns_per_op<T: RandomTarget>(t: &mut T, n: u64, reps: usize) -> Result<(u64, f64)> {
    const SEED: u64 = 0x05EE_D0FA_110C;
    random_allocations(t, n, SEED)?;
    let mut ops = 0;
    let mut v = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let (o, secs) = random_allocations(t, n, SEED)?;
        ops = o;
        v.push(secs * 1e9 / o.max(1) as f64);
    }
    Ok((ops, median(&mut v)))
}

fn random_table(plan: &Plan) -> Result<Vec<RandomAllocationsRow>> {
    let mut rows = Vec::new();
    for &(n, reps) in plan.random {
        // A fresh pool and baseline per n, as RMM builds its resource per
        // benchmark.
        let rt = sim_runtime()?;
        let dev = rt.device(0)?;
        let stream = dev.new_stream()?;
        let (ops, g) = random_ns_per_op(
            &mut GpupoolTarget {
                dev,
                stream: &stream,
            },
            n,
            reps,
        )?;
        let best_fit = MutexBestFit::new(CAPACITY_BYTES);
        let (_, m) = random_ns_per_op(&mut &best_fit, n, reps)?;
        let torch = torch_peer_pool();
        let (_, t) = random_ns_per_op(&mut &torch, n, reps)?;
        rows.push(RandomAllocationsRow {
            n,
            ns_per_op: g,
            mutex_best_fit_ns_per_op: m,
            ns_per_op_torch: t,
            mutex_vs_gpupool: m / g,
            ops,
            max_size_bytes: RANDOM_MAX_BYTES,
        });
    }
    Ok(rows)
}

fn targets(r: &BenchReport) -> Vec<Target> {
    let mut t = Vec::new();
    let mut push = |name: &str, goal: &str, measured: f64, met: bool| {
        t.push(Target {
            name: name.into(),
            goal: goal.into(),
            measured,
            met,
        })
    };
    let p = &r.pair_ns;
    push(
        "small pair, ns (1 thread)",
        "<= 40",
        p.gpupool_small,
        p.gpupool_small <= 40.0,
    );
    push(
        "large cached pair, ns",
        "<= 200",
        p.gpupool_large,
        p.gpupool_large <= 200.0,
    );
    if let Some(row) = r.threads.iter().find(|row| row.threads == 2) {
        push(
            "2 threads: gpupool / mutex_best_fit",
            ">= 10",
            row.gpupool_vs_mutex,
            row.gpupool_vs_mutex >= 10.0,
        );
        push(
            "2 threads: gpupool / gpupool 1 thread",
            ">= 1.6",
            row.gpupool_vs_1_thread,
            row.gpupool_vs_1_thread >= 1.6,
        );
    }
    if let Some(row) = r.random_allocations.iter().find(|row| row.n == 100_000) {
        push(
            "random_allocations n=1e5, ns/op",
            "<= 200",
            row.ns_per_op,
            row.ns_per_op <= 200.0,
        );
    }
    t
}

/// Runs the benchmarks: quick mode takes a few seconds, the full run under
/// a minute on two cores (release build).
pub fn run(opts: &BenchOptions) -> Result<BenchReport> {
    let start = Instant::now();
    let ticks = cpu_ticks();
    DRIVER.with(|d| *d.borrow_mut() = Default::default());
    let plan = Plan::new(opts.quick);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let max_threads = opts.max_threads.unwrap_or(cores.max(2)).max(1);
    let mut r = BenchReport {
        quick: opts.quick,
        machine: MachineInfo {
            cores,
            arch: std::env::consts::ARCH.into(),
            os: std::env::consts::OS.into(),
            profile: if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            }
            .into(),
            backend: "sim (accounting)".into(),
            load_average: load_average(),
            steal_share: None,
        },
        pair_ns: pair_ns(&plan)?,
        threads: threads_table(&plan, max_threads)?,
        random_allocations: random_table(&plan)?,
        multi_stream_allocations: multi_stream::table(opts.quick)?,
        targets: Vec::new(),
        driver_calls: Default::default(),
        driver_ms: 0.0,
        seconds: 0.0,
    };
    r.targets = targets(&r);
    let driver = DRIVER.with(|d| std::mem::take(&mut *d.borrow_mut()));
    r.driver_calls = driver.nonzero_calls();
    r.driver_ms = opts.driver_costs.millis(&driver);
    r.machine.steal_share = steal_share(ticks, cpu_ticks());
    r.seconds = start.elapsed().as_secs_f64();
    Ok(r)
}

/// `4096` → `4 KiB`.
fn fmt_bytes(b: u64) -> String {
    match b {
        b if b >= GIB && b % GIB == 0 => format!("{} GiB", b / GIB),
        b if b >= MIB && b % MIB == 0 => format!("{} MiB", b / MIB),
        b if b >= KIB && b % KIB == 0 => format!("{} KiB", b / KIB),
        b => format!("{b} B"),
    }
}

/// `12345678.0` → `12.35 M`.
fn fmt_rate(x: f64) -> String {
    if x >= 1e9 {
        format!("{:.2} G", x / 1e9)
    } else if x >= 1e6 {
        format!("{:.2} M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.2} k", x / 1e3)
    } else {
        format!("{x:.1}")
    }
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.machine;
        writeln!(
            f,
            "gpupool bench ({}{} build; {} core(s), {}/{}, load {}, steal {}; {}; {:.1} s)",
            if self.quick { "quick, " } else { "" },
            m.profile,
            m.cores,
            m.os,
            m.arch,
            m.load_average
                .map_or_else(|| "unknown".into(), |l| format!("{l:.2}")),
            m.steal_share
                .map_or_else(|| "unknown".into(), |s| format!("{:.1}%", s * 100.0)),
            m.backend,
            self.seconds
        )?;
        let p = &self.pair_ns;
        let (small, large) = (fmt_bytes(p.small_bytes), fmt_bytes(p.large_bytes));
        writeln!(f)?;
        writeln!(f, "alloc + free pair, 1 thread     median ns   vs gpupool")?;
        let mut row = |name: String, ns: f64, reference: f64| {
            writeln!(f, "  {name:<30}{ns:>10.1}   {:>7.2}x", ns / reference)
        };
        row(
            format!("gpupool small ({small})"),
            p.gpupool_small,
            p.gpupool_small,
        )?;
        row(
            format!("gpupool small raw ({small})"),
            p.gpupool_small_raw,
            p.gpupool_small,
        )?;
        row(
            format!("mutex_best_fit ({small})"),
            p.mutex_best_fit,
            p.gpupool_small,
        )?;
        row(
            format!("offset_allocator ({small})"),
            p.offset_allocator,
            p.gpupool_small,
        )?;
        row(
            format!("gpupool large ({large}, cached)"),
            p.gpupool_large,
            p.gpupool_large,
        )?;
        row(
            format!("mutex_best_fit ({large})"),
            p.mutex_best_fit_large,
            p.gpupool_large,
        )?;
        row(format!("torch ({small})"), p.torch_small, p.gpupool_small)?;
        row(
            format!("torch ({large}, cached)"),
            p.torch_large,
            p.gpupool_large,
        )?;
        writeln!(f)?;
        writeln!(
            f,
            "threads ({small} pairs, own stream each; ops/s = allocs + frees per second)"
        )?;
        writeln!(
            f,
            "  {:>7}  {:>10} {:>8} {:>4}  {:>10} {:>8} {:>4}  {:>13}  {:>10} {:>13}",
            "threads",
            "gpupool",
            "vs 1 thr",
            "cpu",
            "mutex_bf",
            "vs 1 thr",
            "cpu",
            "gpupool/mutex",
            "torch",
            "gpupool/torch"
        )?;
        for r in &self.threads {
            writeln!(
                f,
                "  {:>7}  {:>10} {:>7.2}x {:>3.0}%  {:>10} {:>7.2}x {:>3.0}%  {:>12.1}x  {:>10} {:>12.1}x",
                r.threads,
                fmt_rate(r.gpupool_ops_per_sec),
                r.gpupool_vs_1_thread,
                r.gpupool_cpu_share * 100.0,
                fmt_rate(r.mutex_best_fit_ops_per_sec),
                r.mutex_vs_1_thread,
                r.mutex_best_fit_cpu_share * 100.0,
                r.gpupool_vs_mutex,
                fmt_rate(r.torch_ops_per_sec),
                r.gpupool_vs_torch
            )?;
        }
        writeln!(
            f,
            "  (cpu: the threads' CPU time over threads x wall time; under ~90% for gpupool\n   means other processes shared the cores and the scaling is understated)"
        )?;
        writeln!(f)?;
        let max = self
            .random_allocations
            .first()
            .map_or(RANDOM_MAX_BYTES, |r| r.max_size_bytes);
        writeln!(
            f,
            "random_allocations (RMM: sizes in [1 B, {}], 73% allocs, ns per alloc or free)",
            fmt_bytes(max)
        )?;
        writeln!(
            f,
            "  {:>7}  {:>9}  {:>10}  {:>9}  {:>13}",
            "n", "gpupool", "mutex_bf", "torch", "mutex/gpupool"
        )?;
        for r in &self.random_allocations {
            writeln!(
                f,
                "  {:>7}  {:>9.1}  {:>10.1}  {:>9.1}  {:>12.2}x",
                r.n, r.ns_per_op, r.mutex_best_fit_ns_per_op, r.ns_per_op_torch, r.mutex_vs_gpupool
            )?;
        }
        self.fmt_multi_stream(f)?;
        if !self.targets.is_empty() {
            writeln!(f)?;
            writeln!(f, "targets")?;
            for t in &self.targets {
                writeln!(
                    f,
                    "  {:<40}{:>8}  {:>10.2}  {}",
                    t.name,
                    t.goal,
                    t.measured,
                    if t.met { "met" } else { "MISSED" }
                )?;
            }
        }
        Ok(())
    }
}

impl BenchReport {
    fn fmt_multi_stream(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(first) = self.multi_stream_allocations.first() else {
            return Ok(());
        };
        writeln!(f)?;
        writeln!(
            f,
            "multi_stream_allocations (RMM: {} x {} B alloc + {:.1} ms kernel + free per iteration, ns per kernel)",
            first.kernels,
            multi_stream::BYTES,
            first.kernel_ns as f64 / 1e6
        )?;
        writeln!(
            f,
            "  {:>7} {:>7}  {:>10} {:>12}  {:>17}",
            "streams", "prewarm", "gpupool", "gpupool host", "mutex_bf (syncs)"
        )?;
        for r in &self.multi_stream_allocations {
            writeln!(
                f,
                "  {:>7} {:>7}  {:>10.0} {:>12.0}  {:>17.0}",
                r.streams,
                if r.prewarm { "yes" } else { "no" },
                r.ns_per_op,
                r.host_ns_per_op,
                r.mutex_best_fit_ns_per_op
            )?;
        }
        writeln!(f)?;
        writeln!(
            f,
            "driver: {} calls by the benchmark pools, {:.2} ms modeled",
            self.driver_calls.values().sum::<u64>(),
            self.driver_ms
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every number in `v` is finite and positive; returns how many there are.
    fn check_numbers(v: &serde_json::Value, path: &str) -> usize {
        match v {
            serde_json::Value::Number(n) => {
                let x = n.as_f64().unwrap();
                assert!(x.is_finite() && x > 0.0, "{path} = {x}");
                1
            }
            serde_json::Value::Array(a) => a
                .iter()
                .enumerate()
                .map(|(i, e)| check_numbers(e, &format!("{path}[{i}]")))
                .sum(),
            serde_json::Value::Object(o) => o
                .iter()
                .map(|(k, e)| check_numbers(e, &format!("{path}.{k}")))
                .sum(),
            _ => 0,
        }
    }

    #[test]
    fn quick_run_reports_the_contract_keys_with_positive_figures() {
        let r = run(&BenchOptions {
            quick: true,
            max_threads: Some(2),
            ..Default::default()
        })
        .unwrap();
        let j = serde_json::to_value(&r).unwrap();
        for k in [
            "gpupool_small",
            "gpupool_large",
            "mutex_best_fit",
            "offset_allocator",
            "torch_small",
            "torch_large",
        ] {
            assert!(j["pair_ns"][k].as_f64().unwrap() > 0.0, "pair_ns.{k}");
        }
        let threads = j["threads"].as_array().unwrap();
        assert_eq!(threads.len(), 2);
        for (i, row) in threads.iter().enumerate() {
            assert_eq!(row["threads"], i + 1);
            assert!(row["gpupool_ops_per_sec"].is_f64());
            assert!(row["mutex_best_fit_ops_per_sec"].is_f64());
        }
        let random = j["random_allocations"].as_array().unwrap();
        assert_eq!(
            random
                .iter()
                .map(|r| r["n"].as_u64().unwrap())
                .collect::<Vec<_>>(),
            vec![1_000, 10_000]
        );
        for row in random {
            assert!(row["ns_per_op"].is_f64());
            assert!(row["ns_per_op_torch"].as_f64().unwrap() > 0.0);
        }
        let multi = j["multi_stream_allocations"].as_array().unwrap();
        assert_eq!(multi.len(), 6);
        for row in multi {
            assert!([1, 2, 4].contains(&row["streams"].as_u64().unwrap()));
            assert!(row["ns_per_op"].as_f64().unwrap() > 0.0);
        }
        let figures: usize = ["pair_ns", "threads", "random_allocations", "targets"]
            .iter()
            .map(|k| check_numbers(&j[*k], k))
            .sum();
        assert!(figures > 20, "{figures}");
        assert!(j["machine"]["cores"].as_u64().unwrap() >= 1);
        assert_eq!(j["quick"], true);
        assert_eq!(r.targets.len(), 4, "no n = 1e5 row in quick mode");
        // The pools were built and grown through the driver, and costed.
        assert!(
            r.driver_calls["cuMemAddressReserve"] > 0,
            "{:?}",
            r.driver_calls
        );
        assert!(r.driver_calls["cuMemCreate"] > 0, "{:?}", r.driver_calls);
        let floor = r.driver_calls["cuMemCreate"] as f64 * 0.19332;
        assert!(r.driver_ms >= floor, "{} < {floor}", r.driver_ms);
        assert!(j["driver_calls"].is_object() && j["driver_ms"].is_f64());
        // A run's tally is its own: a second run counts from zero again.
        let again = run(&BenchOptions {
            quick: true,
            max_threads: Some(1),
            ..Default::default()
        })
        .unwrap();
        assert!(again.driver_calls["cuMemAddressReserve"] <= r.driver_calls["cuMemAddressReserve"]);
        let table = r.to_string();
        for word in [
            "gpupool small",
            "mutex_best_fit",
            "offset_allocator",
            "torch (4 KiB)",
            "random_allocations",
            "multi_stream_allocations",
            "driver",
        ] {
            assert!(table.contains(word), "{table}");
        }
    }

    #[test]
    fn steal_share_is_the_stolen_part_of_the_ticks_between_readings() {
        assert_eq!(
            steal_share(Some((10, 1_000)), Some((30, 1_400))),
            Some(0.05)
        );
        assert_eq!(steal_share(Some((10, 1_000)), Some((10, 1_000))), None);
        assert_eq!(steal_share(None, Some((10, 1_000))), None);
        if cfg!(target_os = "linux") {
            let (steal, total) = cpu_ticks().expect("/proc/stat is readable on Linux");
            assert!(steal <= total && total > 0, "{steal} of {total}");
        }
    }

    #[test]
    fn random_allocations_follows_rmm_and_frees_everything() {
        let a = MutexBestFit::new(CAPACITY_BYTES);
        let (ops, secs) = random_allocations(&mut &a, 2_000, 1).unwrap();
        // 2n steps, each at least one op, plus the final frees.
        assert!((4_000..=6_000).contains(&ops), "{ops}");
        assert!(secs > 0.0);
        assert_eq!(a.stats().allocated_bytes, 0);
        assert_eq!(a.stats().num_allocs, 2_000, "exactly n allocations");
        a.check().unwrap();
        let rt = sim_runtime().unwrap();
        let dev = rt.device(0).unwrap();
        let s = dev.new_stream().unwrap();
        random_allocations(&mut GpupoolTarget { dev, stream: &s }, 2_000, 1).unwrap();
        let st = dev.stats();
        assert_eq!(st.num_allocs, 2_000);
        assert_eq!(st.requested_bytes.current, 0);
        let torch = torch_peer_pool();
        random_allocations(&mut &torch, 2_000, 1).unwrap();
        let st = torch.stats(0).unwrap();
        assert_eq!((st.num_allocs, st.num_frees), (2_000, 2_000));
        assert_eq!(st.allocated_bytes, 0);
    }

    #[test]
    fn rng_is_uniform_enough() {
        let mut r = Rng::new(3);
        let mut counts = [0u32; 10];
        for _ in 0..100_000 {
            counts[r.below(10) as usize] += 1;
        }
        for c in counts {
            assert!((9_000..11_000).contains(&c), "{counts:?}");
        }
    }
}
