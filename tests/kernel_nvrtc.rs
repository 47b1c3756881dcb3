//! The compaction kernel without a GPU.
//!
//! - `nvrtc_compiles_the_kernel`: compiles `kernels/compact.cu` with NVRTC,
//!   as the CUDA backend does, to a cubin (for `sm_XY`) and PTX, and checks
//!   their structure without depending on one NVVM's spelling. Skipped,
//!   with the reason printed, where libnvrtc cannot be loaded, unless
//!   `GPUPOOL_REQUIRE_NVRTC=1` or `CI=true` (then it fails); get it with
//!   `export LD_LIBRARY_PATH="$(bash scripts/install-nvrtc.sh)"`.
//! - `groups_equal_sequential_moves`: the host's batch splitting
//!   (`move_groups`) against in-order `memmove` of random, heavily
//!   overlapping batches, each group run with concurrent semantics.
//! - `kernel_source_on_host_threads`: the kernel source itself, compiled as
//!   C++ with a small CUDA shim (a block is a set of threads with a barrier)
//!   and run on those same batches. Skipped where no C++20 compiler exists
//!   (a failure under `CI=true`).
//! - `cuda_moves_match_sequential`: the same batches (and larger ones)
//!   through `CudaBackend::enqueue_moves` on a real GPU. Skipped without one,
//!   unless `GPUPOOL_REQUIRE_CUDA=1`.
#![cfg(feature = "cuda")]

use gpupool::backend::cuda::kernel;
use gpupool::backend::move_groups::{conflict_free_groups, is_conflict_free};
use gpupool::{DevicePtr, Move};
use std::path::{Path, PathBuf};
use std::process::Command;

mod common;

const NO_NVRTC: &str = "libnvrtc could not be loaded (run `export LD_LIBRARY_PATH=\"$(bash scripts/install-nvrtc.sh)\"`)";

fn require_nvrtc() -> bool {
    std::env::var("GPUPOOL_REQUIRE_NVRTC").as_deref() == Ok("1")
}

/// Whether `ptx` moves 16 bytes per load or store somewhere: a 128-bit
/// vector access, however this NVVM spells it (`ld.global.v4.u32`,
/// `.v4.b32`, `.v2.u64`, `.v2.b64`, `.b128`, `.v8.b32` ...).
fn has_16_byte_access(ptx: &str) -> bool {
    ptx.lines().map(str::trim).any(|l| {
        let access = l.starts_with("ld.") || l.starts_with("st.");
        let op = l.split_whitespace().next().unwrap_or("");
        access
            && (op.contains(".b128")
                || ["32", "64"].iter().any(|w| {
                    let lanes = if *w == "32" { ".v4." } else { ".v2." };
                    op.contains(lanes) && op.ends_with(w)
                })
                || op.contains(".v8."))
    })
}

#[test]
fn sixteen_byte_accesses_are_recognised_in_any_spelling() {
    for l in [
        "ld.global.v4.u32 {%r1, %r2, %r3, %r4}, [%rd1];",
        "\tst.global.v4.b32 [%rd2], {%r1, %r2, %r3, %r4};",
        "ld.global.nc.v2.u64 {%rd3, %rd4}, [%rd1];",
        "st.global.v2.b64 [%rd2], {%rd3, %rd4};",
        "ld.global.b128 %rq1, [%rd1];",
    ] {
        assert!(has_16_byte_access(l), "{l}");
    }
    for l in [
        "ld.global.u32 %r1, [%rd1];",
        "ld.global.v2.u32 {%r1, %r2}, [%rd1];",
        "mov.b64 %rd1, %rd2;",
    ] {
        assert!(!has_16_byte_access(l), "{l}");
    }
}

