//! Replaying a trace through a real [`DevicePool`] on the simulator.
//!
//! Every allocation of the trace is served by the pool exactly as a live
//! program's would be (same sizes, same order, same streams); frees are
//! stream-ordered on the stream the trace names. The simulator runs in
//! accounting mode (no host memory behind the device), so traces of tens of
//! GB replay on a laptop. The figures: peak live bytes (sum of requested
//! sizes), peak reserved bytes (device memory the pool held), and the
//! overhead `peak_reserved / peak_live - 1`, beside the original
//! allocator's peak reserved bytes where the trace carries them.
//!
//! Each trace is also replayed through the [peers](super::peers): PyTorch's
//! caching allocator, ported, in its default mode and with expandable
//! segments ([`ReplayReport::peers`]). Where the trace is a PyTorch
//! snapshot, [`replay_file`] hands the peers the recording too, so that the
//! port in the recording's mode starts where PyTorch was and is checked
//! against what PyTorch did.

use super::peers::recording::{read_recordings, Recording};
use super::peers::run::{replay_peers, Peers};
use super::{Trace, TraceEvent, TraceFormat};
use gpupool::backend::cost::ColdWarm;
use gpupool::backend::sim::{SimBacking, SimConfig};
use gpupool::config::{BackendKind, PoolConfig};
use gpupool::pool::{Block, DevicePool, Stream};
use gpupool::runtime::Runtime;
use gpupool::{Error, Result};
use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

/// The original allocator's figure, where the trace has it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Baseline {
    /// Who produced it (`"pytorch"`).
    pub source: &'static str,
    /// Its peak reserved bytes.
    pub peak_reserved_bytes: u64,
}

/// The outcome of replaying one trace (the JSON shape of `gpupool replay`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct ReplayReport {
    /// Trace name.
    pub name: String,
    /// `torch-snapshot`, `rmm-log` or `lifetimes`.
    pub format: &'static str,
    /// Events replayed.
    pub events: u64,
    /// Allocations.
    pub allocs: u64,
    /// Frees.
    pub frees: u64,
    /// Peak of the sum of requested sizes of live blocks.
    pub peak_live_bytes: u64,
    /// Peak device memory held by the pool.
    pub peak_reserved_bytes: u64,
    /// `peak_reserved_bytes / peak_live_bytes - 1`.
    pub overhead: f64,
    /// The original allocator's figure, where known.
    pub baseline: Option<Baseline>,
    /// The baseline's overhead over the same peak live bytes.
    pub baseline_overhead: Option<f64>,
    /// Replay speed in steady state: events per second of a second pass of
    /// the trace over the same (warm) pool, as a training loop repeats its
    /// steps.
    pub events_per_sec: f64,
    /// Events per second of the first (cold) pass, which includes growing
    /// the pool through the simulated driver.
    pub cold_events_per_sec: f64,
    /// Peak reserved bytes during the second pass minus during the first:
    /// 0 when repeating the workload needs no new device memory.
    pub reserved_growth_on_repeat: i64,
    /// Granule mappings (`cuMemMap`) made during the first and the second
    /// pass: stitching work done for the trace.
    pub maps: [u64; 2],
    /// Driver calls made during the first (cold) and the second (warm)
    /// pass, by CUDA driver name (kinds not called are left out).
    pub driver_calls: ColdWarm<BTreeMap<&'static str, u64>>,
    /// Modeled driver time of each pass in milliseconds, under the
    /// configuration's cost table ([`gpupool::backend::cost::CostTable`]).
    pub driver_ms: ColdWarm<f64>,
    /// Allocations the pool refused (out of memory); should be 0.
    pub failed_allocs: u64,
    /// Learned steps: each pass is marked as a step
    /// ([`DevicePool::mark_step`]), so the second pass is served from the
    /// plan of the first; the plan's arena is set up at the mark between
    /// them and its driver calls count with the cold pass. `None` when
    /// [`ReplayOptions::learn_steps`] is off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plan: Option<gpupool::pool::PlanStats>,
    /// Samples of (event index, live bytes, reserved bytes) for plotting;
    /// empty unless asked for.
    #[serde(skip)]
    pub samples: Vec<(u64, u64, u64)>,
    /// The same trace through PyTorch's caching allocator (ported), default
    /// mode and expandable segments; `None` when [`ReplayOptions::peers`]
    /// is off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peers: Option<Peers>,
}

