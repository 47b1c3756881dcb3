//! PyTorch's CUDA caching allocator as a live benchmark peer: the replay
//! port ([`crate::trace::peers::TorchAllocator`]) behind PyTorch's locks.
//! **A benchmark peer only**, like [`super::baselines`]: no runtime, CLI or
//! C ABI path hands out its addresses (they are simulated).
//!
//! Locking as in PyTorch's `NativeCachingAllocator`: every `malloc` and
//! `free` of a device runs under that device's one mutex
//! (`DeviceCachingAllocator::mutex`), and the pointer-to-block map is split
//! over 67 shards, each with its own mutex (`allocated_blocks`): `malloc`
//! adds the pointer after the device lock, `free` finds and removes it
//! before. (PyTorch's device mutex is recursive; nothing here re-enters, so
//! a plain mutex behaves the same.)
//!
//! With [`TorchPeer::with_events`], `record_stream` is modelled as PyTorch
//! does it (see [`crate::trace::peers::torch_events`]): the events are
//! real events of the given backend, recorded on the caller's streams.
//!
//! Invariants: an address is in exactly one shard, mapped to its device,
//! from the end of its `alloc` to the start of its `free`; each device's
//! port is only touched under its mutex.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use rustc_hash::FxHashMap;

use crate::trace::peers::torch::TorchStats;
use crate::trace::peers::{DriverCalls, PeerAllocator, StreamEvents, TorchAllocator, TorchConfig};
use gpupool::backend::Backend;
use gpupool::{Error, EventHandle, Result, StreamHandle};
use std::sync::Arc;

/// PyTorch's `kNumMutexShard`.
const SHARDS: usize = 67;

/// The port on `devices` simulated devices; see the [module docs](self).
#[derive(Debug)]
pub struct TorchPeer {
    devices: Vec<Mutex<TorchAllocator>>,
    shards: Vec<Mutex<FxHashMap<u64, usize>>>,
    /// Acquisitions of the device mutexes by `alloc` and `free`.
    device_locks: AtomicU64,
    /// Each device's events, when `record_stream` is modelled.
    events: Vec<BackendEvents>,
}

/// A device's events on a gpupool backend, for the port's `record_stream`.
#[derive(Debug, Clone)]
pub struct BackendEvents {
    backend: Arc<dyn Backend>,
    device: usize,
}

impl StreamEvents for BackendEvents {
    fn create(&self) -> Result<u64> {
        Ok(self.backend.create_event(self.device)?.raw())
    }
    fn record(&self, event: u64, stream: u64) -> Result<()> {
        self.backend
            .record_event(self.device, EventHandle(event), StreamHandle(stream))
    }
    fn query(&self, event: u64) -> Result<bool> {
        self.backend.query_event(self.device, EventHandle(event))
    }
    fn synchronize(&self, event: u64) -> Result<()> {
        self.backend.sync_event(self.device, EventHandle(event))
    }
}

/// PyTorch's `twang_mix64`, which picks a pointer's shard.
fn twang_mix64(mut k: u64) -> u64 {
    k = (!k).wrapping_add(k << 21);
    k ^= k >> 24;
    k = k.wrapping_add(k << 3).wrapping_add(k << 8);
    k ^= k >> 14;
    k = k.wrapping_add(k << 2).wrapping_add(k << 4);
    k ^= k >> 28;
    k.wrapping_add(k << 31)
}

fn shard_of(addr: u64) -> usize {
    (twang_mix64(addr) % SHARDS as u64) as usize
}

fn poisoned() -> Error {
    Error::InvalidArgument("a torch peer lock was poisoned by a panic".into())
}

impl TorchPeer {
    /// `devices` ports with settings `cfg` each.
    pub fn new(devices: usize, cfg: TorchConfig) -> Self {
        TorchPeer {
            devices: (0..devices)
                .map(|d| Mutex::new(TorchAllocator::on_device(d, cfg.clone())))
                .collect(),
            shards: (0..SHARDS)
                .map(|_| Mutex::new(FxHashMap::default()))
                .collect(),
            device_locks: AtomicU64::new(0),
            events: Vec::new(),
        }
    }

    /// [`TorchPeer::new`] with `record_stream` modelled: its events are
    /// `backend`'s, one device per port.
    pub fn with_events(devices: usize, cfg: TorchConfig, backend: &Arc<dyn Backend>) -> Self {
        TorchPeer {
            events: (0..devices)
                .map(|device| BackendEvents {
                    backend: backend.clone(),
                    device,
                })
                .collect(),
            ..Self::new(devices, cfg)
        }
    }

    /// `recordStream` of the block at `addr`; without events (see
    /// [`TorchPeer::with_events`]) a no-op, as in a replay.
    pub fn record_stream(&self, addr: u64, stream: u64) -> Result<()> {
        if self.events.is_empty() {
            return Ok(());
        }
        let device = self.device_of(addr)?;
        self.device_locks.fetch_add(1, Relaxed);
        self.device(device)?
            .lock()
            .map_err(|_| poisoned())?
            .record_stream(addr, stream)
    }

