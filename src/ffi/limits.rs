//! What an embedder sets on the runtime and checks of it: the memory limit
//! (`gpupool_set_memory_limit`), the out-of-memory callback
//! (`gpupool_set_oom_callback`, [`GpupoolOomCallback`]) and the ABI version
//! ([`GPUPOOL_ABI_VERSION`], `gpupool_abi_version`).
//!
//! The callback is process-wide and outlives runtimes: it is set before
//! `gpupool_init` or across restarts, and each pool calls
//! [`call_oom_callback`] once it is hooked (`State::pool`).

use super::state::{check_device_or_all, with_state};
use super::status::status;
use parking_lot::RwLock;
use std::ffi::{c_int, c_void};

/// Sets the memory limit of `device` (`-1`: every device, starting the
/// pools of devices not used yet): the pool never
/// holds more than `nbytes` of device memory (`0`: no limit but the
/// device), replacing the `max_bytes` and `fraction` keys. Lowering it
/// below what the pool holds gives cached memory back first (waiting for
/// pending frees, like `gpupool_trim`); live memory stays, and the pool
/// refuses to grow until it is under the limit. An allocation the limit
/// refuses fails with `GPUPOOL_STATUS_OUT_OF_MEMORY`.
#[no_mangle]
pub extern "C" fn gpupool_set_memory_limit(device: c_int, nbytes: u64) -> c_int {
    status("gpupool_set_memory_limit", || {
        with_state(|st| {
            for d in check_device_or_all(st, device)? {
                st.pool(d as c_int)?
                    .set_memory_limit((nbytes > 0).then_some(nbytes))?;
            }
            Ok(())
        })
    })
}

/// The out-of-memory callback: `device`, the bytes `requested`, and the
/// `user_data` given to `gpupool_set_oom_callback`.
pub type GpupoolOomCallback =
    Option<unsafe extern "C" fn(device: c_int, requested: usize, user_data: *mut c_void)>;

/// The callback and its user data (an address), process-wide.
static OOM_CALLBACK: RwLock<Option<(unsafe extern "C" fn(c_int, usize, *mut c_void), usize)>> =
    parking_lot::const_rwlock(None);

/// Registers `callback` (`NULL`: none), called once for every
/// out-of-memory error on any device, on the allocating thread, just
/// before the failing call returns `GPUPOOL_STATUS_OUT_OF_MEMORY` (or
/// `gpupool_torch_malloc` returns `NULL`). It may read statistics
/// (`gpupool_memory_stats_json`) but must not allocate through gpupool.
/// Works before `gpupool_init` and across restarts.
#[no_mangle]
pub extern "C" fn gpupool_set_oom_callback(
    callback: GpupoolOomCallback,
    user_data: *mut c_void,
) -> c_int {
    status("gpupool_set_oom_callback", || {
        *OOM_CALLBACK.write() = callback.map(|f| (f, user_data as usize));
        Ok(())
    })
}

/// Calls the registered C callback, if any, for `report`.
pub(super) fn call_oom_callback(report: &crate::error::OomReport) {
    let cb = *OOM_CALLBACK.read();
    if let Some((f, user)) = cb {
        let dev = c_int::try_from(report.device).unwrap_or(c_int::MAX);
        let requested = usize::try_from(report.requested).unwrap_or(usize::MAX);
        // SAFETY: the caller registered `f` with this signature and keeps
        // `user` valid while it is registered (the header's contract).
        unsafe { f(dev, requested, user as *mut c_void) };
    }
}

/// The version of this C ABI (`GPUPOOL_ABI_VERSION`): raised whenever a
/// function's signature or meaning changes; new functions and statuses
/// alone do not change it.
pub const GPUPOOL_ABI_VERSION: c_int = 1;

/// The ABI version of the loaded library; compare with the header's
/// `GPUPOOL_ABI_VERSION` (they differ when the header and the library come
/// from different releases).
#[no_mangle]
pub extern "C" fn gpupool_abi_version() -> c_int {
    GPUPOOL_ABI_VERSION
}
