//! Stitching: backing a range with physical memory taken from wherever it
//! is idle, and the quarantine that keeps the old mappings of stolen
//! chunks alive until the work that may still touch them completes.
//!
//! A steal is transactional: either every chunk a request needs is mapped
//! at its new address, or every stolen chunk goes back where it came from
//! and every run the call mapped is unmapped again. A chunk stolen from a
//! granule that is not wholly `Clean` is stolen by aliasing: its old
//! mapping stays (quarantined, excluded from every free range) and the
//! requesting stream waits on the pending groups of the ranges it was cut
//! from before using the new range.

use super::*;

/// Granules as runs `(first, count)`: quarantined granules come in runs
/// (a stitch aliases whole runs of idle granules), handled a run at a time.
pub(crate) type GranuleRuns = Vec<(u32, u32)>;

/// Appends granules `g0..g0 + n` to `runs`, extending the last run if they
/// follow it.
pub(super) fn push_run(runs: &mut GranuleRuns, g0: u32, n: u32) {
    match runs.last_mut() {
        Some((s, m)) if *s + *m == g0 => *m += n,
        _ => runs.push((g0, n)),
    }
}

/// Who is asking, for deciding which idle granules may be stolen.
#[derive(Debug, Clone, Copy)]
pub(super) struct StealCtx {
    pub(super) slot: Option<u16>,
    pub(super) pending_ok: bool,
}

/// A chunk taken from an idle granule.
#[derive(Debug)]
pub(super) struct Stolen {
    g: u32,
    chunk: ChunkHandle,
    /// For a steal by aliasing, the index of its run's cover in the
    /// [`Steals`] (the free ranges the granule's pieces were cut from);
    /// `None` for a clean steal.
    run: Option<u32>,
}

/// The chunks one request steals, the covers of its aliased runs, and its
/// clean runs (to unmap) with their addresses cut out of the free ranges.
#[derive(Debug, Default)]
pub(super) struct Steals {
    stolen: Vec<Stolen>,
    covers: Vec<Cover>,
    pub(super) clean_runs: Vec<(u32, u32)>,
    pub(super) clean_cut: Cover,
}

impl Heap {
    /// Makes `[start, start+len)` backed, all under the heap lock (see
    /// [`Heap::plan_back`]; the large and slab paths map outside it).
    /// Returns the lowest and the highest granule backed by an aliased
    /// chunk, if any.
    pub(super) fn back(
        &mut self,
        start: u64,
        len: u64,
        ctx: StealCtx,
    ) -> Result<Option<(u32, u32)>> {
        match self.plan_back(start, len, ctx)? {
            None => Ok(None),
            Some(job) => {
                let done = job.run();
                self.publish_back(job, done)
            }
        }
    }

