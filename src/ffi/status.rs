//! Status codes and failures: [`GpupoolStatus`] (and which [`Error`] maps
//! to which), the internal [`Fail`], the thread's last-call record read by
//! `gpupool_last_error` and `gpupool_needed_len`, and the wrappers every
//! ABI function runs its body in.
//!
//! Invariant: no panic crosses the boundary and every call leaves a message.
//! A body runs only inside [`run`] (or [`status`]), which catches panics
//! (they become [`GpupoolStatus::Panic`]) and sets this thread's message:
//! `""` after a success, `"<function>: <what>"` after a failure.

use super::thread::{with_thread, FfiThread};
use crate::error::Error;
use std::cell::{Cell, RefCell};
use std::ffi::{c_char, c_int, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Status codes of the C ABI. Values are stable: new codes are only ever
/// appended.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GpupoolStatus {
    /// Success.
    Ok = 0,
    /// No runtime: `gpupool_init` has not been called (or failed).
    NotInitialized = 1,
    /// `gpupool_init` called while a runtime is running.
    AlreadyInitialized = 2,
    /// The runtime was stopped by `gpupool_shutdown` (`gpupool_init` starts a
    /// new one).
    Shutdown = 3,
    /// A required pointer argument is `NULL`.
    NullArgument = 4,
    /// The output buffer is too small; see `gpupool_needed_len`.
    BufferTooSmall = 5,
    /// A panic inside gpupool was caught at the boundary (a bug: please
    /// report the message).
    Panic = 6,
    /// Size 0 (for `gpupool_alloc`) or larger than the device.
    InvalidSize = 7,
    /// No device with this index.
    InvalidDevice = 8,
    /// The pointer belongs to another device; the message names it.
    WrongDevice = 9,
    /// The pointer was not handed out by gpupool on this device (or is
    /// not the start of an allocation).
    UnknownPointer = 10,
    /// The pointer was already freed.
    DoubleFree = 11,
    /// A stream that does not exist or belongs to another device.
    InvalidHandle = 12,
    /// Any other bad argument (bad UTF-8, a negative size, ...).
    InvalidArgument = 13,
    /// The pool cannot serve the request even after reclaiming its cache;
    /// the message gives requested, live, reserved, cached, pending and
    /// largest-free bytes.
    OutOfMemory = 14,
    /// The device refused a physical allocation.
    DeviceOutOfMemory = 15,
    /// No CUDA driver or device (`backend=cuda`).
    NoDriver = 16,
    /// A driver call failed; the message names it.
    Backend = 17,
    /// Bad `GPUPOOL_CONF` / `gpupool_init` string or `GPUPOOL_LOG` filter;
    /// the message names the key.
    Config = 18,
    /// A fault injected by the simulator.
    InjectedFault = 19,
    /// The backend cannot do this.
    Unsupported = 20,
    /// A trace file could not be read.
    Trace = 21,
    /// An I/O error (writing a snapshot file).
    Io = 22,
}

/// Every status, in numeric order.
const ALL_STATUSES: [GpupoolStatus; 23] = [
    GpupoolStatus::Ok,
    GpupoolStatus::NotInitialized,
    GpupoolStatus::AlreadyInitialized,
    GpupoolStatus::Shutdown,
    GpupoolStatus::NullArgument,
    GpupoolStatus::BufferTooSmall,
    GpupoolStatus::Panic,
    GpupoolStatus::InvalidSize,
    GpupoolStatus::InvalidDevice,
    GpupoolStatus::WrongDevice,
    GpupoolStatus::UnknownPointer,
    GpupoolStatus::DoubleFree,
    GpupoolStatus::InvalidHandle,
    GpupoolStatus::InvalidArgument,
    GpupoolStatus::OutOfMemory,
    GpupoolStatus::DeviceOutOfMemory,
    GpupoolStatus::NoDriver,
    GpupoolStatus::Backend,
    GpupoolStatus::Config,
    GpupoolStatus::InjectedFault,
    GpupoolStatus::Unsupported,
    GpupoolStatus::Trace,
    GpupoolStatus::Io,
];

