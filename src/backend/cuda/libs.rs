//! Finding and opening the CUDA-side libraries that are not the driver:
//! NVRTC (`libnvrtc`) and NCCL (`libnccl`).
//!
//! cudarc opens libraries by bare file names (`libnvrtc.so`,
//! `libnvrtc.so.13`, `libnvrtc.so.12`, …; `libnccl.so`, `libnccl.so.13`, …)
//! on the dynamic loader's path only. Two common installs miss that:
//!
//! * Python wheels (`nvidia-cuda-nvrtc-cu12`, `nvidia-cuda-nvrtc` 13.x,
//!   `nvidia-nccl-cu12`, the libraries PyTorch and CuPy pull in) put the
//!   libraries under `site-packages/nvidia/<pkg>/lib` (`nvidia/cuda_nvrtc/lib`,
//!   `nvidia/cu13/lib`, `nvidia/nccl/lib`), which is on no loader path;
//! * NCCL's packages (wheel, Debian, conda) ship `libnccl.so.2` and nothing
//!   else at run time, a name cudarc never tries.
//!
//! So this module searches, in order: a file named by an environment
//! variable (`GPUPOOL_NVRTC_LIB`, `GPUPOOL_NCCL_LIB`), the loader path under
//! the names cudarc and NCCL use, then folders: `GPUPOOL_LIB_DIRS` (a `:`
//! list), the `nvidia/*/lib` folders of every Python site-packages it can
//! find without running Python ([`python_site_dirs`]), and the CUDA
//! toolkit's library folders.
//!
//! For NVRTC, a library found in a folder is opened by its full path and
//! kept open: the loader then answers cudarc's later `dlopen("libnvrtc.so.12")`
//! with that same library, because a bare name matches a loaded library's
//! `DT_SONAME` (glibc's `_dl_map_object`). NCCL's soname `libnccl.so.2` is
//! not among cudarc's names, so NCCL is opened here and called through
//! function pointers (see `collective::nccl`).
//!
//! Libraries opened here are never closed: function pointers into them live
//! in statics for the life of the process.

use std::ffi::{c_void, CStr, CString, OsString};
use std::path::{Path, PathBuf};

/// A shared library opened with `dlopen` and never closed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DynLib {
    handle: *mut c_void,
}

// SAFETY: a dlopen handle is an opaque token the (thread-safe) loader
// accepts from any thread; the library is never closed, so it stays valid.
unsafe impl Send for DynLib {}
// SAFETY: as above; `dlsym` on one handle from many threads is allowed.
unsafe impl Sync for DynLib {}

/// The loader's last error message, if any.
fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a pointer to a NUL-terminated
    // thread-local message, valid until the next dl* call on this thread;
    // it is copied at once.
    let p = unsafe { libc::dlerror() };
    if p.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-null, NUL-terminated (see above).
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

impl DynLib {
    /// Opens `name` (a bare file name searched on the loader path, or a
    /// path), resolving every symbol now (`RTLD_NOW`).
    pub(crate) fn open(name: &str) -> Result<DynLib, String> {
        let c = CString::new(name).map_err(|_| format!("{name:?}: NUL in the name"))?;
        // SAFETY: `c` is NUL-terminated and outlives the call; loading a
        // library runs its initialisers, as loading it for use must.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            Err(dl_error())
        } else {
            Ok(DynLib { handle })
        }
    }

    /// The address of symbol `name`, or `None` where the library lacks it.
    pub(crate) fn sym(&self, name: &CStr) -> Option<*mut c_void> {
        // SAFETY: `handle` is a live dlopen handle (never closed) and `name`
        // is NUL-terminated.
        let p = unsafe { libc::dlsym(self.handle, name.as_ptr()) };
        (!p.is_null()).then_some(p)
    }
}

/// The file the loaded code at `addr` comes from (`dladdr`), e.g. the path
/// of the library a symbol was resolved in.
pub(crate) fn file_of(addr: *const c_void) -> Option<String> {
    // SAFETY: Dl_info is plain old data; all-zero is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is a valid out-pointer; dladdr only reads the loader's
    // tables for `addr`.
    let r = unsafe { libc::dladdr(addr, &mut info) };
    if r == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname points at the loader's NUL-terminated name of a
    // library that stays loaded.
    let name = unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy();
    // The loader keeps the name it was asked for; resolve symlinks so the
    // log names the real file.
    Some(
        std::fs::canonicalize(&*name)
            .map(|p| p.display().to_string())
            .unwrap_or_else(|_| name.into_owned()),
    )
}

