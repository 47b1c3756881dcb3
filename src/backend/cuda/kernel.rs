//! The compaction kernel (`kernels/compact.cu`) on CUDA: compiled at run time
//! with NVRTC, loaded once per device, launched by
//! [`Backend::enqueue_moves`](crate::backend::Backend::enqueue_moves).
//!
//! **Contract.** One launch runs its moves concurrently, so no move of a
//! launch may write bytes another move of it reads or writes; a move may
//! overlap itself (the kernel gives it `memmove` semantics). A batch is cut
//! into such launches by
//! [`move_groups::conflict_free_groups`](crate::backend::move_groups::conflict_free_groups),
//! then into launches of at most [`MAX_MOVES_PER_LAUNCH`] moves, all on the
//! caller's stream, whose order serialises them.
//!
//! **Passing the batch.** Each launch takes its moves by value as one kernel
//! parameter (`MoveBatch`, under the 4 KiB parameter limit). The driver
//! copies kernel parameters when `cuLaunchKernel` is called, so the host
//! struct may die at once, and no device buffer is shared between launches
//! or streams: nothing has to outlive the call, and no event or host sync is
//! needed. The cost is a launch per [`MAX_MOVES_PER_LAUNCH`] moves (a few
//! microseconds each), which compaction passes, bounded in blocks per pass,
//! can afford.
//!
//! **NVRTC.** cudarc opens `libnvrtc` at run time (names `libnvrtc.so`,
//! `libnvrtc.so.13`, `libnvrtc.so.12`, … on the loader path, e.g. from
//! PyPI's `nvidia-cuda-nvrtc-cu12`: see `scripts/install-nvrtc.sh`). The
//! PTX a given NVRTC emits needs a driver at least as new; where NVRTC is
//! missing or the driver refuses its PTX, the backend falls back to
//! `cuMemcpyDtoDAsync` copies and logs why once.

use super::check;
use crate::backend::move_groups::{conflict_free_groups, is_noop, is_self_overlapping};
use crate::backend::Move;
use crate::error::{Error, Result};
use crate::ptr::DevicePtr;
use cudarc::driver::sys;
use parking_lot::Mutex;
use std::ffi::{c_int, c_uint, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The kernel's CUDA C source.
pub const SOURCE: &str = include_str!("../../../kernels/compact.cu");

/// The kernel's entry point.
pub const KERNEL_NAME: &CStr = c"gpupool_compact";

/// Moves per launch: what fits, with the count, in 4 KiB of parameters.
pub const MAX_MOVES_PER_LAUNCH: usize = 168;

/// Bytes of an ordinary move one thread block copies as one unit of work.
pub const TILE_BYTES: u64 = 16 << 10;

/// Threads per block.
pub const BLOCK_THREADS: u32 = 256;

/// Blocks per multiprocessor at most; the grid-stride loop does the rest.
const BLOCKS_PER_SM: u64 = 8;

/// Driver symbols the kernel path needs beyond the backend's own; checked
/// when the kernel is loaded, so that a driver lacking one means the
/// fallback, not a panic in cudarc's loader.
const KERNEL_SYMBOLS: &[&str] = &[
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
];

/// The kernel's only parameter; matches `struct MoveBatch` in compact.cu.
#[repr(C)]
struct MoveBatch {
    n: u32,
    reserved: u32,
    moves: [Move; MAX_MOVES_PER_LAUNCH],
}

const _: () = assert!(std::mem::size_of::<Move>() == 24);
const _: () = assert!(std::mem::size_of::<MoveBatch>() <= 4096);

/// Whether the NVRTC library can be opened.
pub fn nvrtc_available() -> bool {
    // SAFETY: this only dlopens (and closes) candidate libnvrtc names; a
    // panic inside cudarc is caught.
    catch_unwind(|| unsafe { cudarc::nvrtc::sys::is_culib_present() }).unwrap_or(false)
}

/// NVRTC's `(major, minor)` version, where the library can be opened.
pub fn nvrtc_version() -> Option<(i32, i32)> {
    if !nvrtc_available() {
        return None;
    }
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: both are valid out-pointers; the library is present, and a
    // missing symbol (cudarc panics) is caught.
    let r = catch_unwind(AssertUnwindSafe(|| unsafe {
        cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor)
    }));
    match r {
        Ok(cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS) => Some((major, minor)),
        _ => None,
    }
}

