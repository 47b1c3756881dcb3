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
//! **NVRTC.** The source is compiled at run time by NVRTC, once per
//! architecture per process, for the device's own architecture
//! (`sm_XY` from its compute capability). One compilation yields both a
//! cubin (machine code for that architecture) and PTX. The cubin is loaded
//! first: it needs no JIT, so it loads on any driver that supports the
//! device, even where NVRTC is newer than the driver (whose JIT would
//! refuse that NVRTC's PTX with `CUDA_ERROR_UNSUPPORTED_PTX_VERSION`). The
//! PTX is the fallback when the driver refuses to *load* the cubin; where
//! NVRTC does not know the device's architecture at all, portable
//! `compute_75` PTX is compiled instead. Where nothing loads, the backend
//! falls back to `cuMemcpyDtoDAsync` copies and logs why once.
//!
//! **When.** Compiling takes a fraction of a second of host time, so it
//! never happens inside a backend call that a pool may make under one of
//! its locks: the first [`enqueue_moves`](crate::backend::Backend::enqueue_moves)
//! on a device starts the compile and load on a background thread and
//! itself uses the copies; later calls use the kernel once it is loaded.
//! `CudaBackend::move_kernel_ready` waits for it (for tests and benchmarks),
//! and dropping the backend joins the thread before the device's context
//! goes.
//!
//! **Finding NVRTC.** cudarc opens `libnvrtc` by bare names on the loader
//! path; [`nvrtc_available`] also looks where Python wheels and the CUDA
//! toolkit put it (see [`super::libs`]) and logs the file it loaded.

use super::{check, libs};
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
use std::sync::{Arc, OnceLock};

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

/// Where NVRTC was loaded from (`Ok(path)`), or why it could not be.
static NVRTC: OnceLock<std::result::Result<String, String>> = OnceLock::new();

/// NVRTC majors whose soname (`libnvrtc.so.<major>`) cudarc asks for.
const NVRTC_MAJORS: &[u32] = &[13, 12, 11];

/// Finds and opens NVRTC once per process: `GPUPOOL_NVRTC_LIB` (a file)
/// where set, else cudarc's names on the loader path, else the newest
/// `libnvrtc.so.<major>` in [`libs::search_dirs`] (Python wheels, the CUDA
/// toolkit). A library found by path is opened and kept open, so that
/// cudarc's later open by soname gets it. Logs the file loaded.
fn nvrtc_library() -> &'static std::result::Result<String, String> {
    NVRTC.get_or_init(|| {
        // SAFETY: only dlopens (and closes) candidate names; a panic inside
        // cudarc is caught.
        let on_path =
            || catch_unwind(|| unsafe { cudarc::nvrtc::sys::is_culib_present() }).unwrap_or(false);
        let mut tried: Vec<String> = Vec::new();
        if let Some(file) = std::env::var_os("GPUPOOL_NVRTC_LIB") {
            let file = file.to_string_lossy().into_owned();
            libs::DynLib::open(&file).map_err(|e| format!("GPUPOOL_NVRTC_LIB={file}: {e}"))?;
        } else if !on_path() {
            let dirs = libs::search_dirs();
            for cand in libs::find_versioned(&dirs, "libnvrtc", NVRTC_MAJORS) {
                let cand = cand.display().to_string();
                match libs::DynLib::open(&cand) {
                    Ok(_) => break,
                    Err(e) => tried.push(e),
                }
            }
            if !on_path() {
                return Err(format!(
                    "libnvrtc not found on the loader path nor in {} folder(s) searched \
                     (Python wheels' nvidia/*/lib, GPUPOOL_LIB_DIRS, the CUDA toolkit){}{}; \
                     see scripts/install-nvrtc.sh",
                    dirs.len(),
                    if tried.is_empty() { "" } else { ": " },
                    tried.join("; ")
                ));
            }
        }
        // Which file cudarc ended up with: the one holding its symbol.
        let path = catch_unwind(|| {
            // SAFETY: the library is present (checked above); culib() opens
            // it once for the process, and the symbol is only looked up.
            let lib = unsafe { cudarc::nvrtc::sys::culib() };
            // SAFETY: a lookup only; the pointer is never called here.
            let sym = unsafe { lib.get::<unsafe extern "C" fn()>(b"nvrtcVersion") };
            sym.ok().and_then(|f| libs::file_of(*f as *const c_void))
        })
        .map_err(|_| "libnvrtc could not be opened by cudarc".to_string())?
        .unwrap_or_else(|| "(unknown file)".into());
        let version = nvrtc_version_raw();
        tracing::info!(library = %path, version = ?version, "NVRTC loaded");
        Ok(path)
    })
}

