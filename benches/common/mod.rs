//! Shared by the criterion benchmarks of both crates (`benches/pool.rs`
//! here, `tools/benches/baselines.rs`, which includes this file by path).

use std::sync::Barrier;
use std::time::{Duration, Instant};

/// Each of `threads` threads runs `iters` calls of `pair(i)` after a common
/// barrier; returns the wall time from the barrier to the last end.
pub fn run_threads(threads: usize, iters: u64, pair: impl Fn(usize) + Sync) -> Duration {
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
