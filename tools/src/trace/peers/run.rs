//! Replaying a trace through the PyTorch port in both modes, for `gpupool
//! replay`: the figures of each peer beside gpupool's.
//!
//! Each peer runs the trace twice over one allocator: a **cold** pass, then
//! (after freeing what is live at the end, as gpupool's replay does) a
//! **warm** pass over the state the first left, as a training loop repeats
//! its steps. Driver calls are counted per pass, by kind.
//!
//! Where the trace is a PyTorch snapshot recorded in the peer's own mode,
//! the cold pass is the [validated](super::validate) replay of the
//! recording: it starts from PyTorch's recorded segments, so its peak
//! reserved bytes are comparable with PyTorch's recorded figure, and its
//! driver calls are those PyTorch made during the recording. The same peer
//! is then also run from an empty allocator (`cold_start`), which is what
//! gpupool's own replay does. Everywhere else the peer starts empty.
//!
//! Invariants: every pass replays every event of the trace; an allocation
//! the peer refuses is counted in `failed_allocs` and its free is skipped;
//! the warm pass starts with nothing allocated.

use super::device::DriverCounter;
use super::recording::Recording;
use super::validate::{replay_recording, Validation};
use super::{DriverCalls, PeerAllocator, TorchAllocator, TorchConfig};
use crate::trace::{Trace, TraceEvent};
use gpupool::Result;

/// A figure for the cold pass and the warm pass.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ColdWarm {
    /// First pass.
    pub cold: DriverCalls,
    /// Second pass over the same allocator.
    pub warm: DriverCalls,
}

/// The figures of one run (cold pass, then warm pass).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct PeerRun {
    /// Peak reserved bytes during the cold pass.
    pub peak_reserved_bytes: u64,
    /// `peak_reserved_bytes / peak_live_bytes - 1`.
    pub overhead: f64,
    /// Driver calls by kind.
    pub driver_calls: ColdWarm,
    /// Bytes the driver calls of each kind covered.
    pub driver_bytes: ColdWarm,
    /// Modeled driver milliseconds of each pass, with the same cost table
    /// as gpupool's figures ([`PeerRun::cost`]; 0 until then).
    pub driver_ms: gpupool::backend::cost::ColdWarm<f64>,
    /// `(event index, reserved bytes)` through the cold pass, about
    /// [`PLOT_SAMPLES`] of them, for the replay's plot (not in the JSON).
    #[serde(skip)]
    pub samples: Vec<(u64, u64)>,
    /// Peak reserved bytes of the warm pass minus the cold pass's.
    pub reserved_growth_on_repeat: i64,
    /// Allocations the peer refused (both passes).
    pub failed_allocs: u64,
}

/// One peer's report for one trace (the JSON of `peers.torch` and
/// `peers.torch_expandable`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PeerReport {
    /// The figures (from the start given in `start`).
    #[serde(flatten)]
    pub run: PeerRun,
    /// `recorded_segments` (PyTorch's segments when recording began) or
    /// `empty`.
    pub start: &'static str,
    /// Whether the port reproduced the recording; `null` where there is no
    /// recording of this mode.
    pub matched_recording: Option<bool>,
    /// What was compared and the outcome, or why nothing was.
    pub note: String,
    /// The details of the comparison, where one was made.
    pub validation: Option<Validation>,
    /// The same peer from an empty allocator, where `start` is not `empty`.
    pub cold_start: Option<PeerRun>,
}

/// Both peers.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Peers {
    /// PyTorch's caching allocator, default mode.
    pub torch: PeerReport,
    /// PyTorch's caching allocator, `expandable_segments:True`.
    pub torch_expandable: PeerReport,
}

/// One pass of `trace` over `a`; what is live at the end is freed. Returns
/// the allocations refused.
pub fn pass(a: &mut dyn PeerAllocator, trace: &Trace) -> Result<u64> {
    pass_sampled(a, trace, None)
}

/// [`pass`], pushing `(event index, reserved bytes)` every `every` events
/// into `samples` when given.
fn pass_sampled(
    a: &mut dyn PeerAllocator,
    trace: &Trace,
    mut samples: Option<(u64, &mut Vec<(u64, u64)>)>,
) -> Result<u64> {
    let mut live: Vec<Option<u64>> = vec![None; trace.id_bound()];
    let mut failed = 0;
    for (i, ev) in trace.events.iter().enumerate() {
        match *ev {
            TraceEvent::Alloc { id, size, stream } => match a.alloc(size, stream) {
                Ok(p) => live[id as usize] = Some(p),
                Err(e) if e.is_oom() => failed += 1,
                Err(e) => return Err(e),
            },
            TraceEvent::Free { id, .. } => {
                if let Some(p) = live[id as usize].take() {
                    a.free(p)?;
                }
            }
        }
        if let Some((every, out)) = samples.as_mut() {
            if i as u64 % *every == 0 {
                out.push((i as u64, a.reserved_bytes()));
            }
        }
    }
    for p in live.into_iter().flatten() {
        a.free(p)?;
    }
    Ok(failed)
}

