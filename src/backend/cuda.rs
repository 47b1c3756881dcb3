//! The CUDA backend: [`Backend`] over the CUDA driver API, through cudarc's
//! raw bindings (`cudarc::driver::sys`) in dynamic-loading mode.
//!
//! The crate builds without CUDA: `libcuda` is opened at run time, in
//! [`CudaBackend::new`]. Where it is missing, `new` returns
//! [`Error::NoDriver`] instead of letting cudarc panic (its loader panics on
//! the first call into a missing library or symbol). `new` checks for the
//! library with [`CudaBackend::driver_library_present`], then resolves every
//! driver symbol this module calls, under `catch_unwind`, before it makes any
//! call; after that no call into `sys` can hit cudarc's loader panics.
//!
//! Each device is driven through its primary context, retained in `new` and
//! released on drop. Every method makes that context current on the calling
//! thread for its driver calls only, and makes the caller's own context (or
//! none) current again before it returns (see `ctx::CtxGuard`): a PyTorch
//! free of a `cuda:1` tensor while PyTorch's current device is 0 leaves it
//! at 0.
//!
//! Out-of-memory from `cuMemCreate`, `cuMemAlloc`, `cuMemMap` and
//! `cuMemSetAccess` is [`Error::DeviceOutOfMemory`] (so
//! [`Error::is_oom`] holds and the pool trims and retries), never a generic
//! [`Error::Backend`].

mod baseline;
mod ctx;
pub mod kernel;
pub mod libs;

use super::move_groups::{self, split_move};
use super::{Backend, BackendCounters, Call, CallCounters, DeviceInfo, Move};
use crate::error::{Error, Result};
use crate::ptr::{ChunkHandle, DevicePtr, EventHandle, StreamHandle};
use cudarc::driver::sys;
use parking_lot::Mutex;
use std::any::Any;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::Arc;

/// Granularity reported for devices without VMM, where the driver cannot be
/// asked (`cuMemAlloc` has no granularity; 2 MiB is CUDA's large page).
const FALLBACK_GRANULARITY: u64 = 2 << 20;

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
];

/// A context handle (null: none), shareable between threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ctx(sys::CUcontext);

// SAFETY: a CUcontext is an opaque driver handle, not memory Rust reads or
// writes. The driver API is thread safe and a context may be made current on
// (and used from) any thread, which is exactly how this module uses it.
unsafe impl Send for Ctx {}
// SAFETY: as above; sharing the handle value only lets threads pass it to
// the (thread-safe) driver.
unsafe impl Sync for Ctx {}

/// One device: its driver ordinal, primary context and facts.
#[derive(Debug)]
struct Device {
    cu: sys::CUdevice,
    /// The primary context, retained on the device's first use (not at
    /// open: a process that uses one GPU of eight holds one context) and
    /// released when the backend drops.
    ctx: std::sync::OnceLock<Ctx>,
    ctx_init: Mutex<()>,
    info: DeviceInfo,
    /// The compaction kernel, loaded in the background after the first
    /// need; an error where it cannot be (no NVRTC, no image the driver
    /// accepts): moves then use copies.
    kernel: Arc<kernel::KernelSlot>,
    /// The stream host-to-device copies run on (0 until the first copy),
    /// locked across each copy and its synchronize.
    copy_stream: Mutex<usize>,
}

impl Device {
    /// The device's primary context, retained on the first call.
    fn context(&self) -> Result<Ctx> {
        if let Some(&c) = self.ctx.get() {
            return Ok(c);
        }
        let _g = self.ctx_init.lock();
        if let Some(&c) = self.ctx.get() {
            return Ok(c);
        }
        let mut ctx: sys::CUcontext = ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer; `cu` is a device handle the
        // driver gave out in `new`.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, self.cu)
        })?;
        let c = Ctx(ctx);
        let _ = self.ctx.set(c);
        Ok(c)
    }
}

/// A device whose primary context is current on this thread until this is
/// dropped, when the caller's context is current again.
#[must_use = "the device's context is current only while this lives"]
struct Entered<'a> {
    device: &'a Device,
    _cx: ctx::CtxGuard<'static, ctx::Driver>,
}

impl std::ops::Deref for Entered<'_> {
    type Target = Device;
    fn deref(&self) -> &Device {
        self.device
    }
}

