//! Running a pass: enqueue (device-side waits, one move batch, an event)
//! and commit (after that event completed), plus the non-blocking service
//! step that harvests movable frees and commits finished passes.
//!
//! Everything here runs under the arena lock and makes only non-blocking
//! driver calls, except [`sync_pass`], which the explicit `compact()` call
//! uses without the lock held.

use super::arena::{ArenaState, PendingFree};
use super::planner::{self, Budget};
use crate::backend::Move;
use crate::error::Result;
use crate::pool::PoolShared;
use crate::ptr::DevicePtr;

/// What a service step or a commit did.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Serviced {
    /// Pending movable frees released.
    pub harvested: usize,
    /// Blocks and bytes a committed pass moved, and moves it dropped
    /// (cancelled by a pin, or the block freed meanwhile).
    pub blocks_moved: u64,
    pub bytes_moved: u64,
    pub cancelled: u64,
    /// Regions given back to the heap.
    pub regions_released: u64,
    /// Whether a pass was committed.
    pub committed: bool,
}

/// Harvests completed movable frees and commits the in-flight pass if its
/// event completed. Never blocks the host.
pub(crate) fn service(pool: &PoolShared, st: &mut ArenaState) -> Serviced {
    let mut s = Serviced::default();
    if !st.pending.is_empty() {
        let mut emptied = Vec::new();
        let mut i = 0;
        while i < st.pending.len() {
            let p = &st.pending[i];
            if p.unrecorded.is_empty() && p.events.iter().all(|&e| pool.event_done(e)) {
                let p = st.pending.swap_remove(i);
                for e in p.events {
                    pool.recycle_event(e);
                }
                st.unhold_free(p.addr, p.len);
                emptied.push(st.region_of(p.addr));
                s.harvested += 1;
            } else {
                i += 1;
            }
        }
        // Emptied by frees, not by a pass: cached like any freed memory
        // (trim and the idle release give it back), so that a loop whose
        // steps free and allocate movable blocks makes no driver call.
        for base in emptied {
            if st.drop_if_empty(base) {
                pool.free_region(base, false);
                s.regions_released += 1;
            }
        }
    }
    if st.pass.as_ref().is_some_and(|p| pool.event_done(p.done)) {
        let c = commit(pool, st);
        s.blocks_moved = c.blocks_moved;
        s.bytes_moved = c.bytes_moved;
        s.cancelled = c.cancelled;
        s.regions_released += c.regions_released;
        s.committed = true;
    }
    s
}

/// Commits the in-flight pass; its completion event must have completed
/// (or the compaction stream been synchronized).
///
/// For each move: if the block is still live, of the same generation and
/// still marked with this pass (no pin cancelled it, no free came), its
/// handle takes the destination and the source range is freed; otherwise
/// the destination is freed. Both are clean: the copy completed, and the
/// block's last uses completed before it (the compaction stream waited on
/// them). Then the source regions reopen, and those left empty go back to
/// the heap.
pub(crate) fn commit(pool: &PoolShared, st: &mut ArenaState) -> Serviced {
    let pass = st.pass.take().expect("a pass in flight");
    let mut s = Serviced {
        committed: true,
        ..Default::default()
    };
    for m in &pass.moves {
        let e = &mut st.entries[m.handle as usize];
        if e.live && e.gen == m.gen && e.moving == Some(pass.id) {
            for (_, ev) in e.last_use.drain(..) {
                pool.recycle_event(ev);
            }
            st.relocate(m.handle, m.dst);
            s.blocks_moved += 1;
            s.bytes_moved += m.len;
        } else {
            st.release_dst(m.dst, m.len);
            s.cancelled += 1;
        }
    }
    pool.recycle_event(pass.done);
    for &base in &pass.sources {
        st.set_evacuating(base, false);
    }
    // The sources, and destinations whose last hold was a cancelled move.
    let mut touched: Vec<u64> = pass.sources.clone();
    touched.extend(pass.moves.iter().map(|m| st.region_of(m.dst)));
    touched.sort_unstable();
    touched.dedup();
    for base in touched {
        if st.drop_if_empty(base) {
            pool.free_region(base, pass.release);
            s.regions_released += 1;
        }
    }
    let t = &mut st.totals;
    t.passes += 1;
    t.blocks_moved += s.blocks_moved;
    t.bytes_moved += s.bytes_moved;
    t.cancelled += s.cancelled;
    t.regions_released += s.regions_released;
    tracing::debug!(
        device = pool.dev(),
        pass = pass.id,
        blocks = s.blocks_moved,
        bytes = s.bytes_moved,
        cancelled = s.cancelled,
        regions = s.regions_released,
        micros = pass.started.elapsed().as_micros() as u64,
        "compaction pass committed"
    );
    s
}

