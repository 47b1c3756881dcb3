//! RAPIDS RMM's `multi_stream_allocations` benchmark on the simulator.
//!
//! RMM's version (`benchmarks/multi_stream_allocations`): a pool of
//! `streams` CUDA streams; each benchmark iteration launches `kernels` = 4
//! kernels, kernel `i` on stream `i % streams`, each preceded by an 8-byte
//! allocation on that stream (`device_uvector<int64_t>(1)`) that the kernel
//! writes and that is freed on the same stream right after the launch; the
//! iteration ends with `cudaDeviceSynchronize`. The kernel spins for 10^6
//! clock cycles (about 0.5 ms). Optionally every stream is "prewarmed" with
//! one allocation first. Google Benchmark reports time per iteration and
//! items (kernels) per second; a stream-ordered pool lets the kernels of
//! different streams overlap, an allocator that syncs on free serializes
//! them.
//!
//! Here the kernel is a simulated one that sleeps [`KERNEL`] on its
//! stream's worker and then writes the 8 bytes; `ns_per_op` is the wall time
//! over kernels (one alloc + free each), as RMM's items per second inverted.
//! `host_ns_per_op` is the time the host spent inside the pool's alloc and
//! free calls per kernel, which is what the allocator itself costs.
//! The baseline, [`MutexBestFit`], keeps no stream order, so — like
//! `cudaFree`, RMM's `cuda_memory_resource` — it must wait for the stream
//! before each free to stay correct; its row shows what that does to the
//! overlap.

use super::baselines::MutexBestFit;
use super::harness::{baseline_oom, sim_runtime};
use super::CAPACITY_BYTES;
use gpupool::backend::sim::{KernelOp, SimBackend};
use gpupool::backend::Backend;
use gpupool::DevicePtr;
use gpupool::{Error, Result};
use std::time::{Duration, Instant};

/// Run time of the simulated compute-bound kernel (RMM's 10^6 cycles at
/// about 2 GHz).
pub const KERNEL: Duration = Duration::from_micros(500);
/// Kernels per iteration (RMM's `num_kernels`).
pub const KERNELS: usize = 4;
/// Bytes per allocation (`device_uvector<int64_t>(1)`).
pub const BYTES: usize = 8;
/// Stream counts measured (RMM's range 1..=4, multiplier 2).
pub const STREAMS: [usize; 3] = [1, 2, 4];

/// One row of the multi_stream_allocations table.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct MultiStreamRow {
    /// Streams in the pool.
    pub streams: usize,
    /// Whether each stream got one allocation before timing.
    pub prewarm: bool,
    /// gpupool: wall nanoseconds per kernel (alloc + kernel + free).
    pub ns_per_op: f64,
    /// gpupool: host nanoseconds inside alloc + free per kernel.
    pub host_ns_per_op: f64,
    /// gpupool: host-blocking syncs made inside alloc and free (0: the
    /// pool never waits for a kernel, which is what lets streams overlap).
    pub host_syncs_on_alloc_path: u64,
    /// gpupool: allocations of the timed loop that needed new device
    /// memory.
    pub grown_allocs: u64,
    /// The mutex baseline, waiting for the stream before each free.
    pub mutex_best_fit_ns_per_op: f64,
    /// Iterations timed.
    pub iterations: usize,
    /// Kernels per iteration.
    pub kernels: usize,
    /// Simulated kernel time in nanoseconds.
    pub kernel_ns: u64,
}

fn sim(be: &dyn Backend) -> Result<&SimBackend> {
    be.as_any().downcast_ref::<SimBackend>().ok_or_else(|| {
        Error::InvalidArgument("multi_stream_allocations needs the simulator".into())
    })
}

fn kernel(sim: &SimBackend, stream: gpupool::StreamHandle, ptr: DevicePtr) -> Result<()> {
    sim.launch_kernel(
        0,
        stream,
        ptr,
        BYTES as u64,
        KERNEL,
        KernelOp::WritePattern { seed: 1 },
    )
}

/// What one gpupool measurement gives.
struct PoolRun {
    ns_per_op: f64,
    host_ns_per_op: f64,
    host_syncs: u64,
    grown: u64,
}

