//! What driver calls cost: a modeled latency per [`Call`], so that counted
//! calls can be reported as driver time.
//!
//! The simulator makes no real driver calls, so a replay or a stress run on
//! it spends no time in the driver; a real device would. [`CostTable`]
//! charges each call kind a host latency, `us` per call plus `us_per_unit`
//! per unit for the kinds whose cost grows with size ([`Call::unit`]: one
//! unit is a MiB for byte-sized calls, a physical chunk for
//! `cuMemSetAccess`). The charge is *reported* (modeled milliseconds),
//! never slept: replays stay fast and deterministic.
//!
//! # Tables
//!
//! The default is [`CostTable::h200`]: every kind measured on one NVIDIA
//! H200 by `gpupool bench --gpu --calibrate`. [`CostTable::published`]
//! (`driver_costs=published`) holds figures from published measurements
//! on other GPUs where one exists, and labelled estimates elsewhere (each
//! entry's doc below; `docs/BENCHMARKS.md`, "Driver cost model", compares
//! the two):
//!
//! | call | per call µs | per unit µs | source |
//! |---|---|---|---|
//! | `cuMemCreate` | 0 | 96.66 / MiB | kvcached VMM benchmark, A100, 2 MiB pages: 193.32 µs per page |
//! | `cuMemRelease` | 25.6 | – | estimate: no published figure; taken equal to `cuMemUnmap` |
//! | `cuMemAlloc` | 50 | 31 / MiB | ~50 µs flat from 4 KiB to 512 KiB (U. Virginia CUDA overhead study); ~32 ms for 1 GiB (vortex-data/vortex#7815, GH200) |
//! | `cuMemFree` | 14 | – | direct `cudaFree` 14 µs (Cytnx-dev/Cytnx#850); the implicit device sync it may make is not modeled |
//! | `cuMemAddressReserve` | 19 | – | kvcached VMM benchmark: 8 GB reserved in 19 µs |
//! | `cuMemAddressFree` | 19 | – | estimate: taken equal to the reservation |
//! | `cuMemMap` | 1.45 | – | kvcached VMM benchmark (one 2 MiB chunk per call) |
//! | `cuMemUnmap` | 25.63 | – | kvcached VMM benchmark (one 2 MiB chunk per call) |
//! | `cuMemSetAccess` | 0 | 35.99 / chunk | kvcached VMM benchmark (one chunk per call); linear in chunks per PyTorch's expandable-segments notes |
//! | `cuStreamCreate`, `cuStreamDestroy` | 10 | – | estimate: no published figure |
//! | `cuEventCreate`, `cuEventDestroy` | 1 | – | estimate: no published figure |
//! | `cuEventRecord`, `cuStreamWaitEvent` | 1 | – | "on the order of 1 µs" (cudarc PR #335) |
//! | `cuEventQuery` | 0.5 | – | estimate: a completion-flag read, no published figure |
//! | `cuStreamIsCapturing` | 0.1 | – | estimate: a read of the stream's capture state; allocation slow paths only |
//! | `cuStreamQuery` | 0.5 | – | estimate: taken equal to `cuEventQuery` |
//! | `cuEventSynchronize`, `cuStreamSynchronize` | 3 | – | call overhead, stream-to-stream sync ~3 µs (facebookincubator/velox#6096); the wait itself is not modeled |
//! | `launchMoves`, `cuMemsetD8Async` | 3 | 0 | kernel launch ~3 µs (velox#6096); asynchronous, so the host does not pay per byte |
//! | `cuMemcpyDtoH`, `cuMemcpyHtoD` | 10 | 41.94 / MiB | ~10 µs fixed (U. Virginia study); 25 GB/s, an estimate for PCIe 4.0 x16 |
//!
//! # Overrides and calibration
//!
//! `GPUPOOL_CONF` key `driver_costs=published` charges the published
//! figures; `driver_costs=<path>` loads a cost file (JSON, the
//! shape [`CostTable::to_json`] writes, which is also what
//! `gpupool bench --gpu --calibrate <path>` writes from measurements on a
//! real device, see [`calibrate`]); the kinds it names replace the
//! defaults. Keys `cost.<call>=<µs>` and `cost.<call>.per_unit=<µs>` then
//! set single entries (`cost.cuMemMap=2.5`).

use super::{Backend, BackendCounters, Call, Unit};
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::fmt;

/// Bytes in the unit of byte-sized calls.
pub const MIB: u64 = 1 << 20;

/// The modeled cost of one call kind.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallCost {
    /// Microseconds per call.
    #[serde(default)]
    pub us: f64,
    /// Microseconds per unit: per MiB for byte-sized calls, per chunk for
    /// `cuMemSetAccess` ([`Call::unit`]); 0 for calls without units.
    #[serde(default)]
    pub us_per_unit: f64,
}

impl CallCost {
    const fn new(us: f64, us_per_unit: f64) -> CallCost {
        CallCost { us, us_per_unit }
    }

