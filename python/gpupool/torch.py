"""gpupool as PyTorch's CUDA allocator.

Usage, before any CUDA tensor exists in the process::

    import gpupool.torch
    gpupool.torch.install()                 # backend=cuda; builds the C++ shim once (cached)
    ...train...
    gpupool.torch.memory_stats(0)["allocated_bytes.all.peak"]

Two routes:

``install()`` (the default, ``shim=True``) compiles ``csrc/torch_shim.cpp``
against the installed torch (on first use; cached, rebuilt when the source,
torch or the compiler changes) and loads it. The shim makes a subclass of
PyTorch's C++ ``CUDAPluggableAllocator`` the current allocator and wires
``Tensor.record_stream()``, ``torch.cuda.empty_cache()``,
``torch.cuda.set_per_process_memory_fraction()``, ``torch.OutOfMemoryError``
(with gpupool's report) and private pools (``torch.cuda.graph``,
``torch.cuda.MemPool`` with ``use_mem_pool``; when the loaded library has
the pool functions) to gpupool. It needs a C++17 compiler (``$CXX`` or
``c++``) and CUDA's runtime headers (``$CUDA_HOME``, /usr/local/cuda or the
``nvidia-cuda-runtime``/``nvidia-cuda-nvcc`` wheels PyTorch depends on).

``install(shim=False)`` uses PyTorch's Python ``CUDAPluggableAllocator``
over the library's ``gpupool_torch_malloc`` / ``gpupool_torch_free``:
nothing to compile, but allocation and free only (no record_stream,
empty_cache, memory fraction or private pools; an out-of-memory returns
NULL to PyTorch, which reports a later illegal-address error).

On both routes ``torch.cuda.memory_stats()`` and its helpers raise
(PyTorch's pluggable allocator has no statistics): use :func:`memory_stats`,
or :func:`patch_torch_stats` to make ``torch.cuda.memory_stats``,
``memory_allocated``, ``max_memory_allocated``, ``memory_reserved``,
``max_memory_reserved`` and ``reset_peak_memory_stats`` answer with
gpupool's figures.

gpupool runs with ``backend=cuda`` under PyTorch, never the simulator:
:func:`install` refuses a configuration (or a running runtime) with
``backend=sim``, and turns ``backend=auto`` or no backend into
``backend=cuda``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import gpupool
from gpupool import _lib

# Kept from the former gpupool_torch module.
from gpupool import (  # noqa: F401
    dump_snapshot,
    memory_stats,
    record_history,
    reset_peak_memory_stats,
    snapshot,
    stats,
    trim,
    version,
)

GpupoolError = gpupool.Error

#: The shim's C++ source, shipped in the package.
SHIM_SOURCE = Path(__file__).resolve().parent / "csrc" / "torch_shim.cpp"

_allocator = None
_route: Optional[str] = None  # "shim" or "python" once installed
_shim: Optional[ctypes.CDLL] = None
_install_lock = threading.Lock()


def library_path() -> str:
    """The ``libgpupool.so`` PyTorch is pointed at."""
    return _lib.library_path()


def lib(path: Optional[str] = None):
    """The loaded library (ctypes), with the C ABI declared."""
    return _lib.lib(path)


def last_error() -> str:
    """This thread's message of the last gpupool call ("" after a success)."""
    return lib().gpupool_last_error().decode(errors="replace")


def init(conf: Optional[str] = None) -> None:
    """Starts gpupool with a GPUPOOL_CONF string (None: $GPUPOOL_CONF).
    Already running is not an error."""
    gpupool.init(conf)


# ---- backend=cuda only -----------------------------------------------------------


