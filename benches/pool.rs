//! Criterion benchmarks of the pool's alloc + free pairs: the small path
//! per size class sample, the large path on a cached range, and 2-thread
//! throughput. All pools run on the simulator in accounting mode. The same
//! pairs measured against the benchmark baselines (a mutex best-fit pool,
//! `offset-allocator`) are the tools crate's (`tools/benches/baselines.rs`,
//! same group names); `gpupool bench` reports all of them in one run.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use gpupool::backend::sim::{SimBacking, SimConfig};
use gpupool::{BackendKind, PoolConfig, Runtime};
use std::hint::black_box;

mod common;
use common::run_threads;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const CAPACITY: u64 = 64 << 30;

fn runtime() -> Runtime {
    Runtime::builder()
        .backend(BackendKind::Sim(SimConfig {
            devices: 1,
            capacity_bytes: CAPACITY,
            backing: SimBacking::Accounting,
            ..Default::default()
        }))
        .config(PoolConfig::default())
        .build()
        .expect("simulated runtime")
}

fn gpupool_small(c: &mut Criterion) {
    let rt = runtime();
    let dev = rt.device(0).unwrap();
    let s = dev.new_stream().unwrap();
    let mut g = c.benchmark_group("gpupool_small_pair");
    for size in [256, 4 * KIB, 64 * KIB, 256 * KIB] {
        g.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, &size| {
            b.iter(|| black_box(dev.alloc(size, &s).unwrap().ptr()))
        });
    }
    g.finish();
}

fn gpupool_large(c: &mut Criterion) {
    let rt = runtime();
    let dev = rt.device(0).unwrap();
    let s = dev.new_stream().unwrap();
    let mut g = c.benchmark_group("gpupool_large_cached_pair");
    for size in [4 * MIB, 64 * MIB] {
        // Free the range on `s` once: every measured pair reuses it.
        drop(dev.alloc(size, &s).unwrap());
        g.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, &size| {
            b.iter(|| black_box(dev.alloc(size, &s).unwrap().ptr()))
        });
    }
    g.finish();
}

fn two_threads(c: &mut Criterion) {
    const T: usize = 2;
    let rt = runtime();
    let dev = rt.device(0).unwrap();
    let streams: Vec<_> = (0..T).map(|_| dev.new_stream().unwrap()).collect();
    for s in &streams {
        drop(dev.alloc(4 * KIB, s).unwrap());
    }
    let mut g = c.benchmark_group("threads_2_pairs_4096");
    // One iteration = one pair on each thread.
    g.throughput(Throughput::Elements(T as u64));
    g.bench_function("gpupool", |b| {
        b.iter_custom(|iters| {
            run_threads(T, iters, |i| {
                black_box(dev.alloc(4 * KIB, &streams[i]).unwrap().ptr());
            })
        })
    });
    g.finish();
}

criterion_group!(benches, gpupool_small, gpupool_large, two_threads);
criterion_main!(benches);