    /// Microseconds for `calls` calls of `call`'s kind covering `units`
    /// (bytes or chunks, as counted).
    pub fn micros(&self, call: Call, calls: u64, units: u64) -> f64 {
        let per_unit = match call.unit() {
            Unit::None => 0.0,
            Unit::Bytes => units as f64 / MIB as f64,
            Unit::Chunks => units as f64,
        };
        self.us * calls as f64 + self.us_per_unit * per_unit
    }

    fn check(&self, what: &str) -> Result<()> {
        if self.us.is_finite()
            && self.us >= 0.0
            && self.us_per_unit.is_finite()
            && self.us_per_unit >= 0.0
        {
            Ok(())
        } else {
            Err(cost_error(format!(
                "{what}: costs must be finite and >= 0, got {self:?}"
            )))
        }
    }
}

fn cost_error(msg: String) -> Error {
    Error::Config {
        key: "driver_costs".into(),
        msg,
    }
}

/// The published defaults, in [`Call::ALL`] order; see the module docs for
/// the sources.
fn published(call: Call) -> CallCost {
    match call {
        // kvcached VMM benchmark (ovg-project/kvcached,
        // benchmarks/bench_vmm), A100, 4096 pages of 2 MiB, one thread:
        // cuMemCreate 193.32 µs on average per 2 MiB page. Charged per MiB:
        // an extrapolation to other chunk sizes that calibration replaces.
        Call::MemCreate => CallCost::new(0.0, 193.32 / 2.0),
        // Estimate: no published figure for cuMemRelease; taken equal to
        // cuMemUnmap, the other half of giving a chunk back.
        Call::MemRelease => CallCost::new(25.6, 0.0),
        // ~50 µs per cudaMalloc from 4 KiB to 512 KiB (University of
        // Virginia, "CUDA memory management overhead"); growing with size:
        // allocating 1 GiB before a copy added ~32 ms over the copy alone
        // on a GH200 (vortex-data/vortex PR #7815), ~31 µs per MiB.
        Call::MemAlloc => CallCost::new(50.0, 31.0),
        // Direct cudaFree of a small buffer: 14.0 µs (Cytnx-dev/Cytnx PR
        // #850, GTX 1660 SUPER / RTX 2080 Ti). cudaFree may synchronize
        // the device; that wait depends on queued work and is not modeled.
        Call::MemFree => CallCost::new(14.0, 0.0),
        // kvcached VMM benchmark: cuMemAddressReserve of 8 GB in 19 µs.
        Call::AddressReserve => CallCost::new(19.0, 0.0),
        // Estimate: taken equal to the reservation.
        Call::AddressFree => CallCost::new(19.0, 0.0),
        // kvcached VMM benchmark, one 2 MiB chunk per call.
        Call::Map => CallCost::new(1.45, 0.0),
        // kvcached VMM benchmark, one 2 MiB chunk per call.
        Call::Unmap => CallCost::new(25.63, 0.0),
        // kvcached VMM benchmark: 35.99 µs for one 2 MiB chunk. PyTorch's
        // expandable-segments notes (c10/cuda/CUDACachingAllocator.cpp):
        // the cost of changing mappings is proportional to the number of
        // separately created chunks, so a grant over N chunks costs N times.
        Call::SetAccess => CallCost::new(0.0, 35.99),
        // Estimates: no published per-call figure.
        Call::StreamCreate | Call::StreamDestroy => CallCost::new(10.0, 0.0),
        Call::EventCreate | Call::EventDestroy => CallCost::new(1.0, 0.0),
        // "The overhead for recording an event and waiting for it on the GPU
        // side is on the order of 1 µs" (chelsea0x3b/cudarc PR #335).
        Call::EventRecord | Call::StreamWaitEvent => CallCost::new(1.0, 0.0),
        // Estimate: a non-blocking read of a completion flag.
        Call::EventQuery => CallCost::new(0.5, 0.0),
        // The call's own overhead: a stream-to-stream synchronization on
        // the device ~3 µs (facebookincubator/velox PR #6096, RTX 3080).
        // The host's wait for queued work is not modeled.
        Call::EventSynchronize | Call::StreamSynchronize => CallCost::new(3.0, 0.0),
        // Kernel launch from a stream ~3 µs (velox PR #6096). Asynchronous:
        // the host pays the launch, not the bytes.
        Call::LaunchMoves | Call::MemsetAsync => CallCost::new(3.0, 0.0),
        // ~10 µs fixed per small cudaMemcpy (University of Virginia, "CUDA
        // memory transfer overhead"); bytes at 25 GB/s, an estimate for
        // pinned PCIe 4.0 x16 (31.5 GB/s raw).
        Call::MemcpyDtoH | Call::MemcpyHtoD => CallCost::new(10.0, MIB as f64 / 25e9 * 1e6),
        // Estimates: no published figure; once per chunk shared between
        // processes, never in steady state.
        Call::MemExport | Call::MemImport => CallCost::new(10.0, 0.0),
        // Estimate: a read of the stream's capture state, no device work;
        // made on allocation slow paths only (see `pool/capture.rs`).
        Call::StreamIsCapturing => CallCost::new(0.1, 0.0),
        // Estimate: as an event query, a read of the stream's progress.
        Call::StreamQuery => CallCost::new(0.5, 0.0),
    }
}

