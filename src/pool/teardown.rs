//! The end of a pool: every byte of device memory given back whatever
//! still refers to the pool (streams, other threads' caches, raw pointers),
//! after a host wait for the work of every stream it knows. Afterwards the
//! pool makes no driver call.

use super::*;

impl PoolShared {
    /// Gives every byte of device memory back, whatever still refers to the
    /// pool: waits (on the host) for the work of every stream the pool
    /// knows, so that no kernel still runs on memory about to be unmapped
    /// (raw pointers included), waits for pending frees, unmaps and releases
    /// all physical memory, destroys the pool's events and the streams it
    /// made, and drops the streams recorded for live blocks. Idempotent;
    /// afterwards the pool makes no driver call.
    pub(super) fn teardown(&self) {
        use std::sync::atomic::Ordering::{AcqRel, Release};
        self.flags.set(super::PoolFlags::SHUT, true, Release);
        // Streams that retire from now on (other threads' caches) skip
        // their flush: everything is waited for below.
        if self.torn_down.swap(true, AcqRel) {
            return;
        }
        let _gate = self.maint_gate.lock();
        for core in self.streams.live_cores() {
            let foreign_thread = core
                .thread
                .is_some_and(|t| t != std::thread::current().id());
            if !core.is_dead() && !foreign_thread {
                if let Err(e) = self.backend.sync_stream(self.dev, core.handle) {
                    tracing::warn!(device = self.dev, "teardown: stream sync failed: {e}");
                }
            }
        }
        if let Err(e) = self.backend.sync_stream(self.dev, StreamHandle(0)) {
            tracing::warn!(
                device = self.dev,
                "teardown: default stream sync failed: {e}"
            );
        }
        self.movable.teardown(self);
        let _ = self.sync_pending();
        // Slots returning to live streams wait on other streams' events,
        // which may belong to streams already gone.
        for e in self.returning.drain_all() {
            let _ = self.host_sync_waits(&e.waits);
            self.recycle_events(e.waits);
            self.counters.pending_slot_bytes.fetch_sub(
                self.slabs.classes.size_of(e.class as usize),
                std::sync::atomic::Ordering::Relaxed,
            );
        }
        self.drain_probes();
        self.plan_teardown();
        let recorded = std::mem::take(&mut *self.recorded_streams.lock());
        self.recorded_entries
            .store(0, std::sync::atomic::Ordering::Release);
        let tagged = self.tags.clear();
        for (_, t) in std::mem::take(&mut *self.tombs.lock()) {
            if let Some((w, _)) = t.waits {
                self.recycle_events(w);
            }
        }
        self.close_all_imports();
        {
            let mut h = self.heap.lock();
            h.heap.teardown();
            self.by_stream.clear();
            for p in self.take_pending_records() {
                match p {
                    Pending::Slots { waits, .. } | Pending::Classes { waits, .. } => {
                        self.recycle_events(waits)
                    }
                    Pending::Group { .. } => {}
                }
            }
            for (_, w) in h.group_events.drain() {
                self.recycle_events(w);
            }
        }
        for e in self.events.drain() {
            let _ = self.backend.destroy_event(self.dev, e);
        }
        let captured = self.capture.clear();
        let private = self.private.clear();
        let killed = self.streams.kill_owned();
        // Dropped last: no core of an owned stream calls the driver now.
        drop(captured);
        drop(private);
        drop(recorded);
        drop(tagged);
        tracing::debug!(
            device = self.dev,
            streams_destroyed = killed,
            "pool torn down"
        );
    }
}

impl Drop for PoolShared {
    fn drop(&mut self) {
        self.teardown();
    }
}