fn counter(a: &TorchAllocator) -> DriverCounter {
    DriverCounter {
        calls: a.driver_calls(),
        bytes: a.driver_bytes(),
    }
}

fn ratio(reserved: u64, live: u64) -> f64 {
    if live == 0 {
        0.0
    } else {
        reserved as f64 / live as f64 - 1.0
    }
}

/// The warm pass over `a`, given the cold pass's figures.
fn finish(
    mut a: TorchAllocator,
    trace: &Trace,
    cold: DriverCounter,
    cold_peak: u64,
    cold_failed: u64,
) -> Result<PeerRun> {
    for p in a.live_addresses() {
        a.free(p)?;
    }
    a.reset_peak();
    let before = counter(&a);
    let failed = pass(&mut a, trace)?;
    let warm = counter(&a).since(&before);
    Ok(PeerRun {
        peak_reserved_bytes: cold_peak,
        overhead: ratio(cold_peak, trace.peak_live_bytes()),
        driver_calls: ColdWarm {
            cold: cold.calls,
            warm: warm.calls,
        },
        driver_bytes: ColdWarm {
            cold: cold.bytes,
            warm: warm.bytes,
        },
        reserved_growth_on_repeat: a.peak_reserved_bytes() as i64 - cold_peak as i64,
        failed_allocs: cold_failed + failed,
        driver_ms: Default::default(),
        samples: Vec::new(),
    })
}

impl PeerRun {
    /// Prices both passes with `table`. Units: bytes for the calls whose
    /// cost grows with bytes, and for `cuMemSetAccess` the pages it covers,
    /// which in the port is one per `cuMemMap` (no peer devices in a replay).
    pub fn cost(&mut self, table: &gpupool::backend::cost::CostTable) -> Result<()> {
        let units = |calls: &DriverCalls, bytes: &DriverCalls| -> DriverCalls {
            let mut u = bytes.clone();
            if let Some(&maps) = calls.get(gpupool::backend::Call::Map.name()) {
                u.insert(gpupool::backend::Call::SetAccess.name(), maps);
            }
            u
        };
        let c = &self.driver_calls;
        let b = &self.driver_bytes;
        self.driver_ms = gpupool::backend::cost::ColdWarm {
            cold: table.millis_of(&c.cold, Some(&units(&c.cold, &b.cold)))?,
            warm: table.millis_of(&c.warm, Some(&units(&c.warm, &b.warm)))?,
        };
        Ok(())
    }
}

impl Peers {
    /// Prices every run of both peers with `table`.
    pub fn cost(&mut self, table: &gpupool::backend::cost::CostTable) -> Result<()> {
        for p in [&mut self.torch, &mut self.torch_expandable] {
            p.run.cost(table)?;
            if let Some(c) = &mut p.cold_start {
                c.cost(table)?;
            }
        }
        Ok(())
    }
}

/// Samples of reserved bytes a cold pass from empty takes for the plot.
pub const PLOT_SAMPLES: u64 = 2000;

/// Runs `trace` through a fresh allocator with `cfg`: cold (sampled for
/// the plot), then warm.
pub fn from_empty(cfg: TorchConfig, trace: &Trace) -> Result<PeerRun> {
    let mut a = TorchAllocator::new(cfg);
    let before = counter(&a);
    let every = (trace.events.len() as u64 / PLOT_SAMPLES).max(1);
    let mut samples = Vec::new();
    let failed = pass_sampled(&mut a, trace, Some((every, &mut samples)))?;
    let cold = counter(&a).since(&before);
    let peak = a.peak_reserved_bytes();
    let mut run = finish(a, trace, cold, peak, failed)?;
    run.samples = samples;
    Ok(run)
}

