//! Blocks and block pools of the PyTorch port: PyTorch's `Block` (a range of
//! a segment, linked to its neighbours) and `BlockPool` (free blocks ordered
//! by stream, size and address for best fit, plus the unmapped ranges of
//! expandable segments ordered by stream and address).
//!
//! Invariants:
//! - A block id is live from [`Arena::insert`] to [`Arena::remove`]; the
//!   `prev`/`next` links of live blocks name live blocks, and `a.next ==
//!   Some(b)` exactly when `b.prev == Some(a)`; linked blocks are adjacent
//!   (`a.addr + a.size == b.addr`) and share stream, pool and segment.
//! - A free, mapped block is in its pool's `blocks` under its current
//!   `(stream, size, addr)` and nowhere else; a free, unmapped block is in
//!   its pool's `unmapped` under `(stream, addr)`; an allocated block is in
//!   neither (callers take a block out of its set before changing its size
//!   or address, and put it back after).

use std::collections::BTreeMap;

/// Index of a block in the [`Arena`].
pub(super) type Id = usize;

/// PyTorch's `Block`.
#[derive(Debug, Clone)]
pub(super) struct Block {
    pub addr: u64,
    pub size: u64,
    /// Bytes asked for (allocated blocks only).
    pub requested: u64,
    pub stream: u64,
    /// In the small pool (else the large one).
    pub small: bool,
    pub allocated: bool,
    /// Backed by physical memory; false only for the unmapped ranges of
    /// expandable segments.
    pub mapped: bool,
    pub prev: Option<Id>,
    pub next: Option<Id>,
    /// The expandable segment holding the block (index into the
    /// allocator's segment slots), if any.
    pub expandable: Option<usize>,
    /// The pool's `get_free_blocks_call_count` when the block was last put
    /// in the pool (garbage collection ages blocks by it).
    pub gc_count_base: u64,
    /// Other streams the allocated block was used on (`record_stream`).
    pub stream_uses: Vec<u64>,
    /// Events a freed block still waits for before it rejoins its pool.
    pub event_count: u32,
}

impl Block {
    pub(super) fn new(addr: u64, size: u64, stream: u64, small: bool) -> Self {
        Block {
            addr,
            size,
            requested: 0,
            stream,
            small,
            allocated: false,
            mapped: true,
            prev: None,
            next: None,
            expandable: None,
            gc_count_base: 0,
            stream_uses: Vec::new(),
            event_count: 0,
        }
    }

    /// Whether the block is part of a split segment (`is_split`).
    pub(super) fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }
}

/// Storage for blocks, with ids reused after removal.
#[derive(Debug, Clone, Default)]
pub(super) struct Arena {
    slots: Vec<Option<Block>>,
    vacant: Vec<Id>,
}

impl Arena {
    pub(super) fn insert(&mut self, b: Block) -> Id {
        match self.vacant.pop() {
            Some(id) => {
                self.slots[id] = Some(b);
                id
            }
            None => {
                self.slots.push(Some(b));
                self.slots.len() - 1
            }
        }
    }

    pub(super) fn remove(&mut self, id: Id) -> Block {
        let b = self.slots[id].take().expect("removing a dead block");
        self.vacant.push(id);
        b
    }

    pub(super) fn contains(&self, id: Id) -> bool {
        self.slots.get(id).is_some_and(Option::is_some)
    }

    /// Live blocks with their ids.
    pub(super) fn iter(&self) -> impl Iterator<Item = (Id, &Block)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, b)| b.as_ref().map(|b| (i, b)))
    }
}

impl std::ops::Index<Id> for Arena {
    type Output = Block;
    fn index(&self, id: Id) -> &Block {
        self.slots[id].as_ref().expect("dead block")
    }
}

impl std::ops::IndexMut<Id> for Arena {
    fn index_mut(&mut self, id: Id) -> &mut Block {
        self.slots[id].as_mut().expect("dead block")
    }
}

/// Best-fit key of a free block: PyTorch's `BlockComparatorSize`.
pub(super) type SizeKey = (u64, u64, u64);

/// PyTorch's `BlockPool`.
#[derive(Debug, Clone)]
pub(super) struct BlockPool {
    pub small: bool,
    /// Free mapped blocks by `(stream, size, addr)`.
    pub blocks: BTreeMap<SizeKey, Id>,
    /// Free unmapped ranges of expandable segments by `(stream, addr)`.
    pub unmapped: BTreeMap<(u64, u64), Id>,
    /// Best-fit searches so far, counted only while garbage collection is
    /// on (PyTorch's `get_free_blocks_call_count`).
    pub get_free_blocks_call_count: u64,
}

impl BlockPool {
    pub(super) fn new(small: bool) -> Self {
        BlockPool {
            small,
            blocks: BTreeMap::new(),
            unmapped: BTreeMap::new(),
            get_free_blocks_call_count: 0,
        }
    }

    pub(super) fn key(b: &Block) -> SizeKey {
        (b.stream, b.size, b.addr)
    }

    /// `insert_into_blocks`: adds a free mapped block and restarts its age.
    pub(super) fn insert(&mut self, arena: &mut Arena, id: Id) {
        let b = &mut arena[id];
        debug_assert!(!b.allocated && b.mapped && b.small == self.small);
        b.gc_count_base = self.get_free_blocks_call_count;
        let prior = self.blocks.insert(Self::key(b), id);
        debug_assert!(prior.is_none(), "block inserted twice");
    }

    /// Takes a free mapped block out of `blocks`.
    pub(super) fn erase(&mut self, arena: &Arena, id: Id) {
        let removed = self.blocks.remove(&Self::key(&arena[id]));
        debug_assert_eq!(removed, Some(id), "block was not in its pool");
    }

    pub(super) fn insert_unmapped(&mut self, arena: &Arena, id: Id) {
        let b = &arena[id];
        debug_assert!(!b.mapped);
        let prior = self.unmapped.insert((b.stream, b.addr), id);
        debug_assert!(prior.is_none());
    }

    pub(super) fn erase_unmapped(&mut self, arena: &Arena, id: Id) {
        let b = &arena[id];
        let removed = self.unmapped.remove(&(b.stream, b.addr));
        debug_assert_eq!(removed, Some(id));
    }
}
