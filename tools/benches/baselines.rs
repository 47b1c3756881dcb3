//! Criterion benchmarks of the baselines `gpupool bench` measures the pool
//! against (`gpupool_tools::bench::baselines`: a mutex best-fit pool and
//! `offset-allocator`): alloc + free pairs and 2-thread throughput, under
//! the group names of the pool's own benchmark (`benches/pool.rs` at the
//! repository root), so criterion's reports put them side by side.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use gpupool_tools::bench::baselines::{MutexBestFit, OffsetAllocatorPool};
use std::hint::black_box;

#[path = "../../benches/common/mod.rs"]
mod common;
use common::run_threads;

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
