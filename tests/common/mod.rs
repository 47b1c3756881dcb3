//! Shared by the integration tests of both crates (the tools crate's tests
//! include this file by path): what to do when a test's data or tool is
//! missing, where the repository is, and a runtime over a simulator the
//! test keeps.
//!
//! Outside CI a test may skip, printing why. Under `CI=true` a missing
//! prerequisite is a failure: CI has every data set and tool these tests
//! need (`../shared/traces`, a C++ compiler, Python, NVRTC), so a skip
//! there would hide a test that never ran.
#![allow(dead_code)] // each test binary uses its own part

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

/// Whether the tests run under CI (`CI=true`).
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true"))
}

/// A test's prerequisite is missing: under `CI=true` this panics with
/// `why`; elsewhere it prints `why` and the caller skips.
pub fn missing(why: &str) {
    let current = std::thread::current();
    let test = current.name().unwrap_or("a test");
    assert!(
        !in_ci(),
        "{test}: {why}, and CI=true: a test must run in CI, not skip"
    );
    eprintln!("{test}: SKIPPED: {why}");
}

/// `path` when it exists; otherwise [`missing`] (a panic under `CI=true`)
/// and `None`.
pub fn require_path(path: impl AsRef<Path>) -> Option<PathBuf> {
    let p = path.as_ref();
    if p.exists() {
        Some(p.to_path_buf())
    } else {
        missing(&format!("{} is missing", p.display()));
        None
    }
}

/// `Some(program)` when `program --version` runs; otherwise [`missing`]
/// (a panic under `CI=true`) and `None`.
pub fn require_tool(program: &str) -> Option<String> {
    match std::process::Command::new(program)
        .arg("--version")
        .output()
    {
        Ok(_) => Some(program.to_string()),
        Err(e) => {
            missing(&format!("no {program} ({e})"));
            None
        }
    }
}

/// The repository root: the library's package folder, whichever crate's
/// test includes this file (the tools crate is `tools/`, one below it).
pub fn repo_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.ancestors()
        .find(|d| d.join("tools/Cargo.toml").is_file())
        .unwrap_or(here)
        .to_path_buf()
}

/// The real traces next to the repository (`../shared/traces`).
pub fn shared_traces() -> Option<PathBuf> {
    require_path(repo_root().join("../shared/traces"))
}

/// A runtime over a simulator built from `conf` (a `GPUPOOL_CONF` string),
/// with no maintenance thread, and the simulator for its counters and
/// test hooks.
pub fn sim_runtime(
    conf: &str,
) -> (
    gpupool::Runtime,
    std::sync::Arc<gpupool::backend::sim::SimBackend>,
) {
    let cfg = gpupool::PoolConfig::parse(conf).unwrap();
    let sim = std::sync::Arc::new(gpupool::backend::sim::SimBackend::new(cfg.sim.clone()).unwrap());
    let rt = gpupool::Runtime::with_backend(
        sim.clone(),
        gpupool::PoolConfig {
            maintenance_tick: None,
            ..cfg
        },
    )
    .unwrap();
    (rt, sim)
}

/// Runs `body` on its own thread and fails if it does not finish within
/// `limit` (a deadlock or a hang); a panic in the body fails the test with
/// the body's own message.
pub fn watchdog(name: &str, limit: Duration, body: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    let h = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            body();
            let _ = tx.send(());
        })
        .unwrap();
    match rx.recv_timeout(limit) {
        Ok(()) => h.join().unwrap(),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            // The body panicked: re-raise its panic here.
            if let Err(p) = h.join() {
                std::panic::resume_unwind(p);
            }
        }
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("{name}: did not finish within {limit:?} (deadlock or hang)")
        }
    }
}