/// The NVRTC options [`compile_ptx`] uses for `arch` (`sm_90`, `compute_75`).
pub fn compile_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        format!("-DGPUPOOL_MAX_MOVES={MAX_MOVES_PER_LAUNCH}"),
        format!("-DGPUPOOL_TILE_BYTES={TILE_BYTES}ull"),
    ]
}

/// Compiles [`SOURCE`] to PTX for `arch` with NVRTC. Needs no GPU or driver.
///
/// Fails with [`Error::Unsupported`] where NVRTC cannot be loaded, and with
/// [`Error::Backend`] (carrying the compiler's log) where compilation fails.
pub fn compile_ptx(arch: &str) -> Result<String> {
    if !nvrtc_available() {
        return Err(Error::Unsupported(
            "NVRTC (libnvrtc) could not be loaded; see scripts/install-nvrtc.sh".into(),
        ));
    }
    let opts = cudarc::nvrtc::CompileOptions {
        options: compile_options(arch),
        name: Some("compact.cu".into()),
        ..Default::default()
    };
    match catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts)) {
        Ok(Ok(ptx)) => Ok(ptx.to_src()),
        Ok(Err(cudarc::nvrtc::CompileError::CompileError { nvrtc, log, .. })) => {
            Err(Error::backend(
                "nvrtcCompileProgram",
                format!("{nvrtc:?}: {}", log.to_string_lossy()),
            ))
        }
        Ok(Err(e)) => Err(Error::backend("nvrtc", format!("{e:?}"))),
        Err(_) => Err(Error::Unsupported(
            "NVRTC is missing a symbol or failed unexpectedly".into(),
        )),
    }
}

/// PTX compiled so far in this process, by architecture, so that devices of
/// one kind share one compilation.
static PTX_CACHE: Mutex<Vec<(String, Arc<CString>)>> = Mutex::new(Vec::new());

/// PTX for `arch`, compiled on first use.
fn cached_ptx(arch: &str) -> Result<Arc<CString>> {
    if let Some((_, p)) = PTX_CACHE.lock().iter().find(|(a, _)| a == arch) {
        return Ok(p.clone());
    }
    // Compiled outside the lock: a race only compiles twice.
    let ptx = compile_ptx(arch)?;
    let ptx = Arc::new(
        CString::new(ptx).map_err(|_| Error::backend("nvrtcGetPTX", "PTX with a NUL byte"))?,
    );
    PTX_CACHE.lock().push((arch.to_owned(), ptx.clone()));
    Ok(ptx)
}

/// Units of work the kernel makes of `m` (mirrors `units_of` in compact.cu;
/// used only to size the grid).
fn units(m: &Move) -> u64 {
    if is_noop(m) {
        0
    } else if is_self_overlapping(m) {
        1
    } else {
        m.len.div_ceil(TILE_BYTES)
    }
}

/// Logs, once per process, that the kernel path is off and why.
pub(super) fn warn_fallback(dev: usize, why: &Error) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if !WARNED.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            device = dev,
            "compaction kernel unavailable ({why}); moves use cuMemcpyDtoDAsync"
        );
    } else {
        tracing::debug!(device = dev, "compaction kernel unavailable ({why})");
    }
}

/// The kernel loaded into one device's primary context.
///
/// The module is never unloaded by hand: `cuModuleUnload` does not promise
/// to wait for launches in flight, so it stays for the life of the context
/// and goes when the backend's release of the primary context destroys it
/// (where another library retains the primary context too, it stays until
/// that one lets go: one small module per backend instance).
#[derive(Debug)]
pub(super) struct CompactKernel {
    func: sys::CUfunction,
    max_grid: u64,
}

// SAFETY: the function is an opaque driver handle, usable from any thread on
// which its context is current (the driver API is thread safe); Rust never
// dereferences it.
unsafe impl Send for CompactKernel {}
// SAFETY: as above; launching through a shared handle is thread safe.
unsafe impl Sync for CompactKernel {}

fn attribute(cu: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<c_int> {
    let mut v: c_int = 0;
    // SAFETY: `v` is a valid out-pointer; the attribute is an int.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&mut v, attr, cu)
    })?;
    Ok(v)
}

