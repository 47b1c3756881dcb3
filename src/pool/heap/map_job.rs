//! Backing a range in three steps, so that the driver's mapping calls run
//! with no lock held.
//!
//! A `cuMemMap` costs about 20 µs on an H200 and an access grant more
//! with every peer; made under the heap lock, each stalled every stream
//! of the device behind it, cached reuse included. So backing a range is:
//!
//! 1. *Plan*, under the heap lock ([`Heap::plan_back`]): the range is
//!    allocated, a chunk is chosen for every unbacked granule (spare,
//!    created, or stolen from idle memory), and the free rests of its
//!    unbacked first and last granules are cut out of the free ranges.
//! 2. *Map*, no lock held ([`MapJob::run`]): each run of granules is
//!    mapped and its peers granted access; a failure unmaps what the job
//!    mapped.
//! 3. *Publish*, under the lock again ([`Heap::publish_back`]): the
//!    granules record their chunks and the cut rests go back to the free
//!    ranges; after a failure every chunk goes back where it came from.
//!
//! Invariants while a job is out (`Heap::in_flight > 0`): its granules are
//! in neither the mapped nor the idle set and no free range overlaps them
//! (the range is allocated, the rests are cut out), so no other request
//! places memory over them, steals or unmaps them; its chunks are in no
//! list of the heap (each is counted in `reserved` all the same). Only
//! the job's thread touches their mappings. The consistency check
//! ([`Heap::check`]) needs every job published.
//!
//! Chunk creation and the unmapping of stolen clean granules still run
//! at planning, under the lock: they decide what the job maps.

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
    /// A chunk for every granule of `runs`, in order.
    pub(super) chunks: Vec<ChunkHandle>,
    /// How many of `chunks` came off the spare list (the first ones).
    pub(super) from_spare: usize,
    /// Chunks created from the device for this request.
    pub(super) shortfall: usize,
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

/// What [`MapJob::run`] did: `Err` if a call failed, with the indexes of
/// the runs it mapped and then could not unmap (left mapped).
pub(crate) type MapDone = std::result::Result<(), (Error, Vec<usize>)>;

impl MapJob {
    fn va(&self, g: u32) -> DevicePtr {
        DevicePtr(self.base + g as u64 * self.gran)
    }

    /// Maps every run, all or nothing: on a failure the runs already
    /// mapped are unmapped again (no work ever saw their addresses).
    /// Takes no lock of the pool's.
    pub(crate) fn run(&self) -> MapDone {
        let mut i = 0;
        for (k, &(g0, n)) in self.runs.iter().enumerate() {
            let n = n as usize;
            if let Err(e) = self.map(g0, &self.chunks[i..i + n]) {
                let kept = (0..k)
                    .filter(|&j| {
                        let (g, m) = self.runs[j];
                        self.backend
                            .unmap_run(self.dev, self.va(g), self.gran, m as u64)
                            .is_err()
                    })
                    .collect();
                return Err((e, kept));
            }
            i += n;
        }
        Ok(())
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

    /// The chunks of run `k`.
    fn chunks_of(&self, k: usize) -> &[ChunkHandle] {
        let at: usize = self.runs[..k].iter().map(|r| r.1 as usize).sum();
        &self.chunks[at..at + self.runs[k].1 as usize]
    }
}

impl Heap {
    /// Mappings planned and not yet published.
    pub(crate) fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// Publishes a job that [`MapJob::run`] made (`done`): the granules
    /// record their chunks and the cut rests return, those of a granule
    /// backed by an aliased chunk for the requesting stream alone (its
    /// physical memory may still be in use by work only that stream is
    /// ordered after). After a failure, every chunk goes back where it
    /// came from and the range's users are dropped (the caller frees the
    /// range). Returns the job's aliased granules, as `back` does.
    pub(super) fn publish_back(
        &mut self,
        mut job: MapJob,
        done: MapDone,
    ) -> Result<Option<(u32, u32)>> {
        self.in_flight -= 1;
        // The job's quarantine and waits come before any noted since.
        let later = std::mem::replace(
            &mut self.fresh_quarantine,
            std::mem::take(&mut job.quarantine),
        );
        self.fresh_quarantine.extend(later);
        let later = std::mem::replace(&mut self.fresh_waits, std::mem::take(&mut job.waits));
        self.fresh_waits.extend(later);
        let failed = match done {
            Ok(()) => None,
            Err((e, kept)) => Some((e, kept)),
        };
        let mapped_runs: Vec<usize> = match &failed {
            None => (0..job.runs.len()).collect(),
            Some((_, kept)) => kept.clone(),
        };
        for &k in &mapped_runs {
            self.note_mapped(job.runs[k].0, job.chunks_of(k));
        }
        let Some((e, kept)) = failed else {
            if job.peers != self.peers && !self.peers.is_empty() {
                // Peers were granted access while the job mapped: grant
                // them its mappings too.
                for &(g0, n) in &job.runs {
                    let bytes = n as u64 * self.gran;
                    if let Err(e) =
                        self.backend
                            .set_access(self.dev, job.va(g0), bytes, &self.peers)
                    {
                        tracing::warn!(device = self.dev, "peer access to a new mapping: {e}");
                    }
                }
            }
            // (A cut rest lies in the range's first or last granule.)
            for &(a, l, tag) in &job.cut {
                let g = ((a - job.base) / self.gran) as u32;
                let aliased = job.aliased.is_some_and(|(lo, hi)| g == lo || g == hi);
                let tag = match job.slot {
                    Some(s) if aliased => Tag::Dirty(s),
                    _ => tag,
                };
                self.insert_free(a, l, tag);
            }
            return Ok(job.aliased);
        };
        for &(a, l, tag) in &job.cut {
            self.insert_free(a, l, tag);
        }
        if !kept.is_empty() {
            // A driver that maps but cannot unmap: those chunks stay where
            // they are, mapped (a leak, never an alias).
            tracing::error!(
                device = self.dev,
                runs = kept.len(),
                "rolling back a stitch: unmap failed; granules stay mapped"
            );
            self.drop_users(job.start, job.len);
            return Err(e);
        }
        // Spare chunks back to the spare list (in the order they were
        // popped from it), stolen ones to their granules (an aliased one
        // to its old mapping, which it never left), and the chunks created
        // for this request to the device.
        for &c in job.chunks[..job.from_spare].iter().rev() {
            self.push_spare(c);
        }
        self.unsteal_all(job.steals);
        for _ in 0..job.shortfall {
            match self.take_spare() {
                Some(c) => self.release_chunk(c),
                None => break,
            }
        }
        self.drop_users(job.start, job.len);
        Err(e)
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
