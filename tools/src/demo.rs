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

use crate::trace::plot::{line_chart, Series};
use crate::train::{self, IdleWork, TrainOptions, TrainReport};
use gpupool::runtime::Runtime;
use gpupool::Result;
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
            steps: 12,
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

/// The report of `gpupool demo --json`: the harness report, the same steps
/// beside PyTorch's allocator, and the plot.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DemoReport {
    /// The harness report (its keys are the demo's top-level keys).
    #[serde(flatten)]
    pub train: TrainReport,
    /// Batch size of each step.
    pub batches: Vec<usize>,
    /// Device 0's run beside PyTorch's caching allocator (ported) in both
    /// modes, replaying the same allocations and frees.
    pub side_by_side: Option<SideBySide>,
    /// The SVG written, if any.
    pub plot: Option<PathBuf>,
}

/// One allocator's figures for device 0's run of the demo.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AllocatorFigures {
    /// `gpupool`, `torch` or `torch_expandable`.
    pub allocator: &'static str,
    /// Peak device memory held.
    pub peak_reserved_bytes: u64,
    /// `peak_reserved / peak_live - 1`.
    pub overhead: f64,
    /// Memory-management driver calls per step (create, release, alloc,
    /// free, reserve, map, unmap, set access; events are not compared).
    pub driver_calls_per_step: f64,
    /// Modeled driver milliseconds per step (the cost table of
    /// `docs/BENCHMARKS.md`).
    pub driver_ms_per_step: f64,
}

/// gpupool beside the PyTorch port for the same step sequence.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SideBySide {
    /// Allocations and frees compared (device 0's recorded history).
    pub events: usize,
    /// Peak of requested bytes live.
    pub peak_live_bytes: u64,
    /// gpupool, then the two PyTorch modes.
    pub allocators: Vec<AllocatorFigures>,
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
    let dev0 = rt.device(0)?;
    dev0.record_history(true);
    let calls_before = rt.backend().counters();
    let train = train::run(rt, &t)?;
    let calls = rt.backend().counters().since(&calls_before);
    dev0.record_history(false);
    let side_by_side = side_by_side(rt, &dev0.history(), &calls, &train, t.batches.len())?;
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
        side_by_side,
        plot,
    })
}

/// The driver calls the side-by-side compares: those that make, map and
/// give back device memory.
const MEMORY_CALLS: [gpupool::backend::Call; 9] = gpupool::backend::Call::MEMORY;

/// Replays device 0's recorded allocations and frees through the PyTorch
/// port in both modes, beside gpupool's figures for the same run (its
/// driver calls are the backend's over the run, split evenly over the
/// devices, which all run the same steps). Movable checkpoints are not in
/// the history (they are gpupool's own feature); the rest is.
fn side_by_side(
    rt: &Runtime,
    history: &[gpupool::pool::HistoryEvent],
    calls: &gpupool::backend::BackendCounters,
    train: &TrainReport,
    steps: usize,
) -> Result<Option<SideBySide>> {
    use crate::trace::peers::{run::from_empty, TorchConfig};
    use crate::trace::{Trace, TraceEvent, TraceFormat};
    use gpupool::pool::HistoryAction;
    let Some(d0) = train.devices.first() else {
        return Ok(None);
    };
    let mut trace = Trace::new("demo device 0", TraceFormat::Lifetimes);
    let mut ids = std::collections::HashMap::new();
    let mut next = 0u64;
    for e in history {
        match e.action {
            HistoryAction::Alloc => {
                ids.insert(e.addr, next);
                trace.events.push(TraceEvent::Alloc {
                    id: next,
                    size: e.size,
                    stream: e.stream,
                });
                next += 1;
            }
            HistoryAction::FreeRequested => {
                if let Some(id) = ids.remove(&e.addr) {
                    trace.events.push(TraceEvent::Free {
                        id,
                        stream: e.stream,
                    });
                }
            }
        }
    }
    if trace.events.is_empty() {
        return Ok(None);
    }
    let live = trace.peak_live_bytes();
    let per_step = |x: f64| x / steps.max(1) as f64;
    let table = &rt.config().driver_costs;
    let devices = rt.device_count().max(1) as f64;
    // Memory-management calls only: a trace has no `record_stream`, so
    // the port records no events, and the harness's own kernels and
    // events are not the allocator's.
    let mut calls = calls.clone();
    calls
        .calls
        .retain(|name, _| MEMORY_CALLS.iter().any(|c| c.name() == *name));
    calls
        .units
        .retain(|name, _| MEMORY_CALLS.iter().any(|c| c.name() == *name));
    let calls = &calls;
    let mut allocators = vec![AllocatorFigures {
        allocator: "gpupool",
        peak_reserved_bytes: d0.peak_reserved_bytes,
        overhead: d0.peak_reserved_bytes as f64 / d0.peak_live_bytes.max(1) as f64 - 1.0,
        driver_calls_per_step: per_step(calls.total_calls() as f64 / devices),
        driver_ms_per_step: per_step(table.millis(calls) / devices),
    }];
    for (name, expandable) in [("torch", false), ("torch_expandable", true)] {
        let mut run = from_empty(
            TorchConfig {
                expandable_segments: expandable,
                capacity_bytes: d0.peak_live_bytes.max(1) * 4 + (1 << 30),
                ..Default::default()
            },
            &trace,
        )?;
        run.cost(table)?;
        let n: u64 = run
            .driver_calls
            .cold
            .iter()
            .filter(|(name, _)| MEMORY_CALLS.iter().any(|c| c.name() == **name))
            .map(|(_, n)| n)
            .sum();
        allocators.push(AllocatorFigures {
            allocator: name,
            peak_reserved_bytes: run.peak_reserved_bytes,
            overhead: run.overhead,
            driver_calls_per_step: per_step(n as f64),
            driver_ms_per_step: per_step(run.driver_ms.cold),
        });
    }
    Ok(Some(SideBySide {
        events: trace.events.len(),
        peak_live_bytes: live,
        allocators,
    }))
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
        if let Some(s) = &self.side_by_side {
            writeln!(
                f,
                "\nthe same steps beside PyTorch's allocator (device 0's {} allocations and frees, \
                 peak live {:.1} MiB; driver time modeled):",
                s.events,
                s.peak_live_bytes as f64 / (1 << 20) as f64
            )?;
            writeln!(
                f,
                "  {:<18} {:>12} {:>9} {:>16} {:>16}",
                "allocator", "peak resv", "overhead", "driver calls/step", "driver ms/step"
            )?;
            for a in &s.allocators {
                writeln!(
                    f,
                    "  {:<18} {:>8.1} MiB {:>8.2}% {:>16.1} {:>16.2}",
                    a.allocator,
                    a.peak_reserved_bytes as f64 / (1 << 20) as f64,
                    a.overhead * 100.0,
                    a.driver_calls_per_step,
                    a.driver_ms_per_step
                )?;
            }
            let devices = self.train.devices.len().max(1) as u64;
            let by_step: Vec<u64> = self
                .train
                .memory_calls_by_step
                .iter()
                .map(|n| n / devices)
                .collect();
            writeln!(
                f,
                "  gpupool's memory driver calls by step, per device: {by_step:?}\n  (a phase's \
                 first step departs from the learned plan and grows, its second is recorded, \
                 the mark before its third sets up the new plan's arena, and the steps that \
                 follow it need none; the maintenance threads' share depends on timing)"
            )?;
        }
        if let Some(p) = &self.plot {
            write!(f, "\nplot: {}", p.display())?;
        }
        Ok(())
    }
}
