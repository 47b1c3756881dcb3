//! Simulated device memory: physical chunks in a memfd, virtual ranges
//! reserved with `mmap(PROT_NONE)` and mapped with `mmap(MAP_FIXED|MAP_SHARED)`.
//!
//! Device addresses are real host addresses, so the pool's stitching code
//! runs for real: mapping one chunk at two addresses shows the same bytes at
//! both. Every access by simulated work (kernels, moves, copies) is checked
//! against the mapping table first; an access outside mapped memory becomes a
//! recorded device fault (CUDA's `CUDA_ERROR_ILLEGAL_ADDRESS`) instead of a
//! crash of the test process.
//!
//! In accounting mode ([`SimBacking::Accounting`]) nothing is backed: chunks
//! are byte counts, addresses come from a counter, and work on memory is a
//! no-op. That mode replays traces of tens of GB.

use super::SimBacking;
use crate::error::{Error, Result};
use crate::ptr::ChunkHandle;
use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;

/// One physical chunk.
#[derive(Debug)]
struct Chunk {
    /// Offset in the device's memfd.
    file_offset: u64,
    len: u64,
    /// Live mappings of (parts of) this chunk.
    maps: u32,
    /// `cuMemRelease` was called; freed once `maps` reaches zero (CUDA's rule).
    released: bool,
    /// For a chunk imported from another process: the file holding its
    /// bytes (at `file_offset`), instead of this device's memfd. Its
    /// memory is the exporter's: not counted in `used`.
    import: Option<Arc<OwnedFd>>,
    /// Exported to another process, which may map its file range after
    /// this side released it: the range is never reused.
    exported: bool,
}

/// The live chunks by handle: a slab indexed by the handle's low 32 bits
/// (slot + 1, so no handle is 0), with the slot's generation in the high 32
/// bits. Mapping and unmapping look a chunk up per granule, and an index
/// costs less than a hash lookup; the generation keeps a stale handle (its
/// chunk released, its slot reused) invalid, as the driver's is. Fresh
/// slots start at generation 0, so a device's first handles are 1, 2, ...
#[derive(Debug, Default)]
struct ChunkTable {
    slots: Vec<ChunkSlot>,
    /// Slots without a chunk, reused last freed first.
    free: Vec<u32>,
}

#[derive(Debug)]
struct ChunkSlot {
    /// Bumped each time the slot's chunk goes: its old handles go stale.
    generation: u32,
    chunk: Option<Chunk>,
}

impl ChunkTable {
    /// Stores `c`; its handle.
    fn insert(&mut self, c: Chunk) -> u64 {
        let i = match self.free.pop() {
            Some(i) => i as usize,
            None => {
                self.slots.push(ChunkSlot {
                    generation: 0,
                    chunk: None,
                });
                self.slots.len() - 1
            }
        };
        let slot = &mut self.slots[i];
        debug_assert!(slot.chunk.is_none());
        slot.chunk = Some(c);
        (u64::from(slot.generation) << 32) | (i as u64 + 1)
    }

    /// The slot of handle `id` if the handle is current.
    #[inline]
    fn slot_of(&self, id: u64) -> Option<usize> {
        let i = (id as u32).checked_sub(1)? as usize;
        let slot = self.slots.get(i)?;
        (slot.generation == (id >> 32) as u32 && slot.chunk.is_some()).then_some(i)
    }

    /// The live chunk of handle `id`.
    #[inline]
    fn get_mut(&mut self, id: u64) -> Option<&mut Chunk> {
        let i = (id as u32).checked_sub(1)? as usize;
        let slot = self.slots.get_mut(i)?;
        if slot.generation != (id >> 32) as u32 {
            return None;
        }
        slot.chunk.as_mut()
    }

    /// Removes the chunk of handle `id`; its handle goes stale.
    fn remove(&mut self, id: u64) -> Option<Chunk> {
        let i = self.slot_of(id)?;
        let slot = &mut self.slots[i];
        slot.generation = slot.generation.wrapping_add(1);
        self.free.push(i as u32);
        slot.chunk.take()
    }
}

