//! PyTorch's `record_stream` in the port: frees deferred behind CUDA
//! events (`recordStream`, `insert_events`, `process_events`,
//! `synchronize_and_free_events` of `CUDACachingAllocator.cpp`).
//!
//! A block used on streams besides its own is freed with one event
//! recorded on each of those streams; it rejoins its pool (and may merge)
//! when all of them completed. Every `malloc` first queries each stream's
//! oldest events in order, up to the first not complete; on the way to out
//! of memory every outstanding event is synchronized.
//!
//! The events are the caller's ([`StreamEvents`]): the stress peer records
//! them on the simulator's streams, so they complete when the streams'
//! work does. Each call is counted as the driver call PyTorch makes
//! (`cudaEventRecord`, `cudaEventQuery`, `cudaEventSynchronize`, and
//! `cudaEventCreate` the first time the event pool is empty).
//!
//! Invariants: a freed block with `event_count > 0` is in no pool and not
//! in `active`; it appears in `cuda_events` exactly `event_count` times;
//! an event is either in `cuda_events` or in `event_pool`, never both.

use super::blocks::Id;
use super::TorchAllocator;
use gpupool::backend::Call;
use gpupool::{Error, Result};

/// The CUDA events of the streams a port runs beside.
pub trait StreamEvents {
    /// A new event (`cudaEventCreate`).
    fn create(&self) -> Result<u64>;
    /// Records `event` on `stream` (`cudaEventRecord`).
    fn record(&self, event: u64, stream: u64) -> Result<()>;
    /// Whether `event` completed (`cudaEventQuery`).
    fn query(&self, event: u64) -> Result<bool>;
    /// Blocks until `event` completed (`cudaEventSynchronize`).
    fn synchronize(&self, event: u64) -> Result<()>;
}

impl TorchAllocator {
    /// `recordStream`: the block at `addr` is also used on `stream`.
    pub fn record_stream(&mut self, addr: u64, stream: u64) -> Result<()> {
        let id = self.active_block(addr)?;
        let b = &mut self.arena[id];
        if stream != b.stream && !b.stream_uses.contains(&stream) {
            b.stream_uses.push(stream);
        }
        Ok(())
    }

    /// Freed blocks still waiting on events.
    pub fn blocks_behind_events(&self) -> usize {
        self.cuda_events.values().map(|q| q.len()).sum()
    }

    /// `insert_events`: one event on each stream the freed block `id` was
    /// used on.
    pub(super) fn insert_events(&mut self, id: Id, events: &dyn StreamEvents) -> Result<()> {
        let uses = std::mem::take(&mut self.arena[id].stream_uses);
        for stream in uses {
            let ev = match self.event_pool.pop() {
                Some(e) => e,
                None => {
                    self.device.counter.count(Call::EventCreate, None);
                    events.create()?
                }
            };
            self.device.counter.count(Call::EventRecord, None);
            events.record(ev, stream)?;
            self.arena[id].event_count += 1;
            self.cuda_events
                .entry(stream)
                .or_default()
                .push_back((ev, id));
        }
        Ok(())
    }

    /// `process_events`: per stream, the oldest events up to the first not
    /// complete; a block whose last event completed rejoins its pool.
    pub(super) fn process_events(&mut self, events: &dyn StreamEvents) -> Result<()> {
        if self.cuda_events.is_empty() {
            return Ok(());
        }
        let streams: Vec<u64> = self.cuda_events.keys().copied().collect();
        for stream in streams {
            while let Some(&(ev, id)) = self.cuda_events.get(&stream).and_then(|q| q.front()) {
                self.device.counter.count(Call::EventQuery, None);
                if !events.query(ev)? {
                    break;
                }
                self.event_done(stream, ev, id);
            }
        }
        Ok(())
    }

    /// `synchronize_and_free_events`: waits for every outstanding event
    /// and gives every block back (the way to out of memory).
    pub(super) fn synchronize_and_free_events(&mut self, events: &dyn StreamEvents) -> Result<()> {
        let streams: Vec<u64> = self.cuda_events.keys().copied().collect();
        for stream in streams {
            while let Some(&(ev, id)) = self.cuda_events.get(&stream).and_then(|q| q.front()) {
                self.device.counter.count(Call::EventSynchronize, None);
                events.synchronize(ev)?;
                self.event_done(stream, ev, id);
            }
        }
        Ok(())
    }

