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
//! When `GPUPOOL_LOG` is set (an `EnvFilter` string such as `info` or
//! `gpupool=debug`), the first successful [`gpupool_init`] installs a
//! `tracing` subscriber writing to stderr, unless the process already has one.

#![deny(unsafe_op_in_unsafe_fn)]

use crate::config::PoolConfig;
use crate::error::Error;
use crate::export;
use crate::pool::{DevicePool, Stream};
use crate::ptr::{DevicePtr, StreamHandle};
use crate::runtime::Runtime;
use parking_lot::RwLock;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};

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
struct Fail {
    status: GpupoolStatus,
    msg: String,
}

impl Fail {
    fn new(status: GpupoolStatus, msg: impl Into<String>) -> Fail {
        Fail {
            status,
            msg: msg.into(),
        }
    }

    fn null(arg: &str) -> Fail {
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

type FResult<T> = std::result::Result<T, Fail>;

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
        }
    });
}

fn set_needed(n: usize) {
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
fn run<T>(name: &'static str, body: impl FnOnce() -> FResult<T>) -> FResult<T> {
    let r = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(r) => r,
        Err(p) => Err(Fail::new(
            GpupoolStatus::Panic,
            format!("internal panic (a gpupool bug): {}", panic_text(&*p)),
        )),
    };
    match &r {
        Ok(_) => set_message(""),
        Err(f) => {
            let msg = format!("{name}: {}", f.msg);
            tracing::debug!(status = f.status.name(), "{msg}");
            set_message(&msg);
        }
    }
    r
}

/// [`run`] for functions returning a status.
fn status(name: &'static str, body: impl FnOnce() -> FResult<()>) -> c_int {
    match run(name, body) {
        Ok(()) => GpupoolStatus::Ok as c_int,
        Err(f) => f.status as c_int,
    }
}

// ---- the global runtime -------------------------------------------------------------

/// A stream known to the ABI.
struct Known {
    stream: Stream,
    /// Made by `gpupool_stream_create` (and so destroyable through the ABI).
    created: bool,
}

/// Everything `gpupool_init` builds.
struct State {
    rt: Runtime,
    /// Whether the backend is the simulator (no foreign streams there).
    sim: bool,
    /// Per device: raw stream handle -> stream.
    streams: Vec<RwLock<HashMap<u64, Known>>>,
    /// Per device: whether the pool calls the C out-of-memory callback.
    oom_hooked: Vec<AtomicBool>,
}

enum Global {
    Uninit,
    Live(Box<State>),
    Shut,
}

/// The runtime. Calls hold the read lock for their whole duration, so
/// `gpupool_shutdown` (the only writer besides init) waits for calls in
/// flight and no call ever sees a half-torn-down runtime.
static GLOBAL: RwLock<Global> = parking_lot::const_rwlock(Global::Uninit);

static LOG_INSTALLED: AtomicBool = AtomicBool::new(false);

fn with_state<T>(f: impl FnOnce(&State) -> FResult<T>) -> FResult<T> {
    // Recursive: an out-of-memory callback runs inside a call and may call
    // in again (to read statistics) while `gpupool_shutdown` waits.
    let g = GLOBAL.read_recursive();
    match &*g {
        Global::Live(s) => f(s),
        Global::Uninit => Err(Fail::new(
            GpupoolStatus::NotInitialized,
            "gpupool is not initialized: call gpupool_init first",
        )),
        Global::Shut => Err(Fail::new(
            GpupoolStatus::Shutdown,
            "gpupool is shut down (gpupool_shutdown was called); gpupool_init starts it again",
        )),
    }
}

fn install_logging() -> FResult<()> {
    let Ok(filter) = std::env::var("GPUPOOL_LOG") else {
        return Ok(());
    };
    if filter.trim().is_empty() || LOG_INSTALLED.load(Ordering::Acquire) {
        return Ok(());
    }
    let env = tracing_subscriber::EnvFilter::try_new(&filter).map_err(|e| {
        Fail::from(Error::Config {
            key: "GPUPOOL_LOG".into(),
            msg: format!("{filter:?}: {e}"),
        })
    })?;
    // Fails only when the process already has a subscriber: keep that one.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(env)
        .with_writer(std::io::stderr)
        .try_init();
    LOG_INSTALLED.store(true, Ordering::Release);
    Ok(())
}