/// What [`start`] enqueued.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Started {
    pub blocks: u64,
    pub bytes: u64,
}

/// Plans a pass and enqueues it: the compaction stream waits on every
/// moved block's last-use events (device side), runs the batch as one
/// `enqueue_moves`, and records the completion event. `None` when there is
/// nothing to move or a pass is already in flight.
pub(crate) fn start(
    pool: &PoolShared,
    st: &mut ArenaState,
    budget: Budget,
    release: bool,
) -> Result<Option<Started>> {
    if st.pass.is_some() {
        return Ok(None);
    }
    let id = st.next_pass;
    let plan = planner::plan(st, budget, id);
    if plan.moves.is_empty() {
        return Ok(None);
    }
    st.next_pass += 1;
    match enqueue(pool, st, &plan) {
        Ok(done) => {
            let started = Started {
                blocks: plan.moves.len() as u64,
                bytes: plan.bytes(),
            };
            st.pass = Some(super::arena::InFlight {
                id,
                moves: plan.moves,
                sources: plan.sources,
                done,
                started: std::time::Instant::now(),
                release,
            });
            Ok(Some(started))
        }
        Err(e) => {
            planner::undo(st, &plan, id);
            Err(e)
        }
    }
}

fn enqueue(
    pool: &PoolShared,
    st: &mut ArenaState,
    plan: &planner::Plan,
) -> Result<crate::ptr::EventHandle> {
    let be = pool.be();
    let dev = pool.dev();
    let stream = match st.stream {
        Some(s) => s,
        None => {
            let s = be.create_stream(dev)?;
            st.stream = Some(s);
            s
        }
    };
    for m in &plan.moves {
        for &(_, ev) in &st.entries[m.handle as usize].last_use {
            be.stream_wait_event(dev, stream, ev)?;
        }
    }
    let moves: Vec<Move> = plan
        .moves
        .iter()
        .map(|m| Move {
            src: DevicePtr(m.src),
            dst: DevicePtr(m.dst),
            len: m.len,
        })
        .collect();
    be.enqueue_moves(dev, stream, &moves)?;
    match pool.record_event_on_own(stream) {
        Ok(ev) => Ok(ev),
        Err(e) => {
            // The moves are queued but their end cannot be observed: wait
            // for the stream on the host (an error path only) and hand out
            // a fresh, never-recorded event, which counts as complete.
            tracing::warn!(device = dev, "recording the compaction event failed: {e}");
            be.sync_stream(dev, stream)?;
            be.create_event(dev)
        }
    }
}

/// Blocks the host until `ev` completed (the explicit `compact()` with
/// `wait`, called without the arena lock). The event may have been
/// recycled meanwhile; waiting on its new capture is only a longer wait.
pub(crate) fn sync_pass(pool: &PoolShared, ev: crate::ptr::EventHandle) -> Result<()> {
    pool.be().sync_event(pool.dev(), ev)
}

/// Adds a freed block's range to the pending list, or frees it now when
/// nothing could still use it.
pub(crate) fn release_or_park(pool: &PoolShared, st: &mut ArenaState, p: PendingFree) {
    if p.events.is_empty() && p.unrecorded.is_empty() {
        st.unhold_free(p.addr, p.len);
        let base = st.region_of(p.addr);
        // Emptied by a free: cached (see `service`).
        if st.drop_if_empty(base) {
            pool.free_region(base, false);
        }
    } else {
        st.pending.push(p);
    }
}

/// Host-synchronizes every pending free and the in-flight pass, then
/// services (for `trim` and teardown).
pub(crate) fn sync_all(pool: &PoolShared, st: &mut ArenaState) -> Serviced {
    let be = pool.be();
    for p in &mut st.pending {
        for &e in &p.events {
            let _ = be.sync_event(pool.dev(), e);
        }
        for s in std::mem::take(&mut p.unrecorded) {
            if !s.is_dead() {
                let _ = be.sync_stream(pool.dev(), s.handle);
            }
        }
    }
    if let Some(p) = &st.pass {
        let _ = be.sync_event(pool.dev(), p.done);
    }
    let mut s = service(pool, st);
    let empty: Vec<u64> = st
        .regions
        .iter()
        .filter(|(_, r)| r.live == 0 && r.held == 0)
        .map(|(&b, _)| b)
        .collect();
    // To the heap; trim releases it next (teardown releases everything).
    for base in empty {
        if st.drop_if_empty(base) {
            pool.free_region(base, false);
            s.regions_released += 1;
        }
    }
    s
}