/// A modeled latency for every driver call kind; see the module docs.
#[derive(Debug, Clone, PartialEq)]
pub struct CostTable {
    costs: [CallCost; Call::ALL.len()],
    source: String,
}

impl Default for CostTable {
    /// The table measured on a real device ([`CostTable::h200`]): the
    /// published figures come from different GPUs, some are estimates,
    /// and on the H200 they were off by 13x for a map and 100x for an
    /// access grant.
    fn default() -> Self {
        CostTable::h200()
    }
}

/// The file form of a [`CostTable`] (`driver_costs=<path>`, and what
/// `gpupool bench --gpu --calibrate` writes).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct CostFile {
    /// Where the figures come from.
    #[serde(default)]
    source: String,
    /// Costs by driver name; kinds left out keep the defaults.
    costs: BTreeMap<String, CallCost>,
}

impl CostTable {
    /// The defaults from published measurements (module docs).
    pub fn published() -> CostTable {
        let mut costs = [CallCost::default(); Call::ALL.len()];
        for &c in Call::ALL {
            costs[c as usize] = published(c);
        }
        CostTable {
            costs,
            source: "published (src/backend/cost.rs, Tables)".into(),
        }
    }

    /// The kinds the H200 file does not hold: `cuStreamQuery` joined the
    /// backend seam after the calibration run.
    pub const UNMEASURED_ON_H200: &'static [Call] = &[Call::StreamQuery];

    /// Figures measured on one real device: an NVIDIA H200 (driver 580,
    /// CUDA 13), 2026-12-04, by `gpupool bench --gpu --calibrate`
    /// (`src/backend/costs/nvidia-h200.json`; `driver_costs=h200` in
    /// `GPUPOOL_CONF`). Every kind is measured except those added to the
    /// seam after that run ([`CostTable::UNMEASURED_ON_H200`]), which keep the
    /// published estimate until the next calibration on a GPU.
    pub fn h200() -> CostTable {
        static H200: std::sync::OnceLock<CostTable> = std::sync::OnceLock::new();
        H200.get_or_init(|| {
            // Over the published table (it names every kind: tested).
            CostTable::from_json_over(
                include_str!("costs/nvidia-h200.json"),
                CostTable::published(),
            )
            .expect("the bundled H200 cost file parses (tested)")
        })
        .clone()
    }

    /// A table by name (`published`, `h200`) or, for any other value, from
    /// the cost file at that path: what `driver_costs=` takes.
    pub fn named_or_load(value: &str) -> Result<CostTable> {
        match value {
            "published" => Ok(CostTable::published()),
            "h200" => Ok(CostTable::h200()),
            path => CostTable::load(std::path::Path::new(path)),
        }
    }

    /// Where the figures come from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The cost of one call kind.
    pub fn cost(&self, call: Call) -> CallCost {
        self.costs[call as usize]
    }

    /// Replaces the cost of one call kind (an error if it is negative or
    /// not finite).
    pub fn set(&mut self, call: Call, cost: CallCost) -> Result<()> {
        cost.check(call.name())?;
        self.costs[call as usize] = cost;
        Ok(())
    }

    /// Spends on the calling thread the modeled host time of `calls` calls
    /// of `call` covering `units` ([`Call::unit`]): what a simulated
    /// driver does when asked to cost real time (`SimConfig::driver_time`),
    /// so that a call made under a lock holds that lock as long as on a
    /// device, and the threads behind it wait as long.
    ///
    /// Up to [`CostTable::SPIN_US`] the thread spins (a driver call is host
    /// work: an ioctl, page-table updates), beyond it it sleeps all but
    /// that much (long calls wait in the kernel) and spins the rest.
    pub fn spend(&self, call: Call, calls: u64, units: u64) {
        let us = self.cost(call).micros(call, calls, units);
        if us <= 0.0 {
            return;
        }
        let start = std::time::Instant::now();
        let total = std::time::Duration::from_secs_f64(us * 1e-6);
        let spin = std::time::Duration::from_secs_f64(Self::SPIN_US * 1e-6);
        if total > spin {
            std::thread::sleep(total - spin);
        }
        while start.elapsed() < total {
            std::hint::spin_loop();
        }
    }

    /// The longest time [`CostTable::spend`] spins without sleeping, in µs
    /// (Linux's sleeps overshoot by about 50 µs).
    pub const SPIN_US: f64 = 100.0;

    /// Modeled milliseconds of the calls in `counters` (a snapshot, or the
    /// difference of two: [`BackendCounters::since`]).
    pub fn millis(&self, counters: &BackendCounters) -> f64 {
        // A fold from +0.0: an empty f64 sum is -0.0.
        self.breakdown(counters).values().fold(0.0, |a, b| a + b)
    }

