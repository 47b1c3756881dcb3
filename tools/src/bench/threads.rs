//! The `threads` measurement: throughput of alloc + free pairs on 1..=N
//! threads, gpupool (each thread on its own stream of one shared pool)
//! against the mutex baseline and the PyTorch port (each behind one lock),
//! with the share of the wall time the threads were on a CPU. Small pairs
//! are 4 KiB. Large pairs come as steps, as in a training loop: each call
//! allocates one block of every size of [`LARGE_PAIR_BYTES`] (3–24 MiB),
//! then frees them all, so every later step reuses the ranges its
//! thread's stream freed; the PyTorch port does the same. The large pairs
//! run twice: each thread on its own stream, and every thread on one
//! stream (a server's threads on the default stream).

use super::baselines::MutexBestFit;
use super::harness::{baseline_oom, sim_runtime, torch_peer_pool, Plan};
use super::host::thread_cpu_secs;
use super::report::ThreadsRow;
use super::{CAPACITY_BYTES, MIB, SMALL_BYTES};
use gpupool::pool::DevicePool;
use gpupool::Result;
use std::hint::black_box;
use std::sync::Barrier;
use std::time::Instant;

/// Sizes of the large pairs: one block of each per step.
pub const LARGE_PAIR_BYTES: [u64; 6] = [3 * MIB, 5 * MIB, 8 * MIB, 12 * MIB, 16 * MIB, 24 * MIB];

/// Throughput of one timed thread run.
#[derive(Debug, Clone, Copy)]
struct Throughput {
    ops_per_sec: f64,
    /// Thread CPU time over (threads x wall time).
    cpu_share: f64,
}