    fn device_of(&self, addr: u64) -> Result<usize> {
        self.shards[shard_of(addr)]
            .lock()
            .map_err(|_| poisoned())?
            .get(&addr)
            .copied()
            .ok_or(Error::UnknownPointer {
                ptr: addr,
                device: 0,
            })
    }

    fn device(&self, device: usize) -> Result<&Mutex<TorchAllocator>> {
        self.devices.get(device).ok_or(Error::InvalidDevice {
            device,
            count: self.devices.len(),
        })
    }

    /// `malloc` of `size` bytes on `stream` of `device`.
    pub fn alloc(&self, device: usize, size: u64, stream: u64) -> Result<u64> {
        self.device_locks.fetch_add(1, Relaxed);
        let mut port = self.device(device)?.lock().map_err(|_| poisoned())?;
        let addr = match self.events.get(device) {
            Some(ev) => port.malloc_with_events(size, stream, ev)?,
            None => port.malloc(size, stream)?,
        };
        drop(port);
        self.shards[shard_of(addr)]
            .lock()
            .map_err(|_| poisoned())?
            .insert(addr, device);
        Ok(addr)
    }

    /// `free` of an address `alloc` returned (on any device).
    pub fn free(&self, addr: u64) -> Result<()> {
        let device = self.shards[shard_of(addr)]
            .lock()
            .map_err(|_| poisoned())?
            .remove(&addr)
            .ok_or(Error::UnknownPointer {
                ptr: addr,
                device: 0,
            })?;
        self.device_locks.fetch_add(1, Relaxed);
        let mut port = self.device(device)?.lock().map_err(|_| poisoned())?;
        match self.events.get(device) {
            Some(ev) => port.free_with_events(addr, ev),
            None => port.free(addr),
        }
    }

    /// Device-mutex acquisitions by `alloc` and `free` so far.
    pub fn device_locks(&self) -> u64 {
        self.device_locks.load(Relaxed)
    }

    /// Most bytes `device` held at once.
    pub fn peak_reserved_bytes(&self, device: usize) -> Result<u64> {
        Ok(self
            .device(device)?
            .lock()
            .map_err(|_| poisoned())?
            .peak_reserved_bytes())
    }

    /// Bytes covered by the driver calls of `device` so far, by kind.
    pub fn driver_bytes(&self, device: usize) -> Result<DriverCalls> {
        Ok(self
            .device(device)?
            .lock()
            .map_err(|_| poisoned())?
            .driver_bytes())
    }

    /// Reserved bytes of `device`.
    pub fn reserved_bytes(&self, device: usize) -> Result<u64> {
        Ok(self
            .device(device)?
            .lock()
            .map_err(|_| poisoned())?
            .reserved_bytes())
    }

    /// PyTorch's counters of `device`.
    pub fn stats(&self, device: usize) -> Result<TorchStats> {
        Ok(self.device(device)?.lock().map_err(|_| poisoned())?.stats())
    }

    /// Driver calls of `device` so far.
    pub fn driver_calls(&self, device: usize) -> Result<DriverCalls> {
        Ok(self
            .device(device)?
            .lock()
            .map_err(|_| poisoned())?
            .driver_calls())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frees_find_their_device_and_threads_share_the_port() {
        let peer = TorchPeer::new(2, TorchConfig::default());
        let a = peer.alloc(0, 4096, 0).unwrap();
        let b = peer.alloc(1, 4096, 0).unwrap();
        assert_eq!(peer.reserved_bytes(0).unwrap(), 2 << 20);
        peer.free(b).unwrap();
        peer.free(a).unwrap();
        assert!(matches!(peer.free(a), Err(Error::UnknownPointer { .. })));
        assert!(peer.alloc(2, 1, 0).is_err());
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let peer = &peer;
                s.spawn(move || {
                    for i in 0..200u64 {
                        let x = peer.alloc((t % 2) as usize, 512 * (i % 7 + 1), t).unwrap();
                        peer.free(x).unwrap();
                    }
                });
            }
        });
        // One small segment per stream of a device (device 0: streams 0 and
        // 2; device 1: 0, 1 and 3): streams never share cached blocks.
        assert_eq!(peer.driver_calls(0).unwrap()["cuMemAlloc"], 2);
        assert_eq!(
            peer.driver_calls(1).unwrap()["cuMemAlloc"],
            3,
            "and stream 0 of b"
        );
    }

    #[test]
    fn twang_mix64_spreads_aligned_pointers() {
        let mut used = [false; SHARDS];
        for i in 0..1000u64 {
            used[shard_of(0x7f00_0000_0000 + i * 512)] = true;
        }
        assert!(used.iter().filter(|&&u| u).count() > SHARDS * 3 / 4);
    }
}
