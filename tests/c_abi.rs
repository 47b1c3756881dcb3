//! Compiles `tests/c/abi_test.c` with the system C compiler against
//! `include/gpupool.h` and the cdylib `cargo test` just built, runs it
//! against the simulator, and requires every check to pass (including 8
//! threads allocating and freeing through the ABI with 0 errors).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

mod common;

/// The directory holding `libgpupool.so`: `cargo test` builds the cdylib
/// into the deps directory next to this test's executable (and `cargo
/// build` copies it one level up).
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let deps = exe.parent().expect("deps dir").to_path_buf();
    for dir in [deps.clone(), deps.parent().unwrap_or(&deps).to_path_buf()] {
        if dir.join("libgpupool.so").exists() {
            return dir;
        }
    }
    panic!(
        "libgpupool.so not found next to {} (is crate-type cdylib still set?)",
        exe.display()
    );
}

fn compiler() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".to_string())
}

fn build(root: &Path, out: &Path, lib: &Path) -> PathBuf {
    let exe = out.join("abi_test");
    let st = Command::new(compiler())
        .args([
            "-std=c11", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-pthread",
        ])
        .arg("-I")
        .arg(root.join("include"))
        .arg(root.join("tests/c/abi_test.c"))
        .arg("-L")
        .arg(lib)
        .arg("-lgpupool")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-o")
        .arg(&exe)
        .status()
        .expect("running the C compiler (set CC to choose one)");
    assert!(st.success(), "compiling tests/c/abi_test.c failed");
    exe
}

#[cfg(target_os = "linux")]
#[test]
fn c_program_exercises_the_whole_abi() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("c_abi");
    std::fs::create_dir_all(&out).unwrap();
    let lib = lib_dir();
    let exe = build(root, &out, &lib);
    let t = Instant::now();
    let o = Command::new(&exe)
        .arg(&out)
        .env("LD_LIBRARY_PATH", &lib)
        .env_remove("GPUPOOL_CONF")
        .env_remove("GPUPOOL_LOG")
        // gpupool_selftest_panic panics on purpose: keep its report short.
        .env_remove("RUST_BACKTRACE")
        .output()
        .expect("running abi_test");
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    println!("{stdout}");
    eprintln!("{stderr}");
    println!("abi_test ran in {:.2} s", t.elapsed().as_secs_f64());
    assert!(
        o.status.success(),
        "abi_test failed ({}):\n{stdout}\n{stderr}",
        o.status
    );
    assert!(stdout.contains(" 0 failed"), "{stdout}");
    assert!(stdout.contains("0 errors"), "{stdout}");
    // The pickle it wrote loads, in PyTorch's snapshot layout (the trace
    // readers' round trip of that layout: tools/tests/export_roundtrip.rs).
    let bytes = std::fs::read(out.join("abi_snapshot.pickle")).unwrap();
    let v = serde_pickle::value_from_slice(&bytes, serde_pickle::DeOptions::new()).unwrap();
    let serde_pickle::Value::Dict(root) = v else {
        panic!("abi_snapshot.pickle is not a dict: {v:?}")
    };
    let traces = root.get(&serde_pickle::HashableValue::String("device_traces".into()));
    assert!(
        matches!(traces, Some(serde_pickle::Value::List(t)) if !t.is_empty()),
        "{traces:?}"
    );
}

#[cfg(target_os = "linux")]
#[test]
fn header_compiles_as_cpp() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let Ok(st) = Command::new(&cxx)
        .args([
            "-x",
            "c++",
            "-std=c++11",
            "-fsyntax-only",
            "-Wall",
            "-Werror",
        ])
        .arg("-I")
        .arg(root.join("include"))
        .arg("-")
        .stdin(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(
                b"#include \"gpupool.h\"\nint main() { return gpupool_init(nullptr); }\n",
            )?;
            c.wait()
        })
    else {
        common::missing(&format!("no C++ compiler ({cxx})"));
        return;
    };
    assert!(st.success(), "include/gpupool.h does not compile as C++");
}