    /// Modeled milliseconds per call kind, for the kinds called.
    pub fn breakdown(&self, counters: &BackendCounters) -> BTreeMap<&'static str, f64> {
        Call::ALL
            .iter()
            .filter(|c| counters.get(**c) > 0)
            .map(|&c| {
                let us = self
                    .cost(c)
                    .micros(c, counters.get(c), counters.units_of(c));
                (c.name(), us / 1e3)
            })
            .collect()
    }

    /// Modeled milliseconds of calls counted by someone else (a replay peer
    /// such as the PyTorch port): `calls` by CUDA driver name
    /// ([`Call::name`]), `units` by the same names in the units of
    /// [`Call::unit`] (bytes, or chunks for `cuMemSetAccess`).
    ///
    /// Errors: a name that is not a [`Call`], and a kind whose cost grows
    /// with units (`us_per_unit > 0`) called without its units, so that
    /// nothing is silently charged nothing.
    pub fn millis_of(
        &self,
        calls: &BTreeMap<&str, u64>,
        units: Option<&BTreeMap<&str, u64>>,
    ) -> Result<f64> {
        let mut us = 0.0;
        for (&name, &n) in calls {
            let call = Call::from_name(name)
                .ok_or_else(|| cost_error(format!("unknown driver call {name:?}")))?;
            let cost = self.cost(call);
            let u = units.and_then(|u| u.get(name).copied());
            if n > 0 && u.is_none() && call.unit() != Unit::None && cost.us_per_unit > 0.0 {
                return Err(cost_error(format!(
                    "{name}: its cost grows with {:?}; pass its units",
                    call.unit()
                )));
            }
            us += cost.micros(call, n, u.unwrap_or(0));
        }
        if let Some(units) = units {
            if let Some(name) = units.keys().find(|k| !calls.contains_key(*k)) {
                return Err(cost_error(format!("units for {name:?} without calls")));
            }
        }
        Ok(us / 1e3)
    }

    /// The table as a cost file (JSON): `{"source": "...", "costs":
    /// {"cuMemMap": {"us": 1.45, "us_per_unit": 0.0}, ...}}`.
    pub fn to_json(&self) -> String {
        let file = CostFile {
            source: self.source.clone(),
            costs: Call::ALL
                .iter()
                .map(|&c| (c.name().to_string(), self.cost(c)))
                .collect(),
        };
        serde_json::to_string_pretty(&file).expect("a cost table serializes")
    }

    /// Reads a cost file over the defaults ([`CostTable::h200`]): the
    /// kinds it names replace them. Unknown kinds and fields, and negative
    /// or non-finite costs, are errors.
    pub fn from_json(text: &str) -> Result<CostTable> {
        CostTable::from_json_over(text, CostTable::h200())
    }

    /// [`CostTable::from_json`] over `base`.
    fn from_json_over(text: &str, base: CostTable) -> Result<CostTable> {
        let file: CostFile =
            serde_json::from_str(text).map_err(|e| cost_error(format!("not a cost file: {e}")))?;
        let mut t = base;
        for (name, cost) in &file.costs {
            let call = Call::from_name(name)
                .ok_or_else(|| cost_error(format!("unknown driver call {name:?}")))?;
            t.set(call, *cost)?;
        }
        if !file.source.is_empty() {
            t.source = file.source;
        }
        Ok(t)
    }

    /// Reads a cost file ([`CostTable::from_json`]); errors name the path.
    pub fn load(path: &std::path::Path) -> Result<CostTable> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| cost_error(format!("{}: {e}", path.display())))?;
        CostTable::from_json(&text).map_err(|e| match e {
            Error::Config { msg, .. } => cost_error(format!("{}: {msg}", path.display())),
            other => other,
        })
    }

    /// Sets where the figures come from.
    pub fn with_source(mut self, source: impl Into<String>) -> CostTable {
        self.source = source.into();
        self
    }
}

impl serde::Serialize for CostTable {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(2))?;
        m.serialize_entry("source", &self.source)?;
        let costs: BTreeMap<&str, CallCost> = Call::ALL
            .iter()
            .map(|&c| (c.name(), self.cost(c)))
            .collect();
        m.serialize_entry("costs", &costs)?;
        m.end()
    }
}

impl fmt::Display for CostTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "driver costs ({})", self.source)?;
        writeln!(
            f,
            "  {:<22} {:>12} {:>14}",
            "call", "us per call", "us per unit"
        )?;
        for &c in Call::ALL {
            let k = self.cost(c);
            let unit = match c.unit() {
                Unit::None => String::new(),
                Unit::Bytes => " /MiB".into(),
                Unit::Chunks => " /chunk".into(),
            };
            writeln!(
                f,
                "  {:<22} {:>12.2} {:>9.2}{unit}",
                c.name(),
                k.us,
                k.us_per_unit
            )?;
        }
        Ok(())
    }
}

/// Driver time per pass: what the reports carry beside the call counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct ColdWarm<T> {
    /// The first pass, on a fresh pool.
    pub cold: T,
    /// The second pass, over the same (warm) pool.
    pub warm: T,
}