/// Python `site-packages` / `dist-packages` folders that exist, found
/// without running Python: `PYTHONPATH`, the virtual or conda environment
/// (`VIRTUAL_ENV`, `CONDA_PREFIX`), the running interpreter's prefix where
/// this process is Python, the user site, and the usual system prefixes.
pub fn python_site_dirs() -> Vec<PathBuf> {
    python_site_dirs_with(&|k| std::env::var_os(k))
}

/// [`python_site_dirs`] with the environment read through `env`.
fn python_site_dirs_with(env: &dyn Fn(&str) -> Option<OsString>) -> Vec<PathBuf> {
    let mut prefixes: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(v) = env(var) {
            prefixes.push(PathBuf::from(v));
        }
    }
    // Loaded into Python (PyTorch, CuPy): <prefix>/bin/python3.
    if let Ok(exe) = std::fs::read_link("/proc/self/exe") {
        if let Some(prefix) = exe.parent().and_then(Path::parent) {
            prefixes.push(prefix.to_path_buf());
        }
    }
    if let Some(home) = env("HOME") {
        prefixes.push(Path::new(&home).join(".local"));
    }
    prefixes.extend(["/usr/local", "/usr", "/opt/conda"].map(PathBuf::from));

    let mut dirs: Vec<PathBuf> = env("PYTHONPATH")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    for prefix in prefixes {
        let Ok(entries) = std::fs::read_dir(prefix.join("lib")) else {
            continue;
        };
        let mut pythons: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
            .map(|e| e.path())
            .collect();
        pythons.sort();
        for py in pythons {
            dirs.push(py.join("site-packages"));
            dirs.push(py.join("dist-packages"));
        }
    }
    dirs.push(PathBuf::from("/usr/lib/python3/dist-packages"));
    let mut out: Vec<PathBuf> = Vec::new();
    for d in dirs {
        if d.is_dir() && !out.contains(&d) {
            out.push(d);
        }
    }
    out
}

/// Folders to search for a library, in order: `GPUPOOL_LIB_DIRS`, every
/// `nvidia/*/lib` under [`python_site_dirs`], then the CUDA toolkit's and
/// the system's library folders.
pub fn search_dirs() -> Vec<PathBuf> {
    search_dirs_with(&|k| std::env::var_os(k))
}

/// [`search_dirs`] with the environment read through `env`.
fn search_dirs_with(env: &dyn Fn(&str) -> Option<OsString>) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = env("GPUPOOL_LIB_DIRS")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    for site in python_site_dirs_with(env) {
        let Ok(entries) = std::fs::read_dir(site.join("nvidia")) else {
            continue;
        };
        let mut libs: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path().join("lib"))
            .filter(|p| p.is_dir())
            .collect();
        libs.sort();
        dirs.extend(libs);
    }
    dirs.extend(
        [
            "/usr/local/cuda/lib64",
            "/usr/local/cuda/targets/x86_64-linux/lib",
            "/usr/local/cuda/targets/sbsa-linux/lib",
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu",
        ]
        .map(PathBuf::from),
    );
    let mut out: Vec<PathBuf> = Vec::new();
    for d in dirs {
        if d.is_dir() && !out.contains(&d) {
            out.push(d);
        }
    }
    out
}

/// The major version of a file named `<stem>.so.<major>[.<more>]`, `None`
/// for any other name (`libnvrtc-builtins.so.12.9`, `libnvrtc.alt.so.12`,
/// the unversioned `libnvrtc.so`).
pub(crate) fn so_major(file: &str, stem: &str) -> Option<u32> {
    let rest = file.strip_prefix(stem)?.strip_prefix(".so.")?;
    rest.split('.').next()?.parse().ok()
}

