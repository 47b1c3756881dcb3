//! Configuration: [`PoolConfig`], the backend choice, and `GPUPOOL_CONF`.
//!
//! `GPUPOOL_CONF` is a comma-separated list of `key=value` pairs, in the
//! style of `PYTORCH_CUDA_ALLOC_CONF`:
//!
//! ```text
//! GPUPOOL_CONF=backend=sim,devices=2,capacity=8GiB,idle_ms=50
//! ```
//!
//! Sizes take a plain byte count or a suffix (`K`/`KiB`, `M`/`MiB`,
//! `G`/`GiB`, `T`/`TiB`, all powers of 1024; `KB`, `MB`, `GB` are powers of
//! 1000). Booleans take `1/0/true/false/yes/no/on/off`. Unknown keys and bad
//! values are errors that name the key. [`PoolConfig::KEYS`] lists every key
//! with its meaning.

use crate::backend::cost::{CallCost, CostTable};
use crate::backend::sim::SimBacking;
pub use crate::backend::sim::SimConfig;
use crate::backend::Call;
use crate::error::{Error, Result};
use std::time::Duration;

pub use crate::backend::BackendKind;

/// Everything that tunes the pools (and, through `GPUPOOL_CONF`, the backend).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PoolConfig {
    /// Backend to use when the runtime builder is not told otherwise.
    pub backend: BackendKind,
    /// Simulator settings, for `backend=sim` and for `auto` without CUDA.
    pub sim: SimConfig,
    /// Use at most this many devices (the first ones) of any backend
    /// (`devices=N`; `None`: all).
    pub device_limit: Option<usize>,
    /// Requests up to this many bytes come from size-class slabs; larger ones
    /// take the large (virtual-memory) path.
    pub small_max: u64,
    /// Virtual address space reserved per device for the large path, as a
    /// multiple of device memory.
    pub va_factor: u64,
    /// Hand a pending block to another stream by making that stream wait on
    /// the block's events (no host sync) instead of waiting for completion.
    pub handover: bool,
    /// Keep per-thread caches of small slots.
    pub thread_cache: bool,
    /// Granules the large path may steal (stitch) per granule it holds
    /// before the next request that would steal grows device memory
    /// instead; 0: always steal while stealing serves. See
    /// `pool/heap/stitch.rs`.
    pub stitch_budget: f64,
    /// The most share of wall time the large path may spend stealing
    /// (stitching), at the modeled cost of a map, an unmap and an access
    /// grant per granule (`driver_costs`); past it, a request that would
    /// steal grows device memory instead. 0 (the default): no limit.
    /// `gpupool.torch.install()` sets 0.01: a PyTorch loop marks no steps,
    /// and one whose shapes vary restitched every step on an H200 (see
    /// `pool/heap/stitch_share.rs`, docs/BENCHMARKS.md §7).
    pub stitch_share: f64,
    /// Least time between two probes on one stream for `record_stream`'d
    /// frees, outside an allocation's slow path (see `pool/probes.rs`).
    pub probe_interval: Duration,
    /// Start an idle-time compaction pass after this long without traffic
    /// (`None`: never automatically).
    pub idle: Option<Duration>,
    /// Most bytes one compaction pass moves.
    pub compact_max_bytes: u64,
    /// Most blocks one compaction pass moves.
    pub compact_max_blocks: usize,
    /// Give memory emptied by compaction back to the device (`true`) or keep
    /// it cached in the pool (`false`).
    pub compact_release: bool,
    /// Interval of the runtime's per-device maintenance threads (`None`:
    /// no threads). See `Runtime`.
    pub maintenance_tick: Option<Duration>,
    /// Idle release policy: after this long without traffic, the
    /// maintenance thread gives cached memory back to the device when it
    /// exceeds [`PoolConfig::release_fraction`] times what the last busy
    /// period needed (`None`: never automatically).
    pub idle_release: Option<Duration>,
    /// The idle release policy's threshold, as a multiple of the peak of
    /// active bytes during the last busy period.
    pub release_fraction: f64,
    /// Modeled latency of each driver call, for the driver time the
    /// reports give (`driver_costs=h200|published|<file>`, `cost.<call>=<µs>`; see
    /// [`CostTable`]).
    pub driver_costs: CostTable,
    /// The most device memory a pool holds (`max_bytes=`; `None`: no limit
    /// but the device). See `DevicePool::set_memory_limit`.
    pub max_bytes: Option<u64>,
    /// The most device memory a pool holds, as a fraction of the device's
    /// memory in `(0, 1]` (`fraction=`; the smaller limit wins).
    pub memory_fraction: Option<f64>,
    /// Device memory reserved and mapped when a pool is built
    /// (`initial_bytes=`; it stays cached for the first allocations).
    pub initial_bytes: u64,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            backend: BackendKind::Auto,
            sim: SimConfig::default(),
            device_limit: None,
            small_max: 32 << 10,
            va_factor: 4,
            handover: true,
            thread_cache: true,
            stitch_budget: 0.0,
            stitch_share: 0.0,
            probe_interval: Duration::from_micros(500),
            idle: None,
            compact_max_bytes: 256 << 20,
            compact_max_blocks: 4096,
            compact_release: true,
            maintenance_tick: Some(Duration::from_millis(5)),
            idle_release: None,
            release_fraction: 2.0,
            driver_costs: CostTable::h200(),
            max_bytes: None,
            memory_fraction: None,
            initial_bytes: 0,
        }
    }
}

