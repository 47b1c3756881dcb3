//! `gpupool`: demo, info, topology and benchmarks from the command line.
//! Every command takes `--json` for a machine-readable report.

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use gpupool::backend::sim::SimConfig;
use gpupool::{BackendKind, PoolConfig, Runtime};

#[derive(Parser)]
#[command(
    name = "gpupool",
    version,
    about = "A lock-free, multi-GPU device-memory allocator runtime"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a short data-parallel training workload on every device and report.
    Demo {
        #[command(flatten)]
        common: Common,
        /// Training steps (spread over batch phases 32, 64, 16).
        #[arg(long, default_value_t = 12)]
        steps: usize,
        /// Where to write the SVG plot of memory over time.
        #[arg(long, default_value = "target/gpupool-demo.svg")]
        plot: std::path::PathBuf,
    },
    /// Print the backend, its devices and the effective configuration.
    Info {
        #[command(flatten)]
        common: Common,
    },
    /// Print the host topology nearest each device.
    Topo {
        #[command(flatten)]
        common: Common,
    },
    /// Replay allocation traces through the pool and report fragmentation.
    Replay {
        /// Trace files: PyTorch snapshots (.pickle), RMM logs, lifetimes CSVs.
        #[arg(required = true)]
        files: Vec<std::path::PathBuf>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Write an SVG of live vs reserved bytes per trace into this folder.
        #[arg(long)]
        plot: Option<std::path::PathBuf>,
        /// Timed repetitions per trace (the fastest counts).
        #[arg(long, default_value_t = 3)]
        repeats: usize,
        /// Serve both passes dynamically: do not mark each pass as a step
        /// (no learned plan for the second pass).
        #[arg(long)]
        dynamic: bool,
    },
    /// Micro-benchmarks, side by side with baselines in the same run.
    Bench {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// A short run (seconds), for smoke tests.
        #[arg(long)]
        quick: bool,
        /// On a CUDA device instead: pool pairs vs cuMemAlloc and
        /// cuMemAllocAsync, compaction kernel vs cuMemcpyDtoD.
        #[arg(long)]
        gpu: bool,
        /// With --gpu: first measure every driver call's cost on device 0
        /// and write the cost table to this file (JSON), for
        /// GPUPOOL_CONF=driver_costs=<file>.
        #[arg(long, requires = "gpu", value_name = "PATH")]
        calibrate: Option<std::path::PathBuf>,
        /// Most threads of the thread tables (default: the cores, at
        /// least 2).
        #[arg(long, value_name = "N")]
        threads: Option<usize>,
    },
    /// Multi-device, multi-stream, multi-thread stress on the simulator, with
    /// integrity verification and a progress bar.
    Stress(StressArgs),
}

#[derive(Args, Clone)]
struct Common {
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    /// Backend: sim, cuda or auto (default: GPUPOOL_CONF's, else auto).
    #[arg(long)]
    backend: Option<String>,
    /// Simulated devices (when the simulator is used).
    #[arg(long)]
    devices: Option<usize>,
}

impl Common {
    /// The runtime the options describe; `sim_devices` is the simulator's
    /// device count when neither the flag nor GPUPOOL_CONF says.
    fn runtime(&self, sim_devices: usize) -> Result<Runtime> {
        let conf = std::env::var("GPUPOOL_CONF").unwrap_or_default();
        let mut cfg = PoolConfig::parse(&conf).context("GPUPOOL_CONF")?;
        if !conf.contains("devices=") {
            cfg.sim.devices = sim_devices;
        }
        if let Some(d) = self.devices {
            cfg.sim.devices = d;
        }
        let kind = match self.backend.as_deref() {
            None => match cfg.backend {
                BackendKind::Sim(_) => BackendKind::Sim(cfg.sim.clone()),
                ref other => other.clone(),
            },
            Some("sim") => BackendKind::Sim(cfg.sim.clone()),
            Some("cuda") => BackendKind::Cuda,
            Some("auto") => BackendKind::Auto,
            Some(other) => anyhow::bail!("--backend {other}: expected sim, cuda or auto"),
        };
        Ok(Runtime::builder().backend(kind).config(cfg).build()?)
    }
}

fn print<T: serde::Serialize + std::fmt::Display>(json: bool, v: &T) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(v)?);
    } else {
        println!("{v}");
    }
    Ok(())
}

