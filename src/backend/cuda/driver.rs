//! Opening the CUDA driver: finding `libcuda`, resolving every symbol the
//! backend calls before the first call, initialising the driver and
//! reading each device's facts; and the driver's status codes as typed
//! errors.
//!
//! Invariant: after [`CudaBackend::new`] returned `Ok`, every symbol in
//! [`REQUIRED_SYMBOLS`] resolved, so no later call into `sys` can reach
//! cudarc's loader panics; before that, every call into the library runs
//! under `catch_unwind`. Out-of-memory status codes from calls that take
//! device memory become [`Error::DeviceOutOfMemory`] ([`check_mem`]),
//! never a generic [`Error::Backend`].

use super::memory::pinned_prop;
use super::{ctx, kernel, libs, CudaBackend, Device};
use crate::backend::{CallCounters, DeviceInfo};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use parking_lot::Mutex;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::Arc;

/// Granularity reported for devices without VMM, where the driver cannot be
/// asked (`cuMemAlloc` has no granularity; 2 MiB is CUDA's large page).
pub(super) const FALLBACK_GRANULARITY: u64 = 2 << 20;

/// Every driver symbol this module calls, resolved up front in
/// [`CudaBackend::new`] so that a driver too old to export one is a typed
/// error rather than a panic in cudarc's lazy loader later.
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuGetErrorName",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceTotalMem_v2",
    "cuDeviceGetPCIBusId",
    "cuDeviceGetAttribute",
    "cuDeviceCanAccessPeer",
    "cuMemGetAllocationGranularity",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuMemGetInfo_v2",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuStreamWaitEvent",
    "cuStreamSynchronize",
    "cuMemsetD8Async",
    "cuMemcpyDtoH_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuDriverGetVersion",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuStreamIsCapturing",
    "cuStreamQuery",
    "cuThreadExchangeStreamCaptureMode",
];

/// The driver's name for `r` (`CUDA_ERROR_OUT_OF_MEMORY`), or its Debug form
/// (also where no driver is loaded).
pub(super) fn error_name(r: sys::CUresult) -> String {
    let mut p: *const c_char = ptr::null();
    // SAFETY: `p` is a valid out-pointer; cuGetErrorName writes a pointer to
    // a static NUL-terminated string or leaves it untouched on failure. A
    // missing library or symbol panics in cudarc's loader before any
    // foreign call, and is caught.
    let rc = catch_unwind(AssertUnwindSafe(|| unsafe {
        sys::cuGetErrorName(r, &mut p)
    }))
    .unwrap_or(sys::CUresult::CUDA_ERROR_NOT_INITIALIZED);
    if rc == sys::CUresult::CUDA_SUCCESS && !p.is_null() {
        // SAFETY: on success `p` points to a static NUL-terminated string
        // owned by the driver that lives as long as the library.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    } else {
        format!("{r:?}")
    }
}

/// `Ok` on `CUDA_SUCCESS`, else [`Error::Backend`] naming `call`.
pub(super) fn check(call: &'static str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::backend(call, error_name(r)))
    }
}

/// Like [`check`] for a call that takes device memory: out-of-memory is the
/// error `oom` builds (an [`Error::is_oom`] one), not [`Error::Backend`].
pub(super) fn check_mem(
    call: &'static str,
    r: sys::CUresult,
    oom: impl FnOnce() -> Error,
) -> Result<()> {
    if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        Err(oom())
    } else {
        check(call, r)
    }
}

/// A NUL-terminated C string in `buf` as an owned `String`.
fn c_buf_to_string(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Resolves `names` in the driver library (a typed [`Error::NoDriver`]
/// naming the first one missing), catching cudarc's panic should the
/// library vanish between the presence check and here.
pub(super) fn resolve_symbols(names: &[&str]) -> Result<()> {
    let res = catch_unwind(AssertUnwindSafe(|| -> std::result::Result<(), String> {
        // SAFETY: callers checked the library is present; culib() opens it
        // once for the process (panicking, caught here, if it cannot).
        let lib = unsafe { sys::culib() };
        for name in names {
            // SAFETY: the symbol is only looked up, never called through
            // this pointer type; cudarc's bindings call it with the right
            // signature later.
            let sym = unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) };
            if let Err(e) = sym {
                return Err(format!("driver lacks {name}: {e}"));
            }
        }
        Ok(())
    }));
    match res {
        Ok(Ok(())) => Ok(()),
        Ok(Err(msg)) => Err(Error::NoDriver(msg)),
        Err(_) => Err(Error::NoDriver(
            "the CUDA driver library (libcuda) could not be loaded".into(),
        )),
    }
}

