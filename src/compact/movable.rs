//! `MovableBlock` and `Pinned`: the handle whose address a compaction pass
//! may change, and the pin that holds it in place for one stream.

use super::arena::{PendingFree, UNIT};
use super::{arena_of, pass};
use crate::error::Result;
use crate::pool::{DevicePool, Kind, Stream, StreamCore};
use crate::ptr::DevicePtr;
use parking_lot::Mutex;
use std::fmt;
use std::sync::{Arc, OnceLock};

/// Where a movable block's memory is.
#[derive(Debug, Clone, Copy)]
enum Place {
    /// In the movable arena: entry `id` of generation `gen`.
    Arena { id: u32, gen: u32, len: u64 },
    /// Too large for the arena: an ordinary block that never moves.
    Fixed { ptr: DevicePtr, kind: Kind },
}

/// A device allocation that compaction may move. It has no stable address:
/// [`MovableBlock::pin`] gives the current one and keeps the block in place
/// until the pinning stream passes the pin's release. Dropping it frees the
/// memory after every use made under a pin and after the work enqueued so
/// far on its stream and on streams passed to
/// [`MovableBlock::record_stream`]; the host never waits.
pub struct MovableBlock<'a> {
    pool: &'a DevicePool,
    stream: &'a Stream,
    size: usize,
    place: Place,
    extra: ExtraStreams,
}

/// A pinned movable block: its address is valid, and the block stays put,
/// for the work enqueued on the pin's stream until the `Pinned` is dropped.
/// Dropping records an event on that stream; no pass moves the block
/// before the event completes (the compaction stream waits on it on the
/// device).
pub struct Pinned<'b> {
    block: &'b MovableBlock<'b>,
    stream: &'b Stream,
    ptr: DevicePtr,
}

impl DevicePool {
    /// Allocates `size` bytes that compaction may move. Requests up to a
    /// quarter of a region (512 KiB with 2 MiB granules) live in the movable
    /// arena; larger ones are ordinary blocks that never move. Errors as
    /// [`DevicePool::alloc`] does.
    pub fn alloc_movable<'a>(
        &'a self,
        size: usize,
        stream: &'a Stream,
    ) -> Result<MovableBlock<'a>> {
        let shared = self.shared();
        shared.check_request(size as u64, stream)?;
        let len = (size as u64).div_ceil(UNIT) * UNIT;
        let arena = arena_of(shared);
        let max = arena.lock().max_block();
        let place = if len > max {
            let (ptr, kind) = shared.alloc_plain(size as u64, stream)?;
            Place::Fixed { ptr, kind }
        } else {
            let mut st = arena.lock();
            pass::service(shared, &mut st);
            let (id, gen) = match st.alloc_block(len) {
                Some(h) => h,
                None => {
                    let base = shared.alloc_region(st.region_bytes)?;
                    st.add_region(base);
                    st.alloc_block(len).expect("a new region fits a block")
                }
            };
            drop(st);
            shared.count_alloc(size as u64, len);
            Place::Arena { id, gen, len }
        };
        Ok(MovableBlock {
            pool: self,
            stream,
            size,
            place,
            extra: ExtraStreams::default(),
        })
    }
}

impl<'a> MovableBlock<'a> {
    /// The requested size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The stream the block was allocated on.
    pub fn stream(&self) -> &Stream {
        self.stream
    }

    /// Whether compaction can move this block (false for requests too
    /// large for the movable arena).
    pub fn is_movable(&self) -> bool {
        matches!(self.place, Place::Arena { .. })
    }

    /// Marks the block as used on `stream` too: its free waits for the work
    /// enqueued there up to the free. A stream of another device is ignored
    /// with a warning.
    pub fn record_stream(&self, stream: &Stream) {
        self.extra.record(self.stream, stream);
    }

    /// Pins the block for work on `stream` and returns its current address.
    /// If a pass in flight is moving the block, the pin cancels that move:
    /// the block stays where it is. Work enqueued on `stream` while the pin
    /// is held may use the address; after the pin is dropped, only work
    /// enqueued before the drop may still run on the old address, and no
    /// pass moves the block before that work completed.
    pub fn pin<'b>(&'b self, stream: &'b Stream) -> Pinned<'b> {
        let ptr = match self.place {
            Place::Fixed { ptr, .. } => ptr,
            Place::Arena { id, gen, .. } => {
                let mut st = arena_of(self.pool.shared()).lock();
                let e = st.entry(id, gen);
                e.pins += 1;
                let cancelled = e.moving.take().is_some();
                let addr = e.addr;
                drop(st);
                if cancelled {
                    tracing::trace!(addr, "pin cancelled a planned move");
                }
                DevicePtr(addr)
            }
        };
        Pinned {
            block: self,
            stream,
            ptr,
        }
    }

