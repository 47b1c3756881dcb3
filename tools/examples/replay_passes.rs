//! Replays one trace file N times over the same pool and prints each pass's
//! granule maps and time: the driver behind the per-pass instruction counts
//! in docs/BENCHMARKS.md §1 ("Stitching in runs").
//!
//! ```sh
//! cargo build --release --example replay_passes
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!     target/release/examples/replay_passes TRACE 12    # and again with 2:
//! # instructions per warm pass = (I(12) - I(2)) / 10
//! ```

use gpupool::backend::sim::{SimBacking, SimConfig};
use gpupool::backend::Call;
use gpupool::{BackendKind, Block, PoolConfig, Runtime};
use gpupool_tools::trace::{read_file, TraceEvent};
use std::time::Instant;

fn main() -> gpupool::Result<()> {
    let mut args = std::env::args().skip(1);
    let Some(path) = args.next() else {
        eprintln!("usage: replay_passes TRACE [PASSES]");
        std::process::exit(2);
    };
    let passes: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(10);
    let trace = read_file(&path)?;
    let sim = SimConfig {
        devices: 1,
        capacity_bytes: (trace.peak_live_bytes().max(1 << 30) * 2).next_power_of_two(),
        backing: SimBacking::Accounting,
        sync_streams: true,
        ..Default::default()
    };
    let rt = Runtime::builder()
        .backend(BackendKind::Sim(sim))
        .config(PoolConfig::default())
        .maintenance(false)
        .build()?;
    let pool = rt.device(0)?;
    let stream = pool.new_stream()?;
    let maps = || pool.backend().counters().get(Call::Map);
    for pass in 0..passes {
        let mut blocks: Vec<Option<Block>> = (0..trace.id_bound()).map(|_| None).collect();
        let (m0, t0) = (maps(), Instant::now());
        for e in &trace.events {
            match *e {
                TraceEvent::Alloc { id, size, .. } => {
                    blocks[id as usize] = Some(pool.alloc(size as usize, &stream)?);
                }
                TraceEvent::Free { id, .. } => {
                    blocks[id as usize] = None;
                }
            }
        }
        drop(blocks);
        let secs = t0.elapsed().as_secs_f64();
        println!(
            "pass {pass}: {} maps, {:.3} ms, {:.2} M events/s",
            maps() - m0,
            secs * 1e3,
            trace.events.len() as f64 / secs / 1e6
        );
    }
    Ok(())
}