def _conf_backend(conf: Optional[str]) -> Optional[str]:
    """The ``backend`` value of a GPUPOOL_CONF string, None when absent."""
    backend = None
    for item in (conf or "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == "backend":
            backend = value.strip()
    return backend


def cuda_conf(conf: Optional[str] = None) -> str:
    """The configuration :func:`install` runs with: ``conf`` (default
    ``$GPUPOOL_CONF``) with ``backend=cuda``. ``backend=sim`` raises
    :class:`ValueError`; ``backend=auto`` or none becomes ``backend=cuda``
    (auto would fall back to the simulator without a driver).

    Unless ``conf`` sets ``stitch_share`` or ``stitch_budget``, it adds
    ``stitch_share=0.01``: remapping (stitching) takes at most 1% of wall
    time, past which the pool grows instead. PyTorch marks no steps, and a
    training loop whose shapes vary otherwise restitches every step, which
    cost real step time on an H200 (docs/BENCHMARKS.md §7)."""
    conf = conf if conf is not None else os.environ.get("GPUPOOL_CONF", "")
    backend = _conf_backend(conf)
    if backend not in (None, "", "auto", "cuda"):
        raise ValueError(
            f"gpupool.torch.install: GPUPOOL_CONF {conf!r} has backend={backend}; PyTorch's "
            "allocator must be gpupool's CUDA backend (backend=cuda), never the simulator"
        )
    items = [i for i in conf.split(",") if i.strip() and i.partition("=")[0].strip() != "backend"]
    keys = {i.partition("=")[0].strip() for i in items}
    if not keys & {"stitch_share", "stitch_budget"}:
        items.append("stitch_share=0.01")
    return ",".join(["backend=cuda"] + items)


def _require_cuda_runtime() -> None:
    """Refuses a runtime already running on another backend than CUDA
    (started by :func:`gpupool.init` with backend=sim, say)."""
    if not gpupool.is_initialized():
        return
    started = gpupool._started_conf
    if started is None:  # started outside Python (C code, a torch hook): from the environment
        started = os.environ.get("GPUPOOL_CONF", "")
    backend = _conf_backend(started)
    if backend != "cuda":
        raise gpupool.Error(
            _lib.INVALID_ARGUMENT,
            f"gpupool.torch.install: gpupool is already running with "
            f"backend={backend or 'auto'} ({started!r}); PyTorch needs backend=cuda: call "
            "gpupool.shutdown() first, or start it with backend=cuda",
        )


# ---- the shim: build (cached) and load ------------------------------------------------


def _cuda_include_dirs(torch_mod=None) -> List[str]:
    """Directories holding ``cuda_runtime_api.h`` (and ``crt/host_defines.h``,
    which ``cuda_runtime.h`` needs): ``$GPUPOOL_CUDA_INCLUDE`` (a colon
    list), ``$CUDA_HOME``/``$CUDA_PATH``, PyTorch's
    idea of CUDA_HOME, /usr/local/cuda, and the nvidia-* wheels in
    site-packages (``nvidia/cuda_runtime/include``, ``nvidia/cuda_nvcc/include``,
    ``nvidia/cu13/include``)."""
    roots: List[str] = [d for d in os.environ.get("GPUPOOL_CUDA_INCLUDE", "").split(":") if d]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            roots.append(os.path.join(os.environ[env], "include"))
    if torch_mod is not None:
        try:
            from torch.utils import cpp_extension

            if cpp_extension.CUDA_HOME:
                roots.append(os.path.join(cpp_extension.CUDA_HOME, "include"))
        except Exception:
            pass
    roots.append("/usr/local/cuda/include")
    import glob
    import site

    sites: List[str] = []
    try:
        sites += site.getsitepackages()
    except Exception:
        pass
    sites += [p for p in sys.path if p]
    if torch_mod is not None and getattr(torch_mod, "__file__", None):
        sites.append(str(Path(torch_mod.__file__).resolve().parent.parent))
    for s in sites:
        roots += sorted(glob.glob(os.path.join(s, "nvidia", "*", "include")))
    found: List[str] = []
    for r in roots:
        r = os.path.realpath(r)
        if r in found or not os.path.isdir(r):
            continue
        if os.path.exists(os.path.join(r, "cuda_runtime_api.h")) or os.path.exists(
            os.path.join(r, "crt", "host_defines.h")
        ):
            found.append(r)
    return found


def _require_cuda_headers(cuda_incs: Sequence[str], cuda_version: Optional[str]) -> None:
    """Raises, saying what to install, unless ``cuda_runtime_api.h`` and
    ``crt/host_defines.h`` are both among ``cuda_incs``."""
    missing = [
        h
        for h in ("cuda_runtime_api.h", os.path.join("crt", "host_defines.h"))
        if not any(os.path.exists(os.path.join(d, h)) for d in cuda_incs)
    ]
    if not missing:
        return
    major = (cuda_version or "12").split(".")[0]
    if major == "12":
        pip = "pip install 'nvidia-cuda-runtime-cu12==12.*' 'nvidia-cuda-nvcc-cu12==12.*'"
    else:
        mm = cuda_version or f"{major}.0"
        pip = f"pip install 'nvidia-cuda-runtime=={mm}.*' 'nvidia-cuda-crt=={mm}.*'"
    raise RuntimeError(
        f"gpupool.torch: building the shim needs CUDA's runtime headers; not found: "
        f"{', '.join(missing)} (looked in: {', '.join(cuda_incs) or 'nowhere'}). Set CUDA_HOME "
        f"or GPUPOOL_CUDA_INCLUDE, or `{pip}` (headers only; "
        "scripts/fetch-cuda-headers.sh does the same offline-ready), or use install(shim=False)"
    )


def shim_compile_args(
    torch_include_dirs: Sequence[str],
    cuda_include_dirs: Sequence[str],
    cxx11_abi: bool,
    output: str,
    library_dirs: Sequence[str] = (),
    syntax_only: bool = False,
    source: Optional[str] = None,
    cxx: Optional[str] = None,
) -> List[str]:
    """The compiler command that builds the shim (``syntax_only``: checks it
    and writes nothing). Used by :func:`build_shim` and by
    scripts/torch-shim-check.sh, which compiles against downloaded headers."""
    cmd = shlex.split(cxx or os.environ.get("CXX") or "c++")
    cmd += ["-std=c++17", "-O2", "-fPIC", "-Wall", "-Wextra", "-Werror"]
    cmd += [f"-D_GLIBCXX_USE_CXX11_ABI={1 if cxx11_abi else 0}"]
    for d in list(torch_include_dirs) + list(cuda_include_dirs):
        cmd += ["-isystem", d]
    cmd.append(source or str(SHIM_SOURCE))
    if syntax_only:
        return cmd + ["-fsyntax-only"]
    cmd += ["-shared", "-o", output]
    for d in library_dirs:
        cmd += [f"-L{d}", f"-Wl,-rpath,{d}"]
    return cmd + ["-lc10", "-lc10_cuda", "-ltorch_cuda", "-ldl"]


def shim_cache_dir() -> Path:
    """Where built shims are kept: ``$GPUPOOL_TORCH_SHIM_DIR``, else
    ``$TORCH_EXTENSIONS_DIR/gpupool_torch_shim``, else
    ``~/.cache/torch_extensions/gpupool_torch_shim`` (PyTorch's extension
    cache)."""
    if os.environ.get("GPUPOOL_TORCH_SHIM_DIR"):
        return Path(os.environ["GPUPOOL_TORCH_SHIM_DIR"])
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions"
    )
    return Path(root) / "gpupool_torch_shim"