/// Whether the NVRTC library can be opened (searching as
/// [`nvrtc_library_path`] says).
pub fn nvrtc_available() -> bool {
    nvrtc_library().is_ok()
}

/// The file NVRTC was loaded from, or why it could not be: looked for once
/// per process, in `GPUPOOL_NVRTC_LIB`, on the loader path, then in the
/// folders of `backend::cuda::libs::search_dirs` (Python wheels'
/// `site-packages/nvidia/*/lib`, `GPUPOOL_LIB_DIRS`, the CUDA toolkit).
pub fn nvrtc_library_path() -> std::result::Result<String, String> {
    nvrtc_library().clone()
}

fn nvrtc_version_raw() -> Option<(i32, i32)> {
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: both are valid out-pointers; a missing library or symbol
    // (cudarc panics) is caught.
    let r = catch_unwind(AssertUnwindSafe(|| unsafe {
        cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor)
    }));
    match r {
        Ok(cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS) => Some((major, minor)),
        _ => None,
    }
}

/// NVRTC's `(major, minor)` version, where the library can be opened.
pub fn nvrtc_version() -> Option<(i32, i32)> {
    if !nvrtc_available() {
        return None;
    }
    nvrtc_version_raw()
}

/// The NVRTC options [`compile`] uses for `arch` (`sm_90`, `compute_75`).
pub fn compile_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        format!("-DGPUPOOL_MAX_MOVES={MAX_MOVES_PER_LAUNCH}"),
        format!("-DGPUPOOL_TILE_BYTES={TILE_BYTES}ull"),
    ]
}

/// Which compiled image of the kernel a module was loaded from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ImageKind {
    /// Machine code for one architecture (`nvrtcGetCUBIN`): no JIT.
    Cubin,
    /// PTX (`nvrtcGetPTX`), compiled by the driver's JIT at load.
    Ptx,
}

/// What one NVRTC compilation of [`SOURCE`] produced.
#[derive(Debug, Clone)]
pub struct KernelImages {
    /// The architecture compiled for (`sm_90`, `compute_75`).
    pub arch: String,
    /// The cubin, for a real architecture (`sm_XY`); `None` for a virtual
    /// one (`compute_XY`).
    pub cubin: Option<Vec<u8>>,
    /// The PTX, always.
    pub ptx: CString,
}

/// Destroys an NVRTC program when dropped (on every path, without the
/// panicking `unwrap` of cudarc's own wrapper).
struct Program(cudarc::nvrtc::sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by nvrtcCreateProgram and is
        // destroyed once, here.
        let _ = unsafe { cudarc::nvrtc::result::destroy_program(self.0) };
    }
}

fn nvrtc_err(call: &'static str, e: cudarc::nvrtc::result::NvrtcError) -> Error {
    Error::backend(call, format!("{:?}", e.0))
}

/// Bytes NVRTC returned as C chars, up to the first NUL.
fn chars_to_bytes(v: &[std::ffi::c_char]) -> Vec<u8> {
    v.iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect()
}

fn compile_unguarded(arch: &str) -> Result<KernelImages> {
    use cudarc::nvrtc::{result, sys as nv};
    let src = CString::new(SOURCE).map_err(|_| Error::backend("nvrtc", "NUL in the source"))?;
    let prog = Program(
        result::create_program(&src, Some(c"compact.cu"))
            .map_err(|e| nvrtc_err("nvrtcCreateProgram", e))?,
    );
    let opts = compile_options(arch);
    // SAFETY: `prog` is live (destroyed by the guard after the last use);
    // no option contains a NUL byte, so cudarc's conversion cannot panic.
    if let Err(e) = unsafe { result::compile_program(prog.0, &opts) } {
        // SAFETY: as above.
        let log = unsafe { result::get_program_log(prog.0) }
            .map(|l| String::from_utf8_lossy(&chars_to_bytes(&l)).into_owned())
            .unwrap_or_default();
        return Err(Error::backend(
            "nvrtcCompileProgram",
            format!("{arch}: {:?}: {log}", e.0),
        ));
    }
    // SAFETY: `prog` compiled successfully and is live.
    let ptx = unsafe { result::get_ptx(prog.0) }.map_err(|e| nvrtc_err("nvrtcGetPTX", e))?;
    let ptx = CString::new(chars_to_bytes(&ptx)).expect("bytes up to the first NUL");
    let cubin = if arch.starts_with("sm_") {
        let mut size: usize = 0;
        // SAFETY: `size` is a valid out-pointer; `prog` is live.
        let r = unsafe { nv::nvrtcGetCUBINSize(prog.0, &mut size) };
        if r != nv::nvrtcResult::NVRTC_SUCCESS || size == 0 {
            return Err(Error::backend(
                "nvrtcGetCUBINSize",
                format!("{arch}: {r:?}"),
            ));
        }
        let mut buf = vec![0u8; size];
        // SAFETY: `buf` has the `size` bytes NVRTC asked for.
        let r = unsafe { nv::nvrtcGetCUBIN(prog.0, buf.as_mut_ptr().cast()) };
        if r != nv::nvrtcResult::NVRTC_SUCCESS {
            return Err(Error::backend("nvrtcGetCUBIN", format!("{arch}: {r:?}")));
        }
        Some(buf)
    } else {
        None
    };
    Ok(KernelImages {
        arch: arch.to_owned(),
        cubin,
        ptx,
    })
}