/// Measures the cost table on `backend`'s device `dev`: every call kind the
/// table models, timed on the host, per-unit costs fitted from two sizes.
/// `gpupool bench --gpu --calibrate <path>` runs it on the CUDA backend
/// and writes [`CostTable::to_json`]; on the simulator it measures the
/// simulator (the tests use that to check the code path and the file).
///
/// `samples` repetitions per figure, the median counts. Needs a device
/// with virtual memory support and room for 64 MiB.
pub fn calibrate(backend: &dyn Backend, dev: usize, samples: usize) -> Result<CostTable> {
    calibration::run(backend, dev, samples.max(1))
}

mod calibration {
    use super::*;
    use crate::backend::{ChunkHandle, Move};
    use std::time::Instant;

    /// Median of the µs that `f` reports over `n` runs.
    fn median(n: usize, mut f: impl FnMut() -> Result<f64>) -> Result<f64> {
        let mut v = (0..n).map(|_| f()).collect::<Result<Vec<_>>>()?;
        v.sort_by(f64::total_cmp);
        Ok(v[v.len() / 2])
    }

    /// Microseconds `f` took.
    fn time<T>(f: impl FnOnce() -> Result<T>) -> Result<(f64, T)> {
        let t = Instant::now();
        let r = f()?;
        Ok((t.elapsed().as_secs_f64() * 1e6, r))
    }

    /// `(us per call, us per unit)` from times at two sizes (units `a < b`),
    /// clamped at 0 (noise can make a small slope negative).
    fn fit(a: (f64, f64), b: (f64, f64)) -> CallCost {
        let slope = ((b.1 - a.1) / (b.0 - a.0)).max(0.0);
        CallCost::new((a.1 - slope * a.0).max(0.0), slope)
    }