/// One reserved virtual range and the chunk mappings inside it.
#[derive(Debug)]
struct Reservation {
    len: u64,
    /// What `mmap` returned (before aligning), for `munmap`.
    raw_base: u64,
    raw_len: u64,
    /// The mapping holding each granule, by granule offset from the base
    /// (every granule of a mapping holds a copy of it); grown on demand up
    /// to the highest granule mapped so far. Mappings are granule aligned,
    /// so mapping, unmapping and address checks index this directly: a
    /// replay stitches thousands of granules per pass.
    granules: Vec<Option<Mapped>>,
    /// Granules mapped.
    mapped: u64,
}

impl Reservation {
    /// The mapping holding granule `i`, if any.
    fn at(&self, i: u64) -> Option<Mapped> {
        self.granules.get(i as usize).copied().flatten()
    }
}

/// Part of a chunk mapped into a reservation.
#[derive(Debug, Clone, Copy)]
struct Mapped {
    start: u64,
    len: u64,
    chunk: u64,
}

/// A plain segment (`cuMemAlloc`); owns its own physical range.
#[derive(Debug, Clone, Copy)]
struct Segment {
    file_offset: u64,
    raw_len: u64,
}

/// All memory state of one simulated device. Guarded by one `RwLock` in the
/// device: work on memory takes it shared, map/unmap take it exclusive, so a
/// range cannot be unmapped under a running kernel.
#[derive(Debug)]
pub(super) struct DeviceMemory {
    device: usize,
    granularity: u64,
    backing: SimBacking,
    memfd: Option<OwnedFd>,
    file_len: u64,
    /// Free ranges of the memfd: offset -> len.
    file_free: BTreeMap<u64, u64>,
    /// Bytes of physical memory held (chunks and segments).
    pub(super) used: u64,
    chunks: ChunkTable,
    /// Reservations by base address, each with its mapping table.
    reservations: BTreeMap<u64, Reservation>,
    /// Plain segments: va -> segment.
    segments: BTreeMap<u64, Segment>,
    /// Next fake address in accounting mode.
    next_fake_va: u64,
}

/// Fake address spaces handed out by this process (accounting mode).
static FAKE_SPACES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn os_err(call: &'static str) -> Error {
    Error::backend(call, std::io::Error::last_os_error().to_string())
}

fn round_up(v: u64, to: u64) -> u64 {
    v.div_ceil(to) * to
}

const PAGE: u64 = 4096;

impl DeviceMemory {
    pub(super) fn new(device: usize, granularity: u64, backing: SimBacking) -> Result<Self> {
        let memfd = match backing {
            SimBacking::Memory => {
                let name = std::ffi::CString::new(format!("gpupool-sim-{device}")).unwrap();
                // SAFETY: `name` is a valid NUL-terminated string; memfd_create
                // has no other preconditions.
                let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
                if fd < 0 {
                    return Err(os_err("memfd_create"));
                }
                // SAFETY: `fd` was just returned by memfd_create and is owned
                // by nobody else.
                Some(unsafe { OwnedFd::from_raw_fd(fd) })
            }
            SimBacking::Accounting => None,
        };
        Ok(DeviceMemory {
            device,
            granularity,
            backing,
            memfd,
            file_len: 0,
            file_free: BTreeMap::new(),
            used: 0,
            chunks: ChunkTable::default(),
            reservations: BTreeMap::new(),
            segments: BTreeMap::new(),
            // A fake address space of its own (1 TiB apart, 96 before one
            // repeats): an address of another device, or of a simulator
            // dropped earlier (a runtime shut down and started again), is
            // unknown here rather than memory this one handed out, so a
            // stale pointer is refused as unknown and never frees a block
            // of the new life.
            next_fake_va: 0x1000_0000_0000
                + ((FAKE_SPACES.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 96) << 40),
        })
    }

    fn fd(&self) -> i32 {
        self.memfd.as_ref().map_or(-1, |f| f.as_raw_fd())
    }