impl PoolConfig {
    /// Every key `GPUPOOL_CONF` accepts, with what it sets.
    pub const KEYS: &'static [(&'static str, &'static str)] = &[
        (
            "backend",
            "sim | cuda | auto (default auto: CUDA if present, else sim)",
        ),
        (
            "devices",
            "use the first N devices (default: all; the simulator makes N, default 1)",
        ),
        ("capacity", "memory per simulated device (default 8GiB)"),
        (
            "granularity",
            "simulated allocation granularity (default 2MiB)",
        ),
        (
            "vmm",
            "simulated devices support virtual memory (default true)",
        ),
        (
            "op_delay_us",
            "simulated delay before each stream operation (default 0)",
        ),
        (
            "queue_depth",
            "simulated operations a stream queues before the host blocks; 0: no bound (default 1024)",
        ),
        (
            "backing",
            "simulated memory: memory | accounting (default memory)",
        ),
        (
            "driver_time",
            "simulated driver calls: counted (the default: costed in reports only) | spent (each takes its modeled time, at driver_costs, on the calling thread, as on a GPU)",
        ),
        (
            "small_max",
            "largest request served from size-class slabs (default 1MiB)",
        ),
        (
            "va_factor",
            "large-path address space per device, times its memory (default 4)",
        ),
        (
            "stitch_budget",
            "granules stitched per granule held before growing instead (default 0: always stitch)",
        ),
        (
            "stitch_share",
            "most share of wall time spent stitching before growing instead (default 0: no limit; gpupool.torch.install() sets 0.01)",
        ),
        (
            "probe_interval_us",
            "least microseconds between two probes on a stream for record_stream'd frees (default 500)",
        ),
        (
            "handover",
            "hand pending blocks to other streams via stream-wait-event (default true)",
        ),
        (
            "thread_cache",
            "per-thread caches of small slots (default true)",
        ),
        (
            "idle_ms",
            "idle time before automatic compaction, 0 = never (default 0)",
        ),
        (
            "compact_max_bytes",
            "bytes moved per compaction pass at most (default 256MiB)",
        ),
        (
            "compact_max_blocks",
            "blocks moved per compaction pass at most (default 4096)",
        ),
        (
            "compact_release",
            "return compacted memory to the device (default true)",
        ),
        (
            "maint_ms",
            "tick of the per-device maintenance threads, 0 = no threads (default 5)",
        ),
        (
            "idle_release_ms",
            "idle time before cached memory above release_fraction is given back, 0 = never (default 0)",
        ),
        (
            "release_fraction",
            "idle release keeps cached bytes up to this multiple of the last busy period's peak (default 2)",
        ),
        (
            "max_bytes",
            "most device memory each pool holds, on every backend; 0 = no limit (default 0)",
        ),
        (
            "fraction",
            "most device memory each pool holds, as a fraction (0, 1] of the device's memory (default 1); with max_bytes the smaller wins",
        ),
        (
            "initial_bytes",
            "device memory each pool reserves and maps when it is built (default 0)",
        ),
        (
            "driver_costs",
            "driver-call costs the reports charge: `h200` (default: measured on an H200), `published` (figures from the literature), or the path of a JSON cost file (as `gpupool bench --gpu --calibrate` writes) replacing the default costs it names",
        ),
        (
            "cost.<call>",
            "modeled µs per call of one driver call, e.g. cost.cuMemMap=1.45; cost.<call>.per_unit sets µs per MiB (per chunk for cuMemSetAccess)",
        ),
    ];

    /// Reads `GPUPOOL_CONF`; the defaults where it is unset or empty.
    pub fn from_env() -> Result<PoolConfig> {
        match std::env::var("GPUPOOL_CONF") {
            Ok(s) => PoolConfig::parse(&s),
            Err(std::env::VarError::NotPresent) => Ok(PoolConfig::default()),
            Err(e) => Err(Error::Config {
                key: "GPUPOOL_CONF".into(),
                msg: e.to_string(),
            }),
        }
    }

    /// Parses a `GPUPOOL_CONF` string over the defaults.
    pub fn parse(s: &str) -> Result<PoolConfig> {
        let mut c = PoolConfig::default();
        let mut backend = None;
        // `cost.*` keys apply over the cost file wherever they stand.
        let mut cost_keys = Vec::new();
        let mut spend = false;
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (key, value) = item.split_once('=').ok_or_else(|| Error::Config {
                key: item.to_string(),
                msg: "expected key=value".into(),
            })?;
            let (key, value) = (key.trim(), value.trim());
            let bad = |msg: String| Error::Config {
                key: key.to_string(),
                msg,
            };
            match key {
                "backend" => backend = Some(value.to_ascii_lowercase()),
                "devices" => {
                    c.sim.devices = parse_u64(value).map_err(bad)? as usize;
                    if c.sim.devices == 0 || c.sim.devices > 64 {
                        return Err(bad(format!("{value}: between 1 and 64 devices")));
                    }
                    c.device_limit = Some(c.sim.devices);
                }
                "capacity" => c.sim.capacity_bytes = nonzero(parse_size(value)).map_err(bad)?,
                "granularity" => {
                    let g = parse_size(value).map_err(bad)?;
                    if !g.is_power_of_two() || g < 4096 {
                        return Err(bad(format!("{value}: a power of two of at least 4KiB")));
                    }
                    c.sim.granularity = g;
                }
                "vmm" => c.sim.vmm = parse_bool(value).map_err(bad)?,
                "op_delay_us" => {
                    c.sim.op_delay = Duration::from_micros(parse_u64(value).map_err(bad)?)
                }
                "queue_depth" => c.sim.queue_depth = parse_u64(value).map_err(bad)? as usize,
                "backing" => {
                    c.sim.backing = match value {
                        "memory" => SimBacking::Memory,
                        "accounting" => SimBacking::Accounting,
                        _ => return Err(bad(format!("{value}: expected memory or accounting"))),
                    }
                }
                "driver_time" => {
                    spend = match value {
                        "counted" => false,
                        "spent" => true,
                        _ => return Err(bad(format!("{value}: expected counted or spent"))),
                    }
                }
                "small_max" => c.small_max = nonzero(parse_size(value)).map_err(bad)?,
                "va_factor" => {
                    c.va_factor = nonzero(parse_u64(value)).map_err(bad)?;
                    if c.va_factor > 64 {
                        return Err(bad(format!("{value}: at most 64")));
                    }
                }
                "stitch_share" => {
                    let v = parse_non_negative(value).map_err(bad)?;
                    if v > 1.0 {
                        return Err(bad(format!("{value}: a share of time, 0 to 1")));
                    }
                    c.stitch_share = v
                }
                "handover" => c.handover = parse_bool(value).map_err(bad)?,
                "stitch_budget" => c.stitch_budget = parse_non_negative(value).map_err(bad)?,
                "probe_interval_us" => {
                    c.probe_interval = Duration::from_micros(parse_u64(value).map_err(bad)?)
                }
                "thread_cache" => c.thread_cache = parse_bool(value).map_err(bad)?,
                "idle_ms" => {
                    let ms = parse_u64(value).map_err(bad)?;
                    c.idle = (ms > 0).then(|| Duration::from_millis(ms));
                }
                "compact_max_bytes" => {
                    c.compact_max_bytes = nonzero(parse_size(value)).map_err(bad)?
                }
                "compact_max_blocks" => {
                    c.compact_max_blocks = nonzero(parse_u64(value)).map_err(bad)? as usize
                }
                "compact_release" => c.compact_release = parse_bool(value).map_err(bad)?,
                "maint_ms" => {
                    let ms = parse_u64(value).map_err(bad)?;
                    c.maintenance_tick = (ms > 0).then(|| Duration::from_millis(ms));
                }
                "idle_release_ms" => {
                    let ms = parse_u64(value).map_err(bad)?;
                    c.idle_release = (ms > 0).then(|| Duration::from_millis(ms));
                }
                "release_fraction" => {
                    c.release_fraction = parse_non_negative(value).map_err(bad)?
                }
                "max_bytes" => {
                    let b = parse_size(value).map_err(bad)?;
                    c.max_bytes = (b > 0).then_some(b);
                }
                "fraction" => {
                    let f: f64 = value
                        .parse()
                        .map_err(|_| bad(format!("{value:?} is not a number")))?;
                    if !(f.is_finite() && f > 0.0 && f <= 1.0) {
                        return Err(bad(format!("{value}: a fraction in (0, 1]")));
                    }
                    c.memory_fraction = (f < 1.0).then_some(f);
                }
                "initial_bytes" => c.initial_bytes = parse_size(value).map_err(bad)?,
                "driver_costs" => {
                    c.driver_costs =
                        CostTable::named_or_load(value).map_err(|e| bad(e.to_string()))?
                }
                k if k.starts_with("cost.") => cost_keys.push((key, value)),
                _ => {
                    return Err(Error::Config {
                        key: key.to_string(),
                        msg: format!(
                            "unknown key; known keys: {}",
                            Self::KEYS
                                .iter()
                                .map(|k| k.0)
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    })
                }
            }
        }
        for (key, value) in cost_keys {
            let bad = |msg: String| Error::Config {
                key: key.to_string(),
                msg,
            };
            let rest = &key["cost.".len()..];
            let (name, per_unit) = match rest.strip_suffix(".per_unit") {
                Some(n) => (n, true),
                None => (rest, false),
            };
            let call = Call::from_name(name).ok_or_else(|| {
                bad(format!(
                    "unknown driver call {name:?}; known: {}",
                    Call::ALL
                        .iter()
                        .map(|c| c.name())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?;
            let us: f64 = value
                .parse()
                .map_err(|_| bad(format!("{value:?} is not a number of microseconds")))?;
            let mut k: CallCost = c.driver_costs.cost(call);
            if per_unit {
                k.us_per_unit = us;
            } else {
                k.us = us;
            }
            c.driver_costs
                .set(call, k)
                .map_err(|e| bad(e.to_string()))?;
            let src = format!("{} with {key}={value}", c.driver_costs.source());
            c.driver_costs = c.driver_costs.clone().with_source(src);
        }
        // The table as the whole string sets it, wherever the key stands.
        c.sim.driver_time = spend.then(|| std::sync::Arc::new(c.driver_costs.clone()));
        c.backend = match backend.as_deref() {
            None | Some("auto") => BackendKind::Auto,
            Some("sim") => BackendKind::Sim(c.sim.clone()),
            Some("cuda") => BackendKind::Cuda,
            Some(other) => {
                return Err(Error::Config {
                    key: "backend".into(),
                    msg: format!("{other}: expected sim, cuda or auto"),
                })
            }
        };
        Ok(c)
    }
}

fn nonzero(v: std::result::Result<u64, String>) -> std::result::Result<u64, String> {
    match v {
        Ok(0) => Err("must be greater than zero".into()),
        other => other,
    }
}

fn parse_u64(s: &str) -> std::result::Result<u64, String> {
    s.parse::<u64>()
        .map_err(|_| format!("{s:?} is not a whole number"))
}

/// Parses a byte size such as `4096`, `64KiB`, `2M`, `8GiB` or `1.5GB`.
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(format!("{s:?}: unknown size unit {unit:?}")),
    };
    if num.is_empty() {
        return Err(format!("{s:?} is not a size"));
    }
    let v: f64 = num.parse().map_err(|_| format!("{s:?} is not a size"))?;
    let bytes = v * mult as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 || bytes.fract() != 0.0 {
        return Err(format!("{s:?} is not a whole number of bytes"));
    }
    Ok(bytes as u64)
}

/// A finite number `>= 0`.
fn parse_non_negative(s: &str) -> std::result::Result<f64, String> {
    let f: f64 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    if f.is_finite() && f >= 0.0 {
        Ok(f)
    } else {
        Err(format!("{s}: a finite number >= 0"))
    }
}

fn parse_bool(s: &str) -> std::result::Result<bool, String> {
    match s.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(format!("{s:?} is not a boolean")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64KiB"), Ok(64 << 10));
        assert_eq!(parse_size("2M"), Ok(2 << 20));
        assert_eq!(parse_size("8GiB"), Ok(8 << 30));
        assert_eq!(parse_size("1.5GB"), Ok(1_500_000_000));
        assert!(parse_size("12XB").is_err());
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("-1").is_err());
    }

    #[test]
    fn conf_string_sets_backend_and_keys() {
        let c = PoolConfig::parse("backend=sim,devices=2,capacity=8GiB,idle_ms=50").unwrap();
        assert_eq!(c.sim.devices, 2);
        assert_eq!(c.sim.capacity_bytes, 8 << 30);
        assert_eq!(c.idle, Some(Duration::from_millis(50)));
        match c.backend {
            BackendKind::Sim(s) => assert_eq!(s.devices, 2),
            other => panic!("expected sim, got {other:?}"),
        }
        assert_eq!(PoolConfig::parse("").unwrap(), PoolConfig::default());
    }

    #[test]
    fn unknown_key_and_bad_value_name_the_key() {
        match PoolConfig::parse("devices=2,colour=blue") {
            Err(Error::Config { key, msg }) => {
                assert_eq!(key, "colour");
                assert!(msg.contains("unknown key"), "{msg}");
            }
            other => panic!("{other:?}"),
        }
        match PoolConfig::parse("capacity=lots") {
            Err(Error::Config { key, .. }) => assert_eq!(key, "capacity"),
            other => panic!("{other:?}"),
        }
        match PoolConfig::parse("backend=tpu") {
            Err(Error::Config { key, .. }) => assert_eq!(key, "backend"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            PoolConfig::parse("devices"),
            Err(Error::Config { .. })
        ));
        assert!(matches!(
            PoolConfig::parse("devices=0"),
            Err(Error::Config { .. })
        ));
        assert!(matches!(
            PoolConfig::parse("vmm=maybe"),
            Err(Error::Config { .. })
        ));
        for bad in ["-1", "NaN", "inf", "lots"] {
            match PoolConfig::parse(&format!("stitch_budget={bad}")) {
                Err(Error::Config { key, .. }) => assert_eq!(key, "stitch_budget"),
                other => panic!("{bad}: {other:?}"),
            }
        }
        assert_eq!(PoolConfig::default().stitch_share, 0.0);
        assert_eq!(
            PoolConfig::parse("stitch_share=0.05").unwrap().stitch_share,
            0.05
        );
        for bad in ["-0.1", "1.5", "NaN", "some"] {
            match PoolConfig::parse(&format!("stitch_share={bad}")) {
                Err(Error::Config { key, .. }) => assert_eq!(key, "stitch_share"),
                other => panic!("{bad}: {other:?}"),
            }
        }
        assert_eq!(
            PoolConfig::parse("stitch_budget=2.5")
                .unwrap()
                .stitch_budget,
            2.5
        );
    }

    /// `driver_time=spent` hands the simulator the final cost table, with
    /// the `cost.` keys applied wherever they stand; `counted` (and no
    /// key) none; anything else is a typed error.
    #[test]
    fn driver_time_spent_gives_the_simulator_the_final_table() {
        let c = PoolConfig::parse("driver_time=spent,backend=sim,cost.cuMemMap=7").unwrap();
        let t = c.sim.driver_time.as_ref().expect("a table to spend");
        assert_eq!(t.cost(Call::Map).us, 7.0);
        match &c.backend {
            BackendKind::Sim(s) => assert_eq!(s.driver_time.as_deref(), Some(&**t)),
            other => panic!("{other:?}"),
        }
        assert!(PoolConfig::parse("driver_time=counted")
            .unwrap()
            .sim
            .driver_time
            .is_none());
        assert!(PoolConfig::default().sim.driver_time.is_none());
        match PoolConfig::parse("driver_time=slept") {
            Err(Error::Config { key, .. }) => assert_eq!(key, "driver_time"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn every_documented_key_is_accepted() {
        let values = |k: &str| match k {
            "backend" => "sim",
            "backing" => "accounting",
            "driver_time" => "spent",
            "vmm" | "handover" | "thread_cache" | "compact_release" => "false",
            "granularity" => "64KiB",
            "fraction" | "stitch_share" => "0.5",
            _ => "3",
        };
        let file = std::env::temp_dir().join(format!("gpupool-costs-{}.json", std::process::id()));
        std::fs::write(&file, CostTable::published().to_json()).unwrap();
        for (k, _) in PoolConfig::KEYS {
            let s = match *k {
                "driver_costs" => format!("driver_costs={}", file.display()),
                "cost.<call>" => "cost.cuMemMap=3".to_string(),
                k => format!("{k}={}", values(k)),
            };
            PoolConfig::parse(&s).unwrap_or_else(|e| panic!("{s}: {e}"));
        }
        let _ = std::fs::remove_file(file);
    }

    #[test]
    fn driver_costs_come_from_a_file_and_cost_keys() {
        let file =
            std::env::temp_dir().join(format!("gpupool-costs-k-{}.json", std::process::id()));
        std::fs::write(
            &file,
            r#"{"source": "bench", "costs": {"cuMemMap": {"us": 9.5}}}"#,
        )
        .unwrap();
        // The cost key applies over the file even when written first.
        let c = PoolConfig::parse(&format!(
            "cost.cuMemSetAccess.per_unit=2,driver_costs={},cost.cuMemUnmap=4",
            file.display()
        ))
        .unwrap();
        let _ = std::fs::remove_file(&file);
        let t = &c.driver_costs;
        assert_eq!(
            t.cost(Call::Map),
            CallCost {
                us: 9.5,
                us_per_unit: 0.0
            }
        );
        assert_eq!(t.cost(Call::Unmap).us, 4.0);
        assert_eq!(t.cost(Call::SetAccess).us_per_unit, 2.0);
        assert_eq!(
            t.cost(Call::MemCreate),
            CostTable::h200().cost(Call::MemCreate)
        );
        assert!(t.source().starts_with("bench"), "{}", t.source());
        for bad in [
            "cost.cuMemMapp=1",
            "cost.cuMemMap=-1",
            "cost.cuMemMap=fast",
            "driver_costs=/nonexistent/costs.json",
        ] {
            match PoolConfig::parse(bad) {
                Err(Error::Config { key, .. }) => {
                    assert_eq!(key, bad.split('=').next().unwrap(), "{bad}")
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
        assert_eq!(PoolConfig::default().driver_costs, CostTable::h200());
    }
}