fn init_from(conf: Option<&str>) -> FResult<()> {
    let cfg = match conf {
        Some(s) => PoolConfig::parse(s)?,
        None => PoolConfig::from_env()?,
    };
    install_logging()?;
    let mut g = GLOBAL.write();
    if let Global::Live(_) = &*g {
        return Err(Fail::new(
            GpupoolStatus::AlreadyInitialized,
            "gpupool is already initialized (call gpupool_shutdown first to restart it)",
        ));
    }
    let rt = Runtime::builder().config(cfg).build()?;
    let sim = rt.backend().name() == "sim";
    tracing::info!(
        backend = rt.backend().name(),
        devices = rt.device_count(),
        "gpupool initialized through the C ABI"
    );
    let streams = (0..rt.device_count())
        .map(|_| RwLock::new(HashMap::new()))
        .collect();
    let oom_hooked = (0..rt.device_count())
        .map(|_| AtomicBool::new(false))
        .collect();
    *g = Global::Live(Box::new(State {
        rt,
        sim,
        streams,
        oom_hooked,
    }));
    Ok(())
}

impl State {
    fn pool(&self, device: c_int) -> FResult<&DevicePool> {
        let n = self.rt.device_count();
        let d = usize::try_from(device)
            .ok()
            .filter(|&d| d < n)
            .ok_or_else(|| {
                Fail::new(
                    GpupoolStatus::InvalidDevice,
                    format!("invalid device {device}: {n} device(s) present"),
                )
            })?;
        // Built on first use; the C out-of-memory callback is hooked to
        // each pool once, when the ABI first sees it.
        let pool = self.rt.device(d)?;
        if !self.oom_hooked[d].swap(true, Ordering::AcqRel) {
            pool.on_oom(Box::new(call_oom_callback));
        }
        Ok(pool)
    }

    /// Runs `f` with the pool of `device` and the stream `handle` of it.
    fn with_stream<T>(
        &self,
        device: c_int,
        handle: *mut c_void,
        f: impl FnOnce(&DevicePool, &Stream) -> FResult<T>,
    ) -> FResult<T> {
        let pool = self.pool(device)?;
        let dev = pool.device();
        let h = handle as usize as u64;
        if StreamHandle(h).canonical() == StreamHandle(0) {
            return f(pool, pool.default_stream());
        }
        if StreamHandle(h) == StreamHandle::PER_THREAD {
            // The calling thread's default stream: a wrapper per call, bound
            // to this thread (it has no slot, so this costs no retirement).
            let s = pool.stream_from_raw(StreamHandle::PER_THREAD);
            return f(pool, &s);
        }
        {
            let m = self.streams[dev].read();
            if let Some(k) = m.get(&h) {
                return f(pool, &k.stream);
            }
        }
        if let Some(other) =
            (0..self.streams.len()).find(|&d| d != dev && self.streams[d].read().contains_key(&h))
        {
            return Err(Fail::new(
                GpupoolStatus::InvalidHandle,
                format!("stream {h:#x} belongs to device {other}, not device {dev}"),
            ));
        }
        if self.sim {
            return Err(Fail::new(
                GpupoolStatus::InvalidHandle,
                format!(
                    "unknown stream {h:#x} on device {dev}: the simulator only knows NULL \
                     (the default stream) and streams from gpupool_stream_create"
                ),
            ));
        }
        // A stream created elsewhere (PyTorch's): wrap it once, keep it.
        let stream = {
            let mut m = self.streams[dev].write();
            m.entry(h)
                .or_insert_with(|| Known {
                    stream: pool.stream_from_raw(StreamHandle(h)),
                    created: false,
                })
                .stream
                .clone()
        };
        f(pool, &stream)
    }

    /// The device (other than `dev`) on which `addr` is a live raw
    /// allocation, if any.
    fn owner_of(&self, addr: u64, dev: usize) -> Option<usize> {
        self.rt
            .active_devices()
            .into_iter()
            .find(|p| p.device() != dev && p.raw_size(DevicePtr(addr)).is_some())
            .map(|p| p.device())
    }

    /// Turns an unknown-pointer error into a wrong-device one when the
    /// pointer is live on another device.
    fn classify(&self, e: Error, addr: u64, dev: usize) -> Fail {
        if let Error::UnknownPointer { .. } = e {
            if let Some(owner) = self.owner_of(addr, dev) {
                return Fail::new(
                    GpupoolStatus::WrongDevice,
                    format!(
                        "pointer {addr:#x} was allocated on device {owner}, not on device {dev}"
                    ),
                );
            }
        }
        e.into()
    }
}

fn check_device_or_all(st: &State, device: c_int) -> FResult<Vec<usize>> {
    if device == -1 {
        Ok((0..st.rt.device_count()).collect())
    } else {
        Ok(vec![st.pool(device)?.device()])
    }
}