def build_shim(verbose: bool = False) -> str:
    """Builds the shim for the installed torch unless a build of the same
    source, torch and compiler command is cached; returns the ``.so`` path.
    Concurrent builders (torchrun ranks) each compile to a temporary file
    and rename it into place."""
    import torch
    from torch.utils import cpp_extension

    src = SHIM_SOURCE.read_bytes()
    torch_dir = str(Path(torch.__file__).resolve().parent)
    try:
        incs = cpp_extension.include_paths()
    except TypeError:  # older signatures
        incs = cpp_extension.include_paths(False)
    libs = cpp_extension.library_paths()
    cuda_incs = _cuda_include_dirs(torch)
    abi = bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    probe = shim_compile_args(incs, cuda_incs, abi, "OUT", libs)
    key = hashlib.sha256(
        b"\0".join(
            [src, torch.__version__.encode(), torch_dir.encode(), " ".join(probe).encode()]
        )
    ).hexdigest()[:16]
    out_dir = shim_cache_dir()
    out = out_dir / f"libgpupool_torch_shim-{key}.so"
    if out.exists():
        return str(out)
    _require_cuda_headers(cuda_incs, getattr(getattr(torch, "version", None), "cuda", None))
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=str(out_dir))
    os.close(fd)
    cmd = shim_compile_args(incs, cuda_incs, abi, tmp, libs)
    if verbose:
        print("gpupool.torch: building the shim:", " ".join(shlex.quote(c) for c in cmd),
              file=sys.stderr)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError as e:
        os.unlink(tmp)
        raise RuntimeError(
            f"gpupool.torch: no C++ compiler ({cmd[0]}) to build the shim; set CXX, "
            "or use install(shim=False)"
        ) from e
    if p.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(
            "gpupool.torch: building the shim failed:\n"
            + " ".join(shlex.quote(c) for c in cmd)
            + "\n"
            + (p.stderr or p.stdout)[-6000:]
        )
    os.replace(tmp, out)
    return str(out)


