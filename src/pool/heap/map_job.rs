//! Backing a range in three steps, so that the driver's mapping calls run
//! with no lock held.
//!
//! A `cuMemMap` costs about 20 µs on an H200 and an access grant more
//! with every peer; made under the heap lock, each stalled every stream
//! of the device behind it, cached reuse included. So backing a range is:
//!
//! 1. *Plan*, under the heap lock ([`Heap::plan_back`]): the range is
//!    allocated and a chunk is chosen for every unbacked granule: spare,
//!    to be created (admitted within the limit and counted as reserved),
//!    or stolen from idle memory. The free rests of the range's unbacked
//!    first and last granules, and the addresses of stolen clean
//!    granules, are cut out of the free ranges.
//! 2. *Call the driver*, no lock held ([`MapJob::run`]): create the new
//!    chunks, unmap the stolen clean granules, map each run of granules
//!    and grant its peers access. A failure undoes what the job did where
//!    it can (chunks it created are released, runs it mapped unmapped).
//! 3. *Publish*, under the lock again ([`Heap::publish_back`]): the
//!    granules record their chunks and the cut addresses go back to the
//!    free ranges; after a failure every chunk goes back where it came
//!    from.
//!
//! Invariants while a job is out (`Heap::in_flight > 0`): its granules
//! (those it maps and those it unmaps) are in neither the mapped nor the
//! idle set and no free range overlaps them, so no other request places
//! memory over them, steals or unmaps them; its chunks are in no list of
//! the heap (each is counted in `reserved` all the same). Only the job's
//! thread touches their mappings. The consistency check ([`Heap::check`])
//! needs every job published. A pending group that completes while a job
//! holds pieces of it out gets them back clean (`Heap::live_tag`).
//!
//! A job may unmap (stolen clean granules; its own runs after a failed
//! map), which a CUDA graph capture forbids: the pool enters the capture
//! handshake before it releases the lock (`PoolShared::mapping_job`), so
//! a capture begun after the plan waits for the job's calls.
//!
//! A growth the device refuses (its chunks could not be created) is
//! planned again with stealing ([`Heap::growth_refused`]), as a
//! refused growth always fell back on stitching.

use super::stitch::Steals;
use super::*;

/// The mapping one request needs: made by [`MapJob::run`] outside the
/// heap lock, then handed to [`Heap::publish_back`].
#[derive(Debug)]
#[must_use = "a planned mapping must be run and published"]
pub(crate) struct MapJob {
    pub(super) backend: Arc<dyn Backend>,
    pub(super) dev: usize,
    /// Start of the reservation and the granule size.
    pub(super) base: u64,
    pub(super) gran: u64,
    /// Peers granted access to every mapping, as planned.
    pub(super) peers: Vec<usize>,
    /// The range being backed and the stream slot asking.
    pub(super) start: u64,
    pub(super) len: u64,
    pub(super) slot: Option<u16>,
    /// Unbacked granules as runs `(first, count)`, ascending.
    pub(super) runs: smallvec::SmallVec<[(u32, u32); 8]>,
    /// A chunk for every granule of `runs`, in order, but for the
    /// `create` still to be created.
    pub(super) chunks: Vec<ChunkHandle>,
    /// How many of `chunks` came off the spare list (the first ones).
    pub(super) from_spare: usize,
    /// Chunks to create from the device for this request (they go after
    /// the spare ones).
    pub(super) create: usize,
    /// Whether the plan grew in place of stealing (`growth_due`).
    pub(super) growth: bool,
    pub(super) steals: Steals,
    /// The lowest and highest granule backed by an aliased chunk.
    pub(super) aliased: Option<(u32, u32)>,
    /// Free rests cut out of the free ranges until publication.
    pub(super) cut: Cover,
    /// Quarantined runs and pending groups to wait on, noted at planning
    /// (the heap's own lists are for the caller that publishes).
    pub(super) quarantine: GranuleRuns,
    pub(super) waits: Vec<u32>,
}

/// What [`MapJob::run`] did: the chunks it created, or why it failed.
pub(crate) type MapDone = std::result::Result<Vec<ChunkHandle>, MapFailed>;

/// A job that failed, and what it left done.
#[derive(Debug)]
pub(crate) struct MapFailed {
    error: Error,
    /// Chunks it created and still holds (none if creation failed).
    created: Vec<ChunkHandle>,
    /// Clean runs (`Steals::clean_runs`) it unmapped: the first ones.
    unmapped: usize,
    /// Runs it mapped and then could not unmap (left mapped).
    kept: Vec<usize>,
}

