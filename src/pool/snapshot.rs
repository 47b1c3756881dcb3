//! Snapshots of a pool's memory, in the shape of PyTorch's
//! `torch.cuda.memory._snapshot()` (segments holding blocks), plus the
//! optional history of allocation events.

/// State of one block in a snapshot (PyTorch's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockState {
    /// A live allocation.
    ActiveAllocated,
    /// Freed, waiting for its last uses to complete.
    ActivePendingFree,
    /// Free and reusable.
    Inactive,
}

/// One block of a segment.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct BlockInfo {
    /// Device address.
    pub address: u64,
    /// Bytes the block spans (slot or range size).
    pub size: u64,
    /// Bytes asked for (0 for free blocks).
    pub requested_size: u64,
    /// Allocated, pending or free.
    pub state: BlockState,
}

/// One segment: a run of backed device memory.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SegmentInfo {
    /// Device index.
    pub device: usize,
    /// First address.
    pub address: u64,
    /// Bytes of device memory in the segment.
    pub total_size: u64,
    /// Bytes of live blocks (rounded).
    pub allocated_size: u64,
    /// Bytes asked for by live blocks.
    pub requested_size: u64,
    /// `"small"` for a size-class slab, `"large"` otherwise.
    pub segment_type: &'static str,
    /// Slot size for slabs, 0 for large segments.
    pub slot_size: u64,
    /// Blocks in address order, covering the segment.
    pub blocks: Vec<BlockInfo>,
}

/// What a history event records (PyTorch's trace actions).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HistoryAction {
    /// A block was allocated.
    Alloc,
    /// A block was freed by its owner (its memory may still be pending).
    FreeRequested,
}

/// One event of the allocation history.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct HistoryEvent {
    /// What happened.
    pub action: HistoryAction,
    /// Block address.
    pub addr: u64,
    /// Requested bytes.
    pub size: u64,
    /// Stream handle of the call.
    pub stream: u64,
    /// Microseconds since the pool started recording.
    pub time_us: u64,
}

/// A pool's memory at one moment.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Snapshot {
    /// Device index.
    pub device: usize,
    /// Segments in address order.
    pub segments: Vec<SegmentInfo>,
    /// Statistics at the same moment.
    pub stats: super::PoolStats,
    /// Events recorded since history recording was turned on.
    pub history: Vec<HistoryEvent>,
}
