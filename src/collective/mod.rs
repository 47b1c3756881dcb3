//! Collectives over per-device buffers: the all-reduce a data-parallel
//! harness runs on its gradient buckets.
//!
//! [`AllReduce`] sums one buffer per device, element-wise, in place, in
//! stream order: the reduction reads each buffer only after the work
//! enqueued so far on that buffer's stream, and work enqueued on the stream
//! afterwards sees the sums. Elements are `u32` summed modulo 2^32, so the
//! result is exact and independent of the reduction order (ring, tree or
//! host loop), which lets a harness demand bit-identical gradients.
//!
//! Two implementations:
//! - [`HostAllReduce`] (any backend; what the simulator uses): orders the
//!   host after each stream with an event, copies every buffer to the host,
//!   sums, and copies the sums back. Its host syncs are counted
//!   ([`AllReduce::host_syncs`]) so that reports can tell them from the
//!   pool's (which must be zero on the alloc/free path).
//! - `NcclAllReduce` (feature `nccl`, CUDA backend): one communicator per
//!   device for one process driving every GPU (`ncclCommInitAll`), the
//!   per-device calls in one `ncclGroupStart`/`ncclGroupEnd`, and optional
//!   registration of pool memory with each communicator
//!   (`ncclCommRegister`).
//!
//! [`for_runtime`] picks NCCL when the backend is CUDA and NCCL loads, the
//! host path otherwise.

mod host;
#[cfg(feature = "nccl")]
mod nccl;

pub use host::HostAllReduce;
#[cfg(feature = "nccl")]
pub use nccl::{nccl_library_path, NcclAllReduce};

use crate::error::{Error, Result};
use crate::ptr::{DevicePtr, StreamHandle};
use crate::runtime::Runtime;
use std::fmt;

/// Bytes of one element (`u32`).
pub const ELEM_BYTES: u64 = 4;

/// One device's buffer of a collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReduceBuf {
    /// Device the buffer lives on.
    pub device: usize,
    /// Stream the reduction is ordered on.
    pub stream: StreamHandle,
    /// Start of the buffer.
    pub ptr: DevicePtr,
    /// Length in bytes (a multiple of [`ELEM_BYTES`]).
    pub bytes: u64,
}

/// An in-place, stream-ordered sum of one buffer per device.
pub trait AllReduce: Send + Sync + fmt::Debug {
    /// `"host"` or `"nccl"`.
    fn name(&self) -> &'static str;

    /// Sums `bufs` element-wise (`u32`, modulo 2^32) into every one of them.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the buffers are empty, of different
    /// lengths, not whole elements, or two share a device; nothing is
    /// enqueued then. Backend errors otherwise.
    fn all_reduce(&self, bufs: &[ReduceBuf]) -> Result<()>;

    /// Registers `[ptr, ptr+bytes)` of `device` with the collective
    /// library for faster transfers (zero-copy); `Ok(false)` where the
    /// implementation or library has no registration. Registrations end
    /// at [`AllReduce::deregister_all`] or when the collective is dropped,
    /// one of which must happen before the memory is freed.
    fn register(&self, device: usize, ptr: DevicePtr, bytes: u64) -> Result<bool>;

    /// Ends every registration made so far.
    fn deregister_all(&self) {}

    /// Host-blocking syncs this collective made so far.
    fn host_syncs(&self) -> u64;
}

/// Checks the buffers of one call; returns the common length in bytes.
pub(crate) fn validate(bufs: &[ReduceBuf]) -> Result<u64> {
    let first = bufs
        .first()
        .ok_or_else(|| Error::InvalidArgument("all-reduce of no buffers".into()))?;
    let bytes = first.bytes;
    if bytes == 0 || bytes % ELEM_BYTES != 0 {
        return Err(Error::InvalidArgument(format!(
            "all-reduce of {bytes} bytes: a positive multiple of {ELEM_BYTES}"
        )));
    }
    for (i, b) in bufs.iter().enumerate() {
        if b.bytes != bytes {
            return Err(Error::InvalidArgument(format!(
                "all-reduce buffers differ in length: {} and {}",
                bytes, b.bytes
            )));
        }
        if bufs[..i].iter().any(|o| o.device == b.device) {
            return Err(Error::InvalidArgument(format!(
                "two all-reduce buffers on device {}",
                b.device
            )));
        }
    }
    Ok(bytes)
}

/// The collective for `rt`: NCCL when the backend is CUDA, the `nccl`
/// feature is built and NCCL initialises over every device; the host path
/// otherwise (logging why NCCL was not used, on CUDA).
pub fn for_runtime(rt: &Runtime) -> Result<Box<dyn AllReduce>> {
    #[cfg(feature = "nccl")]
    if rt.backend().name() == "cuda" {
        let devices: Vec<usize> = (0..rt.device_count()).collect();
        match NcclAllReduce::new(&devices) {
            Ok(n) => return Ok(Box::new(n)),
            Err(e) => tracing::warn!("NCCL unavailable ({e}); all-reduce on the host"),
        }
    }
    Ok(Box::new(HostAllReduce::new(rt.backend().clone())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf(device: usize, bytes: u64) -> ReduceBuf {
        ReduceBuf {
            device,
            stream: StreamHandle(0),
            ptr: DevicePtr(0x1000),
            bytes,
        }
    }

    #[test]
    fn validate_rejects_mismatched_calls() {
        assert_eq!(validate(&[buf(0, 64), buf(1, 64)]).unwrap(), 64);
        assert!(validate(&[]).is_err());
        assert!(validate(&[buf(0, 0)]).is_err());
        assert!(validate(&[buf(0, 6)]).is_err());
        assert!(validate(&[buf(0, 64), buf(1, 32)]).is_err());
        assert!(validate(&[buf(0, 64), buf(0, 64)]).is_err());
    }
}