    /// Takes `len` bytes of the memfd: first fit, else grow the file. The file
    /// is sparse, so only touched pages cost host memory.
    fn take_file_range(&mut self, len: u64) -> Result<u64> {
        if self.memfd.is_none() {
            return Ok(0);
        }
        let fit = self
            .file_free
            .iter()
            .find(|(_, l)| **l >= len)
            .map(|(o, l)| (*o, *l));
        if let Some((off, flen)) = fit {
            self.file_free.remove(&off);
            if flen > len {
                self.file_free.insert(off + len, flen - len);
            }
            return Ok(off);
        }
        let off = self.file_len;
        // SAFETY: plain syscall on a file descriptor this struct owns.
        if unsafe { libc::ftruncate(self.fd(), (off + len) as libc::off_t) } != 0 {
            return Err(os_err("ftruncate"));
        }
        self.file_len = off + len;
        Ok(off)
    }

    /// Returns a memfd range and punches a hole so its host pages go back.
    fn give_file_range(&mut self, off: u64, len: u64) {
        if self.memfd.is_none() {
            return;
        }
        // SAFETY: plain syscall on an owned fd; the range lies inside the file.
        unsafe {
            libc::fallocate(
                self.fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off as libc::off_t,
                len as libc::off_t,
            );
        }
        let mut off = off;
        let mut len = len;
        // Coalesce with neighbours so first fit keeps finding room.
        if let Some((&poff, &plen)) = self.file_free.range(..off).next_back() {
            if poff + plen == off {
                self.file_free.remove(&poff);
                off = poff;
                len += plen;
            }
        }
        if let Some(&nlen) = self.file_free.get(&(off + len)) {
            self.file_free.remove(&(off + len));
            len += nlen;
        }
        self.file_free.insert(off, len);
    }

    fn check_granule(&self, what: &str, v: u64) -> Result<()> {
        if v == 0 || v % self.granularity != 0 {
            return Err(Error::InvalidArgument(format!(
                "{what} {v:#x} is not a non-zero multiple of the granularity {}",
                self.granularity
            )));
        }
        Ok(())
    }

    pub(super) fn create_chunk(&mut self, bytes: u64) -> Result<u64> {
        self.check_granule("chunk size", bytes)?;
        let file_offset = self.take_file_range(bytes)?;
        let id = self.chunks.insert(Chunk {
            file_offset,
            len: bytes,
            maps: 0,
            released: false,
            import: None,
            exported: false,
        });
        self.used += bytes;
        Ok(id)
    }

    /// `cuMemExportToShareableHandle`: a new descriptor of the file holding
    /// chunk `id` (this device's memfd, or the file it was imported from)
    /// and the chunk's offset in it. The simulator shares the whole file,
    /// where a driver shares the chunk alone; the chunk's range of it is
    /// never reused, since the other process may map it for as long as it
    /// likes.
    pub(super) fn export_chunk(&mut self, id: u64) -> Result<(OwnedFd, u64)> {
        if self.memfd.is_none() {
            return Err(Error::Unsupported(
                "export in accounting mode (no memory behind chunks)".into(),
            ));
        }
        let device_fd = self.fd();
        let c = self
            .chunks
            .get_mut(id)
            .filter(|c| !c.released)
            .ok_or_else(|| Error::InvalidHandle(format!("chunk {id} on device {}", self.device)))?;
        let raw = c.import.as_ref().map_or(device_fd, |f| f.as_raw_fd());
        // SAFETY: `raw` is an open descriptor this device owns (its memfd or
        // an imported file held in `c.import`) for the whole call.
        let fd = unsafe { BorrowedFd::borrow_raw(raw) }.try_clone_to_owned()?;
        c.exported = true;
        Ok((fd, c.file_offset))
    }