impl CompactKernel {
    /// Compiles (or takes from the cache) and loads the kernel for device
    /// `cu`, whose primary context must be current on this thread.
    pub(super) fn load(cu: sys::CUdevice) -> Result<CompactKernel> {
        let symbols = catch_unwind(|| {
            // SAFETY: the driver library was opened by `CudaBackend::new`;
            // symbols are only looked up here, never called through this
            // pointer type.
            let lib = unsafe { sys::culib() };
            KERNEL_SYMBOLS.iter().find(|name| {
                // SAFETY: as above, a lookup only.
                unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err()
            })
        });
        match symbols {
            Ok(None) => {}
            Ok(Some(name)) => return Err(Error::Unsupported(format!("driver lacks {name}"))),
            Err(_) => return Err(Error::Unsupported("driver library unavailable".into())),
        }
        use sys::CUdevice_attribute as A;
        let major = attribute(cu, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attribute(cu, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let sms = attribute(cu, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as u64;
        // The device's own architecture; else portable PTX the driver can
        // JIT for a device newer than this NVRTC knows.
        let native = format!("sm_{major}{minor}");
        let ptx = match cached_ptx(&native) {
            Err(e) if major * 10 + minor > 75 => cached_ptx("compute_75").map_err(|_| e)?,
            other => other?,
        };
        let mut module: sys::CUmodule = ptr::null_mut();
        // SAFETY: `module` is a valid out-pointer and `ptx` a NUL-terminated
        // PTX image that outlives the call (the driver copies it).
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut module, ptx.as_ptr().cast::<c_void>())
        })?;
        let mut func: sys::CUfunction = ptr::null_mut();
        // SAFETY: `func` is a valid out-pointer, `module` was just loaded and
        // the name is NUL-terminated.
        let r = unsafe { sys::cuModuleGetFunction(&mut func, module, KERNEL_NAME.as_ptr()) };
        if let Err(e) = check("cuModuleGetFunction", r) {
            // SAFETY: the module was loaded above and nothing else uses it.
            unsafe { sys::cuModuleUnload(module) };
            return Err(e);
        }
        Ok(CompactKernel {
            func,
            max_grid: sms * BLOCKS_PER_SM,
        })
    }

    /// Enqueues `moves` on `stream` with in-order (`memmove`) semantics for
    /// the batch as a whole: one launch per conflict-free group of at most
    /// [`MAX_MOVES_PER_LAUNCH`] moves, in order. The device's context must
    /// be current, and the moves validated
    /// ([`move_groups::validate`](crate::backend::move_groups::validate)).
    /// On an error, earlier launches stay enqueued.
    pub(super) fn enqueue(&self, stream: sys::CUstream, moves: &[Move]) -> Result<()> {
        const NONE: Move = Move {
            src: DevicePtr::NULL,
            dst: DevicePtr::NULL,
            len: 0,
        };
        for group in conflict_free_groups(moves) {
            for chunk in group.chunks(MAX_MOVES_PER_LAUNCH) {
                let mut batch = MoveBatch {
                    n: chunk.len() as u32,
                    reserved: 0,
                    moves: [NONE; MAX_MOVES_PER_LAUNCH],
                };
                batch.moves[..chunk.len()].copy_from_slice(chunk);
                let units: u64 = chunk.iter().map(units).sum();
                let grid = units.clamp(1, self.max_grid) as c_uint;
                let mut params = [(&mut batch as *mut MoveBatch).cast::<c_void>()];
                // SAFETY: `func` is a loaded kernel whose one parameter is a
                // `MoveBatch` (same layout as the Rust struct, asserted in
                // both languages); `params` points at it and both live
                // across the call, which copies the parameter before it
                // returns. The device addresses are the caller's, validated
                // by the driver on use; the batch meets the kernel's
                // contract, being one conflict-free group.
                check("cuLaunchKernel", unsafe {
                    sys::cuLaunchKernel(
                        self.func,
                        grid,
                        1,
                        1,
                        BLOCK_THREADS,
                        1,
                        1,
                        0,
                        stream,
                        params.as_mut_ptr(),
                        ptr::null_mut(),
                    )
                })?;
            }
        }
        Ok(())
    }
}
