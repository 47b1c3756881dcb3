//! The C ABI (`include/gpupool.h`, `libgpupool.so`) and the two symbols
//! PyTorch's `CUDAPluggableAllocator` loads.
//!
//! # Model
//!
//! One process-wide runtime, started by [`gpupool_init`] (configured by its
//! argument or by `GPUPOOL_CONF`) and stopped by [`gpupool_shutdown`]. Every
//! call takes the device index explicitly and a stream as an opaque
//! `void*`: the backend's stream handle (a `CUstream` / `cudaStream_t` on
//! CUDA, a small integer from [`gpupool_stream_create`] on the simulator).
//! `NULL` names the device's default (legacy null) stream.
//!
//! # Errors
//!
//! Every function returns an `int` status ([`GpupoolStatus`], 0 = OK) unless
//! noted, and sets a thread-local message read with [`gpupool_last_error`]:
//! the empty string after a success, `"<function>: <what went wrong>"` after
//! a failure. A failed call changes nothing (out-parameters aside, which are
//! set to `NULL` where noted). Checks run in this order: `NULL` arguments,
//! initialization, device index, stream, then the operation itself. No panic
//! ever crosses the boundary: each body runs under `catch_unwind` and a panic
//! becomes [`GpupoolStatus::Panic`].
//!
//! # Buffers
//!
//! Functions that write text (`*_json`) take `(char* buf, size_t len)` and
//! write a NUL-terminated string. When it does not fit they write nothing but
//! `buf[0] = '\0'` (when `len > 0`) and return
//! [`GpupoolStatus::BufferTooSmall`]; the bytes needed (NUL included) are in
//! the message and in [`gpupool_needed_len`]. `buf == NULL && len == 0` is a
//! pure size query (it also returns `BUFFER_TOO_SMALL`). Figures move between
//! two calls, so leave some slack (or loop).
//!
//! # Streams
//!
//! Streams passed in are wrapped once and cached per device, so each keeps
//! its pool slot (its own free lists) for the life of the runtime. On the
//! simulator only `NULL` and streams from [`gpupool_stream_create`] exist;
//! any other handle is [`GpupoolStatus::InvalidHandle`]. On CUDA any stream
//! of the device is accepted (PyTorch's streams among them).
//!
//! # Logging
//!
//! When `GPUPOOL_LOG` is set (a filter such as `info` or `gpupool=debug`,
//! `EnvFilter`'s basic form), the first successful [`gpupool_init`]
//! installs a `tracing` subscriber that prints gpupool's events on stderr
//! (`log`); a process that already has a subscriber keeps its own.
//!
//! # Layout
//!
//! One file per concept: `status` (status codes, failures, the thread's
//! last-call message, the panic-catching wrappers), `state` (the
//! process-wide runtime, its lifecycle, device and stream checks), `text`
//! (C strings in, the buffer protocol out), `thread` (what a call keeps
//! per thread, in one thread-local), `readers` (how a call reaches the
//! runtime without a lock, and how shutdown waits for it), `log`
//! (`GPUPOOL_LOG`), then the calls: `alloc`, `streams`, `stats`, `limits` (memory limit,
//! out-of-memory callback, ABI version), `snapshot` (snapshots and
//! history), `trim`, `steps` (learned steps), `pause` (tagged allocations,
//! pause and resume), `ipc` (sharing memory with other processes), and
//! `torch` (PyTorch's hooks).
//!
//! Invariant: the modules holding `extern "C"` functions are declared below
//! in the order of `include/gpupool.h`. cbindgen writes functions in the
//! order it parses them, file by file in declaration order, so reordering
//! these lines (or moving a function between files) reorders the header
//! and `cargo test --test header` fails.

#![deny(unsafe_op_in_unsafe_fn)]

// In header order (see above): not sorted. Each `mod` stands apart so
// that rustfmt, which sorts adjacent `mod` lines, keeps this order.

// Lifecycle: gpupool_init, gpupool_shutdown, gpupool_device_count.
mod state;

// gpupool_alloc, gpupool_free, gpupool_record_stream.
mod alloc;

// gpupool_stream_create, gpupool_stream_destroy, gpupool_stream_release.
mod streams;

// gpupool_stats_json, gpupool_memory_stats_json, gpupool_reset_peak_stats.
mod stats;

// gpupool_set_memory_limit, gpupool_set_oom_callback, gpupool_abi_version.
mod limits;

// gpupool_snapshot_json, gpupool_snapshot_pickle, gpupool_record_history.
mod snapshot;

// gpupool_trim.
mod steps;
mod trim;

// gpupool_begin_allocate_to_pool, gpupool_end_allocate_to_pool,
// gpupool_release_pool, gpupool_alloc_in_pool.
mod graphs;

// gpupool_alloc_tagged, gpupool_set_thread_tag, gpupool_clear_thread_tag,
// gpupool_pause, gpupool_resume.
mod pause;

// gpupool_export, gpupool_import, gpupool_import_close.
mod ipc;

// gpupool_last_error, gpupool_needed_len, gpupool_status_name,
// gpupool_version, gpupool_selftest_panic.
mod status;

// gpupool_torch_malloc, gpupool_torch_free, gpupool_torch_record_stream.
mod torch;

// No `extern "C"` functions.
mod text;
// The per-thread record of the ABI (no extern functions).
mod thread;
// Lock-free readers of the runtime (no extern functions).
mod readers;
// GPUPOOL_LOG's stderr subscriber (no extern functions).
mod log;

pub use alloc::{gpupool_alloc, gpupool_free, gpupool_record_stream};
pub use graphs::{
    gpupool_alloc_in_pool, gpupool_begin_allocate_to_pool, gpupool_end_allocate_to_pool,
    gpupool_release_pool,
};
pub use ipc::{gpupool_export, gpupool_import, gpupool_import_close, GpupoolIpcChunk};
pub use limits::{
    gpupool_abi_version, gpupool_set_memory_limit, gpupool_set_oom_callback, GpupoolOomCallback,
    GPUPOOL_ABI_VERSION,
};
pub use pause::{
    gpupool_alloc_tagged, gpupool_clear_thread_tag, gpupool_pause, gpupool_resume,
    gpupool_set_thread_tag,
};
pub use snapshot::{gpupool_record_history, gpupool_snapshot_json, gpupool_snapshot_pickle};
pub use state::{gpupool_device_count, gpupool_init, gpupool_shutdown};
pub use stats::{gpupool_memory_stats_json, gpupool_reset_peak_stats, gpupool_stats_json};
pub use status::{
    gpupool_last_error, gpupool_needed_len, gpupool_selftest_panic, gpupool_status_name,
    gpupool_version, GpupoolStatus,
};
pub use steps::gpupool_mark_step;
pub use streams::{gpupool_stream_create, gpupool_stream_destroy, gpupool_stream_release};
pub use torch::{gpupool_torch_free, gpupool_torch_malloc, gpupool_torch_record_stream};
pub use trim::gpupool_trim;