#[test]
fn nvrtc_compiles_the_kernel() {
    if !kernel::nvrtc_available() {
        assert!(!require_nvrtc(), "GPUPOOL_REQUIRE_NVRTC=1 but {NO_NVRTC}");
        common::missing(NO_NVRTC);
        return;
    }
    let version = kernel::nvrtc_version().expect("nvrtcVersion");
    let library = kernel::nvrtc_library_path().unwrap();
    assert!(library.contains("libnvrtc"), "{library}");
    eprintln!(
        "kernel_nvrtc: NVRTC {}.{} from {library}",
        version.0, version.1
    );
    for arch in ["sm_90", "sm_80", "compute_75"] {
        let images = kernel::compile(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        let ptx = images.ptx.to_str().expect("PTX is text");
        eprintln!(
            "kernel_nvrtc: compiled compact.cu for {arch}: {} bytes of PTX, {} bytes of cubin",
            ptx.len(),
            images.cubin.as_ref().map_or(0, Vec::len)
        );
        assert_eq!(images.arch, arch);
        assert!(ptx.contains(".entry gpupool_compact"), "{arch}: no entry");
        let target = arch.replace("compute_", "sm_");
        assert!(ptx.contains(&format!(".target {target}")), "{arch}: target");
        // 16-byte vector copies, and the by-value batch read from parameter
        // space rather than copied to per-thread local memory.
        assert!(has_16_byte_access(ptx), "{arch}: no 16-byte loads/stores");
        assert!(!ptx.contains(".local"), "{arch}: uses local memory");
        // A real architecture gets machine code too (an ELF image, which
        // is what the backend loads first); a virtual one only PTX.
        match &images.cubin {
            Some(cubin) => {
                assert!(arch.starts_with("sm_"), "{arch}: cubin for a virtual arch");
                assert_eq!(&cubin[..4], b"\x7fELF", "{arch}: cubin is not ELF");
                assert!(cubin.len() > 1024, "{arch}: cubin of {} bytes", cubin.len());
            }
            None => assert!(arch.starts_with("compute_"), "{arch}: no cubin"),
        }
        assert_eq!(kernel::compile_ptx(arch).unwrap(), ptx);
        if arch == "sm_90" {
            let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("gpupool_compact.sm_90.ptx");
            std::fs::write(&out, ptx).unwrap();
            eprintln!("kernel_nvrtc: PTX written to {}", out.display());
        }
    }
}

/// NVRTC is found where Python wheels put it with nothing on the loader
/// path: a child run of this test binary, with `LD_LIBRARY_PATH` removed
/// and `GPUPOOL_LIB_DIRS` naming the folder the library is in, loads it
/// from there and compiles.
#[test]
fn nvrtc_is_found_off_the_loader_path() {
    if !kernel::nvrtc_available() {
        assert!(!require_nvrtc(), "GPUPOOL_REQUIRE_NVRTC=1 but no libnvrtc");
        common::missing(NO_NVRTC);
        return;
    }
    let library = kernel::nvrtc_library_path().unwrap();
    let dir = Path::new(&library).parent().unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "nvrtc_probe", "--ignored", "--nocapture"])
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("GPUPOOL_NVRTC_LIB")
        .env("GPUPOOL_LIB_DIRS", dir)
        .env("GPUPOOL_PROBE_DIR", dir)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "child failed:\n{text}");
    assert!(text.contains("1 passed"), "the probe did not run:\n{text}");
}

/// The child of [`nvrtc_is_found_off_the_loader_path`].
#[test]
#[ignore = "run as a child process by nvrtc_is_found_off_the_loader_path"]
fn nvrtc_probe() {
    let want = std::env::var("GPUPOOL_PROBE_DIR").expect("GPUPOOL_PROBE_DIR");
    let library = kernel::nvrtc_library_path().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        Path::new(&library).starts_with(&want),
        "{library} is not in {want}"
    );
    let images = kernel::compile("sm_90").unwrap();
    assert!(images.cubin.is_some());
}

/// SplitMix64: a small deterministic generator for the random batches.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// One random case: a buffer and a batch of moves given as offsets into it.
struct Case {
    init: Vec<u8>,
    moves: Vec<Move>,
}

const BUF: u64 = 768;

