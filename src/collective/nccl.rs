//! The all-reduce through NCCL (feature `nccl`), for one process driving
//! every GPU of a CUDA backend.
//!
//! cudarc's safe NCCL API (`Comm::from_devices`) works on its own
//! `CudaStream` and `CudaSlice` types; the pools hand out raw device
//! pointers on raw streams, so this uses cudarc's thin `result` layer over
//! the same calls: `ncclCommInitAll` (one communicator per device),
//! `ncclGroupStart`/`ncclGroupEnd` around the per-device `ncclAllReduce`
//! calls (required when one thread drives several devices), and
//! `ncclCommRegister` for pool memory (NCCL 2.19 and later; older
//! libraries lack the symbol and registration is skipped). The library is
//! opened at run time; where it is missing, [`NcclAllReduce::new`] fails
//! with [`Error::NoDriver`] and no panic.
//!
//! Device `i` of the backend is CUDA ordinal `i` (as `CudaBackend`
//! enumerates them).

use super::{validate, AllReduce, ReduceBuf, ELEM_BYTES};
use crate::error::{Error, Result};
use crate::ptr::DevicePtr;
use cudarc::nccl::{result, sys};
use parking_lot::Mutex;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// One NCCL communicator per device, created together.
#[derive(Debug)]
pub struct NcclAllReduce {
    /// `comms[i]` is the communicator of `devices[i]` (rank `i`).
    comms: Vec<sys::ncclComm_t>,
    devices: Vec<usize>,
    /// Registration handles: (rank, handle).
    registered: Mutex<Vec<(usize, usize)>>,
}

// SAFETY: communicators are opaque NCCL handles, never dereferenced by
// Rust. NCCL allows a communicator to be used from any thread as long as
// calls on one communicator are not concurrent; `all_reduce` issues every
// call of a collective inside one group from the calling thread, and the
// harness calls it from one thread at a time.
unsafe impl Send for NcclAllReduce {}
// SAFETY: as above.
unsafe impl Sync for NcclAllReduce {}

fn nccl_err(call: &'static str, e: result::NcclError) -> Error {
    Error::backend(call, format!("{:?}", e.0))
}

/// Runs an NCCL call, turning a panic of cudarc's loader (library or
/// symbol missing) into an error.
fn guarded<T>(call: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f))
        .unwrap_or_else(|_| Err(Error::NoDriver(format!("NCCL lacks {call}"))))
}

impl NcclAllReduce {
    /// Communicators over `devices` (CUDA ordinals), one rank each.
    pub fn new(devices: &[usize]) -> Result<NcclAllReduce> {
        if devices.is_empty() {
            return Err(Error::InvalidArgument("NCCL over no devices".into()));
        }
        // SAFETY: only tries to dlopen libnccl; nothing is called.
        let present = catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false);
        if !present {
            return Err(Error::NoDriver("libnccl could not be loaded".into()));
        }
        let ordinals: Vec<i32> = devices.iter().map(|&d| d as i32).collect();
        let mut comms = vec![std::ptr::null_mut(); devices.len()];
        guarded("ncclCommInitAll", || {
            // SAFETY: `comms` has room for `ordinals.len()` communicators
            // and `ordinals` holds that many device ordinals; both outlive
            // the call.
            unsafe {
                result::comm_init_all(comms.as_mut_ptr(), ordinals.len() as i32, ordinals.as_ptr())
            }
            .map_err(|e| nccl_err("ncclCommInitAll", e))
        })?;
        Ok(NcclAllReduce {
            comms,
            devices: devices.to_vec(),
            registered: Mutex::new(Vec::new()),
        })
    }

    fn rank_of(&self, device: usize) -> Result<usize> {
        self.devices
            .iter()
            .position(|&d| d == device)
            .ok_or(Error::InvalidDevice {
                device,
                count: self.devices.len(),
            })
    }
}

impl AllReduce for NcclAllReduce {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn all_reduce(&self, bufs: &[ReduceBuf]) -> Result<()> {
        let bytes = validate(bufs)?;
        if bufs.len() != self.comms.len() {
            return Err(Error::InvalidArgument(format!(
                "NCCL all-reduce needs one buffer per rank: {} given, {} ranks",
                bufs.len(),
                self.comms.len()
            )));
        }
        let ranks: Vec<usize> = bufs
            .iter()
            .map(|b| self.rank_of(b.device))
            .collect::<Result<_>>()?;
        let count = (bytes / ELEM_BYTES) as usize;
        guarded("ncclAllReduce", || {
            result::group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
            let mut first_err = None;
            for (b, &r) in bufs.iter().zip(&ranks) {
                let p = b.ptr.addr() as usize as *mut c_void;
                // SAFETY: `p` is a live device buffer of `bytes` bytes on
                // the communicator's device (the caller's contract, checked
                // by NCCL), reduced in place; the stream is the raw
                // CUstream of that device, which is NCCL's cudaStream_t.
                let r = unsafe {
                    result::all_reduce(
                        p,
                        p,
                        count,
                        sys::ncclDataType_t::ncclUint32,
                        sys::ncclRedOp_t::ncclSum,
                        self.comms[r],
                        b.stream.raw() as usize as sys::cudaStream_t,
                    )
                };
                if let Err(e) = r {
                    first_err.get_or_insert(nccl_err("ncclAllReduce", e));
                }
            }
            // The group must be closed even after an error.
            let end = result::group_end().map_err(|e| nccl_err("ncclGroupEnd", e));
            match first_err {
                Some(e) => Err(e),
                None => end.map(|_| ()),
            }
        })
    }

    fn register(&self, device: usize, ptr: DevicePtr, bytes: u64) -> Result<bool> {
        let rank = self.rank_of(device)?;
        let mut handle: *mut c_void = std::ptr::null_mut();
        // Older NCCL lacks the symbol: cudarc's loader panics, caught here.
        let r = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: the range is device memory of the communicator's
            // device that stays allocated until the registration ends (the
            // trait's contract); `handle` is a valid out-pointer.
            unsafe {
                sys::ncclCommRegister(
                    self.comms[rank],
                    ptr.addr() as usize as *mut c_void,
                    bytes as usize,
                    &mut handle,
                )
            }
        }));
        match r {
            Ok(sys::ncclResult_t::ncclSuccess) => {
                self.registered.lock().push((rank, handle as usize));
                Ok(true)
            }
            Ok(other) => {
                tracing::debug!(device, "ncclCommRegister: {other:?}; not registered");
                Ok(false)
            }
            Err(_) => Ok(false),
        }
    }

    fn host_syncs(&self) -> u64 {
        0
    }

    fn deregister_all(&self) {
        for (rank, h) in std::mem::take(&mut *self.registered.lock()) {
            let comm = self.comms[rank];
            // SAFETY: `h` came from ncclCommRegister on this communicator
            // and is deregistered once (taken out of the list).
            let _ = catch_unwind(|| unsafe { sys::ncclCommDeregister(comm, h as *mut c_void) });
        }
    }
}

impl Drop for NcclAllReduce {
    fn drop(&mut self) {
        self.deregister_all();
        for &c in &self.comms {
            // SAFETY: each communicator was created by ncclCommInitAll and
            // is destroyed once; NCCL waits for its operations in flight.
            let _ = catch_unwind(|| unsafe { result::comm_destroy(c) });
        }
    }
}