/// Writes `s` NUL-terminated into `buf`, or reports the size needed.
///
/// # Safety
/// `buf` is NULL or valid for writes of `len` bytes.
unsafe fn write_text(buf: *mut c_char, len: usize, s: &str) -> FResult<()> {
    let need = s.len() + 1;
    set_needed(need);
    if buf.is_null() {
        if len == 0 {
            return Err(Fail::new(
                GpupoolStatus::BufferTooSmall,
                format!("size query: {need} bytes needed (including the NUL)"),
            ));
        }
        return Err(Fail::null("buf"));
    }
    if len < need {
        if len > 0 {
            // SAFETY: `buf` is valid for `len >= 1` bytes (caller's contract).
            unsafe { *buf = 0 };
        }
        return Err(Fail::new(
            GpupoolStatus::BufferTooSmall,
            format!("buffer of {len} bytes too small: {need} bytes needed (including the NUL)"),
        ));
    }
    // SAFETY: `buf` is valid for `len >= need = s.len() + 1` bytes, and a
    // Rust string cannot overlap memory the caller handed us for writing.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), s.len());
        *buf.add(s.len()) = 0;
    }
    Ok(())
}

/// Reads a C string argument.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string.
unsafe fn c_str<'a>(p: *const c_char, arg: &str) -> FResult<&'a str> {
    if p.is_null() {
        return Err(Fail::null(arg));
    }
    // SAFETY: non-NULL and NUL-terminated by the caller's contract.
    let c = unsafe { CStr::from_ptr(p) };
    c.to_str().map_err(|e| {
        Fail::new(
            GpupoolStatus::InvalidArgument,
            format!("argument `{arg}` is not UTF-8: {e}"),
        )
    })
}

// ---- lifecycle ----------------------------------------------------------------------------

/// Starts the runtime.
///
/// `conf` is a `GPUPOOL_CONF`-style string (`"backend=sim,devices=2,capacity=256MiB"`;
/// `backend=cuda|sim|auto` plus the pool's keys); `NULL` reads the
/// `GPUPOOL_CONF` environment variable (defaults where unset). Returns
/// `GPUPOOL_STATUS_CONFIG` naming the bad key, `GPUPOOL_STATUS_NO_DRIVER` for
/// `backend=cuda` without a GPU, `GPUPOOL_STATUS_ALREADY_INITIALIZED` when a
/// runtime is running. After `gpupool_shutdown` it starts a fresh runtime.
///
/// # Safety
/// `conf` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn gpupool_init(conf: *const c_char) -> c_int {
    status("gpupool_init", || {
        let conf = if conf.is_null() {
            None
        } else {
            // SAFETY: non-NULL, NUL-terminated by the caller's contract.
            Some(unsafe { c_str(conf, "conf") }?)
        };
        init_from(conf)
    })
}

/// Stops the runtime: waits for calls in flight, then releases every pool,
/// stream and byte of device memory. Pointers still live become invalid.
/// Later calls return `GPUPOOL_STATUS_SHUTDOWN` until `gpupool_init` runs
/// again.
#[no_mangle]
pub extern "C" fn gpupool_shutdown() -> c_int {
    status("gpupool_shutdown", || {
        let old = {
            let mut g = GLOBAL.write();
            match &mut *g {
                live @ Global::Live(_) => std::mem::replace(live, Global::Shut),
                Global::Uninit => {
                    return Err(Fail::new(
                        GpupoolStatus::NotInitialized,
                        "gpupool is not initialized: nothing to shut down",
                    ))
                }
                Global::Shut => {
                    return Err(Fail::new(
                        GpupoolStatus::Shutdown,
                        "gpupool is already shut down",
                    ))
                }
            }
        };
        if let Global::Live(st) = old {
            for p in st.rt.active_devices() {
                let live = p.stats().requested_bytes.current;
                if live > 0 {
                    tracing::warn!(
                        device = p.device(),
                        live,
                        "gpupool_shutdown with live allocations; their pointers are now invalid"
                    );
                }
            }
            st.rt.shutdown();
            drop(st);
        }
        Ok(())
    })
}

/// Number of devices of the running runtime, into `*out`.
///
/// # Safety
/// `out` is NULL or valid for one `int` write.
#[no_mangle]
pub unsafe extern "C" fn gpupool_device_count(out: *mut c_int) -> c_int {
    status("gpupool_device_count", || {
        if out.is_null() {
            return Err(Fail::null("out"));
        }
        with_state(|st| {
            let n = c_int::try_from(st.rt.device_count()).unwrap_or(c_int::MAX);
            // SAFETY: `out` is non-NULL and valid for writes (caller's contract).
            unsafe { out.write(n) };
            Ok(())
        })
    })
}