/// How to replay.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// Pool configuration (the backend part is ignored: replays always run
    /// on an accounting-mode simulator).
    pub config: PoolConfig,
    /// Take about this many (live, reserved) samples for a plot (0: none).
    pub samples: usize,
    /// Timed repetitions; the fastest counts (the machines are noisy).
    pub repeats: usize,
    /// Replay through the peers too (see [`ReplayReport::peers`]).
    pub peers: bool,
    /// Mark each pass as a step (see [`ReplayReport::plan`]).
    pub learn_steps: bool,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            config: PoolConfig::default(),
            samples: 0,
            repeats: 3,
            peers: true,
            learn_steps: true,
        }
    }
}

/// Device capacity for a replay: room for the trace with headroom, so that
/// the replay measures placement, not the capacity limit.
fn capacity_for(trace: &Trace) -> u64 {
    let peak = trace.peak_live_bytes().max(1 << 30);
    (peak * 2).next_power_of_two()
}

/// Device capacity the peers simulate: as gpupool's, and room for the
/// recorded segments where the trace has them.
fn peer_capacity(trace: &Trace) -> u64 {
    let recorded = trace.baseline_peak_reserved.unwrap_or(0);
    capacity_for(trace).max((recorded * 2).next_power_of_two())
}

/// Replays `trace`; see the module docs. The peers start from an empty
/// allocator: [`replay_with_recording`] gives them a snapshot's recording.
pub fn replay(trace: &Trace, opts: &ReplayOptions) -> Result<ReplayReport> {
    replay_with_recording(trace, None, opts)
}

/// Replays `trace`, with `recording` the PyTorch snapshot it was read from
/// (if it was), for the peers to start from and be checked against.
pub fn replay_with_recording(
    trace: &Trace,
    recording: Option<&Recording>,
    opts: &ReplayOptions,
) -> Result<ReplayReport> {
    let mut report = replay_gpupool(trace, opts)?;
    if opts.peers {
        let mut peers = replay_peers(trace, recording, peer_capacity(trace))?;
        peers.cost(&opts.config.driver_costs)?;
        report.peers = Some(peers);
    }
    Ok(report)
}

fn replay_gpupool(trace: &Trace, opts: &ReplayOptions) -> Result<ReplayReport> {
    let mut best: Option<ReplayReport> = None;
    for rep in 0..opts.repeats.max(1) {
        let samples = if rep == 0 { opts.samples } else { 0 };
        let r = replay_once(trace, opts, samples)?;
        best = Some(match best {
            None => r,
            Some(mut b) => {
                b.events_per_sec = b.events_per_sec.max(r.events_per_sec);
                b.cold_events_per_sec = b.cold_events_per_sec.max(r.cold_events_per_sec);
                b
            }
        });
    }
    Ok(best.expect("at least one repetition"))
}

fn replay_once(trace: &Trace, opts: &ReplayOptions, samples: usize) -> Result<ReplayReport> {
    let sim = SimConfig {
        devices: 1,
        capacity_bytes: capacity_for(trace),
        backing: SimBacking::Accounting,
        sync_streams: true,
        ..opts.config.sim.clone()
    };
    let rt = Runtime::builder()
        .backend(BackendKind::Sim(sim))
        .config(opts.config.clone())
        // Replays are deterministic: no background harvesting at times
        // that vary from run to run.
        .maintenance(false)
        .build()?;
    let pool = rt.device(0)?;
    let mut stream_ids: Vec<u64> = trace.events.iter().map(TraceEvent::stream).collect();
    stream_ids.sort_unstable();
    stream_ids.dedup();
    let streams: Vec<Stream> = stream_ids
        .iter()
        .map(|_| pool.new_stream())
        .collect::<Result<_>>()?;
    let stream_of: HashMap<u64, usize> = stream_ids
        .iter()
        .enumerate()
        .map(|(i, &s)| (s, i))
        .collect();
    let ev_stream: Vec<usize> = trace
        .events
        .iter()
        .map(|e| stream_of[&e.stream()])
        .collect();
    run_events(trace, pool, &streams, &ev_stream, samples, opts.learn_steps)
}

/// The outcome of one pass over the events.
struct Pass {
    peak_live: u64,
    failed: u64,
    secs: f64,
    samples: Vec<(u64, u64, u64)>,
}