impl GpupoolStatus {
    /// Every status, in numeric order.
    pub fn all() -> &'static [GpupoolStatus] {
        &ALL_STATUSES
    }

    /// The status an [`Error`] maps to (one per variant).
    pub fn of(e: &Error) -> GpupoolStatus {
        match e {
            Error::NoDriver(_) => GpupoolStatus::NoDriver,
            Error::NoDevice(_) => GpupoolStatus::InvalidDevice,
            Error::Backend { .. } => GpupoolStatus::Backend,
            Error::DeviceOutOfMemory { .. } => GpupoolStatus::DeviceOutOfMemory,
            Error::OutOfMemory(_) => GpupoolStatus::OutOfMemory,
            Error::InvalidSize { .. } => GpupoolStatus::InvalidSize,
            Error::InvalidDevice { .. } => GpupoolStatus::InvalidDevice,
            Error::UnknownPointer { .. } => GpupoolStatus::UnknownPointer,
            Error::DoubleFree { .. } => GpupoolStatus::DoubleFree,
            Error::InvalidHandle(_) => GpupoolStatus::InvalidHandle,
            Error::InvalidArgument(_) => GpupoolStatus::InvalidArgument,
            Error::Config { .. } => GpupoolStatus::Config,
            Error::InjectedFault(_) => GpupoolStatus::InjectedFault,
            Error::Shutdown => GpupoolStatus::Shutdown,
            Error::Unsupported(_) => GpupoolStatus::Unsupported,
            Error::Trace { .. } => GpupoolStatus::Trace,
            Error::Io(_) => GpupoolStatus::Io,
        }
    }

    /// The C name of the status, e.g. `GPUPOOL_STATUS_DOUBLE_FREE`.
    pub fn name(self) -> &'static str {
        self.c_name().to_str().unwrap_or("GPUPOOL_STATUS_?")
    }

    fn c_name(self) -> &'static CStr {
        match self {
            GpupoolStatus::Ok => c"GPUPOOL_STATUS_OK",
            GpupoolStatus::NotInitialized => c"GPUPOOL_STATUS_NOT_INITIALIZED",
            GpupoolStatus::AlreadyInitialized => c"GPUPOOL_STATUS_ALREADY_INITIALIZED",
            GpupoolStatus::Shutdown => c"GPUPOOL_STATUS_SHUTDOWN",
            GpupoolStatus::NullArgument => c"GPUPOOL_STATUS_NULL_ARGUMENT",
            GpupoolStatus::BufferTooSmall => c"GPUPOOL_STATUS_BUFFER_TOO_SMALL",
            GpupoolStatus::Panic => c"GPUPOOL_STATUS_PANIC",
            GpupoolStatus::InvalidSize => c"GPUPOOL_STATUS_INVALID_SIZE",
            GpupoolStatus::InvalidDevice => c"GPUPOOL_STATUS_INVALID_DEVICE",
            GpupoolStatus::WrongDevice => c"GPUPOOL_STATUS_WRONG_DEVICE",
            GpupoolStatus::UnknownPointer => c"GPUPOOL_STATUS_UNKNOWN_POINTER",
            GpupoolStatus::DoubleFree => c"GPUPOOL_STATUS_DOUBLE_FREE",
            GpupoolStatus::InvalidHandle => c"GPUPOOL_STATUS_INVALID_HANDLE",
            GpupoolStatus::InvalidArgument => c"GPUPOOL_STATUS_INVALID_ARGUMENT",
            GpupoolStatus::OutOfMemory => c"GPUPOOL_STATUS_OUT_OF_MEMORY",
            GpupoolStatus::DeviceOutOfMemory => c"GPUPOOL_STATUS_DEVICE_OUT_OF_MEMORY",
            GpupoolStatus::NoDriver => c"GPUPOOL_STATUS_NO_DRIVER",
            GpupoolStatus::Backend => c"GPUPOOL_STATUS_BACKEND",
            GpupoolStatus::Config => c"GPUPOOL_STATUS_CONFIG",
            GpupoolStatus::InjectedFault => c"GPUPOOL_STATUS_INJECTED_FAULT",
            GpupoolStatus::Unsupported => c"GPUPOOL_STATUS_UNSUPPORTED",
            GpupoolStatus::Trace => c"GPUPOOL_STATUS_TRACE",
            GpupoolStatus::Io => c"GPUPOOL_STATUS_IO",
        }
    }
}