fn random_case(rng: &mut Rng) -> Case {
    let init = (0..BUF).map(|_| rng.next() as u8).collect();
    let n = 1 + rng.below(24);
    let mut moves = Vec::new();
    for _ in 0..n {
        let aligned = rng.below(2) == 0;
        let max = if rng.below(4) == 0 { 400 } else { 96 };
        let mut len = 1 + rng.below(max);
        if aligned {
            len = len.div_ceil(16) * 16;
        }
        let len = len.min(BUF);
        let pick = |rng: &mut Rng| {
            let o = rng.below(BUF - len + 1);
            if aligned {
                o / 16 * 16
            } else {
                o
            }
        };
        let src = pick(rng);
        let dst = match rng.below(4) {
            // A slide by less than its length: overlaps itself.
            0 => {
                let d = 1 + rng.below(len.max(2) - 1);
                let d = if aligned { d.div_ceil(16) * 16 } else { d };
                if rng.below(2) == 0 {
                    src.saturating_sub(d)
                } else {
                    (src + d).min(BUF - len)
                }
            }
            // Reuse an earlier move's range, to chain reads and writes.
            1 if !moves.is_empty() => {
                let m: &Move = &moves[rng.below(moves.len() as u64) as usize];
                [m.src.addr(), m.dst.addr()][rng.below(2) as usize].min(BUF - len)
            }
            _ => pick(rng),
        };
        moves.push(Move {
            src: DevicePtr(src),
            dst: DevicePtr(dst),
            len,
        });
    }
    Case { init, moves }
}

fn range(m: &Move) -> (std::ops::Range<usize>, usize) {
    let s = m.src.addr() as usize;
    (s..s + m.len as usize, m.dst.addr() as usize)
}

/// The batch's meaning: each move in order, as `memmove`.
fn sequential(case: &Case) -> Vec<u8> {
    let mut buf = case.init.clone();
    for m in &case.moves {
        let (r, d) = range(m);
        buf.copy_within(r, d);
    }
    buf
}

fn cases() -> Vec<Case> {
    let mut rng = Rng(0x0067_7075_706f_6f6c);
    (0..3000).map(|_| random_case(&mut rng)).collect()
}

#[test]
fn groups_equal_sequential_moves() {
    let mut max_groups = 0;
    for (i, case) in cases().iter().enumerate() {
        let want = sequential(case);
        let groups = conflict_free_groups(&case.moves);
        max_groups = max_groups.max(groups.len());
        // Concurrent semantics: every move of a group reads the memory the
        // group started from; then, to be sure the order inside a group does
        // not matter, the same groups run move by move, backwards.
        let mut snap = case.init.clone();
        let mut back = case.init.clone();
        for g in &groups {
            assert!(is_conflict_free(g), "case {i}: group not conflict-free");
            let before = snap.clone();
            for m in g {
                let (r, d) = range(m);
                snap[d..d + r.len()].copy_from_slice(&before[r]);
            }
            for m in g.iter().rev() {
                let (r, d) = range(m);
                back.copy_within(r, d);
            }
        }
        assert_eq!(snap, want, "case {i}: concurrent groups differ");
        assert_eq!(back, want, "case {i}: reversed groups differ");
    }
    assert!(max_groups > 3, "the random batches should chain moves");
}

/// Runs `kernels/compact.cu` on host threads: `__syncthreads` is a barrier
/// over a block's threads, blocks run one after another (each block's work
/// must not depend on the others', which the contract guarantees), and
/// launches run in order.
const SHIM: &str = r#"
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
struct uint4 { unsigned x, y, z, w; };
struct dim3 { unsigned x = 1, y = 1, z = 1; };
static thread_local dim3 threadIdx, blockIdx, gridDim;
static dim3 blockDim;
static std::barrier<>* block_barrier;
static void __syncthreads() { block_barrier->arrive_and_wait(); }
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#include "compact.cu"

static uint64_t get(FILE* f) {
    uint64_t v;
    if (fread(&v, 8, 1, f) != 1) { fprintf(stderr, "short input\n"); exit(2); }
    return v;
}

struct Launch { unsigned grid; MoveBatch batch; };

