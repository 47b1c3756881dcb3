//! Counters of driver-level calls, kept by every backend.
//!
//! The pool's promise "no host-blocking sync on the alloc/free path" is
//! checked by reading [`BackendCounters::host_syncs`] around a workload.
//!
//! Besides how many calls of each kind were made, calls whose cost grows
//! with their size also count *units*: the bytes they cover (see
//! [`Call::unit`]). [`CostTable`](super::cost::CostTable) turns a snapshot
//! (or the difference of two, [`BackendCounters::since`]) into modeled
//! driver time.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

macro_rules! calls {
    ($($variant:ident => $name:literal),* $(,)?) => {
        /// A driver-level call that backends count.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(usize)]
        pub enum Call { $(#[doc = $name] $variant),* }

        impl Call {
            /// Every call, in order.
            pub const ALL: &'static [Call] = &[$(Call::$variant),*];

            /// The calls that make, map and give back device memory: what
            /// a pool in steady state makes none of.
            pub const MEMORY: [Call; 9] = [
                Call::MemCreate,
                Call::MemRelease,
                Call::MemAlloc,
                Call::MemFree,
                Call::AddressReserve,
                Call::AddressFree,
                Call::Map,
                Call::Unmap,
                Call::SetAccess,
            ];

            /// The CUDA driver name of the call.
            pub fn name(self) -> &'static str {
                match self { $(Call::$variant => $name),* }
            }

            /// The call with this CUDA driver name (as [`Call::name`] gives).
            pub fn from_name(name: &str) -> Option<Call> {
                match name { $($name => Some(Call::$variant),)* _ => None }
            }
        }
    };
}

calls! {
    MemCreate => "cuMemCreate",
    MemRelease => "cuMemRelease",
    MemAlloc => "cuMemAlloc",
    MemFree => "cuMemFree",
    AddressReserve => "cuMemAddressReserve",
    AddressFree => "cuMemAddressFree",
    Map => "cuMemMap",
    Unmap => "cuMemUnmap",
    SetAccess => "cuMemSetAccess",
    StreamCreate => "cuStreamCreate",
    StreamDestroy => "cuStreamDestroy",
    EventCreate => "cuEventCreate",
    EventDestroy => "cuEventDestroy",
    EventRecord => "cuEventRecord",
    EventQuery => "cuEventQuery",
    EventSynchronize => "cuEventSynchronize",
    StreamWaitEvent => "cuStreamWaitEvent",
    StreamSynchronize => "cuStreamSynchronize",
    LaunchMoves => "launchMoves",
    MemsetAsync => "cuMemsetD8Async",
    MemcpyDtoH => "cuMemcpyDtoH",
    MemcpyHtoD => "cuMemcpyHtoD",
    MemExport => "cuMemExportToShareableHandle",
    MemImport => "cuMemImportFromShareableHandle",
    StreamIsCapturing => "cuStreamIsCapturing",
    StreamQuery => "cuStreamQuery",
}

/// What a call's units measure, for calls whose cost grows with their size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Unit {
    /// The call's cost does not depend on a size the backend sees.
    None,
    /// Bytes: created, allocated, filled, moved or copied.
    Bytes,
    /// Physical chunks (separately created allocations) a call covers:
    /// `cuMemSetAccess` over a run of N mapped granules covers N. The
    /// cost of changing mappings grows with the number of chunks, not bytes
    /// (PyTorch's expandable-segments notes: mapping 10 separately created
    /// 2 MiB pages takes 10 times as long as mapping one 20 MiB allocation).
    Chunks,
}

impl Call {
    /// What the units counted for this call measure: bytes for
    /// `cuMemCreate`, `cuMemAlloc`, fills, moves and copies; chunks for
    /// `cuMemSetAccess`; none for the others (`cuMemMap` and `cuMemUnmap`
    /// are made once per chunk, so their calls are their chunks).
    pub fn unit(self) -> Unit {
        match self {
            Call::SetAccess => Unit::Chunks,
            Call::MemCreate
            | Call::MemAlloc
            | Call::LaunchMoves
            | Call::MemsetAsync
            | Call::MemcpyDtoH
            | Call::MemcpyHtoD => Unit::Bytes,
            _ => Unit::None,
        }
    }
}

/// Devices whose host syncs are counted separately.
pub const COUNTED_DEVICES: usize = 64;

/// Calls and units of one kind, side by side so that counting both touches
/// one cache line.
#[derive(Debug, Default)]
#[repr(align(16))]
struct Slot {
    calls: AtomicU64,
    units: AtomicU64,
}

/// Lock-free call counters, one per [`Call`] (calls and units), plus
/// host-blocking syncs (in total and per device).
#[derive(Debug)]
pub struct CallCounters {
    calls: [Slot; Call::ALL.len()],
    host_syncs: AtomicU64,
    per_device: [AtomicU64; COUNTED_DEVICES],
}