fn peer(
    expandable: bool,
    trace: &Trace,
    recording: Option<&Recording>,
    capacity: u64,
) -> Result<PeerReport> {
    let mut cfg = TorchConfig {
        capacity_bytes: capacity,
        ..TorchConfig::with_mode(expandable)
    };
    if let Some(rec) = recording {
        rec.settings.apply(&mut cfg);
    }
    let empty = |note: String, matched: Option<bool>| -> Result<PeerReport> {
        Ok(PeerReport {
            run: from_empty(cfg.clone(), trace)?,
            start: "empty",
            matched_recording: matched,
            note,
            validation: None,
            cold_start: None,
        })
    };
    let Some(rec) = recording else {
        return empty(
            format!(
                "no recording to match ({} trace); replayed from an empty allocator",
                trace.format
            ),
            None,
        );
    };
    if rec.expandable() != expandable {
        return empty(
            format!(
                "recorded with expandable_segments:{}: nothing of this mode to match; replayed \
                 from an empty allocator",
                if rec.expandable() { "True" } else { "False" }
            ),
            None,
        );
    }
    let run = match replay_recording(rec, cfg.clone()) {
        Ok(run) => run,
        Err(e) => {
            return empty(
                format!("could not replay the recording ({e}); replayed from an empty allocator"),
                Some(false),
            )
        }
    };
    let v = run.validation;
    let start = if v.start_reserved_bytes == 0 {
        "empty"
    } else {
        "recorded_segments"
    };
    let cold_peak = run.allocator.peak_reserved_bytes();
    let figures = finish(
        run.allocator,
        trace,
        v.driver.clone(),
        cold_peak,
        v.failed_allocs,
    )?;
    let cold_start = if start == "empty" {
        None
    } else {
        Some(from_empty(cfg, trace)?)
    };
    Ok(PeerReport {
        run: figures,
        start,
        matched_recording: Some(v.matched),
        note: v.note.clone(),
        validation: Some(v),
        cold_start,
    })
}

/// Both peers over `trace`; `recording` is the trace's snapshot where it is
/// one (see the [module docs](self)); `capacity` the simulated device's
/// memory.
pub fn replay_peers(trace: &Trace, recording: Option<&Recording>, capacity: u64) -> Result<Peers> {
    Ok(Peers {
        torch: peer(false, trace, recording, capacity)?,
        torch_expandable: peer(true, trace, recording, capacity)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::TraceFormat;

    const MIB: u64 = 1 << 20;

    fn trace(events: &[(bool, u64, u64)]) -> Trace {
        let mut t = Trace::new("t", TraceFormat::Lifetimes);
        for &(alloc, id, size) in events {
            t.events.push(if alloc {
                TraceEvent::Alloc {
                    id,
                    size,
                    stream: 0,
                }
            } else {
                TraceEvent::Free { id, stream: 0 }
            });
        }
        t
    }

    #[test]
    fn the_warm_pass_reuses_what_the_cold_pass_cached() {
        // 3 and 4 MiB, then 15 MiB while the 4 MiB block is live; block 3
        // is live at the end (freed before the warm pass).
        let t = trace(&[
            (true, 0, 3 * MIB),
            (true, 1, 4 * MIB),
            (false, 0, 0),
            (true, 2, 15 * MIB),
            (false, 1, 0),
            (false, 2, 0),
            (true, 3, 100),
        ]);
        let cfg = TorchConfig {
            capacity_bytes: 1 << 30,
            ..TorchConfig::default()
        };
        let r = from_empty(cfg, &t).unwrap();
        // A 20 MiB segment for 3 and 4 MiB; 15 MiB fits in neither free
        // piece (3 and 13 MiB): a 16 MiB segment; 2 MiB for 100 B.
        assert_eq!(r.driver_calls.cold["cuMemAlloc"], 3);
        assert_eq!(r.peak_reserved_bytes, 38 * MIB);
        assert!(r.driver_calls.warm.is_empty(), "{:?}", r.driver_calls.warm);
        assert_eq!(r.reserved_growth_on_repeat, 0);
        assert_eq!(r.failed_allocs, 0);
        assert!((r.overhead - (38.0 / 19.0 - 1.0)).abs() < 1e-9);

        let e = from_empty(TorchConfig::with_mode(true), &t).unwrap();
        // The 15 MiB block starts in the first page's free 13 MiB and takes
        // one more 20 MiB page; a 2 MiB small page.
        assert_eq!(e.driver_calls.cold["cuMemMap"], 3);
        assert_eq!(e.driver_calls.cold["cuMemAddressReserve"], 2);
        assert_eq!(e.peak_reserved_bytes, 42 * MIB);
        assert!(e.driver_calls.warm.is_empty());
    }
}