/// Compiles [`SOURCE`] with NVRTC for `arch`: a cubin and PTX for a real
/// architecture (`sm_90`), PTX only for a virtual one (`compute_75`).
/// Needs no GPU or driver.
///
/// Fails with [`Error::Unsupported`] where NVRTC cannot be loaded, and with
/// [`Error::Backend`] (carrying the compiler's log) where compilation fails.
pub fn compile(arch: &str) -> Result<KernelImages> {
    if let Err(why) = nvrtc_library() {
        return Err(Error::Unsupported(format!("NVRTC: {why}")));
    }
    catch_unwind(|| compile_unguarded(arch)).unwrap_or_else(|_| {
        Err(Error::Unsupported(
            "NVRTC is missing a symbol or failed unexpectedly".into(),
        ))
    })
}

/// Compiles [`SOURCE`] to PTX for `arch` with NVRTC (see [`compile`]).
pub fn compile_ptx(arch: &str) -> Result<String> {
    Ok(compile(arch)?.ptx.to_string_lossy().into_owned())
}

/// The images for a device of compute capability `major.minor`: its own
/// architecture (`sm_XY`), or portable `compute_75` PTX where this NVRTC
/// does not know that architecture.
fn compile_for(major: i32, minor: i32) -> Result<KernelImages> {
    match compile(&format!("sm_{major}{minor}")) {
        Err(e) if major * 10 + minor > 75 && !matches!(e, Error::Unsupported(_)) => {
            compile("compute_75").map_err(|_| e)
        }
        other => other,
    }
}

type ImageSlot = Arc<OnceLock<Result<Arc<KernelImages>>>>;

/// Images compiled so far in this process, by compute capability, so that
/// devices of one kind share one compilation.
static IMAGES: Mutex<Vec<(i32, ImageSlot)>> = Mutex::new(Vec::new());

/// The images for compute capability `major.minor`, compiled on first use
/// (the cache's lock is not held while compiling; a second caller for the
/// same capability waits for the first's result).
pub(super) fn images_for(major: i32, minor: i32) -> Result<Arc<KernelImages>> {
    let key = major * 10 + minor;
    let slot = {
        let mut cache = IMAGES.lock();
        match cache.iter().find(|(k, _)| *k == key) {
            Some((_, s)) => s.clone(),
            None => {
                let s = ImageSlot::default();
                cache.push((key, s.clone()));
                s
            }
        }
    };
    slot.get_or_init(|| compile_for(major, minor).map(Arc::new))
        .clone()
}

