//! The backend seam: everything gpupool needs from a device driver.
//!
//! One object-safe trait, [`Backend`], with two implementations:
//! [`sim::SimBackend`] (host memory behind simulated devices, always built)
//! and `cuda::CudaBackend` (the CUDA driver API through cudarc, feature
//! `cuda`). The pool only ever talks to `Arc<dyn Backend>`, so every pool test
//! runs on the simulator and the same code drives a real GPU.
//!
//! The calls mirror the CUDA driver API one to one (named in each method's
//! docs) so that the simulator's semantics can be checked against CUDA's by
//! the conformance suite in `tests/conformance.rs`.

pub mod cost;
mod counters;
pub mod move_groups;
pub mod sim;

#[cfg(feature = "cuda")]
pub mod cuda;

pub use cost::{CallCost, CostTable};
pub use counters::{BackendCounters, Call, CallCounters, Unit, COUNTED_DEVICES};

use crate::error::Result;
use crate::ptr::{ChunkHandle, DevicePtr, EventHandle, StreamHandle};
use std::any::Any;
use std::fmt;
use std::os::fd::{BorrowedFd, OwnedFd};

/// Static facts about one device.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeviceInfo {
    /// Index of the device in its backend.
    pub index: usize,
    /// Marketing name, e.g. `NVIDIA H200` or `sim-0`.
    pub name: String,
    /// Total device memory in bytes.
    pub total_bytes: u64,
    /// PCI bus id (`0000:3b:00.0`), used to find the nearest NUMA node.
    pub pci_bus_id: String,
    /// Physical allocation granularity in bytes (`cuMemGetAllocationGranularity`).
    pub granularity: u64,
    /// Whether virtual memory management (`cuMemCreate`/`cuMemMap`) is supported.
    pub vmm_supported: bool,
}

/// One move of a compaction batch: copy `len` bytes from `src` to `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct Move {
    /// Source address.
    pub src: DevicePtr,
    /// Destination address.
    pub dst: DevicePtr,
    /// Bytes to move.
    pub len: u64,
}