    /// The front event of `stream`'s queue completed.
    fn event_done(&mut self, stream: u64, ev: u64, id: Id) {
        if let Some(q) = self.cuda_events.get_mut(&stream) {
            q.pop_front();
            if q.is_empty() {
                self.cuda_events.remove(&stream);
            }
        }
        self.event_pool.push(ev);
        let b = &mut self.arena[id];
        b.event_count -= 1;
        if b.event_count == 0 {
            self.free_block(id);
        }
    }

    fn active_block(&self, addr: u64) -> Result<Id> {
        self.active_id(addr).ok_or(Error::UnknownPointer {
            ptr: addr,
            device: 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::peers::{PeerAllocator, TorchConfig};
    use std::cell::RefCell;

    /// Events that complete when the test says so.
    #[derive(Default)]
    struct Manual {
        done: RefCell<Vec<bool>>,
        recorded: RefCell<Vec<(u64, u64)>>,
    }

    impl StreamEvents for Manual {
        fn create(&self) -> Result<u64> {
            let mut d = self.done.borrow_mut();
            d.push(false);
            Ok(d.len() as u64 - 1)
        }
        fn record(&self, event: u64, stream: u64) -> Result<()> {
            self.done.borrow_mut()[event as usize] = false;
            self.recorded.borrow_mut().push((event, stream));
            Ok(())
        }
        fn query(&self, event: u64) -> Result<bool> {
            Ok(self.done.borrow()[event as usize])
        }
        fn synchronize(&self, event: u64) -> Result<()> {
            self.done.borrow_mut()[event as usize] = true;
            Ok(())
        }
    }

    #[test]
    fn a_recorded_block_is_reused_only_after_its_event_completes() {
        let ev = Manual::default();
        let mut t = TorchAllocator::new(TorchConfig::default());
        let a = t.malloc_with_events(4096, 1, &ev).expect("first");
        t.record_stream(a, 2).expect("live");
        t.record_stream(a, 1).expect("its own stream adds nothing");
        t.free_with_events(a, &ev).expect("free");
        assert_eq!(*ev.recorded.borrow(), vec![(0, 2)]);
        assert_eq!(t.blocks_behind_events(), 1);
        // The event has not completed: the same request gets another block.
        let b = t.malloc_with_events(4096, 1, &ev).expect("second");
        assert_ne!(a, b);
        ev.done.borrow_mut()[0] = true;
        t.free_with_events(b, &ev).expect("free b");
        let c = t.malloc_with_events(4096, 1, &ev).expect("third");
        assert_eq!(t.blocks_behind_events(), 0);
        assert!(c == a || c == b, "a block came back to the pool");
        let calls = t.driver_calls();
        assert_eq!(calls.get("cuEventRecord"), Some(&1));
        assert_eq!(calls.get("cuEventCreate"), Some(&1));
        assert!(calls.get("cuEventQuery").is_some_and(|&q| q >= 2));
        // The event went back to the pool: the next record reuses it.
        t.record_stream(c, 3).expect("live");
        t.free_with_events(c, &ev).expect("free c");
        assert_eq!(ev.recorded.borrow().last(), Some(&(0, 3)));
    }

    #[test]
    fn a_plain_free_of_a_recorded_block_is_refused() {
        let mut t = TorchAllocator::new(TorchConfig::default());
        let a = t.malloc(4096, 1).expect("alloc");
        t.record_stream(a, 2).expect("live");
        assert!(t.free(a).is_err());
        assert!(t.record_stream(a + 512, 2).is_err(), "not a block");
    }

    #[test]
    fn out_of_memory_waits_for_the_events_first() {
        let ev = Manual::default();
        let cfg = TorchConfig {
            capacity_bytes: 64 << 20,
            ..TorchConfig::default()
        };
        let mut t = TorchAllocator::new(cfg);
        let a = t.malloc_with_events(40 << 20, 1, &ev).expect("first");
        t.record_stream(a, 2).expect("live");
        t.free_with_events(a, &ev).expect("free");
        // Only the block behind the event could serve this: PyTorch
        // synchronizes the event instead of failing.
        t.malloc_with_events(40 << 20, 1, &ev)
            .expect("served after the sync");
        assert_eq!(t.driver_calls().get("cuEventSynchronize"), Some(&1));
        assert_eq!(t.blocks_behind_events(), 0);
    }
}
