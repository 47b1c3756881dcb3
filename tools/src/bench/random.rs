//! The `random_allocations` measurement, RAPIDS RMM's benchmark: random
//! sizes in `[1, RANDOM_MAX_BYTES]`, 73% allocs under a live-byte cap, on
//! gpupool, the mutex baseline and the PyTorch port, each driven through
//! [`RandomTarget`] with the same seeded request sequence.

use super::baselines::MutexBestFit;
use super::harness::{median, sim_runtime, torch_peer_pool, Plan, Rng};
use super::report::RandomAllocationsRow;
use super::torch_peer::TorchPeer;
use super::{CAPACITY_BYTES, RANDOM_MAX_BYTES, RANDOM_MAX_USAGE};
use gpupool::pool::{Block, DevicePool};
use gpupool::Result;
use std::time::Instant;

/// An allocator driven by [`random_allocations`].
/// What `random_allocations` drives. A handle knows its size, as RMM's
/// loop keeps `{pointer, size}` per live allocation.
trait RandomTarget {
    type Handle;
    /// `Ok(None)`: out of memory (the step frees instead, as in RMM).
    fn alloc(&mut self, size: u64) -> Result<Option<Self::Handle>>;
    fn size(h: &Self::Handle) -> u64;
    fn free(&mut self, h: Self::Handle);
}

struct GpupoolTarget<'a> {
    dev: &'a DevicePool,
    stream: &'a gpupool::pool::Stream,
}

impl<'a> RandomTarget for GpupoolTarget<'a> {
    type Handle = Block<'a>;
    fn alloc(&mut self, size: u64) -> Result<Option<Block<'a>>> {
        match self.dev.alloc(size as usize, self.stream) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.is_oom() => Ok(None),
            Err(e) => Err(e),
        }
    }
    fn size(h: &Block<'a>) -> u64 {
        h.size() as u64
    }
    fn free(&mut self, h: Block<'a>) {
        drop(h);
    }
}

impl RandomTarget for &MutexBestFit {
    /// `(address, size)`, RMM's pair.
    type Handle = (u64, u64);
    fn alloc(&mut self, size: u64) -> Result<Option<(u64, u64)>> {
        Ok(MutexBestFit::alloc(self, size).map(|a| (a, size)))
    }
    fn size(h: &(u64, u64)) -> u64 {
        h.1
    }
    fn free(&mut self, h: (u64, u64)) {
        MutexBestFit::free(self, h.0);
    }
}

impl RandomTarget for &TorchPeer {
    /// `(address, size)`.
    type Handle = (u64, u64);
    fn alloc(&mut self, size: u64) -> Result<Option<(u64, u64)>> {
        match TorchPeer::alloc(self, 0, size, 0) {
            Ok(a) => Ok(Some((a, size))),
            Err(e) if e.is_oom() => Ok(None),
            Err(e) => Err(e),
        }
    }
    fn size(h: &(u64, u64)) -> u64 {
        h.1
    }
    fn free(&mut self, h: (u64, u64)) {
        TorchPeer::free(self, h.0).expect("the torch peer frees what it handed out");
    }
}

/// One run of RMM's random_allocations; returns (operations, seconds).
fn random_allocations<T: RandomTarget>(t: &mut T, n: u64, seed: u64) -> Result<(u64, f64)> {
    const ALLOC_PERCENT: u64 = 73;
    let mut rng = Rng::new(seed);
    let mut live: Vec<T::Handle> = Vec::with_capacity(n as usize);
    let (mut count, mut bytes, mut ops) = (0u64, 0u64, 0u64);
    let start = Instant::now();
    for _ in 0..2 * n {
        let size = 1 + rng.below(RANDOM_MAX_BYTES);
        let do_alloc = live.is_empty()
            || (rng.below(100) < ALLOC_PERCENT && count < n && bytes + size < RANDOM_MAX_USAGE);
        if do_alloc {
            ops += 1;
            if let Some(h) = t.alloc(size)? {
                live.push(h);
                count += 1;
                bytes += size;
                continue;
            }
        }
        if !live.is_empty() {
            let i = rng.below(live.len() as u64) as usize;
            let h = live.swap_remove(i);
            bytes -= T::size(&h);
            t.free(h);
            ops += 1;
        }
    }
    for h in live.drain(..) {
        t.free(h);
        ops += 1;
    }
    Ok((ops, start.elapsed().as_secs_f64()))
}

/// Warm-up run, then the median ns/op of `reps` timed runs.
fn random_ns_per_op<T: RandomTarget>(t: &mut T, n: u64, reps: usize) -> Result<(u64, f64)> {
    const SEED: u64 = 0x05EE_D0FA_110C;
    random_allocations(t, n, SEED)?;
    let mut ops = 0;
    let mut v = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let (o, secs) = random_allocations(t, n, SEED)?;
        ops = o;
        v.push(secs * 1e9 / o.max(1) as f64);
    }
    Ok((ops, median(&mut v)))
}

/// The random_allocations table, one row per `n` of the plan.
pub(super) fn random_table(plan: &Plan) -> Result<Vec<RandomAllocationsRow>> {
    let mut rows = Vec::new();
    for &(n, reps) in plan.random {
        // A fresh pool and baseline per n, as RMM builds its resource per
        // benchmark.
        let rt = sim_runtime()?;
        let dev = rt.device(0)?;
        let stream = dev.new_stream()?;
        let (ops, g) = random_ns_per_op(
            &mut GpupoolTarget {
                dev,
                stream: &stream,
            },
            n,
            reps,
        )?;
        let best_fit = MutexBestFit::new(CAPACITY_BYTES);
        let (_, m) = random_ns_per_op(&mut &best_fit, n, reps)?;
        let torch = torch_peer_pool();
        let (_, t) = random_ns_per_op(&mut &torch, n, reps)?;
        rows.push(RandomAllocationsRow {
            n,
            ns_per_op: g,
            mutex_best_fit_ns_per_op: m,
            ns_per_op_torch: t,
            mutex_vs_gpupool: m / g,
            ops,
            max_size_bytes: RANDOM_MAX_BYTES,
        });
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_allocations_follows_rmm_and_frees_everything() {
        let a = MutexBestFit::new(CAPACITY_BYTES);
        let (ops, secs) = random_allocations(&mut &a, 2_000, 1).unwrap();
        // 2n steps, each at least one op, plus the final frees.
        assert!((4_000..=6_000).contains(&ops), "{ops}");
        assert!(secs > 0.0);
        assert_eq!(a.stats().allocated_bytes, 0);
        assert_eq!(a.stats().num_allocs, 2_000, "exactly n allocations");
        a.check().unwrap();
        let rt = sim_runtime().unwrap();
        let dev = rt.device(0).unwrap();
        let s = dev.new_stream().unwrap();
        random_allocations(&mut GpupoolTarget { dev, stream: &s }, 2_000, 1).unwrap();
        let st = dev.stats();
        assert_eq!(st.num_allocs, 2_000);
        assert_eq!(st.requested_bytes.current, 0);
        let torch = torch_peer_pool();
        random_allocations(&mut &torch, 2_000, 1).unwrap();
        let st = torch.stats(0).unwrap();
        assert_eq!((st.num_allocs, st.num_frees), (2_000, 2_000));
        assert_eq!(st.allocated_bytes, 0);
    }
}