    /// `cuMemImportFromShareableHandle`: a chunk of `bytes` at `fd_offset`
    /// of the file `fd` refers to (duplicated; `fd` stays the caller's).
    pub(super) fn import_chunk(
        &mut self,
        fd: BorrowedFd<'_>,
        fd_offset: u64,
        bytes: u64,
    ) -> Result<u64> {
        self.check_granule("chunk size", bytes)?;
        if self.memfd.is_none() {
            return Err(Error::Unsupported(
                "import in accounting mode (no memory behind chunks)".into(),
            ));
        }
        if fd_offset % PAGE != 0 {
            return Err(Error::InvalidArgument(format!(
                "file offset {fd_offset:#x} is not page aligned"
            )));
        }
        // SAFETY: an all-zero `stat` is a valid value; fstat fills it.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is open (a BorrowedFd) and `st` valid for writes.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(Error::InvalidHandle(format!(
                "descriptor {}: {}",
                fd.as_raw_fd(),
                std::io::Error::last_os_error()
            )));
        }
        if fd_offset.saturating_add(bytes) > st.st_size as u64 {
            return Err(Error::InvalidArgument(format!(
                "[{fd_offset:#x}, +{bytes}) lies outside the shared file ({} bytes)",
                st.st_size
            )));
        }
        let own = fd.try_clone_to_owned()?;
        Ok(self.chunks.insert(Chunk {
            file_offset: fd_offset,
            len: bytes,
            maps: 0,
            released: false,
            import: Some(Arc::new(own)),
            exported: false,
        }))
    }

    pub(super) fn release_chunk(&mut self, id: u64) -> Result<()> {
        let c = self
            .chunks
            .get_mut(id)
            .filter(|c| !c.released)
            .ok_or_else(|| Error::InvalidHandle(format!("chunk {id} on device {}", self.device)))?;
        c.released = true;
        if c.maps == 0 {
            self.drop_chunk(id);
        }
        Ok(())
    }

    fn drop_chunk(&mut self, id: u64) {
        let Some(c) = self.chunks.remove(id) else {
            return;
        };
        if c.import.is_some() {
            return; // the exporter's memory; the file closes with `c`
        }
        self.used -= c.len;
        if !c.exported {
            self.give_file_range(c.file_offset, c.len);
        }
    }

    pub(super) fn reserve_va(&mut self, bytes: u64) -> Result<u64> {
        self.check_granule("reservation size", bytes)?;
        let g = self.granularity;
        let (base, raw_base, raw_len) = match self.backing {
            SimBacking::Accounting => {
                let base = round_up(self.next_fake_va, g);
                self.next_fake_va = base + bytes + g; // a guard gap
                (base, base, bytes)
            }
            SimBacking::Memory => {
                let raw_len = bytes + g;
                // SAFETY: an anonymous PROT_NONE reservation at an address the
                // kernel chooses; it aliases nothing.
                let p = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        raw_len as usize,
                        libc::PROT_NONE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                        -1,
                        0,
                    )
                };
                if p == libc::MAP_FAILED {
                    return Err(os_err("cuMemAddressReserve(mmap)"));
                }
                let raw = p as u64;
                (round_up(raw, g), raw, raw_len)
            }
        };
        self.reservations.insert(
            base,
            Reservation {
                len: bytes,
                raw_base,
                raw_len,
                granules: Vec::new(),
                mapped: 0,
            },
        );
        Ok(base)
    }

    pub(super) fn free_va(&mut self, base: u64, bytes: u64) -> Result<()> {
        let r = self.reservations.get(&base).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{base:#x} is not a reservation on device {}",
                self.device
            ))
        })?;
        if r.len != bytes {
            return Err(Error::InvalidArgument(format!(
                "reservation {base:#x} has {} bytes, not {bytes}",
                r.len
            )));
        }
        if r.mapped != 0 {
            return Err(Error::InvalidArgument(format!(
                "reservation {base:#x} still has mappings"
            )));
        }
        let r = self.reservations.remove(&base).expect("checked above");
        if self.backing == SimBacking::Memory {
            // SAFETY: exactly the range mmap returned for this reservation;
            // nothing is mapped inside it any more.
            unsafe { libc::munmap(r.raw_base as *mut libc::c_void, r.raw_len as usize) };
        }
        Ok(())
    }

    /// The reservation holding all of `[va, va+len)`, if any: its base.
    fn reservation_of(&self, va: u64, len: u64) -> Option<u64> {
        let (&base, r) = self.reservations.range(..=va).next_back()?;
        (va + len <= base + r.len).then_some(base)
    }

    pub(super) fn map(&mut self, va: u64, bytes: u64, chunk: u64, chunk_offset: u64) -> Result<()> {
        let base = self.check_map_range(va, bytes, bytes, chunk_offset)?;
        let env = self.map_env();
        let r = self.reservations.get_mut(&base).expect("checked above");
        let g = env.granularity;
        let (i0, i1) = (
            ((va - base) / g) as usize,
            ((va - base + bytes) / g) as usize,
        );
        if r.granules.len() < i1 {
            r.granules.resize(i1, None);
        }
        let slots = &mut r.granules[i0..i1];
        map_into(env, slots, &mut self.chunks, va, bytes, chunk, chunk_offset)?;
        r.mapped += (i1 - i0) as u64;
        Ok(())
    }

    /// Checks a mapping of `bytes` at `va` made of pieces of `piece` bytes
    /// from chunk offset `chunk_offset`: granule sizes and alignment, and
    /// one reservation holding it all (its base is returned).
    fn check_map_range(&self, va: u64, bytes: u64, piece: u64, chunk_offset: u64) -> Result<u64> {
        self.check_granule("mapping size", piece)?;
        if va % self.granularity != 0 || chunk_offset % self.granularity != 0 {
            return Err(Error::InvalidArgument(format!(
                "mapping at {va:#x} (chunk offset {chunk_offset}) is not granule aligned"
            )));
        }
        self.reservation_of(va, bytes).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "[{va:#x}, +{bytes}) is not inside one reservation on device {}",
                self.device
            ))
        })
    }

    fn map_env(&self) -> MapEnv {
        MapEnv {
            device: self.device,
            backing: self.backing,
            fd: self.fd(),
            granularity: self.granularity,
        }
    }

    /// Maps whole chunks of `gran` bytes at `va`, `va + gran`, ... The
    /// range is checked once (alignment, one reservation) and its
    /// reservation looked up once; each chunk is then mapped as by
    /// [`DeviceMemory::map`]. All or nothing: on an error the chunks
    /// already mapped are unmapped again.
    pub(super) fn map_run(&mut self, va: u64, gran: u64, chunks: &[ChunkHandle]) -> Result<()> {
        let base = self.check_map_range(va, gran * chunks.len() as u64, gran, 0)?;
        let env = self.map_env();
        let r = self.reservations.get_mut(&base).expect("checked above");
        // One division and one table growth for the run, not per chunk.
        let per = (gran / env.granularity) as usize;
        let i0 = ((va - base) / env.granularity) as usize;
        let i1 = i0 + per * chunks.len();
        if r.granules.len() < i1 {
            r.granules.resize(i1, None);
        }
        let table = &mut self.chunks;
        let mut map_at = |i: usize, slots: &mut [Option<Mapped>], c: u64| {
            map_into(env, slots, table, va + i as u64 * gran, gran, c, 0).map_err(|e| (i, e))
        };
        let done = if per == 1 {
            // The usual case, one table entry per chunk: with one-entry
            // slices the per-chunk step's check and fill are a single load
            // and store, not loops over a slice of unknown length.
            let slots = r.granules[i0..i1].iter_mut();
            chunks
                .iter()
                .zip(slots)
                .enumerate()
                .try_for_each(|(i, (&ChunkHandle(c), slot))| {
                    map_at(i, std::slice::from_mut(slot), c)
                })
        } else {
            let slots = r.granules[i0..i1].chunks_exact_mut(per);
            chunks
                .iter()
                .zip(slots)
                .enumerate()
                .try_for_each(|(i, (&ChunkHandle(c), slots))| map_at(i, slots, c))
        };
        if let Err((i, e)) = done {
            r.mapped += (i * per) as u64;
            if i > 0 {
                self.unmap(va, i as u64 * gran).expect("mapped just above");
            }
            return Err(e);
        }
        r.mapped += (i1 - i0) as u64;
        Ok(())
    }

    /// Unmaps whole mappings exactly covering `[va, va+bytes)` (inside one
    /// reservation, as every mapping is).
    pub(super) fn unmap(&mut self, va: u64, bytes: u64) -> Result<()> {
        let g = self.granularity;
        let not_whole = |at: u64| {
            Error::InvalidArgument(format!(
                "[{va:#x}, +{bytes}) is not a whole set of mappings (gap or split at {at:#x})"
            ))
        };
        let base = self
            .reservation_of(va, bytes)
            .ok_or_else(|| not_whole(va))?;
        let r = self.reservations.get_mut(&base).expect("found above");
        // One walk checks the range granule by granule and drops the map
        // count of each mapping starting in it; a bad range restores the
        // counts dropped so far, so a failing call changes nothing. (A
        // stitch unmaps thousands of granules per pass: one walk, not a
        // check and then a second walk.) Granule `i` starts at `at`.
        let end = va + bytes;
        let i0 = ((va - base) / g) as usize;
        let i1 = if bytes == 0 {
            i0
        } else {
            ((end - 1 - base) / g) as usize + 1
        };
        let chunks = &mut self.chunks;
        let mut dead: smallvec::SmallVec<[u64; 4]> = smallvec::SmallVec::new();
        let mut covered = va; // the end of the last mapping begun
        let mut at = va;
        let mut failed = None;
        for i in i0..i1 {
            match r.granules.get(i).and_then(Option::as_ref) {
                Some(m) if m.start == at => {
                    let c = chunks.get_mut(m.chunk).expect("mapped chunk exists");
                    c.maps -= 1;
                    if c.maps == 0 && c.released {
                        dead.push(m.chunk);
                    }
                    covered = at + m.len;
                }
                // The rest of a mapping begun in the range (the table holds
                // a mapping in each of its granules).
                Some(m) if i > i0 && m.start < at => {}
                _ => {
                    failed = Some((i, not_whole(at)));
                    break;
                }
            }
            at += g;
        }
        if failed.is_none() && covered != end {
            failed = Some((
                i1,
                Error::InvalidArgument(format!(
                    "unmap of [{va:#x}, +{bytes}) would split a mapping"
                )),
            ));
        }
        if failed.is_none() && self.backing == SimBacking::Memory {
            // SAFETY: the range is exactly a set of our own mappings inside a
            // reservation; replacing it with PROT_NONE restores the reservation.
            let p = unsafe {
                libc::mmap(
                    va as *mut libc::c_void,
                    bytes as usize,
                    libc::PROT_NONE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                failed = Some((i1, os_err("cuMemUnmap(mmap)")));
            }
        }
        if let Some((upto, e)) = failed {
            // Undo the drops: the mappings begun before granule `upto`.
            for i in i0..upto {
                if let Some(m) = &r.granules[i] {
                    if m.start == base + i as u64 * g {
                        chunks.get_mut(m.chunk).expect("mapped chunk exists").maps += 1;
                    }
                }
            }
            return Err(e);
        }
        r.granules[i0..i1].fill(None);
        r.mapped -= (i1 - i0) as u64;
        for id in dead {
            self.drop_chunk(id);
        }
        Ok(())
    }

    pub(super) fn check_access(&self, va: u64, bytes: u64) -> Result<()> {
        if self.mapped_covers(va, bytes) {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "[{va:#x}, +{bytes}) is not mapped on device {} (illegal address)",
                self.device
            )))
        }
    }

    /// Whether `[va, va+len)` is fully covered by adjacent mapped ranges.
    pub(super) fn mapped_covers(&self, va: u64, len: u64) -> bool {
        let end = va + len;
        let Some(mut cursor) = self.mapping_end(va) else {
            return false;
        };
        while cursor < end {
            match self.mapping_end(cursor) {
                Some(e) => cursor = e,
                None => return false,
            }
        }
        true
    }

    /// The end of the mapping (chunk mapping or segment) holding `va`.
    fn mapping_end(&self, va: u64) -> Option<u64> {
        if let Some(base) = self.reservation_of(va, 1) {
            let m = self.reservations[&base].at((va - base) / self.granularity)?;
            return Some(m.start + m.len);
        }
        let (&s, seg) = self.segments.range(..=va).next_back()?;
        (s + seg.raw_len > va).then_some(s + seg.raw_len)
    }

    pub(super) fn alloc_segment(&mut self, bytes: u64) -> Result<u64> {
        if bytes == 0 {
            return Err(Error::InvalidSize {
                size: 0,
                why: "cuMemAlloc of zero bytes",
            });
        }
        let raw_len = round_up(bytes, PAGE);
        let file_offset = self.take_file_range(raw_len)?;
        let va = match self.backing {
            SimBacking::Accounting => {
                let va = round_up(self.next_fake_va, PAGE);
                self.next_fake_va = va + raw_len + PAGE;
                va
            }
            SimBacking::Memory => {
                // SAFETY: a fresh shared mapping of our memfd at an address the
                // kernel picks; the file range is ours alone.
                let p = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        raw_len as usize,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_SHARED,
                        self.fd(),
                        file_offset as libc::off_t,
                    )
                };
                if p == libc::MAP_FAILED {
                    self.give_file_range(file_offset, raw_len);
                    return Err(os_err("cuMemAlloc(mmap)"));
                }
                p as u64
            }
        };
        self.used += raw_len;
        self.segments.insert(
            va,
            Segment {
                file_offset,
                raw_len,
            },
        );
        Ok(va)
    }

    pub(super) fn free_segment(&mut self, va: u64) -> Result<()> {
        let Some(Segment {
            file_offset,
            raw_len,
        }) = self.segments.remove(&va)
        else {
            return Err(Error::InvalidArgument(format!(
                "{va:#x} is not a segment on device {}",
                self.device
            )));
        };
        if self.backing == SimBacking::Memory {
            // SAFETY: exactly the mapping alloc_segment created.
            unsafe { libc::munmap(va as *mut libc::c_void, raw_len as usize) };
        }
        self.give_file_range(file_offset, raw_len);
        self.used -= raw_len;
        Ok(())
    }

    /// Whether memory is really backed (not accounting mode).
    pub(super) fn is_backed(&self) -> bool {
        self.backing == SimBacking::Memory
    }
}

