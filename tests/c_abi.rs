//! Compiles `tests/c/abi_test.c` with the system C compiler against
//! `include/gpupool.h` and the cdylib `cargo test` just built, runs it
//! against the simulator, and requires every check to pass (including 8
//! threads allocating and freeing through the ABI with 0 errors).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

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
    // The pickle it wrote loads in the reader of PyTorch snapshots.
    let bytes = std::fs::read(out.join("abi_snapshot.pickle")).unwrap();
    let traces = gpupool::trace::parse_all("abi_snapshot.pickle", &bytes).unwrap();
    assert!(!traces.is_empty());
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
        eprintln!("no C++ compiler ({cxx}); skipped");
        return;
    };
    assert!(st.success(), "include/gpupool.h does not compile as C++");
}
