//! The simulated CUDA driver under a peer: device memory counted against a
//! capacity, virtual addresses from a counter, and every call counted by its
//! CUDA driver name.
//!
//! Invariants:
//! - `used <= capacity` after every call; a call that would pass it fails
//!   (and is still counted: the real driver was asked).
//! - Addresses handed out never overlap one another, nor any range given to
//!   [`SimDevice::reserve_above`] (seeded segments).
//! - `counter.calls[name]` counts every call of that name made so far;
//!   `counter.bytes[name]` the bytes those calls covered (allocations,
//!   mappings, reservations); both only grow.

use std::collections::{BTreeMap, VecDeque};

use super::DriverCalls;
use gpupool::backend::{Call, CostTable, Unit};

/// Driver calls by name and the bytes they covered.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DriverCounter {
    /// Calls by driver name.
    pub calls: DriverCalls,
    /// Bytes covered by the calls of each name that take a size.
    pub bytes: DriverCalls,
}

impl DriverCounter {
    pub(super) fn count(&mut self, call: Call, bytes: Option<u64>) {
        *self.calls.entry(call.name()).or_default() += 1;
        if let Some(b) = bytes {
            *self.bytes.entry(call.name()).or_default() += b;
        }
    }

    /// `self - earlier`, by name (names with no calls in between are left
    /// out).
    pub fn since(&self, earlier: &DriverCounter) -> DriverCounter {
        let diff = |now: &DriverCalls, then: &DriverCalls| -> DriverCalls {
            now.iter()
                .filter_map(|(k, &v)| {
                    let d = v - then.get(k).copied().unwrap_or(0);
                    (d > 0).then_some((*k, d))
                })
                .collect()
        };
        DriverCounter {
            calls: diff(&self.calls, &earlier.calls),
            bytes: diff(&self.bytes, &earlier.bytes),
        }
    }
}

/// Where simulated addresses of device 0 start: high in the address space,
/// as CUDA's are, and far from 0 so that a stray 0 is never a valid address.
const VA_START: u64 = 0x7f00_0000_0000;
/// Address space of each device (devices share one address space, as
/// CUDA's unified addressing has them, without overlapping).
const VA_PER_DEVICE: u64 = 1 << 44;
/// Alignment of every range handed out (CUDA's allocation granularity).
const VA_ALIGN: u64 = 2 << 20;

/// The simulated device and driver.
#[derive(Debug, Clone)]
pub(super) struct SimDevice {
    capacity: u64,
    used: u64,
    next_va: u64,
    /// Addresses to hand out for `cuMemAlloc`, in order, each for a size:
    /// a replay of a recording feeds PyTorch's own segment addresses here so
    /// that best fit breaks ties between equal blocks as it did.
    script: VecDeque<(u64, u64)>,
    /// Live `cuMemAlloc` ranges (and seeded ones): start -> size.
    live: BTreeMap<u64, u64>,
    /// Live `cuMemAddressReserve` ranges: start -> size.
    reserved: BTreeMap<u64, u64>,
    /// The address the next `cuMemAddressReserve` returns, if free.
    reserve_hint: Option<u64>,
    pub(super) counter: DriverCounter,
    /// Spend each call's modeled time on the calling thread (see
    /// `SimConfig::driver_time`); `None`: count only.
    pub(super) driver_time: Option<std::sync::Arc<CostTable>>,
}

impl SimDevice {
    /// Device `index` of `capacity` bytes.
    pub(super) fn new(index: usize, capacity: u64) -> Self {
        SimDevice {
            capacity,
            used: 0,
            next_va: VA_START + index as u64 * VA_PER_DEVICE,
            script: VecDeque::new(),
            live: BTreeMap::new(),
            reserved: BTreeMap::new(),
            reserve_hint: None,
            counter: DriverCounter::default(),
            driver_time: None,
        }
    }

    /// Counts one call covering `bytes` and, with `driver_time` set, spends
    /// its modeled time (a grant's units are the 2 MiB chunks it covers).
    pub(super) fn call(&mut self, call: Call, bytes: Option<u64>) {
        self.counter.count(call, bytes);
        if let Some(t) = &self.driver_time {
            let units = match call.unit() {
                Unit::None => 0,
                Unit::Bytes => bytes.unwrap_or(0),
                Unit::Chunks => bytes.unwrap_or(0).div_ceil(VA_ALIGN).max(1),
            };
            t.spend(call, 1, units);
        }
    }