int main(int argc, char** argv) {
    FILE* in = fopen(argv[1], "rb");
    std::vector<std::vector<unsigned char>> bufs(get(in));
    std::vector<Launch> launches;
    for (auto& buf : bufs) {
        buf.resize(get(in) + 16);
        // 16-byte aligned start, as device allocations are.
        unsigned char* base = buf.data() + (16 - (uintptr_t)buf.data() % 16) % 16;
        if (fread(base, 1, buf.size() - 16, in) != buf.size() - 16) return 2;
        for (uint64_t l = get(in); l > 0; --l) {
            Launch x{};
            x.grid = (unsigned)get(in);
            x.batch.n = (unsigned)get(in);
            for (unsigned k = 0; k < x.batch.n; ++k) {
                x.batch.moves[k].src = (u64)base + get(in);
                x.batch.moves[k].dst = (u64)base + get(in);
                x.batch.moves[k].len = get(in);
            }
            launches.push_back(x);
        }
    }
    const unsigned threads = 8;
    blockDim.x = threads;
    std::barrier<> bar(threads);
    block_barrier = &bar;
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t)
        pool.emplace_back([t, &launches] {
            threadIdx.x = t;
            for (const Launch& l : launches) {
                gridDim.x = l.grid;
                for (unsigned b = l.grid; b-- > 0;) {  // last block first
                    blockIdx.x = b;
                    gpupool_compact(l.batch);
                    __syncthreads();  // blocks (and launches) one at a time
                }
            }
        });
    for (auto& th : pool) th.join();
    FILE* out = fopen(argv[2], "wb");
    for (auto& buf : bufs) {
        unsigned char* base = buf.data() + (16 - (uintptr_t)buf.data() % 16) % 16;
        fwrite(base, 1, buf.size() - 16, out);
    }
    fclose(out);
    return 0;
}
"#;

/// Builds the emulator, or says why not.
fn build_emulator(dir: &Path) -> Result<PathBuf, String> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let src = dir.join("emulate.cc");
    std::fs::write(&src, SHIM).map_err(|e| e.to_string())?;
    let exe = dir.join("emulate");
    let kernels = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    // Small tiles and staging windows, so that small buffers exercise
    // several tiles per move, the grid-stride loop and multi-window memmove.
    let base = [
        "-std=c++20",
        "-O1",
        "-pthread",
        "-DGPUPOOL_TILE_BYTES=48ull",
        "-DGPUPOOL_STAGE_BYTES=32u",
    ];
    let mut last = String::new();
    // With ThreadSanitizer where it links: it would see a missing barrier
    // inside a block as a data race.
    for extra in [&["-fsanitize=thread"][..], &[]] {
        let out = Command::new(&cxx)
            .args(base)
            .args(extra)
            .arg("-I")
            .arg(&kernels)
            .arg(&src)
            .arg("-o")
            .arg(&exe)
            .output()
            .map_err(|e| format!("{cxx}: {e}"))?;
        if out.status.success() {
            eprintln!("kernel_nvrtc: emulator built with {cxx} {extra:?}");
            return Ok(exe);
        }
        last = String::from_utf8_lossy(&out.stderr).into_owned();
    }
    Err(format!("{cxx} failed: {last}"))
}

#[test]
fn kernel_source_on_host_threads() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("gpupool-kernel-emulation");
    std::fs::create_dir_all(&dir).unwrap();
    let exe = match build_emulator(&dir) {
        Ok(exe) => exe,
        Err(why) if why.contains("No such file") || why.contains("not found") => {
            common::missing(&format!("emulation: no C++ compiler ({why})"));
            return;
        }
        Err(why) => panic!("the kernel does not build as C++: {why}"),
    };
    let cases: Vec<Case> = cases().into_iter().take(1500).collect();
    let mut rng = Rng(7);
    let mut input: Vec<u8> = Vec::new();
    let put = |v: u64, input: &mut Vec<u8>| input.extend_from_slice(&v.to_le_bytes());
    put(cases.len() as u64, &mut input);
    for case in &cases {
        put(case.init.len() as u64, &mut input);
        input.extend_from_slice(&case.init);
        // Launches as the backend makes them, but in random slices smaller
        // than a full batch, and on random grids.
        let mut launches: Vec<Vec<Move>> = Vec::new();
        for g in conflict_free_groups(&case.moves) {
            let mut rest = &g[..];
            while !rest.is_empty() {
                let k = (1 + rng.below(rest.len() as u64 + 2) as usize)
                    .min(rest.len())
                    .min(kernel::MAX_MOVES_PER_LAUNCH);
                launches.push(rest[..k].to_vec());
                rest = &rest[k..];
            }
        }
        put(launches.len() as u64, &mut input);
        for l in launches {
            put(1 + rng.below(5), &mut input);
            put(l.len() as u64, &mut input);
            for m in &l {
                put(m.src.addr(), &mut input);
                put(m.dst.addr(), &mut input);
                put(m.len, &mut input);
            }
        }
    }
    let (inp, outp) = (dir.join("input.bin"), dir.join("output.bin"));
    std::fs::write(&inp, &input).unwrap();
    let status = Command::new(&exe).arg(&inp).arg(&outp).status().unwrap();
    assert!(status.success(), "emulator failed: {status}");
    let output = std::fs::read(&outp).unwrap();
    let mut at = 0;
    for (i, case) in cases.iter().enumerate() {
        let got = &output[at..at + case.init.len()];
        at += case.init.len();
        assert_eq!(
            got,
            &sequential(case)[..],
            "case {i}: kernel result differs"
        );
    }
    assert_eq!(at, output.len());
}