fn one_pass<'a>(
    trace: &Trace,
    pool: &'a DevicePool,
    streams: &'a [Stream],
    ev_stream: &[usize],
    samples: usize,
) -> Result<Pass> {
    let mut blocks: Vec<Option<Block<'a>>> = (0..trace.id_bound()).map(|_| None).collect();
    let every = if samples == 0 {
        u64::MAX
    } else {
        (trace.events.len() as u64 / samples as u64).max(1)
    };
    let (mut live, mut peak_live, mut failed) = (0u64, 0u64, 0u64);
    let mut sampled = Vec::new();
    let t = Instant::now();
    for (i, ev) in trace.events.iter().enumerate() {
        match *ev {
            TraceEvent::Alloc { id, size, .. } => {
                match pool.alloc(size as usize, &streams[ev_stream[i]]) {
                    Ok(b) => {
                        blocks[id as usize] = Some(b);
                        live += size;
                        peak_live = peak_live.max(live);
                    }
                    Err(e) if e.is_oom() => failed += 1,
                    Err(e) => return Err(e),
                }
            }
            TraceEvent::Free { id, .. } => {
                if let Some(b) = blocks[id as usize].take() {
                    live -= b.size() as u64;
                }
            }
        }
        if i as u64 % every == 0 {
            sampled.push((i as u64, live, pool.reserved_bytes()));
        }
    }
    let secs = t.elapsed().as_secs_f64();
    // Blocks live at the end of the trace are freed, so that a repeated
    // pass starts from the same state.
    drop(blocks);
    Ok(Pass {
        peak_live,
        failed,
        secs,
        samples: sampled,
    })
}

fn run_events(
    trace: &Trace,
    pool: &DevicePool,
    streams: &[Stream],
    ev_stream: &[usize],
    samples: usize,
    learn_steps: bool,
) -> Result<ReplayReport> {
    let counters = || pool.backend().counters();
    let mark = || {
        if learn_steps {
            pool.mark_step()
        } else {
            Ok(())
        }
    };
    mark()?;
    let c0 = counters();
    let cold = one_pass(trace, pool, streams, ev_stream, samples)?;
    mark()?;
    let c1 = counters();
    let peak_reserved = pool.stats().reserved_bytes.peak;
    pool.reset_peak_stats();
    let warm = one_pass(trace, pool, streams, ev_stream, 0)?;
    let warm_peak_reserved = pool.stats().reserved_bytes.peak;
    let plan = learn_steps.then(|| pool.plan_stats());
    let c2 = counters();
    let (cold_calls, warm_calls) = (c1.since(&c0), c2.since(&c1));
    let costs = &pool.config().driver_costs;
    let peak_live = cold.peak_live;
    let baseline = trace.baseline_peak_reserved.map(|b| Baseline {
        source: "pytorch",
        peak_reserved_bytes: b,
    });
    let ratio = |r: u64| {
        if peak_live == 0 {
            0.0
        } else {
            r as f64 / peak_live as f64 - 1.0
        }
    };
    let rate = |p: &Pass| trace.events.len() as f64 / p.secs.max(1e-9);
    Ok(ReplayReport {
        name: trace.name.clone(),
        format: trace.format.as_str(),
        events: trace.events.len() as u64,
        allocs: trace.allocs() as u64,
        frees: trace.frees() as u64,
        peak_live_bytes: peak_live,
        peak_reserved_bytes: peak_reserved,
        overhead: ratio(peak_reserved),
        baseline_overhead: baseline.as_ref().map(|b| ratio(b.peak_reserved_bytes)),
        baseline,
        events_per_sec: rate(&warm),
        cold_events_per_sec: rate(&cold),
        reserved_growth_on_repeat: warm_peak_reserved as i64 - peak_reserved as i64,
        failed_allocs: cold.failed + warm.failed,
        maps: [
            cold_calls.get(gpupool::backend::Call::Map),
            warm_calls.get(gpupool::backend::Call::Map),
        ],
        driver_calls: ColdWarm {
            cold: cold_calls.nonzero_calls(),
            warm: warm_calls.nonzero_calls(),
        },
        driver_ms: ColdWarm {
            cold: costs.millis(&cold_calls),
            warm: costs.millis(&warm_calls),
        },
        samples: cold.samples,
        plan,
        peers: None,
    })
}

/// Replays a trace file (any format; PyTorch snapshots with several devices
/// give one report per device).
pub fn replay_file(path: &std::path::Path, opts: &ReplayOptions) -> Result<Vec<ReplayReport>> {
    let traces = super::read_file_all(path)?;
    if traces.is_empty() {
        return Err(Error::Trace {
            file: path.display().to_string(),
            msg: "no events".into(),
        });
    }
    let recordings = if opts.peers && traces[0].format == TraceFormat::TorchSnapshot {
        read_recordings(path)?
    } else {
        Vec::new()
    };
    traces
        .iter()
        .map(|t| {
            let rec = recordings.iter().find(|r| r.name == t.name);
            replay_with_recording(t, rec, opts)
        })
        .collect()
}
