use gpupool::backend::sim::SimBacking;
use gpupool::*;
use std::time::Instant;
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z as u128 * n as u128) >> 64) as u64
    }
}
fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .map(|s| s.parse().unwrap())
        .unwrap_or(100_000);
    let reps: usize = std::env::args()
        .nth(2)
        .map(|s| s.parse().unwrap())
        .unwrap_or(5);
    let rt = Runtime::builder()
        .backend(BackendKind::Sim(SimConfig {
            devices: 1,
            capacity_bytes: 64 << 30,
            backing: SimBacking::Accounting,
            ..Default::default()
        }))
        .config(PoolConfig::default())
        .maintenance(std::env::var_os("NOMAINT").is_none())
        .build()
        .unwrap();
    let dev = rt.device(0).unwrap();
    let s = dev.new_stream().unwrap();
    for rep in 0..reps {
        let mut rng = Rng(0x05EE_D0FA_110C);
        let mut live: Vec<(Block, u64)> = Vec::new();
        let (mut count, mut bytes, mut ops) = (0u64, 0u64, 0u64);
        let t = Instant::now();
        for _ in 0..2 * n {
            let size = 1 + rng.below(1 << 20);
            let do_alloc =
                live.is_empty() || (rng.below(100) < 73 && count < n && bytes + size < 16000 << 20);
            if do_alloc {
                ops += 1;
                let b = dev.alloc(size as usize, &s).unwrap();
                live.push((b, size));
                count += 1;
                bytes += size;
                continue;
            }
            if !live.is_empty() {
                let i = rng.below(live.len() as u64) as usize;
                let (_, sz) = live.swap_remove(i);
                bytes -= sz;
                ops += 1;
            }
        }
        ops += live.len() as u64;
        live.clear();
        let st = dev.stats();
        println!(
            "rep {rep}: {:.0} ns/op ops={ops} reserved_peak={} grown={}",
            t.elapsed().as_nanos() as f64 / ops as f64,
            st.reserved_bytes.peak,
            st.num_device_allocs
        );
    }
}
