//! Learned steps through the C ABI: `gpupool_mark_step`.

use super::state::with_state;
use super::status::status;
use std::ffi::c_int;

/// Marks a step boundary on every device in use (see
/// `DevicePool::mark_step`): call it once per training step or served
/// batch, at the same point of each. Large requests that repeat the
/// recorded step are then served from a plan, with no lock shared between
/// streams and no driver call.
#[no_mangle]
pub extern "C" fn gpupool_mark_step() -> c_int {
    status("gpupool_mark_step", || {
        with_state(|st| Ok(st.rt.mark_step()?))
    })
}
