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

/// A 4 KiB pair through each door a caller can use: the Rust API (RAII
/// block), raw pointers, the C ABI and PyTorch's allocator hook (the
/// process-wide runtime of the C ABI, on the simulator).
fn doors(c: &mut Criterion) {
    use gpupool::ffi::{
        gpupool_alloc, gpupool_free, gpupool_init, gpupool_shutdown, gpupool_torch_free,
        gpupool_torch_malloc,
    };
    let rt = runtime();
    let dev = rt.device(0).unwrap();
    let s = dev.new_stream().unwrap();
    let mut g = c.benchmark_group("small_pair_4096_by_door");
    g.bench_function("rust_api", |b| {
        b.iter(|| black_box(dev.alloc(4 * KIB, &s).unwrap().ptr()))
    });
    g.bench_function("rust_raw", |b| {
        b.iter(|| {
            let p = dev.alloc_raw(4 * KIB, &s).unwrap();
            dev.free_raw(black_box(p), &s).unwrap()
        })
    });
    let conf = c"backend=sim,devices=1,backing=accounting,capacity=8GiB,maint_ms=0";
    // SAFETY: a NUL-terminated string that outlives the call.
    assert_eq!(unsafe { gpupool_init(conf.as_ptr()) }, 0);
    let null = std::ptr::null_mut();
    g.bench_function("c_abi", |b| {
        b.iter(|| {
            let mut p = null;
            // SAFETY: `p` is valid for one pointer write.
            assert_eq!(unsafe { gpupool_alloc(4 * KIB, 0, null, &mut p) }, 0);
            assert_eq!(gpupool_free(black_box(p), 0, null), 0);
        })
    });
    g.bench_function("torch_hook", |b| {
        b.iter(|| {
            let p = gpupool_torch_malloc(4 * KIB as libc::ssize_t, 0, null);
            assert!(!p.is_null());
            gpupool_torch_free(black_box(p), 4 * KIB as libc::ssize_t, 0, null);
        })
    });
    g.finish();
    assert_eq!(gpupool_shutdown(), 0);
}

criterion_group!(benches, gpupool_small, gpupool_large, two_threads, doors);
criterion_main!(benches);
