//! What every measurement runs on: the iteration [`Plan`] of a run, a
//! seeded generator ([`Rng`]) so that every allocator sees the same
//! requests, the medians, and the pools: gpupool on one simulated device in
//! accounting mode ([`sim_runtime`]), whose driver calls are tallied per
//! thread ([`Tallied`]), and the PyTorch port ([`torch_peer_pool`]).

use super::torch_peer::TorchPeer;
use super::CAPACITY_BYTES;
use crate::trace::peers::TorchConfig;
use gpupool::backend::sim::SimBacking;
use gpupool::config::{BackendKind, PoolConfig, SimConfig};
use gpupool::runtime::Runtime;
use gpupool::{Error, Result};

/// Iteration counts of one run.
#[derive(Debug, Clone)]
pub(super) struct Plan {
    pub(super) samples: usize,
    pub(super) batch: usize,
    pub(super) warmup: usize,
    pub(super) gpupool_thread_pairs: u64,
    pub(super) mutex_thread_pairs: u64,
    pub(super) thread_reps: usize,
    pub(super) random: &'static [(u64, usize)],
}

impl Plan {
    pub(super) fn new(quick: bool) -> Plan {
        if quick {
            Plan {
                samples: 15,
                batch: 200,
                warmup: 1_000,
                gpupool_thread_pairs: 20_000,
                mutex_thread_pairs: 5_000,
                thread_reps: 1,
                random: &[(1_000, 1), (10_000, 1)],
            }
        } else {
            Plan {
                samples: 301,
                batch: 1_000,
                warmup: 20_000,
                gpupool_thread_pairs: 2_000_000,
                mutex_thread_pairs: 300_000,
                thread_reps: 5,
                random: &[(1_000, 51), (10_000, 11), (100_000, 5)],
            }
        }
    }
}

/// A small, fast, seeded generator (SplitMix64), so that runs repeat exactly
/// and every allocator sees the same request sequence.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    #[inline]
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    #[inline]
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

/// The median of `v` (sorted in place; the upper one of an even count).
pub(super) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The error a baseline allocator's `None` becomes.
pub(super) fn baseline_oom(which: &'static str) -> Error {
    Error::backend(which, "baseline allocator out of memory")
}

thread_local! {
    /// Driver calls of the benchmark pools dropped on this thread so far
    /// (each `run` reads its own thread's tally, so parallel runs in tests
    /// do not mix).
    pub(super) static DRIVER: std::cell::RefCell<gpupool::backend::BackendCounters> =
        std::cell::RefCell::default();
}

/// A benchmark's runtime: when dropped, its backend's driver calls are
/// added to this thread's tally ([`BenchReport::driver_calls`](super::BenchReport::driver_calls)).
pub(crate) struct Tallied(Runtime);

impl std::ops::Deref for Tallied {
    type Target = Runtime;
    fn deref(&self) -> &Runtime {
        &self.0
    }
}

impl Drop for Tallied {
    fn drop(&mut self) {
        let c = self.0.backend().counters();
        DRIVER.with(|d| d.borrow_mut().add(&c));
    }
}

/// A pool on one simulated device in accounting mode.
pub(super) fn sim_runtime() -> Result<Tallied> {
    Runtime::builder()
        .backend(BackendKind::Sim(SimConfig {
            devices: 1,
            capacity_bytes: CAPACITY_BYTES,
            backing: SimBacking::Accounting,
            ..Default::default()
        }))
        .config(PoolConfig::default())
        .build()
        .map(Tallied)
}

/// The PyTorch port on one simulated device of [`CAPACITY_BYTES`], default
/// settings.
pub(super) fn torch_peer_pool() -> TorchPeer {
    TorchPeer::new(
        1,
        TorchConfig {
            capacity_bytes: CAPACITY_BYTES,
            ..TorchConfig::default()
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_is_uniform_enough() {
        let mut r = Rng::new(3);
        let mut counts = [0u32; 10];
        for _ in 0..100_000 {
            counts[r.below(10) as usize] += 1;
        }
        for c in counts {
            assert!((9_000..11_000).contains(&c), "{counts:?}");
        }
    }
}
