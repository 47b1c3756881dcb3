//! Readings of the host the benchmarks share: a thread's CPU time, the
//! load average and the CPU time the hypervisor stole (Linux's `/proc`),
//! which say whether the figures of a run mean anything.

/// CPU time of the calling thread, in seconds.
pub(super) fn thread_cpu_secs() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return f64::NAN;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// The 1-minute load average (Linux), if readable.
pub(super) fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// All CPUs' `(steal, total)` time in ticks so far (Linux), if readable.
pub(super) fn cpu_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    let ticks: Vec<u64> = line
        .split_whitespace()
        .map(|t| t.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal (guest time is
    // already inside user and nice).
    let steal = *ticks.get(7)?;
    Some((steal, ticks.iter().take(8).sum()))
}

/// The share of CPU time stolen between two [`cpu_ticks`] readings.
pub(super) fn steal_share(before: Option<(u64, u64)>, after: Option<(u64, u64)>) -> Option<f64> {
    let ((s0, t0), (s1, t1)) = (before?, after?);
    (t1 > t0).then(|| s1.saturating_sub(s0) as f64 / (t1 - t0) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steal_share_is_the_stolen_part_of_the_ticks_between_readings() {
        assert_eq!(
            steal_share(Some((10, 1_000)), Some((30, 1_400))),
            Some(0.05)
        );
        assert_eq!(steal_share(Some((10, 1_000)), Some((10, 1_000))), None);
        assert_eq!(steal_share(None, Some((10, 1_000))), None);
        if cfg!(target_os = "linux") {
            let (steal, total) = cpu_ticks().expect("/proc/stat is readable on Linux");
            assert!(steal <= total && total > 0, "{steal} of {total}");
        }
    }
}