// ---- failures and the thread-local message ------------------------------------------

/// A failed call: its status and message (without the function prefix).
/// Boxed, so that a call's `FResult<()>` is one pointer (null: success)
/// returned in a register, and `FResult<pointer>` two: the success path
/// moves no 32-byte value through memory.
pub(super) struct Fail(Box<FailInner>);

/// What a [`Fail`] holds.
pub(super) struct FailInner {
    pub(super) status: GpupoolStatus,
    pub(super) msg: String,
}

impl std::ops::Deref for Fail {
    type Target = FailInner;
    fn deref(&self) -> &FailInner {
        &self.0
    }
}

impl Fail {
    #[cold]
    pub(super) fn new(status: GpupoolStatus, msg: impl Into<String>) -> Fail {
        Fail(Box::new(FailInner {
            status,
            msg: msg.into(),
        }))
    }

    pub(super) fn null(arg: &str) -> Fail {
        Fail::new(
            GpupoolStatus::NullArgument,
            format!("argument `{arg}` is NULL"),
        )
    }
}

impl From<Error> for Fail {
    fn from(e: Error) -> Fail {
        Fail::new(GpupoolStatus::of(&e), e.to_string())
    }
}

pub(super) type FResult<T> = std::result::Result<T, Fail>;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    static NEEDED: Cell<usize> = const { Cell::new(0) };
}

fn set_message(msg: &str) {
    let c = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    // `try_with`: during thread teardown the slot may be gone; then the
    // message is simply lost.
    let _ = LAST_ERROR.try_with(|l| {
        if let Ok(mut l) = l.try_borrow_mut() {
            *l = c;
            with_thread(|t| t.has_message.set(true));
        }
    });
}

/// After a success: the message becomes `""`, with no allocation when it
/// already is (every call on the fast path succeeds).
#[inline]
fn clear_message(t: &FfiThread) {
    if t.has_message.get() {
        let _ = LAST_ERROR.try_with(|l| {
            if let Ok(mut l) = l.try_borrow_mut() {
                *l = CString::default();
                t.has_message.set(false);
            }
        });
    }
}

pub(super) fn set_needed(n: usize) {
    let _ = NEEDED.try_with(|c| c.set(n));
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// Runs `body` with panics caught, records the message, returns the status.
#[inline]
pub(super) fn run<T>(name: &'static str, body: impl FnOnce() -> FResult<T>) -> FResult<T> {
    with_thread(|t| run_in(t, name, body))
}

/// [`run`] with this thread's record already looked up.
#[inline(always)]
pub(super) fn run_in<T>(
    t: &FfiThread,
    name: &'static str,
    body: impl FnOnce() -> FResult<T>,
) -> FResult<T> {
    let r = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(r) => r,
        Err(p) => Err(Fail::new(
            GpupoolStatus::Panic,
            format!("internal panic (a gpupool bug): {}", panic_text(&*p)),
        )),
    };
    match &r {
        Ok(_) => clear_message(t),
        Err(f) => record_failure(name, f),
    }
    r
}

/// The failure's message becomes the thread's last error (out of line: the
/// fast path is a success).
#[cold]
#[inline(never)]
fn record_failure(name: &str, f: &Fail) {
    let msg = format!("{name}: {}", f.msg);
    tracing::debug!(status = f.status.name(), "{msg}");
    set_message(&msg);
}

/// [`run`] for functions returning a status.
#[inline]
pub(super) fn status(name: &'static str, body: impl FnOnce() -> FResult<()>) -> c_int {
    with_thread(|t| status_in(t, name, body))
}

