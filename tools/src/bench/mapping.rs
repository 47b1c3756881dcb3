//! What backing a range costs the driver, by the size of its physical
//! units: `n` granules as one chunk (one `cuMemCreate`, one `cuMemMap`,
//! one `cuMemUnmap`, one `cuMemRelease`) against `n` chunks of one granule
//! mapped side by side (what the heap does today: `n` of each, and one
//! access grant over the run). Part of `gpupool bench --gpu`.
//!
//! Why: growing the device costs gpupool 6-17x the peers' driver time
//! (docs/BENCHMARKS.md), one create and one map per 2 MiB granule. The
//! cost table measures one granule per call only, and whether a map's
//! cost grows with its size decides how large the heap's physical units
//! should be; this table measures it on the device.

use gpupool::backend::Backend;
use gpupool::ChunkHandle;
use gpupool::Result;
use std::time::Instant;

/// One size: host µs per step, each the median of the samples.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MappingRow {
    /// Granules backed.
    pub granules: u64,
    /// Bytes backed.
    pub bytes: u64,
    /// One chunk of `granules`: create, map (with its access grant),
    /// unmap, release.
    pub one_chunk_us: Steps,
    /// `granules` chunks of one granule: every create, the run's maps and
    /// one grant (`Backend::map_run`), the run's unmaps, every release.
    pub per_granule_us: Steps,
}

/// Host µs of each step of backing a range and giving it back.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Steps {
    /// `cuMemCreate`.
    pub create: f64,
    /// `cuMemMap` and `cuMemSetAccess`.
    pub map: f64,
    /// `cuMemUnmap`.
    pub unmap: f64,
    /// `cuMemRelease`.
    pub release: f64,
}

impl Steps {
    /// All four steps.
    pub fn total(&self) -> f64 {
        self.create + self.map + self.unmap + self.release
    }
}

/// Granule counts measured.
pub const GRANULES: [u64; 3] = [1, 8, 32];

/// Measures [`GRANULES`] on `be`'s device `dev`, `samples` times each.
pub fn measure(be: &dyn Backend, dev: usize, samples: usize) -> Result<Vec<MappingRow>> {
    let gran = be.device_info(dev)?.granularity;
    let span = GRANULES.iter().max().copied().unwrap_or(1) * gran;
    let va = be.reserve_va(dev, span)?;
    let rows = GRANULES
        .iter()
        .map(|&n| {
            Ok(MappingRow {
                granules: n,
                bytes: n * gran,
                one_chunk_us: median(samples, || one_chunk(be, dev, va, n * gran))?,
                per_granule_us: median(samples, || per_granule(be, dev, va, gran, n))?,
            })
        })
        .collect::<Result<Vec<_>>>();
    be.free_va(dev, va, span)?;
    rows
}

fn micros<T>(f: impl FnOnce() -> Result<T>) -> Result<(f64, T)> {
    let t = Instant::now();
    let r = f()?;
    Ok((t.elapsed().as_secs_f64() * 1e6, r))
}

fn one_chunk(be: &dyn Backend, dev: usize, va: gpupool::DevicePtr, bytes: u64) -> Result<Steps> {
    let (create, c) = micros(|| be.create_chunk(dev, bytes))?;
    let (map, ()) = micros(|| be.map(dev, va, bytes, c, 0))?;
    let (unmap, ()) = micros(|| be.unmap(dev, va, bytes))?;
    let (release, ()) = micros(|| be.release_chunk(dev, c))?;
    Ok(Steps {
        create,
        map,
        unmap,
        release,
    })
}

fn per_granule(
    be: &dyn Backend,
    dev: usize,
    va: gpupool::DevicePtr,
    gran: u64,
    n: u64,
) -> Result<Steps> {
    let (create, chunks) = micros(|| {
        (0..n)
            .map(|_| be.create_chunk(dev, gran))
            .collect::<Result<Vec<ChunkHandle>>>()
    })?;
    let (map, ()) = micros(|| be.map_run(dev, va, gran, &chunks))?;
    let (unmap, ()) = micros(|| be.unmap_run(dev, va, gran, n))?;
    let (release, ()) = micros(|| chunks.iter().try_for_each(|&c| be.release_chunk(dev, c)))?;
    Ok(Steps {
        create,
        map,
        unmap,
        release,
    })
}

/// Step by step, the median over `samples` runs of `f`.
fn median(samples: usize, mut f: impl FnMut() -> Result<Steps>) -> Result<Steps> {
    let runs = (0..samples.max(1))
        .map(|_| f())
        .collect::<Result<Vec<Steps>>>()?;
    let mid = |pick: fn(&Steps) -> f64| {
        let mut v: Vec<f64> = runs.iter().map(pick).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Ok(Steps {
        create: mid(|s| s.create),
        map: mid(|s| s.map),
        unmap: mid(|s| s.unmap),
        release: mid(|s| s.release),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpupool::backend::sim::{SimBackend, SimConfig};
    use gpupool::backend::Call;

    /// On the simulator: every row, and the driver calls each way makes
    /// (one of each per chunk; one map per granule plus one grant).
    #[test]
    fn each_size_is_backed_both_ways_and_everything_is_given_back() {
        let sim = SimBackend::new(SimConfig::default()).unwrap();
        let before = sim.counters();
        let rows = measure(&sim, 0, 3).unwrap();
        assert_eq!(
            rows.iter().map(|r| r.granules).collect::<Vec<_>>(),
            GRANULES.to_vec()
        );
        let calls = sim.counters().since(&before);
        let granules: u64 = GRANULES.iter().sum();
        let sizes = GRANULES.len() as u64;
        // Three samples of each way, at each size.
        assert_eq!(calls.get(Call::MemCreate), 3 * (sizes + granules));
        assert_eq!(calls.get(Call::MemRelease), 3 * (sizes + granules));
        assert_eq!(calls.get(Call::Map), 3 * (sizes + granules));
        assert_eq!(calls.get(Call::Unmap), 3 * (sizes + granules));
        for r in &rows {
            assert_eq!(
                r.bytes,
                r.granules * sim.device_info(0).unwrap().granularity
            );
            assert!(r.one_chunk_us.total() > 0.0 && r.per_granule_us.total() > 0.0);
        }
        assert_eq!(sim.used_bytes(0), 0, "every chunk released");
    }
}
