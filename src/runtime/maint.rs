//! Per-device maintenance threads.
//!
//! The runtime starts one thread per pool when it builds the pool, named
//! `gpupool-maint-<dev>`. Each
//! tick (`PoolConfig::maintenance_tick`, 5 ms by default) it calls
//! [`DevicePool::maintain`] (harvest completed frees, idle clock, and
//! whatever idle work the pool does there), then applies the idle release
//! policy, then sleeps with `park_timeout` (no busy spin; `stop` unparks it
//! so shutdown is prompt). With the `hwloc` feature the thread first binds
//! itself to the CPUs nearest its device ([`crate::topology`]); without it,
//! or where hwloc cannot place the device, it stays unbound and says why.
//!
//! **Idle release policy** (`idle_release_ms`, `release_fraction`). Once a
//! pool has been idle for `idle_release`, the thread takes the peak of
//! active bytes of the busy period that just ended
//! ([`DevicePool::take_window_peak`]) and, while cached bytes exceed
//! `release_fraction` times that peak, gives the cached memory above it
//! back without blocking ([`DevicePool::release_cache_above`]). A pool that needed as much as
//! it holds keeps it (no grow-release churn in a steady loop); a pool that
//! grew for a large batch and then runs smaller ones gives the difference
//! back at its next idle gap. Memory still in flight on the device goes on
//! a later tick. The release is given up when an allocation or a free came
//! after the tick measured the gap (checked under the heap lock, just
//! before the bytes go back): a busy period that starts mid-tick keeps
//! what it asked for, and its peak is taken at the next gap.

use super::Pools;
use crate::error::Result;
use crate::pool::DevicePool;
use crate::topology::Topology;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Where a maintenance thread runs.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum ThreadBinding {
    /// Bound to these CPUs (read back from the OS after binding).
    Bound {
        /// OS CPU indices.
        cpus: Vec<usize>,
    },
    /// Free to run anywhere.
    Unbound {
        /// Why it is not bound.
        reason: String,
    },
}

/// What one maintenance thread did so far.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct MaintenanceStats {
    /// Device index.
    pub device: usize,
    /// Thread name (`gpupool-maint-<dev>`).
    pub thread: String,
    /// Ticks run (calls of [`DevicePool::maintain`]).
    pub ticks: u64,
    /// Pending-free records harvested.
    pub harvested: u64,
    /// Ticks that found the pool idle for at least the idle release delay.
    pub idle_ticks: u64,
    /// Release passes of the idle release policy that gave memory back.
    pub releases: u64,
    /// Bytes given back by the idle release policy.
    pub released_bytes: u64,
    /// Where the thread runs; `None` until it has started.
    pub binding: Option<ThreadBinding>,
}

/// Counters shared between a thread and the runtime.
#[derive(Debug, Default)]
struct Shared {
    stop: AtomicBool,
    ticks: AtomicU64,
    harvested: AtomicU64,
    idle_ticks: AtomicU64,
    releases: AtomicU64,
    released_bytes: AtomicU64,
    binding: parking_lot::Mutex<Option<ThreadBinding>>,
}

/// One running thread: name, device, counters, handle (taken at join).
type Thread = (String, usize, Arc<Shared>, Option<JoinHandle<()>>);

/// The maintenance threads of one runtime.
#[derive(Debug, Default)]
pub(crate) struct Maintenance {
    threads: Vec<Thread>,
}

/// Whether the idle release policy gives memory back: cached bytes above
/// `fraction` times what the last busy period needed.
pub(crate) fn over_threshold(cached: u64, busy_peak: u64, fraction: f64) -> bool {
    cached as f64 > fraction * busy_peak as f64
}

impl Maintenance {
    /// Starts the thread of device `dev`'s pool (built), ticking every
    /// `tick`.
    pub(crate) fn start_one(
        &mut self,
        pools: &Pools,
        dev: usize,
        tick: Duration,
        topo: &Topology,
    ) -> Result<()> {
        let name = format!("gpupool-maint-{dev}");
        let shared = Arc::new(Shared::default());
        let cpus = bind_target(topo, dev);
        let (p, s) = (pools.clone(), shared.clone());
        let h = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                let pool = p[dev].get().expect("a pool is built before its thread");
                run(pool, tick, &s, cpus)
            })?;
        self.threads.push((name, dev, shared, Some(h)));
        Ok(())
    }

    /// What each thread did so far.
    pub(crate) fn stats(&self) -> Vec<MaintenanceStats> {
        self.threads
            .iter()
            .map(|(name, dev, s, _)| MaintenanceStats {
                device: *dev,
                thread: name.clone(),
                ticks: s.ticks.load(Relaxed),
                harvested: s.harvested.load(Relaxed),
                idle_ticks: s.idle_ticks.load(Relaxed),
                releases: s.releases.load(Relaxed),
                released_bytes: s.released_bytes.load(Relaxed),
                binding: s.binding.lock().clone(),
            })
            .collect()
    }

    /// Stops and joins every thread (idempotent).
    pub(crate) fn stop(&mut self) {
        for (_, _, s, h) in &self.threads {
            s.stop.store(true, Relaxed);
            if let Some(h) = h {
                h.thread().unpark();
            }
        }
        for (name, _, _, h) in &mut self.threads {
            if let Some(h) = h.take() {
                if h.join().is_err() {
                    tracing::error!("maintenance thread {name} panicked");
                }
            }
        }
    }
}