    pub(super) fn capacity(&self) -> u64 {
        self.capacity
    }

    pub(super) fn used(&self) -> u64 {
        self.used
    }

    /// Takes `[addr, addr + size)` as already allocated (a segment that
    /// existed before the replay started): counts it as used and moves the
    /// address counter past it. No driver call is counted.
    pub(super) fn reserve_above(&mut self, addr: u64, size: u64) {
        self.used += size;
        self.live.insert(addr, size);
        self.next_va = self
            .next_va
            .max((addr + size).next_multiple_of(VA_ALIGN) + VA_ALIGN);
    }

    fn overlaps_live(&self, addr: u64, size: u64) -> bool {
        [&self.live, &self.reserved].iter().any(|m| {
            m.range(..addr + size)
                .next_back()
                .is_some_and(|(&a, &s)| a + s > addr)
        })
    }

    /// The next `cuMemAddressReserve` returns `addr` if that range is free
    /// (a replay of a recording passes the address where PyTorch's new
    /// expandable segment began); any other call of the device forgets it.
    pub(super) fn hint_next_reservation(&mut self, addr: u64) {
        self.reserve_hint = Some(addr);
    }

    /// Forgets a hint given to [`SimDevice::hint_next_reservation`].
    pub(super) fn clear_reservation_hint(&mut self) {
        self.reserve_hint = None;
    }

    /// Queues the addresses `cuMemAlloc` hands out next: `(size, addr)`.
    /// Once an allocation does not follow the script (another size than the
    /// front's, or a scripted range still in use), the script is dropped and
    /// every later address is fresh.
    pub(super) fn script_addresses(&mut self, script: impl IntoIterator<Item = (u64, u64)>) {
        self.script.extend(script);
    }

    fn fresh_va(&mut self, size: u64) -> u64 {
        let addr = self.next_va;
        // A guard gap keeps ranges from touching.
        self.next_va += size.next_multiple_of(VA_ALIGN) + VA_ALIGN;
        addr
    }

    /// `cuMemAlloc` (PyTorch's `cudaMalloc`): `None` when the device is full.
    pub(super) fn mem_alloc(&mut self, size: u64) -> Option<u64> {
        if self.used + size > self.capacity {
            self.call(Call::MemAlloc, None);
            return None;
        }
        self.call(Call::MemAlloc, Some(size));
        self.used += size;
        let addr = match self.script.pop_front() {
            Some((s, addr)) if s == size && !self.overlaps_live(addr, size) => {
                self.next_va = self.next_va.max((addr + size).next_multiple_of(VA_ALIGN));
                addr
            }
            Some(_) => {
                self.script.clear();
                self.fresh_va(size)
            }
            None => self.fresh_va(size),
        };
        self.live.insert(addr, size);
        Some(addr)
    }

    /// `cuMemFree` of the allocation at `addr`.
    pub(super) fn mem_free(&mut self, addr: u64) {
        let size = self
            .live
            .remove(&addr)
            .expect("cuMemFree of an address cuMemAlloc did not return");
        self.call(Call::MemFree, Some(size));
        self.used -= size;
    }

    /// `cuMemCreate` of one physical chunk: false when the device is full.
    pub(super) fn mem_create(&mut self, size: u64) -> bool {
        if self.used + size > self.capacity {
            self.call(Call::MemCreate, None);
            return false;
        }
        self.call(Call::MemCreate, Some(size));
        self.used += size;
        true
    }

    /// `cuMemRelease` of one physical chunk.
    pub(super) fn mem_release(&mut self, size: u64) {
        self.call(Call::MemRelease, Some(size));
        self.used -= size;
    }

    /// `cuMemAddressReserve`: a fresh virtual range (uses no memory).
    pub(super) fn address_reserve(&mut self, size: u64) -> u64 {
        self.call(Call::AddressReserve, Some(size));
        let addr = match self.reserve_hint.take() {
            Some(h) if !self.overlaps_live(h, size) => {
                self.next_va = self.next_va.max((h + size).next_multiple_of(VA_ALIGN));
                h
            }
            _ => self.fresh_va(size),
        };
        self.reserved.insert(addr, size);
        addr
    }

