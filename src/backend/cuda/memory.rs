//! Device memory through the driver's virtual-memory API: physical chunks
//! (`cuMemCreate`), plain segments where VMM is missing (`cuMemAlloc`),
//! virtual address ranges, mappings and access rights.
//!
//! Invariants: a mapping is never left without access (a failed
//! `cuMemSetAccess` unmaps what this call mapped), and out-of-memory from
//! any of these calls is [`Error::DeviceOutOfMemory`] with the device's
//! figures, so the pool trims and retries. Calls that need VMM fail with
//! [`Error::Unsupported`] on a device without it.

use super::driver::{check, check_mem};
use super::{CudaBackend, Device};
use crate::backend::{Backend, Call};
use crate::error::{Error, Result};
use crate::ptr::{ChunkHandle, DevicePtr};
use cudarc::driver::sys;
use std::ffi::{c_int, c_void};
use std::ptr;

fn location(cu: sys::CUdevice) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: cu,
    }
}

pub(super) fn pinned_prop(cu: sys::CUdevice) -> sys::CUmemAllocationProp {
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

impl CudaBackend {
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

/// A device can always access itself; otherwise `cuDeviceCanAccessPeer`.
pub(super) fn can_access_peer(be: &CudaBackend, dev: usize, peer: usize) -> Result<bool> {
    let d = be.enter(dev)?;
    let p = be.peer_cu(peer)?;
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

pub(super) fn create_chunk(be: &CudaBackend, dev: usize, bytes: u64) -> Result<ChunkHandle> {
    let d = be.enter(dev)?;
    let _relaxed = super::streams::RelaxedCapture::enter();
    CudaBackend::require_vmm(dev, &d)?;
    let mut prop = pinned_prop(d.cu);
    // Shareable with other processes (`export_chunk`) where supported.
    if posix_fd_supported(d.cu) {
        prop.requestedHandleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    }
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    be.counters.count_units(Call::MemCreate, 1, bytes);
    // SAFETY: `h` is a valid out-pointer and `prop` a fully initialised
    // property struct that outlives the call.
    let r = unsafe { sys::cuMemCreate(&mut h, bytes as usize, &prop, 0) };
    check_mem("cuMemCreate", r, || be.oom(dev, &d, bytes))?;
    Ok(ChunkHandle(h))
}

pub(super) fn release_chunk(be: &CudaBackend, dev: usize, chunk: ChunkHandle) -> Result<()> {
    let _cx = be.enter(dev)?;
    be.counters.count(Call::MemRelease);
    // SAFETY: the driver validates the handle; releasing memory that is
    // still mapped only drops the handle's reference, no Rust memory is
    // touched.
    check("cuMemRelease", unsafe { sys::cuMemRelease(chunk.0) })
}

pub(super) fn export_chunk(
    be: &CudaBackend,
    dev: usize,
    chunk: ChunkHandle,
) -> Result<(std::os::fd::OwnedFd, u64)> {
    use std::os::fd::FromRawFd;
    let d = be.enter(dev)?;
    if !posix_fd_supported(d.cu) {
        return Err(Error::Unsupported(format!(
            "device {dev} cannot share memory as POSIX file descriptors"
        )));
    }
    let mut fd: c_int = -1;
    be.counters.count(Call::MemExport);
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

pub(super) fn import_chunk(
    be: &CudaBackend,
    dev: usize,
    fd: std::os::fd::BorrowedFd<'_>,
    fd_offset: u64,
) -> Result<ChunkHandle> {
    use std::os::fd::AsRawFd;
    let _cx = be.enter(dev)?;
    if fd_offset != 0 {
        return Err(Error::InvalidArgument(format!(
            "a CUDA shareable handle has no offset ({fd_offset} given)"
        )));
    }
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    be.counters.count(Call::MemImport);
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

pub(super) fn alloc_segment(be: &CudaBackend, dev: usize, bytes: u64) -> Result<DevicePtr> {
    let d = be.enter(dev)?;
    let _relaxed = super::streams::RelaxedCapture::enter();
    let mut p: sys::CUdeviceptr = 0;
    be.counters.count_units(Call::MemAlloc, 1, bytes);
    // SAFETY: `p` is a valid out-pointer.
    let r = unsafe { sys::cuMemAlloc_v2(&mut p, bytes as usize) };
    check_mem("cuMemAlloc", r, || be.oom(dev, &d, bytes))?;
    Ok(DevicePtr(p))
}

pub(super) fn free_segment(be: &CudaBackend, dev: usize, ptr: DevicePtr) -> Result<()> {
    let _cx = be.enter(dev)?;
    be.counters.count(Call::MemFree);
    // SAFETY: device memory is not host memory; the driver validates the
    // address and fails on one it did not hand out.
    check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr.0) })
}

pub(super) fn reserve_va(be: &CudaBackend, dev: usize, bytes: u64) -> Result<DevicePtr> {
    let d = be.enter(dev)?;
    CudaBackend::require_vmm(dev, &d)?;
    let mut p: sys::CUdeviceptr = 0;
    be.counters.count(Call::AddressReserve);
    // SAFETY: `p` is a valid out-pointer; no fixed address is requested.
    check("cuMemAddressReserve", unsafe {
        sys::cuMemAddressReserve(&mut p, bytes as usize, d.info.granularity as usize, 0, 0)
    })?;
    Ok(DevicePtr(p))
}

pub(super) fn free_va(be: &CudaBackend, dev: usize, base: DevicePtr, bytes: u64) -> Result<()> {
    let _cx = be.enter(dev)?;
    be.counters.count(Call::AddressFree);
    // SAFETY: only device address space is released; the driver
    // validates the range.
    check("cuMemAddressFree", unsafe {
        sys::cuMemAddressFree(base.0, bytes as usize)
    })
}

pub(super) fn map(
    be: &CudaBackend,
    dev: usize,
    va: DevicePtr,
    bytes: u64,
    chunk: ChunkHandle,
    chunk_offset: u64,
) -> Result<()> {
    let d = be.enter(dev)?;
    CudaBackend::require_vmm(dev, &d)?;
    let _relaxed = super::streams::RelaxedCapture::enter();
    be.counters.count(Call::Map);
    // SAFETY: maps device memory into device address space; the driver
    // validates the range, handle and offset.
    let r = unsafe { sys::cuMemMap(va.0, bytes as usize, chunk_offset as usize, chunk.0, 0) };
    check_mem("cuMemMap", r, || be.oom(dev, &d, bytes))?;
    let desc = rw_access(d.cu);
    // One chunk mapped, and its access granted.
    be.counters.count_units(Call::SetAccess, 1, 1);
    // SAFETY: `desc` is one initialised descriptor, and count 1 is passed.
    let r = unsafe { sys::cuMemSetAccess(va.0, bytes as usize, &desc, 1) };
    if let Err(e) = check_mem("cuMemSetAccess", r, || be.oom(dev, &d, bytes)) {
        // Leave nothing half done: a mapping without access is useless.
        be.counters.count(Call::Unmap);
        // SAFETY: the range was mapped just above.
        let _ = unsafe { sys::cuMemUnmap(va.0, bytes as usize) };
        return Err(e);
    }
    Ok(())
}

pub(super) fn map_run(
    be: &CudaBackend,
    dev: usize,
    va: DevicePtr,
    gran: u64,
    chunks: &[ChunkHandle],
) -> Result<()> {
    let d = be.enter(dev)?;
    CudaBackend::require_vmm(dev, &d)?;
    let _relaxed = super::streams::RelaxedCapture::enter();
    // The first `n` chunks of the run were mapped by this call.
    let undo = |n: usize| {
        let _ = be.unmap_run(dev, va, gran, n as u64);
    };
    for (i, c) in chunks.iter().enumerate() {
        be.counters.count(Call::Map);
        // SAFETY: maps device memory into device address space; the
        // driver validates the range, handle and offset.
        let r = unsafe { sys::cuMemMap(va.0 + i as u64 * gran, gran as usize, 0, c.0, 0) };
        if let Err(e) = check_mem("cuMemMap", r, || be.oom(dev, &d, gran)) {
            undo(i);
            return Err(e);
        }
    }
    let desc = rw_access(d.cu);
    let bytes = chunks.len() * gran as usize;
    be.counters
        .count_units(Call::SetAccess, 1, chunks.len() as u64);
    // SAFETY: `desc` is one initialised descriptor, and count 1 is
    // passed; the range is fully mapped just above.
    let r = unsafe { sys::cuMemSetAccess(va.0, bytes, &desc, 1) };
    if let Err(e) = check_mem("cuMemSetAccess", r, || be.oom(dev, &d, bytes as u64)) {
        undo(chunks.len());
        return Err(e);
    }
    Ok(())
}

pub(super) fn unmap(be: &CudaBackend, dev: usize, va: DevicePtr, bytes: u64) -> Result<()> {
    let _cx = be.enter(dev)?;
    be.counters.count(Call::Unmap);
    // SAFETY: only device address space is affected; the driver
    // validates the range.
    check("cuMemUnmap", unsafe {
        sys::cuMemUnmap(va.0, bytes as usize)
    })
}

pub(super) fn set_access(
    be: &CudaBackend,
    dev: usize,
    va: DevicePtr,
    bytes: u64,
    peers: &[usize],
) -> Result<()> {
    let d = be.enter(dev)?;
    let mut descs = vec![rw_access(d.cu)];
    for &peer in peers {
        let cu = be.peer_cu(peer)?;
        if descs.iter().all(|x| x.location.id != cu) {
            descs.push(rw_access(cu));
        }
    }
    // The pool maps one chunk per granule: the range covers this many.
    let chunks = bytes.div_ceil(d.info.granularity.max(1));
    be.counters.count_units(Call::SetAccess, 1, chunks);
    // SAFETY: `descs` holds `descs.len()` initialised descriptors and
    // lives across the call. One call covers the whole range, however
    // many mappings it spans (the driver requires them all mapped).
    let r = unsafe { sys::cuMemSetAccess(va.0, bytes as usize, descs.as_ptr(), descs.len()) };
    check_mem("cuMemSetAccess", r, || be.oom(dev, &d, bytes))
}