/// Scales a case's offsets and lengths by `k`, keeping its overlaps.
fn scaled(case: &Case, k: u64, rng: &mut Rng) -> Case {
    Case {
        init: (0..case.init.len() as u64 * k)
            .map(|_| rng.next() as u8)
            .collect(),
        moves: case
            .moves
            .iter()
            .map(|m| Move {
                src: DevicePtr(m.src.addr() * k),
                dst: DevicePtr(m.dst.addr() * k),
                len: m.len * k,
            })
            .collect(),
    }
}

/// The same batches through the real backend, where a GPU is present:
/// skipped here, unless `GPUPOOL_REQUIRE_CUDA=1`. With
/// `GPUPOOL_REQUIRE_NVRTC=1` the kernel (not the copy fallback) must run.
#[test]
fn cuda_moves_match_sequential() {
    use gpupool::backend::cuda::CudaBackend;
    use gpupool::Backend;
    let b = match CudaBackend::new() {
        Ok(b) => b,
        Err(e) => {
            let strict = std::env::var("GPUPOOL_REQUIRE_CUDA").as_deref() == Ok("1");
            assert!(
                !strict,
                "GPUPOOL_REQUIRE_CUDA=1 but CUDA could not be opened: {e}"
            );
            eprintln!("kernel_nvrtc: CUDA case SKIPPED: {e}");
            return;
        }
    };
    let kernel = b.move_kernel_ready(0).unwrap();
    eprintln!("kernel_nvrtc: CUDA moves via the kernel: {kernel}");
    assert!(
        kernel || !require_nvrtc(),
        "NVRTC required, kernel not loaded"
    );
    let mut rng = Rng(11);
    let mut all: Vec<Case> = cases().into_iter().take(300).collect();
    let big: Vec<Case> = all[..20]
        .iter()
        .map(|c| scaled(c, 4096, &mut rng))
        .collect();
    all.extend(big);
    // One batch of many small independent moves: several launches.
    all.push(Case {
        init: (0..1000 * 512).map(|_| rng.next() as u8).collect(),
        moves: (0..1000u64)
            .map(|i| Move {
                src: DevicePtr(i * 512),
                dst: DevicePtr(i * 512 + 256),
                len: 200 + i % 56,
            })
            .collect(),
    });
    let s = b.create_stream(0).unwrap();
    let cap = all.iter().map(|c| c.init.len()).max().unwrap() as u64;
    let p = b.alloc_segment(0, cap).unwrap();
    for (i, case) in all.iter().enumerate() {
        b.copy_from_host(0, p, &case.init).unwrap();
        let moves: Vec<Move> = case
            .moves
            .iter()
            .map(|m| Move {
                src: p.offset(m.src.addr()),
                dst: p.offset(m.dst.addr()),
                len: m.len,
            })
            .collect();
        b.enqueue_moves(0, s, &moves).unwrap();
        b.sync_stream(0, s).unwrap();
        let mut got = vec![0u8; case.init.len()];
        b.copy_to_host(0, p, &mut got).unwrap();
        assert!(got == sequential(case), "case {i}: device result differs");
    }
    b.free_segment(0, p).unwrap();
    b.destroy_stream(0, s).unwrap();
}
