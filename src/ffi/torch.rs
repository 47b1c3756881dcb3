//! The hooks PyTorch's `CUDAPluggableAllocator` loads:
//! `gpupool_torch_malloc`, `gpupool_torch_free` and
//! `gpupool_torch_record_stream`.
//!
//! Invariant: they return no status, so every failure also goes to stderr
//! ([`report_to_stderr`]) besides `gpupool_last_error`; the first
//! allocation initializes gpupool from `GPUPOOL_CONF` when `gpupool_init`
//! was not called.

use super::alloc::{alloc_in, free_impl};
use super::state::{ensure_init, with_state, with_state_in};
use super::status::{report_to_stderr, run, run_in, FResult, Fail, GpupoolStatus};
use super::thread::{with_thread, FfiThread};
use crate::ptr::DevicePtr;
use std::ffi::{c_int, c_void};

/// PyTorch's `CUDAPluggableAllocator` allocation hook
/// (`void* (size_t, int, cudaStream_t)`). Returns the pointer, or `NULL`:
/// for `size == 0` (no error, as PyTorch's own allocator does) and on
/// failure (with `gpupool_last_error` set and the message also written to
/// stderr, since PyTorch does not check for `NULL`). The first call
/// initializes gpupool from `GPUPOOL_CONF` when `gpupool_init` was not
/// called, on CUDA unless `GPUPOOL_CONF` says `backend=sim` (without a
/// driver that first call fails with `GPUPOOL_STATUS_NO_DRIVER`, never
/// falling back to the simulator); after `gpupool_shutdown` it fails.
#[no_mangle]
pub extern "C" fn gpupool_torch_malloc(
    size: libc::ssize_t,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    with_thread(move |t| torch_malloc(t, size, device, stream))
}

/// The body of [`gpupool_torch_malloc`], with this thread's record.
#[inline]
fn torch_malloc(
    t: &FfiThread,
    size: libc::ssize_t,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    // `move` closures (as in `gpupool_alloc`): the arguments stay in
    // registers.
    let r = run_in(t, "gpupool_torch_malloc", move || {
        let size = usize::try_from(size).map_err(|_| {
            Fail::new(
                GpupoolStatus::InvalidSize,
                format!("invalid size {size}: negative"),
            )
        })?;
        if size == 0 {
            return Ok(std::ptr::null_mut());
        }
        // One read of the global state on the fast path; the first call
        // initializes from `GPUPOOL_CONF` and tries again.
        let p = match with_state_in(t, move |st| alloc_in(t, st, size, device, stream)) {
            Err(f) if f.status == GpupoolStatus::NotInitialized => {
                first_alloc(t, size, device, stream)?
            }
            r => r?,
        };
        Ok(p.addr() as usize as *mut c_void)
    });
    r.unwrap_or_else(|_| {
        report_to_stderr();
        std::ptr::null_mut()
    })
}

/// The first allocation of a process that did not call `gpupool_init`:
/// initializes from `GPUPOOL_CONF` and allocates (out of line, so that
/// the hook's fast path stays one call).
#[cold]
#[inline(never)]
fn first_alloc(
    t: &FfiThread,
    size: usize,
    device: c_int,
    stream: *mut c_void,
) -> FResult<DevicePtr> {
    ensure_init()?;
    with_state_in(t, move |st| alloc_in(t, st, size, device, stream))
}

/// PyTorch's `CUDAPluggableAllocator` free hook
/// (`void (void*, size_t, int, cudaStream_t)`). `NULL` is a no-op; `size`
/// is not needed (the pool knows it). Errors set `gpupool_last_error` and
/// are written to stderr.
#[no_mangle]
pub extern "C" fn gpupool_torch_free(
    ptr: *mut c_void,
    size: libc::ssize_t,
    device: c_int,
    stream: *mut c_void,
) {
    let _ = size;
    let r = with_thread(move |t| {
        run_in(t, "gpupool_torch_free", move || {
            if ptr.is_null() {
                return Ok(());
            }
            free_impl(t, ptr, device, stream)
        })
    });
    if r.is_err() {
        report_to_stderr();
    }
}

/// The shape of PyTorch's `record_stream` hook (`void (void*,
/// cudaStream_t)`, settable from C++ with `set_record_stream_fn`): records
/// `stream` for `ptr` on whichever device holds it. Errors set
/// `gpupool_last_error` and are written to stderr.
#[no_mangle]
pub extern "C" fn gpupool_torch_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    let r = run("gpupool_torch_record_stream", || {
        if ptr.is_null() {
            return Err(Fail::null("ptr"));
        }
        let addr = ptr as usize as u64;
        with_state(|st| {
            let dev = st
                .rt
                .active_devices()
                .into_iter()
                .find(|p| p.raw_size(DevicePtr(addr)).is_some())
                .map(|p| p.device())
                .ok_or_else(|| {
                    Fail::new(
                        GpupoolStatus::UnknownPointer,
                        format!("unknown pointer {addr:#x} on every device"),
                    )
                })?;
            st.with_stream(dev as c_int, stream, |pool, s| {
                Ok(pool.record_stream_raw(DevicePtr(addr), s)?)
            })
        })
    });
    if r.is_err() {
        report_to_stderr();
    }
}
