//! What a stress run needs of a peer allocator, and the peer with no
//! allocator at all, which measures the harness itself.
//!
//! A peer run (`gpupool stress --peers`) drives the pool run's traffic
//! through another allocator, on the same streams, with the same events
//! between them. [`NoAllocator`] hands every request fresh addresses and
//! forgets every free: no allocator does less, so its operations per
//! second are the most the harness allows at that thread and stream count,
//! and the ratio of two of its runs (8 streams against 1, say) the best
//! ratio any allocator can show between them. Each stream added costs the
//! harness work of its own (an event record and a stream wait for every
//! block used on a second stream, which a single stream never has), and
//! that work is in every allocator's figure.
//!
//! Invariants: [`NoAllocator`] never returns an address twice in a
//! process (each thread bumps through regions no other thread is given),
//! makes no driver call and reports no memory.

use crate::bench::torch_peer::TorchPeer;
use crate::trace::peers::DriverCalls;
use gpupool::Result;
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// A peer allocator as the stress harness drives it: addresses are
/// simulated (the harness writes nothing there).
pub trait StressPeer: Sync {
    /// The report's name for the peer.
    fn name(&self) -> &'static str;
    /// `size` bytes on device `device` for use on `stream`.
    fn alloc(&self, device: usize, size: u64, stream: u64) -> Result<u64>;
    /// Frees what [`StressPeer::alloc`] returned.
    fn free(&self, addr: u64) -> Result<()>;
    /// `addr` is used on `stream` too (PyTorch's `recordStream`).
    fn record_stream(&self, addr: u64, stream: u64) -> Result<()>;
    /// Acquisitions of a device-wide lock so far.
    fn device_locks(&self) -> u64;
    /// Peak reserved bytes of `device`.
    fn peak_reserved_bytes(&self, device: usize) -> Result<u64>;
    /// Driver calls made for `device`, by CUDA name.
    fn driver_calls(&self, device: usize) -> Result<DriverCalls>;
    /// Bytes (or chunks) those calls covered, by CUDA name.
    fn driver_bytes(&self, device: usize) -> Result<DriverCalls>;
}

/// PyTorch's allocator as the replay port models it, in one of its modes.
pub struct Torch<'a> {
    pub name: &'static str,
    pub port: &'a TorchPeer,
}

impl StressPeer for Torch<'_> {
    fn name(&self) -> &'static str {
        self.name
    }
    fn alloc(&self, device: usize, size: u64, stream: u64) -> Result<u64> {
        self.port.alloc(device, size, stream)
    }
    fn free(&self, addr: u64) -> Result<()> {
        self.port.free(addr)
    }
    fn record_stream(&self, addr: u64, stream: u64) -> Result<()> {
        self.port.record_stream(addr, stream)
    }
    fn device_locks(&self) -> u64 {
        self.port.device_locks()
    }
    fn peak_reserved_bytes(&self, device: usize) -> Result<u64> {
        self.port.peak_reserved_bytes(device)
    }
    fn driver_calls(&self, device: usize) -> Result<DriverCalls> {
        self.port.driver_calls(device)
    }
    fn driver_bytes(&self, device: usize) -> Result<DriverCalls> {
        self.port.driver_bytes(device)
    }
}

/// Bytes of address space each thread bumps through before it takes
/// another region.
const REGION: u64 = 1 << 44;

/// No allocator: fresh addresses for every request, frees forgotten; its
/// operations per second are the most the harness allows (the
/// `harness_only` row of `gpupool stress --peers`).
#[derive(Debug, Default)]
pub struct NoAllocator;

/// Regions handed to threads so far, by every [`NoAllocator`] of the
/// process (a thread's region outlives a run).
static REGIONS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// This thread's next address and the end of its region.
    static BUMP: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

impl StressPeer for NoAllocator {
    fn name(&self) -> &'static str {
        "harness_only"
    }
    fn alloc(&self, _device: usize, size: u64, _stream: u64) -> Result<u64> {
        let len = size.max(1).next_multiple_of(512);
        Ok(BUMP.with(|b| {
            let (mut next, mut end) = b.get();
            if next + len > end {
                // Region 0 is never handed out: no address is null.
                let r = REGIONS.fetch_add(1, Relaxed) + 1;
                (next, end) = (r * REGION, (r + 1) * REGION);
            }
            b.set((next + len, end));
            next
        }))
    }
    fn free(&self, _addr: u64) -> Result<()> {
        Ok(())
    }
    fn record_stream(&self, _addr: u64, _stream: u64) -> Result<()> {
        Ok(())
    }
    fn device_locks(&self) -> u64 {
        0
    }
    fn peak_reserved_bytes(&self, _device: usize) -> Result<u64> {
        Ok(0)
    }
    fn driver_calls(&self, _device: usize) -> Result<DriverCalls> {
        Ok(DriverCalls::new())
    }
    fn driver_bytes(&self, _device: usize) -> Result<DriverCalls> {
        Ok(DriverCalls::new())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Addresses of one thread and of two threads never overlap, even
    /// across a region's end.
    #[test]
    fn no_allocator_hands_out_disjoint_ranges() {
        let p = NoAllocator;
        let mut ranges = Vec::new();
        for size in [1, 512, 513, REGION - 1024, 4096] {
            ranges.push((p.alloc(0, size, 0).unwrap(), size.next_multiple_of(512)));
        }
        let other = std::thread::scope(|s| s.spawn(|| p.alloc(0, 100, 0).unwrap()).join().unwrap());
        ranges.push((other, 512));
        ranges.sort();
        assert!(ranges[0].0 >= REGION, "no null address: {ranges:?}");
        for w in ranges.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "overlap: {ranges:?}");
        }
    }
}