/// gpupool: wall and host time per kernel, host syncs inside alloc and
/// free, allocations that grew the pool.
fn gpupool(streams: usize, prewarm: bool, iterations: usize) -> Result<PoolRun> {
    let rt = sim_runtime()?;
    let dev = rt.device(0)?;
    let sim = sim(rt.backend().as_ref())?;
    let pool: Vec<_> = (0..streams)
        .map(|_| dev.new_stream())
        .collect::<Result<_>>()?;
    if prewarm {
        let warm: Vec<_> = pool
            .iter()
            .map(|s| dev.alloc(BYTES, s))
            .collect::<Result<_>>()?;
        drop(warm);
    }
    let syncs = || sim.counters().host_syncs_of(0);
    let grown0 = dev.stats().num_allocs_grown;
    let mut host = Duration::ZERO;
    let mut host_syncs = 0;
    let start = Instant::now();
    for _ in 0..iterations {
        for i in 0..KERNELS {
            let s = &pool[i % streams];
            let (t, n) = (Instant::now(), syncs());
            let b = dev.alloc(BYTES, s)?;
            host += t.elapsed();
            host_syncs += syncs() - n;
            kernel(sim, s.handle(), b.ptr())?;
            let (t, n) = (Instant::now(), syncs());
            drop(b);
            host += t.elapsed();
            host_syncs += syncs() - n;
        }
        for s in &pool {
            sim.sync_stream(0, s.handle())?;
        }
    }
    let ops = (iterations * KERNELS) as f64;
    Ok(PoolRun {
        ns_per_op: start.elapsed().as_nanos() as f64 / ops,
        host_ns_per_op: host.as_nanos() as f64 / ops,
        host_syncs,
        grown: dev.stats().num_allocs_grown - grown0,
    })
}

/// The baseline: no stream order, so each free first waits for its stream.
fn baseline(streams: usize, prewarm: bool, iterations: usize) -> Result<f64> {
    let rt = sim_runtime()?;
    let dev = rt.device(0)?;
    let sim = sim(rt.backend().as_ref())?;
    let pool: Vec<_> = (0..streams)
        .map(|_| dev.new_stream())
        .collect::<Result<_>>()?;
    let bf = MutexBestFit::new(CAPACITY_BYTES);
    let alloc = || {
        bf.alloc(BYTES as u64)
            .ok_or_else(|| baseline_oom("mutex_best_fit"))
    };
    if prewarm {
        let warm: Vec<_> = pool.iter().map(|_| alloc()).collect::<Result<_>>()?;
        for a in warm {
            bf.free(a);
        }
    }
    let start = Instant::now();
    for _ in 0..iterations {
        for i in 0..KERNELS {
            let s = &pool[i % streams];
            let a = alloc()?;
            kernel(sim, s.handle(), DevicePtr(a))?;
            sim.sync_stream(0, s.handle())?;
            bf.free(a);
        }
        for s in &pool {
            sim.sync_stream(0, s.handle())?;
        }
    }
    Ok(start.elapsed().as_nanos() as f64 / (iterations * KERNELS) as f64)
}

/// The table: streams 1, 2, 4, without and with prewarming.
pub fn table(quick: bool) -> Result<Vec<MultiStreamRow>> {
    let iterations = if quick { 5 } else { 100 };
    let mut rows = Vec::new();
    for prewarm in [false, true] {
        for streams in STREAMS {
            let g = gpupool(streams, prewarm, iterations)?;
            rows.push(MultiStreamRow {
                streams,
                prewarm,
                ns_per_op: g.ns_per_op,
                host_ns_per_op: g.host_ns_per_op,
                host_syncs_on_alloc_path: g.host_syncs,
                grown_allocs: g.grown,
                mutex_best_fit_ns_per_op: baseline(streams, prewarm, iterations)?,
                iterations,
                kernels: KERNELS,
                kernel_ns: KERNEL.as_nanos() as u64,
            });
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What holds in every interleaving: gpupool's alloc and free never
    /// wait for a kernel (the reason its streams can overlap) and a
    /// prewarmed pool never grows, while the syncing baseline runs one
    /// kernel at a time; every kernel runs, at most `streams` at once.
    /// How much the streams overlapped and the host's time per operation
    /// are wall-clock figures of `gpupool bench` (BENCHMARKS.md), not
    /// judged here: on loaded cores a preempted thread's time counts
    /// as host time.
    #[test]
    fn gpupool_never_waits_on_free_and_the_syncing_baseline_serializes() {
        let k = KERNEL.as_nanos() as f64;
        let rows = table(true).unwrap();
        assert_eq!(rows.len(), 6);
        for r in &rows {
            assert_eq!(r.iterations, 5);
            assert_eq!(r.kernels, KERNELS);
            assert_eq!(r.host_syncs_on_alloc_path, 0, "{r:?}");
            if r.prewarm {
                assert_eq!(r.grown_allocs, 0, "{r:?}");
            }
            // Lower bounds: kernels sleep KERNEL each, `streams` at a time
            // at best; the baseline waits for each before its free.
            assert!(r.ns_per_op >= k / r.streams as f64 * 0.9, "{r:?}");
            assert!(r.mutex_best_fit_ns_per_op >= k * 0.95, "{r:?}");
            assert!(r.host_ns_per_op > 0.0, "{r:?}");
        }
    }
}
