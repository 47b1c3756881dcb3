//! Snapshots and history through the C ABI: `gpupool_snapshot_json`,
//! `gpupool_snapshot_pickle` (the layout PyTorch's memory viewer opens)
//! and `gpupool_record_history`. Diagnostics, not fast calls.

use super::state::{check_device_or_all, with_state};
use super::status::{status, Fail, GpupoolStatus};
use super::text::{c_str, write_text};
use crate::error::Error;
use crate::export;
use std::ffi::{c_char, c_int};

/// Writes a snapshot of `device` (`-1`: every device) as a JSON array of
/// snapshots (`device`, `segments` with `blocks`, `stats`, `history`). Exact
/// while no other thread uses the device; a diagnostic, not a fast call.
///
/// # Safety
/// `buf` is NULL or valid for writes of `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn gpupool_snapshot_json(
    device: c_int,
    buf: *mut c_char,
    len: usize,
) -> c_int {
    status("gpupool_snapshot_json", || {
        if buf.is_null() && len != 0 {
            return Err(Fail::null("buf"));
        }
        let json = with_state(|st| {
            let snaps: Vec<_> = check_device_or_all(st, device)?
                .into_iter()
                .map(|d| st.rt.device(d).map(|p| p.snapshot()))
                .collect::<Result<Vec<_>, Error>>()?;
            Ok(export::snapshot_to_json(&snaps))
        })?;
        // SAFETY: `buf` is NULL or valid for `len` bytes (caller's contract).
        unsafe { write_text(buf, len, &json) }
    })
}

/// Writes a snapshot of `device` (`-1`: every device) to the file `path` as
/// a pickle in the layout of PyTorch's `torch.cuda.memory._snapshot()`, which
/// PyTorch's memory viewer (`memory_viz`) opens. `device_traces` holds the
/// events recorded since `gpupool_record_history` turned recording on.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn gpupool_snapshot_pickle(device: c_int, path: *const c_char) -> c_int {
    status("gpupool_snapshot_pickle", || {
        // SAFETY: NULL or NUL-terminated by the caller's contract.
        let path = unsafe { c_str(path, "path") }?;
        let bytes = with_state(|st| {
            let snaps: Vec<_> = check_device_or_all(st, device)?
                .into_iter()
                .map(|d| st.rt.device(d).map(|p| p.snapshot()))
                .collect::<Result<Vec<_>, Error>>()?;
            Ok(export::snapshot_to_pickle(&snaps))
        })?;
        std::fs::write(path, bytes)
            .map_err(|e| Fail::new(GpupoolStatus::Io, format!("writing {path}: {e}")))
    })
}

/// Turns recording of alloc/free events on (`enabled != 0`, clearing earlier
/// ones) or off for `device` (`-1`: every device). The events appear in
/// snapshots (`history`, and `device_traces` of the pickle).
#[no_mangle]
pub extern "C" fn gpupool_record_history(device: c_int, enabled: c_int) -> c_int {
    status("gpupool_record_history", || {
        with_state(|st| {
            for d in check_device_or_all(st, device)? {
                st.rt.device(d)?.record_history(enabled != 0);
            }
            Ok(())
        })
    })
}
