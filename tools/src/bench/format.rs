//! The text form of a [`BenchReport`] (what `gpupool bench` prints without
//! `--json`): one table per measurement, then the targets and the driver
//! calls.

use super::report::BenchReport;
use super::{multi_stream, GIB, KIB, MIB, RANDOM_MAX_BYTES};
use std::fmt;

/// `4096` → `4 KiB`.
fn fmt_bytes(b: u64) -> String {
    match b {
        b if b >= GIB && b % GIB == 0 => format!("{} GiB", b / GIB),
        b if b >= MIB && b % MIB == 0 => format!("{} MiB", b / MIB),
        b if b >= KIB && b % KIB == 0 => format!("{} KiB", b / KIB),
        b => format!("{b} B"),
    }
}

/// `12345678.0` → `12.35 M`.
fn fmt_rate(x: f64) -> String {
    if x >= 1e9 {
        format!("{:.2} G", x / 1e9)
    } else if x >= 1e6 {
        format!("{:.2} M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.2} k", x / 1e3)
    } else {
        format!("{x:.1}")
    }
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.machine;
        writeln!(
            f,
            "gpupool bench ({}{} build; {} core(s), {}/{}, load {}, steal {}; {}; {:.1} s)",
            if self.quick { "quick, " } else { "" },
            m.profile,
            m.cores,
            m.os,
            m.arch,
            m.load_average
                .map_or_else(|| "unknown".into(), |l| format!("{l:.2}")),
            m.steal_share
                .map_or_else(|| "unknown".into(), |s| format!("{:.1}%", s * 100.0)),
            m.backend,
            self.seconds
        )?;
        let p = &self.pair_ns;
        let (small, large) = (fmt_bytes(p.small_bytes), fmt_bytes(p.large_bytes));
        writeln!(f)?;
        writeln!(f, "alloc + free pair, 1 thread     median ns   vs gpupool")?;
        let mut row = |name: String, ns: f64, reference: f64| {
            writeln!(f, "  {name:<30}{ns:>10.1}   {:>7.2}x", ns / reference)
        };
        row(
            format!("gpupool small ({small})"),
            p.gpupool_small,
            p.gpupool_small,
        )?;
        row(
            format!("gpupool small raw ({small})"),
            p.gpupool_small_raw,
            p.gpupool_small,
        )?;
        row(
            format!("gpupool small C ABI ({small})"),
            p.gpupool_small_c_abi,
            p.gpupool_small,
        )?;
        row(
            format!("gpupool small torch hook ({small})"),
            p.gpupool_small_torch_hook,
            p.gpupool_small,
        )?;
        row(
            format!("mutex_best_fit ({small})"),
            p.mutex_best_fit,
            p.gpupool_small,
        )?;
        row(
            format!("offset_allocator ({small})"),
            p.offset_allocator,
            p.gpupool_small,
        )?;
        row(
            format!("gpupool large ({large}, cached)"),
            p.gpupool_large,
            p.gpupool_large,
        )?;
        row(
            format!("mutex_best_fit ({large})"),
            p.mutex_best_fit_large,
            p.gpupool_large,
        )?;
        row(format!("torch ({small})"), p.torch_small, p.gpupool_small)?;
        row(
            format!("torch ({large}, cached)"),
            p.torch_large,
            p.gpupool_large,
        )?;
        writeln!(f)?;
        writeln!(
            f,
            "threads ({small} pairs, own stream each; ops/s = allocs + frees per second)"
        )?;
        writeln!(
            f,
            "  {:>7}  {:>10} {:>8} {:>4}  {:>10} {:>8} {:>4}  {:>13}  {:>10} {:>13}",
            "threads",
            "gpupool",
            "vs 1 thr",
            "cpu",
            "mutex_bf",
            "vs 1 thr",
            "cpu",
            "gpupool/mutex",
            "torch",
            "gpupool/torch"
        )?;
        for r in &self.threads {
            writeln!(
                f,
                "  {:>7}  {:>10} {:>7.2}x {:>3.0}%  {:>10} {:>7.2}x {:>3.0}%  {:>12.1}x  {:>10} {:>12.1}x",
                r.threads,
                fmt_rate(r.gpupool_ops_per_sec),
                r.gpupool_vs_1_thread,
                r.gpupool_cpu_share * 100.0,
                fmt_rate(r.mutex_best_fit_ops_per_sec),
                r.mutex_vs_1_thread,
                r.mutex_best_fit_cpu_share * 100.0,
                r.gpupool_vs_mutex,
                fmt_rate(r.torch_ops_per_sec),
                r.gpupool_vs_torch
            )?;
        }
        writeln!(
            f,
            "  (cpu: the threads' CPU time over threads x wall time; under ~90% for gpupool\n   means other processes shared the cores and the scaling is understated)"
        )?;
        writeln!(f)?;
        writeln!(
            f,
            "threads, large pairs (steps of 3, 5, 8, 12, 16, 24 MiB: all allocated, then all freed)"
        )?;
        writeln!(
            f,
            "  {:>7}  {:>10} {:>8} {:>4} {:>11}  {:>10} {:>13}",
            "threads", "gpupool", "vs 1 thr", "cpu", "heap locks", "torch", "gpupool/torch"
        )?;
        for r in &self.threads {
            writeln!(
                f,
                "  {:>7}  {:>10} {:>7.2}x {:>3.0}% {:>8.3}/op  {:>10} {:>12.1}x",
                r.threads,
                fmt_rate(r.gpupool_large_ops_per_sec),
                r.gpupool_large_vs_1_thread,
                r.gpupool_large_cpu_share * 100.0,
                r.gpupool_large_heap_locks_per_op,
                fmt_rate(r.torch_large_ops_per_sec),
                r.gpupool_large_vs_torch
            )?;
        }
        writeln!(f, "  same, every thread on one stream")?;
        writeln!(
            f,
            "  {:>7}  {:>10} {:>8} {:>4}  {:>10} {:>13}",
            "threads", "gpupool", "vs 1 thr", "cpu", "torch", "gpupool/torch"
        )?;
        for r in &self.threads {
            writeln!(
                f,
                "  {:>7}  {:>10} {:>7.2}x {:>3.0}%  {:>10} {:>12.1}x",
                r.threads,
                fmt_rate(r.gpupool_large_shared_ops_per_sec),
                r.gpupool_large_shared_vs_1_thread,
                r.gpupool_large_shared_cpu_share * 100.0,
                fmt_rate(r.torch_large_shared_ops_per_sec),
                r.gpupool_large_shared_ops_per_sec / r.torch_large_shared_ops_per_sec
            )?;
        }
        writeln!(f)?;
        let max = self
            .random_allocations
            .first()
            .map_or(RANDOM_MAX_BYTES, |r| r.max_size_bytes);
        writeln!(
            f,
            "random_allocations (RMM: sizes in [1 B, {}], 73% allocs, ns per alloc or free)",
            fmt_bytes(max)
        )?;
        writeln!(
            f,
            "  {:>7}  {:>9}  {:>10}  {:>9}  {:>13}",
            "n", "gpupool", "mutex_bf", "torch", "mutex/gpupool"
        )?;
        for r in &self.random_allocations {
            writeln!(
                f,
                "  {:>7}  {:>9.1}  {:>10.1}  {:>9.1}  {:>12.2}x",
                r.n, r.ns_per_op, r.mutex_best_fit_ns_per_op, r.ns_per_op_torch, r.mutex_vs_gpupool
            )?;
        }
        self.fmt_multi_stream(f)?;
        if !self.targets.is_empty() {
            writeln!(f)?;
            writeln!(f, "targets")?;
            for t in &self.targets {
                writeln!(
                    f,
                    "  {:<40}{:>8}  {:>10.2}  {}",
                    t.name,
                    t.goal,
                    t.measured,
                    if t.met { "met" } else { "MISSED" }
                )?;
            }
        }
        Ok(())
    }
}

impl BenchReport {
    fn fmt_multi_stream(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(first) = self.multi_stream_allocations.first() else {
            return Ok(());
        };
        writeln!(f)?;
        writeln!(
            f,
            "multi_stream_allocations (RMM: {} x {} B alloc + {:.1} ms kernel + free per iteration, ns per kernel)",
            first.kernels,
            multi_stream::BYTES,
            first.kernel_ns as f64 / 1e6
        )?;
        writeln!(
            f,
            "  {:>7} {:>7}  {:>10} {:>12}  {:>17}",
            "streams", "prewarm", "gpupool", "gpupool host", "mutex_bf (syncs)"
        )?;
        for r in &self.multi_stream_allocations {
            writeln!(
                f,
                "  {:>7} {:>7}  {:>10.0} {:>12.0}  {:>17.0}",
                r.streams,
                if r.prewarm { "yes" } else { "no" },
                r.ns_per_op,
                r.host_ns_per_op,
                r.mutex_best_fit_ns_per_op
            )?;
        }
        writeln!(f)?;
        writeln!(
            f,
            "driver: {} calls by the benchmark pools, {:.2} ms modeled",
            self.driver_calls.values().sum::<u64>(),
            self.driver_ms
        )?;
        Ok(())
    }
}