def _load_shim(path: str) -> ctypes.CDLL:
    shim = ctypes.CDLL(path)
    shim.gpupool_torch_shim_install.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    shim.gpupool_torch_shim_install.restype = ctypes.c_int
    shim.gpupool_torch_shim_has_pools.restype = ctypes.c_int
    shim.gpupool_torch_shim_missing_pools.restype = ctypes.c_char_p
    shim.gpupool_torch_shim_pool_key.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
    shim.gpupool_torch_shim_pool_key.restype = ctypes.c_uint64
    return shim


def _install_shim(verbose: bool = False):
    global _shim
    import torch  # noqa: F401  (its libraries must be loaded before the shim)

    shim = _load_shim(build_shim(verbose=verbose))
    err = ctypes.create_string_buffer(4096)
    if shim.gpupool_torch_shim_install(os.fsencode(_lib.path()), err, len(err)) != 0:
        raise RuntimeError("gpupool.torch: the shim could not install gpupool: "
                           + err.value.decode(errors="replace"))
    _shim = shim
    if not shim.gpupool_torch_shim_has_pools():
        missing = shim.gpupool_torch_shim_missing_pools().decode()
        print(
            f"gpupool.torch: private memory pools (torch.cuda.graph, torch.cuda.MemPool) are "
            f"unavailable: {_lib.path()} lacks {missing}; everything else works",
            file=sys.stderr,
        )
    return shim


def _install_python():
    import torch

    alloc = torch.cuda.memory.CUDAPluggableAllocator(
        _lib.path(), "gpupool_torch_malloc", "gpupool_torch_free"
    )
    torch.cuda.memory.change_current_allocator(alloc)
    return alloc


def install(
    conf: Optional[str] = None,
    path: Optional[str] = None,
    shim: bool = True,
    verbose: bool = False,
):
    """Makes gpupool PyTorch's CUDA allocator for this process.

    ``conf`` is a GPUPOOL_CONF string (default ``$GPUPOOL_CONF``), always run
    with ``backend=cuda`` (see :func:`cuda_conf`; ``backend=sim`` raises
    :class:`ValueError`, and so does a runtime already running on the
    simulator). It is exported as GPUPOOL_CONF so that child processes see
    it. ``shim=True`` builds (once, cached) and loads the C++ shim;
    ``shim=False`` uses PyTorch's Python ``CUDAPluggableAllocator`` (see the
    module's documentation for what each can do). Call before the first
    CUDA allocation (PyTorch refuses to swap an allocator already in use).
    Returns the shim (a ctypes library) or the ``CUDAPluggableAllocator``;
    a second call returns the first's.
    """
    global _allocator, _route
    with _install_lock:
        if _allocator is not None:
            return _allocator
        import torch  # noqa: F401

        conf = cuda_conf(conf)
        _require_cuda_runtime()
        os.environ["GPUPOOL_CONF"] = conf
        lib(path)
        gpupool.init(conf)
        _require_cuda_runtime()
        if shim:
            _allocator = _install_shim(verbose=verbose)
            _route = "shim"
        else:
            _allocator = _install_python()
            _route = "python"
        return _allocator


def route() -> Optional[str]:
    """``"shim"`` or ``"python"`` once :func:`install` ran, else None."""
    return _route


