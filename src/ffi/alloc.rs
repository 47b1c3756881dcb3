//! Allocation through the C ABI: `gpupool_alloc`, `gpupool_free` and
//! `gpupool_record_stream`, each on an explicit device and stream.
//!
//! A free of a pointer live on another device is reported as
//! `GPUPOOL_STATUS_WRONG_DEVICE` naming the owner (`State::classify`).

use super::state::{with_state, with_state_in, State};
use super::status::{status, status_in, FResult, Fail};
use super::thread::{with_thread, FfiThread};
use crate::ptr::DevicePtr;
use std::ffi::{c_int, c_void};

/// Allocates `size` bytes on `device` for use on `stream` (`NULL`: the
/// default stream) into `*out`. Alignment is at least 256 bytes. The memory
/// is never moved. `size == 0` is `GPUPOOL_STATUS_INVALID_SIZE`, as is a size
/// larger than the device. On any failure `*out` is set to `NULL`. Inside a
/// `gpupool_set_thread_tag` scope the allocation is tagged (see
/// `gpupool_alloc_tagged`).
///
/// # Safety
/// `out` is NULL or valid for one pointer write.
#[no_mangle]
pub unsafe extern "C" fn gpupool_alloc(
    size: usize,
    device: c_int,
    stream: *mut c_void,
    out: *mut *mut c_void,
) -> c_int {
    // `move` closures throughout: captured by reference, the arguments
    // went through the stack on every call.
    with_thread(move |t| {
        status_in(t, "gpupool_alloc", move || {
            if out.is_null() {
                return Err(Fail::null("out"));
            }
            // SAFETY: `out` is non-NULL and valid for writes (caller's
            // contract).
            unsafe { out.write(std::ptr::null_mut()) };
            let p = with_state_in(t, move |st| alloc_in(t, st, size, device, stream))?;
            // SAFETY: as above.
            unsafe { out.write(p.addr() as usize as *mut c_void) };
            Ok(())
        })
    })
}

/// The body of `gpupool_alloc` and `gpupool_torch_malloc` on the live
/// state. A named function forced inline: as a closure, LLVM kept it out of
/// line (12 more instructions a call).
#[inline(always)]
pub(super) fn alloc_in(
    t: &FfiThread,
    st: &State,
    size: usize,
    device: c_int,
    stream: *mut c_void,
) -> FResult<DevicePtr> {
    st.with_stream_in(t, device, stream, move |pool, s| {
        Ok(super::pause::alloc_raw(t, pool, size, s)?)
    })
}

/// Frees `ptr` (from `gpupool_alloc` or `gpupool_torch_malloc` on `device`),
/// ordered after the work enqueued so far on `stream` and on every stream
/// recorded with `gpupool_record_stream`. The memory is reusable at once by
/// `stream`, by other streams once that work completes. Errors:
/// `NULL_ARGUMENT`, `WRONG_DEVICE` (the message names the owner),
/// `UNKNOWN_POINTER`, `DOUBLE_FREE`.
#[no_mangle]
pub extern "C" fn gpupool_free(ptr: *mut c_void, device: c_int, stream: *mut c_void) -> c_int {
    with_thread(move |t| status_in(t, "gpupool_free", move || free_impl(t, ptr, device, stream)))
}

/// The body of `gpupool_free`, shared with `gpupool_torch_free`.
#[inline(always)]
pub(super) fn free_impl(
    t: &FfiThread,
    ptr: *mut c_void,
    device: c_int,
    stream: *mut c_void,
) -> FResult<()> {
    if ptr.is_null() {
        return Err(Fail::null("ptr"));
    }
    let addr = ptr as usize as u64;
    with_state_in(t, move |st| free_in(t, st, addr, device, stream))
}

/// [`free_impl`] on the live state (forced inline, as [`alloc_in`]).
#[inline(always)]
fn free_in(
    t: &FfiThread,
    st: &State,
    addr: u64,
    device: c_int,
    stream: *mut c_void,
) -> FResult<()> {
    st.with_pointer_stream_in(t, device, stream, addr, move |pool, s| {
        pool.free_raw(DevicePtr(addr), s)
            .map_err(|e| st.classify(e, addr, pool.device()))
    })
}

/// Marks `ptr` as also used on `stream` (PyTorch's `record_stream`): its
/// free will wait for the work enqueued on `stream` up to the free.
#[no_mangle]
pub extern "C" fn gpupool_record_stream(
    ptr: *mut c_void,
    device: c_int,
    stream: *mut c_void,
) -> c_int {
    status("gpupool_record_stream", || {
        if ptr.is_null() {
            return Err(Fail::null("ptr"));
        }
        let addr = ptr as usize as u64;
        with_state(|st| {
            st.with_pointer_stream(device, stream, addr, |pool, s| {
                pool.record_stream_raw(DevicePtr(addr), s)
                    .map_err(|e| st.classify(e, addr, pool.device()))
            })
        })
    })
}
