//! Request-size and lifetime distributions of the stress workloads.
//!
//! **Training** sizes follow the PyTorch snapshots in `shared/traces`
//! (`lm-small-10steps-train`, `lm-medium-ctx256-train`): by count, about 20%
//! of their allocations are at most 32 KiB, about 52% between 32 KiB and
//! 4 MiB, and about 28% between 8 MiB and 256 MiB (mostly 8–32 MiB). The
//! mixture below keeps those weights, draws log-uniformly inside each band
//! (so every size class is hit), and caps the large band by the simulated
//! capacity so that a few devices fit in host memory.
//!
//! **Serving** models an inference server: requests whose sequence lengths
//! spread over three orders of magnitude (log-uniform 16..8192 tokens),
//! each holding a KV-cache buffer proportional to its length for a random
//! number of decode steps (geometric, mean 25), with short-lived prefill
//! and per-step activation buffers around it.

use std::time::Duration;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// Which traffic the stress run generates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    /// Forward/backward phases: activations allocated layer by layer and
    /// freed in reverse order, with gradient temporaries in between.
    #[default]
    Training,
    /// An inference server: KV buffers of widely varying sizes that live
    /// for random durations, plus short-lived activations.
    Serving,
}

impl std::str::FromStr for Workload {
    type Err = gpupool::Error;
    fn from_str(s: &str) -> gpupool::Result<Workload> {
        match s {
            "training" => Ok(Workload::Training),
            "serving" => Ok(Workload::Serving),
            other => Err(gpupool::Error::InvalidArgument(format!(
                "workload {other:?}: expected training or serving"
            ))),
        }
    }
}

impl std::fmt::Display for Workload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Workload::Training => "training",
            Workload::Serving => "serving",
        })
    }
}

/// A small, fast, seeded generator (xorshift64*): runs with the same seed
/// make the same request sequence per thread.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed` (any value, zero included).
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `lo..=hi` (`lo <= hi`).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + ((self.next_u64() as u128 * (hi - lo + 1) as u128) >> 64) as u64
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        self.range(0, n as u64 - 1) as usize
    }

    /// True with probability `percent` / 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.range(0, 99) < percent
    }

    /// Log-uniform in `lo..=hi` (`1 <= lo <= hi`): as many draws per octave.
    pub fn log_uniform(&mut self, lo: u64, hi: u64) -> u64 {
        let (a, b) = ((lo as f64).ln(), (hi as f64).ln());
        let u = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        ((a + u * (b - a)).exp() as u64).clamp(lo, hi)
    }

    /// A simulated kernel's run time: none 60% of the time, else up to
    /// 2 ms, so that frees often overtake the work still queued on a block.
    pub fn kernel_delay(&mut self) -> Duration {
        if self.chance(60) {
            Duration::ZERO
        } else {
            Duration::from_micros(self.range(1, 2000))
        }
    }
}

/// The size bands of the training mixture for one device capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrainingSizes {
    /// Upper end of the large band: capacity / 64, between 8 and 256 MiB.
    pub large_max: u64,
}

impl TrainingSizes {
    /// Bands for a device of `capacity` bytes.
    pub fn for_capacity(capacity: u64) -> TrainingSizes {
        TrainingSizes {
            large_max: (capacity / 64).clamp(8 * MIB, 256 * MIB),
        }
    }

    /// One request size: 20% in 256 B..32 KiB, 52% in 64 KiB..4 MiB,
    /// 28% in 8 MiB..`large_max`, log-uniform in each band; the low bits
    /// are random, as real requests are not rounded.
    pub fn draw(&self, rng: &mut Rng) -> u64 {
        match rng.range(0, 99) {
            0..=19 => rng.log_uniform(256, 32 * KIB),
            20..=71 => rng.log_uniform(64 * KIB, 4 * MIB),
            _ => rng.log_uniform(8 * MIB, self.large_max),
        }
    }
}

/// The shape of the serving workload for one device capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServingShape {
    /// KV-cache bytes per token: the longest request's KV buffer is
    /// capacity / 64 (at least 8 MiB).
    pub kv_bytes_per_token: u64,
    /// Activation bytes per token of a prefill (a quarter of the KV bytes).
    pub act_bytes_per_token: u64,
}

/// Shortest and longest sequence of a serving request, in tokens.
pub const SEQ_TOKENS: (u64, u64) = (16, 8192);

impl ServingShape {
    /// The shape for a device of `capacity` bytes.
    pub fn for_capacity(capacity: u64) -> ServingShape {
        let longest = (capacity / 64).clamp(8 * MIB, 256 * MIB);
        let kv = (longest / SEQ_TOKENS.1).max(256);
        ServingShape {
            kv_bytes_per_token: kv,
            act_bytes_per_token: (kv / 4).max(64),
        }
    }

    /// A request's sequence length in tokens (log-uniform).
    pub fn tokens(&self, rng: &mut Rng) -> u64 {
        rng.log_uniform(SEQ_TOKENS.0, SEQ_TOKENS.1)
    }

    /// How many decode steps a request lives: geometric with mean 25
    /// (at most 1000).
    pub fn lifetime_steps(&self, rng: &mut Rng) -> u32 {
        let mut n = 1;
        while n < 1000 && !rng.chance(4) {
            n += 1;
        }
        n
    }

    /// One decode step's activation buffer: 4 KiB..256 KiB.
    pub fn step_bytes(&self, rng: &mut Rng) -> u64 {
        rng.log_uniform(4 * KIB, 256 * KIB)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn training_mixture_has_the_trace_weights() {
        let sizes = TrainingSizes::for_capacity(1 << 30);
        assert_eq!(sizes.large_max, 16 * MIB);
        let mut rng = Rng::new(7);
        let mut bands = [0u32; 3];
        for _ in 0..100_000 {
            let s = sizes.draw(&mut rng);
            assert!((256..=16 * MIB).contains(&s), "{s}");
            bands[match s {
                s if s <= 32 * KIB => 0,
                s if s <= 4 * MIB => 1,
                _ => 2,
            }] += 1;
        }
        let pct = bands.map(|b| (b as f64 / 1000.0).round() as u32);
        assert!((19..=21).contains(&pct[0]), "{pct:?}");
        assert!((50..=54).contains(&pct[1]), "{pct:?}");
        assert!((26..=30).contains(&pct[2]), "{pct:?}");
    }

    #[test]
    fn serving_lengths_span_three_decades_and_lifetimes_average_25() {
        let shape = ServingShape::for_capacity(1 << 30);
        let mut rng = Rng::new(3);
        let toks: Vec<u64> = (0..20_000).map(|_| shape.tokens(&mut rng)).collect();
        assert!(toks.iter().all(|t| (16..=8192).contains(t)));
        assert!(toks.iter().filter(|&&t| t < 64).count() > 3000);
        assert!(toks.iter().filter(|&&t| t > 2048).count() > 3000);
        let mean = (0..20_000)
            .map(|_| shape.lifetime_steps(&mut rng) as f64)
            .sum::<f64>()
            / 20_000.0;
        assert!((23.0..27.0).contains(&mean), "{mean}");
        assert_eq!(shape.kv_bytes_per_token * 8192, 16 * MIB);
    }

    #[test]
    fn workload_names_round_trip_and_bad_ones_are_typed_errors() {
        for w in [Workload::Training, Workload::Serving] {
            assert_eq!(w.to_string().parse::<Workload>().unwrap(), w);
        }
        assert!(matches!(
            "inference".parse::<Workload>(),
            Err(gpupool::Error::InvalidArgument(_))
        ));
    }
}