/// [`Backend`] over the CUDA driver API (feature `cuda`).
///
/// Build one with [`CudaBackend::new`]; it fails with [`Error::NoDriver`]
/// where there is no usable driver or device.
#[derive(Debug)]
pub struct CudaBackend {
    devices: Vec<Device>,
    counters: CallCounters,
}

/// The driver's name for `r` (`CUDA_ERROR_OUT_OF_MEMORY`), or its Debug form
/// (also where no driver is loaded).
fn error_name(r: sys::CUresult) -> String {
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
fn check(call: &'static str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::backend(call, error_name(r)))
    }
}

/// Like [`check`] for a call that takes device memory: out-of-memory is the
/// error `oom` builds (an [`Error::is_oom`] one), not [`Error::Backend`].
fn check_mem(call: &'static str, r: sys::CUresult, oom: impl FnOnce() -> Error) -> Result<()> {
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

fn stream_of(s: StreamHandle) -> sys::CUstream {
    s.0 as usize as sys::CUstream
}

fn event_of(e: EventHandle) -> Result<sys::CUevent> {
    if e.0 == 0 {
        return Err(Error::InvalidHandle("null event".into()));
    }
    Ok(e.0 as usize as sys::CUevent)
}

fn location(cu: sys::CUdevice) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: cu,
    }
}

fn pinned_prop(cu: sys::CUdevice) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: location(cu),
        win32HandleMetaData: ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// Whether chunks of device `cu` can be created shareable as POSIX file
/// descriptors (`CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`).
/// Asked per chunk: one attribute read beside a `cuMemCreate`.
fn posix_fd_supported(cu: sys::CUdevice) -> bool {
    let mut v: c_int = 0;
    // SAFETY: `v` is a valid out-pointer; the attribute is an int.
    let r = unsafe {
        sys::cuDeviceGetAttribute(
            &mut v,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            cu,
        )
    };
    r == sys::CUresult::CUDA_SUCCESS && v != 0
}

fn rw_access(cu: sys::CUdevice) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: location(cu),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