#[derive(serde::Serialize)]
struct InfoReport {
    backend: String,
    devices: Vec<gpupool::DeviceInfo>,
    config: PoolConfig,
    size_classes: Vec<u64>,
    config_keys: Vec<(&'static str, &'static str)>,
}

impl std::fmt::Display for InfoReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "backend: {}", self.backend)?;
        for d in &self.devices {
            writeln!(
                f,
                "device {}: {} | {:.2} GiB | granularity {} KiB | VMM {} | PCI {}",
                d.index,
                d.name,
                d.total_bytes as f64 / (1u64 << 30) as f64,
                d.granularity >> 10,
                if d.vmm_supported { "yes" } else { "no" },
                d.pci_bus_id
            )?;
        }
        let c = &self.config;
        writeln!(
            f,
            "config: small_max {} B, va_factor {}, handover {}, thread_cache {}, idle {:?}, \
             compact_max_bytes {}, compact_max_blocks {}, compact_release {}",
            c.small_max,
            c.va_factor,
            c.handover,
            c.thread_cache,
            c.idle,
            c.compact_max_bytes,
            c.compact_max_blocks,
            c.compact_release
        )?;
        writeln!(
            f,
            "size classes ({}): {:?}",
            self.size_classes.len(),
            self.size_classes
        )?;
        writeln!(f, "GPUPOOL_CONF keys:")?;
        for (k, v) in &self.config_keys {
            writeln!(f, "  {k:<20} {v}")?;
        }
        Ok(())
    }
}

/// `gpupool topo`: the topology, where each maintenance thread runs, and
/// the peer-access matrix.
#[derive(serde::Serialize)]
struct TopoReport {
    #[serde(flatten)]
    topology: gpupool::topology::Topology,
    maintenance: Vec<gpupool::runtime::MaintenanceStats>,
    peer_access: gpupool::runtime::PeerMatrix,
}

impl TopoReport {
    fn of(rt: &Runtime) -> TopoReport {
        // Give the threads a moment to bind and report it.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while rt.maintenance_stats().iter().any(|m| m.binding.is_none())
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        TopoReport {
            topology: rt.topology().clone(),
            maintenance: rt.maintenance_stats(),
            peer_access: rt.peer_matrix().clone(),
        }
    }
}

impl std::fmt::Display for TopoReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use gpupool::runtime::ThreadBinding;
        writeln!(f, "{}", self.topology)?;
        if self.maintenance.is_empty() {
            writeln!(f, "maintenance threads: off")?;
        }
        for m in &self.maintenance {
            match &m.binding {
                Some(ThreadBinding::Bound { cpus }) => {
                    writeln!(f, "{}: bound to CPUs {cpus:?}", m.thread)?
                }
                Some(ThreadBinding::Unbound { reason }) => {
                    writeln!(f, "{}: unbound ({reason})", m.thread)?
                }
                None => writeln!(f, "{}: not started", m.thread)?,
            }
        }
        write!(f, "{}", self.peer_access)
    }
}

fn info(common: &Common) -> Result<()> {
    let rt = common.runtime(SimConfig::default().devices)?;
    let devices = rt.devices().into_iter().map(|p| p.info().clone()).collect();
    let size_classes = rt.device(0)?.size_classes().sizes().to_vec();
    let report = InfoReport {
        backend: rt.backend().name().into(),
        devices,
        config: rt.config().clone(),
        size_classes,
        config_keys: PoolConfig::KEYS.to_vec(),
    };
    print(common.json, &report)
}