    /// `cuMemAddressFree` of the range reserved at `addr`.
    pub(super) fn address_free(&mut self, addr: u64) {
        let size = self
            .reserved
            .remove(&addr)
            .expect("cuMemAddressFree of a range not reserved");
        self.call(Call::AddressFree, Some(size));
    }

    /// `cuMemMap` of one chunk.
    pub(super) fn map(&mut self, size: u64) {
        self.call(Call::Map, Some(size));
    }

    /// `cuMemUnmap` of one chunk.
    pub(super) fn unmap(&mut self, size: u64) {
        self.call(Call::Unmap, Some(size));
    }

    /// `cuMemSetAccess` over a range.
    pub(super) fn set_access(&mut self, size: u64) {
        self.call(Call::SetAccess, Some(size));
    }

    /// `cuStreamSynchronize` (a host wait).
    pub(super) fn stream_synchronize(&mut self) {
        self.call(Call::StreamSynchronize, None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_failures_are_counted_and_change_nothing() {
        let mut d = SimDevice::new(0, 4 << 20);
        let a = d.mem_alloc(2 << 20).unwrap();
        let b = d.mem_alloc(2 << 20).unwrap();
        assert!(b >= a + (2 << 20), "ranges do not overlap");
        assert_eq!(d.mem_alloc(512), None);
        assert_eq!(d.used(), 4 << 20);
        assert_eq!(d.counter.calls["cuMemAlloc"], 3);
        assert_eq!(d.counter.bytes["cuMemAlloc"], 4 << 20);
        d.mem_free(b);
        assert!(d.mem_create(2 << 20));
        assert!(!d.mem_create(2 << 20));
        assert_eq!(d.counter.calls["cuMemCreate"], 2);
    }

    /// With a cost table, each call takes its modeled time: a `cuMemAlloc`
    /// per call and per MiB, a grant per 2 MiB chunk it covers.
    #[test]
    fn driver_time_is_spent_per_call_and_per_unit() {
        use gpupool::backend::CallCost;
        use std::time::{Duration, Instant};
        let mut t = CostTable::h200();
        let cost = |us, us_per_unit| CallCost { us, us_per_unit };
        t.set(Call::MemAlloc, cost(1000.0, 500.0)).unwrap();
        t.set(Call::SetAccess, cost(0.0, 700.0)).unwrap();
        let mut d = SimDevice::new(0, 1 << 30);
        d.driver_time = Some(std::sync::Arc::new(t));
        let start = Instant::now();
        d.mem_alloc(4 << 20).unwrap();
        // 1000 µs + 4 MiB x 500 µs.
        assert!(start.elapsed() >= Duration::from_millis(3));
        let start = Instant::now();
        d.set_access(6 << 20);
        // Three chunks of 2 MiB at 700 µs.
        assert!(start.elapsed() >= Duration::from_micros(2100));
        assert_eq!(d.counter.calls["cuMemSetAccess"], 1);
    }

    #[test]
    fn scripted_addresses_are_used_for_matching_sizes() {
        let mut d = SimDevice::new(0, 1 << 40);
        d.reserve_above(0x1000_0000, 2 << 20);
        d.script_addresses([(20 << 20, 0x5000_0000), (2 << 20, 0x1000_0000)]);
        assert_eq!(d.mem_alloc(20 << 20), Some(0x5000_0000));
        let taken = d.mem_alloc(2 << 20).unwrap();
        assert_ne!(
            taken, 0x1000_0000,
            "a scripted range still in use is not reused"
        );
        d.script_addresses([(2 << 20, 0x6000_0000)]);
        let other = d.mem_alloc(4 << 20).unwrap();
        assert_ne!(other, 0x6000_0000, "another size takes a fresh address");
        assert_ne!(
            d.mem_alloc(2 << 20),
            Some(0x6000_0000),
            "the script was dropped"
        );
        let before = d.counter.clone();
        d.mem_free(0x5000_0000);
        let delta = d.counter.since(&before);
        assert_eq!(delta.calls.len(), 1);
        assert_eq!(delta.calls["cuMemFree"], 1);
    }
}