    /// Plans backing `[start, start+len)` (an allocated range, counted as
    /// a user of its granules here): chooses a chunk for every granule
    /// that has none, from the spare list, from idle granules (stolen),
    /// and only then from the device, and returns the mapping to make
    /// ([`MapJob::run`], no lock needed) and then publish
    /// ([`Heap::publish_back`]); `None` if every granule is backed. All
    /// device allocations are made before anything is stolen, so a
    /// shortfall fails cleanly. On an error nothing changed.
    pub(super) fn plan_back(
        &mut self,
        start: u64,
        len: u64,
        ctx: StealCtx,
    ) -> Result<Option<Box<MapJob>>> {
        if !matches!(self.phys, Physical::Vmm { .. }) {
            return Ok(None);
        }
        self.count_users(start, len, true);
        // Mask compares, no count: most takes are of backed places, and
        // the runs below give the count of the others.
        if self.fully_backed(start, len) {
            return Ok(None);
        }
        let Physical::Vmm { base, mapped, .. } = &self.phys else {
            unreachable!("VMM checked above")
        };
        let base = *base;
        let (first, last, _) = granule_span(base, self.gran, start, len);
        // The unbacked granules as runs `(first, count)`, ascending, read
        // off the mapped set a word at a time. Their granules in order are
        // "the needed granules": position `p` of that order gets chunk
        // `p`. (Stealing below takes idle granules only, never these.)
        let mut runs: smallvec::SmallVec<[(u32, u32); 8]> = smallvec::SmallVec::new();
        let mut g = first;
        while g <= last {
            g += mapped.run_len(g, last + 1);
            if g > last {
                break;
            }
            let n = mapped.gap_len(g, last + 1);
            runs.push((g, n));
            g += n;
        }
        let need_len: usize = runs.iter().map(|r| r.1 as usize).sum();
        debug_assert_eq!(need_len as u64, self.unbacked(start, len));
        let want = need_len.saturating_sub(self.spare_len());
        // Grow in place of this steal once stitching has remapped its
        // budget (see `stitch_budget`); a growth the limit refuses steals
        // after all (stitching is what averts the OOM), as does the retry
        // of one the device refused (`growth_refused`).
        let growth = !std::mem::take(&mut self.growth_refused)
            && self.growth_due(want)
            && self.admit_chunks(want).is_ok();
        let (mut victims, create) = if growth {
            // (`stolen_since_growth` restarts when the growth is published.)
            (Vec::new(), want)
        } else {
            let victims = self.stealable(ctx, want);
            let reusable = self.spare_len() + victims.iter().map(|v| v.1 as usize).sum::<usize>();
            let create = need_len.saturating_sub(reusable);
            if let Err(e) = self.admit_chunks(create) {
                self.drop_users(start, len);
                return Err(e);
            }
            (victims, create)
        };
        // Spare chunks and the chunks to create cover all but the
        // victims' share; steal that share in runs of adjacent granules.
        let from_spare = self.spare_len().min(need_len - create);
        let mut keep = need_len - create - from_spare;
        victims.retain_mut(|v| {
            v.1 = v.1.min(keep as u32);
            keep -= v.1 as usize;
            v.1 > 0
        });
        let mut steals = Steals {
            stolen: Vec::with_capacity(victims.iter().map(|v| v.1 as usize).sum()),
            ..Steals::default()
        };
        self.steal_all(&victims, &mut steals);
        self.stolen_since_growth += steals.stolen.len() as u64;
        self.stitch_share.spend(steals.stolen.len());
        // Every needed granule's chunk, in order: the spare chunks first
        // (as `take_spare` pops them), then the ones to create (the job
        // puts them in), then the stolen ones, last stolen first.
        // Stealing took exactly the rest, so one vector serves every run
        // as a slice.
        let mut chunks = Vec::with_capacity(need_len);
        chunks.extend((0..from_spare).map_while(|_| self.take_spare()));
        chunks.extend(steals.stolen.iter().rev().map(|st| st.chunk));
        debug_assert_eq!(
            chunks.len() + create,
            need_len,
            "counted as stealable above"
        );
        // Stolen chunk `k` backs needed granule `from_spare + create +
        // stolen.len() - 1 - k` (last stolen first): the lowest aliased
        // granule is that of the last aliased steal, the highest that of
        // the first.
        let stolen = &steals.stolen;
        let granule_of = |k: usize| {
            let mut p = from_spare + create + stolen.len() - 1 - k;
            for &(g0, n) in &runs {
                if p < n as usize {
                    return g0 + p as u32;
                }
                p -= n as usize;
            }
            unreachable!("a needed granule lies in a run")
        };
        let is_aliased = |st: &Stolen| st.run.is_some();
        let aliased = stolen.iter().rposition(is_aliased).map(|lo| {
            let hi = stolen.iter().position(is_aliased).expect("one is aliased");
            (granule_of(lo), granule_of(hi))
        });
        // The free rests of the unbacked first and last granules leave the
        // free ranges until the job is published: no other request may
        // place memory in a granule whose mapping is under way.
        let mut cut = Cover::new();
        let (gs, ge) = (
            base + first as u64 * self.gran,
            base + (last as u64 + 1) * self.gran,
        );
        if runs[0].0 == first {
            self.cut_free(gs, start, &mut cut);
        }
        let &(g_end, n_end) = runs.last().expect("some granule is unbacked");
        if g_end + n_end - 1 == last {
            self.cut_free(start + len, ge, &mut cut);
        }
        self.in_flight += 1;
        Ok(Some(Box::new(MapJob {
            backend: self.backend.clone(),
            dev: self.dev,
            base,
            gran: self.gran,
            peers: self.peers.clone(),
            start,
            len,
            slot: ctx.slot,
            runs,
            chunks,
            from_spare,
            create,
            growth,
            steals,
            aliased,
            cut,
            quarantine: std::mem::take(&mut self.fresh_quarantine),
            waits: std::mem::take(&mut self.fresh_waits),
        })))
    }