impl Default for CallCounters {
    fn default() -> Self {
        CallCounters {
            calls: std::array::from_fn(|_| Slot::default()),
            host_syncs: AtomicU64::new(0),
            per_device: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl CallCounters {
    /// Counts one call.
    #[inline]
    pub fn count(&self, call: Call) {
        self.calls[call as usize].calls.fetch_add(1, Relaxed);
    }

    /// Counts `n` calls of one kind (a run of mappings) with one atomic add.
    #[inline]
    pub fn count_n(&self, call: Call, n: u64) {
        self.calls[call as usize].calls.fetch_add(n, Relaxed);
    }

    /// Counts `n` calls of one kind that together cover `units` (bytes or
    /// chunks, see [`Call::unit`]): two adds on one cache line.
    #[inline]
    pub fn count_units(&self, call: Call, n: u64, units: u64) {
        let s = &self.calls[call as usize];
        s.calls.fetch_add(n, Relaxed);
        s.units.fetch_add(units, Relaxed);
    }

    /// Counts one host-blocking sync made on device `dev`.
    #[inline]
    pub fn count_host_sync(&self, dev: usize) {
        self.host_syncs.fetch_add(1, Relaxed);
        if let Some(c) = self.per_device.get(dev) {
            c.fetch_add(1, Relaxed);
        }
    }

    /// A snapshot of all counters.
    pub fn snapshot(&self) -> BackendCounters {
        BackendCounters {
            host_syncs: self.host_syncs.load(Relaxed),
            host_syncs_by_device: self.per_device.iter().map(|c| c.load(Relaxed)).collect(),
            calls: Call::ALL
                .iter()
                .map(|c| (c.name(), self.calls[*c as usize].calls.load(Relaxed)))
                .collect(),
            units: Call::ALL
                .iter()
                .filter(|c| c.unit() != Unit::None)
                .map(|c| (c.name(), self.calls[*c as usize].units.load(Relaxed)))
                .collect(),
        }
    }
}

/// A snapshot of a backend's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct BackendCounters {
    /// Host-blocking syncs (`cuEventSynchronize`, `cuStreamSynchronize`,
    /// synchronous copies).
    pub host_syncs: u64,
    /// Host-blocking syncs per device (the first [`COUNTED_DEVICES`]).
    pub host_syncs_by_device: Vec<u64>,
    /// Calls by driver name.
    pub calls: BTreeMap<&'static str, u64>,
    /// Units (bytes or chunks) by driver name, for the calls that have
    /// them ([`Call::unit`]).
    pub units: BTreeMap<&'static str, u64>,
}

impl BackendCounters {
    /// Host-blocking syncs made on device `dev`.
    pub fn host_syncs_of(&self, dev: usize) -> u64 {
        self.host_syncs_by_device.get(dev).copied().unwrap_or(0)
    }

    /// How many times `call` was made.
    pub fn get(&self, call: Call) -> u64 {
        self.calls.get(call.name()).copied().unwrap_or(0)
    }

    /// The units (bytes or chunks) `call` covered.
    pub fn units_of(&self, call: Call) -> u64 {
        self.units.get(call.name()).copied().unwrap_or(0)
    }

    /// Driver calls of every kind made so far.
    pub fn total_calls(&self) -> u64 {
        self.calls.values().sum()
    }

    /// What happened between `earlier` and this snapshot (counters only
    /// grow, so each figure is this one minus the earlier one).
    pub fn since(&self, earlier: &BackendCounters) -> BackendCounters {
        let sub = |a: &BTreeMap<&'static str, u64>, b: &BTreeMap<&'static str, u64>| {
            a.iter()
                .map(|(k, v)| (*k, v.saturating_sub(b.get(k).copied().unwrap_or(0))))
                .collect()
        };
        BackendCounters {
            host_syncs: self.host_syncs.saturating_sub(earlier.host_syncs),
            host_syncs_by_device: self
                .host_syncs_by_device
                .iter()
                .enumerate()
                .map(|(d, v)| v.saturating_sub(earlier.host_syncs_of(d)))
                .collect(),
            calls: sub(&self.calls, &earlier.calls),
            units: sub(&self.units, &earlier.units),
        }
    }

    /// Adds `other`'s figures to these (tallying several backends' runs).
    pub fn add(&mut self, other: &BackendCounters) {
        self.host_syncs += other.host_syncs;
        if self.host_syncs_by_device.len() < other.host_syncs_by_device.len() {
            self.host_syncs_by_device
                .resize(other.host_syncs_by_device.len(), 0);
        }
        for (d, v) in other.host_syncs_by_device.iter().enumerate() {
            self.host_syncs_by_device[d] += v;
        }
        for (k, v) in &other.calls {
            *self.calls.entry(k).or_insert(0) += v;
        }
        for (k, v) in &other.units {
            *self.units.entry(k).or_insert(0) += v;
        }
    }

    /// The kinds actually called, with their counts (zero counts left out):
    /// the `driver_calls` figure of the reports.
    pub fn nonzero_calls(&self) -> BTreeMap<&'static str, u64> {
        self.calls
            .iter()
            .filter(|(_, v)| **v > 0)
            .map(|(k, v)| (*k, *v))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_units_are_counted_beside_calls() {
        for &c in Call::ALL {
            assert_eq!(Call::from_name(c.name()), Some(c));
        }
        assert_eq!(Call::from_name("cudaMalloc"), None);
        let k = CallCounters::default();
        k.count_units(Call::SetAccess, 1, 3);
        k.count_units(Call::SetAccess, 2, 2);
        k.count(Call::EventRecord);
        let a = k.snapshot();
        assert_eq!(a.get(Call::SetAccess), 3);
        assert_eq!(a.units_of(Call::SetAccess), 5);
        assert_eq!(a.get(Call::EventRecord), 1);
        // Calls without a size have no units entry at all.
        assert!(!a.units.contains_key("cuEventRecord"));
        k.count_units(Call::SetAccess, 1, 1);
        k.count_host_sync(1);
        let d = k.snapshot().since(&a);
        assert_eq!(d.get(Call::SetAccess), 1);
        assert_eq!(d.units_of(Call::SetAccess), 1);
        assert_eq!(d.get(Call::EventRecord), 0);
        assert_eq!((d.host_syncs, d.host_syncs_of(1)), (1, 1));
        assert_eq!(
            d.nonzero_calls(),
            BTreeMap::from([("cuMemSetAccess", 1u64)])
        );
        let mut sum = a.clone();
        sum.add(&d);
        assert_eq!(sum, k.snapshot());
    }
}