/// What a device driver must provide. Object safe; used as `Arc<dyn Backend>`.
///
/// Every method takes the device index first; streams and events are only
/// valid on the device that created them, and backends check that where they
/// can (the simulator always does).
pub trait Backend: Send + Sync + fmt::Debug + 'static {
    /// Short name of the backend: `"sim"` or `"cuda"`.
    fn name(&self) -> &'static str;

    /// Number of devices.
    fn device_count(&self) -> usize;

    /// Facts about device `dev`.
    fn device_info(&self, dev: usize) -> Result<DeviceInfo>;

    /// Whether `dev` can map memory of `peer` (`cuDeviceCanAccessPeer`).
    fn can_access_peer(&self, dev: usize, peer: usize) -> Result<bool>;

    // ---- physical memory -------------------------------------------------

    /// Creates a physical chunk of `bytes` (a multiple of the granularity)
    /// (`cuMemCreate`).
    fn create_chunk(&self, dev: usize, bytes: u64) -> Result<ChunkHandle>;

    /// Releases a physical chunk (`cuMemRelease`). The chunk must be unmapped.
    fn release_chunk(&self, dev: usize, chunk: ChunkHandle) -> Result<()>;

    /// Allocates a plain segment, the fallback where VMM is unsupported
    /// (`cuMemAlloc`).
    fn alloc_segment(&self, dev: usize, bytes: u64) -> Result<DevicePtr>;

    /// Frees a plain segment (`cuMemFree`).
    fn free_segment(&self, dev: usize, ptr: DevicePtr) -> Result<()>;

    /// Exports `chunk` for another process (`cuMemExportToShareableHandle`
    /// with a POSIX file descriptor; the chunk must have been created with
    /// that handle type, as the CUDA backend does where the device supports
    /// it): a new file descriptor the caller owns, and the offset of the
    /// chunk's bytes in the file it refers to (0 on CUDA). The default is
    /// [`Error::Unsupported`](crate::Error::Unsupported).
    fn export_chunk(&self, dev: usize, chunk: ChunkHandle) -> Result<(OwnedFd, u64)> {
        let _ = (dev, chunk);
        Err(crate::error::Error::Unsupported(format!(
            "the {} backend cannot export memory",
            self.name()
        )))
    }

    /// Imports a chunk of `bytes` that another process exported with
    /// [`Backend::export_chunk`] (`cuMemImportFromShareableHandle`): `fd`
    /// and `fd_offset` as it gave them (`fd` stays the caller's). Map it
    /// like any chunk; release it with [`Backend::release_chunk`] once
    /// unmapped. The memory stays the exporter's: the importer's device
    /// holds no more memory for it. The default is `Unsupported`.
    fn import_chunk(
        &self,
        dev: usize,
        fd: BorrowedFd<'_>,
        fd_offset: u64,
        bytes: u64,
    ) -> Result<ChunkHandle> {
        let _ = (dev, fd, fd_offset, bytes);
        Err(crate::error::Error::Unsupported(format!(
            "the {} backend cannot import memory",
            self.name()
        )))
    }

    // ---- virtual addresses ----------------------------------------------

    /// Reserves `bytes` of device virtual address space, aligned to the
    /// granularity (`cuMemAddressReserve`).
    fn reserve_va(&self, dev: usize, bytes: u64) -> Result<DevicePtr>;

    /// Frees a reservation; nothing may be mapped in it (`cuMemAddressFree`).
    fn free_va(&self, dev: usize, base: DevicePtr, bytes: u64) -> Result<()>;

    /// Maps `bytes` of `chunk`, starting at `chunk_offset`, at `va`, and
    /// makes it readable and writable by `dev` (`cuMemMap` + `cuMemSetAccess`).
    fn map(
        &self,
        dev: usize,
        va: DevicePtr,
        bytes: u64,
        chunk: ChunkHandle,
        chunk_offset: u64,
    ) -> Result<()>;

    /// Maps `chunks[i]` (each `gran` bytes, from its start) at
    /// `va + i * gran` and makes the whole run readable and writable by
    /// `dev`: one `cuMemMap` per chunk, then one `cuMemSetAccess` over the
    /// run (access is set per address range, so one call covers every
    /// mapping in it; stitching a 256 MiB block maps 128 chunks). All or
    /// nothing: on an error no part of the run stays mapped.
    ///
    /// The default maps chunk by chunk with [`Backend::map`].
    fn map_run(&self, dev: usize, va: DevicePtr, gran: u64, chunks: &[ChunkHandle]) -> Result<()> {
        for (i, &c) in chunks.iter().enumerate() {
            if let Err(e) = self.map(dev, va.offset(i as u64 * gran), gran, c, 0) {
                let _ = self.unmap_run(dev, va, gran, i as u64);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Unmaps `n` adjacent mappings of `gran` bytes each, starting at `va`
    /// (one `cuMemUnmap` per mapping). Every mapping is tried; the first
    /// error is returned.
    fn unmap_run(&self, dev: usize, va: DevicePtr, gran: u64, n: u64) -> Result<()> {
        let mut first = Ok(());
        for i in 0..n {
            if let Err(e) = self.unmap(dev, va.offset(i * gran), gran) {
                first = first.and(Err(e));
            }
        }
        first
    }

    /// Unmaps `bytes` at `va` (`cuMemUnmap`).
    fn unmap(&self, dev: usize, va: DevicePtr, bytes: u64) -> Result<()>;

    /// Grants read/write access to a mapped range to `peers` as well as `dev`
    /// (`cuMemSetAccess`).
    fn set_access(&self, dev: usize, va: DevicePtr, bytes: u64, peers: &[usize]) -> Result<()>;

    // ---- streams and events ---------------------------------------------

    /// Creates a non-blocking stream (`cuStreamCreate`).
    fn create_stream(&self, dev: usize) -> Result<StreamHandle>;

    /// Destroys a stream once its work is done (`cuStreamDestroy`).
    fn destroy_stream(&self, dev: usize, stream: StreamHandle) -> Result<()>;

    /// Creates an event with timing disabled (`cuEventCreate`).
    fn create_event(&self, dev: usize) -> Result<EventHandle>;

    /// Destroys an event (`cuEventDestroy`).
    fn destroy_event(&self, dev: usize, event: EventHandle) -> Result<()>;

    /// Captures the work enqueued so far on `stream` in `event`
    /// (`cuEventRecord`). Re-recording replaces the earlier capture.
    fn record_event(&self, dev: usize, event: EventHandle, stream: StreamHandle) -> Result<()>;

    /// Whether the captured work has completed, without blocking
    /// (`cuEventQuery`). An event never recorded counts as complete.
    fn query_event(&self, dev: usize, event: EventHandle) -> Result<bool>;

    /// Blocks the host until the event completes (`cuEventSynchronize`).
    /// Counted as a host-blocking sync.
    fn sync_event(&self, dev: usize, event: EventHandle) -> Result<()>;

    /// Makes all future work on `stream` wait for `event`, without blocking
    /// the host or other streams (`cuStreamWaitEvent`).
    fn stream_wait_event(&self, dev: usize, stream: StreamHandle, event: EventHandle)
        -> Result<()>;

    /// Blocks the host until `stream` is idle (`cuStreamSynchronize`).
    /// Counted as a host-blocking sync.
    fn sync_stream(&self, dev: usize, stream: StreamHandle) -> Result<()>;

    /// Whether `stream` is capturing a CUDA graph now
    /// (`cuStreamIsCapturing`; legal during a capture, unlike an event
    /// query). An invalidated capture counts as capturing: it still ends
    /// with `cuStreamEndCapture`. The default: never.
    fn stream_capturing(&self, dev: usize, stream: StreamHandle) -> Result<bool> {
        let _ = (dev, stream);
        Ok(false)
    }

    /// Whether every operation enqueued on `stream` so far has completed
    /// (`cuStreamQuery`, non-blocking). Illegal during a capture of any
    /// stream of the device, like an event query: callers check first.
    /// The default: never known idle, which costs only missed reuse.
    fn query_stream(&self, dev: usize, stream: StreamHandle) -> Result<bool> {
        let _ = (dev, stream);
        Ok(false)
    }

    // ---- work -------------------------------------------------------------

    /// Enqueues a batch of moves on `stream`, run in order as one operation
    /// (the compaction kernel on CUDA, a host copy on the simulator).
    fn enqueue_moves(&self, dev: usize, stream: StreamHandle, moves: &[Move]) -> Result<()>;

    /// Enqueues a byte fill of `bytes` at `ptr` on `stream` (`cuMemsetD8Async`).
    fn enqueue_fill(
        &self,
        dev: usize,
        stream: StreamHandle,
        ptr: DevicePtr,
        bytes: u64,
        value: u8,
    ) -> Result<()>;

    /// Copies device memory to the host, synchronously (`cuMemcpyDtoH`).
    /// For tests and diagnostics; counted as a host-blocking sync.
    fn copy_to_host(&self, dev: usize, src: DevicePtr, dst: &mut [u8]) -> Result<()>;

    /// Copies host memory to the device, synchronously (`cuMemcpyHtoD`).
    fn copy_from_host(&self, dev: usize, dst: DevicePtr, src: &[u8]) -> Result<()>;

    // ---- observability ----------------------------------------------------

    /// Counts of driver-level calls and host-blocking syncs so far.
    fn counters(&self) -> BackendCounters;

    /// For downcasting to the concrete backend (the simulator's test hooks).
    fn as_any(&self) -> &dyn Any;
}

/// Which backend a runtime uses.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub enum BackendKind {
    /// The simulator with this configuration.
    Sim(sim::SimConfig),
    /// The CUDA driver; an error if none is present.
    Cuda,
    /// CUDA if a driver and a device are present, else the simulator with
    /// the configuration's `sim` settings.
    Auto,
}

/// Opens the backend `kind` names. `Auto` tries CUDA (when the `cuda`
/// feature is built) and falls back to the simulator with `sim`, logging why.
pub fn open(kind: &BackendKind, sim: &sim::SimConfig) -> Result<std::sync::Arc<dyn Backend>> {
    match kind {
        BackendKind::Sim(cfg) => Ok(std::sync::Arc::new(sim::SimBackend::new(cfg.clone())?)),
        BackendKind::Cuda => open_cuda(),
        BackendKind::Auto => match open_cuda() {
            Ok(b) => Ok(b),
            Err(e) => {
                tracing::info!("CUDA unavailable ({e}); using the simulator");
                Ok(std::sync::Arc::new(sim::SimBackend::new(sim.clone())?))
            }
        },
    }
}

#[cfg(feature = "cuda")]
fn open_cuda() -> Result<std::sync::Arc<dyn Backend>> {
    cuda::open()
}

#[cfg(not(feature = "cuda"))]
fn open_cuda() -> Result<std::sync::Arc<dyn Backend>> {
    Err(crate::error::Error::NoDriver(
        "gpupool was built without the `cuda` feature".into(),
    ))
}