fn replay(
    files: &[std::path::PathBuf],
    json: bool,
    plot: Option<&std::path::Path>,
    repeats: usize,
    learn_steps: bool,
) -> Result<()> {
    use gpupool_tools::trace::plot::{line_chart, Series};
    use gpupool_tools::trace::replay::{replay_file, ReplayOptions};
    let cfg = PoolConfig::from_env().context("GPUPOOL_CONF")?;
    let opts = ReplayOptions {
        config: cfg,
        samples: if plot.is_some() { 2000 } else { 0 },
        repeats,
        peers: true,
        learn_steps,
    };
    let mut reports = Vec::new();
    for f in files {
        reports
            .extend(replay_file(f, &opts).with_context(|| format!("replaying {}", f.display()))?);
    }
    if let Some(dir) = plot {
        std::fs::create_dir_all(dir)?;
        for r in &reports {
            let pts = |k: usize| {
                r.samples
                    .iter()
                    .map(|s| (s.0 as f64, [s.1, s.2][k] as f64))
                    .collect::<Vec<_>>()
            };
            let mut series = vec![
                Series {
                    name: "live (requested) bytes",
                    colour: "#1f77b4",
                    points: pts(0),
                },
                Series {
                    name: "gpupool reserved bytes",
                    colour: "#d62728",
                    points: pts(1),
                },
            ];
            // The PyTorch port in both modes, from an empty allocator.
            if let Some(p) = &r.peers {
                for (name, colour, peer) in [
                    ("PyTorch default (port) reserved", "#ff7f0e", &p.torch),
                    (
                        "PyTorch expandable (port) reserved",
                        "#9467bd",
                        &p.torch_expandable,
                    ),
                ] {
                    let run = peer.cold_start.as_ref().unwrap_or(&peer.run);
                    series.push(Series {
                        name,
                        colour,
                        points: run
                            .samples
                            .iter()
                            .map(|&(i, b)| (i as f64, b as f64))
                            .collect(),
                    });
                }
            }
            if let Some(b) = &r.baseline {
                let x = r.samples.last().map_or(1.0, |s| s.0 as f64);
                let y = b.peak_reserved_bytes as f64;
                series.push(Series {
                    name: "PyTorch peak reserved",
                    colour: "#2ca02c",
                    points: vec![(0.0, y), (x, y)],
                });
            }
            let title = format!(
                "{}: live vs reserved ({:.2}% overhead)",
                r.name,
                r.overhead * 100.0
            );
            let svg = line_chart(&title, "event", "GiB", (1u64 << 30) as f64, &series);
            let path = dir.join(format!("{}.svg", r.name.replace(['/', '#'], "_")));
            std::fs::write(&path, svg)?;
            eprintln!("wrote {}", path.display());
        }
    }
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "traces": reports }))?
        );
        return Ok(());
    }
    println!(
        "{:<28} {:>8} {:>16} {:>16} {:>9} {:>17} {:>9} {:>9} {:>10} {:>8} {:>12} {:>12} {:>10} {:>11} {:>11}",
        "trace",
        "events",
        "peak live",
        "gpupool reserved",
        "overhead",
        "baseline reserved",
        "baseline",
        "torch",
        "torch exp.",
        "port=rec",
        "events/s",
        "cold ev/s",
        "warm calls",
        "drv ms cold",
        "drv ms warm"
    );
    let pct = |o: Option<f64>| o.map_or_else(|| "-".to_string(), |o| format!("{:.2}%", o * 100.0));
    for r in &reports {
        let (b, bo) = match (&r.baseline, r.baseline_overhead) {
            (Some(b), Some(o)) => (
                b.peak_reserved_bytes.to_string(),
                format!("{:.2}%", o * 100.0),
            ),
            _ => ("-".into(), "-".into()),
        };
        let p = r.peers.as_ref();
        let matched = p
            .and_then(|p| {
                [&p.torch, &p.torch_expandable]
                    .iter()
                    .filter_map(|x| x.matched_recording)
                    .reduce(|a, b| a && b)
            })
            .map_or("-", |m| if m { "yes" } else { "no" });
        println!(
            "{:<28} {:>8} {:>16} {:>16} {:>8.2}% {:>17} {:>9} {:>9} {:>10} {:>8} {:>12.0} {:>12.0} {:>10} {:>11.2} {:>11.2}",
            r.name,
            r.events,
            r.peak_live_bytes,
            r.peak_reserved_bytes,
            r.overhead * 100.0,
            b,
            bo,
            pct(p.map(|p| p.torch.run.overhead)),
            pct(p.map(|p| p.torch_expandable.run.overhead)),
            matched,
            r.events_per_sec,
            r.cold_events_per_sec,
            r.driver_calls.warm.values().sum::<u64>(),
            r.driver_ms.cold,
            r.driver_ms.warm
        );
    }
    // Which calls a warm pass still makes: the steady-state driver work.
    let warm: Vec<_> = reports
        .iter()
        .filter(|r| !r.driver_calls.warm.is_empty())
        .collect();
    if !warm.is_empty() {
        println!(
            "\nwarm-pass driver calls (modeled with {}):",
            opts.config.driver_costs.source()
        );
        for r in warm {
            let kinds: Vec<String> = r
                .driver_calls
                .warm
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect();
            println!("  {:<28} {}", r.name, kinds.join(", "));
        }
    }
    // Per trace, what the port was checked against and the outcome.
    for r in &reports {
        let Some(p) = &r.peers else { continue };
        for (name, peer) in [
            ("torch", &p.torch),
            ("torch_expandable", &p.torch_expandable),
        ] {
            if peer.matched_recording.is_some() {
                println!("{}: {name}: {}", r.name, peer.note);
            }
        }
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpupool: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_env("GPUPOOL_LOG")
        .unwrap_or_else(|_| "warn".into());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Demo {
            common,
            steps,
            plot,
        } => {
            let rt = common.runtime(4)?;
            let opts = gpupool_tools::demo::DemoOptions {
                steps,
                plot: Some(plot),
                ..Default::default()
            };
            let report = gpupool_tools::demo::run(&rt, &opts)?;
            print(common.json, &report)?;
            // Only checks that hold in every interleaving decide the exit
            // status (see `TrainReport::ok`); timing figures never do.
            if !report.train.ok() {
                anyhow::bail!(
                    "demo checks failed: {}",
                    report.train.failed_checks.join("; ")
                );
            }
        }
        Command::Info { common } => info(&common)?,
        Command::Topo { common } => {
            let rt = common.runtime(SimConfig::default().devices)?;
            print(common.json, &TopoReport::of(&rt))?;
        }
        Command::Replay {
            files,
            json,
            plot,
            repeats,
            dynamic,
        } => replay(&files, json, plot.as_deref(), repeats, !dynamic)?,
        Command::Stress(args) => stress(&args)?,
        Command::Bench {
            json,
            quick,
            gpu: true,
            calibrate,
            ..
        } => {
            if let Some(path) = calibrate {
                let table = gpupool_tools::bench::gpu::calibrate(quick)?;
                std::fs::write(&path, table.to_json())
                    .with_context(|| format!("writing {}", path.display()))?;
                eprint!("{table}");
                eprintln!("wrote {}", path.display());
            }
            let report = gpupool_tools::bench::gpu::run(quick)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{report}");
            }
        }
        Command::Bench {
            json,
            quick,
            threads,
            ..
        } => {
            let cfg = PoolConfig::from_env().context("GPUPOOL_CONF")?;
            let report = gpupool_tools::bench::run(&gpupool_tools::bench::BenchOptions {
                quick,
                max_threads: threads,
                driver_costs: cfg.driver_costs,
            })?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                println!("{report}");
            }
        }
    }
    Ok(())
}

