//! The report of a stress run (`gpupool stress [--json]`).

use super::workload::Workload;
use std::fmt;

/// Reserved memory may grow by this share from the first half of a run to
/// the second and still count as flat.
pub const FLAT_TOLERANCE: f64 = 0.10;

/// One sample of the memory series.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct MemorySample {
    /// Seconds since the start of the run.
    pub t_secs: f64,
    /// Device memory held by all pools.
    pub reserved_bytes: u64,
    /// Requested bytes of live blocks on all devices.
    pub live_bytes: u64,
    /// Reserved bytes free for reuse now, all devices.
    pub cached_bytes: u64,
    /// Freed bytes waiting for their last use to complete, all devices.
    pub pending_bytes: u64,
}

/// Figures of one device.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct DeviceStress {
    /// Device index.
    pub device: usize,
    /// Allocs plus frees.
    pub ops: u64,
    /// Operations per second on this device.
    pub ops_per_sec: f64,
    /// Peak requested bytes (the pool's sampled peak).
    pub peak_live_bytes: u64,
    /// Peak device memory held by the pool.
    pub peak_reserved_bytes: u64,
    /// Bytes that verify kernels found wrong on this device.
    pub integrity_errors: u64,
    /// Accesses by simulated kernels outside mapped memory.
    pub device_faults: u64,
    /// Allocations that failed with out-of-memory (the workload then frees
    /// something; not an error).
    pub ooms: u64,
    /// Out-of-memory errors while the memory was not in use: live bytes
    /// plus the request plus one largest request in flight per other
    /// thread (and two granules of rounding per thread) fit in the device.
    /// Each one is a bug.
    pub false_ooms: u64,
    /// Host waits on the way to out of memory (the alloc path's one
    /// allowed host wait).
    pub oom_waits: u64,
    /// Host syncs those waits made.
    pub oom_host_syncs: u64,
    /// Acquisitions of the device's heap mutex (its one device-wide lock)
    /// per operation (alloc or free).
    pub heap_locks_per_op: f64,
    /// Frees parked on the pending list (cross-stream uses).
    pub pending_frees: u64,
    /// Pending blocks handed to another stream by a stream-wait-event.
    pub handovers: u64,
    /// Harvest passes over the pending frees (the allocation slow paths',
    /// the paced ones after `record_stream`'d frees, the maintenance
    /// thread's).
    pub harvests: u64,
    /// Those that looked at every pending free (the others looked at the
    /// new ones only: no stream's earliest pending event had completed).
    pub harvest_walks: u64,
    /// Small allocations that took the slow path (no slot in the thread's
    /// magazine nor the stream's stacks).
    pub small_slow_paths: u64,
    /// Large allocations that took the slow path (neither the stream's
    /// parked ranges nor the heap's backed memory served at once).
    pub large_slow_paths: u64,
    /// Reclaim passes (each flushes every stream's dirty memory, small
    /// caches included, harvests and retires empty slabs).
    pub reclaims: u64,
    /// Host-blocking syncs the backend counted on this device during the
    /// run (the harness makes none there, so all are the pool's), less
    /// those of waits on the way to out of memory.
    pub host_syncs_on_alloc_path: u64,
    /// Live bytes left after every block was freed, plus reserved bytes
    /// left after every stream finished and the pool was trimmed.
    pub leaked_bytes: u64,
    /// The pool's self-audit after the run: `null` when every invariant
    /// held, else the first violation.
    pub audit_error: Option<String>,
}

