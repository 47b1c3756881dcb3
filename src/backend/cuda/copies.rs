//! Moving bytes: compaction moves (the kernel where it is loaded,
//! `cuMemcpyDtoDAsync` otherwise), fills, and copies to and from the host.
//!
//! Invariants: a batch of moves has in-order `memmove` semantics on its
//! stream whichever way it runs, and enqueueing never waits for the device
//! nor for NVRTC (the kernel loads in the background; copies run until
//! then). A host-to-device copy is complete on return, on the backend's
//! own stream, with one counted host sync.

use super::driver::check;
use super::streams::stream_of;
use super::{kernel, CudaBackend};
use crate::backend::move_groups::{self, split_move};
use crate::backend::{Call, Move};
use crate::error::{Error, Result};
use crate::ptr::{DevicePtr, StreamHandle};
use cudarc::driver::sys;
use std::ffi::{c_uint, c_void};
use std::ptr;

impl CudaBackend {
    /// Whether [`Backend::enqueue_moves`](crate::backend::Backend::enqueue_moves) on `dev` runs the compaction
    /// kernel (`true`) or falls back to `cuMemcpyDtoDAsync` copies. Loads
    /// the kernel (compiling it with NVRTC) if that was not done yet,
    /// waiting for it: call it outside any pool lock (benchmarks, tests,
    /// warm-up), never from a pool's own path.
    pub fn move_kernel_ready(&self, dev: usize) -> Result<bool> {
        Ok(self.move_kernel_info(dev)?.is_ok())
    }

    /// How `dev`'s compaction kernel was loaded (architecture, cubin or
    /// PTX, the NVRTC library), or why it could not be; waits for the load
    /// like [`CudaBackend::move_kernel_ready`].
    pub fn move_kernel_info(
        &self,
        dev: usize,
    ) -> Result<std::result::Result<kernel::KernelInfo, Error>> {
        let d = self.device(dev)?;
        Ok(match d.kernel.load_now(dev, d.cu, d.context()?) {
            Ok(k) => Ok(k.info.clone()),
            Err(e) => Err(e.clone()),
        })
    }

    /// Loads one kind of kernel image (cubin or PTX, compiled for `dev`'s
    /// architecture) into `dev`'s context and finds the kernel in it,
    /// without using it: whether this driver accepts that image from this
    /// NVRTC. For the GPU check; the module stays loaded until the context
    /// goes.
    pub fn try_load_move_kernel(&self, dev: usize, kind: kernel::ImageKind) -> Result<()> {
        let d = self.enter(dev)?;
        kernel::CompactKernel::load(d.cu, Some(kind)).map(|_| ())
    }
}

/// One launch of the compaction kernel per conflict-free group of
/// moves (see [`kernel`]), or, where the kernel cannot be loaded, one
/// `cuMemcpyDtoDAsync` per move (more for a move that overlaps itself),
/// all in order on `stream`. Either way the batch has in-order `memmove`
/// semantics and the host never waits on the device, nor on NVRTC: the
/// first call on a device starts compiling and loading the kernel on a
/// background thread and uses the copies until it is loaded (see
/// [`kernel`]).
pub(super) fn enqueue_moves(
    be: &CudaBackend,
    dev: usize,
    stream: StreamHandle,
    moves: &[Move],
) -> Result<()> {
    let d = be.enter(dev)?;
    move_groups::validate(moves)?;
    if moves.iter().all(move_groups::is_noop) {
        return Ok(());
    }
    let moved = moves.iter().map(|m| m.len).sum();
    be.counters.count_units(Call::LaunchMoves, 1, moved);
    let s = stream_of(stream);
    if let Some(Ok(k)) = d.kernel.get_or_start(dev, d.cu, d.context()?) {
        return k.enqueue(s, moves);
    }
    // A stream runs its work in order, so a move reading what an
    // earlier move wrote sees the new bytes. A move that overlaps itself
    // is split into non-overlapping pieces, since cuMemcpy does not
    // promise memmove.
    for m in moves {
        for (dst, src, len) in split_move(m) {
            // SAFETY: device-to-device copy on an opaque stream; the
            // driver validates both ranges, and no host memory is read
            // or written.
            check("cuMemcpyDtoDAsync", unsafe {
                sys::cuMemcpyDtoDAsync_v2(dst, src, len as usize, s)
            })?;
        }
    }
    Ok(())
}