impl MapJob {
    fn va(&self, g: u32) -> DevicePtr {
        DevicePtr(self.base + g as u64 * self.gran)
    }

    /// Creates the new chunks, unmaps the stolen clean granules and maps
    /// every run, all or nothing: on a failure the runs already mapped
    /// are unmapped again (no work ever saw their addresses), and chunks
    /// whose creation did not complete are released. Takes no lock of
    /// the pool's.
    pub(crate) fn run(&self) -> MapDone {
        let fail = |error, created, unmapped, kept| MapFailed {
            error,
            created,
            unmapped,
            kept,
        };
        let mut created = Vec::with_capacity(self.create);
        for _ in 0..self.create {
            match self.backend.create_chunk(self.dev, self.gran) {
                Ok(c) => created.push(c),
                Err(e) => {
                    for c in created {
                        let _ = self.backend.release_chunk(self.dev, c);
                    }
                    return Err(fail(e, Vec::new(), 0, Vec::new()));
                }
            }
        }
        for (j, &(g0, n)) in self.steals.clean_runs.iter().enumerate() {
            if let Err(e) = self
                .backend
                .unmap_run(self.dev, self.va(g0), self.gran, n as u64)
            {
                return Err(fail(e, created, j, Vec::new()));
            }
        }
        let all = self.all_chunks(&created);
        let mut i = 0;
        for (k, &(g0, n)) in self.runs.iter().enumerate() {
            let n = n as usize;
            if let Err(e) = self.map(g0, &all[i..i + n]) {
                let kept = (0..k)
                    .filter(|&j| {
                        let (g, m) = self.runs[j];
                        self.backend
                            .unmap_run(self.dev, self.va(g), self.gran, m as u64)
                            .is_err()
                    })
                    .collect();
                return Err(fail(e, created, self.steals.clean_runs.len(), kept));
            }
            i += n;
        }
        Ok(created)
    }

