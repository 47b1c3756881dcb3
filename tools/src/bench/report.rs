//! The report of `gpupool bench` (`--json` serializes it as is): where it
//! ran, the three measurements' rows, and the project's performance
//! [`Target`]s judged against them ([`targets`]).

use super::multi_stream;

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
    /// gpupool, [`SMALL_BYTES`](super::SMALL_BYTES) block (`alloc` + drop).
    pub gpupool_small: f64,
    /// gpupool, [`LARGE_BYTES`](super::LARGE_BYTES) block from a range cached on the stream.
    pub gpupool_large: f64,
    /// The PyTorch-style baseline, [`SMALL_BYTES`](super::SMALL_BYTES).
    pub mutex_best_fit: f64,
    /// The `offset-allocator` baseline, [`SMALL_BYTES`](super::SMALL_BYTES).
    pub offset_allocator: f64,
    /// gpupool, [`SMALL_BYTES`](super::SMALL_BYTES) through `alloc_raw` + `free_raw` (the FFI path).
    pub gpupool_small_raw: f64,
    /// gpupool, [`SMALL_BYTES`](super::SMALL_BYTES) through the C ABI
    /// (`gpupool_alloc` + `gpupool_free`, default stream).
    pub gpupool_small_c_abi: f64,
    /// gpupool, [`SMALL_BYTES`](super::SMALL_BYTES) through PyTorch's hook
    /// (`gpupool_torch_malloc` + `gpupool_torch_free`, default stream).
    pub gpupool_small_torch_hook: f64,
    /// The PyTorch-style baseline, [`LARGE_BYTES`](super::LARGE_BYTES).
    pub mutex_best_fit_large: f64,
    /// PyTorch's caching allocator (the port, behind its device mutex),
    /// [`SMALL_BYTES`](super::SMALL_BYTES).
    pub torch_small: f64,
    /// PyTorch's caching allocator, [`LARGE_BYTES`](super::LARGE_BYTES) (a cached block).
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
    /// Acquisitions of the device's heap mutex (its one device-wide lock)
    /// per gpupool operation in this row's runs.
    pub gpupool_heap_locks_per_op: f64,
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
    /// gpupool operations per second of large pairs, all threads: steps of
    /// six blocks of 3–24 MiB, all allocated then all freed on the thread's
    /// stream (each step reuses the ranges the one before freed).
    pub gpupool_large_ops_per_sec: f64,
    /// Heap mutex acquisitions per operation of the large pairs (0 when
    /// every pair is served by the stream's parking cache).
    pub gpupool_large_heap_locks_per_op: f64,
    /// gpupool large-pair throughput over its 1-thread throughput.
    pub gpupool_large_vs_1_thread: f64,
    /// Share of the wall time gpupool's large-pair threads were on a CPU.
    pub gpupool_large_cpu_share: f64,
    /// The PyTorch port's operations per second of the same large pairs,
    /// each thread on its own stream.
    pub torch_large_ops_per_sec: f64,
    /// gpupool large-pair throughput over the PyTorch port's.
    pub gpupool_large_vs_torch: f64,
    /// gpupool operations per second of the same large pairs with every
    /// thread on one shared stream.
    pub gpupool_large_shared_ops_per_sec: f64,
    /// That over its 1-thread throughput.
    pub gpupool_large_shared_vs_1_thread: f64,
    /// Share of the wall time those threads were on a CPU.
    pub gpupool_large_shared_cpu_share: f64,
    /// The PyTorch port's operations per second with every thread on one
    /// stream.
    pub torch_large_shared_ops_per_sec: f64,
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

/// The project's performance targets, judged against the figures of `r`.
pub(super) fn targets(r: &BenchReport) -> Vec<Target> {
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
        push(
            "2 threads, large pairs: gpupool / gpupool 1 thread",
            ">= 1.8",
            row.gpupool_large_vs_1_thread,
            row.gpupool_large_vs_1_thread >= 1.8,
        );
    }
    if let Some(row) = r.threads.iter().find(|row| row.threads == 8) {
        push(
            "8 threads, large pairs: gpupool / gpupool 1 thread",
            ">= 1",
            row.gpupool_large_vs_1_thread,
            row.gpupool_large_vs_1_thread >= 1.0,
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