// ---- allocation -----------------------------------------------------------------------

/// Allocates `size` bytes on `device` for use on `stream` (`NULL`: the
/// default stream) into `*out`. Alignment is at least 256 bytes. The memory
/// is never moved. `size == 0` is `GPUPOOL_STATUS_INVALID_SIZE`, as is a size
/// larger than the device. On any failure `*out` is set to `NULL`.
///
/// # Safety
/// `out` is NULL or valid for one pointer write.
#[no_mangle]
pub unsafe extern "C" fn gpupool_alloc(
    size: usize,
    device: c_int,
    stream: *mut c_void,
    out: *mut *mut c_void,
) -> c_int {
    status("gpupool_alloc", || {
        if out.is_null() {
            return Err(Fail::null("out"));
        }
        // SAFETY: `out` is non-NULL and valid for writes (caller's contract).
        unsafe { out.write(std::ptr::null_mut()) };
        let p = with_state(|st| {
            st.with_stream(device, stream, |pool, s| Ok(pool.alloc_raw(size, s)?))
        })?;
        // SAFETY: as above.
        unsafe { out.write(p.addr() as usize as *mut c_void) };
        Ok(())
    })
}

/// Frees `ptr` (from `gpupool_alloc` or `gpupool_torch_malloc` on `device`),
/// ordered after the work enqueued so far on `stream` and on every stream
/// recorded with `gpupool_record_stream`. The memory is reusable at once by
/// `stream`, by other streams once that work completes. Errors:
/// `NULL_ARGUMENT`, `WRONG_DEVICE` (the message names the owner),
/// `UNKNOWN_POINTER`, `DOUBLE_FREE`.
#[no_mangle]
pub extern "C" fn gpupool_free(ptr: *mut c_void, device: c_int, stream: *mut c_void) -> c_int {
    status("gpupool_free", || free_impl(ptr, device, stream))
}

fn free_impl(ptr: *mut c_void, device: c_int, stream: *mut c_void) -> FResult<()> {
    if ptr.is_null() {
        return Err(Fail::null("ptr"));
    }
    let addr = ptr as usize as u64;
    with_state(|st| {
        st.with_stream(device, stream, |pool, s| {
            pool.free_raw(DevicePtr(addr), s)
                .map_err(|e| st.classify(e, addr, pool.device()))
        })
    })
}

/// Marks `ptr` as also used on `stream` (PyTorch's `record_stream`): its
/// free will wait for the work enqueued on `stream` up to the free.
#[no_mangle]
pub extern "C" fn gpupool_record_stream(
    ptr: *mut c_void,
    device: c_int,
    stream: *mut c_void,
) -> c_int {
    status("gpupool_record_stream", || {
        if ptr.is_null() {
            return Err(Fail::null("ptr"));
        }
        let addr = ptr as usize as u64;
        with_state(|st| {
            st.with_stream(device, stream, |pool, s| {
                pool.record_stream_raw(DevicePtr(addr), s)
                    .map_err(|e| st.classify(e, addr, pool.device()))
            })
        })
    })
}

// ---- streams ------------------------------------------------------------------------------

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
            st.streams[pool.device()].write().insert(
                h,
                Known {
                    stream: s,
                    created: true,
                },
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
            let mut m = st.streams[dev].write();
            match m.get(&h) {
                Some(k) if k.created => Ok(m.remove(&h)),
                Some(_) => Err(Fail::new(
                    GpupoolStatus::InvalidHandle,
                    format!("stream {h:#x} was not created by gpupool_stream_create"),
                )),
                None => {
                    drop(m);
                    let other = (0..st.streams.len())
                        .find(|&d| d != dev && st.streams[d].read().contains_key(&h));
                    Err(Fail::new(
                        GpupoolStatus::InvalidHandle,
                        match other {
                            Some(o) => {
                                format!("stream {h:#x} belongs to device {o}, not device {dev}")
                            }
                            None => format!("unknown stream {h:#x} on device {dev}"),
                        },
                    ))
                }
            }
        })?;
        // Dropped outside the locks: this flushes the stream's free lists
        // and destroys the backend stream.
        drop(gone);
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
            let mut m = st.streams[pool.device()].write();
            match m.get(&h) {
                Some(k) if k.created => Err(Fail::new(
                    GpupoolStatus::InvalidHandle,
                    format!(
                        "stream {h:#x} was created by gpupool_stream_create: \
                         destroy it with gpupool_stream_destroy"
                    ),
                )),
                Some(_) => Ok(m.remove(&h)),
                None => Ok(None),
            }
        })?;
        // Dropped outside the locks: this flushes the stream's free lists.
        drop(gone);
        Ok(())
    })
}

