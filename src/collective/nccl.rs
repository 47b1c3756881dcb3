//! The all-reduce through NCCL (feature `nccl`), for one process driving
//! every GPU of a CUDA backend.
//!
//! The calls: `ncclCommInitAll` (one communicator per device),
//! `ncclGroupStart`/`ncclGroupEnd` around the per-device `ncclAllReduce`
//! calls (required when one thread drives several devices), and
//! `ncclCommRegister` for pool memory (NCCL 2.19 and later; older
//! libraries lack the symbol and registration is skipped).
//!
//! **Loading.** NCCL's packages (the `nvidia-nccl-cu12`/`-cu13` wheels,
//! Debian's `libnccl2`, conda) install `libnccl.so.2` and no other name at
//! run time, while cudarc's loader only asks for `libnccl.so`,
//! `libnccl.so.13`, `libnccl.so.12`, …, and no environment variable changes
//! that. So this module opens NCCL itself ([`nccl_library_path`]), once per
//! process, and calls it through function pointers: `GPUPOOL_NCCL_LIB` (a
//! file) where set; else `libnccl.so.2`, then `libnccl.so`, on the loader
//! path (which also finds a copy PyTorch already loaded); else
//! `libnccl.so.<major>` in the folders of
//! [`search_dirs`](crate::backend::cuda::libs::search_dirs) (the wheels'
//! `site-packages/nvidia/nccl/lib`, `GPUPOOL_LIB_DIRS`, the CUDA toolkit).
//! The file loaded is logged. Where none loads, [`NcclAllReduce::new`]
//! fails with [`Error::NoDriver`] and no panic.
//!
//! Device `i` of the backend is CUDA ordinal `i` (as `CudaBackend`
//! enumerates them).

use super::{validate, AllReduce, ReduceBuf, ELEM_BYTES};
use crate::backend::cuda::libs::{self, DynLib};
use crate::error::{Error, Result};
use crate::ptr::DevicePtr;
use parking_lot::Mutex;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

/// `ncclComm_t`.
type Comm = *mut c_void;
/// `ncclResult_t` (an int in the C ABI; read as one, never as a Rust enum).
type NcclResult = c_int;
const NCCL_SUCCESS: NcclResult = 0;
/// `ncclUint32` of `ncclDataType_t`.
const NCCL_UINT32: c_int = 3;
/// `ncclSum` of `ncclRedOp_t`.
const NCCL_SUM: c_int = 0;

type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> NcclResult;
type GetErrorStringFn = unsafe extern "C" fn(NcclResult) -> *const c_char;
type CommInitAllFn = unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> NcclResult;
type CommDestroyFn = unsafe extern "C" fn(Comm) -> NcclResult;
type GroupFn = unsafe extern "C" fn() -> NcclResult;
type AllReduceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    Comm,
    *mut c_void,
) -> NcclResult;
type CommRegisterFn =
    unsafe extern "C" fn(Comm, *mut c_void, usize, *mut *mut c_void) -> NcclResult;
type CommDeregisterFn = unsafe extern "C" fn(Comm, *mut c_void) -> NcclResult;

/// The NCCL entry points this module calls, from one loaded library.
#[derive(Debug)]
struct Api {
    path: String,
    version: c_int,
    get_error_string: Option<GetErrorStringFn>,
    comm_init_all: CommInitAllFn,
    comm_destroy: CommDestroyFn,
    group_start: GroupFn,
    group_end: GroupFn,
    all_reduce: AllReduceFn,
    comm_register: Option<CommRegisterFn>,
    comm_deregister: Option<CommDeregisterFn>,
}

