//! Counters of driver-level calls, kept by every backend.
//!
//! The pool's promise "no host-blocking sync on the alloc/free path" is
//! checked by reading [`BackendCounters::host_syncs`] around a workload.

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

            /// The CUDA driver name of the call.
            pub fn name(self) -> &'static str {
                match self { $(Call::$variant => $name),* }
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
}

/// Devices whose host syncs are counted separately.
pub const COUNTED_DEVICES: usize = 64;

/// Lock-free call counters, one per [`Call`], plus host-blocking syncs
/// (in total and per device).
#[derive(Debug)]
pub struct CallCounters {
    calls: [AtomicU64; Call::ALL.len()],
    host_syncs: AtomicU64,
    per_device: [AtomicU64; COUNTED_DEVICES],
}

impl Default for CallCounters {
    fn default() -> Self {
        CallCounters {
            calls: std::array::from_fn(|_| AtomicU64::new(0)),
            host_syncs: AtomicU64::new(0),
            per_device: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl CallCounters {
    /// Counts one call.
    #[inline]
    pub fn count(&self, call: Call) {
        self.calls[call as usize].fetch_add(1, Relaxed);
    }

    /// Counts `n` calls of one kind (a run of mappings) with one atomic add.
    #[inline]
    pub fn count_n(&self, call: Call, n: u64) {
        self.calls[call as usize].fetch_add(n, Relaxed);
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
                .map(|c| (c.name(), self.calls[*c as usize].load(Relaxed)))
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

    /// Driver calls of every kind made so far.
    pub fn total_calls(&self) -> u64 {
        self.calls.values().sum()
    }
}