/// The same traffic through a peer allocator (`gpupool stress --peers`):
/// PyTorch's caching allocator as the replay port models it, behind
/// PyTorch's locks (`bench::torch_peer`), one run after gpupool's, for
/// the same duration, on the same streams. The harness's own stream
/// events are the same, and so are the blocks used on a second stream:
/// the port frees those behind one event per such stream, queried at each
/// `malloc` (PyTorch's `record_stream`, `trace::peers::torch_events`). Its
/// addresses are simulated (no verify kernels, so its streams run
/// lighter). Last, `harness_only`: no allocator (`stress::peer`), the
/// most operations per second the harness itself allows.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PeerStress {
    /// `torch`, `torch_expandable` or `harness_only`.
    pub name: &'static str,
    /// Wall time of the traffic in seconds.
    pub seconds: f64,
    /// Allocs plus frees, all devices.
    pub ops: u64,
    /// Operations per second, all devices.
    pub ops_per_sec: f64,
    /// Median alloc latency in nanoseconds.
    pub p50_ns: u64,
    /// 99th percentile alloc latency.
    pub p99_ns: u64,
    /// 99.9th percentile alloc latency.
    pub p999_ns: u64,
    /// Sum over devices of each device's peak live (requested) bytes.
    pub peak_live_bytes: u64,
    /// Sum over devices of each device's peak reserved bytes.
    pub peak_reserved_bytes: u64,
    /// Allocations refused (handled by the workload).
    pub ooms: u64,
    /// Refusals while the memory was not in use (as for gpupool).
    pub false_ooms: u64,
    /// Acquisitions of a device's one allocator mutex per operation
    /// (`malloc`, `free` and `recordStream` each take it).
    pub device_locks_per_op: f64,
    /// The port's driver calls, all devices, by CUDA driver name.
    pub driver_calls: std::collections::BTreeMap<String, u64>,
    /// Their modeled time in milliseconds (the same cost table).
    pub driver_ms: f64,
    /// See [`StressReport::allocator_ns_per_op`] (0 for `harness_only`).
    pub allocator_ns_per_op: Option<f64>,
}

