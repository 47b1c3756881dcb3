//! Giving memory back through the C ABI: `gpupool_trim`, the one call that
//! blocks the host (it waits for pending frees).

use super::state::with_state;
use super::status::status;
use std::ffi::c_int;

/// Gives cached device memory of every device back to the driver. Unlike
/// alloc and free, this waits for pending frees (it blocks the host).
#[no_mangle]
pub extern "C" fn gpupool_trim() -> c_int {
    status("gpupool_trim", || {
        with_state(|st| {
            let bytes = st.rt.trim()?;
            tracing::debug!(bytes, "gpupool_trim released memory");
            Ok(())
        })
    })
}
