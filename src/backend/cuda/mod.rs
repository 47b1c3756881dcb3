//! The CUDA backend: [`Backend`] over the CUDA driver API, through cudarc's
//! raw bindings (`cudarc::driver::sys`) in dynamic-loading mode.
//!
//! The crate builds without CUDA: `libcuda` is opened at run time, in
//! [`CudaBackend::new`]. Where it is missing, `new` returns
//! [`Error::NoDriver`] instead of letting cudarc panic (its loader panics on
//! the first call into a missing library or symbol). `new` checks for the
//! library with [`CudaBackend::driver_library_present`], then resolves every
//! driver symbol this module calls, under `catch_unwind`, before it makes any
//! call; after that no call into `sys` can hit cudarc's loader panics.
//!
//! Each device is driven through its primary context, retained in `new` and
//! released on drop. Every method makes that context current on the calling
//! thread for its driver calls only, and makes the caller's own context (or
//! none) current again before it returns (see `ctx::CtxGuard`): a PyTorch
//! free of a `cuda:1` tensor while PyTorch's current device is 0 leaves it
//! at 0.
//!
//! Out-of-memory from `cuMemCreate`, `cuMemAlloc`, `cuMemMap` and
//! `cuMemSetAccess` is [`Error::DeviceOutOfMemory`] (so
//! [`Error::is_oom`] holds and the pool trims and retries), never a generic
//! [`Error::Backend`].
//!
//! The files, one concept each:
//!
//! * `driver.rs`: opening the driver library, resolving
//!   its symbols, discovering the devices; driver status codes as errors.
//! * `ctx.rs`: each device's primary context and the guard that makes it
//!   current for a call and restores the caller's.
//! * `memory.rs`: physical chunks, plain segments, virtual address ranges,
//!   mappings and access (the virtual-memory half of [`Backend`]).
//! * `streams.rs`: streams and events.
//! * `copies.rs`: moves, fills and host copies (the compaction kernel
//!   where it is loaded, copies otherwise).
//! * `kernel.rs`: compiling and loading the compaction kernel (NVRTC);
//!   `libs.rs`: finding NVRTC and NCCL; `baseline.rs`: driver baselines
//!   for the GPU benchmarks.
//!
//! This file holds the backend itself: its devices, entering a device
//! (its context current for the call), the [`Backend`] impl, which hands
//! each call to the file of its concept, and the release of every context
//! on drop.

mod baseline;
mod copies;
mod ctx;
mod driver;
pub mod kernel;
pub mod libs;
mod memory;
mod streams;

use super::{Backend, BackendCounters, CallCounters, DeviceInfo, Move};
use crate::error::{Error, Result};
use crate::ptr::{ChunkHandle, DevicePtr, EventHandle, StreamHandle};
use ctx::Ctx;
use cudarc::driver::sys;
use driver::check;
use parking_lot::Mutex;
use std::any::Any;
use std::ptr;
use std::sync::Arc;

/// One device: its driver ordinal, primary context and facts.
#[derive(Debug)]
struct Device {
    cu: sys::CUdevice,
    /// The primary context, retained on the device's first use (not at
    /// open: a process that uses one GPU of eight holds one context) and
    /// released when the backend drops.
    ctx: std::sync::OnceLock<Ctx>,
    ctx_init: Mutex<()>,
    info: DeviceInfo,
    /// The compaction kernel, loaded in the background after the first
    /// need; an error where it cannot be (no NVRTC, no image the driver
    /// accepts): moves then use copies.
    kernel: Arc<kernel::KernelSlot>,
    /// The stream host-to-device copies run on (0 until the first copy),
    /// locked across each copy and its synchronize.
    copy_stream: Mutex<usize>,
}

impl Device {
    /// The device's primary context, retained on the first call.
    fn context(&self) -> Result<Ctx> {
        if let Some(&c) = self.ctx.get() {
            return Ok(c);
        }
        let _g = self.ctx_init.lock();
        if let Some(&c) = self.ctx.get() {
            return Ok(c);
        }
        let mut ctx: sys::CUcontext = ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer; `cu` is a device handle the
        // driver gave out in `new`.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, self.cu)
        })?;
        let c = Ctx(ctx);
        let _ = self.ctx.set(c);
        Ok(c)
    }
}

