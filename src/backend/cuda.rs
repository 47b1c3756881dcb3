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
//! thread first.

mod baseline;
pub mod kernel;

use super::move_groups::{self, split_move};
use super::{Backend, BackendCounters, Call, CallCounters, DeviceInfo, Move};
use crate::error::{Error, Result};
use crate::ptr::{ChunkHandle, DevicePtr, EventHandle, StreamHandle};
use cudarc::driver::sys;
use std::any::Any;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::OnceLock;

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
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoDAsync_v2",
];

/// A primary context handle, shareable between threads.
#[derive(Debug, Clone, Copy)]
struct Ctx(sys::CUcontext);

// SAFETY: a CUcontext is an opaque driver handle, not memory Rust reads or
// writes. The driver API is thread safe and a context may be made current on
// (and used from) any thread, which is exactly how this module uses it.
unsafe impl Send for Ctx {}
// SAFETY: as above; sharing the handle value only lets threads pass it to
// the (thread-safe) driver.
unsafe impl Sync for Ctx {}

/// One device: its driver ordinal, retained primary context and facts.
#[derive(Debug)]
struct Device {
    cu: sys::CUdevice,
    ctx: Ctx,
    info: DeviceInfo,
    /// The compaction kernel, loaded on first use; `None` where it cannot
    /// be (no NVRTC, PTX the driver refuses): moves then use copies.
    kernel: OnceLock<Option<kernel::CompactKernel>>,
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

/// The driver's name for `r` (`CUDA_ERROR_OUT_OF_MEMORY`), or its Debug form.
fn error_name(r: sys::CUresult) -> String {
    let mut p: *const c_char = ptr::null();
    // SAFETY: `p` is a valid out-pointer; cuGetErrorName writes a pointer to
    // a static NUL-terminated string or leaves it untouched on failure, and
    // the symbol was resolved in `new` before any call reaches here.
    let rc = unsafe { sys::cuGetErrorName(r, &mut p) };
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
            let mut ctx: sys::CUcontext = ptr::null_mut();
            // SAFETY: `ctx` is a valid out-pointer; `cu` is a device handle
            // the driver just gave out.
            check("cuDevicePrimaryCtxRetain", unsafe {
                sys::cuDevicePrimaryCtxRetain(&mut ctx, cu)
            })?;
            let index = this.devices.len();
            this.devices.push(Device {
                cu,
                ctx: Ctx(ctx),
                info: DeviceInfo {
                    index,
                    name: String::new(),
                    total_bytes: 0,
                    pci_bus_id: String::new(),
                    granularity: FALLBACK_GRANULARITY,
                    vmm_supported: false,
                },
                kernel: OnceLock::new(),
            });
            let info = Self::query_info(index, cu)?;
            this.devices[index].info = info;
        }
        Ok(this)
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

