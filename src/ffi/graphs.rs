//! CUDA graphs through the C ABI: private graph pools (what PyTorch's
//! `torch.cuda.graph(pool=...)` and `MemPool` use through the pluggable
//! allocator's `beginAllocateToPool` / `endAllocateToPool` /
//! `releasePool`), and the capture rules they switch on (see
//! `src/pool/capture.rs` and `src/pool/private_pool.rs`).
//!
//! Invariant: bad input (pool 0, an invalid device, an unknown or released
//! pool, a stream already routed) is `GPUPOOL_STATUS_INVALID_ARGUMENT` or
//! the device or stream status, and changes nothing.

use super::state::with_state;
use super::status::{status, Fail};
use std::ffi::{c_int, c_void};

/// From now on, allocations on `stream` of `device` (`gpupool_alloc`,
/// `gpupool_torch_malloc`) go to private pool `pool` (nonzero; made on
/// first use) until `gpupool_end_allocate_to_pool(device, pool)`, and a
/// graph capture counts as underway on `stream`: while any is on the
/// device, gpupool records no event on a capturing stream (frees that would
/// are deferred to the end of the capture), queries and waits on no event,
/// and unmaps and releases no memory. Call it before the capture begins,
/// once per stream to route. Errors, changing nothing: pool 0, a stream
/// already routed, a released pool.
#[no_mangle]
pub extern "C" fn gpupool_begin_allocate_to_pool(
    device: c_int,
    pool: u64,
    stream: *mut c_void,
) -> c_int {
    status("gpupool_begin_allocate_to_pool", || {
        with_state(|st| {
            st.with_stream(
                device,
                stream,
                |p, s| Ok(p.begin_allocate_to_pool(pool, s)?),
            )
        })
    })
}

/// Ends the routing of every stream routed to private pool `pool` of
/// `device`; their captures are over for gpupool, and once none is left on
/// the device the deferred frees record their events. Blocks freed in the
/// pool stay in it. Errors: pool 0, a pool never used on that device.
#[no_mangle]
pub extern "C" fn gpupool_end_allocate_to_pool(device: c_int, pool: u64) -> c_int {
    status("gpupool_end_allocate_to_pool", || {
        with_state(|st| Ok(st.pool(device)?.end_allocate_to_pool(pool)?))
    })
}

/// The graph of private pool `pool` of `device` is gone: ends its routing
/// and gives its free memory back to the device pool (reusable by others
/// after the work of the streams that used it); blocks still live stay the
/// pool's until freed, then go back. Errors, changing nothing: pool 0, an
/// unknown pool, a pool released already.
#[no_mangle]
pub extern "C" fn gpupool_release_pool(device: c_int, pool: u64) -> c_int {
    status("gpupool_release_pool", || {
        with_state(|st| Ok(st.pool(device)?.release_pool(pool)?))
    })
}

/// Allocates `size` bytes on `device` for use on `stream` directly in
/// private pool `pool` (nonzero; made on first use) into `*out`, whatever
/// the stream's routing. Free it with `gpupool_free`: it stays in the pool
/// (reusable by the pool's later allocations on that stream) until
/// `gpupool_release_pool`. On any failure `*out` is `NULL`.
///
/// # Safety
/// `out` is NULL or valid for one pointer write.
#[no_mangle]
pub unsafe extern "C" fn gpupool_alloc_in_pool(
    size: usize,
    device: c_int,
    stream: *mut c_void,
    pool: u64,
    out: *mut *mut c_void,
) -> c_int {
    status("gpupool_alloc_in_pool", || {
        if out.is_null() {
            return Err(Fail::null("out"));
        }
        // SAFETY: `out` is non-NULL and valid for writes (caller's contract).
        unsafe { out.write(std::ptr::null_mut()) };
        let p = with_state(|st| {
            st.with_stream(device, stream, |pl, s| {
                Ok(pl.alloc_raw_in_pool(size, s, pool)?)
            })
        })?;
        // SAFETY: as above.
        unsafe { out.write(p.addr() as usize as *mut c_void) };
        Ok(())
    })
}