impl CudaBackend {
    /// Whether the CUDA driver library (`libcuda.so`, `nvcuda.dll`) can be
    /// opened. Does not initialise the driver or look for devices.
    pub fn driver_library_present() -> bool {
        // SAFETY: this only dlopens (and closes again) the driver library,
        // running its initialisers, which is what loading it for use does
        // too; no Rust memory is involved.
        catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
    }

    /// Loads the driver, initialises it (`cuInit`), and retains the primary
    /// context of every device.
    ///
    /// Fails with [`Error::NoDriver`] where `libcuda` is missing, lacks a
    /// symbol this backend uses, `cuInit` fails, or there is no device; with
    /// [`Error::Backend`] where a device query fails.
    pub fn new() -> Result<CudaBackend> {
        if !Self::driver_library_present() {
            return Err(Error::NoDriver(
                "the CUDA driver library (libcuda) could not be loaded".into(),
            ));
        }
        Self::load_symbols()?;

        // SAFETY: every symbol was resolved above; cuInit takes flags only.
        let r = unsafe { sys::cuInit(0) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(Error::NoDriver(format!("cuInit: {}", error_name(r))));
        }
        let mut count: c_int = 0;
        // SAFETY: `count` is a valid out-pointer.
        check("cuDeviceGetCount", unsafe {
            sys::cuDeviceGetCount(&mut count)
        })?;
        if count <= 0 {
            return Err(Error::NoDriver("no CUDA device".into()));
        }

        // Devices are pushed as their contexts are retained, so that an early
        // return drops `this` and releases exactly those.
        let mut this = CudaBackend {
            devices: Vec::with_capacity(count as usize),
            counters: CallCounters::default(),
        };
        for ordinal in 0..count {
            let mut cu: sys::CUdevice = 0;
            // SAFETY: `cu` is a valid out-pointer; `ordinal` < count.
            check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut cu, ordinal) })?;
            let index = this.devices.len();
            this.devices.push(Device {
                cu,
                ctx: std::sync::OnceLock::new(),
                ctx_init: Mutex::new(()),
                info: DeviceInfo {
                    index,
                    name: String::new(),
                    total_bytes: 0,
                    pci_bus_id: String::new(),
                    granularity: FALLBACK_GRANULARITY,
                    vmm_supported: false,
                },
                kernel: Arc::default(),
                copy_stream: Mutex::new(0),
            });
            let info = match Self::query_info(index, cu) {
                Ok(i) => i,
                // A driver that wants a context for the granularity query:
                // this device's is retained now, the others stay untouched.
                Err(_) => {
                    let d = &this.devices[index];
                    let _cx = ctx::CtxGuard::enter(&ctx::Driver, d.context()?)?;
                    Self::query_info(index, cu)?
                }
            };
            this.devices[index].info = info;
        }
        let mut version: c_int = 0;
        // SAFETY: `version` is a valid out-pointer.
        let _ = unsafe { sys::cuDriverGetVersion(&mut version) };
        tracing::info!(
            library = %Self::driver_library_path().unwrap_or_else(|| "(unknown file)".into()),
            version = format!("{}.{}", version / 1000, version % 1000 / 10),
            devices = this.devices.len(),
            "CUDA driver loaded"
        );
        // Finds (and logs) NVRTC now, so that the open says which library
        // the kernel will come from; compiling waits for the first need.
        if let Err(why) = kernel::nvrtc_library_path() {
            tracing::info!("NVRTC unavailable ({why}); compaction moves will use copies");
        }
        Ok(this)
    }

    /// The file the driver library was loaded from (`libcuda.so.580.65.06`).
    pub fn driver_library_path() -> Option<String> {
        catch_unwind(|| {
            // SAFETY: `new` opened the library; a lookup only, never a call.
            let lib = unsafe { sys::culib() };
            // SAFETY: as above.
            let f = unsafe { lib.get::<unsafe extern "C" fn()>(b"cuInit") }.ok()?;
            libs::file_of(*f as *const c_void)
        })
        .ok()
        .flatten()
    }

    /// Resolves every symbol in [`REQUIRED_SYMBOLS`].
    fn load_symbols() -> Result<()> {
        resolve_symbols(REQUIRED_SYMBOLS)
    }

    /// Reads the facts of device `cu` (its primary context is retained).
    fn query_info(index: usize, cu: sys::CUdevice) -> Result<DeviceInfo> {
        let mut name = [0 as c_char; 256];
        // SAFETY: `name` is writable for its full length, which is passed.
        check("cuDeviceGetName", unsafe {
            sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, cu)
        })?;
        let mut total: usize = 0;
        // SAFETY: `total` is a valid out-pointer.
        check("cuDeviceTotalMem", unsafe {
            sys::cuDeviceTotalMem_v2(&mut total, cu)
        })?;
        let mut bus = [0 as c_char; 64];
        // SAFETY: `bus` is writable for its full length, which is passed.
        check("cuDeviceGetPCIBusId", unsafe {
            sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as c_int, cu)
        })?;
        let mut vmm: c_int = 0;
        // SAFETY: `vmm` is a valid out-pointer; the attribute is an int.
        check("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(
                &mut vmm,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
                cu,
            )
        })?;
        let vmm_supported = vmm != 0;
        let granularity = if vmm_supported {
            let prop = pinned_prop(cu);
            let mut g: usize = 0;
            // SAFETY: `g` is a valid out-pointer and `prop` a fully
            // initialised property struct that outlives the call.
            check("cuMemGetAllocationGranularity", unsafe {
                sys::cuMemGetAllocationGranularity(
                    &mut g,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                )
            })?;
            g as u64
        } else {
            FALLBACK_GRANULARITY
        };
        Ok(DeviceInfo {
            index,
            name: c_buf_to_string(&name),
            total_bytes: total as u64,
            // The driver writes upper-case hex; sysfs names are lower case.
            pci_bus_id: c_buf_to_string(&bus).to_ascii_lowercase(),
            granularity,
            vmm_supported,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Backend;

    /// Out-of-memory from a mapping call is an out-of-memory error (the
    /// pool trims and retries on those), anything else a backend error
    /// naming the call; no driver is needed to tell them apart.
    #[test]
    fn out_of_memory_from_map_calls_is_oom() {
        let oom = || Error::DeviceOutOfMemory {
            device: 1,
            requested: 2 << 20,
            used: 0,
            capacity: 1,
        };
        for call in ["cuMemMap", "cuMemSetAccess", "cuMemCreate", "cuMemAlloc"] {
            let e = check_mem(call, sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY, oom).unwrap_err();
            assert!(e.is_oom(), "{call}: {e:?}");
            let e = check_mem(call, sys::CUresult::CUDA_ERROR_INVALID_VALUE, oom).unwrap_err();
            assert!(!e.is_oom());
            assert!(
                matches!(e, Error::Backend { call: c, .. } if c == call),
                "{e:?}"
            );
        }
        assert!(check_mem("cuMemMap", sys::CUresult::CUDA_SUCCESS, oom).is_ok());
    }

    /// Without a driver `new` is a typed error, never a panic; with one, it
    /// finds devices (or, on a machine with the library but no GPU, says so
    /// with `NoDriver`).
    #[test]
    fn new_without_driver_is_no_driver() {
        let present = CudaBackend::driver_library_present();
        match CudaBackend::new() {
            Ok(b) => {
                assert!(
                    present,
                    "new() succeeded but no driver library was detected"
                );
                assert!(b.device_count() > 0);
                assert_eq!(b.name(), "cuda");
                let info = b.device_info(0).unwrap();
                assert!(info.total_bytes > 0 && info.granularity > 0);
                assert!(matches!(
                    b.device_info(b.device_count()),
                    Err(Error::InvalidDevice { .. })
                ));
            }
            Err(Error::NoDriver(msg)) => {
                eprintln!("libcuda present: {present}; new(): NoDriver({msg})");
            }
            Err(e) => {
                assert!(present, "no driver library, yet new() failed with {e:?}");
                panic!("driver present but new() failed with {e:?}");
            }
        }
        if !present {
            assert!(matches!(CudaBackend::new(), Err(Error::NoDriver(_))));
        }
    }
}