    /// Device `dev`, with its primary context made current on this thread.
    fn enter(&self, dev: usize) -> Result<&Device> {
        let d = self.devices.get(dev).ok_or(Error::InvalidDevice {
            device: dev,
            count: self.devices.len(),
        })?;
        // The current context is asked for rather than cached in a
        // thread_local: other code on the thread (a framework, another
        // library) may switch contexts behind our back, and cuCtxGetCurrent
        // is a thread-local read in the driver.
        let mut cur: sys::CUcontext = ptr::null_mut();
        // SAFETY: `cur` is a valid out-pointer.
        check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut cur) })?;
        if cur != d.ctx.0 {
            // SAFETY: `d.ctx` is a primary context retained in `new` and
            // released only in `drop`, so it is live while `self` is.
            check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(d.ctx.0) })?;
        }
        Ok(d)
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

    /// The compaction kernel of `d` (whose context is current), loading it
    /// on first use; `None`, logged once, where it cannot be loaded.
    fn kernel(dev: usize, d: &Device) -> Option<&kernel::CompactKernel> {
        d.kernel
            .get_or_init(|| match kernel::CompactKernel::load(d.cu) {
                Ok(k) => {
                    tracing::debug!(device = dev, "compaction kernel loaded");
                    Some(k)
                }
                Err(e) => {
                    kernel::warn_fallback(dev, &e);
                    None
                }
            })
            .as_ref()
    }

    /// Whether [`Backend::enqueue_moves`] on `dev` runs the compaction
    /// kernel (`true`) or falls back to `cuMemcpyDtoDAsync` copies. Loads
    /// (compiling with NVRTC) the kernel if that was not done yet.
    pub fn move_kernel_ready(&self, dev: usize) -> Result<bool> {
        let d = self.enter(dev)?;
        Ok(Self::kernel(dev, d).is_some())
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
            // SAFETY: each device's primary context was retained exactly once
            // in `new`; this is the matching release. A failure is ignored:
            // nothing useful can be done about it in drop.
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
        Self::require_vmm(dev, d)?;
        let prop = pinned_prop(d.cu);
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        self.counters.count(Call::MemCreate);
        // SAFETY: `h` is a valid out-pointer and `prop` a fully initialised
        // property struct that outlives the call.
        let r = unsafe { sys::cuMemCreate(&mut h, bytes as usize, &prop, 0) };
        if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Err(self.oom(dev, d, bytes));
        }
        check("cuMemCreate", r)?;
        Ok(ChunkHandle(h))
    }

    fn release_chunk(&self, dev: usize, chunk: ChunkHandle) -> Result<()> {
        self.enter(dev)?;
        self.counters.count(Call::MemRelease);
        // SAFETY: the driver validates the handle; releasing memory that is
        // still mapped only drops the handle's reference, no Rust memory is
        // touched.
        check("cuMemRelease", unsafe { sys::cuMemRelease(chunk.0) })
    }

    fn alloc_segment(&self, dev: usize, bytes: u64) -> Result<DevicePtr> {
        let d = self.enter(dev)?;
        let mut p: sys::CUdeviceptr = 0;
        self.counters.count(Call::MemAlloc);
        // SAFETY: `p` is a valid out-pointer.
        let r = unsafe { sys::cuMemAlloc_v2(&mut p, bytes as usize) };
        if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Err(self.oom(dev, d, bytes));
        }
        check("cuMemAlloc", r)?;
        Ok(DevicePtr(p))
    }

    fn free_segment(&self, dev: usize, ptr: DevicePtr) -> Result<()> {
        self.enter(dev)?;
        self.counters.count(Call::MemFree);
        // SAFETY: device memory is not host memory; the driver validates the
        // address and fails on one it did not hand out.
        check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr.0) })
    }

    fn reserve_va(&self, dev: usize, bytes: u64) -> Result<DevicePtr> {
        let d = self.enter(dev)?;
        Self::require_vmm(dev, d)?;
        let mut p: sys::CUdeviceptr = 0;
        self.counters.count(Call::AddressReserve);
        // SAFETY: `p` is a valid out-pointer; no fixed address is requested.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut p, bytes as usize, d.info.granularity as usize, 0, 0)
        })?;
        Ok(DevicePtr(p))
    }

    fn free_va(&self, dev: usize, base: DevicePtr, bytes: u64) -> Result<()> {
        self.enter(dev)?;
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
        Self::require_vmm(dev, d)?;
        self.counters.count(Call::Map);
        // SAFETY: maps device memory into device address space; the driver
        // validates the range, handle and offset.
        check("cuMemMap", unsafe {
            sys::cuMemMap(va.0, bytes as usize, chunk_offset as usize, chunk.0, 0)
        })?;
        let desc = rw_access(d.cu);
        self.counters.count(Call::SetAccess);
        // SAFETY: `desc` is one initialised descriptor, and count 1 is passed.
        let r = unsafe { sys::cuMemSetAccess(va.0, bytes as usize, &desc, 1) };
        if let Err(e) = check("cuMemSetAccess", r) {
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
        Self::require_vmm(dev, d)?;
        // The first `n` chunks of the run were mapped by this call.
        let undo = |n: usize| {
            let _ = self.unmap_run(dev, va, gran, n as u64);
        };
        for (i, c) in chunks.iter().enumerate() {
            self.counters.count(Call::Map);
            // SAFETY: maps device memory into device address space; the
            // driver validates the range, handle and offset.
            let r = unsafe { sys::cuMemMap(va.0 + i as u64 * gran, gran as usize, 0, c.0, 0) };
            if let Err(e) = check("cuMemMap", r) {
                undo(i);
                return Err(e);
            }
        }
        let desc = rw_access(d.cu);
        self.counters.count(Call::SetAccess);
        let bytes = chunks.len() * gran as usize;
        // SAFETY: `desc` is one initialised descriptor, and count 1 is
        // passed; the range is fully mapped just above.
        let r = unsafe { sys::cuMemSetAccess(va.0, bytes, &desc, 1) };
        if let Err(e) = check("cuMemSetAccess", r) {
            undo(chunks.len());
            return Err(e);
        }
        Ok(())
    }

    fn unmap(&self, dev: usize, va: DevicePtr, bytes: u64) -> Result<()> {
        self.enter(dev)?;
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
        self.counters.count(Call::SetAccess);
        // SAFETY: `descs` holds `descs.len()` initialised descriptors and
        // lives across the call.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(va.0, bytes as usize, descs.as_ptr(), descs.len())
        })
    }

    fn create_stream(&self, dev: usize) -> Result<StreamHandle> {
        self.enter(dev)?;
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
        self.enter(dev)?;
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
        self.enter(dev)?;
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
        self.enter(dev)?;
        let e = event_of(event)?;
        self.counters.count(Call::EventDestroy);
        // SAFETY: the handle is non-null and the driver validates it.
        check("cuEventDestroy", unsafe { sys::cuEventDestroy_v2(e) })
    }

    fn record_event(&self, dev: usize, event: EventHandle, stream: StreamHandle) -> Result<()> {
        self.enter(dev)?;
        let e = event_of(event)?;
        self.counters.count(Call::EventRecord);
        // SAFETY: opaque handles, validated by the driver.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(e, stream_of(stream))
        })
    }

    fn query_event(&self, dev: usize, event: EventHandle) -> Result<bool> {
        self.enter(dev)?;
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
        self.enter(dev)?;
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
        self.enter(dev)?;
        let e = event_of(event)?;
        self.counters.count(Call::StreamWaitEvent);
        // SAFETY: opaque handles, validated by the driver; flags must be 0.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(stream_of(stream), e, 0)
        })
    }

    fn sync_stream(&self, dev: usize, stream: StreamHandle) -> Result<()> {
        self.enter(dev)?;
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
    /// semantics and the host never waits on the device (the first call on
    /// a device compiles the kernel with NVRTC, host work of well under a
    /// second).
    fn enqueue_moves(&self, dev: usize, stream: StreamHandle, moves: &[Move]) -> Result<()> {
        let d = self.enter(dev)?;
        move_groups::validate(moves)?;
        if moves.iter().all(move_groups::is_noop) {
            return Ok(());
        }
        self.counters.count(Call::LaunchMoves);
        let s = stream_of(stream);
        if let Some(k) = Self::kernel(dev, d) {
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
        self.enter(dev)?;
        self.counters.count(Call::MemsetAsync);
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
        self.enter(dev)?;
        if dst.is_empty() {
            return Ok(());
        }
        self.counters.count(Call::MemcpyDtoH);
        self.counters.count_host_sync(dev);
        // SAFETY: `dst` is a live, exclusively borrowed host buffer of
        // `dst.len()` bytes, and the copy is synchronous, so the driver is
        // done writing it before the borrow ends.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast::<c_void>(), src.0, dst.len())
        })
    }

    /// Synchronous; see [`CudaBackend::copy_to_host`] for ordering with
    /// non-blocking streams.
    fn copy_from_host(&self, dev: usize, dst: DevicePtr, src: &[u8]) -> Result<()> {
        self.enter(dev)?;
        if src.is_empty() {
            return Ok(());
        }
        self.counters.count(Call::MemcpyHtoD);
        self.counters.count_host_sync(dev);
        // SAFETY: `src` is a live host buffer of `src.len()` bytes, only
        // read, and the driver has consumed it when the synchronous call
        // returns.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(dst.0, src.as_ptr().cast::<c_void>(), src.len())
        })
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
