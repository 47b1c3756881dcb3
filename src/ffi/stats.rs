//! Statistics through the C ABI: `gpupool_stats_json` (gpupool's
//! `PoolStats`), `gpupool_memory_stats_json` (PyTorch's flat
//! `memory_stats()` layout) and `gpupool_reset_peak_stats`.

use super::state::with_state;
use super::status::{status, Fail, GpupoolStatus};
use super::text::write_text;
use std::ffi::{c_char, c_int};

/// Writes the statistics of `device` as one JSON object (the fields of
/// `PoolStats`: `device`, `requested_bytes`, `allocated_bytes`,
/// `active_bytes`, `reserved_bytes`, `inactive_split_bytes`,
/// `cached_bytes`, `pending_bytes` as `{"current", "peak"}`, and the
/// counters `num_allocs`, `num_frees`, `num_device_allocs`, `num_ooms`,
/// ...). The byte names mean what PyTorch means: requested sizes, their
/// rounded sizes, those plus freed blocks not yet reusable, device memory
/// held. `plan` holds the learned steps' figures (`PlanStats`: `plans`,
/// `served`, `misses`, `departures`, `arena_bytes`, ...; see
/// `gpupool_mark_step`). `driver_calls` counts the backend's driver calls
/// by CUDA name (`{"cuEventRecord": N, ...}`, zero counts left out; the
/// backend's, so every device it drives) and `driver_host_syncs` its
/// host-blocking waits: read it twice around a workload to see what a
/// steady state costs the driver. See the buffer protocol in the header's preamble,
/// and `gpupool_memory_stats_json` for PyTorch's flat layout.
///
/// # Safety
/// `buf` is NULL or valid for writes of `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn gpupool_stats_json(device: c_int, buf: *mut c_char, len: usize) -> c_int {
    status("gpupool_stats_json", || {
        if buf.is_null() && len != 0 {
            return Err(Fail::null("buf"));
        }
        let json = with_state(|st| {
            let pool = st.pool(device)?;
            let ser = |e: serde_json::Error| {
                Fail::new(GpupoolStatus::Io, format!("serializing stats: {e}"))
            };
            let mut v = serde_json::to_value(pool.stats()).map_err(ser)?;
            v["plan"] = serde_json::to_value(pool.plan_stats()).map_err(ser)?;
            let calls = pool.backend().counters();
            v["driver_calls"] = serde_json::to_value(calls.nonzero_calls()).map_err(ser)?;
            v["driver_host_syncs"] = calls.host_syncs.into();
            serde_json::to_string(&v).map_err(ser)
        })?;
        // SAFETY: `buf` is NULL or valid for `len` bytes (caller's contract).
        unsafe { write_text(buf, len, &json) }
    })
}

/// Writes the statistics of `device` as one flat JSON object in the layout
/// of `torch.cuda.memory_stats()`: `{"active_bytes.all.current": N,
/// "allocated_bytes.all.current": N, "allocated_bytes.all.peak": N, ...,
/// "num_alloc_retries": N, "num_ooms": N, ...}`, keys sorted, with PyTorch's
/// meanings (see `PoolStats::memory_stats` in the Rust docs). Same buffer
/// protocol as `gpupool_stats_json`.
///
/// # Safety
/// `buf` is NULL or valid for writes of `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn gpupool_memory_stats_json(
    device: c_int,
    buf: *mut c_char,
    len: usize,
) -> c_int {
    status("gpupool_memory_stats_json", || {
        if buf.is_null() && len != 0 {
            return Err(Fail::null("buf"));
        }
        let json = with_state(|st| {
            let flat = st.pool(device)?.stats().memory_stats();
            serde_json::to_string(&flat)
                .map_err(|e| Fail::new(GpupoolStatus::Io, format!("serializing stats: {e}")))
        })?;
        // SAFETY: `buf` is NULL or valid for `len` bytes (caller's contract).
        unsafe { write_text(buf, len, &json) }
    })
}

/// Resets the peaks of `device` (`-1`: every device in use; a device not
/// used yet has no peaks) to the current values (PyTorch's
/// `reset_peak_memory_stats`).
#[no_mangle]
pub extern "C" fn gpupool_reset_peak_stats(device: c_int) -> c_int {
    status("gpupool_reset_peak_stats", || {
        with_state(|st| {
            if device == -1 {
                st.rt
                    .active_devices()
                    .into_iter()
                    .for_each(|p| p.reset_peak_stats());
                return Ok(());
            }
            st.pool(device)?.reset_peak_stats();
            Ok(())
        })
    })
}