    /// Whether a request short of `want` granules grows the device memory
    /// instead of stealing them: stitching has stolen `stitch_budget`
    /// times the heap's reserved granules since the last such growth.
    /// Ski rental: a workload whose free memory stays fragmented (a server
    /// whose request sizes never repeat) would otherwise remap granules on
    /// every few requests forever, each steal an unmap, a map and an
    /// access grant; past the budget the pool buys the memory once, and
    /// the budget grows with what it holds, so the growth settles.
    /// Or stealing them would take more than the heap's share of wall
    /// time (`stitch_share.rs`).
    fn growth_due(&mut self, want: usize) -> bool {
        want > 0
            && ((self.stitch_budget > 0.0
                && self.stolen_since_growth as f64
                    >= self.stitch_budget * (self.reserved / self.gran) as f64)
                || !self.stitch_share.affords(want, std::time::Instant::now()))
    }

    /// Admits `n` chunks to create within the limit and counts them as
    /// reserved and as device allocations (the job creates them,
    /// [`MapJob::run`]; `publish_back` uncounts any it could not).
    fn admit_chunks(&mut self, n: usize) -> Result<()> {
        let bytes = n as u64 * self.gran;
        self.limit.admit(self.dev, self.reserved, bytes)?;
        self.device_allocs += n as u64;
        self.reserved += bytes;
        if n > 0 {
            tracing::debug!(
                device = self.dev,
                chunks = n,
                reserved = self.reserved,
                "device memory grown"
            );
        }
        Ok(())
    }

    /// Steals the chunks of `victims` (runs of idle granules in
    /// ascending order, each with its steal kind, as from
    /// [`Heap::stealable`]). A clean run's granules leave the mapped and
    /// idle sets and its addresses the free ranges (`Steals::clean_cut`)
    /// until the job that unmaps them is published.
    pub(super) fn steal_all(&mut self, victims: &[(u32, u32, bool)], out: &mut Steals) {
        for &(g0, n, clean) in victims {
            if !clean {
                self.steal_aliased_run(g0, n, out);
                continue;
            }
            let Physical::Vmm {
                base,
                granules,
                idle,
                mapped,
                ..
            } = &mut self.phys
            else {
                unreachable!("VMM only")
            };
            let (rs, re) = (
                *base + g0 as u64 * self.gran,
                *base + (g0 + n) as u64 * self.gran,
            );
            mapped.remove_range(g0, g0 + n);
            idle.remove_range(g0, g0 + n);
            for g in g0..g0 + n {
                let chunk = granules[g as usize]
                    .chunk
                    .take()
                    .expect("idle granules are mapped");
                out.stolen.push(Stolen {
                    g,
                    chunk,
                    run: None,
                });
            }
            out.clean_runs.push((g0, n));
            self.cut_free(rs, re, &mut out.clean_cut);
        }
    }

    /// Puts back the clean steals of `steals.clean_runs[from..]`, which
    /// the job did not unmap: each chunk under its granule again, mapped
    /// and idle (its addresses return with the job's cut pieces).
    pub(super) fn unsteal_clean_from(&mut self, steals: &mut Steals, from: usize) {
        let Physical::Vmm {
            granules,
            idle,
            mapped,
            ..
        } = &mut self.phys
        else {
            return;
        };
        let keep = |g: u32| {
            !steals.clean_runs[from..]
                .iter()
                .any(|&(g0, n)| g0 <= g && g < g0 + n)
        };
        steals.stolen.retain(|st| {
            if st.run.is_some() || keep(st.g) {
                return true;
            }
            granules[st.g as usize].chunk = Some(st.chunk);
            mapped.insert(st.g);
            idle.insert(st.g);
            false
        });
        steals.clean_runs.truncate(from);
    }

    /// How an idle granule covered by free ranges of `tags` can be stolen
    /// under `ctx`: `Some(true)` clean (unmap now), `Some(false)` by
    /// aliasing (free for `ctx.slot` after waiting), `None` not at all.
    pub(super) fn kind_of(
        &self,
        tags: impl Iterator<Item = Tag> + Clone,
        ctx: StealCtx,
    ) -> Option<bool> {
        if tags.clone().all(|t| t == Tag::Clean) {
            return Some(true);
        }
        let ok = tags.into_iter().all(|t| match t {
            Tag::Clean => true,
            Tag::Dirty(s) => Some(s) == ctx.slot,
            Tag::Pending(id) => ctx.pending_ok && !self.blocked.contains(&id),
        });
        // Aliasing leaves the rest of the granule to the requesting stream
        // alone, which needs a stream slot to express.
        (ok && ctx.slot.is_some()).then_some(false)
    }