/// `GPUPOOL_LOG` turns gpupool's `tracing` output on in a C process.
#[cfg(target_os = "linux")]
#[test]
fn gpupool_log_enables_tracing_through_the_abi() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("c_abi_log");
    std::fs::create_dir_all(&out).unwrap();
    let lib = lib_dir();
    let exe = build(root, &out, &lib);
    let run = |log: Option<&str>| {
        let mut c = Command::new(&exe);
        c.arg(&out)
            .env("LD_LIBRARY_PATH", &lib)
            .env_remove("GPUPOOL_CONF")
            .env_remove("RUST_BACKTRACE");
        match log {
            Some(l) => c.env("GPUPOOL_LOG", l),
            None => c.env_remove("GPUPOOL_LOG"),
        };
        let o = c.output().expect("running abi_test");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let quiet = run(None);
    assert!(!quiet.contains("initialized through the C ABI"), "{quiet}");
    let loud = run(Some("gpupool=info"));
    assert!(loud.contains("initialized through the C ABI"), "{loud}");
    assert!(loud.contains("out of memory"), "the OOM warning: {loud}");
}

/// The Python package (`python/gpupool`, ctypes over the C ABI) drives the
/// cdylib `cargo test` just built, on the simulator, from the source tree:
/// `gpupool.torch` (the former `gpupool_torch.py`) keeps its helpers, and
/// the training example skips cleanly where torch or a GPU is missing.
/// (CI also installs the wheel and runs `python/tests` against it.)
#[cfg(target_os = "linux")]
#[test]
fn python_helpers_work_on_the_simulator() {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    if common::require_tool(&python).is_none() {
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = lib_dir().join("libgpupool.so");
    let snap = Path::new(env!("CARGO_TARGET_TMPDIR")).join("py_snapshot.pickle");
    let script = r#"
import ctypes, pickle, sys
import gpupool
import gpupool.torch as g
assert gpupool.library_path() == sys.argv[2], (gpupool.library_path(), sys.argv[2])
g.init("backend=sim,devices=2,capacity=64MiB")
g.init("backend=sim")  # already running: not an error
l = g.lib()
n = ctypes.c_int()
assert l.gpupool_device_count(ctypes.byref(n)) == 0 and n.value == 2
g.record_history(True)
s = gpupool.stream_create(1)
ptrs = [gpupool.alloc(size, 1, s) for size in (100, 5000, 3 << 20)]
st = g.stats(1)
assert st["device"] == 1 and st["requested_bytes"]["current"] == 100 + 5000 + (3 << 20), st
assert st["allocated_bytes"]["current"] > st["requested_bytes"]["current"], st
assert st["num_allocs"] == 3
m = g.memory_stats(1)
assert m["requested_bytes.all.current"] == 100 + 5000 + (3 << 20), m
try:
    gpupool.free(ptrs[0], 0)
    raise SystemExit("free on the wrong device succeeded")
except g.GpupoolError as e:
    assert e.status == 9 and "device 1" in str(e) and isinstance(e, ValueError), e
assert g.snapshot(1)["device"] == 1
g.dump_snapshot(sys.argv[1])
d = pickle.load(open(sys.argv[1], "rb"))
assert len(d["device_traces"]) == 2 and len(d["device_traces"][1]) == 3
for p in ptrs:
    gpupool.free(p, 1, s)
g.trim()
assert g.stats(1)["reserved_bytes"]["current"] == 0
gpupool.shutdown()
print("ok", g.version())
"#;
    let o = Command::new(&python)
        .arg("-c")
        .arg(script)
        .arg(&snap)
        .arg(&lib)
        .env("GPUPOOL_LIB", &lib)
        .env("PYTHONPATH", root.join("python"))
        .env_remove("GPUPOOL_CONF")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.starts_with("ok"),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );

    // No torch or no GPU here: the example reports a skip and exits 0.
    let has_torch_gpu = Command::new(&python)
        .args([
            "-c",
            "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)",
        ])
        .status()
        .is_ok_and(|s| s.success());
    if !has_torch_gpu {
        let o = Command::new(&python)
            .arg(root.join("python/examples/train.py"))
            .arg("--steps")
            .arg("2")
            .output()
            .unwrap();
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{out}");
        assert!(out.contains("\"skipped\": true"), "{out}");
    }
}
