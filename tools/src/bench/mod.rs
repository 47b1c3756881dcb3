//! Micro-benchmarks run by `gpupool bench`, side by side with baselines in
//! the same run.
//!
//! Everything runs on the simulator in accounting mode
//! ([`SimBacking::Accounting`](gpupool::backend::sim::SimBacking::Accounting)): the pool's alloc/free paths only do
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
//!   small uses a 4 KiB [`Block`](gpupool::pool::Block) (alloc, then drop);
//!   gpupool large a 4 MiB block whose range was freed on the same stream
//!   just before (the cached case); the baselines use the same sizes.
//! * **`threads`**: for 1..=N threads (N = available cores, at least 2),
//!   each thread doing 4 KiB alloc + free pairs on its own stream of one
//!   shared pool (the pool's fast path is per stream), against all threads
//!   sharing one [`MutexBestFit`](baselines::MutexBestFit). Throughput is
//!   in operations per second, where an operation is one alloc or one free
//!   (a pair is two), over the wall time from a common start barrier to the
//!   last thread's end. The same rows give large pairs (3–24 MiB in turn,
//!   each reusing its stream's freed range) beside the PyTorch port, with
//!   heap-lock acquisitions per operation. Each row also gives the threads' CPU time over
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
//!
//! # Layout
//!
//! This file holds the options, the workload constants and [`run`];
//! `report` the report's types and targets, `harness` what every
//! measurement runs on (plan, generator, pools), `host` the host readings,
//! one file per measurement (`pair`, `threads`, `random`, and
//! [`multi_stream`]), and `format` the text form of the report.

pub mod baselines;
pub mod gpu;
pub mod mapping;
pub mod multi_stream;
pub mod torch_peer;

mod format;
mod harness;
mod host;
mod pair;
mod random;
mod report;
mod threads;

pub use report::{BenchReport, MachineInfo, PairNs, RandomAllocationsRow, Target, ThreadsRow};

use gpupool::Result;
use harness::{Plan, DRIVER};
use host::{cpu_ticks, load_average, steal_share};
use std::time::Instant;

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
    /// H200's measured costs).
    pub driver_costs: gpupool::backend::CostTable,
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
        pair_ns: pair::pair_ns(&plan)?,
        threads: threads::threads_table(&plan, max_threads)?,
        random_allocations: random::random_table(&plan)?,
        multi_stream_allocations: multi_stream::table(opts.quick)?,
        targets: Vec::new(),
        driver_calls: Default::default(),
        driver_ms: 0.0,
        seconds: 0.0,
    };
    r.targets = report::targets(&r);
    let driver = DRIVER.with(|d| std::mem::take(&mut *d.borrow_mut()));
    r.driver_calls = driver.nonzero_calls();
    r.driver_ms = opts.driver_costs.millis(&driver);
    r.machine.steal_share = steal_share(ticks, cpu_ticks());
    r.seconds = start.elapsed().as_secs_f64();
    Ok(r)
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
            assert!(row["gpupool_large_ops_per_sec"].as_f64().unwrap() > 0.0);
            assert!(row["torch_large_ops_per_sec"].as_f64().unwrap() > 0.0);
            // Every large pair after the first is served by the stream's
            // parking cache, without the heap lock.
            assert!(row["gpupool_large_heap_locks_per_op"].as_f64().unwrap() < 0.01);
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
        // Small and large pair, three 2-thread ratios; no n = 1e5 row and
        // no 8-thread row in quick mode with 2 threads.
        assert_eq!(r.targets.len(), 5, "{:?}", r.targets);
        // The pools were built and grown through the driver, and costed.
        assert!(
            r.driver_calls["cuMemAddressReserve"] > 0,
            "{:?}",
            r.driver_calls
        );
        assert!(r.driver_calls["cuMemCreate"] > 0, "{:?}", r.driver_calls);
        // Each 2 MiB granule created at the default table's cost at least.
        let c = gpupool::backend::CostTable::default().cost(gpupool::backend::Call::MemCreate);
        let floor = r.driver_calls["cuMemCreate"] as f64 * (c.us + 2.0 * c.us_per_unit) / 1e3;
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
}
