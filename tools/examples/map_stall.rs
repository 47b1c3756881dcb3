//! How long a stream's reuse waits while another thread grows the device:
//! the figure for mapping outside the heap lock (docs/BENCHMARKS.md §4,
//! `pool/heap/map_job.rs`).
//!
//! One simulated device with driver time spent (each call takes its H200
//! cost on the calling thread: `cuMemCreate` 6.5 µs, `cuMemMap` 19.7 µs
//! per 2 MiB chunk). A *grower* thread allocates fresh 64 MiB blocks on
//! its stream and keeps them (32 chunks created and mapped each); a
//! *reuser* thread, on its own stream, allocates and frees blocks of
//! 1-16 MiB inside memory it already backs, whose sizes vary so that most
//! requests go to the heap (its lock) rather than the stream's parked
//! ranges. Prints the reuser's latency while the grower runs.
//!
//! ```sh
//! cargo run --release --example map_stall -- 4    # GiB the grower takes
//! ```

use gpupool::{DevicePtr, PoolConfig, Runtime};
use hdrhistogram::Histogram;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::Instant;

const MIB: usize = 1 << 20;

fn main() -> gpupool::Result<()> {
    let gib: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    let cfg = PoolConfig::parse(
        "backend=sim,devices=1,capacity=64GiB,backing=accounting,driver_time=spent",
    )?;
    let rt = Runtime::builder().config(cfg).maintenance(false).build()?;
    let pool = rt.device(0)?;
    let (grow_s, reuse_s) = (pool.new_stream()?, pool.new_stream()?);
    // The reuser's memory, backed up front: 32 MiB held, then freed.
    let warm: Vec<DevicePtr> = (0..4)
        .map(|_| pool.alloc_raw(8 * MIB, &reuse_s))
        .collect::<gpupool::Result<_>>()?;
    for p in warm {
        pool.free_raw(p, &reuse_s)?;
    }
    let growing = AtomicBool::new(true);
    let mut hist = Histogram::<u64>::new(3).expect("histogram");
    let mut grow_ms = 0.0;
    std::thread::scope(|s| -> gpupool::Result<()> {
        let grower = s.spawn(|| -> gpupool::Result<f64> {
            let t = Instant::now();
            let mut held = Vec::new();
            for _ in 0..gib * 16 {
                held.push(pool.alloc_raw(64 * MIB, &grow_s)?);
            }
            let ms = t.elapsed().as_secs_f64() * 1e3;
            growing.store(false, Relaxed);
            for p in held {
                pool.free_raw(p, &grow_s)?;
            }
            Ok(ms)
        });
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        while growing.load(Relaxed) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = ((x % 16) as usize + 1) * MIB;
            let t = Instant::now();
            let p = pool.alloc_raw(len, &reuse_s)?;
            pool.free_raw(p, &reuse_s)?;
            hist.record(t.elapsed().as_nanos() as u64)
                .expect("in range");
        }
        grow_ms = grower.join().expect("grower")?;
        Ok(())
    })?;
    let us = |q: f64| hist.value_at_quantile(q) as f64 / 1e3;
    println!(
        "grower: {gib} GiB in {grow_ms:.1} ms; reuser: {} pairs, p50 {:.2} µs, p99 {:.1} µs, p99.9 {:.1} µs, max {:.1} µs, over 100 µs: {}",
        hist.len(),
        us(0.5),
        us(0.99),
        us(0.999),
        hist.max() as f64 / 1e3,
        hist.count_between(100_000, u64::MAX),
    );
    Ok(())
}