/// Flags of `gpupool stress`.
#[derive(Args)]
struct StressArgs {
    /// Simulated devices.
    #[arg(long, default_value_t = 4)]
    devices: usize,
    /// Streams per device.
    #[arg(long, default_value_t = 4)]
    streams: usize,
    /// Threads per device.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Seconds of traffic.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Write and verify a pattern in every block with simulated kernels.
    #[arg(long)]
    verify: bool,
    /// training or serving.
    #[arg(long, default_value = "training")]
    workload: String,
    /// Seed of the request sequence.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Memory of each simulated device, e.g. 1GiB (backed by host memory).
    #[arg(long, default_value = "1GiB")]
    capacity: String,
    /// Print JSON instead of text (hides the progress bar).
    #[arg(long)]
    json: bool,
    /// Percent of blocks also used on a second stream of the device
    /// (an event record, a stream wait and `record_stream`).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(0..=100))]
    cross_percent: u64,
    /// Percent of allocations followed by a simulated kernel of
    /// --kernel-us on their stream (time only): streams busy part of the
    /// time, as a server's are.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=100))]
    kernel_percent: u64,
    /// With --kernel-percent: each kernel's length in microseconds.
    #[arg(long, default_value_t = 20)]
    kernel_us: u64,
    /// Then run the same traffic through the PyTorch port (default and
    /// expandable_segments) and through no allocator (harness_only: the
    /// most the harness allows), each for --duration, and report them side
    /// by side (addresses simulated: no --verify there).
    #[arg(long)]
    peers: bool,
    /// Driver calls take their modeled time (the H200 table, or
    /// GPUPOOL_CONF's driver_costs) on the calling thread, in the pool's
    /// simulator and in the PyTorch port alike, instead of returning at
    /// once: a call made under a lock stalls the threads behind it
    /// (also GPUPOOL_CONF=driver_time=spent).
    #[arg(long)]
    spend_driver_time: bool,
    /// Instead: fragment one simulated device with movable blocks (random
    /// sizes, a random half freed), then compact it under concurrent load,
    /// and report reserved/live before and after (the device has
    /// --capacity, 8 GiB by default here).
    #[arg(long)]
    fragment: bool,
    /// With --fragment: movable blocks allocated before half are freed.
    #[arg(long, default_value_t = 60_000)]
    blocks: usize,
    /// With --fragment: compaction calls made under load.
    #[arg(long, default_value_t = 1_000)]
    passes: usize,
}