/// Loads the first image that loads: the cubin (where there is one), then,
/// on a load error, the PTX. `Ok((module, kind, cubin_error))`, where
/// `cubin_error` says why the cubin was refused; `Err` names both failures.
/// `only` restricts the choice to one kind.
pub(crate) fn load_with_fallback<M>(
    images: &KernelImages,
    only: Option<ImageKind>,
    mut load: impl FnMut(ImageKind, &[u8]) -> Result<M>,
) -> Result<(M, ImageKind, Option<Error>)> {
    let mut cubin_err = None;
    if only != Some(ImageKind::Ptx) {
        match &images.cubin {
            Some(cubin) => match load(ImageKind::Cubin, cubin) {
                Ok(m) => return Ok((m, ImageKind::Cubin, None)),
                Err(e) => cubin_err = Some(e),
            },
            None if only == Some(ImageKind::Cubin) => {
                return Err(Error::Unsupported(format!(
                    "no cubin for {} (a virtual architecture)",
                    images.arch
                )))
            }
            None => {}
        }
    }
    if only == Some(ImageKind::Cubin) {
        return Err(cubin_err.expect("set above"));
    }
    match load(ImageKind::Ptx, images.ptx.as_bytes_with_nul()) {
        Ok(m) => Ok((m, ImageKind::Ptx, cubin_err)),
        Err(e) => Err(match cubin_err {
            Some(c) => Error::backend(
                "cuModuleLoadData",
                format!(
                    "{}: cubin refused ({c}), then PTX refused ({e})",
                    images.arch
                ),
            ),
            None => e,
        }),
    }
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

/// How a device's kernel was loaded, for logs and reports.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct KernelInfo {
    /// The architecture NVRTC compiled for (`sm_90`, `compute_75`).
    pub arch: String,
    /// The image the driver accepted.
    pub image: ImageKind,
    /// Why the cubin was refused, where the PTX fallback was used.
    pub cubin_error: Option<String>,
    /// NVRTC's version.
    pub nvrtc_version: Option<(i32, i32)>,
    /// The NVRTC library file.
    pub nvrtc_library: Option<String>,
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
    pub(super) info: KernelInfo,
}

// SAFETY: the function is an opaque driver handle, usable from any thread on
// which its context is current (the driver API is thread safe); Rust never
// dereferences it.
unsafe impl Send for CompactKernel {}
// SAFETY: as above; launching through a shared handle is thread safe.
unsafe impl Sync for CompactKernel {}

pub(super) fn attribute(cu: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<c_int> {
    let mut v: c_int = 0;
    // SAFETY: `v` is a valid out-pointer; the attribute is an int.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&mut v, attr, cu)
    })?;
    Ok(v)
}

