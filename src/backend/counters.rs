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

/// Lock-free call counters, one per [`Call`], plus host-blocking syncs.
#[derive(Debug, Default)]
pub struct CallCounters {
    calls: [AtomicU64; Call::ALL.len()],
    host_syncs: AtomicU64,
}

impl CallCounters {
    /// Counts one call.
    #[inline]
    pub fn count(&self, call: Call) {
        self.calls[call as usize].fetch_add(1, Relaxed);
    }

    /// Counts one host-blocking sync.
    #[inline]
    pub fn count_host_sync(&self) {
        self.host_syncs.fetch_add(1, Relaxed);
    }

    /// A snapshot of all counters.
    pub fn snapshot(&self) -> BackendCounters {
        BackendCounters {
            host_syncs: self.host_syncs.load(Relaxed),
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
    /// Calls by driver name.
    pub calls: BTreeMap<&'static str, u64>,
}

impl BackendCounters {
    /// How many times `call` was made.
    pub fn get(&self, call: Call) -> u64 {
        self.calls.get(call.name()).copied().unwrap_or(0)
    }
}