def has_private_pools() -> bool:
    """Whether ``torch.cuda.graph`` / ``torch.cuda.MemPool`` pools reach
    gpupool (the shim is installed and the library has the pool functions)."""
    return _shim is not None and bool(_shim.gpupool_torch_shim_has_pools())


# ---- torch.cuda's statistics from gpupool (opt in) -----------------------------------

_PATCHED_NAMES = (
    "memory_stats",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "reset_peak_memory_stats",
)
_saved: Dict[str, Dict[str, object]] = {}


def _device_index(torch_mod, device) -> int:
    """PyTorch's ``device`` argument (None, an int, ``"cuda:1"``, a
    ``torch.device``) as an index; None and an index-less device mean the
    current device."""
    if device is None:
        return int(torch_mod.cuda.current_device())
    if isinstance(device, bool):
        raise TypeError("device must be an int, a str or a torch.device")
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        kind, _, idx = device.partition(":")
        if kind != "cuda":
            raise ValueError(f"expected a CUDA device, got {device!r}")
        return int(idx) if idx else int(torch_mod.cuda.current_device())
    kind = getattr(device, "type", "cuda")
    if kind != "cuda":
        raise ValueError(f"expected a CUDA device, got {device!r}")
    idx = getattr(device, "index", None)
    return int(torch_mod.cuda.current_device()) if idx is None else int(idx)


def _stats_functions(torch_mod) -> Dict[str, object]:
    def memory_stats(device=None):
        """gpupool's statistics of ``device`` in ``torch.cuda.memory_stats()``'s
        flat keys and meanings (patched by gpupool.torch.patch_torch_stats)."""
        st = gpupool.memory_stats(_device_index(torch_mod, device))
        return dict(sorted(st.items()))

    def _get(key):
        def f(device=None):
            return int(gpupool.memory_stats(_device_index(torch_mod, device)).get(key, 0))

        f.__name__ = key
        f.__doc__ = f"gpupool's {key} (patched by gpupool.torch.patch_torch_stats)."
        return f

    def reset_peak_memory_stats(device=None):
        """Resets gpupool's peaks of ``device`` (patched by
        gpupool.torch.patch_torch_stats)."""
        gpupool.reset_peak_memory_stats(_device_index(torch_mod, device))

    fns = {
        "memory_stats": memory_stats,
        "memory_allocated": _get("allocated_bytes.all.current"),
        "max_memory_allocated": _get("allocated_bytes.all.peak"),
        "memory_reserved": _get("reserved_bytes.all.current"),
        "max_memory_reserved": _get("reserved_bytes.all.peak"),
        "reset_peak_memory_stats": reset_peak_memory_stats,
    }
    for name, fn in fns.items():
        fn.__name__ = name
        fn.__gpupool__ = True
    return fns


def patch_torch_stats() -> None:
    """Makes ``torch.cuda.memory_stats``, ``memory_allocated``,
    ``max_memory_allocated``, ``memory_reserved``, ``max_memory_reserved``
    and ``reset_peak_memory_stats`` (in ``torch.cuda`` and
    ``torch.cuda.memory``, so PyTorch's own helpers that call them follow)
    answer with gpupool's figures, in PyTorch's keys and meanings. Opt in:
    PyTorch's pluggable allocator has no statistics, so unpatched they
    raise. :func:`unpatch_torch_stats` restores PyTorch's. Idempotent."""
    import torch

    fns = _stats_functions(torch)
    for modname in ("torch.cuda", "torch.cuda.memory"):
        mod = torch.cuda if modname == "torch.cuda" else getattr(torch.cuda, "memory", None)
        if mod is None:
            continue
        saved = _saved.setdefault(modname, {})
        for name, fn in fns.items():
            if not hasattr(mod, name):
                continue
            cur = getattr(mod, name)
            if not getattr(cur, "__gpupool__", False):
                saved[name] = cur
            setattr(mod, name, fn)


def unpatch_torch_stats() -> None:
    """Puts back what :func:`patch_torch_stats` replaced."""
    import torch

    for modname, saved in list(_saved.items()):
        mod = torch.cuda if modname == "torch.cuda" else getattr(torch.cuda, "memory", None)
        if mod is not None:
            for name, fn in saved.items():
                setattr(mod, name, fn)
    _saved.clear()