// ---- observability ------------------------------------------------------------------------

/// Writes the statistics of `device` as one JSON object (the fields of
/// `PoolStats`: `device`, `requested_bytes`, `allocated_bytes`,
/// `active_bytes`, `reserved_bytes`, `inactive_split_bytes`,
/// `cached_bytes`, `pending_bytes` as `{"current", "peak"}`, and the
/// counters `num_allocs`, `num_frees`, `num_device_allocs`, `num_ooms`,
/// ...). The byte names mean what PyTorch means: requested sizes, their
/// rounded sizes, those plus freed blocks not yet reusable, device memory
/// held. See the buffer protocol in the header's preamble, and
/// `gpupool_memory_stats_json` for PyTorch's flat layout.
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
            let stats = st.pool(device)?.stats();
            serde_json::to_string(&stats)
                .map_err(|e| Fail::new(GpupoolStatus::Io, format!("serializing stats: {e}")))
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

// ---- limits -------------------------------------------------------------------------------

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
fn call_oom_callback(report: &crate::error::OomReport) {
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

// ---- PyTorch ------------------------------------------------------------------------------

fn ensure_init() -> FResult<()> {
    let uninit = matches!(&*GLOBAL.read(), Global::Uninit);
    if uninit {
        match init_from(None) {
            Err(f) if f.status == GpupoolStatus::AlreadyInitialized => {}
            other => other?,
        }
    }
    Ok(())
}

/// PyTorch's `CUDAPluggableAllocator` allocation hook
/// (`void* (size_t, int, cudaStream_t)`). Returns the pointer, or `NULL`:
/// for `size == 0` (no error, as PyTorch's own allocator does) and on
/// failure (with `gpupool_last_error` set and the message also written to
/// stderr, since PyTorch does not check for `NULL`). The first call
/// initializes gpupool from `GPUPOOL_CONF` when `gpupool_init` was not
/// called; after `gpupool_shutdown` it fails.
#[no_mangle]
pub extern "C" fn gpupool_torch_malloc(
    size: libc::ssize_t,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    let r = run("gpupool_torch_malloc", || {
        let size = usize::try_from(size).map_err(|_| {
            Fail::new(
                GpupoolStatus::InvalidSize,
                format!("invalid size {size}: negative"),
            )
        })?;
        if size == 0 {
            return Ok(std::ptr::null_mut());
        }
        ensure_init()?;
        let p = with_state(|st| {
            st.with_stream(device, stream, |pool, s| Ok(pool.alloc_raw(size, s)?))
        })?;
        Ok(p.addr() as usize as *mut c_void)
    });
    r.unwrap_or_else(|_| {
        report_to_stderr();
        std::ptr::null_mut()
    })
}

/// PyTorch's `CUDAPluggableAllocator` free hook
/// (`void (void*, size_t, int, cudaStream_t)`). `NULL` is a no-op; `size`
/// is not needed (the pool knows it). Errors set `gpupool_last_error` and
/// are written to stderr.
#[no_mangle]
pub extern "C" fn gpupool_torch_free(
    ptr: *mut c_void,
    size: libc::ssize_t,
    device: c_int,
    stream: *mut c_void,
) {
    let _ = size;
    let r = run("gpupool_torch_free", || {
        if ptr.is_null() {
            return Ok(());
        }
        free_impl(ptr, device, stream)
    });
    if r.is_err() {
        report_to_stderr();
    }
}

/// The shape of PyTorch's `record_stream` hook (`void (void*,
/// cudaStream_t)`, settable from C++ with `set_record_stream_fn`): records
/// `stream` for `ptr` on whichever device holds it. Errors set
/// `gpupool_last_error` and are written to stderr.
#[no_mangle]
pub extern "C" fn gpupool_torch_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    let r = run("gpupool_torch_record_stream", || {
        if ptr.is_null() {
            return Err(Fail::null("ptr"));
        }
        let addr = ptr as usize as u64;
        with_state(|st| {
            let dev = st
                .rt
                .active_devices()
                .into_iter()
                .find(|p| p.raw_size(DevicePtr(addr)).is_some())
                .map(|p| p.device())
                .ok_or_else(|| {
                    Fail::new(
                        GpupoolStatus::UnknownPointer,
                        format!("unknown pointer {addr:#x} on every device"),
                    )
                })?;
            st.with_stream(dev as c_int, stream, |pool, s| {
                Ok(pool.record_stream_raw(DevicePtr(addr), s)?)
            })
        })
    });
    if r.is_err() {
        report_to_stderr();
    }
}

fn report_to_stderr() {
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
