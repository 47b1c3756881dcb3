//! Frees that wait on events before their memory may be reused by any stream.
//!
//! A record is created when a block used on several streams is freed
//! (`record_stream`), when a stream's dirty slots are flushed so that other
//! streams can use them, and when a stream goes away. Records sit on a
//! lock-free queue; harvesting pops each once, queries its events without
//! blocking, and releases the memory if all completed or pushes it back.

use crate::ptr::EventHandle;

/// What a pending record holds back.
#[derive(Debug)]
pub(crate) enum Pending {
    /// Small slots of one class, waiting on `events`.
    Slots {
        /// Size class.
        class: u16,
        /// Slot indices.
        slots: Vec<u32>,
        /// What must complete first.
        waits: Waits,
        /// Slot bytes held back.
        bytes: u64,
    },
    /// Heap ranges of pending group `id`; its events are kept with the heap
    /// (under the heap lock) so that a handover can read them.
    Group {
        /// The heap's pending group id.
        id: u32,
    },
}

/// What a pending record waits for.
#[derive(Debug, Clone, Default)]
pub(crate) struct Waits {
    /// Events recorded at the free, one per stream that used the memory.
    pub events: Vec<EventHandle>,
    /// Streams whose event could not be recorded: only a host sync of the
    /// stream (in `trim`) can release the memory.
    pub unrecorded: Vec<crate::ptr::StreamHandle>,
}
