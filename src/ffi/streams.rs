//! Stream handles through the C ABI: `gpupool_stream_create`,
//! `gpupool_stream_destroy` (streams gpupool made) and
//! `gpupool_stream_release` (streams a framework made and the ABI wrapped).
//!
//! Invariant: a removed stream is dropped outside the registry's locks,
//! since dropping it flushes its free lists (and, for a created stream,
//! destroys the backend stream), and only after a grace period (other
//! threads' last-stream memories may name it: see `state.rs`).

use super::state::{bury, with_state, Known};
use super::status::{status, Fail, GpupoolStatus};
use crate::ptr::StreamHandle;
use std::ffi::{c_int, c_void};

/// Creates a stream on `device` (a non-blocking `CUstream` on CUDA, a
/// simulated stream on the simulator) and returns its handle in `*out`.
/// The stream lives until `gpupool_stream_destroy` or `gpupool_shutdown`.
/// On failure `*out` is set to `NULL`.
///
/// # Safety
/// `out` is NULL or valid for one pointer write.
#[no_mangle]
pub unsafe extern "C" fn gpupool_stream_create(device: c_int, out: *mut *mut c_void) -> c_int {
    status("gpupool_stream_create", || {
        if out.is_null() {
            return Err(Fail::null("out"));
        }
        // SAFETY: `out` is non-NULL and valid for writes (caller's contract).
        unsafe { out.write(std::ptr::null_mut()) };
        let h = with_state(|st| {
            let pool = st.pool(device)?;
            let s = pool.new_stream()?;
            let h = s.handle().raw();
            st.write_streams(pool.device()).insert(
                h,
                Box::new(Known {
                    stream: s,
                    created: true,
                }),
            );
            Ok(h)
        })?;
        // SAFETY: as above.
        unsafe { out.write(h as usize as *mut c_void) };
        Ok(())
    })
}

/// Destroys a stream made by `gpupool_stream_create` once its work is done.
/// Memory it freed goes through the cross-stream path first, so no other
/// stream reuses it early. Pointers allocated on it stay valid; free them on
/// another stream. `NULL` (the default stream) and streams gpupool did not
/// create are `GPUPOOL_STATUS_INVALID_HANDLE`.
#[no_mangle]
pub extern "C" fn gpupool_stream_destroy(device: c_int, stream: *mut c_void) -> c_int {
    status("gpupool_stream_destroy", || {
        let h = stream as usize as u64;
        let gone = with_state(|st| {
            let pool = st.pool(device)?;
            let dev = pool.device();
            if h == 0 {
                return Err(Fail::new(
                    GpupoolStatus::InvalidHandle,
                    "the default stream (NULL) cannot be destroyed",
                ));
            }
            let gone = st.remove_stream(dev, h, |k| {
                if k.created {
                    Ok(())
                } else {
                    Err(Fail::new(
                        GpupoolStatus::InvalidHandle,
                        format!("stream {h:#x} was not created by gpupool_stream_create"),
                    ))
                }
            })?;
            if gone.is_none() {
                let other = (0..st.streams.len())
                    .find(|&d| d != dev && st.read_streams(d).contains_key(&h));
                return Err(Fail::new(
                    GpupoolStatus::InvalidHandle,
                    match other {
                        Some(o) => {
                            format!("stream {h:#x} belongs to device {o}, not device {dev}")
                        }
                        None => format!("unknown stream {h:#x} on device {dev}"),
                    },
                ));
            }
            Ok(gone)
        })?;
        // Dropped outside the locks, after a grace period: this flushes
        // the stream's free lists and destroys the backend stream.
        bury(gone);
        Ok(())
    })
}

/// Releases a stream gpupool did not create (a framework's), which the ABI
/// wrapped on its first use: memory freed on it moves behind one event
/// recorded on it now, and gpupool never uses the handle again except to
/// order frees of blocks recorded on it (`gpupool_record_stream`), which
/// keep it until they are freed. Call it before destroying such a stream.
/// A stream never used through the ABI is a no-op (0); `NULL`, the default
/// streams and streams from `gpupool_stream_create` (use
/// `gpupool_stream_destroy`) are `GPUPOOL_STATUS_INVALID_HANDLE`.
#[no_mangle]
pub extern "C" fn gpupool_stream_release(device: c_int, stream: *mut c_void) -> c_int {
    status("gpupool_stream_release", || {
        let h = stream as usize as u64;
        let gone = with_state(|st| {
            let pool = st.pool(device)?;
            if StreamHandle(h).is_default() {
                return Err(Fail::new(
                    GpupoolStatus::InvalidHandle,
                    "a default stream cannot be released",
                ));
            }
            st.remove_stream(pool.device(), h, |k| {
                if k.created {
                    Err(Fail::new(
                        GpupoolStatus::InvalidHandle,
                        format!(
                            "stream {h:#x} was created by gpupool_stream_create: \
                             destroy it with gpupool_stream_destroy"
                        ),
                    ))
                } else {
                    Ok(())
                }
            })
        })?;
        // Dropped outside the locks, after a grace period: this flushes
        // the stream's free lists.
        bury(gone);
        Ok(())
    })
}