    /// Maps `chunks` under granules `g0..`, with access for the peers.
    fn map(&self, g0: u32, chunks: &[ChunkHandle]) -> Result<()> {
        let va = self.va(g0);
        self.backend.map_run(self.dev, va, self.gran, chunks)?;
        // Access is per mapping: peers get it on every new one.
        if !self.peers.is_empty() {
            let bytes = chunks.len() as u64 * self.gran;
            if let Err(e) = self.backend.set_access(self.dev, va, bytes, &self.peers) {
                let _ = self
                    .backend
                    .unmap_run(self.dev, va, self.gran, chunks.len() as u64);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Every granule's chunk in order: spare, created, stolen.
    fn all_chunks(&self, created: &[ChunkHandle]) -> Vec<ChunkHandle> {
        let mut all = Vec::with_capacity(self.chunks.len() + created.len());
        all.extend_from_slice(&self.chunks[..self.from_spare]);
        all.extend_from_slice(created);
        all.extend_from_slice(&self.chunks[self.from_spare..]);
        all
    }

    /// The offset in [`MapJob::all_chunks`] of run `k`'s chunks.
    fn offset_of(&self, k: usize) -> usize {
        self.runs[..k].iter().map(|r| r.1 as usize).sum()
    }
}

impl Heap {
    /// Mappings planned and not yet published.
    pub(crate) fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// Publishes a job that [`MapJob::run`] made (`done`): the granules
    /// record their chunks and the cut addresses return, the rests of a
    /// granule backed by an aliased chunk for the requesting stream alone
    /// (its physical memory may still be in use by work only that stream
    /// is ordered after). After a failure, every chunk goes back where it
    /// came from and the range's users are dropped (the caller frees the
    /// range). Returns the job's aliased granules, as `back` does.
    pub(super) fn publish_back(
        &mut self,
        job: Box<MapJob>,
        done: MapDone,
    ) -> Result<Option<(u32, u32)>> {
        let r = self.publish(*job, done);
        if self.in_flight == 0 {
            self.completed_during_jobs.clear();
        }
        r
    }

    fn publish(&mut self, mut job: MapJob, done: MapDone) -> Result<Option<(u32, u32)>> {
        self.in_flight -= 1;
        // The job's quarantine and waits come before any noted since.
        let later = std::mem::replace(
            &mut self.fresh_quarantine,
            std::mem::take(&mut job.quarantine),
        );
        self.fresh_quarantine.extend(later);
        let later = std::mem::replace(&mut self.fresh_waits, std::mem::take(&mut job.waits));
        self.fresh_waits.extend(later);
        let mut f = match done {
            Ok(created) => {
                let all = job.all_chunks(&created);
                let mut i = 0;
                for &(g0, n) in &job.runs {
                    self.note_mapped(g0, &all[i..i + n as usize]);
                    i += n as usize;
                }
                self.grant_new_peers(&job);
                if job.growth {
                    self.stolen_since_growth = 0;
                }
                for &(a, l, tag) in &job.steals.clean_cut {
                    self.insert_free(a, l, self.live_tag(tag));
                }
                // (A cut rest lies in the range's first or last granule.)
                for &(a, l, tag) in &job.cut {
                    let g = ((a - job.base) / self.gran) as u32;
                    let aliased = job.aliased.is_some_and(|(lo, hi)| g == lo || g == hi);
                    let tag = match job.slot {
                        Some(s) if aliased => Tag::Dirty(s),
                        _ => self.live_tag(tag),
                    };
                    self.insert_free(a, l, tag);
                }
                return Ok(job.aliased);
            }
            Err(f) => f,
        };
        // A growth plan steals nothing: an empty `created` means the
        // device refused the chunks.
        if job.growth && f.created.is_empty() {
            self.growth_refused = true;
        }
        let all = job.all_chunks(&f.created);
        for &k in &f.kept {
            let at = job.offset_of(k);
            self.note_mapped(job.runs[k].0, &all[at..at + job.runs[k].1 as usize]);
        }
        // Clean victims the job did not unmap keep their mappings.
        self.unsteal_clean_from(&mut job.steals, f.unmapped);
        for &(a, l, tag) in job.steals.clean_cut.iter().chain(&job.cut) {
            self.insert_free(a, l, self.live_tag(tag));
        }
        if !f.kept.is_empty() {
            // A driver that maps but cannot unmap: those chunks stay where
            // they are, mapped (a leak, never an alias).
            tracing::error!(
                device = self.dev,
                runs = f.kept.len(),
                "rolling back a stitch: unmap failed; granules stay mapped"
            );
            self.drop_users(job.start, job.len);
            return Err(f.error);
        }
        // Spare chunks back to the spare list (in the order they were
        // popped from it), stolen ones to their granules (an aliased one
        // to its old mapping, which it never left) or, unmapped, to the
        // spare list, and the chunks created for this request to the
        // device (uncounted if they were never made).
        for &c in job.chunks[..job.from_spare].iter().rev() {
            self.push_spare(c);
        }
        self.unsteal_all(job.steals);
        if f.created.is_empty() {
            self.reserved -= job.create as u64 * self.gran;
            self.device_allocs -= job.create as u64;
        }
        for c in std::mem::take(&mut f.created) {
            self.release_chunk(c);
        }
        self.drop_users(job.start, job.len);
        Err(f.error)
    }

    /// Grants peers given access while `job` mapped its runs (with the
    /// peers of its plan) access to them too.
    fn grant_new_peers(&mut self, job: &MapJob) {
        if job.peers == self.peers || self.peers.is_empty() {
            return;
        }
        for &(g0, n) in &job.runs {
            let bytes = n as u64 * self.gran;
            if let Err(e) = self
                .backend
                .set_access(self.dev, job.va(g0), bytes, &self.peers)
            {
                tracing::warn!(device = self.dev, "peer access to a new mapping: {e}");
            }
        }
    }

    /// After a growth the device refused: whether the caller should plan
    /// again (this time stealing idle memory; `plan_back`).
    pub(crate) fn growth_refused(&self) -> bool {
        self.growth_refused
    }

    /// Takes the free memory in `[lo, hi)` out of the free ranges, adding
    /// its pieces `(addr, len, tag)` to `out`.
    pub(super) fn cut_free(&mut self, lo: u64, hi: u64, out: &mut Cover) {
        if lo >= hi {
            return;
        }
        let Some(cover) = self.cover(lo, hi) else {
            debug_assert!(false, "the rest of an unbacked granule is free");
            return;
        };
        for (a, l, tag) in cover {
            self.index_remove(a);
            if a < lo {
                self.insert_free(a, lo - a, tag);
            }
            if a + l > hi {
                self.insert_free(hi, a + l - hi, tag);
            }
            let (s, e) = (a.max(lo), (a + l).min(hi));
            out.push((s, e - s, tag));
        }
    }
}