/// The report of one stress run. The keys `ops`, `integrity_errors`,
/// `leaked_bytes`, `host_syncs_on_alloc_path`, `p50_ns`, `p99_ns`,
/// `peak_live_bytes` and `peak_reserved_bytes` are part of the public
/// contract of `gpupool stress --json`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct StressReport {
    /// The workload that ran.
    pub workload: Workload,
    /// Simulated devices.
    pub devices: usize,
    /// Streams per device.
    pub streams: usize,
    /// Threads per device.
    pub threads: usize,
    /// Memory of each simulated device.
    pub capacity_bytes: u64,
    /// Whether blocks were written and verified by simulated kernels.
    pub verify: bool,
    /// The seed of the run.
    pub seed: u64,
    /// Percent of allocations followed by a simulated kernel on their
    /// stream (`--kernel-percent`).
    pub kernel_percent: u64,
    /// Each such kernel's length in microseconds.
    pub kernel_us: u64,
    /// Whether driver calls spent their modeled time on the calling
    /// thread (`--spend-driver-time`) instead of being only counted.
    pub driver_time_spent: bool,
    /// Wall time of the traffic in seconds.
    pub seconds: f64,
    /// Allocs plus frees, all devices.
    pub ops: u64,
    /// Successful allocations.
    pub allocs: u64,
    /// Frees.
    pub frees: u64,
    /// Operations per second, all devices.
    pub ops_per_sec: f64,
    /// Bytes that verify kernels found wrong (0 is the only good value).
    pub integrity_errors: u64,
    /// Verify kernels that found at least one wrong byte.
    pub failed_verifies: u64,
    /// Verify kernels run.
    pub verify_kernels: u64,
    /// Accesses by simulated kernels outside mapped memory.
    pub device_faults: u64,
    /// Bytes not given back: live bytes left after every block was freed,
    /// plus reserved bytes left after trim, all devices.
    pub leaked_bytes: u64,
    /// Host-blocking syncs during the traffic, all devices (the harness
    /// makes none, so these are the pool's alloc/free path).
    pub host_syncs_on_alloc_path: u64,
    /// Median alloc latency (successful calls) in nanoseconds.
    pub p50_ns: u64,
    /// 99th percentile alloc latency.
    pub p99_ns: u64,
    /// 99.9th percentile alloc latency.
    pub p999_ns: u64,
    /// Slowest alloc.
    pub max_ns: u64,
    /// Median alloc latency of the small path (requests up to the largest
    /// size class).
    pub small_p50_ns: u64,
    /// 99th percentile alloc latency of the small path.
    pub small_p99_ns: u64,
    /// Median alloc latency of the large path.
    pub large_p50_ns: u64,
    /// 99th percentile alloc latency of the large path.
    pub large_p99_ns: u64,
    /// Median free latency (drop or `free_raw`).
    pub free_p50_ns: u64,
    /// 99th percentile free latency.
    pub free_p99_ns: u64,
    /// Sum over devices of each device's peak live bytes.
    pub peak_live_bytes: u64,
    /// Sum over devices of each device's peak reserved bytes.
    pub peak_reserved_bytes: u64,
    /// Allocations that failed with out-of-memory (the workload frees and
    /// goes on).
    pub ooms: u64,
    /// Out-of-memory errors while the memory was not in use, all devices
    /// (see [`DeviceStress::false_ooms`]); the target is 0.
    pub false_ooms: u64,
    /// Host waits on the way to out of memory, all devices.
    pub oom_waits: u64,
    /// Acquisitions of the devices' heap mutexes per operation, all devices.
    pub heap_locks_per_op: f64,
    /// Blocks also used on another stream (`record_stream`).
    pub cross_stream_uses: u64,
    /// Raw blocks freed from another stream than their own.
    pub cross_stream_frees: u64,
    /// Peak resident memory of the process (`getrusage` `ru_maxrss`).
    pub peak_rss_bytes: u64,
    /// Reserved and live bytes over time.
    pub memory_series: Vec<MemorySample>,
    /// Whether reserved memory stayed flat: the second half's peak is at
    /// most [`FLAT_TOLERANCE`] above the first half's. `null` with fewer
    /// than four samples.
    pub reserved_flat: Option<bool>,
    /// Whether reserved memory reached the capacity of every device at
    /// some point (then a flat series may only mean the pools were full;
    /// `ooms` tells whether that hurt).
    pub reserved_hit_capacity: bool,
    /// Driver calls during the traffic, all devices, by CUDA driver name
    /// (kinds not called left out): the pools' and the harness's own
    /// (verify kernels' fills and launches).
    pub driver_calls: std::collections::BTreeMap<&'static str, u64>,
    /// Modeled driver time of those calls in milliseconds, under the
    /// configuration's cost table.
    pub driver_ms: f64,
    /// The part of `driver_ms` the harness spent itself: the event record
    /// and stream wait that order each cross-stream use and free.
    pub harness_driver_ms: f64,
    /// Per-device figures.
    pub per_device: Vec<DeviceStress>,
    /// The same traffic through the peers, with `--peers` (else empty).
    pub peers: Vec<PeerStress>,
    /// With `--peers`: thread time per operation beyond the harness alone
    /// (`harness_only`), in ns: threads x (1/ops_per_sec - 1/harness
    /// ops_per_sec). What the allocator itself costs an operation; unlike
    /// ops/s it compares stream counts fairly, as the harness's own events
    /// and waits slow it with more streams.
    pub allocator_ns_per_op: Option<f64>,
}

impl StressReport {
    /// Whether the run met the stress targets: no integrity error or device
    /// fault, no leak, no host sync on the alloc/free path, clean audits.
    pub fn passed(&self) -> bool {
        self.integrity_errors == 0
            && self.failed_verifies == 0
            && self.device_faults == 0
            && self.leaked_bytes == 0
            && self.host_syncs_on_alloc_path == 0
            && self.false_ooms == 0
            && self.per_device.iter().all(|d| d.audit_error.is_none())
    }
}