pub(super) fn enqueue_fill(
    be: &CudaBackend,
    dev: usize,
    stream: StreamHandle,
    ptr: DevicePtr,
    bytes: u64,
    value: u8,
) -> Result<()> {
    let _cx = be.enter(dev)?;
    be.counters.count_units(Call::MemsetAsync, 1, bytes);
    // SAFETY: fills device memory only; the driver validates the range
    // and the stream.
    check("cuMemsetD8Async", unsafe {
        sys::cuMemsetD8Async(ptr.0, value, bytes as usize, stream_of(stream))
    })
}

/// Synchronous with respect to the legacy default stream only: work
/// enqueued on streams from
/// [`Backend::create_stream`](crate::backend::Backend::create_stream)
/// (non-blocking) is not waited for, so sync that stream first.
pub(super) fn copy_to_host(
    be: &CudaBackend,
    dev: usize,
    src: DevicePtr,
    dst: &mut [u8],
) -> Result<()> {
    let _cx = be.enter(dev)?;
    if dst.is_empty() {
        return Ok(());
    }
    be.counters
        .count_units(Call::MemcpyDtoH, 1, dst.len() as u64);
    be.counters.count_host_sync(dev);
    // SAFETY: `dst` is a live, exclusively borrowed host buffer of
    // `dst.len()` bytes, and the copy is synchronous, so the driver is
    // done writing it before the borrow ends.
    check("cuMemcpyDtoH", unsafe {
        sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast::<c_void>(), src.0, dst.len())
    })
}

/// Complete on return: the bytes are in device memory before any work
/// enqueued afterwards, on any stream, can read them.
///
/// `cuMemcpyHtoD` from pageable memory may return once the bytes are
/// staged, before the DMA lands, and only the legacy default stream is
/// ordered after it: a kernel enqueued next on one of the pool's
/// non-blocking streams could read stale bytes. So the copy is enqueued
/// (`cuMemcpyHtoDAsync`) on a stream of the backend's own, created on
/// the first copy (a blocking stream, so it still follows earlier work
/// on the legacy default stream, as `cuMemcpyHtoD` did), and that
/// stream is synchronized before returning: one host-blocking sync,
/// counted, which only waits for this copy (and legacy-stream work),
/// not for the pool's streams.
pub(super) fn copy_from_host(
    be: &CudaBackend,
    dev: usize,
    dst: DevicePtr,
    src: &[u8],
) -> Result<()> {
    let d = be.enter(dev)?;
    if src.is_empty() {
        return Ok(());
    }
    let mut slot = d.copy_stream.lock();
    if *slot == 0 {
        let mut s: sys::CUstream = ptr::null_mut();
        be.counters.count(Call::StreamCreate);
        // SAFETY: `s` is a valid out-pointer; the device's context is
        // current.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_DEFAULT as c_uint)
        })?;
        *slot = s as usize;
    }
    let s = *slot as sys::CUstream;
    be.counters
        .count_units(Call::MemcpyHtoD, 1, src.len() as u64);
    be.counters.count(Call::StreamSynchronize);
    be.counters.count_host_sync(dev);
    // SAFETY: `src` is a live host buffer of `src.len()` bytes, only
    // read; the driver stages pageable memory before returning, and the
    // stream is synchronized below before the borrow ends either way.
    let r =
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst.0, src.as_ptr().cast::<c_void>(), src.len(), s) };
    // Synchronized even after an error: nothing of this call may still
    // read `src` once it returns.
    // SAFETY: the backend's own live stream of this device.
    let sync = unsafe { sys::cuStreamSynchronize(s) };
    check("cuMemcpyHtoDAsync", r)?;
    check("cuStreamSynchronize", sync)
}
