//! What a harness run reports.

use super::TrainOptions;
use crate::backend::sim::VerifyResult;
use crate::pool::PoolStats;
use crate::runtime::{MaintenanceStats, Runtime};
use std::fmt;
use std::sync::Arc;

/// One point of a device's memory over time.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Sample {
    /// Milliseconds since the run started.
    pub t_ms: f64,
    /// Requested bytes of live blocks.
    pub live_bytes: u64,
    /// Device memory held by the pool.
    pub reserved_bytes: u64,
}

/// Per-device figures of a run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeviceReport {
    /// Device index.
    pub device: usize,
    /// Steps run.
    pub steps: usize,
    /// Steps per second (step work only, idle gaps excluded).
    pub steps_per_sec: f64,
    /// Peak requested bytes.
    pub peak_live_bytes: u64,
    /// Peak device memory held by the pool.
    pub peak_reserved_bytes: u64,
    /// `peak_reserved / peak_live - 1`.
    pub overhead: f64,
    /// Reserved bytes right after each step.
    pub reserved_after_step: Vec<u64>,
    /// Reserved bytes after each step's idle gap (the maintenance
    /// thread's idle release shows here).
    pub reserved_after_idle: Vec<u64>,
    /// Allocations in total.
    pub allocs: u64,
    /// Allocations served without new device memory.
    pub allocs_from_cache: u64,
    /// Frees parked on the pending list (cross-stream uses).
    pub pending_frees: u64,
    /// Pending blocks handed to another stream without a host sync.
    pub handovers: u64,
    /// Host-blocking syncs on this device during the alloc/free phases
    /// (the harness makes none there: these are the pool's).
    pub host_syncs_on_alloc_path: u64,
    /// Bytes the simulator's verify kernels found wrong (0 on CUDA, where
    /// activations are not verified).
    pub integrity_errors: u64,
    /// Compaction passes that moved blocks (idle-time ones, run by the
    /// maintenance thread between steps).
    pub compaction_passes: u64,
    /// Bytes those passes moved.
    pub compaction_bytes_moved: u64,
    /// What the device's maintenance thread did (`None` without threads).
    pub maintenance: Option<MaintenanceStats>,
    /// Memory over time.
    #[serde(skip)]
    pub samples: Vec<Sample>,
    #[serde(skip)]
    pub(super) step_seconds: Vec<f64>,
    #[serde(skip)]
    pub(super) verifies: Vec<Arc<VerifyResult>>,
}

impl DeviceReport {
    pub(super) fn new(device: usize) -> DeviceReport {
        DeviceReport {
            device,
            steps: 0,
            steps_per_sec: 0.0,
            peak_live_bytes: 0,
            peak_reserved_bytes: 0,
            overhead: 0.0,
            reserved_after_step: Vec::new(),
            reserved_after_idle: Vec::new(),
            allocs: 0,
            allocs_from_cache: 0,
            pending_frees: 0,
            handovers: 0,
            host_syncs_on_alloc_path: 0,
            integrity_errors: 0,
            compaction_passes: 0,
            compaction_bytes_moved: 0,
            maintenance: None,
            samples: Vec::new(),
            step_seconds: Vec::new(),
            verifies: Vec::new(),
        }
    }

    pub(super) fn finish(
        mut self,
        o: &TrainOptions,
        st: &PoolStats,
        maintenance: Option<MaintenanceStats>,
    ) -> DeviceReport {
        let busy: f64 = self.step_seconds.iter().sum();
        self.steps = o.batches.len();
        self.steps_per_sec = self.steps as f64 / busy.max(1e-9);
        self.peak_live_bytes = st.allocated_bytes.peak;
        self.peak_reserved_bytes = st.reserved_bytes.peak;
        self.overhead = st.reserved_bytes.peak as f64 / st.allocated_bytes.peak.max(1) as f64 - 1.0;
        self.allocs = st.num_allocs;
        self.allocs_from_cache = st.num_allocs.saturating_sub(st.num_allocs_grown);
        self.pending_frees = st.num_pending_frees;
        self.handovers = st.num_handovers;
        self.maintenance = maintenance;
        self
    }
}

/// One run of equal batch sizes.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PhaseReport {
    /// Batch size.
    pub batch: usize,
    /// First step of the phase.
    pub first_step: usize,
    /// Steps in the phase.
    pub steps: usize,
    /// Largest reserved bytes after a step of the phase, over devices.
    pub max_reserved_after_step: u64,
    /// Reserved bytes after the phase's last idle gap, summed over devices.
    pub reserved_at_end: u64,
    /// Whether some device's reserved bytes grew after the phase's second
    /// step (the pool should have what a fixed batch needs by then).
    pub grew_after_second_step: bool,
}

/// The report of a harness run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TrainReport {
    /// Backend name.
    pub backend: String,
    /// Collective used (`host` or `nccl`).
    pub collective: String,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Per-device figures.
    pub devices: Vec<DeviceReport>,
    /// Whether every device held identical buckets after every all-reduce.
    pub gradients_match: bool,
    /// Whether the buckets also equalled the host-computed sums (`None`
    /// when not verified).
    pub gradients_expected: Option<bool>,
    /// Whether every device ended with identical weights.
    pub weights_match: bool,
    /// Phases of equal batch size.
    pub phases: Vec<PhaseReport>,
    /// No phase grew after its second step.
    pub no_growth_after_step2: bool,
    /// Wall time in seconds.
    pub seconds: f64,
}