/// A device whose primary context is current on this thread until this is
/// dropped, when the caller's context is current again.
#[must_use = "the device's context is current only while this lives"]
struct Entered<'a> {
    device: &'a Device,
    _cx: ctx::CtxGuard<'static, ctx::Driver>,
}

impl std::ops::Deref for Entered<'_> {
    type Target = Device;
    fn deref(&self) -> &Device {
        self.device
    }
}

/// [`Backend`] over the CUDA driver API (feature `cuda`).
///
/// Build one with [`CudaBackend::new`]; it fails with [`Error::NoDriver`]
/// where there is no usable driver or device.
#[derive(Debug)]
pub struct CudaBackend {
    devices: Vec<Device>,
    counters: CallCounters,
}

impl CudaBackend {
    /// Device `dev`, with its primary context current on this thread until
    /// the returned guard drops and makes the caller's context current
    /// again. The current context is asked for on each entry rather than
    /// cached: other code on the thread (a framework, another library) may
    /// switch contexts between calls, and `cuCtxGetCurrent` is a
    /// thread-local read in the driver.
    fn enter(&self, dev: usize) -> Result<Entered<'_>> {
        let d = self.device(dev)?;
        // `d.context()` is a primary context retained on first use and
        // released only in `drop`, so it is live while `self` is.
        let cx = ctx::CtxGuard::enter(&ctx::Driver, d.context()?)?;
        Ok(Entered { device: d, _cx: cx })
    }

    fn device(&self, dev: usize) -> Result<&Device> {
        self.devices.get(dev).ok_or(Error::InvalidDevice {
            device: dev,
            count: self.devices.len(),
        })
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        for d in &self.devices {
            // A kernel load in flight uses the context: let it finish.
            d.kernel.join();
            let s = std::mem::take(&mut *d.copy_stream.lock());
            if s != 0 {
                let Some(&c) = d.ctx.get() else { continue };
                if let Ok(_cx) = ctx::CtxGuard::enter(&ctx::Driver, c) {
                    // SAFETY: the copy stream was created by this backend
                    // in this context, is idle (every copy synchronized it)
                    // and is destroyed once (taken out of the slot).
                    let _ = unsafe { sys::cuStreamDestroy_v2(s as sys::CUstream) };
                }
            }
            if d.ctx.get().is_none() {
                continue;
            }
            // SAFETY: this device's primary context was retained exactly
            // once (`Device::context`); this is the matching release. A
            // failure is ignored: nothing useful can be done about it in drop.
            let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(d.cu) };
        }
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device_count(&self) -> usize {
        self.devices.len()
    }

    fn device_info(&self, dev: usize) -> Result<DeviceInfo> {
        self.devices
            .get(dev)
            .map(|d| d.info.clone())
            .ok_or(Error::InvalidDevice {
                device: dev,
                count: self.devices.len(),
            })
    }

    fn can_access_peer(&self, dev: usize, peer: usize) -> Result<bool> {
        memory::can_access_peer(self, dev, peer)
    }

    fn create_chunk(&self, dev: usize, bytes: u64) -> Result<ChunkHandle> {
        memory::create_chunk(self, dev, bytes)
    }

    fn release_chunk(&self, dev: usize, chunk: ChunkHandle) -> Result<()> {
        memory::release_chunk(self, dev, chunk)
    }

    fn export_chunk(&self, dev: usize, chunk: ChunkHandle) -> Result<(std::os::fd::OwnedFd, u64)> {
        memory::export_chunk(self, dev, chunk)
    }

    fn import_chunk(
        &self,
        dev: usize,
        fd: std::os::fd::BorrowedFd<'_>,
        fd_offset: u64,
        _bytes: u64,
    ) -> Result<ChunkHandle> {
        // The allocation carries its own size.
        memory::import_chunk(self, dev, fd, fd_offset)
    }

    fn alloc_segment(&self, dev: usize, bytes: u64) -> Result<DevicePtr> {
        memory::alloc_segment(self, dev, bytes)
    }

    fn free_segment(&self, dev: usize, ptr: DevicePtr) -> Result<()> {
        memory::free_segment(self, dev, ptr)
    }

    fn reserve_va(&self, dev: usize, bytes: u64) -> Result<DevicePtr> {
        memory::reserve_va(self, dev, bytes)
    }

    fn free_va(&self, dev: usize, base: DevicePtr, bytes: u64) -> Result<()> {
        memory::free_va(self, dev, base, bytes)
    }

    fn map(
        &self,
        dev: usize,
        va: DevicePtr,
        bytes: u64,
        chunk: ChunkHandle,
        chunk_offset: u64,
    ) -> Result<()> {
        memory::map(self, dev, va, bytes, chunk, chunk_offset)
    }

    fn map_run(&self, dev: usize, va: DevicePtr, gran: u64, chunks: &[ChunkHandle]) -> Result<()> {
        memory::map_run(self, dev, va, gran, chunks)
    }

    fn unmap(&self, dev: usize, va: DevicePtr, bytes: u64) -> Result<()> {
        memory::unmap(self, dev, va, bytes)
    }

    fn set_access(&self, dev: usize, va: DevicePtr, bytes: u64, peers: &[usize]) -> Result<()> {
        memory::set_access(self, dev, va, bytes, peers)
    }

    fn create_stream(&self, dev: usize) -> Result<StreamHandle> {
        streams::create_stream(self, dev)
    }

    fn destroy_stream(&self, dev: usize, stream: StreamHandle) -> Result<()> {
        streams::destroy_stream(self, dev, stream)
    }

    fn create_event(&self, dev: usize) -> Result<EventHandle> {
        streams::create_event(self, dev)
    }

    fn destroy_event(&self, dev: usize, event: EventHandle) -> Result<()> {
        streams::destroy_event(self, dev, event)
    }

    fn record_event(&self, dev: usize, event: EventHandle, stream: StreamHandle) -> Result<()> {
        streams::record_event(self, dev, event, stream)
    }

    fn query_event(&self, dev: usize, event: EventHandle) -> Result<bool> {
        streams::query_event(self, dev, event)
    }

    fn sync_event(&self, dev: usize, event: EventHandle) -> Result<()> {
        streams::sync_event(self, dev, event)
    }

    fn stream_wait_event(
        &self,
        dev: usize,
        stream: StreamHandle,
        event: EventHandle,
    ) -> Result<()> {
        streams::stream_wait_event(self, dev, stream, event)
    }

    fn sync_stream(&self, dev: usize, stream: StreamHandle) -> Result<()> {
        streams::sync_stream(self, dev, stream)
    }

    fn stream_capturing(&self, dev: usize, stream: StreamHandle) -> Result<bool> {
        streams::stream_capturing(self, dev, stream)
    }

    fn query_stream(&self, dev: usize, stream: StreamHandle) -> Result<bool> {
        streams::query_stream(self, dev, stream)
    }

    /// One launch of the compaction kernel per conflict-free group of
    /// moves (see [`kernel`]), or, where the kernel cannot be loaded, one
    /// `cuMemcpyDtoDAsync` per move (more for a move that overlaps itself),
    /// all in order on `stream`. Either way the batch has in-order `memmove`
    /// semantics and the host never waits on the device, nor on NVRTC: the
    /// first call on a device starts compiling and loading the kernel on a
    /// background thread and uses the copies until it is loaded (see
    /// [`kernel`]).
    fn enqueue_moves(&self, dev: usize, stream: StreamHandle, moves: &[Move]) -> Result<()> {
        copies::enqueue_moves(self, dev, stream, moves)
    }

    fn enqueue_fill(
        &self,
        dev: usize,
        stream: StreamHandle,
        ptr: DevicePtr,
        bytes: u64,
        value: u8,
    ) -> Result<()> {
        copies::enqueue_fill(self, dev, stream, ptr, bytes, value)
    }

    /// Synchronous with respect to the legacy default stream only: work
    /// enqueued on streams from [`Backend::create_stream`] (non-blocking) is
    /// not waited for, so sync that stream first.
    fn copy_to_host(&self, dev: usize, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
        copies::copy_to_host(self, dev, src, dst)
    }

    /// Complete on return: the bytes are in device memory before any work
    /// enqueued afterwards, on any stream, can read them (see
    /// `copies::copy_from_host` for how).
    fn copy_from_host(&self, dev: usize, dst: DevicePtr, src: &[u8]) -> Result<()> {
        copies::copy_from_host(self, dev, dst, src)
    }

    fn counters(&self) -> BackendCounters {
        self.counters.snapshot()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Opens the CUDA backend as a trait object; [`Error::NoDriver`] where no
/// driver or device exists.
pub fn open() -> Result<std::sync::Arc<dyn crate::backend::Backend>> {
    Ok(std::sync::Arc::new(CudaBackend::new()?))
}