/// What mapping one chunk needs of its device besides the tables.
#[derive(Clone, Copy)]
struct MapEnv {
    device: usize,
    backing: SimBacking,
    fd: i32,
    granularity: u64,
}

/// Maps `bytes` of `chunk` from `chunk_offset` at `va`, whose granules'
/// entries in its reservation's table are `slots` (alignment and bounds
/// already checked, the table grown to hold them): the entries and the
/// chunk's map count change only if it succeeds. Inlined into the run
/// loop, which calls it per granule of a stitch.
#[inline(always)]
fn map_into(
    env: MapEnv,
    slots: &mut [Option<Mapped>],
    chunks: &mut ChunkTable,
    va: u64,
    bytes: u64,
    chunk: u64,
    chunk_offset: u64,
) -> Result<()> {
    if slots.iter().any(Option::is_some) {
        return Err(Error::InvalidArgument(format!(
            "[{va:#x}, +{bytes}) is already mapped"
        )));
    }
    let c = chunks
        .get_mut(chunk)
        .filter(|c| !c.released)
        .ok_or_else(|| Error::InvalidHandle(format!("chunk {chunk} on device {}", env.device)))?;
    if chunk_offset + bytes > c.len {
        return Err(Error::InvalidArgument(format!(
            "chunk {chunk} has {} bytes; cannot map {bytes} at offset {chunk_offset}",
            c.len
        )));
    }
    if env.backing == SimBacking::Memory {
        // An imported chunk's bytes are in the file it came from.
        let fd = c.import.as_ref().map_or(env.fd, |f| f.as_raw_fd());
        // SAFETY: [va, va+bytes) lies inside a PROT_NONE reservation we own
        // and holds no other mapping (checked above), so MAP_FIXED replaces
        // only our own reservation pages; the file range is inside the memfd
        // (or, imported, inside the shared file: checked at import).
        let p = unsafe {
            libc::mmap(
                va as *mut libc::c_void,
                bytes as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd,
                (c.file_offset + chunk_offset) as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_err("cuMemMap(mmap)"));
        }
    }
    c.maps += 1;
    slots.fill(Some(Mapped {
        start: va,
        len: bytes,
        chunk,
    }));
    Ok(())
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if self.backing != SimBacking::Memory {
            return;
        }
        for (&va, seg) in &self.segments {
            // SAFETY: our own segment mapping; nothing uses it any more.
            unsafe { libc::munmap(va as *mut libc::c_void, seg.raw_len as usize) };
        }
        for r in self.reservations.values() {
            // SAFETY: our own reservation (with whatever is mapped inside it);
            // the device is being dropped, so no work can touch it.
            unsafe { libc::munmap(r.raw_base as *mut libc::c_void, r.raw_len as usize) };
        }
    }
}