/// The flatness verdict of a reserved-bytes series (see
/// [`StressReport::reserved_flat`]).
pub fn reserved_flat(series: &[MemorySample]) -> Option<bool> {
    if series.len() < 4 {
        return None;
    }
    let (first, second) = series.split_at(series.len() / 2);
    let peak = |s: &[MemorySample]| s.iter().map(|m| m.reserved_bytes).max().unwrap_or(0);
    Some(peak(second) as f64 <= peak(first) as f64 * (1.0 + FLAT_TOLERANCE))
}

/// `1234567` → `1.18 MiB`.
pub(crate) fn fmt_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = b as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < UNITS.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{x:.2} {}", UNITS[u])
    }
}

impl fmt::Display for StressReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "gpupool stress: {} workload, {} device(s) x {} stream(s) x {} thread(s), {} per device, verify {}, seed {}, {:.1} s",
            self.workload,
            self.devices,
            self.streams,
            self.threads,
            fmt_bytes(self.capacity_bytes),
            if self.verify { "on" } else { "off" },
            self.seed,
            self.seconds
        )?;
        writeln!(
            f,
            "  ops               {} ({} allocs, {} frees), {:.0} ops/s",
            self.ops, self.allocs, self.frees, self.ops_per_sec
        )?;
        writeln!(
            f,
            "  alloc latency     p50 {} ns, p99 {} ns, p99.9 {} ns, max {} ns",
            self.p50_ns, self.p99_ns, self.p999_ns, self.max_ns
        )?;
        writeln!(
            f,
            "    small / large   p50 {} / {} ns, p99 {} / {} ns",
            self.small_p50_ns, self.large_p50_ns, self.small_p99_ns, self.large_p99_ns
        )?;
        writeln!(
            f,
            "  free latency      p50 {} ns, p99 {} ns",
            self.free_p50_ns, self.free_p99_ns
        )?;
        writeln!(
            f,
            "  memory            peak live {}, peak reserved {}, peak RSS {}",
            fmt_bytes(self.peak_live_bytes),
            fmt_bytes(self.peak_reserved_bytes),
            fmt_bytes(self.peak_rss_bytes)
        )?;
        writeln!(
            f,
            "  traffic           {} cross-stream uses, {} cross-stream frees, {} OOMs (handled)",
            self.cross_stream_uses, self.cross_stream_frees, self.ooms
        )?;
        writeln!(
            f,
            "  false OOMs        {} (memory not in use, request refused); {} host waits before OOM",
            self.false_ooms, self.oom_waits
        )?;
        writeln!(
            f,
            "  device locks      {:.3} heap-mutex acquisitions per operation",
            self.heap_locks_per_op
        )?;
        writeln!(
            f,
            "  integrity         {} bad bytes in {} of {} verify kernels, {} device faults",
            self.integrity_errors, self.failed_verifies, self.verify_kernels, self.device_faults
        )?;
        writeln!(f, "  leaked            {} bytes", self.leaked_bytes)?;
        writeln!(
            f,
            "  host syncs        {} on the alloc/free path",
            self.host_syncs_on_alloc_path
        )?;
        writeln!(
            f,
            "  driver            {} calls, {:.2} ms modeled ({:.2} ms of them the harness's){}",
            self.driver_calls.values().sum::<u64>(),
            self.driver_ms,
            self.harness_driver_ms,
            if self.driver_time_spent {
                ", spent on the calling threads"
            } else {
                ""
            }
        )?;
        let flat = match self.reserved_flat {
            Some(true) => "yes",
            Some(false) => "NO",
            None => "n/a (under 4 samples)",
        };
        writeln!(
            f,
            "  reserved flat     {flat} ({} samples{})",
            self.memory_series.len(),
            if self.reserved_hit_capacity {
                "; reserved reached every device's capacity"
            } else {
                ""
            }
        )?;
        writeln!(
            f,
            "  {:>6} {:>10} {:>10} {:>12} {:>14} {:>6} {:>8} {:>9} {:>7}",
            "device",
            "ops",
            "ops/s",
            "peak live",
            "peak reserved",
            "OOMs",
            "pending",
            "handovers",
            "audit"
        )?;
        for d in &self.per_device {
            writeln!(
                f,
                "  {:>6} {:>10} {:>10.0} {:>12} {:>14} {:>6} {:>8} {:>9} {:>7}",
                d.device,
                d.ops,
                d.ops_per_sec,
                fmt_bytes(d.peak_live_bytes),
                fmt_bytes(d.peak_reserved_bytes),
                d.ooms,
                d.pending_frees,
                d.handovers,
                if d.audit_error.is_none() {
                    "ok"
                } else {
                    "FAILED"
                }
            )?;
        }
        if !self.peers.is_empty() {
            writeln!(
                f,
                "  same traffic      {:>16} {:>10} {:>8} {:>12} {:>14} {:>10} {:>6} {:>11} {:>10} {:>10}",
                "allocator",
                "ops/s",
                "p99.9",
                "peak live",
                "peak reserved",
                "res/live",
                "OOMs",
                "locks/op",
                "driver ms",
                "own ns/op"
            )?;
            let row = |f: &mut fmt::Formatter<'_>,
                       name: &str,
                       ops: f64,
                       p999: u64,
                       live: u64,
                       res: u64,
                       ooms: u64,
                       locks: f64,
                       ms: f64,
                       own: Option<f64>| {
                writeln!(
                    f,
                    "                    {:>16} {:>10.0} {:>6}us {:>12} {:>14} {:>9.2}x {:>6} {:>11.3} {:>10.1} {:>10.0}",
                    name,
                    ops,
                    p999 / 1000,
                    fmt_bytes(live),
                    fmt_bytes(res),
                    res as f64 / live.max(1) as f64,
                    ooms,
                    locks,
                    ms,
                    own.unwrap_or(f64::NAN)
                )
            };
            row(
                f,
                "gpupool",
                self.ops_per_sec,
                self.p999_ns,
                self.peak_live_bytes,
                self.peak_reserved_bytes,
                self.ooms,
                self.heap_locks_per_op,
                self.driver_ms - self.harness_driver_ms,
                self.allocator_ns_per_op,
            )?;
            for p in &self.peers {
                row(
                    f,
                    p.name,
                    p.ops_per_sec,
                    p.p999_ns,
                    p.peak_live_bytes,
                    p.peak_reserved_bytes,
                    p.ooms,
                    p.device_locks_per_op,
                    p.driver_ms,
                    p.allocator_ns_per_op,
                )?;
            }
        }
        for d in self.per_device.iter().filter(|d| d.audit_error.is_some()) {
            writeln!(
                f,
                "  device {} audit: {}",
                d.device,
                d.audit_error.as_deref().unwrap_or_default()
            )?;
        }
        write!(
            f,
            "  verdict           {}",
            if self.passed() { "PASS" } else { "FAIL" }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(v: &[u64]) -> Vec<MemorySample> {
        v.iter()
            .enumerate()
            .map(|(i, &r)| MemorySample {
                t_secs: i as f64,
                reserved_bytes: r,
                live_bytes: r / 2,
                ..Default::default()
            })
            .collect()
    }

    #[test]
    fn flat_means_the_second_half_peak_stays_within_tolerance() {
        assert_eq!(reserved_flat(&series(&[1, 2, 3])), None);
        assert_eq!(reserved_flat(&series(&[100, 80, 90, 105])), Some(true));
        assert_eq!(reserved_flat(&series(&[100, 80, 90, 111])), Some(false));
        assert_eq!(
            reserved_flat(&series(&[10, 20, 30, 40, 50, 60])),
            Some(false)
        );
    }

    #[test]
    fn bytes_format_with_binary_units() {
        assert_eq!(fmt_bytes(512), "512 B");
        assert_eq!(fmt_bytes(3 << 20), "3.00 MiB");
        assert_eq!(fmt_bytes(1536 << 20), "1.50 GiB");
    }
}
