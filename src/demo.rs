//! The demo behind `gpupool demo`: the data-parallel training harness
//! ([`crate::train`]) on every device of the embedded default backend
//! (CUDA if a driver and device exist, else 4 simulated devices), with a
//! batch schedule that grows and then shrinks the pools, traffic on
//! several streams per device, idle-time work after each step (a
//! compaction pass and the idle release test, run by the demo itself at a
//! known point, see [`crate::train::IdleWork`]), a per-device report and
//! an SVG plot of memory over time.
//!
//! The demo passes or fails by [`TrainReport::ok`](crate::train::TrainReport::ok)
//! alone, whose checks hold in every interleaving of the threads: the exit
//! status does not depend on timing.

use crate::error::Result;
use crate::runtime::Runtime;
use crate::trace::plot::{line_chart, Series};
use crate::train::{self, IdleWork, TrainOptions, TrainReport};
use std::path::PathBuf;
use std::time::Duration;

/// Knobs of the demo.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Training steps, spread evenly over the batch phases.
    pub steps: usize,
    /// Batch size of each phase, in order.
    pub phases: Vec<usize>,
    /// Micro-batches accumulated per step.
    pub micro_batches: usize,
    /// Streams per device.
    pub streams: usize,
    /// Transformer-shaped model: layers, activation bytes per sample and
    /// layer, gradient buckets and their size.
    pub layers: usize,
    /// See [`DemoOptions::layers`].
    pub activation_bytes: usize,
    /// See [`DemoOptions::layers`].
    pub buckets: usize,
    /// See [`DemoOptions::layers`].
    pub bucket_bytes: usize,
    /// Host idle gap after each step (after the demo's own idle work; the
    /// maintenance threads see an idle pool in it).
    pub idle_gap: Duration,
    /// Where to write the SVG plot (`None`: no plot).
    pub plot: Option<PathBuf>,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            steps: 9,
            phases: vec![32, 64, 16],
            micro_batches: 2,
            streams: 3,
            // 24 layers at 48 KiB per sample and layer (times 1 to 3):
            // about 75 MiB of activations per micro-batch at batch 32 and
            // 150 MiB at 64, beside 8 gradient buckets of 1 MiB: a step at
            // a scale where granule rounding no longer decides the figures.
            layers: 24,
            activation_bytes: 48 << 10,
            buckets: 8,
            bucket_bytes: 1 << 20,
            idle_gap: Duration::from_millis(20),
            plot: Some(PathBuf::from("target/gpupool-demo.svg")),
        }
    }
}

impl DemoOptions {
    /// The batch size of each step.
    pub fn batches(&self) -> Vec<usize> {
        let n = self.phases.len().max(1);
        (0..self.steps)
            .map(|i| {
                self.phases
                    .get(i * n / self.steps.max(1))
                    .copied()
                    .unwrap_or(32)
            })
            .collect()
    }
}

/// The report of `gpupool demo --json`: the harness report plus the plot.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DemoReport {
    /// The harness report (its keys are the demo's top-level keys).
    #[serde(flatten)]
    pub train: TrainReport,
    /// Batch size of each step.
    pub batches: Vec<usize>,
    /// The SVG written, if any.
    pub plot: Option<PathBuf>,
}

/// Runs the demo on every device of `rt`, writing the plot if asked.
pub fn run(rt: &Runtime, opts: &DemoOptions) -> Result<DemoReport> {
    let t = TrainOptions {
        batches: opts.batches(),
        micro_batches: opts.micro_batches,
        streams: opts.streams,
        layers: opts.layers,
        activation_bytes: opts.activation_bytes,
        // Kernels write and verify the first 256 KiB of each activation.
        activation_check_bytes: 256 << 10,
        buckets: opts.buckets,
        bucket_bytes: opts.bucket_bytes,
        idle_gap: opts.idle_gap,
        idle_work: Some(IdleWork {
            compact: true,
            release_fraction: Some(rt.config().release_fraction),
        }),
        ..Default::default()
    };
    let train = train::run(rt, &t)?;
    let plot = match &opts.plot {
        Some(p) => {
            if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)?;
            }
            std::fs::write(p, plot_svg(&train))?;
            Some(p.clone())
        }
        None => None,
    };
    Ok(DemoReport {
        train,
        batches: t.batches,
        plot,
    })
}

/// Live and reserved bytes of every device over time, as an SVG.
pub fn plot_svg(r: &TrainReport) -> String {
    const LIVE: [&str; 4] = ["#1f77b4", "#2ca02c", "#9467bd", "#17becf"];
    const RESERVED: [&str; 4] = ["#d62728", "#ff7f0e", "#8c564b", "#e377c2"];
    let names: Vec<(String, String)> = r
        .devices
        .iter()
        .map(|d| {
            (
                format!("device {} live", d.device),
                format!("device {} reserved", d.device),
            )
        })
        .collect();
    let mut series = Vec::new();
    for (i, d) in r.devices.iter().enumerate() {
        let pts = |f: fn(&train::Sample) -> u64| {
            d.samples
                .iter()
                .map(|s| (s.t_ms, f(s) as f64))
                .collect::<Vec<_>>()
        };
        series.push(Series {
            name: &names[i].0,
            colour: LIVE[i % 4],
            points: pts(|s| s.live_bytes),
        });
        series.push(Series {
            name: &names[i].1,
            colour: RESERVED[i % 4],
            points: pts(|s| s.reserved_bytes),
        });
    }
    let title = format!(
        "gpupool demo on {} ({} devices): live vs reserved memory",
        r.backend,
        r.devices.len()
    );
    line_chart(&title, "ms", "MiB", (1u64 << 20) as f64, &series)
}

impl std::fmt::Display for DemoReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "gpupool demo, batch sizes per step {:?}", self.batches)?;
        write!(f, "{}", self.train)?;
        if let Some(p) = &self.plot {
            write!(f, "\nplot: {}", p.display())?;
        }
        Ok(())
    }
}