    pub(super) fn run(be: &dyn Backend, dev: usize, n: usize) -> Result<CostTable> {
        let gran = be.device_info(dev)?.granularity;
        let mut t = CostTable::published();
        let mut put = |c: Call, k: CallCost| t.set(c, k);
        let mib = |bytes: u64| bytes as f64 / MIB as f64;
        const RUN: u64 = 16;

        // Physical chunks: one granule, and RUN granules at once.
        let create = |bytes: u64| -> Result<f64> {
            median(n, || {
                let (us, c) = time(|| be.create_chunk(dev, bytes))?;
                be.release_chunk(dev, c)?;
                Ok(us)
            })
        };
        let (c1, c16) = (create(gran)?, create(RUN * gran)?);
        put(
            Call::MemCreate,
            fit((mib(gran), c1), (mib(RUN * gran), c16)),
        )?;
        let release = median(n, || {
            let c = be.create_chunk(dev, gran)?;
            Ok(time(|| be.release_chunk(dev, c))?.0)
        })?;
        put(Call::MemRelease, CallCost::new(release, 0.0))?;

        // Address space.
        let span = 4 * RUN * gran;
        let mut reserve = Vec::new();
        let mut free = Vec::new();
        for _ in 0..n {
            let (us, va) = time(|| be.reserve_va(dev, span))?;
            reserve.push(us);
            free.push(time(|| be.free_va(dev, va, span))?.0);
        }
        let mid = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        put(Call::AddressReserve, CallCost::new(mid(reserve), 0.0))?;
        put(Call::AddressFree, CallCost::new(mid(free), 0.0))?;

        // Mapping: map (with its one-chunk grant), a grant over 1 and over
        // RUN chunks, unmap.
        let va = be.reserve_va(dev, span)?;
        let chunks: Vec<ChunkHandle> = (0..RUN)
            .map(|_| be.create_chunk(dev, gran))
            .collect::<Result<_>>()?;
        let measured = (|| -> Result<(f64, f64, f64, f64)> {
            let (mut map, mut unmap, mut one, mut many) = (vec![], vec![], vec![], vec![]);
            for _ in 0..n {
                let mut m = 0.0;
                for (i, &c) in chunks.iter().enumerate() {
                    m += time(|| be.map(dev, va.offset(i as u64 * gran), gran, c, 0))?.0;
                }
                // `map` grants access as well: the grant's own cost, timed
                // below, is taken out.
                one.push(time(|| be.set_access(dev, va, gran, &[]))?.0);
                many.push(time(|| be.set_access(dev, va, RUN * gran, &[]))?.0);
                map.push(m / RUN as f64);
                let mut u = 0.0;
                for i in 0..RUN {
                    u += time(|| be.unmap(dev, va.offset(i * gran), gran))?.0;
                }
                unmap.push(u / RUN as f64);
            }
            Ok((mid(map), mid(unmap), mid(one), mid(many)))
        })();
        for c in &chunks {
            be.release_chunk(dev, *c)?;
        }
        be.free_va(dev, va, span)?;
        let (map, unmap, one, many) = measured?;
        let access = fit((1.0, one), (RUN as f64, many));
        put(Call::SetAccess, access)?;
        put(
            Call::Map,
            CallCost::new((map - access.micros(Call::SetAccess, 1, 1)).max(0.0), 0.0),
        )?;
        put(Call::Unmap, CallCost::new(unmap, 0.0))?;

        // Sharing between processes: export a chunk and import it back
        // (the published estimates stay where the backend cannot share).
        let c = be.create_chunk(dev, gran)?;
        let shared = (|| -> Result<(f64, f64)> {
            let (mut ex, mut im) = (vec![], vec![]);
            for _ in 0..n {
                let (us, (fd, off)) = time(|| be.export_chunk(dev, c))?;
                ex.push(us);
                let fd = std::os::fd::AsFd::as_fd(&fd);
                let (us, imported) = time(|| be.import_chunk(dev, fd, off, gran))?;
                im.push(us);
                be.release_chunk(dev, imported)?;
            }
            Ok((mid(ex), mid(im)))
        })();
        be.release_chunk(dev, c)?;
        match shared {
            Ok((ex, im)) => {
                put(Call::MemExport, CallCost::new(ex, 0.0))?;
                put(Call::MemImport, CallCost::new(im, 0.0))?;
            }
            Err(Error::Unsupported(_)) => {}
            Err(e) => return Err(e),
        }

        // Plain segments: a granule and 32 granules.
        let seg = |bytes: u64| -> Result<(f64, f64)> {
            let (mut a, mut f) = (vec![], vec![]);
            for _ in 0..n {
                let (us, p) = time(|| be.alloc_segment(dev, bytes))?;
                a.push(us);
                f.push(time(|| be.free_segment(dev, p))?.0);
            }
            Ok((mid(a), mid(f)))
        };
        let ((a1, f1), (a32, f32)) = (seg(gran)?, seg(32 * gran)?);
        put(Call::MemAlloc, fit((mib(gran), a1), (mib(32 * gran), a32)))?;
        put(Call::MemFree, CallCost::new((f1 + f32) / 2.0, 0.0))?;

        // Streams and events.
        let (mut sc, mut sd) = (vec![], vec![]);
        for _ in 0..n {
            let (us, s) = time(|| be.create_stream(dev))?;
            sc.push(us);
            sd.push(time(|| be.destroy_stream(dev, s))?.0);
        }
        put(Call::StreamCreate, CallCost::new(mid(sc), 0.0))?;
        put(Call::StreamDestroy, CallCost::new(mid(sd), 0.0))?;
        let s = be.create_stream(dev)?;
        let s2 = be.create_stream(dev)?;
        let measured = (|| -> Result<()> {
            let (mut ec, mut ed, mut rec, mut q, mut w, mut es, mut ss, mut cap, mut sq) = (
                vec![],
                vec![],
                vec![],
                vec![],
                vec![],
                vec![],
                vec![],
                vec![],
                vec![],
            );
            for _ in 0..n {
                let (us, e) = time(|| be.create_event(dev))?;
                ec.push(us);
                rec.push(time(|| be.record_event(dev, e, s))?.0);
                w.push(time(|| be.stream_wait_event(dev, s2, e))?.0);
                es.push(time(|| be.sync_event(dev, e))?.0);
                q.push(time(|| be.query_event(dev, e))?.0);
                ss.push(time(|| be.sync_stream(dev, s2))?.0);
                cap.push(time(|| be.stream_capturing(dev, s))?.0);
                sq.push(time(|| be.query_stream(dev, s))?.0);
                ed.push(time(|| be.destroy_event(dev, e))?.0);
            }
            put(Call::EventCreate, CallCost::new(mid(ec), 0.0))?;
            put(Call::EventDestroy, CallCost::new(mid(ed), 0.0))?;
            put(Call::EventRecord, CallCost::new(mid(rec), 0.0))?;
            put(Call::EventQuery, CallCost::new(mid(q), 0.0))?;
            put(Call::StreamWaitEvent, CallCost::new(mid(w), 0.0))?;
            // Synchronizing idle work: the call's own overhead.
            put(Call::EventSynchronize, CallCost::new(mid(es), 0.0))?;
            put(Call::StreamSynchronize, CallCost::new(mid(ss), 0.0))?;
            put(Call::StreamIsCapturing, CallCost::new(mid(cap), 0.0))?;
            put(Call::StreamQuery, CallCost::new(mid(sq), 0.0))?;

            // Launches and copies on a segment of 4 MiB: host time of the
            // asynchronous launches, and synchronous copies at two sizes.
            let bytes = 4 * MIB;
            let p = be.alloc_segment(dev, bytes)?;
            let work = (|| -> Result<()> {
                let (mut fill, mut mv) = (vec![], vec![]);
                for _ in 0..n {
                    fill.push(time(|| be.enqueue_fill(dev, s, p, bytes, 1))?.0);
                    let m = [Move {
                        src: p,
                        dst: p.offset(bytes / 2),
                        len: bytes / 2,
                    }];
                    mv.push(time(|| be.enqueue_moves(dev, s, &m))?.0);
                    be.sync_stream(dev, s)?;
                }
                put(Call::MemsetAsync, CallCost::new(mid(fill), 0.0))?;
                put(Call::LaunchMoves, CallCost::new(mid(mv), 0.0))?;
                let mut host = vec![0u8; bytes as usize];
                let small = 4096usize;
                let copy = |len: usize, host: &mut [u8], up: bool| -> Result<f64> {
                    median(n, || {
                        Ok(time(|| {
                            if up {
                                be.copy_from_host(dev, p, &host[..len])
                            } else {
                                be.copy_to_host(dev, p, &mut host[..len])
                            }
                        })?
                        .0)
                    })
                };
                let units = |len: usize| len as f64 / MIB as f64;
                for (call, up) in [(Call::MemcpyHtoD, true), (Call::MemcpyDtoH, false)] {
                    let (a, b) = (
                        copy(small, &mut host, up)?,
                        copy(bytes as usize, &mut host, up)?,
                    );
                    put(call, fit((units(small), a), (units(bytes as usize), b)))?;
                }
                Ok(())
            })();
            be.sync_stream(dev, s)?;
            be.free_segment(dev, p)?;
            work
        })();
        be.destroy_stream(dev, s)?;
        be.destroy_stream(dev, s2)?;
        measured?;
        let name = be.device_info(dev)?.name;
        Ok(t.with_source(format!(
            "calibrated on {name} ({} backend) by gpupool bench --gpu --calibrate, \
             median of {n} samples per figure",
            be.name()
        )))
    }
}