    fn unpin(&self, stream: &Stream) {
        let shared = self.pool.shared();
        match self.place {
            Place::Fixed { .. } => self.record_stream(stream),
            Place::Arena { id, gen, .. } => {
                // A stream of another pool cannot be recorded on here: its
                // use counts as unrecorded (the block stops moving).
                let ev = if shared.owns_stream(stream) {
                    shared.record_event_on(stream.core()).ok()
                } else {
                    None
                };
                let mut st = arena_of(shared).lock();
                let e = st.entry(id, gen);
                e.pins -= 1;
                let h = stream.handle();
                match ev {
                    Some(ev) => {
                        // Stream order: the new event covers the older one.
                        let old = match e.last_use.iter_mut().find(|(s, _)| *s == h) {
                            Some(slot) => Some(std::mem::replace(&mut slot.1, ev)),
                            None => {
                                e.last_use.push((h, ev));
                                None
                            }
                        };
                        drop(st);
                        if let Some(old) = old {
                            shared.recycle_event(old);
                        }
                    }
                    None => {
                        if !e.unrecorded.iter().any(|c| Arc::ptr_eq(c, stream.core())) {
                            e.unrecorded.push(stream.core().clone());
                        }
                    }
                }
            }
        }
    }
}

impl Drop for MovableBlock<'_> {
    fn drop(&mut self) {
        let shared = self.pool.shared();
        let extra = self.extra.take();
        match self.place {
            Place::Fixed { ptr, kind } => {
                shared.free_block(ptr, kind, self.size as u64, self.stream, &extra)
            }
            Place::Arena { id, len, .. } => {
                let mut st = arena_of(shared).lock();
                let (addr, l, mut events, mut unrecorded) = st.free_block(id);
                debug_assert_eq!(l, len);
                // Work on the block's own and recorded streams counts as a
                // use if anything ever pinned it (else no work could have
                // had its address).
                if !events.is_empty() || !unrecorded.is_empty() || !extra.is_empty() {
                    for s in std::iter::once(self.stream.core()).chain(&extra) {
                        match shared.record_event_on(s) {
                            Ok(ev) => events.push(ev),
                            Err(_) => unrecorded.push(s.clone()),
                        }
                    }
                }
                pass::release_or_park(
                    shared,
                    &mut st,
                    PendingFree {
                        addr,
                        len,
                        events,
                        unrecorded,
                    },
                );
                drop(st);
                shared.count_free(self.size as u64, len);
            }
        }
    }
}

impl Pinned<'_> {
    /// The block's device address, valid for work on the pin's stream.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// The stream the pin is for.
    pub fn stream(&self) -> &Stream {
        self.stream
    }
}

impl Drop for Pinned<'_> {
    fn drop(&mut self) {
        self.block.unpin(self.stream);
    }
}

impl fmt::Debug for MovableBlock<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MovableBlock")
            .field("device", &self.pool.device())
            .field("size", &self.size)
            .field("movable", &self.is_movable())
            .field("stream", &self.stream.handle())
            .finish()
    }
}

impl fmt::Debug for Pinned<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pinned")
            .field("ptr", &self.ptr)
            .field("stream", &self.stream.handle())
            .finish()
    }
}

/// The streams other than its own that used a movable block
/// (`record_stream`). Rare, so the list is allocated on the first record:
/// an unused one is two words (a once flag and an empty box). (A plain
/// [`crate::Block`] keeps its list in the pool's table instead: its
/// address never changes.)
#[derive(Default)]
struct ExtraStreams(OnceLock<Box<Mutex<Vec<Arc<StreamCore>>>>>);

impl ExtraStreams {
    /// Adds `stream` once if `own`, the block's stream, [`Stream::records`]
    /// it.
    fn record(&self, own: &Stream, stream: &Stream) {
        if !own.records(stream) {
            return;
        }
        let mut e = self.0.get_or_init(Box::default).lock();
        if !e.iter().any(|c| Arc::ptr_eq(c, stream.core())) {
            e.push(stream.core().clone());
        }
    }

    /// The recorded streams, leaving none (for a free that moves them).
    fn take(&mut self) -> Vec<Arc<StreamCore>> {
        self.0.take().map(|m| m.into_inner()).unwrap_or_default()
    }
}
