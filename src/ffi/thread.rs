//! The ABI's per-thread record: everything a call keeps on its thread, in
//! one thread-local, so that a call reaches it with one thread-local
//! access.
//!
//! Why one record: `libgpupool.so` is loaded with `dlopen` (PyTorch's
//! `CUDAPluggableAllocator`), where every thread-local access of a shared
//! library is a call to `__tls_get_addr` (the general-dynamic model; stable
//! Rust cannot ask for another). With a thread-local per concept, a small
//! alloc + free pair through the `.so` made ten such calls (110 of its 831
//! instructions). The hot calls (`gpupool_alloc`, `gpupool_free` and the
//! PyTorch hooks) look the record up once and pass it down.
//!
//! Invariants: the record is `const`-initialized and has no destructor, so
//! it is never torn down and [`with_thread`] never fails, even during
//! thread exit; each field is owned by the file that documents it
//! (`current` and `recent_streams` by `state.rs`, `has_message` by
//! `status.rs`, `tag` by `pause.rs`, `reader` by `readers.rs`).

use super::readers::ReaderSlot;
use super::state::State;
use crate::pool::{DevicePool, Stream};
use std::cell::Cell;
use std::ffi::c_int;

/// One of a thread's recent (device, stream) pairs and what it resolved to
/// (see `state.rs`'s invariants).
#[derive(Clone, Copy)]
pub(super) struct LastStream {
    pub(super) generation: u64,
    pub(super) device: c_int,
    pub(super) handle: u64,
    pub(super) epoch: u64,
    pub(super) pool: *const DevicePool,
    pub(super) stream: *const Stream,
}

impl LastStream {
    pub(super) const NONE: LastStream = LastStream {
        generation: 0,
        device: 0,
        handle: 0,
        epoch: 0,
        pool: std::ptr::null(),
        stream: std::ptr::null(),
    };
}

/// Streams a thread remembers.
pub(super) const RECENT_STREAMS: usize = 4;

/// What the ABI keeps per thread.
pub(super) struct FfiThread {
    /// The state of the call this thread is inside, for as long as that
    /// call holds it (`state.rs`); null outside calls.
    pub(super) current: Cell<*const State>,
    /// This thread's most recently named streams, the last one first: a
    /// thread takes turns on a few streams (compute, copies,
    /// communication), and with one remembered every turn read a stream
    /// map (a pair on three streams in turn cost 2.2x a pair on one).
    pub(super) recent_streams: [Cell<LastStream>; RECENT_STREAMS],
    /// Whether the thread's last-call message is non-empty: one plain read
    /// on the fast path (every successful call) instead of a borrow.
    pub(super) has_message: Cell<bool>,
    /// The tag `gpupool_alloc` and `gpupool_torch_malloc` give their
    /// allocations on this thread, if any.
    pub(super) tag: Cell<Option<u64>>,
    /// This thread's reader slot (`readers.rs`), once it has one.
    pub(super) reader: Cell<Option<&'static ReaderSlot>>,
}

thread_local! {
    static FFI: FfiThread = const {
        FfiThread {
            current: Cell::new(std::ptr::null()),
            recent_streams: [const { Cell::new(LastStream::NONE) }; RECENT_STREAMS],
            has_message: Cell::new(false),
            tag: Cell::new(None),
            reader: Cell::new(None),
        }
    };
}

/// Runs `f` with this thread's record.
#[inline(always)]
pub(super) fn with_thread<R>(f: impl FnOnce(&FfiThread) -> R) -> R {
    let p: *const FfiThread = FFI.with(|t| t as *const FfiThread);
    // SAFETY: the record has no destructor, so its storage stays valid
    // for as long as the thread runs code; the reference lives only for
    // `f` on this thread (`FfiThread` is not `Sync`).
    f(unsafe { &*p })
}