/// Runs `calls` calls of `pairs(i)`, each making `per_call` alloc + free
/// pairs, on each of `threads` threads after a common barrier; returns
/// operations (2 per pair) per second and the share of the wall time the
/// threads spent on a CPU.
fn timed_threads(
    threads: usize,
    warmup: usize,
    (calls, per_call): (u64, u64),
    pairs: impl Fn(usize) -> Result<()> + Sync,
) -> Result<Throughput> {
    let barrier = Barrier::new(threads);
    let spans = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..threads)
            .map(|i| {
                let (barrier, pairs) = (&barrier, &pairs);
                sc.spawn(move || -> Result<(Instant, Instant, f64)> {
                    let warm = (0..warmup).try_for_each(|_| pairs(i));
                    // Everyone reaches the barrier, even after an error.
                    barrier.wait();
                    warm?;
                    let (t0, c0) = (Instant::now(), thread_cpu_secs());
                    for _ in 0..calls {
                        pairs(i)?;
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
        ops_per_sec: 2.0 * (calls * per_call) as f64 * threads as f64 / secs,
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
        timed_threads(threads, plan.warmup, (plan.gpupool_thread_pairs, 1), |i| {
            let b = dev.alloc(SMALL_BYTES as usize, &streams[i])?;
            black_box(b.ptr());
            Ok(())
        })
    })
}

/// Pairs per large step.
const STEP: u64 = LARGE_PAIR_BYTES.len() as u64;

/// Large steps per thread and run.
fn large_steps(plan: &Plan) -> u64 {
    plan.gpupool_thread_pairs / STEP / 2
}

/// Which streams the threads of a large-pair run use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Streams {
    /// Each thread its own stream (a stream per worker or per request).
    Own,
    /// All threads one stream (threads of a server on the default stream).
    Shared,
}

fn gpupool_large_threads(
    dev: &DevicePool,
    plan: &Plan,
    threads: usize,
    mode: Streams,
) -> Result<Throughput> {
    let n = if mode == Streams::Own { threads } else { 1 };
    let streams = (0..n)
        .map(|_| dev.new_stream())
        .collect::<Result<Vec<_>>>()?;
    median_of(plan.thread_reps, || {
        timed_threads(threads, 1, (large_steps(plan), STEP), |i| {
            let s = &streams[i % n];
            let mut held = [const { None }; LARGE_PAIR_BYTES.len()];
            for (h, &n) in held.iter_mut().zip(&LARGE_PAIR_BYTES) {
                *h = Some(black_box(dev.alloc(n as usize, s)?));
            }
            drop(held);
            Ok(())
        })
    })
}

fn torch_large_threads(plan: &Plan, threads: usize, mode: Streams) -> Result<Throughput> {
    let torch = torch_peer_pool();
    median_of(plan.thread_reps, || {
        timed_threads(threads, 1, (large_steps(plan), STEP), |t| {
            let stream = if mode == Streams::Own {
                t as u64 + 1
            } else {
                1
            };
            let mut held = [0u64; LARGE_PAIR_BYTES.len()];
            for (h, &n) in held.iter_mut().zip(&LARGE_PAIR_BYTES) {
                *h = black_box(torch.alloc(0, n, stream)?);
            }
            held.into_iter().try_for_each(|a| torch.free(a))
        })
    })
}

fn mutex_threads(plan: &Plan, threads: usize) -> Result<Throughput> {
    let a = MutexBestFit::new(CAPACITY_BYTES);
    median_of(plan.thread_reps, || {
        timed_threads(threads, plan.warmup, (plan.mutex_thread_pairs, 1), |_| {
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
        timed_threads(threads, plan.warmup, (plan.mutex_thread_pairs, 1), |t| {
            let a = torch.alloc(0, SMALL_BYTES, t as u64 + 1)?;
            torch.free(black_box(a))
        })
    })
}

/// The thread table, 1..=`max_threads` threads.
pub(super) fn threads_table(plan: &Plan, max_threads: usize) -> Result<Vec<ThreadsRow>> {
    let rt = sim_runtime()?;
    let dev = rt.device(0)?;
    let mut rows: Vec<ThreadsRow> = Vec::new();
    for t in 1..=max_threads {
        let locks0 = dev.stats().heap_lock_acquisitions;
        let g = gpupool_threads(dev, plan, t)?;
        // Every operation of the measured runs and their warm-ups.
        let ops = 2
            * t as u64
            * plan.thread_reps.max(1) as u64
            * (plan.warmup as u64 + plan.gpupool_thread_pairs);
        let locks = dev.stats().heap_lock_acquisitions - locks0;
        let locks0 = dev.stats().heap_lock_acquisitions;
        let gl = gpupool_large_threads(dev, plan, t, Streams::Own)?;
        let large_ops =
            2 * t as u64 * plan.thread_reps.max(1) as u64 * (1 + large_steps(plan)) * STEP;
        let large_locks = dev.stats().heap_lock_acquisitions - locks0;
        let m = mutex_threads(plan, t)?;
        let tp = torch_threads(plan, t)?;
        let tl = torch_large_threads(plan, t, Streams::Own)?;
        let gs = gpupool_large_threads(dev, plan, t, Streams::Shared)?;
        let ts = torch_large_threads(plan, t, Streams::Shared)?;
        let (g1, m1, gl1, gs1) = rows.first().map_or(
            (g.ops_per_sec, m.ops_per_sec, gl.ops_per_sec, gs.ops_per_sec),
            |r| {
                (
                    r.gpupool_ops_per_sec,
                    r.mutex_best_fit_ops_per_sec,
                    r.gpupool_large_ops_per_sec,
                    r.gpupool_large_shared_ops_per_sec,
                )
            },
        );
        rows.push(ThreadsRow {
            threads: t,
            gpupool_ops_per_sec: g.ops_per_sec,
            gpupool_heap_locks_per_op: locks as f64 / ops.max(1) as f64,
            mutex_best_fit_ops_per_sec: m.ops_per_sec,
            torch_ops_per_sec: tp.ops_per_sec,
            gpupool_vs_torch: g.ops_per_sec / tp.ops_per_sec,
            gpupool_vs_1_thread: g.ops_per_sec / g1,
            gpupool_vs_mutex: g.ops_per_sec / m.ops_per_sec,
            mutex_vs_1_thread: m.ops_per_sec / m1,
            gpupool_cpu_share: g.cpu_share,
            mutex_best_fit_cpu_share: m.cpu_share,
            gpupool_large_ops_per_sec: gl.ops_per_sec,
            gpupool_large_heap_locks_per_op: large_locks as f64 / large_ops.max(1) as f64,
            gpupool_large_vs_1_thread: gl.ops_per_sec / gl1,
            gpupool_large_cpu_share: gl.cpu_share,
            torch_large_ops_per_sec: tl.ops_per_sec,
            gpupool_large_vs_torch: gl.ops_per_sec / tl.ops_per_sec,
            gpupool_large_shared_ops_per_sec: gs.ops_per_sec,
            gpupool_large_shared_vs_1_thread: gs.ops_per_sec / gs1,
            gpupool_large_shared_cpu_share: gs.cpu_share,
            torch_large_shared_ops_per_sec: ts.ops_per_sec,
        });
    }
    Ok(rows)
}