    /// Up to `want` idle granules stealable under `ctx`, ascending, as
    /// runs `(first, count, clean)` of adjacent granules of one kind.
    /// Idle granules mostly come in runs inside one long free range (a
    /// freed large block): the granules wholly inside the range that
    /// covered the previous one take its kind without a lookup, a word of
    /// the idle set at a time.
    pub(super) fn stealable(&self, ctx: StealCtx, want: usize) -> Vec<(u32, u32, bool)> {
        if self.capture_hold {
            return Vec::new();
        }
        let Physical::Vmm { idle, base, .. } = &self.phys else {
            return Vec::new();
        };
        let mut out: Vec<(u32, u32, bool)> = Vec::new();
        let mut found = 0usize;
        // The last range of the previous cover: (start, end, kind alone).
        let mut last: Option<(u64, u64, Option<bool>)> = None;
        let mut next = 0u64;
        while found < want {
            let Some(g) = idle.first_at_or_after(next) else {
                break;
            };
            let g = g as u32;
            let (gs, ge) = (
                *base + g as u64 * self.gran,
                *base + (g as u64 + 1) * self.gran,
            );
            let (kind, n) = match last {
                Some((a, e, k)) if a <= gs && ge <= e => {
                    // This granule and the idle ones right after it that
                    // still lie wholly inside that range.
                    let end = ((e - *base) / self.gran) as u32;
                    (k, idle.run_len(g, end).max(1))
                }
                _ => match self.granule_cover(g) {
                    Some(cover) => {
                        let &(a, l, t) = cover.last().expect("a cover is never empty");
                        last = Some((a, a + l, self.kind_of(std::iter::once(t), ctx)));
                        (self.kind_of(cover.iter().map(|p| p.2), ctx), 1)
                    }
                    None => (None, 1),
                },
            };
            next = g as u64 + n as u64;
            let Some(k) = kind else {
                continue;
            };
            let n = n.min((want - found) as u32);
            found += n as usize;
            match out.last_mut() {
                Some((g0, m, c)) if *c == k && *g0 + *m == g => *m += n,
                _ => out.push((g, n, k)),
            }
        }
        out
    }

    /// Takes the chunks of idle granules `g0..g0+n` for new mappings
    /// (stitching) while their last uses may still run (dirty on the
    /// requesting stream, or pending): each granule keeps its old mapping,
    /// so that work can finish; its address range is quarantined until an
    /// event recorded on the requesting stream completes, then unmapped
    /// ([`Heap::release_quarantine`]). The requesting stream's new work is
    /// ordered after the old uses (same stream, or a wait on the pending
    /// groups, queued for [`Heap::take_steal_waits`]), so the aliased bytes
    /// are never used twice at once. The free ranges covering the run are
    /// cut once for the whole run, not once per granule: stitching a large
    /// block usually steals a few long runs.
    pub(super) fn steal_aliased_run(&mut self, g0: u32, n: u32, out: &mut Steals) {
        let Physical::Vmm { base, .. } = &self.phys else {
            unreachable!("VMM only")
        };
        let (rs, re) = (
            *base + g0 as u64 * self.gran,
            *base + (g0 + n) as u64 * self.gran,
        );
        let cover = self.cover(rs, re).expect("idle granules are free");
        for &(a, l, tag) in &cover {
            self.index_remove(a);
            if let Tag::Pending(id) = tag {
                self.fresh_waits.push(id);
            }
            self.insert_free(a, rs.saturating_sub(a), tag);
            if a + l > re {
                self.insert_free(re, a + l - re, tag);
            }
        }
        let Physical::Vmm {
            granules,
            idle,
            quarantine,
            mapped,
            ..
        } = &mut self.phys
        else {
            unreachable!()
        };
        let run = Some(out.covers.len() as u32);
        out.covers.push(cover);
        mapped.remove_range(g0, g0 + n);
        idle.remove_range(g0, g0 + n);
        quarantine.insert_range(g0, g0 + n);
        push_run(&mut self.fresh_quarantine, g0, n);
        for g in g0..g0 + n {
            let gr = &mut granules[g as usize];
            let chunk = gr.chunk.take().expect("idle granules are mapped");
            gr.alias = Some(chunk);
            *self.aliases.entry(chunk).or_default() += 1;
            out.stolen.push(Stolen { g, chunk, run });
        }
    }

    /// Undoes every steal of `steals` whose chunk was not mapped.
    pub(super) fn unsteal_all(&mut self, steals: Steals) {
        for st in steals.stolen {
            self.unsteal(st, &steals.covers);
        }
    }

