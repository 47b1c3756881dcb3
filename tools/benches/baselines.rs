//! Criterion benchmarks of the baselines `gpupool bench` measures the pool
//! against (`gpupool_tools::bench::baselines`: a mutex best-fit pool and
//! `offset-allocator`): alloc + free pairs and 2-thread throughput, under
//! the group names of the pool's own benchmark (`benches/pool.rs` at the
//! repository root), so criterion's reports put them side by side.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use gpupool_tools::bench::baselines::{MutexBestFit, OffsetAllocatorPool};
use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const CAPACITY: u64 = 64 << 30;

fn baselines(c: &mut Criterion) {
    let a = MutexBestFit::new(CAPACITY);
    let mut g = c.benchmark_group("mutex_best_fit_pair");
    for size in [4 * KIB as u64, 4 * MIB as u64] {
        g.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, &size| {
            b.iter(|| a.free(black_box(a.alloc(size).unwrap())))
        });
    }
    g.finish();
    let o = OffsetAllocatorPool::new(CAPACITY);
    c.bench_function("offset_allocator_pair/4096", |b| {
        b.iter(|| o.free(black_box(o.alloc(4096).unwrap())))
    });
}

/// Each of `threads` threads runs `iters` calls of `pair(i)` after a common
/// barrier; returns the wall time from the barrier to the last end.
fn run_threads(threads: usize, iters: u64, pair: impl Fn(usize) + Sync) -> Duration {
    let barrier = Barrier::new(threads);
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..threads)
            .map(|i| {
                let (barrier, pair) = (&barrier, &pair);
                sc.spawn(move || {
                    barrier.wait();
                    let t0 = Instant::now();
                    for _ in 0..iters {
                        pair(i);
                    }
                    (t0, Instant::now())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let start = spans.iter().map(|s| s.0).min().unwrap();
    spans.iter().map(|s| s.1).max().unwrap() - start
}

fn two_threads(c: &mut Criterion) {
    const T: usize = 2;
    let a = MutexBestFit::new(CAPACITY);
    let mut g = c.benchmark_group("threads_2_pairs_4096");
    // One iteration = one pair on each thread.
    g.throughput(Throughput::Elements(T as u64));
    g.bench_function("mutex_best_fit", |b| {
        b.iter_custom(|iters| {
            run_threads(T, iters, |_| {
                a.free(black_box(a.alloc(4 * KIB as u64).unwrap()));
            })
        })
    });
    g.finish();
}

criterion_group!(benches, baselines, two_threads);
criterion_main!(benches);