/// The CPUs device `dev`'s thread binds to: hwloc's placement, or `Err`
/// with the reason it stays unbound.
fn bind_target(topo: &Topology, dev: usize) -> std::result::Result<Vec<usize>, String> {
    if topo.source != "hwloc" {
        return Err(topo.note.clone());
    }
    match topo.devices.iter().find(|d| d.device == dev) {
        Some(d) if !d.cpus.is_empty() => Ok(d.cpus.clone()),
        _ => Err(format!("hwloc has no CPUs for device {dev}")),
    }
}

fn bind(target: std::result::Result<Vec<usize>, String>) -> ThreadBinding {
    let cpus = match target {
        Ok(c) => c,
        Err(reason) => return ThreadBinding::Unbound { reason },
    };
    match crate::topology::bind_current_thread(&cpus)
        .and_then(|()| crate::topology::current_thread_cpus())
    {
        Ok(cpus) => ThreadBinding::Bound { cpus },
        Err(e) => ThreadBinding::Unbound {
            reason: format!("binding failed: {e}"),
        },
    }
}

/// The thread's loop.
fn run(
    pool: &DevicePool,
    tick: Duration,
    s: &Shared,
    target: std::result::Result<Vec<usize>, String>,
) {
    *s.binding.lock() = Some(bind(target));
    let cfg = pool.config().clone();
    // The busy period's peak, taken once the current idle gap is long enough.
    let mut busy_peak: Option<u64> = None;
    let mut exhausted = false;
    while !s.stop.load(Relaxed) {
        let gate = pool.maintenance_gate();
        let r = pool.maintain();
        s.ticks.fetch_add(1, Relaxed);
        s.harvested.fetch_add(r.harvested as u64, Relaxed);
        match cfg.idle_release {
            Some(after) if r.idle_for >= after => {
                s.idle_ticks.fetch_add(1, Relaxed);
                let need = *busy_peak.get_or_insert_with(|| pool.take_window_peak());
                let st = pool.stats();
                if !exhausted && over_threshold(st.cached_bytes.current, need, cfg.release_fraction)
                {
                    let keep = (cfg.release_fraction * need as f64) as u64;
                    match pool.release_cache_above_if_quiet(keep) {
                        // Traffic since `maintain` measured the gap: a new
                        // busy period, whose peak the next gap takes.
                        None => busy_peak = None,
                        Some(0) if pool.stats().pending_bytes.current == 0 => {
                            // Nothing more to give back in this idle gap.
                            exhausted = true;
                        }
                        Some(0) => {}
                        Some(freed) => {
                            s.releases.fetch_add(1, Relaxed);
                            s.released_bytes.fetch_add(freed, Relaxed);
                        }
                    }
                }
            }
            _ if r.idle_for.is_zero() => {
                busy_peak = None;
                exhausted = false;
            }
            _ => {}
        }
        drop(gate);
        std::thread::park_timeout(tick);
    }
}

#[cfg(test)]
mod tests {
    use super::{over_threshold, ThreadBinding};
    use crate::config::{BackendKind, SimConfig};
    use crate::runtime::{MaintenanceStats, Runtime};
    use std::time::{Duration, Instant};

    /// A runtime over 2 simulated devices, once its threads have bound.
    fn bound_runtime() -> (Runtime, Vec<MaintenanceStats>) {
        let rt = Runtime::builder()
            .backend(BackendKind::Sim(SimConfig {
                devices: 2,
                ..Default::default()
            }))
            .build()
            .unwrap();
        // Pools (and their threads) start on first use.
        assert_eq!(rt.devices().len(), 2);
        let deadline = Instant::now() + Duration::from_secs(5);
        while rt.maintenance_stats().iter().any(|m| m.binding.is_none()) {
            assert!(Instant::now() < deadline, "threads did not start");
            std::thread::sleep(Duration::from_millis(1));
        }
        let stats = rt.maintenance_stats();
        assert_eq!(stats.len(), 2, "one thread per device");
        (rt, stats)
    }

    #[cfg(feature = "hwloc")]
    #[test]
    fn topology_binds_maintenance_threads_with_hwloc() {
        let (rt, stats) = bound_runtime();
        let topo = rt.topology();
        assert_eq!(stats.len(), 2);
        for m in &stats {
            match (&m.binding, topo.source) {
                (Some(ThreadBinding::Bound { cpus }), "hwloc") => {
                    // Bound to what hwloc calls nearest (all host CPUs for
                    // the simulator's made-up bus ids), read back from the OS.
                    assert_eq!(cpus, &topo.devices[m.device].cpus, "{m:?}");
                }
                (Some(ThreadBinding::Unbound { reason }), src) if src != "hwloc" => {
                    assert_eq!(reason, &topo.note);
                }
                other => panic!("{other:?} with topology {topo}"),
            }
        }
    }

    #[cfg(not(feature = "hwloc"))]
    #[test]
    fn topology_leaves_maintenance_threads_unbound_without_hwloc() {
        let (_rt, stats) = bound_runtime();
        for m in &stats {
            assert_eq!(
                m.binding,
                Some(ThreadBinding::Unbound {
                    reason: crate::topology::NO_HWLOC_NOTE.into()
                })
            );
        }
    }

    #[test]
    fn threshold_compares_cache_with_the_busy_peak() {
        assert!(over_threshold(301, 200, 1.5));
        assert!(!over_threshold(300, 200, 1.5));
        assert!(over_threshold(1, 0, 1.5));
        assert!(!over_threshold(0, 0, 1.5));
    }
}
