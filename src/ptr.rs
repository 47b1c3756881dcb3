//! Device addresses and the opaque handles the backend hands out.

use std::fmt;

/// A device address. On the simulator it is a host virtual address inside a
/// reservation; on CUDA a `CUdeviceptr`.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[repr(transparent)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The null device pointer.
    pub const NULL: DevicePtr = DevicePtr(0);

    /// The address as an integer.
    #[inline]
    pub fn addr(self) -> u64 {
        self.0
    }

    /// This address plus `bytes`.
    #[inline]
    pub fn offset(self, bytes: u64) -> DevicePtr {
        DevicePtr(self.0 + bytes)
    }

    /// Whether this is the null pointer.
    #[inline]
    pub fn is_null(self) -> bool {
        self.0 == 0
    }
}

impl fmt::Debug for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DevicePtr({:#x})", self.0)
    }
}

impl fmt::Display for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

macro_rules! handle {
    ($(#[$m:meta])* $name:ident) => {
        $(#[$m])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
        #[repr(transparent)]
        pub struct $name(pub u64);

        impl $name {
            /// The raw value (a driver handle on CUDA, an id on the simulator).
            #[inline]
            pub fn raw(self) -> u64 {
                self.0
            }
        }
    };
}

handle!(
    /// A physical memory chunk (`CUmemGenericAllocationHandle` on CUDA).
    ChunkHandle
);
handle!(
    /// A stream (`CUstream` on CUDA). `StreamHandle(0)` is the device's
    /// default (legacy null) stream.
    StreamHandle
);
handle!(
    /// An event with timing disabled (`CUevent` on CUDA).
    EventHandle
);

impl StreamHandle {
    /// The legacy default stream under its explicit name
    /// (`CU_STREAM_LEGACY`): the same stream as `StreamHandle(0)`.
    pub const LEGACY: StreamHandle = StreamHandle(1);
    /// The calling thread's default stream (`CU_STREAM_PER_THREAD`): one
    /// handle value that names a different stream on every host thread.
    pub const PER_THREAD: StreamHandle = StreamHandle(2);

    /// Whether this is a handle value the driver reserves for a default
    /// stream (0, [`StreamHandle::LEGACY`], [`StreamHandle::PER_THREAD`]).
    #[inline]
    pub fn is_default(self) -> bool {
        self.0 <= 2
    }

    /// The one handle of the legacy default stream: [`StreamHandle::LEGACY`]
    /// becomes 0, every other handle stays.
    #[inline]
    pub fn canonical(self) -> StreamHandle {
        if self == StreamHandle::LEGACY {
            StreamHandle(0)
        } else {
            self
        }
    }
}