/// Modeled milliseconds of `calls` (by CUDA driver name, with `units` by
/// the same names) under `table`: [`CostTable::millis_of`], for callers
/// that count their own driver calls (replay peers).
pub fn driver_ms(
    table: &CostTable,
    calls: &BTreeMap<&str, u64>,
    units: Option<&BTreeMap<&str, u64>>,
) -> Result<f64> {
    table.millis_of(calls, units)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CallCounters;

    /// `spend` takes at least the modeled time, on both of its ways: a
    /// short call spun out, a long one slept and then spun.
    #[test]
    fn spend_takes_at_least_the_modeled_time() {
        let mut t = CostTable::h200();
        for us in [40.0, 1500.0] {
            t.set(Call::Map, CallCost::new(us, 0.0)).unwrap();
            let start = std::time::Instant::now();
            t.spend(Call::Map, 2, 0);
            assert!(start.elapsed() >= std::time::Duration::from_secs_f64(2.0 * us * 1e-6));
        }
    }

    /// Equal up to the last bits JSON's decimal form may lose.
    fn same(a: &CostTable, b: &CostTable) -> bool {
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-9 * x.abs().max(1.0);
        a.source() == b.source()
            && Call::ALL.iter().all(|&c| {
                let (x, y) = (a.cost(c), b.cost(c));
                close(x.us, y.us) && close(x.us_per_unit, y.us_per_unit)
            })
    }

    #[test]
    fn published_defaults_are_the_cited_figures() {
        let t = CostTable::published();
        assert_eq!(t.cost(Call::Map).us, 1.45);
        assert_eq!(t.cost(Call::Unmap).us, 25.63);
        assert_eq!(t.cost(Call::SetAccess).us_per_unit, 35.99);
        // One 2 MiB chunk costs what the kvcached benchmark measured.
        let create = t.cost(Call::MemCreate).micros(Call::MemCreate, 1, 2 * MIB);
        assert!((create - 193.32).abs() < 1e-9, "{create}");
        for &c in Call::ALL {
            let k = t.cost(c);
            assert!(
                k.us > 0.0 || k.us_per_unit > 0.0,
                "{} costs nothing",
                c.name()
            );
            if c.unit() == Unit::None {
                assert_eq!(k.us_per_unit, 0.0, "{} has no units", c.name());
            }
        }
    }

    #[test]
    fn costs_grow_with_units_and_deltas() {
        let t = CostTable::published();
        let k = CallCounters::default();
        let before = k.snapshot();
        // A run of 4 granules: 4 maps, one grant over 4 chunks.
        k.count_n(Call::Map, 4);
        k.count_units(Call::SetAccess, 1, 4);
        k.count_units(Call::MemAlloc, 1, 64 * MIB);
        let d = k.snapshot().since(&before);
        let want_us = 4.0 * 1.45 + 4.0 * 35.99 + (50.0 + 64.0 * 31.0);
        assert!((t.millis(&d) - want_us / 1e3).abs() < 1e-9);
        let b = t.breakdown(&d);
        assert_eq!(b.len(), 3);
        assert!((b["cuMemSetAccess"] - 4.0 * 35.99 / 1e3).abs() < 1e-12);
        // The same grant over twice the chunks costs twice as much.
        k.count_units(Call::SetAccess, 1, 8);
        let d2 = k.snapshot().since(&before);
        let b2 = t.breakdown(&d2);
        assert!((b2["cuMemSetAccess"] - 12.0 * 35.99 / 1e3).abs() < 1e-12);
        // Nothing counted, nothing charged (and printed as 0, not -0).
        let none = t.millis(&k.snapshot().since(&k.snapshot()));
        assert!(none == 0.0 && none.is_sign_positive());
    }

    #[test]
    fn peers_are_costed_by_name_with_their_units() {
        let t = CostTable::published();
        let calls = BTreeMap::from([("cuMemMap", 10u64), ("cuMemUnmap", 10)]);
        let ms = driver_ms(&t, &calls, None).unwrap();
        assert!((ms - 10.0 * (1.45 + 25.63) / 1e3).abs() < 1e-12);
        // cuMemCreate grows with bytes: without units it is an error, not 0.
        let calls = BTreeMap::from([("cuMemCreate", 2u64)]);
        assert!(t.millis_of(&calls, None).is_err());
        let units = BTreeMap::from([("cuMemCreate", 40 * MIB)]);
        let ms = t.millis_of(&calls, Some(&units)).unwrap();
        assert!((ms - 40.0 * 193.32 / 2.0 / 1e3).abs() < 1e-12);
        assert!(t
            .millis_of(&BTreeMap::from([("cudaMalloc", 1u64)]), None)
            .is_err());
        assert!(t
            .millis_of(&calls, Some(&BTreeMap::from([("cuMemAlloc", 1u64)])))
            .is_err());
    }

    #[test]
    fn cost_files_round_trip_and_reject_bad_input() {
        let mut t = CostTable::published();
        t.set(Call::Map, CallCost::new(2.5, 0.0)).unwrap();
        let t = t.with_source("test");
        let back = CostTable::from_json(&t.to_json()).unwrap();
        assert!(same(&back, &t), "{back:?}");
        assert_eq!(back.cost(Call::Map).us, 2.5);
        // A partial file keeps the defaults (the H200's) for what it
        // leaves out.
        let p = CostTable::from_json(r#"{"costs": {"cuMemUnmap": {"us": 7}}}"#).unwrap();
        assert_eq!(p.cost(Call::Unmap), CallCost::new(7.0, 0.0));
        assert_eq!(p.cost(Call::Map), CostTable::h200().cost(Call::Map));
        assert_eq!(
            CostTable::default().cost(Call::Map),
            CostTable::h200().cost(Call::Map)
        );
        assert_ne!(
            CostTable::h200().cost(Call::Map),
            CostTable::published().cost(Call::Map)
        );
        for bad in [
            r#"{"costs": {"cuMemMapp": {"us": 1}}}"#,
            r#"{"costs": {"cuMemMap": {"us": -1}}}"#,
            r#"{"costs": {"cuMemMap": {"usec": 1}}}"#,
            r#"{"cost": {}}"#,
            "not json",
        ] {
            assert!(
                matches!(CostTable::from_json(bad), Err(Error::Config { .. })),
                "{bad}"
            );
        }
        assert!(CostTable::load(std::path::Path::new("/nonexistent/costs.json")).is_err());
    }

    #[test]
    fn the_h200_table_names_every_kind_and_is_chosen_by_name() {
        let t = CostTable::h200();
        assert!(t.source().contains("H200"), "{}", t.source());
        let file: CostFile = serde_json::from_str(include_str!("costs/nvidia-h200.json")).unwrap();
        for &c in Call::ALL {
            assert_eq!(
                file.costs.contains_key(c.name()),
                !CostTable::UNMEASURED_ON_H200.contains(&c),
                "{}: measured, or listed as not",
                c.name()
            );
        }
        for &c in CostTable::UNMEASURED_ON_H200 {
            assert_eq!(t.cost(c), CostTable::published().cost(c), "{}", c.name());
        }
        // Measured, so unlike the published estimates: a map costs more
        // than an event record, an access grant far less than a map.
        assert!(t.cost(Call::Map).us > 10.0 * t.cost(Call::EventRecord).us);
        assert!(t.cost(Call::SetAccess).micros(Call::SetAccess, 1, 1) < t.cost(Call::Map).us);
        assert!(same(&CostTable::named_or_load("h200").unwrap(), &t));
        assert!(same(
            &CostTable::named_or_load("published").unwrap(),
            &CostTable::published()
        ));
        assert!(CostTable::named_or_load("/nonexistent/h100.json").is_err());
    }

    #[test]
    fn calibration_measures_every_kind_and_writes_a_loadable_file() {
        let be = crate::backend::sim::SimBackend::new(crate::backend::sim::SimConfig {
            capacity_bytes: 1 << 30,
            ..Default::default()
        })
        .unwrap();
        let before = be.counters();
        let t = calibrate(&be, 0, 3).unwrap();
        assert!(t.source().contains("calibrated"), "{}", t.source());
        let d = be.counters().since(&before);
        // Every kind of the table was exercised.
        for &c in Call::ALL {
            assert!(d.get(c) > 0, "{} not measured", c.name());
            let k = t.cost(c);
            assert!(k.us.is_finite() && k.us >= 0.0 && k.us_per_unit >= 0.0);
        }
        // Nothing was left behind on the device.
        assert_eq!(
            d.get(Call::MemCreate) + d.get(Call::MemImport),
            d.get(Call::MemRelease)
        );
        assert_eq!(d.get(Call::AddressReserve), d.get(Call::AddressFree));
        assert_eq!(d.get(Call::MemAlloc), d.get(Call::MemFree));
        let back = CostTable::from_json(&t.to_json()).unwrap();
        assert!(same(&back, &t), "{back:?}");
    }
}
