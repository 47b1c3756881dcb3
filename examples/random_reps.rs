//! RAPIDS RMM's `random_allocations` loop at n = 10^5 over one pool, the
//! same loop, RNG and seed as `gpupool bench` (maintenance off), repeated
//! N times; prints each repetition's ns per operation. The driver behind
//! the per-operation cachegrind counts in docs/BENCHMARKS.md §2:
//!
//! ```sh
//! cargo build --release --example random_reps
//! valgrind --tool=cachegrind --cache-sim=yes --D1=32768,8,64 --LL=524288,8,64 \
//!     target/release/examples/random_reps 4     # and again with 2:
//! # per operation = (count(4) - count(2)) / 400,000
//! ```

use gpupool::backend::sim::{SimBacking, SimConfig};
use gpupool::{BackendKind, Block, PoolConfig, Runtime};
use std::time::Instant;
/// The bench's generator (splitmix64).
struct Rng(u64);
impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}
fn main() -> gpupool::Result<()> {
    let reps: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    let n: u64 = 100_000;
    let rt = Runtime::builder()
        .backend(BackendKind::Sim(SimConfig {
            devices: 1,
            capacity_bytes: 64 << 30,
            backing: SimBacking::Accounting,
            ..Default::default()
        }))
        .config(PoolConfig::default())
        .maintenance(false)
        .build()?;
    let dev = rt.device(0)?;
    let s = dev.new_stream()?;
    for _ in 0..reps {
        let mut rng = Rng(0x05EE_D0FA_110C);
        let mut live: Vec<Block> = Vec::with_capacity(n as usize);
        let (mut count, mut bytes, mut ops) = (0u64, 0u64, 0u64);
        let t = Instant::now();
        for _ in 0..2 * n {
            let size = 1 + rng.below(1 << 20);
            let do_alloc = live.is_empty()
                || (rng.below(100) < 73 && count < n && bytes + size < 16_000 << 20);
            if do_alloc {
                ops += 1;
                match dev.alloc(size as usize, &s) {
                    Ok(b) => {
                        live.push(b);
                        count += 1;
                        bytes += size;
                        continue;
                    }
                    Err(e) if e.is_oom() => {}
                    Err(e) => return Err(e),
                }
            }
            if !live.is_empty() {
                let i = rng.below(live.len() as u64) as usize;
                let b = live.swap_remove(i);
                bytes -= b.size() as u64;
                ops += 1;
            }
        }
        ops += live.len() as u64;
        live.clear();
        let st = dev.reserved_bytes();
        println!(
            "{:.1} ns/op ops {} reserved {:.2} GB",
            t.elapsed().as_nanos() as f64 / ops as f64,
            ops,
            st as f64 / 1e9
        );
    }
    Ok(())
}
