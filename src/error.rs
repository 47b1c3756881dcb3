//! The one error type of gpupool.
//!
//! Every fallible call returns [`Result<T>`]. Variants are typed so that
//! callers (and the C ABI, which maps each one to a status code) can react to
//! the kind of failure without parsing messages.

use std::fmt;

/// Shorthand for `Result<T, gpupool::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Byte figures attached to an out-of-memory error, as PyTorch reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OomReport {
    /// Device the request was made on.
    pub device: usize,
    /// Bytes asked for.
    pub requested: u64,
    /// Bytes held by live blocks (requested sizes).
    pub live: u64,
    /// Device memory held by the pool.
    pub reserved: u64,
    /// Reserved bytes free for reuse right now.
    pub cached: u64,
    /// Bytes freed but waiting for their last use to complete.
    pub pending: u64,
    /// The largest request that could be served without new device memory.
    pub largest_free: u64,
    /// Device capacity in bytes.
    pub capacity: u64,
}

impl fmt::Display for OomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "device {}: requested {} B; live {} B, reserved {} B, cached {} B, pending {} B, \
             largest free {} B, capacity {} B",
            self.device,
            self.requested,
            self.live,
            self.reserved,
            self.cached,
            self.pending,
            self.largest_free,
            self.capacity
        )
    }
}

/// Everything that can go wrong in gpupool.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// No CUDA driver library could be loaded, or it reported no device.
    #[error("no CUDA driver: {0}")]
    NoDriver(String),
    /// The backend has no device the configuration lets gpupool use.
    #[error("no device: {0}")]
    NoDevice(String),
    /// A call into the backend (driver) failed.
    #[error("backend call {call} failed: {msg}")]
    Backend {
        /// The driver-level call, e.g. `cuMemCreate`.
        call: &'static str,
        /// What the driver said.
        msg: String,
    },
    /// The device itself has no more memory for a physical chunk or segment.
    #[error(
        "device {device} out of memory: {requested} B requested, {used} B of {capacity} B in use"
    )]
    DeviceOutOfMemory {
        /// Device index.
        device: usize,
        /// Bytes asked for.
        requested: u64,
        /// Bytes already held on the device.
        used: u64,
        /// Device capacity.
        capacity: u64,
    },
    /// The pool could not serve a request even after harvesting, trimming and
    /// compacting.
    #[error("out of memory: {0}")]
    OutOfMemory(Box<OomReport>),
    /// A size of zero, or one no device could ever hold.
    #[error("invalid size {size}: {why}")]
    InvalidSize {
        /// The size given.
        size: u64,
        /// Why it is refused.
        why: &'static str,
    },
    /// A device index past the last device.
    #[error("invalid device {device}: {count} device(s) present")]
    InvalidDevice {
        /// The index given.
        device: usize,
        /// Devices present.
        count: usize,
    },
    /// A pointer the pool did not hand out (or already took back).
    #[error("unknown pointer {ptr:#x} on device {device}")]
    UnknownPointer {
        /// The address given.
        ptr: u64,
        /// The device it was presented to.
        device: usize,
    },
    /// A pointer freed twice.
    #[error("double free of pointer {ptr:#x} on device {device}")]
    DoubleFree {
        /// The address given.
        ptr: u64,
        /// The device it was presented to.
        device: usize,
    },
    /// A stream, event or handle that belongs to another device or to nobody.
    #[error("invalid handle: {0}")]
    InvalidHandle(String),
    /// A value the operation cannot take (bad alignment, range outside a
    /// reservation, and the like).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// `GPUPOOL_CONF` or a config value that cannot be parsed; names the key.
    #[error("config key `{key}`: {msg}")]
    Config {
        /// The offending key.
        key: String,
        /// What is wrong with it.
        msg: String,
    },
    /// A fault injected by the simulator.
    #[error("injected fault: {0}")]
    InjectedFault(String),
    /// The runtime was shut down.
    #[error("gpupool is shut down")]
    Shutdown,
    /// The backend cannot do this (for example VMM on a device without it).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A trace file could not be read; names the file and place.
    #[error("trace {file}: {msg}")]
    Trace {
        /// File name.
        file: String,
        /// What and where.
        msg: String,
    },
    /// An I/O error, as text (so the error stays `Clone`).
    #[error("i/o: {0}")]
    Io(String),
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e.to_string())
    }
}

impl Error {
    /// Builds a [`Error::Backend`].
    pub fn backend(call: &'static str, msg: impl Into<String>) -> Self {
        Error::Backend {
            call,
            msg: msg.into(),
        }
    }

    /// Whether this error means "no memory" (device or pool).
    pub fn is_oom(&self) -> bool {
        matches!(
            self,
            Error::OutOfMemory(_) | Error::DeviceOutOfMemory { .. }
        )
    }
}
