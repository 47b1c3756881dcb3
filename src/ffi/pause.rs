//! Tagged allocations, pause and resume through the C ABI:
//! `gpupool_alloc_tagged`, the thread's tag scope
//! (`gpupool_set_thread_tag`, `gpupool_clear_thread_tag`), `gpupool_pause`
//! and `gpupool_resume`. The rules are those of `src/pool/pause.rs`.
//!
//! Invariant: the thread tag is read only by `gpupool_alloc` and
//! `gpupool_torch_malloc` (through [`alloc_raw`]); it lives in this
//! thread's record (`thread.rs`), set and cleared by the caller, and
//! survives `gpupool_shutdown` and `gpupool_init`.

use super::state::with_state;
use super::status::{status, Fail};
use super::thread::{with_thread, FfiThread};
use crate::error::Result;
use crate::pool::{DevicePool, Stream};
use crate::ptr::DevicePtr;
use std::ffi::{c_int, c_void};

/// A raw allocation, tagged with this thread's tag if one is set.
#[inline]
pub(super) fn alloc_raw(
    t: &FfiThread,
    pool: &DevicePool,
    size: usize,
    s: &Stream,
) -> Result<DevicePtr> {
    match t.tag.get() {
        Some(tag) => pool.alloc_raw_tagged(size, s, tag),
        None => pool.alloc_raw(size, s),
    }
}

/// Like `gpupool_alloc`, under `tag`: the allocation owns whole granules
/// (granule aligned, its size rounded up to the granularity) so that
/// `gpupool_pause(tag, ...)` can give its memory back alone. Free it with
/// `gpupool_free`, paused or not. `GPUPOOL_STATUS_UNSUPPORTED` on a device
/// without virtual memory management. On any failure `*out` is `NULL`.
///
/// # Safety
/// `out` is NULL or valid for one pointer write.
#[no_mangle]
pub unsafe extern "C" fn gpupool_alloc_tagged(
    size: usize,
    device: c_int,
    stream: *mut c_void,
    tag: u64,
    out: *mut *mut c_void,
) -> c_int {
    status("gpupool_alloc_tagged", || {
        if out.is_null() {
            return Err(Fail::null("out"));
        }
        // SAFETY: `out` is non-NULL and valid for writes (caller's contract).
        unsafe { out.write(std::ptr::null_mut()) };
        let p = with_state(|st| {
            st.with_stream(device, stream, |pool, s| {
                Ok(pool.alloc_raw_tagged(size, s, tag)?)
            })
        })?;
        // SAFETY: as above.
        unsafe { out.write(p.addr() as usize as *mut c_void) };
        Ok(())
    })
}

/// Makes `gpupool_alloc` and `gpupool_torch_malloc` on the calling thread
/// tag their allocations with `tag` (as `gpupool_alloc_tagged` does) until
/// `gpupool_clear_thread_tag`: a scope for code that allocates through
/// PyTorch. Needs no runtime; never fails.
#[no_mangle]
pub extern "C" fn gpupool_set_thread_tag(tag: u64) -> c_int {
    status("gpupool_set_thread_tag", || {
        with_thread(|t| t.tag.set(Some(tag)));
        Ok(())
    })
}

/// Ends the calling thread's tag scope: its allocations are untagged again.
#[no_mangle]
pub extern "C" fn gpupool_clear_thread_tag() -> c_int {
    status("gpupool_clear_thread_tag", || {
        with_thread(|t| t.tag.set(None));
        Ok(())
    })
}

/// Gives the device memory of every live allocation tagged `tag`, on every
/// device in use, back to the driver while their addresses stay reserved;
/// with `save != 0` their bytes are copied to host memory first. Waits on
/// the host for the streams those allocations were used on (their
/// allocation stream and recorded streams). Touching a paused allocation
/// is an illegal address until `gpupool_resume`. Pausing an unknown tag,
/// or one already paused, releases nothing. `*released` (when not NULL)
/// gets the bytes released (0 on failure). `GPUPOOL_STATUS_UNSUPPORTED`
/// without virtual memory management.
///
/// # Safety
/// `released` is NULL or valid for one `uint64_t` write.
#[no_mangle]
pub unsafe extern "C" fn gpupool_pause(tag: u64, save: c_int, released: *mut u64) -> c_int {
    status("gpupool_pause", || {
        if !released.is_null() {
            // SAFETY: non-NULL and valid for writes (caller's contract).
            unsafe { released.write(0) };
        }
        let bytes = with_state(|st| Ok(st.rt.pause(tag, save != 0)?))?;
        if !released.is_null() {
            // SAFETY: as above.
            unsafe { released.write(bytes) };
        }
        Ok(())
    })
}

/// Maps new device memory under every paused allocation tagged `tag`, at
/// the same addresses, and restores the bytes saved by `gpupool_pause`
/// (unsaved contents are undefined). All or nothing per device: on
/// `GPUPOOL_STATUS_OUT_OF_MEMORY` the device's allocations stay paused
/// with their saved bytes. Resuming a tag with nothing paused does
/// nothing. `*mapped` (when not NULL) gets the bytes mapped (0 on failure).
///
/// # Safety
/// `mapped` is NULL or valid for one `uint64_t` write.
#[no_mangle]
pub unsafe extern "C" fn gpupool_resume(tag: u64, mapped: *mut u64) -> c_int {
    status("gpupool_resume", || {
        if !mapped.is_null() {
            // SAFETY: non-NULL and valid for writes (caller's contract).
            unsafe { mapped.write(0) };
        }
        let bytes = with_state(|st| Ok(st.rt.resume(tag)?))?;
        if !mapped.is_null() {
            // SAFETY: as above.
            unsafe { mapped.write(bytes) };
        }
        Ok(())
    })
}