    /// Undoes a steal whose chunk could not be mapped.
    pub(super) fn unsteal(&mut self, st: Stolen, covers: &[Cover]) {
        let Some(run) = st.run else {
            // A clean steal: the old mapping is gone; keep the chunk spare.
            self.push_spare(st.chunk);
            return;
        };
        let Physical::Vmm {
            base,
            granules,
            idle,
            quarantine,
            mapped,
            ..
        } = &mut self.phys
        else {
            return;
        };
        granules[st.g as usize].chunk = Some(st.chunk);
        granules[st.g as usize].alias = None;
        match self.aliases.get_mut(&st.chunk) {
            Some(n) if *n > 1 => *n -= 1,
            _ => {
                self.aliases.remove(&st.chunk);
            }
        }
        mapped.insert(st.g);
        idle.insert(st.g);
        quarantine.remove(st.g);
        // Out of its quarantine run, which may split in two.
        if let Some(k) = self
            .fresh_quarantine
            .iter()
            .position(|&(s, n)| s <= st.g && st.g < s + n)
        {
            let (s, n) = self.fresh_quarantine[k];
            let (before, after) = (st.g - s, s + n - st.g - 1);
            match (before, after) {
                (0, 0) => {
                    self.fresh_quarantine.remove(k);
                }
                (0, _) => self.fresh_quarantine[k] = (st.g + 1, after),
                (_, 0) => self.fresh_quarantine[k] = (s, before),
                _ => {
                    self.fresh_quarantine[k] = (s, before);
                    self.fresh_quarantine.insert(k + 1, (st.g + 1, after));
                }
            }
        }
        // The granule's free pieces: its run's cover, clipped to it.
        let gs = *base + st.g as u64 * self.gran;
        let ge = gs + self.gran;
        for &(a, l, tag) in &covers[run as usize] {
            let (ps, pe) = (a.max(gs), (a + l).min(ge));
            if ps < pe {
                self.insert_free(ps, pe - ps, self.live_tag(tag));
            }
        }
    }

    /// Sets the pending groups that may not be handed over or stitched
    /// (see the `blocked` field).
    pub(crate) fn set_blocked(&mut self, ids: impl IntoIterator<Item = u32>) {
        self.blocked.clear();
        self.blocked.extend(ids);
    }

    /// Pending groups aliased since the last call (whether or not the
    /// allocation then succeeded): the requesting stream must wait on them
    /// before the quarantine event is recorded.
    pub(crate) fn take_steal_waits(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.fresh_waits)
    }

    /// Granules aliased since the last call; the caller records one event
    /// on the requesting stream and releases them when it completes.
    pub(crate) fn take_quarantine(&mut self) -> GranuleRuns {
        std::mem::take(&mut self.fresh_quarantine)
    }

    /// Unmaps quarantined granules (runs, as from
    /// [`Heap::take_quarantine`]) whose old uses completed and frees their
    /// addresses (clean, with no physical memory behind them).
    /// Adjacent granules become free as one range (one index update per
    /// run, not per granule).
    pub(crate) fn release_quarantine(&mut self, runs: &[(u32, u32)]) {
        let Physical::Vmm { base, .. } = &self.phys else {
            return;
        };
        let base = *base;
        // Stitching quarantines granules in ascending order, so the runs
        // are nearly always sorted already: copy and sort only if not.
        let mut copy = Vec::new();
        let sorted = if runs.is_sorted() {
            runs
        } else {
            copy.extend_from_slice(runs);
            copy.sort_unstable();
            &copy[..]
        };
        let mut k = 0;
        while k < sorted.len() {
            // Adjacent runs are released as one.
            let (g0, mut n) = sorted[k];
            k += 1;
            while k < sorted.len() && sorted[k].0 == g0 + n {
                n += sorted[k].1;
                k += 1;
            }
            let mut chunks = Vec::with_capacity(n as usize);
            if let Physical::Vmm {
                quarantine,
                granules,
                ..
            } = &mut self.phys
            {
                quarantine.remove_range(g0, g0 + n);
                chunks.extend((g0..g0 + n).filter_map(|g| granules[g as usize].alias.take()));
            }
            let va = base + g0 as u64 * self.gran;
            if let Err(e) = self
                .backend
                .unmap_run(self.dev, DevicePtr(va), self.gran, n as u64)
            {
                tracing::error!(
                    device = self.dev,
                    "unmap of quarantined granules failed: {e}"
                );
            }
            // Chunks given back meanwhile are free once this was their last
            // old mapping.
            for c in chunks {
                let last = match self.aliases.get_mut(&c) {
                    Some(k) if *k > 1 => {
                        *k -= 1;
                        false
                    }
                    _ => {
                        self.aliases.remove(&c);
                        true
                    }
                };
                if last && self.deferred.remove(&c) {
                    self.release_chunk(c);
                }
            }
            self.insert_free(va, n as u64 * self.gran, Tag::Clean);
        }
    }
}
