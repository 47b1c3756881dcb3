//! Streams and events: non-blocking streams, timing-free events, and the
//! calls that order them (record, query, synchronize, wait).
//!
//! Invariants: `query_event` never blocks the host; the two calls that do
//! (`sync_event`, `sync_stream`) count a host sync, which is how tests
//! prove the pool's alloc/free path makes none. Handles are opaque driver
//! pointers carried as integers; a null event is an error, a null stream
//! the legacy default stream.

use super::driver::{check, error_name};
use super::CudaBackend;
use crate::backend::Call;
use crate::error::{Error, Result};
use crate::ptr::{EventHandle, StreamHandle};
use cudarc::driver::sys;
use std::ffi::c_uint;
use std::ptr;

pub(super) fn stream_of(s: StreamHandle) -> sys::CUstream {
    s.0 as usize as sys::CUstream
}

fn event_of(e: EventHandle) -> Result<sys::CUevent> {
    if e.0 == 0 {
        return Err(Error::InvalidHandle("null event".into()));
    }
    Ok(e.0 as usize as sys::CUevent)
}

pub(super) fn create_stream(be: &CudaBackend, dev: usize) -> Result<StreamHandle> {
    let _cx = be.enter(dev)?;
    let mut s: sys::CUstream = ptr::null_mut();
    be.counters.count(Call::StreamCreate);
    // SAFETY: `s` is a valid out-pointer.
    check("cuStreamCreate", unsafe {
        sys::cuStreamCreate(
            &mut s,
            sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint,
        )
    })?;
    Ok(StreamHandle(s as usize as u64))
}

pub(super) fn destroy_stream(be: &CudaBackend, dev: usize, stream: StreamHandle) -> Result<()> {
    let _cx = be.enter(dev)?;
    if stream.0 == 0 {
        return Err(Error::InvalidHandle(
            "the default stream cannot be destroyed".into(),
        ));
    }
    be.counters.count(Call::StreamDestroy);
    // SAFETY: the handle is non-null and the driver validates it.
    check("cuStreamDestroy", unsafe {
        sys::cuStreamDestroy_v2(stream_of(stream))
    })
}

pub(super) fn create_event(be: &CudaBackend, dev: usize) -> Result<EventHandle> {
    let _cx = be.enter(dev)?;
    let mut e: sys::CUevent = ptr::null_mut();
    be.counters.count(Call::EventCreate);
    // SAFETY: `e` is a valid out-pointer.
    check("cuEventCreate", unsafe {
        sys::cuEventCreate(
            &mut e,
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint,
        )
    })?;
    Ok(EventHandle(e as usize as u64))
}

pub(super) fn destroy_event(be: &CudaBackend, dev: usize, event: EventHandle) -> Result<()> {
    let _cx = be.enter(dev)?;
    let e = event_of(event)?;
    be.counters.count(Call::EventDestroy);
    // SAFETY: the handle is non-null and the driver validates it.
    check("cuEventDestroy", unsafe { sys::cuEventDestroy_v2(e) })
}

pub(super) fn record_event(
    be: &CudaBackend,
    dev: usize,
    event: EventHandle,
    stream: StreamHandle,
) -> Result<()> {
    let _cx = be.enter(dev)?;
    let e = event_of(event)?;
    be.counters.count(Call::EventRecord);
    // SAFETY: opaque handles, validated by the driver.
    check("cuEventRecord", unsafe {
        sys::cuEventRecord(e, stream_of(stream))
    })
}

pub(super) fn query_event(be: &CudaBackend, dev: usize, event: EventHandle) -> Result<bool> {
    let _cx = be.enter(dev)?;
    let e = event_of(event)?;
    be.counters.count(Call::EventQuery);
    // SAFETY: an opaque handle, validated by the driver.
    let r = unsafe { sys::cuEventQuery(e) };
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        other => Err(Error::backend("cuEventQuery", error_name(other))),
    }
}

pub(super) fn sync_event(be: &CudaBackend, dev: usize, event: EventHandle) -> Result<()> {
    let _cx = be.enter(dev)?;
    let e = event_of(event)?;
    be.counters.count(Call::EventSynchronize);
    be.counters.count_host_sync(dev);
    // SAFETY: an opaque handle, validated by the driver.
    check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(e) })
}

pub(super) fn stream_wait_event(
    be: &CudaBackend,
    dev: usize,
    stream: StreamHandle,
    event: EventHandle,
) -> Result<()> {
    let _cx = be.enter(dev)?;
    let e = event_of(event)?;
    be.counters.count(Call::StreamWaitEvent);
    // SAFETY: opaque handles, validated by the driver; flags must be 0.
    check("cuStreamWaitEvent", unsafe {
        sys::cuStreamWaitEvent(stream_of(stream), e, 0)
    })
}

pub(super) fn sync_stream(be: &CudaBackend, dev: usize, stream: StreamHandle) -> Result<()> {
    let _cx = be.enter(dev)?;
    be.counters.count(Call::StreamSynchronize);
    be.counters.count_host_sync(dev);
    // SAFETY: an opaque handle (null: the legacy default stream),
    // validated by the driver.
    check("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(stream_of(stream))
    })
}

/// `cuStreamQuery`: whether all work enqueued on `stream` completed.
pub(super) fn query_stream(be: &CudaBackend, dev: usize, stream: StreamHandle) -> Result<bool> {
    let _cx = be.enter(dev)?;
    be.counters.count(Call::StreamQuery);
    // SAFETY: an opaque handle (null: the legacy default stream),
    // validated by the driver.
    let r = unsafe { sys::cuStreamQuery(stream_of(stream)) };
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        other => Err(Error::backend("cuStreamQuery", error_name(other))),
    }
}

/// `cuStreamIsCapturing`: whether `stream` captures a graph (an
/// invalidated capture counts: it still has to end).
pub(super) fn stream_capturing(be: &CudaBackend, dev: usize, stream: StreamHandle) -> Result<bool> {
    let _cx = be.enter(dev)?;
    be.counters.count(Call::StreamIsCapturing);
    let mut st = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: `st` is a valid out-pointer; the driver validates the handle.
    check("cuStreamIsCapturing", unsafe {
        sys::cuStreamIsCapturing(stream_of(stream), &mut st)
    })?;
    Ok(st != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// The calling thread in relaxed stream-capture mode while this lives
/// (`cuThreadExchangeStreamCaptureMode`), as PyTorch's allocator makes
/// `cudaMalloc` during a capture: creating and mapping new memory is not a
/// stream operation, but a global-mode capture on any thread forbids such
/// "potentially unsafe" calls on every thread that has not relaxed. The
/// previous mode comes back on drop. Not counted: a thread-local switch,
/// no device work. A failure (an old driver) leaves the mode as it was.
pub(super) struct RelaxedCapture {
    prev: Option<sys::CUstreamCaptureMode>,
}

impl RelaxedCapture {
    pub(super) fn enter() -> RelaxedCapture {
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: `mode` is a valid in/out pointer for the call.
        let r = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        RelaxedCapture {
            prev: (r == sys::CUresult::CUDA_SUCCESS).then_some(mode),
        }
    }
}

impl Drop for RelaxedCapture {
    fn drop(&mut self) {
        if let Some(mut mode) = self.prev {
            // SAFETY: `mode` is a valid in/out pointer; it restores the
            // mode `enter` swapped out on this same thread.
            let _ = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        }
    }
}