/// Loads one image into the current context and finds the kernel in it.
fn load_module(image: &[u8]) -> Result<sys::CUfunction> {
    let mut module: sys::CUmodule = ptr::null_mut();
    // SAFETY: `module` is a valid out-pointer and `image` a cubin or a
    // NUL-terminated PTX text that outlives the call (the driver copies or
    // compiles it before returning).
    check("cuModuleLoadData", unsafe {
        sys::cuModuleLoadData(&mut module, image.as_ptr().cast::<c_void>())
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
    Ok(func)
}

impl CompactKernel {
    /// Compiles (or takes from the process's cache) and loads the kernel
    /// for device `cu`, whose context must be current on this thread: the
    /// cubin, or the PTX where the driver refuses the cubin (`only` forces
    /// one of them).
    pub(super) fn load(cu: sys::CUdevice, only: Option<ImageKind>) -> Result<CompactKernel> {
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
        let images = images_for(major, minor)?;
        let (func, image, cubin_err) =
            load_with_fallback(&images, only, |_, bytes| load_module(bytes))?;
        Ok(CompactKernel {
            func,
            max_grid: sms * BLOCKS_PER_SM,
            info: KernelInfo {
                arch: images.arch.clone(),
                image,
                cubin_error: cubin_err.map(|e| e.to_string()),
                nvrtc_version: nvrtc_version(),
                nvrtc_library: nvrtc_library().clone().ok(),
            },
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

/// A device's compaction kernel, loaded once: on a background thread that
/// the first need starts ([`KernelSlot::get_or_start`], which never waits),
/// or at once by a caller that may wait ([`KernelSlot::load_now`]).
#[derive(Debug, Default)]
pub(super) struct KernelSlot {
    state: OnceLock<Result<CompactKernel>>,
    started: AtomicBool,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl KernelSlot {
    /// The load's outcome where it is done; `None` while it runs. Starts
    /// it, once, on a background thread: this never waits on NVRTC or the
    /// driver's JIT, so it may be called under any lock.
    pub(super) fn get_or_start(
        self: &Arc<Self>,
        dev: usize,
        cu: sys::CUdevice,
        ctx: super::Ctx,
    ) -> Option<&Result<CompactKernel>> {
        if let Some(s) = self.state.get() {
            return Some(s);
        }
        if !self.started.swap(true, Ordering::AcqRel) {
            let me = Arc::clone(self);
            let spawned = std::thread::Builder::new()
                .name(format!("gpupool-kernel-{dev}"))
                .spawn(move || {
                    me.load_now(dev, cu, ctx);
                });
            match spawned {
                Ok(h) => *self.thread.lock() = Some(h),
                Err(e) => {
                    let _ = self.state.set(Err(Error::Unsupported(format!(
                        "could not start the kernel's load thread: {e}"
                    ))));
                }
            }
        }
        self.state.get()
    }

    /// Compiles (or takes from the cache) and loads the kernel, waiting
    /// for a load already running; logs the outcome once. Makes `ctx`
    /// current for the load and restores the caller's context after.
    pub(super) fn load_now(
        &self,
        dev: usize,
        cu: sys::CUdevice,
        ctx: super::Ctx,
    ) -> &Result<CompactKernel> {
        self.state.get_or_init(|| {
            let r = catch_unwind(AssertUnwindSafe(|| {
                let _cx = super::ctx::CtxGuard::enter(&super::ctx::Driver, ctx)?;
                CompactKernel::load(cu, None)
            }))
            .unwrap_or_else(|_| Err(Error::Unsupported("the kernel's load panicked".into())));
            match &r {
                Ok(k) => tracing::info!(
                    device = dev,
                    arch = %k.info.arch,
                    image = ?k.info.image,
                    cubin_error = ?k.info.cubin_error,
                    "compaction kernel loaded"
                ),
                Err(e) => warn_fallback(dev, e),
            }
            r
        })
    }

    /// Waits for the background load, if one was started.
    pub(super) fn join(&self) {
        let h = self.thread.lock().take();
        if let Some(h) = h {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn images(cubin: bool) -> KernelImages {
        KernelImages {
            arch: if cubin { "sm_90" } else { "compute_75" }.into(),
            cubin: cubin.then(|| b"\x7fELF cubin".to_vec()),
            ptx: CString::new(".version 9.0\n.target sm_90\n").unwrap(),
        }
    }

    fn refuse(what: ImageKind) -> impl FnMut(ImageKind, &[u8]) -> Result<Vec<u8>> {
        move |kind, bytes| {
            if kind == what {
                Err(Error::backend(
                    "cuModuleLoadData",
                    format!("{kind:?}: CUDA_ERROR_UNSUPPORTED_PTX_VERSION"),
                ))
            } else {
                Ok(bytes.to_vec())
            }
        }
    }

    #[test]
    fn the_cubin_is_loaded_first() {
        let mut seen = Vec::new();
        let (m, kind, err) = load_with_fallback(&images(true), None, |k, b| {
            seen.push(k);
            Ok(b.to_vec())
        })
        .unwrap();
        assert_eq!(kind, ImageKind::Cubin);
        assert_eq!(m, b"\x7fELF cubin");
        assert!(err.is_none());
        assert_eq!(seen, vec![ImageKind::Cubin], "PTX not touched");
    }

    #[test]
    fn a_cubin_the_driver_refuses_falls_back_to_ptx() {
        let (m, kind, err) =
            load_with_fallback(&images(true), None, refuse(ImageKind::Cubin)).unwrap();
        assert_eq!(kind, ImageKind::Ptx);
        assert_eq!(m.last(), Some(&0), "PTX is passed NUL-terminated");
        assert!(m.starts_with(b".version"));
        assert!(err.unwrap().to_string().contains("Cubin"));
    }

    #[test]
    fn a_virtual_architecture_loads_its_ptx() {
        let (_, kind, err) =
            load_with_fallback(&images(false), None, refuse(ImageKind::Cubin)).unwrap();
        assert_eq!(kind, ImageKind::Ptx);
        assert!(err.is_none());
    }

    #[test]
    fn both_refused_is_an_error_naming_both() {
        let e = load_with_fallback(&images(true), None, |k, _| -> Result<()> {
            Err(Error::backend("cuModuleLoadData", format!("{k:?} refused")))
        })
        .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("Cubin refused") && msg.contains("Ptx refused"),
            "{msg}"
        );
    }

    #[test]
    fn one_kind_can_be_forced() {
        let (_, kind, _) =
            load_with_fallback(&images(true), Some(ImageKind::Ptx), |_, b| Ok(b.to_vec())).unwrap();
        assert_eq!(kind, ImageKind::Ptx);
        // Forcing the cubin never falls back.
        assert!(load_with_fallback(
            &images(true),
            Some(ImageKind::Cubin),
            refuse(ImageKind::Cubin)
        )
        .is_err());
        assert!(load_with_fallback(
            &images(false),
            Some(ImageKind::Cubin),
            |_, b| Ok(b.to_vec())
        )
        .is_err());
    }
}
