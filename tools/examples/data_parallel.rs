//! The data-parallel training harness from the command line.
//!
//! ```text
//! cargo run --release --example data_parallel -- --devices 4 \
//!     --schedule 32x3,64x3,16x3 --micro-batches 2 --idle-release-ms 10
//! ```
//!
//! Runs on CUDA when a driver and device exist (`--backend auto`), else on
//! simulated devices, and prints the harness report (`--json` for JSON).

use anyhow::{bail, Context, Result};
use clap::Parser;
use gpupool::{BackendKind, PoolConfig, Runtime};
use gpupool_tools::train::{self, TrainOptions};
use std::time::Duration;

#[derive(Parser)]
struct Args {
    /// sim, cuda or auto.
    #[arg(long, default_value = "sim")]
    backend: String,
    /// Simulated devices.
    #[arg(long, default_value_t = 4)]
    devices: usize,
    /// Batch schedule: BATCHxSTEPS phases, comma separated.
    #[arg(long, default_value = "32x3,64x3,16x3")]
    schedule: String,
    /// Micro-batches accumulated before each all-reduce.
    #[arg(long, default_value_t = 2)]
    micro_batches: usize,
    /// Layers of the model.
    #[arg(long, default_value_t = 8)]
    layers: usize,
    /// Streams per device.
    #[arg(long, default_value_t = 3)]
    streams: usize,
    /// Idle gap after each step, in milliseconds.
    #[arg(long, default_value_t = 30)]
    idle_ms: u64,
    /// Idle time before the maintenance thread gives surplus cache back.
    #[arg(long, default_value_t = 10)]
    idle_release_ms: u64,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn schedule(s: &str) -> Result<Vec<usize>> {
    let mut phases = Vec::new();
    for p in s.split(',') {
        let (b, n) = p.split_once('x').context("a phase is BATCHxSTEPS")?;
        phases.push((b.trim().parse()?, n.trim().parse()?));
    }
    Ok(TrainOptions::schedule(&phases))
}

fn main() -> Result<()> {
    let a = Args::parse();
    let mut cfg = PoolConfig::parse(&format!("idle_release_ms={}", a.idle_release_ms))?;
    cfg.sim.devices = a.devices;
    let kind = match a.backend.as_str() {
        "sim" => BackendKind::Sim(cfg.sim.clone()),
        "cuda" => BackendKind::Cuda,
        "auto" => BackendKind::Auto,
        other => bail!("--backend {other}: sim, cuda or auto"),
    };
    let rt = Runtime::builder().backend(kind).config(cfg).build()?;
    let opts = TrainOptions {
        batches: schedule(&a.schedule)?,
        micro_batches: a.micro_batches,
        layers: a.layers,
        streams: a.streams,
        idle_gap: Duration::from_millis(a.idle_ms),
        ..Default::default()
    };
    let report = train::run(&rt, &opts)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("{report}");
    }
    if !report.ok() {
        bail!("a harness check failed");
    }
    Ok(())
}
