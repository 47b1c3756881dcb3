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
//! ranges. Prints the reuser's latency while the grower runs, for gpupool
//! and then for the PyTorch port in both modes (the same driver costs,
//! spent under its device mutex as PyTorch makes them).
//!
//! ```sh
//! cargo run --release --example map_stall -- 4    # GiB the grower takes
//! ```

use gpupool::backend::CostTable;
use gpupool::{PoolConfig, Runtime};
use gpupool_tools::bench::torch_peer::TorchPeer;
use gpupool_tools::trace::peers::TorchConfig;
use hdrhistogram::Histogram;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

const MIB: u64 = 1 << 20;

/// One allocator under test: alloc and free on a stream (0 or 1).
trait Under: Sync {
    fn alloc(&self, len: u64, stream: usize) -> gpupool::Result<u64>;
    fn free(&self, addr: u64, stream: usize) -> gpupool::Result<()>;
}

struct Pool<'a> {
    pool: &'a gpupool::DevicePool,
    streams: [gpupool::Stream; 2],
}

impl Under for Pool<'_> {
    fn alloc(&self, len: u64, stream: usize) -> gpupool::Result<u64> {
        Ok(self.pool.alloc_raw(len as usize, &self.streams[stream])?.0)
    }
    fn free(&self, addr: u64, stream: usize) -> gpupool::Result<()> {
        self.pool
            .free_raw(gpupool::DevicePtr(addr), &self.streams[stream])
    }
}

impl Under for TorchPeer {
    fn alloc(&self, len: u64, stream: usize) -> gpupool::Result<u64> {
        TorchPeer::alloc(self, 0, len, stream as u64 + 1)
    }
    fn free(&self, addr: u64, _stream: usize) -> gpupool::Result<()> {
        TorchPeer::free(self, addr)
    }
}

/// The grower's time, and the reuser's latencies while it grew.
fn run(a: &dyn Under, gib: u64) -> gpupool::Result<(f64, Histogram<u64>)> {
    // The reuser's memory, backed up front: two 16 MiB blocks held, then
    // freed (every request of the reuser fits one).
    let warm: Vec<u64> = (0..2)
        .map(|_| a.alloc(16 * MIB, 1))
        .collect::<gpupool::Result<_>>()?;
    for p in warm {
        a.free(p, 1)?;
    }
    let growing = AtomicBool::new(true);
    let mut hist = Histogram::<u64>::new(3).expect("histogram");
    let grow_ms = std::thread::scope(|s| -> gpupool::Result<f64> {
        let grower = s.spawn(|| -> gpupool::Result<f64> {
            let t = Instant::now();
            let mut held = Vec::new();
            for _ in 0..gib * 16 {
                held.push(a.alloc(64 * MIB, 0)?);
            }
            let ms = t.elapsed().as_secs_f64() * 1e3;
            growing.store(false, Relaxed);
            for p in held {
                a.free(p, 0)?;
            }
            Ok(ms)
        });
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        while growing.load(Relaxed) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = ((x % 16) + 1) * MIB;
            let t = Instant::now();
            let p = a.alloc(len, 1)?;
            a.free(p, 1)?;
            hist.record(t.elapsed().as_nanos() as u64)
                .expect("in range");
        }
        grower.join().expect("grower")
    })?;
    Ok((grow_ms, hist))
}

fn main() -> gpupool::Result<()> {
    let gib: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    let cfg = PoolConfig::parse(
        "backend=sim,devices=1,capacity=64GiB,backing=accounting,driver_time=spent",
    )?;
    let rt = Runtime::builder().config(cfg).maintenance(false).build()?;
    let pool = rt.device(0)?;
    let gpupool = Pool {
        pool,
        streams: [pool.new_stream()?, pool.new_stream()?],
    };
    let torch = |expandable| {
        TorchPeer::new(
            1,
            TorchConfig {
                capacity_bytes: 64 << 30,
                driver_time: Some(Arc::new(CostTable::h200())),
                ..TorchConfig::with_mode(expandable)
            },
        )
    };
    let (default, expandable) = (torch(false), torch(true));
    let runs: [(&str, &dyn Under); 3] = [
        ("gpupool", &gpupool),
        ("PyTorch default", &default),
        ("PyTorch expandable", &expandable),
    ];
    for (name, a) in runs {
        let (grow_ms, hist) = run(a, gib)?;
        let us = |q: f64| hist.value_at_quantile(q) as f64 / 1e3;
        println!(
            "{name}: grower {gib} GiB in {grow_ms:.1} ms; reuser {} pairs, p50 {:.2} µs, p99 {:.1} µs, p99.9 {:.1} µs, max {:.1} µs, over 100 µs: {}",
            hist.len(),
            us(0.5),
            us(0.99),
            us(0.999),
            hist.max() as f64 / 1e3,
            hist.count_between(100_000, u64::MAX),
        );
    }
    Ok(())
}