/// Files named `<stem>.so.<major>…` in `dirs`, highest major first, then in
/// the order of `dirs`; only majors in `majors` where that is not empty.
pub(crate) fn find_versioned(dirs: &[PathBuf], stem: &str, majors: &[u32]) -> Vec<PathBuf> {
    let mut found: Vec<(u32, usize, PathBuf)> = Vec::new();
    for (i, d) in dirs.iter().enumerate() {
        let Ok(entries) = std::fs::read_dir(d) else {
            continue;
        };
        let mut here: Vec<(u32, PathBuf)> = entries
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let major = so_major(&name, stem)?;
                (majors.is_empty() || majors.contains(&major)).then(|| (major, e.path()))
            })
            .collect();
        // `libx.so.2` before `libx.so.2.21.5`: the soname link first.
        here.sort_by_key(|(_, p)| p.as_os_str().len());
        found.extend(here.into_iter().map(|(m, p)| (m, i, p)));
    }
    found.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    found.into_iter().map(|(_, _, p)| p).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versioned_names_are_recognised() {
        assert_eq!(so_major("libnvrtc.so.12", "libnvrtc"), Some(12));
        assert_eq!(so_major("libnvrtc.so.13.0.88", "libnvrtc"), Some(13));
        assert_eq!(so_major("libnccl.so.2", "libnccl"), Some(2));
        assert_eq!(so_major("libnvrtc-builtins.so.12.9", "libnvrtc"), None);
        assert_eq!(so_major("libnvrtc.alt.so.12", "libnvrtc"), None);
        assert_eq!(so_major("libnvrtc.so", "libnvrtc"), None);
        assert_eq!(so_major("libnvrtc.so.x", "libnvrtc"), None);
    }

    #[test]
    fn find_versioned_prefers_high_majors_then_folder_order() {
        let root = std::env::temp_dir().join(format!("gpupool-libs-{}", std::process::id()));
        let (a, b) = (root.join("a"), root.join("b"));
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        for (d, f) in [
            (&a, "libnvrtc.so.12"),
            (&a, "libnvrtc-builtins.so.12.9"),
            (&b, "libnvrtc.so.13"),
            (&b, "libnvrtc.so.12"),
            (&b, "libnccl.so.2.27.3"),
            (&b, "libnccl.so.2"),
        ] {
            std::fs::write(d.join(f), b"").unwrap();
        }
        let dirs = vec![a.clone(), b.clone()];
        assert_eq!(
            find_versioned(&dirs, "libnvrtc", &[]),
            vec![
                b.join("libnvrtc.so.13"),
                a.join("libnvrtc.so.12"),
                b.join("libnvrtc.so.12")
            ]
        );
        assert_eq!(
            find_versioned(&dirs, "libnvrtc", &[12]),
            vec![a.join("libnvrtc.so.12"), b.join("libnvrtc.so.12")]
        );
        assert_eq!(
            find_versioned(&dirs, "libnccl", &[2]),
            vec![b.join("libnccl.so.2"), b.join("libnccl.so.2.27.3")]
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn search_dirs_start_with_gpupool_lib_dirs_and_find_wheel_folders() {
        // A fake virtual environment with a wheel's library folder.
        let root = std::env::temp_dir().join(format!("gpupool-venv-{}", std::process::id()));
        let lib = root.join("lib/python3.12/site-packages/nvidia/cu13/lib");
        std::fs::create_dir_all(&lib).unwrap();
        let extra = root.join("extra");
        std::fs::create_dir_all(&extra).unwrap();
        let env = |k: &str| match k {
            "GPUPOOL_LIB_DIRS" => Some(extra.clone().into_os_string()),
            "VIRTUAL_ENV" => Some(root.clone().into_os_string()),
            _ => None,
        };
        let dirs = search_dirs_with(&env);
        assert_eq!(dirs.first(), Some(&extra), "{dirs:?}");
        assert!(dirs.contains(&lib), "{dirs:?}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn opening_a_missing_library_is_an_error_and_libc_is_found() {
        assert!(DynLib::open("libgpupool-no-such-library.so.7").is_err());
        let libc = DynLib::open("libc.so.6").unwrap();
        let p = libc.sym(c"malloc").unwrap();
        assert!(libc.sym(c"gpupool_no_such_symbol").is_none());
        let file = file_of(p).unwrap();
        assert!(file.contains("libc"), "{file}");
    }
}