/// [`status`] with this thread's record already looked up.
#[inline(always)]
pub(super) fn status_in(
    t: &FfiThread,
    name: &'static str,
    body: impl FnOnce() -> FResult<()>,
) -> c_int {
    match run_in(t, name, body) {
        Ok(()) => GpupoolStatus::Ok as c_int,
        Err(f) => f.status as c_int,
    }
}

// ---- the thread's last call, names, version, self-test ---------------------------------

/// The message of the last call on this thread: `""` after a success,
/// `"<function>: <what>"` after a failure. Never NULL; valid until the next
/// gpupool call on this thread. Does not change the message itself.
#[no_mangle]
pub extern "C" fn gpupool_last_error() -> *const c_char {
    LAST_ERROR
        .try_with(|l| match l.try_borrow() {
            // The pointer stays valid until the next call replaces the
            // CString (documented lifetime).
            Ok(s) => s.as_ptr(),
            Err(_) => c"".as_ptr(),
        })
        .unwrap_or(c"".as_ptr())
}

/// Bytes (NUL included) the last text-writing call on this thread needed,
/// whether it succeeded or returned `GPUPOOL_STATUS_BUFFER_TOO_SMALL`.
#[no_mangle]
pub extern "C" fn gpupool_needed_len() -> usize {
    NEEDED.try_with(Cell::get).unwrap_or(0)
}

/// The C name of a status code (`"GPUPOOL_STATUS_DOUBLE_FREE"`), or
/// `"GPUPOOL_STATUS_UNKNOWN"`. Never NULL; static.
#[no_mangle]
pub extern "C" fn gpupool_status_name(status: c_int) -> *const c_char {
    ALL_STATUSES
        .iter()
        .find(|s| **s as c_int == status)
        .map_or(c"GPUPOOL_STATUS_UNKNOWN".as_ptr(), |s| s.c_name().as_ptr())
}

/// The library version (`"0.1.0"`). Never NULL; static.
#[no_mangle]
pub extern "C" fn gpupool_version() -> *const c_char {
    const V: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");
    V.as_ptr().cast()
}

/// Always panics inside and returns `GPUPOOL_STATUS_PANIC`: lets an embedder
/// check that no panic crosses the boundary (the panic message is printed
/// to stderr by Rust's panic hook).
#[no_mangle]
pub extern "C" fn gpupool_selftest_panic() -> c_int {
    status("gpupool_selftest_panic", || -> FResult<()> {
        panic!("gpupool_selftest_panic: deliberate panic");
    })
}

/// Writes this thread's last message to stderr (for the hooks that return
/// no status).
pub(super) fn report_to_stderr() {
    let msg = LAST_ERROR
        .try_with(|l| l.try_borrow().map(|s| s.to_string_lossy().into_owned()))
        .ok()
        .and_then(|r| r.ok())
        .unwrap_or_default();
    if !msg.is_empty() {
        eprintln!("gpupool: {msg}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_names_match_values() {
        for (i, s) in ALL_STATUSES.iter().enumerate() {
            assert_eq!(*s as usize, i);
            // SAFETY: gpupool_status_name returns a static C string.
            let n = unsafe { CStr::from_ptr(gpupool_status_name(i as c_int)) };
            assert_eq!(n.to_str().unwrap(), s.name());
        }
        // SAFETY: as above.
        let n = unsafe { CStr::from_ptr(gpupool_status_name(999)) };
        assert_eq!(n.to_str().unwrap(), "GPUPOOL_STATUS_UNKNOWN");
    }

    #[test]
    fn panics_become_a_status() {
        assert_eq!(gpupool_selftest_panic(), GpupoolStatus::Panic as c_int);
        // SAFETY: gpupool_last_error never returns NULL.
        let m = unsafe { CStr::from_ptr(gpupool_last_error()) };
        assert!(m.to_str().unwrap().contains("deliberate panic"));
    }
}