impl TrainReport {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        rt: &Runtime,
        o: &TrainOptions,
        collective: &str,
        devices: Vec<DeviceReport>,
        gradients_match: bool,
        gradients_expected: Option<bool>,
        weights_match: bool,
        seconds: f64,
    ) -> TrainReport {
        let phases = phases(o, &devices);
        TrainReport {
            backend: rt.backend().name().to_string(),
            collective: collective.to_string(),
            micro_batches: o.micro_batches,
            no_growth_after_step2: phases.iter().all(|p| !p.grew_after_second_step),
            devices,
            gradients_match,
            gradients_expected,
            weights_match,
            phases,
            seconds,
        }
    }

    /// Whether every check passed: identical (and, if verified, expected)
    /// gradients, identical weights, no growth after step 2, no integrity
    /// error, no host sync on the alloc path.
    pub fn ok(&self) -> bool {
        self.gradients_match
            && self.gradients_expected != Some(false)
            && self.weights_match
            && self.no_growth_after_step2
            && self
                .devices
                .iter()
                .all(|d| d.integrity_errors == 0 && d.host_syncs_on_alloc_path == 0)
    }
}

fn phases(o: &TrainOptions, devices: &[DeviceReport]) -> Vec<PhaseReport> {
    let mut out: Vec<PhaseReport> = Vec::new();
    for (i, &b) in o.batches.iter().enumerate() {
        match out.last_mut() {
            Some(p) if p.batch == b => p.steps += 1,
            _ => out.push(PhaseReport {
                batch: b,
                first_step: i,
                steps: 1,
                max_reserved_after_step: 0,
                reserved_at_end: 0,
                grew_after_second_step: false,
            }),
        }
    }
    for p in &mut out {
        let range = p.first_step..p.first_step + p.steps;
        let last = p.first_step + p.steps - 1;
        for d in devices {
            let after = &d.reserved_after_step[range.clone()];
            p.max_reserved_after_step = p
                .max_reserved_after_step
                .max(after.iter().copied().max().unwrap_or(0));
            p.reserved_at_end += d.reserved_after_idle[last];
            if let Some(&second) = after.get(1) {
                p.grew_after_second_step |= after[2..].iter().any(|&r| r > second);
            }
        }
    }
    out
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

impl fmt::Display for TrainReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} device(s) on {}, all-reduce: {}, {} micro-batch(es) per step, {:.2} s",
            self.devices.len(),
            self.backend,
            self.collective,
            self.micro_batches,
            self.seconds
        )?;
        writeln!(
            f,
            "{:>6} {:>8} {:>10} {:>12} {:>12} {:>9} {:>11} {:>8} {:>10} {:>10} {:>12}",
            "device",
            "steps/s",
            "allocs",
            "peak live",
            "peak resv",
            "overhead",
            "from cache",
            "pending",
            "host syncs",
            "integrity",
            "maint ticks"
        )?;
        for d in &self.devices {
            writeln!(
                f,
                "{:>6} {:>8.1} {:>10} {:>8.1} MiB {:>8.1} MiB {:>8.2}% {:>11} {:>8} {:>10} {:>10} {:>12}",
                d.device,
                d.steps_per_sec,
                d.allocs,
                mib(d.peak_live_bytes),
                mib(d.peak_reserved_bytes),
                d.overhead * 100.0,
                d.allocs_from_cache,
                d.pending_frees,
                d.host_syncs_on_alloc_path,
                d.integrity_errors,
                d.maintenance.as_ref().map_or(0, |m| m.ticks)
            )?;
        }
        for d in &self.devices {
            if let Some(m) = &d.maintenance {
                let bind = match &m.binding {
                    Some(crate::runtime::ThreadBinding::Bound { cpus }) => {
                        format!("bound to {} CPU(s)", cpus.len())
                    }
                    Some(crate::runtime::ThreadBinding::Unbound { .. }) => "unbound".into(),
                    None => "not started".into(),
                };
                writeln!(
                    f,
                                        "maintenance {}: {} ticks, {} harvested, {} idle ticks, {} release(s) giving back {:.1} MiB, {} compaction pass(es) moving {:.2} MiB, {bind}",
                    m.thread,
                    m.ticks,
                    m.harvested,
                    m.idle_ticks,
                    m.releases,
                    mib(m.released_bytes),
                    d.compaction_passes,
                    mib(d.compaction_bytes_moved)
                )?;
            }
        }
        writeln!(
            f,
            "phases (batch x steps: max reserved after a step -> reserved at end, all devices):"
        )?;
        for p in &self.phases {
            writeln!(
                f,
                "  batch {:>4} x {:>2}: {:>8.1} MiB per device max -> {:>8.1} MiB total at end{}",
                p.batch,
                p.steps,
                mib(p.max_reserved_after_step),
                mib(p.reserved_at_end),
                if p.grew_after_second_step {
                    " (GREW after step 2)"
                } else {
                    ""
                }
            )?;
        }
        let yes = |b: bool| if b { "yes" } else { "NO" };
        write!(
            f,
            "gradients identical on every device: {}; equal to the host's sums: {}; weights identical: {}; no growth after step 2: {}",
            yes(self.gradients_match),
            self.gradients_expected.map_or("not checked", yes),
            yes(self.weights_match),
            yes(self.no_growth_after_step2)
        )
    }
}
