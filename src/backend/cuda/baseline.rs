//! Driver-level baselines for `gpupool bench --gpu`: the calls a pool is
//! measured against on a real device, timed from the host.
//!
//! * `cuMemAlloc` + `cuMemFree`: what a framework without a pool pays (both
//!   synchronize with the device).
//! * `cuMemAllocAsync` + `cuMemFreeAsync` on a stream: CUDA's own
//!   stream-ordered pool (the default memory pool of the device).
//! * `cuMemcpyDtoDAsync`: the copy bandwidth the compaction kernel is
//!   compared with.
//!
//! The async symbols are not in the backend's required list (the pool never
//! calls them), so they are resolved here first and a driver without them
//! gives a typed error.

use super::driver::{check, resolve_symbols};
use super::streams::stream_of;
use super::CudaBackend;
use crate::error::Result;
use crate::ptr::{DevicePtr, StreamHandle};
use cudarc::driver::sys;
use std::time::{Duration, Instant};

const ASYNC_SYMBOLS: &[&str] = &["cuMemAllocAsync", "cuMemFreeAsync"];

impl CudaBackend {
    /// Time of `iters` `cuMemAlloc` + `cuMemFree` pairs of `bytes` on `dev`.
    pub fn time_mem_alloc_pairs(&self, dev: usize, bytes: u64, iters: u32) -> Result<Duration> {
        let _cx = self.enter(dev)?;
        let start = Instant::now();
        for _ in 0..iters {
            let mut p: sys::CUdeviceptr = 0;
            // SAFETY: `p` is a valid out-pointer; the context is current.
            check("cuMemAlloc", unsafe {
                sys::cuMemAlloc_v2(&mut p, bytes as usize)
            })?;
            // SAFETY: `p` was just allocated by cuMemAlloc and is freed once.
            check("cuMemFree", unsafe { sys::cuMemFree_v2(p) })?;
        }
        Ok(start.elapsed())
    }

    /// Host time of `iters` `cuMemAllocAsync` + `cuMemFreeAsync` pairs of
    /// `bytes` on `stream` (the device's default memory pool). The stream
    /// is synchronized after the clock stops, so the figure is what the
    /// calls cost the host, as for the pool's own pairs.
    pub fn time_mem_alloc_async_pairs(
        &self,
        dev: usize,
        stream: StreamHandle,
        bytes: u64,
        iters: u32,
    ) -> Result<Duration> {
        resolve_symbols(ASYNC_SYMBOLS)?;
        let _cx = self.enter(dev)?;
        let s = stream_of(stream);
        let start = Instant::now();
        for _ in 0..iters {
            let mut p: sys::CUdeviceptr = 0;
            // SAFETY: `p` is a valid out-pointer; both symbols were resolved
            // above; the stream is a live handle of this device.
            check("cuMemAllocAsync", unsafe {
                sys::cuMemAllocAsync(&mut p, bytes as usize, s)
            })?;
            // SAFETY: `p` came from cuMemAllocAsync on the same stream and is
            // freed once, stream-ordered.
            check("cuMemFreeAsync", unsafe { sys::cuMemFreeAsync(p, s) })?;
        }
        let t = start.elapsed();
        // SAFETY: a live stream of this device.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(s)
        })?;
        Ok(t)
    }

    /// Time of `iters` copies of `bytes` from `src` to `dst` with
    /// `cuMemcpyDtoDAsync` on `stream`, including the final synchronize.
    pub fn time_dtod_copies(
        &self,
        dev: usize,
        stream: StreamHandle,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: u64,
        iters: u32,
    ) -> Result<Duration> {
        let _cx = self.enter(dev)?;
        let s = stream_of(stream);
        let start = Instant::now();
        for _ in 0..iters {
            // SAFETY: device-to-device copy; the driver validates both ranges
            // (the caller owns them) and no host memory is touched.
            check("cuMemcpyDtoDAsync", unsafe {
                sys::cuMemcpyDtoDAsync_v2(dst.0, src.0, bytes as usize, s)
            })?;
        }
        // SAFETY: a live stream of this device.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(s)
        })?;
        Ok(start.elapsed())
    }
}