/// Resolves `names` in the driver library (a typed [`Error::NoDriver`]
/// naming the first one missing), catching cudarc's panic should the
/// library vanish between the presence check and here.
pub(crate) fn resolve_symbols(names: &[&str]) -> Result<()> {
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

    /// Device `dev`, with its primary context current on this thread until
    /// the returned guard drops and makes the caller's context current
    /// again. The current context is asked for on each entry rather than
    /// cached: other code on the thread (a framework, another library) may
    /// switch contexts between calls, and `cuCtxGetCurrent` is a
    /// thread-local read in the driver.
    fn enter(&self, dev: usize) -> Result<Entered<'_>> {
        let d = self.device(dev)?;
        // `d.context()` is a primary context retained on first use and
        // released only in `drop`, so it is live while `self` is.
        let cx = ctx::CtxGuard::enter(&ctx::Driver, d.context()?)?;
        Ok(Entered { device: d, _cx: cx })
    }

    fn device(&self, dev: usize) -> Result<&Device> {
        self.devices.get(dev).ok_or(Error::InvalidDevice {
            device: dev,
            count: self.devices.len(),
        })
    }

    /// The device-level out-of-memory error for a request of `requested`.
    fn oom(&self, dev: usize, d: &Device, requested: u64) -> Error {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both are valid out-pointers; the device's context is
        // current (the caller went through `enter`).
        let r = unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) };
        let used = if r == sys::CUresult::CUDA_SUCCESS {
            (total as u64).saturating_sub(free as u64)
        } else {
            0
        };
        Error::DeviceOutOfMemory {
            device: dev,
            requested,
            used,
            capacity: d.info.total_bytes,
        }
    }

    /// Whether [`Backend::enqueue_moves`] on `dev` runs the compaction
    /// kernel (`true`) or falls back to `cuMemcpyDtoDAsync` copies. Loads
    /// the kernel (compiling it with NVRTC) if that was not done yet,
    /// waiting for it: call it outside any pool lock (benchmarks, tests,
    /// warm-up), never from a pool's own path.
    pub fn move_kernel_ready(&self, dev: usize) -> Result<bool> {
        Ok(self.move_kernel_info(dev)?.is_ok())
    }

    /// How `dev`'s compaction kernel was loaded (architecture, cubin or
    /// PTX, the NVRTC library), or why it could not be; waits for the load
    /// like [`CudaBackend::move_kernel_ready`].
    pub fn move_kernel_info(
        &self,
        dev: usize,
    ) -> Result<std::result::Result<kernel::KernelInfo, Error>> {
        let d = self.device(dev)?;
        Ok(match d.kernel.load_now(dev, d.cu, d.context()?) {
            Ok(k) => Ok(k.info.clone()),
            Err(e) => Err(e.clone()),
        })
    }

    /// Loads one kind of kernel image (cubin or PTX, compiled for `dev`'s
    /// architecture) into `dev`'s context and finds the kernel in it,
    /// without using it: whether this driver accepts that image from this
    /// NVRTC. For the GPU check; the module stays loaded until the context
    /// goes.
    pub fn try_load_move_kernel(&self, dev: usize, kind: kernel::ImageKind) -> Result<()> {
        let d = self.enter(dev)?;
        kernel::CompactKernel::load(d.cu, Some(kind)).map(|_| ())
    }

    fn require_vmm(dev: usize, d: &Device) -> Result<()> {
        if d.info.vmm_supported {
            Ok(())
        } else {
            Err(Error::Unsupported(format!(
                "device {dev} ({}) does not support virtual memory management",
                d.info.name
            )))
        }
    }

    fn peer_cu(&self, peer: usize) -> Result<sys::CUdevice> {
        self.devices
            .get(peer)
            .map(|p| p.cu)
            .ok_or(Error::InvalidDevice {
                device: peer,
                count: self.devices.len(),
            })
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        for d in &self.devices {
            // A kernel load in flight uses the context: let it finish.
            d.kernel.join();
            let s = std::mem::take(&mut *d.copy_stream.lock());
            if s != 0 {
                let Some(&c) = d.ctx.get() else { continue };
                if let Ok(_cx) = ctx::CtxGuard::enter(&ctx::Driver, c) {
                    // SAFETY: the copy stream was created by this backend
                    // in this context, is idle (every copy synchronized it)
                    // and is destroyed once (taken out of the slot).
                    let _ = unsafe { sys::cuStreamDestroy_v2(s as sys::CUstream) };
                }
            }
            if d.ctx.get().is_none() {
                continue;
            }
            // SAFETY: this device's primary context was retained exactly
            // once (`Device::context`); this is the matching release. A
            // failure is ignored: nothing useful can be done about it in drop.
            let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(d.cu) };
        }
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device_count(&self) -> usize {
        self.devices.len()
    }

    fn device_info(&self, dev: usize) -> Result<DeviceInfo> {
        self.devices
            .get(dev)
            .map(|d| d.info.clone())
            .ok_or(Error::InvalidDevice {
                device: dev,
                count: self.devices.len(),
            })
    }

    /// A device can always access itself; otherwise `cuDeviceCanAccessPeer`.
    fn can_access_peer(&self, dev: usize, peer: usize) -> Result<bool> {
        let d = self.enter(dev)?;
        let p = self.peer_cu(peer)?;
        if p == d.cu {
            return Ok(true);
        }
        let mut can: c_int = 0;
        // SAFETY: `can` is a valid out-pointer; both are driver devices.
        check("cuDeviceCanAccessPeer", unsafe {
            sys::cuDeviceCanAccessPeer(&mut can, d.cu, p)
        })?;
        Ok(can != 0)
    }

    fn create_chunk(&self, dev: usize, bytes: u64) -> Result<ChunkHandle> {
        let d = self.enter(dev)?;
        Self::require_vmm(dev, &d)?;
        let mut prop = pinned_prop(d.cu);
        // Shareable with other processes (`export_chunk`) where supported.
        if posix_fd_supported(d.cu) {
            prop.requestedHandleTypes =
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        }
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        self.counters.count_units(Call::MemCreate, 1, bytes);
        // SAFETY: `h` is a valid out-pointer and `prop` a fully initialised
        // property struct that outlives the call.
        let r = unsafe { sys::cuMemCreate(&mut h, bytes as usize, &prop, 0) };
        check_mem("cuMemCreate", r, || self.oom(dev, &d, bytes))?;
        Ok(ChunkHandle(h))
    }

    fn release_chunk(&self, dev: usize, chunk: ChunkHandle) -> Result<()> {
        let _cx = self.enter(dev)?;
        self.counters.count(Call::MemRelease);
        // SAFETY: the driver validates the handle; releasing memory that is
        // still mapped only drops the handle's reference, no Rust memory is
        // touched.
        check("cuMemRelease", unsafe { sys::cuMemRelease(chunk.0) })
    }

    fn export_chunk(&self, dev: usize, chunk: ChunkHandle) -> Result<(std::os::fd::OwnedFd, u64)> {
        use std::os::fd::FromRawFd;
        let d = self.enter(dev)?;
        if !posix_fd_supported(d.cu) {
            return Err(Error::Unsupported(format!(
                "device {dev} cannot share memory as POSIX file descriptors"
            )));
        }
        let mut fd: c_int = -1;
        self.counters.count(Call::MemExport);
        // SAFETY: for a POSIX descriptor the shareable handle is an `int`,
        // and `fd` is a valid `int` out-pointer; the driver validates the
        // chunk handle.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut c_int).cast::<c_void>(),
                chunk.0,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        // SAFETY: the driver just created this descriptor for the caller,
        // who owns it from here on.
        Ok((unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }, 0))
    }

    fn import_chunk(
        &self,
        dev: usize,
        fd: std::os::fd::BorrowedFd<'_>,
        fd_offset: u64,
        bytes: u64,
    ) -> Result<ChunkHandle> {
        use std::os::fd::AsRawFd;
        let _cx = self.enter(dev)?;
        if fd_offset != 0 {
            return Err(Error::InvalidArgument(format!(
                "a CUDA shareable handle has no offset ({fd_offset} given)"
            )));
        }
        let _ = bytes; // the allocation carries its own size
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        self.counters.count(Call::MemImport);
        // SAFETY: `h` is a valid out-pointer; for a POSIX descriptor the
        // driver takes the descriptor's value in the pointer argument and
        // does not keep it (`fd` stays the caller's).
        check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut h,
                fd.as_raw_fd() as usize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        Ok(ChunkHandle(h))
    }

    fn alloc_segment(&self, dev: usize, bytes: u64) -> Result<DevicePtr> {
        let d = self.enter(dev)?;
        let mut p: sys::CUdeviceptr = 0;
        self.counters.count_units(Call::MemAlloc, 1, bytes);
        // SAFETY: `p` is a valid out-pointer.
        let r = unsafe { sys::cuMemAlloc_v2(&mut p, bytes as usize) };
        check_mem("cuMemAlloc", r, || self.oom(dev, &d, bytes))?;
        Ok(DevicePtr(p))
    }

    fn free_segment(&self, dev: usize, ptr: DevicePtr) -> Result<()> {
        let _cx = self.enter(dev)?;
        self.counters.count(Call::MemFree);
        // SAFETY: device memory is not host memory; the driver validates the
        // address and fails on one it did not hand out.
        check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr.0) })
    }

    fn reserve_va(&self, dev: usize, bytes: u64) -> Result<DevicePtr> {
        let d = self.enter(dev)?;
        Self::require_vmm(dev, &d)?;
        let mut p: sys::CUdeviceptr = 0;
        self.counters.count(Call::AddressReserve);
        // SAFETY: `p` is a valid out-pointer; no fixed address is requested.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut p, bytes as usize, d.info.granularity as usize, 0, 0)
        })?;
        Ok(DevicePtr(p))
    }

    fn free_va(&self, dev: usize, base: DevicePtr, bytes: u64) -> Result<()> {
        let _cx = self.enter(dev)?;
        self.counters.count(Call::AddressFree);
        // SAFETY: only device address space is released; the driver
        // validates the range.
        check("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(base.0, bytes as usize)
        })
    }

    fn map(
        &self,
        dev: usize,
        va: DevicePtr,
        bytes: u64,
        chunk: ChunkHandle,
        chunk_offset: u64,
    ) -> Result<()> {
        let d = self.enter(dev)?;
        Self::require_vmm(dev, &d)?;
        self.counters.count(Call::Map);
        // SAFETY: maps device memory into device address space; the driver
        // validates the range, handle and offset.
        let r = unsafe { sys::cuMemMap(va.0, bytes as usize, chunk_offset as usize, chunk.0, 0) };
        check_mem("cuMemMap", r, || self.oom(dev, &d, bytes))?;
        let desc = rw_access(d.cu);
        // One chunk mapped, and its access granted.
        self.counters.count_units(Call::SetAccess, 1, 1);
        // SAFETY: `desc` is one initialised descriptor, and count 1 is passed.
        let r = unsafe { sys::cuMemSetAccess(va.0, bytes as usize, &desc, 1) };
        if let Err(e) = check_mem("cuMemSetAccess", r, || self.oom(dev, &d, bytes)) {
            // Leave nothing half done: a mapping without access is useless.
            self.counters.count(Call::Unmap);
            // SAFETY: the range was mapped just above.
            let _ = unsafe { sys::cuMemUnmap(va.0, bytes as usize) };
            return Err(e);
        }
        Ok(())
    }

    fn map_run(&self, dev: usize, va: DevicePtr, gran: u64, chunks: &[ChunkHandle]) -> Result<()> {
        let d = self.enter(dev)?;
        Self::require_vmm(dev, &d)?;
        // The first `n` chunks of the run were mapped by this call.
        let undo = |n: usize| {
            let _ = self.unmap_run(dev, va, gran, n as u64);
        };
        for (i, c) in chunks.iter().enumerate() {
            self.counters.count(Call::Map);
            // SAFETY: maps device memory into device address space; the
            // driver validates the range, handle and offset.
            let r = unsafe { sys::cuMemMap(va.0 + i as u64 * gran, gran as usize, 0, c.0, 0) };
            if let Err(e) = check_mem("cuMemMap", r, || self.oom(dev, &d, gran)) {
                undo(i);
                return Err(e);
            }
        }
        let desc = rw_access(d.cu);
        let bytes = chunks.len() * gran as usize;
        self.counters
            .count_units(Call::SetAccess, 1, chunks.len() as u64);
        // SAFETY: `desc` is one initialised descriptor, and count 1 is
        // passed; the range is fully mapped just above.
        let r = unsafe { sys::cuMemSetAccess(va.0, bytes, &desc, 1) };
        if let Err(e) = check_mem("cuMemSetAccess", r, || self.oom(dev, &d, bytes as u64)) {
            undo(chunks.len());
            return Err(e);
        }
        Ok(())
    }

    fn unmap(&self, dev: usize, va: DevicePtr, bytes: u64) -> Result<()> {
        let _cx = self.enter(dev)?;
        self.counters.count(Call::Unmap);
        // SAFETY: only device address space is affected; the driver
        // validates the range.
        check("cuMemUnmap", unsafe {
            sys::cuMemUnmap(va.0, bytes as usize)
        })
    }

    fn set_access(&self, dev: usize, va: DevicePtr, bytes: u64, peers: &[usize]) -> Result<()> {
        let d = self.enter(dev)?;
        let mut descs = vec![rw_access(d.cu)];
        for &peer in peers {
            let cu = self.peer_cu(peer)?;
            if descs.iter().all(|x| x.location.id != cu) {
                descs.push(rw_access(cu));
            }
        }
        // The pool maps one chunk per granule: the range covers this many.
        let chunks = bytes.div_ceil(d.info.granularity.max(1));
        self.counters.count_units(Call::SetAccess, 1, chunks);
        // SAFETY: `descs` holds `descs.len()` initialised descriptors and
        // lives across the call. One call covers the whole range, however
        // many mappings it spans (the driver requires them all mapped).
        let r = unsafe { sys::cuMemSetAccess(va.0, bytes as usize, descs.as_ptr(), descs.len()) };
        check_mem("cuMemSetAccess", r, || self.oom(dev, &d, bytes))
    }

    fn create_stream(&self, dev: usize) -> Result<StreamHandle> {
        let _cx = self.enter(dev)?;
        let mut s: sys::CUstream = ptr::null_mut();
        self.counters.count(Call::StreamCreate);
        // SAFETY: `s` is a valid out-pointer.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(
                &mut s,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint,
            )
        })?;
        Ok(StreamHandle(s as usize as u64))
    }

    fn destroy_stream(&self, dev: usize, stream: StreamHandle) -> Result<()> {
        let _cx = self.enter(dev)?;
        if stream.0 == 0 {
            return Err(Error::InvalidHandle(
                "the default stream cannot be destroyed".into(),
            ));
        }
        self.counters.count(Call::StreamDestroy);
        // SAFETY: the handle is non-null and the driver validates it.
        check("cuStreamDestroy", unsafe {
            sys::cuStreamDestroy_v2(stream_of(stream))
        })
    }

    fn create_event(&self, dev: usize) -> Result<EventHandle> {
        let _cx = self.enter(dev)?;
        let mut e: sys::CUevent = ptr::null_mut();
        self.counters.count(Call::EventCreate);
        // SAFETY: `e` is a valid out-pointer.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(
                &mut e,
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint,
            )
        })?;
        Ok(EventHandle(e as usize as u64))
    }

    fn destroy_event(&self, dev: usize, event: EventHandle) -> Result<()> {
        let _cx = self.enter(dev)?;
        let e = event_of(event)?;
        self.counters.count(Call::EventDestroy);
        // SAFETY: the handle is non-null and the driver validates it.
        check("cuEventDestroy", unsafe { sys::cuEventDestroy_v2(e) })
    }

    fn record_event(&self, dev: usize, event: EventHandle, stream: StreamHandle) -> Result<()> {
        let _cx = self.enter(dev)?;
        let e = event_of(event)?;
        self.counters.count(Call::EventRecord);
        // SAFETY: opaque handles, validated by the driver.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(e, stream_of(stream))
        })
    }

    fn query_event(&self, dev: usize, event: EventHandle) -> Result<bool> {
        let _cx = self.enter(dev)?;
        let e = event_of(event)?;
        self.counters.count(Call::EventQuery);
        // SAFETY: an opaque handle, validated by the driver.
        let r = unsafe { sys::cuEventQuery(e) };
        match r {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => Err(Error::backend("cuEventQuery", error_name(other))),
        }
    }

    fn sync_event(&self, dev: usize, event: EventHandle) -> Result<()> {
        let _cx = self.enter(dev)?;
        let e = event_of(event)?;
        self.counters.count(Call::EventSynchronize);
        self.counters.count_host_sync(dev);
        // SAFETY: an opaque handle, validated by the driver.
        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(e) })
    }

    fn stream_wait_event(
        &self,
        dev: usize,
        stream: StreamHandle,
        event: EventHandle,
    ) -> Result<()> {
        let _cx = self.enter(dev)?;
        let e = event_of(event)?;
        self.counters.count(Call::StreamWaitEvent);
        // SAFETY: opaque handles, validated by the driver; flags must be 0.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(stream_of(stream), e, 0)
        })
    }

    fn sync_stream(&self, dev: usize, stream: StreamHandle) -> Result<()> {
        let _cx = self.enter(dev)?;
        self.counters.count(Call::StreamSynchronize);
        self.counters.count_host_sync(dev);
        // SAFETY: an opaque handle (null: the legacy default stream),
        // validated by the driver.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(stream_of(stream))
        })
    }

    /// One launch of the compaction kernel per conflict-free group of
    /// moves (see [`kernel`]), or, where the kernel cannot be loaded, one
    /// `cuMemcpyDtoDAsync` per move (more for a move that overlaps itself),
    /// all in order on `stream`. Either way the batch has in-order `memmove`
    /// semantics and the host never waits on the device, nor on NVRTC: the
    /// first call on a device starts compiling and loading the kernel on a
    /// background thread and uses the copies until it is loaded (see
    /// [`kernel`]).
    fn enqueue_moves(&self, dev: usize, stream: StreamHandle, moves: &[Move]) -> Result<()> {
        let d = self.enter(dev)?;
        move_groups::validate(moves)?;
        if moves.iter().all(move_groups::is_noop) {
            return Ok(());
        }
        let moved = moves.iter().map(|m| m.len).sum();
        self.counters.count_units(Call::LaunchMoves, 1, moved);
        let s = stream_of(stream);
        if let Some(Ok(k)) = d.kernel.get_or_start(dev, d.cu, d.context()?) {
            return k.enqueue(s, moves);
        }
        // A stream runs its work in order, so a move reading what an
        // earlier move wrote sees the new bytes. A move that overlaps itself
        // is split into non-overlapping pieces, since cuMemcpy does not
        // promise memmove.
        for m in moves {
            for (dst, src, len) in split_move(m) {
                // SAFETY: device-to-device copy on an opaque stream; the
                // driver validates both ranges, and no host memory is read
                // or written.
                check("cuMemcpyDtoDAsync", unsafe {
                    sys::cuMemcpyDtoDAsync_v2(dst, src, len as usize, s)
                })?;
            }
        }
        Ok(())
    }

    fn enqueue_fill(
        &self,
        dev: usize,
        stream: StreamHandle,
        ptr: DevicePtr,
        bytes: u64,
        value: u8,
    ) -> Result<()> {
        let _cx = self.enter(dev)?;
        self.counters.count_units(Call::MemsetAsync, 1, bytes);
        // SAFETY: fills device memory only; the driver validates the range
        // and the stream.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(ptr.0, value, bytes as usize, stream_of(stream))
        })
    }

    /// Synchronous with respect to the legacy default stream only: work
    /// enqueued on streams from [`Backend::create_stream`] (non-blocking) is
    /// not waited for, so sync that stream first.
    fn copy_to_host(&self, dev: usize, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
        let _cx = self.enter(dev)?;
        if dst.is_empty() {
            return Ok(());
        }
        self.counters
            .count_units(Call::MemcpyDtoH, 1, dst.len() as u64);
        self.counters.count_host_sync(dev);
        // SAFETY: `dst` is a live, exclusively borrowed host buffer of
        // `dst.len()` bytes, and the copy is synchronous, so the driver is
        // done writing it before the borrow ends.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast::<c_void>(), src.0, dst.len())
        })
    }

    /// Complete on return: the bytes are in device memory before any work
    /// enqueued afterwards, on any stream, can read them.
    ///
    /// `cuMemcpyHtoD` from pageable memory may return once the bytes are
    /// staged, before the DMA lands, and only the legacy default stream is
    /// ordered after it: a kernel enqueued next on one of the pool's
    /// non-blocking streams could read stale bytes. So the copy is enqueued
    /// (`cuMemcpyHtoDAsync`) on a stream of the backend's own, created on
    /// the first copy (a blocking stream, so it still follows earlier work
    /// on the legacy default stream, as `cuMemcpyHtoD` did), and that
    /// stream is synchronized before returning: one host-blocking sync,
    /// counted, which only waits for this copy (and legacy-stream work),
    /// not for the pool's streams.
    fn copy_from_host(&self, dev: usize, dst: DevicePtr, src: &[u8]) -> Result<()> {
        let d = self.enter(dev)?;
        if src.is_empty() {
            return Ok(());
        }
        let mut slot = d.copy_stream.lock();
        if *slot == 0 {
            let mut s: sys::CUstream = ptr::null_mut();
            self.counters.count(Call::StreamCreate);
            // SAFETY: `s` is a valid out-pointer; the device's context is
            // current.
            check("cuStreamCreate", unsafe {
                sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_DEFAULT as c_uint)
            })?;
            *slot = s as usize;
        }
        let s = *slot as sys::CUstream;
        self.counters
            .count_units(Call::MemcpyHtoD, 1, src.len() as u64);
        self.counters.count(Call::StreamSynchronize);
        self.counters.count_host_sync(dev);
        // SAFETY: `src` is a live host buffer of `src.len()` bytes, only
        // read; the driver stages pageable memory before returning, and the
        // stream is synchronized below before the borrow ends either way.
        let r = unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst.0, src.as_ptr().cast::<c_void>(), src.len(), s)
        };
        // Synchronized even after an error: nothing of this call may still
        // read `src` once it returns.
        // SAFETY: the backend's own live stream of this device.
        let sync = unsafe { sys::cuStreamSynchronize(s) };
        check("cuMemcpyHtoDAsync", r)?;
        check("cuStreamSynchronize", sync)
    }

    fn counters(&self) -> BackendCounters {
        self.counters.snapshot()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Opens the CUDA backend as a trait object; [`Error::NoDriver`] where no
/// driver or device exists.
pub fn open() -> Result<std::sync::Arc<dyn crate::backend::Backend>> {
    Ok(std::sync::Arc::new(CudaBackend::new()?))
}

#[cfg(test)]
mod tests {
    use super::*;

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