/// `gpupool stress --fragment`: the compaction workload.
fn fragment(a: &StressArgs) -> Result<()> {
    use gpupool::compact::fragment::{run, FragmentOptions};
    let mut opts = FragmentOptions {
        blocks: a.blocks,
        passes: a.passes,
        seed: a.seed,
        ..Default::default()
    };
    if a.capacity != "1GiB" {
        opts.capacity_bytes = gpupool::config::parse_size(&a.capacity)
            .map_err(|e| anyhow::anyhow!("--capacity {}: {e}", a.capacity))?;
    }
    if !a.json {
        eprintln!(
            "fragmenting with {} movable blocks, then {} compaction calls under load...",
            opts.blocks, opts.passes
        );
    }
    let r = run(&opts)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        println!(
            "before: live {:.1} MiB, reserved {:.1} MiB ({:.3}x)",
            mib(r.before.live_bytes),
            mib(r.before.reserved_bytes),
            r.before.ratio
        );
        println!(
            "after:  live {:.1} MiB, reserved {:.1} MiB ({:.3}x; target 1.10x)",
            mib(r.after.live_bytes),
            mib(r.after.reserved_bytes),
            r.after.ratio
        );
        println!(
            "moved {:.1} MiB in {} blocks over {} passes ({} under load; {} moves cancelled by pins); pass time mean {:.0} us, max {:.0} us",
            mib(r.bytes_moved),
            r.blocks_moved,
            r.passes,
            r.passes_under_load,
            r.moves_cancelled,
            r.pass_us_mean,
            r.pass_us_max
        );
        println!(
            "ops {}, alloc p50 {} ns, p99 {} ns, host syncs on the alloc path {}, integrity errors {}, device faults {}, leaked {} B, audit {}",
            r.ops,
            r.p50_ns,
            r.p99_ns,
            r.host_syncs_on_alloc_path,
            r.integrity_errors,
            r.device_faults,
            r.leaked_bytes,
            r.audit_error.as_deref().unwrap_or("ok")
        );
    }
    if r.integrity_errors > 0
        || r.device_faults > 0
        || r.leaked_bytes > 0
        || r.audit_error.is_some()
    {
        anyhow::bail!("fragment run failed: see the report");
    }
    Ok(())
}

fn stress(a: &StressArgs) -> Result<()> {
    if a.fragment {
        return fragment(a);
    }
    use gpupool_tools::stress::{run, StressOptions};
    use std::io::IsTerminal;
    let config = PoolConfig::from_env().context("GPUPOOL_CONF")?;
    let capacity_bytes = gpupool::config::parse_size(&a.capacity)
        .map_err(|e| anyhow::anyhow!("--capacity {}: {e}", a.capacity))?;
    if !(a.duration.is_finite() && a.duration > 0.0) {
        anyhow::bail!(
            "--duration {}: expected a positive number of seconds",
            a.duration
        );
    }
    let opts = StressOptions {
        devices: a.devices,
        streams: a.streams,
        threads: a.threads,
        duration: std::time::Duration::from_secs_f64(a.duration),
        verify: a.verify,
        workload: a.workload.parse()?,
        seed: a.seed,
        capacity_bytes,
        config,
        peers: a.peers,
        spend_driver_time: a.spend_driver_time,
        cross_percent: a.cross_percent,
        kernel_percent: a.kernel_percent,
        kernel_time: std::time::Duration::from_micros(a.kernel_us),
        ..Default::default()
    };
    let bar = if a.json || !std::io::stderr().is_terminal() {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(opts.duration.as_millis() as u64)
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {elapsed_precise}/{duration_precise} {msg}",
        )
        .context("progress bar template")?,
    );
    let report = run(&opts, |p| {
        bar.set_position(p.elapsed.as_millis() as u64);
        bar.set_message(format!(
            "{} ops, {} MiB reserved, {} bad bytes",
            p.ops,
            p.reserved_bytes >> 20,
            p.integrity_errors
        ));
    })?;
    bar.finish_and_clear();
    print(a.json, &report)?;
    if !report.passed() {
        anyhow::bail!("stress run failed: see the report");
    }
    Ok(())
}
