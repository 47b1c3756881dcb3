//! What a harness run reports.

use super::TrainOptions;
use gpupool::backend::sim::VerifyResult;
use gpupool::pool::PoolStats;
use gpupool::runtime::{MaintenanceStats, Runtime};
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
    /// Compaction passes that moved blocks (the harness's idle work, and
    /// any idle-time passes of the maintenance thread).
    pub compaction_passes: u64,
    /// Bytes those passes moved.
    pub compaction_bytes_moved: u64,
    /// Releases by the harness's own idle work ([`super::IdleWork`]) that
    /// gave memory back.
    pub idle_releases: u64,
    /// Bytes those releases gave back.
    pub idle_released_bytes: u64,
    /// Learned steps ([`gpupool::DevicePool::mark_step`]): plans built,
    /// requests served from them, departures.
    pub plan: gpupool::pool::PlanStats,
    /// Live bytes of the pool after the run (everything the harness
    /// allocated freed) over those before it: 0 unless something leaked.
    pub leaked_bytes: u64,
    /// Reserved bytes of the pool before the run.
    pub reserved_before_run: u64,
    /// Reserved bytes after the run, once everything the harness allocated
    /// is freed and the pool settled and trimmed: at most
    /// `reserved_before_run`.
    pub reserved_after_run: u64,
    /// The pool's audit after the run: `None` when every invariant holds,
    /// else the first violation.
    pub audit: Option<String>,
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
            idle_releases: 0,
            idle_released_bytes: 0,
            plan: Default::default(),
            leaked_bytes: 0,
            reserved_before_run: 0,
            reserved_after_run: 0,
            audit: None,
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
        self.peak_live_bytes = st.requested_bytes.peak;
        self.peak_reserved_bytes = st.reserved_bytes.peak;
        self.overhead = st.reserved_bytes.peak as f64 / st.requested_bytes.peak.max(1) as f64 - 1.0;
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
    /// step (the pool should have what a fixed batch needs by then). A
    /// figure, not a check: whether a freed block is reusable at the next
    /// allocation depends on when the stream workers and maintenance
    /// threads ran.
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
    /// No phase grew after its second step (a figure, not a check; see
    /// [`PhaseReport::grew_after_second_step`]).
    pub no_growth_after_step2: bool,
    /// Wall time in seconds.
    pub seconds: f64,
    /// Driver calls that make, map or give back device memory
    /// ([`gpupool::backend::Call::MEMORY`]) during each step and its idle
    /// work and gap, all devices together (a figure, not a check: the
    /// maintenance threads' share depends on timing).
    pub memory_calls_by_step: Vec<u64>,
    /// The checks that failed (see [`TrainReport::ok`]); empty when all
    /// passed.
    pub failed_checks: Vec<String>,
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
        let failed_checks =
            failed_checks(&devices, gradients_match, gradients_expected, weights_match);
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
            memory_calls_by_step: Vec::new(),
            failed_checks,
        }
    }

    /// Whether every check passed: identical (and, if verified, expected)
    /// gradients, identical weights, and on every device no integrity
    /// error, no host sync on the alloc path, no leaked bytes, no more
    /// reserved after the run than before it, and a clean audit. Each
    /// holds in every interleaving of the threads involved, so the outcome
    /// does not depend on timing; timing-dependent figures (growth after a
    /// phase's second step, idle releases, speeds) are only reported.
    pub fn ok(&self) -> bool {
        self.failed_checks.is_empty()
    }
}

fn failed_checks(
    devices: &[DeviceReport],
    gradients_match: bool,
    gradients_expected: Option<bool>,
    weights_match: bool,
) -> Vec<String> {
    let mut out = Vec::new();
    if !gradients_match {
        out.push("gradients differ between devices".to_string());
    }
    if gradients_expected == Some(false) {
        out.push("gradients differ from the host's sums".to_string());
    }
    if !weights_match {
        out.push("weights differ between devices".to_string());
    }
    for d in devices {
        let n = d.device;
        if d.integrity_errors > 0 {
            out.push(format!(
                "device {n}: {} integrity errors",
                d.integrity_errors
            ));
        }
        if d.host_syncs_on_alloc_path > 0 {
            out.push(format!(
                "device {n}: {} host syncs on the alloc path",
                d.host_syncs_on_alloc_path
            ));
        }
        if d.leaked_bytes > 0 {
            out.push(format!("device {n}: {} bytes leaked", d.leaked_bytes));
        }
        if d.reserved_after_run > d.reserved_before_run {
            out.push(format!(
                "device {n}: {} bytes reserved after the run and a trim, {} before",
                d.reserved_after_run, d.reserved_before_run
            ));
        }
        if let Some(e) = &d.audit {
            out.push(format!("device {n}: audit: {e}"));
        }
    }
    out
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
            writeln!(
                f,
                "device {}: {} compaction pass(es) moving {:.2} MiB, {} idle release(s) by the harness giving back {:.1} MiB, {} of {} large requests from {} learned plan(s) ({} departure(s))",
                d.device,
                d.compaction_passes,
                mib(d.compaction_bytes_moved),
                d.idle_releases,
                mib(d.idle_released_bytes),
                d.plan.served,
                d.plan.served + d.plan.dynamic,
                d.plan.plans,
                d.plan.departures
            )?;
        }
        for d in &self.devices {
            if let Some(m) = &d.maintenance {
                let bind = match &m.binding {
                    Some(gpupool::runtime::ThreadBinding::Bound { cpus }) => {
                        format!("bound to {} CPU(s)", cpus.len())
                    }
                    Some(gpupool::runtime::ThreadBinding::Unbound { .. }) => "unbound".into(),
                    None => "not started".into(),
                };
                writeln!(
                    f,
                    "maintenance {}: {} ticks, {} harvested, {} idle ticks, {} release(s) giving back {:.1} MiB, {bind}",
                    m.thread,
                    m.ticks,
                    m.harvested,
                    m.idle_ticks,
                    m.releases,
                    mib(m.released_bytes),
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
                    " (grew after step 2)"
                } else {
                    ""
                }
            )?;
        }
        let yes = |b: bool| if b { "yes" } else { "NO" };
        let sum = |f: fn(&DeviceReport) -> u64| self.devices.iter().map(f).sum::<u64>();
        let audits = self.devices.iter().filter(|d| d.audit.is_none()).count();
        writeln!(
            f,
            "after the run (all freed, pools trimmed): {} bytes leaked, {:.1} MiB reserved (before: {:.1} MiB), {audits} of {} audits clean",
            sum(|d| d.leaked_bytes),
            mib(sum(|d| d.reserved_after_run)),
            mib(sum(|d| d.reserved_before_run)),
            self.devices.len()
        )?;
        writeln!(
            f,
            "figures (depend on thread timing, not checked): no growth after step 2: {}",
            if self.no_growth_after_step2 {
                "yes"
            } else {
                "no"
            },
        )?;
        write!(
            f,
            "checks: gradients identical on every device: {}; equal to the host's sums: {}; weights identical: {}; integrity errors: {}; host syncs on the alloc path: {}; leaks, memory returned, audits: {}",
            yes(self.gradients_match),
            self.gradients_expected.map_or("not checked", yes),
            yes(self.weights_match),
            sum(|d| d.integrity_errors),
            sum(|d| d.host_syncs_on_alloc_path),
            if self.failed_checks.is_empty() { "ok" } else { "FAILED" }
        )?;
        for c in &self.failed_checks {
            write!(f, "\nFAILED: {c}")?;
        }
        Ok(())
    }
}
