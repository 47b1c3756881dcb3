//! Writes the serving workload of `gpupool stress --workload serving` (one
//! thread, one stream) as a lifetimes CSV (`id,lower,upper,size`), so that
//! `gpupool replay` runs it through gpupool and the PyTorch ports side by
//! side: a workload whose sizes never repeat, where steady state is the
//! question. Same shape and generator as the stress run (requests of
//! 16..8192 tokens, at most 16 active, KV caches growing by reallocation,
//! a prefill and a per-step activation buffer around them).
//!
//! ```sh
//! cargo run --release --example serving_trace -- 200000 > /tmp/serving.csv
//! cargo run --release -- replay --dynamic /tmp/serving.csv
//! ```
//!
//! Arguments: allocations to write (default 200,000), device capacity in
//! MiB that sizes the requests (default 1024), seed (default 1).

use gpupool_tools::stress::workload::{Rng, ServingShape};
use std::collections::VecDeque;
use std::io::Write;

/// Most concurrent requests (as `stress/serving.rs`).
const MAX_BATCH: usize = 16;

struct Trace {
    /// `(lower, upper, size)` by id; `upper` is set at the free.
    rows: Vec<(u64, u64, u64)>,
    now: u64,
}

impl Trace {
    fn alloc(&mut self, size: u64) -> usize {
        self.now += 1;
        self.rows.push((self.now, u64::MAX, size));
        self.rows.len() - 1
    }
    fn free(&mut self, id: usize) {
        self.now += 1;
        self.rows[id].1 = self.now;
    }
}

struct Request {
    kv: usize,
    tokens: u64,
    steps_left: u32,
}

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(200_000);
    let capacity_mib: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(1024);
    let seed: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(1);
    let shape = ServingShape::for_capacity(capacity_mib << 20);
    let mut rng = Rng::new(seed);
    let mut t = Trace {
        rows: Vec::with_capacity(n),
        now: 0,
    };
    let mut active: VecDeque<Request> = VecDeque::new();
    while t.rows.len() < n {
        if active.len() < MAX_BATCH && (active.is_empty() || rng.chance(30)) {
            let tokens = shape.tokens(&mut rng);
            let steps_left = shape.lifetime_steps(&mut rng);
            let kv = t.alloc(tokens * shape.kv_bytes_per_token);
            let prefill = t.alloc(tokens * shape.act_bytes_per_token);
            t.free(prefill);
            active.push_back(Request {
                kv,
                tokens,
                steps_left,
            });
        }
        let mut i = 0;
        while i < active.len() {
            let r = &mut active[i];
            r.steps_left -= 1;
            let tmp = t.alloc(shape.step_bytes(&mut rng));
            t.free(tmp);
            if rng.chance(12) {
                let tokens = r.tokens + 8;
                let bigger = t.alloc(tokens * shape.kv_bytes_per_token);
                let old = std::mem::replace(&mut r.kv, bigger);
                r.tokens = tokens;
                t.free(old);
            }
            if active[i].steps_left == 0 {
                let done = active.remove(i).expect("index in range");
                t.free(done.kv);
            } else {
                i += 1;
            }
        }
    }
    for r in active.drain(..) {
        t.free(r.kv);
    }
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    writeln!(out, "id,lower,upper,size")?;
    for (id, (lo, hi, size)) in t.rows.iter().enumerate() {
        writeln!(out, "{id},{lo},{hi},{size}")?;
    }
    Ok(())
}