/// Resolves `name` in `lib` as a function of type `F`.
///
/// # Safety
///
/// `F` must be the function pointer type of the C function `name`.
unsafe fn func<F: Copy>(lib: &DynLib, name: &CStr) -> Option<F> {
    debug_assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: a non-null symbol address of a function, reinterpreted as
    // the pointer type the caller vouches for (same size, asserted above).
    lib.sym(name)
        .map(|p| unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

impl Api {
    fn from_lib(lib: DynLib, name: &str) -> std::result::Result<Api, String> {
        let need = |what: &str| format!("{name} lacks {what}");
        // SAFETY (each `func` call): the types are those of nccl.h for
        // NCCL 2.x, whose ABI these symbols have kept.
        let get_version: GetVersionFn =
            unsafe { func(&lib, c"ncclGetVersion") }.ok_or_else(|| need("ncclGetVersion"))?;
        let mut version: c_int = 0;
        // SAFETY: `version` is a valid out-pointer.
        let r = unsafe { get_version(&mut version) };
        if r != NCCL_SUCCESS {
            return Err(format!("{name}: ncclGetVersion returned {r}"));
        }
        let path = lib
            .sym(c"ncclGetVersion")
            .and_then(|p| libs::file_of(p.cast_const()))
            .unwrap_or_else(|| name.to_owned());
        Ok(Api {
            path,
            version,
            // SAFETY: see above.
            get_error_string: unsafe { func(&lib, c"ncclGetErrorString") },
            // SAFETY: see above.
            comm_init_all: unsafe { func(&lib, c"ncclCommInitAll") }
                .ok_or_else(|| need("ncclCommInitAll"))?,
            // SAFETY: see above.
            comm_destroy: unsafe { func(&lib, c"ncclCommDestroy") }
                .ok_or_else(|| need("ncclCommDestroy"))?,
            // SAFETY: see above.
            group_start: unsafe { func(&lib, c"ncclGroupStart") }
                .ok_or_else(|| need("ncclGroupStart"))?,
            // SAFETY: see above.
            group_end: unsafe { func(&lib, c"ncclGroupEnd") }
                .ok_or_else(|| need("ncclGroupEnd"))?,
            // SAFETY: see above.
            all_reduce: unsafe { func(&lib, c"ncclAllReduce") }
                .ok_or_else(|| need("ncclAllReduce"))?,
            // SAFETY: see above (NCCL 2.19 and later).
            comm_register: unsafe { func(&lib, c"ncclCommRegister") },
            // SAFETY: see above (NCCL 2.19 and later).
            comm_deregister: unsafe { func(&lib, c"ncclCommDeregister") },
        })
    }

    fn error(&self, call: &'static str, r: NcclResult) -> Error {
        let text = self
            .get_error_string
            // SAFETY: ncclGetErrorString returns a static NUL-terminated
            // string (or NULL) for any code.
            .map(|f| unsafe { f(r) })
            .filter(|p| !p.is_null())
            // SAFETY: non-null and static, see above.
            .map(|p| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
            .unwrap_or_default();
        Error::backend(call, format!("ncclResult {r}: {text}"))
    }

    fn check(&self, call: &'static str, r: NcclResult) -> Result<()> {
        if r == NCCL_SUCCESS {
            Ok(())
        } else {
            Err(self.error(call, r))
        }
    }
}

/// The names tried on the loader path, in order.
const NCCL_NAMES: &[&str] = &["libnccl.so.2", "libnccl.so"];

static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();

fn load_api() -> std::result::Result<Api, String> {
    let mut tried: Vec<String> = Vec::new();
    let mut candidates: Vec<String> = Vec::new();
    if let Some(file) = std::env::var_os("GPUPOOL_NCCL_LIB") {
        candidates.push(file.to_string_lossy().into_owned());
    } else {
        candidates.extend(NCCL_NAMES.iter().map(|s| s.to_string()));
        candidates.extend(
            libs::find_versioned(&libs::search_dirs(), "libnccl", &[])
                .into_iter()
                .map(|p| p.display().to_string()),
        );
    }
    for name in &candidates {
        match DynLib::open(name).and_then(|lib| Api::from_lib(lib, name)) {
            Ok(api) => {
                tracing::info!(
                    library = %api.path,
                    version = api.version,
                    "NCCL loaded"
                );
                return Ok(api);
            }
            Err(e) => tried.push(e),
        }
    }
    Err(format!("libnccl could not be loaded: {}", tried.join("; ")))
}

fn api() -> Result<&'static Api> {
    API.get_or_init(load_api)
        .as_ref()
        .map_err(|e| Error::NoDriver(e.clone()))
}

/// The NCCL library file this process loaded (loading it on first call),
/// with NCCL's version code (`22703` for 2.27.3); [`Error::NoDriver`] with
/// every name and file tried where none loads.
pub fn nccl_library_path() -> Result<(String, i32)> {
    api().map(|a| (a.path.clone(), a.version))
}

/// One NCCL communicator per device, created together.
#[derive(Debug)]
pub struct NcclAllReduce {
    api: &'static Api,
    /// `comms[i]` is the communicator of `devices[i]` (rank `i`).
    comms: Vec<Comm>,
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

// SAFETY: `Api` holds function pointers into a library that is never
// unloaded, and strings; calling NCCL from any thread is allowed.
unsafe impl Send for Api {}
// SAFETY: as above.
unsafe impl Sync for Api {}

impl NcclAllReduce {
    /// Communicators over `devices` (CUDA ordinals), one rank each.
    pub fn new(devices: &[usize]) -> Result<NcclAllReduce> {
        if devices.is_empty() {
            return Err(Error::InvalidArgument("NCCL over no devices".into()));
        }
        let api = api()?;
        let ordinals: Vec<c_int> = devices.iter().map(|&d| d as c_int).collect();
        let mut comms: Vec<Comm> = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: `comms` has room for `ordinals.len()` communicators and
        // `ordinals` holds that many device ordinals; both outlive the call.
        let r = unsafe {
            (api.comm_init_all)(
                comms.as_mut_ptr(),
                ordinals.len() as c_int,
                ordinals.as_ptr(),
            )
        };
        api.check("ncclCommInitAll", r)?;
        Ok(NcclAllReduce {
            api,
            comms,
            devices: devices.to_vec(),
            registered: Mutex::new(Vec::new()),
        })
    }

    /// The NCCL library file in use.
    pub fn library(&self) -> &str {
        &self.api.path
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
        let api = self.api;
        // SAFETY: no arguments; opens a group closed below on every path.
        api.check("ncclGroupStart", unsafe { (api.group_start)() })?;
        let mut first_err = None;
        for (b, &r) in bufs.iter().zip(&ranks) {
            let p = b.ptr.addr() as usize as *mut c_void;
            // SAFETY: `p` is a live device buffer of `bytes` bytes on the
            // communicator's device (the caller's contract, checked by
            // NCCL), reduced in place; the stream is the raw CUstream of
            // that device, which is NCCL's cudaStream_t.
            let res = unsafe {
                (api.all_reduce)(
                    p,
                    p,
                    count,
                    NCCL_UINT32,
                    NCCL_SUM,
                    self.comms[r],
                    b.stream.raw() as usize as *mut c_void,
                )
            };
            if res != NCCL_SUCCESS {
                first_err.get_or_insert(api.error("ncclAllReduce", res));
            }
        }
        // The group must be closed even after an error.
        // SAFETY: closes the group opened above.
        let end = api.check("ncclGroupEnd", unsafe { (api.group_end)() });
        match first_err {
            Some(e) => Err(e),
            None => end,
        }
    }

    fn register(&self, device: usize, ptr: DevicePtr, bytes: u64) -> Result<bool> {
        let rank = self.rank_of(device)?;
        // Older NCCL lacks the symbol: registration is skipped.
        let Some(register) = self.api.comm_register else {
            return Ok(false);
        };
        let mut handle: *mut c_void = std::ptr::null_mut();
        // SAFETY: the range is device memory of the communicator's device
        // that stays allocated until the registration ends (the trait's
        // contract); `handle` is a valid out-pointer.
        let r = unsafe {
            register(
                self.comms[rank],
                ptr.addr() as usize as *mut c_void,
                bytes as usize,
                &mut handle,
            )
        };
        if r == NCCL_SUCCESS {
            self.registered.lock().push((rank, handle as usize));
            Ok(true)
        } else {
            tracing::debug!(
                device,
                "ncclCommRegister: {}; not registered",
                self.api.error("ncclCommRegister", r)
            );
            Ok(false)
        }
    }

    fn host_syncs(&self) -> u64 {
        0
    }

    fn deregister_all(&self) {
        let taken = std::mem::take(&mut *self.registered.lock());
        let Some(deregister) = self.api.comm_deregister else {
            return;
        };
        for (rank, h) in taken {
            // SAFETY: `h` came from ncclCommRegister on this communicator
            // and is deregistered once (taken out of the list).
            let _ = unsafe { deregister(self.comms[rank], h as *mut c_void) };
        }
    }
}

impl Drop for NcclAllReduce {
    fn drop(&mut self) {
        self.deregister_all();
        for &c in &self.comms {
            // SAFETY: each communicator was created by ncclCommInitAll and
            // is destroyed once; NCCL waits for its operations in flight.
            let _ = unsafe { (self.api.comm_destroy)(c) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without NCCL the collective is a typed error naming what was tried,
    /// never a panic; with it, the library file is named.
    #[test]
    fn loading_nccl_is_an_error_or_names_the_file() {
        match nccl_library_path() {
            Ok((path, version)) => {
                assert!(path.contains("libnccl"), "{path}");
                assert!(version > 0);
            }
            Err(Error::NoDriver(msg)) => {
                assert!(msg.contains("libnccl.so.2"), "{msg}");
                assert!(matches!(NcclAllReduce::new(&[0]), Err(Error::NoDriver(_))));
            }
            Err(e) => panic!("unexpected error {e:?}"),
        }
        assert!(matches!(
            NcclAllReduce::new(&[]),
            Err(Error::InvalidArgument(_))
        ));
    }
}
