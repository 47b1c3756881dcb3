//! Differential model test of `DevicePool` on the simulator.
//!
//! Random operation sequences (allocations as RAII blocks or raw pointers on
//! several streams, frees, `record_stream`, bad frees, harvests, trims,
//! step marks, stream syncs and stalls) run against the pool and against a
//! trivial model (a map of live blocks). After every step the test checks
//! that live blocks never overlap, that each lies in mapped device memory, that `audit()`
//! passes, that the stats agree with the model, that the pool holds exactly
//! the device memory the stats say, and that typed errors change nothing.
//! When the device could evidently hold a request once nothing is in flight,
//! an out-of-memory error must go away after a sync (liveness).
//!
//! Two flavours of marker bytes catch reuse of live memory:
//! * host mode: markers are written with `copy_from_host` at allocation and
//!   read back after every step (no device work is ever in flight);
//! * kernel mode: markers are written by simulated kernels on the block's
//!   stream, `Use` ops launch delayed kernels on it (and on other streams,
//!   after `record_stream`), and verify kernels run before every free, so a
//!   block handed out before its last use finished shows up as corruption.
//!
//! Knobs: `PROPTEST_CASES` (cases per test), `MODEL_REPEAT` (runs per case
//! of the timing-dependent kernel tests: failures shrink better), and
//! `MODEL_TRACE` (print every op and address). A long hunt:
//! `PROPTEST_CASES=500 MODEL_REPEAT=3 cargo test --release --test model`.

use gpupool::backend::sim::{fill_pattern, SimBackend};
use gpupool::backend::Backend;
use gpupool::{
    BackendKind, Block, DevicePool, DevicePtr, Error, PoolConfig, PoolStats, Runtime, SimConfig,
    Stream,
};
use proptest::prelude::*;
use std::collections::BTreeSet;
use std::time::Duration;

const MIB: u64 = 1 << 20;
const CAPACITY: u64 = 96 * MIB;
const GRAN: u64 = 2 * MIB;
/// The pool's small/large threshold with 2 MiB slabs.
const SMALL_MAX: u64 = 256 << 10;
/// Streams the ops pick from. In the VMM variants the last one gets no
/// stream slot (all 64 are taken), which sends its frees down the pending
/// path.
const STREAMS: usize = 4;

/// Picks one of the live blocks (or of the freed pointers): `n % len`.
/// Shrinks towards the first one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pick(u16);

impl Pick {
    fn index(self, len: usize) -> usize {
        self.0 as usize % len
    }
}

impl Arbitrary for Pick {
    type Parameters = ();
    type Strategy = prop::strategy::Map<std::ops::RangeInclusive<u16>, fn(u16) -> Pick>;
    fn arbitrary_with((): ()) -> Self::Strategy {
        (0..=u16::MAX).prop_map(Pick as fn(u16) -> Pick)
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// Allocates `size` bytes on `stream`, as a raw pointer if `raw`.
    Alloc {
        size: usize,
        stream: usize,
        raw: bool,
    },
    /// Frees a live block: drop, or `free_raw` on stream `on` (in kernel
    /// mode after recording the block's own stream, so the free waits for
    /// its kernels). Kernel mode first verifies the markers after `us`.
    Free {
        pick: Pick,
        on: usize,
        us: u64,
    },
    /// `record_stream` of a live block on another stream.
    Record {
        pick: Pick,
        stream: usize,
    },
    /// Kernel mode: a delayed write (of the block's own markers) or verify
    /// kernel on a live block, on its own stream or on another (ordered
    /// after the block's stream by an event, and `record_stream`ed).
    Use {
        pick: Pick,
        stream: usize,
        us: u64,
        verify: bool,
    },
    /// A free that must fail with a typed error and change nothing.
    BadFree {
        bad: Bad,
        stream: usize,
    },
    Harvest,
    Trim,
    /// A step boundary (`mark_step`): random sequences rarely repeat, so
    /// this mostly exercises plans that are built, departed from and
    /// retired while their blocks live.
    MarkStep,
    /// Host-syncs a stream (the test's own sync, not the pool's).
    Sync {
        stream: usize,
    },
    /// Delays a stream's next operation, so its frees stay pending a while.
    Stall {
        stream: usize,
        us: u64,
    },
}

#[derive(Debug, Clone)]
enum Bad {
    /// A raw pointer freed before (double free, unless handed out again).
    Freed(Pick),
    /// A pointer inside a live block.
    Interior(Pick, u64),
    /// The pointer of a live RAII block (not a raw allocation).
    BlockPtr(Pick),
    /// An address the pool never handed out.
    Unknown(u64),
    /// `record_stream_raw` on an address the pool never handed out.
    RecordUnknown(u64),
}

fn size_strategy() -> impl Strategy<Value = usize> {
    let c = CAPACITY as usize;
    prop_oneof![
        40 => 1usize..=4096,
        20 => 4097usize..=SMALL_MAX as usize,
        18 => (SMALL_MAX as usize + 1)..=(6 << 20),
        6 => prop::sample::select(vec![
            1usize,
            255,
            256,
            257,
            1024,
            1025,
            SMALL_MAX as usize - 1,
            SMALL_MAX as usize,
            SMALL_MAX as usize + 1,
            GRAN as usize - 256,
            GRAN as usize,
            GRAN as usize + 1,
        ]),
        // May or may not fit: must succeed or be OutOfMemory.
        4 => (c / 4)..=c,
        // Never fits: InvalidSize.
        2 => Just(0usize),
        2 => (c + 1)..=usize::MAX / 2,
    ]
}

fn delay_strategy() -> impl Strategy<Value = u64> {
    prop_oneof![Just(0u64), 1u64..3000]
}

fn op_strategy(kernels: bool) -> impl Strategy<Value = Op> {
    let st = 0..STREAMS;
    let bad = prop_oneof![
        any::<Pick>().prop_map(Bad::Freed),
        (any::<Pick>(), 1u64..=1 << 20).prop_map(|(i, o)| Bad::Interior(i, o)),
        any::<Pick>().prop_map(Bad::BlockPtr),
        prop_oneof![Just(0u64), 1u64..=u64::MAX].prop_map(Bad::Unknown),
        any::<u64>().prop_map(Bad::RecordUnknown),
    ];
    let stall_us: u64 = if kernels { 10_000 } else { 3000 };
    prop_oneof![
        40 => (size_strategy(), st.clone(), any::<bool>())
            .prop_map(|(size, stream, raw)| Op::Alloc { size, stream, raw }),
        28 => (any::<Pick>(), st.clone(), delay_strategy())
            .prop_map(|(pick, on, us)| Op::Free { pick, on, us }),
        6 => (any::<Pick>(), st.clone()).prop_map(|(pick, stream)| Op::Record { pick, stream }),
        (if kernels { 16 } else { 0 }) =>
            (any::<Pick>(), st.clone(), delay_strategy(), any::<bool>())
            .prop_map(|(pick, stream, us, verify)| Op::Use { pick, stream, us, verify }),
        6 => (bad, st.clone()).prop_map(|(bad, stream)| Op::BadFree { bad, stream }),
        4 => Just(Op::Harvest),
        1 => Just(Op::Trim),
        3 => Just(Op::MarkStep),
        3 => st.clone().prop_map(|stream| Op::Sync { stream }),
        3 => (st, 0..stall_us).prop_map(|(stream, us)| Op::Stall { stream, us }),
    ]
}

enum Handle<'a> {
    Block(Block<'a>),
    Raw(DevicePtr),
}

struct Live<'a> {
    h: Handle<'a>,
    ptr: u64,
    size: u64,
    /// Index of the stream it was allocated on.
    stream: usize,
    /// Seed of its first marker region (region `r` uses `tag + r`).
    tag: u64,
}

impl Live<'_> {
    fn raw(&self) -> bool {
        matches!(self.h, Handle::Raw(_))
    }
}

/// The marked regions of a block, `(offset, len)`: its first and last
/// `edge` bytes (one region for a block of at most `2 * edge` bytes).
fn regions(size: u64, edge: u64) -> Vec<(u64, u64)> {
    if size <= 2 * edge {
        vec![(0, size)]
    } else {
        vec![(0, edge), (size - edge, edge)]
    }
}

fn pattern(seed: u64, len: u64) -> Vec<u8> {
    let mut v = vec![0u8; len as usize];
    fill_pattern(&mut v, seed);
    v
}

fn key_stats(s: &PoolStats) -> [u64; 10] {
    [
        s.requested_bytes.current,
        s.allocated_bytes.current,
        s.reserved_bytes.current,
        s.cached_bytes.current,
        s.pending_bytes.current,
        s.num_allocs,
        s.num_frees,
        s.num_ooms,
        s.num_device_allocs,
        s.num_pending_frees,
    ]
}

struct Model<'a> {
    dev: &'a DevicePool,
    sim: &'a SimBackend,
    streams: &'a [Stream],
    vmm: bool,
    kernels: bool,
    /// Marker region length at each end of a block.
    edge: u64,
    live: Vec<Live<'a>>,
    /// Raw pointers freed so far (for double frees).
    freed_raw: Vec<u64>,
    allocs: u64,
    frees: u64,
    next_tag: u64,
}

type Check = Result<(), String>;

impl<'a> Model<'a> {
    fn regions(&self, l: &Live<'_>) -> Vec<(u64, u64, u64)> {
        regions(l.size, self.edge)
            .into_iter()
            .enumerate()
            .map(|(r, (off, len))| (off, len, l.tag + r as u64))
            .collect()
    }

    /// Writes the markers: from the host, or by a kernel on the block's stream.
    fn write_markers(&self, l: &Live<'_>, delay: Duration) -> Check {
        let s = self.streams[l.stream].handle();
        for (off, len, seed) in self.regions(l) {
            let p = DevicePtr(l.ptr + off);
            let r = if self.kernels {
                self.sim.launch_write_pattern(0, s, p, len, seed, delay)
            } else {
                self.sim.copy_from_host(0, p, &pattern(seed, len))
            };
            r.map_err(|e| format!("block {:#x}+{} not writable: {e}", l.ptr, l.size))?;
        }
        Ok(())
    }

    /// Reads the markers back from the host (only valid when no kernel on
    /// the block is in flight).
    fn check_markers(&self, l: &Live<'_>) -> Check {
        for (off, len, seed) in self.regions(l) {
            let mut bytes = vec![0u8; len as usize];
            self.sim
                .copy_to_host(0, DevicePtr(l.ptr + off), &mut bytes)
                .map_err(|e| format!("live block {:#x}+{} not mapped: {e}", l.ptr, l.size))?;
            if let Some(i) = bytes
                .iter()
                .zip(pattern(seed, len))
                .position(|(a, b)| *a != b)
            {
                return Err(format!(
                    "live block {:#x}+{} was overwritten at offset {}",
                    l.ptr,
                    l.size,
                    off + i as u64
                ));
            }
        }
        Ok(())
    }

    /// Checks that the first and last byte of a block are mapped.
    fn check_mapped(&self, l: &Live<'_>) -> Check {
        let mut b = [0u8; 1];
        for off in [0, l.size - 1] {
            self.sim
                .copy_to_host(0, DevicePtr(l.ptr + off), &mut b)
                .map_err(|e| format!("live block {:#x}+{} not mapped: {e}", l.ptr, l.size))?;
        }
        Ok(())
    }

    /// Every invariant the test checks after a step.
    fn check(&self) -> Check {
        let mut spans: Vec<(u64, u64)> = self.live.iter().map(|l| (l.ptr, l.size)).collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(format!(
                    "live blocks overlap: {:#x}+{} and {:#x}+{}",
                    w[0].0, w[0].1, w[1].0, w[1].1
                ));
            }
        }
        for l in &self.live {
            if self.kernels {
                self.check_mapped(l)?;
            } else {
                self.check_markers(l)?;
            }
        }
        self.check_device()?;
        let st = self.dev.audit().map_err(|e| format!("audit: {e}"))?;
        let live_bytes: u64 = self.live.iter().map(|l| l.size).sum();
        if st.requested_bytes.current != live_bytes {
            return Err(format!(
                "allocated {} != model's live bytes {live_bytes}",
                st.requested_bytes.current
            ));
        }
        if (st.num_allocs, st.num_frees) != (self.allocs, self.frees) {
            return Err(format!(
                "allocs/frees ({}, {}) != model's ({}, {})",
                st.num_allocs, st.num_frees, self.allocs, self.frees
            ));
        }
        if st.allocated_bytes.current < st.requested_bytes.current {
            return Err("allocated (rounded) < requested".into());
        }
        let used = self.sim.used_bytes(0);
        if st.reserved_bytes.current != used || used > CAPACITY {
            return Err(format!(
                "reserved {} != device memory held {used} (capacity {CAPACITY})",
                st.reserved_bytes.current
            ));
        }
        Ok(())
    }

    /// Corruption or faults the simulated kernels saw so far.
    fn check_device(&self) -> Check {
        let (bad, faults) = (self.sim.integrity_errors(0), self.sim.device_faults(0));
        if bad != 0 || faults != 0 {
            return Err(format!(
                "kernels saw {bad} corrupted bytes and {faults} accesses to unmapped memory"
            ));
        }
        Ok(())
    }

    /// Granules a live block keeps from being reused: the whole slab granule
    /// of a small block, every granule a large block touches.
    fn pinned_granules(&self) -> u64 {
        let mut g = BTreeSet::new();
        for l in &self.live {
            let len = l.size.div_ceil(256) * 256;
            g.extend(l.ptr / GRAN..=(l.ptr + len - 1) / GRAN);
        }
        g.len() as u64
    }

    /// Whether a request of `size` must succeed once nothing is in flight:
    /// enough granules are neither held by live blocks nor needed.
    fn must_fit(&self, size: u64) -> bool {
        let need = if size <= SMALL_MAX {
            1
        } else {
            size.div_ceil(GRAN) + 1
        };
        self.vmm && (self.pinned_granules() + need) * GRAN <= CAPACITY
    }

    fn sync_all(&self) {
        for s in self.streams.iter().chain([self.dev.default_stream()]) {
            self.dev.backend().sync_stream(0, s.handle()).unwrap();
        }
    }

    fn alloc(&mut self, size: usize, si: usize, raw: bool) -> Check {
        let s = &self.streams[si];
        let before = self.dev.stats();
        let mut r = self.try_alloc(size, s, raw);
        if size == 0 || size as u64 > CAPACITY {
            return match r {
                Err(Error::InvalidSize { .. }) => {
                    let after = self.dev.stats();
                    if key_stats(&after) != key_stats(&before) {
                        return Err(format!(
                            "InvalidSize changed stats: {before:?} -> {after:?}"
                        ));
                    }
                    Ok(())
                }
                other => Err(format!(
                    "alloc({size}) must be InvalidSize, got {:?}",
                    other.map(|_| ())
                )),
            };
        }
        if let Err(Error::OutOfMemory(rep)) = &r {
            let after = self.dev.stats();
            let kb = key_stats(&before);
            let ka = key_stats(&after);
            if (ka[0], ka[1], ka[5], ka[6]) != (kb[0], kb[1], kb[5], kb[6]) || ka[7] != kb[7] + 1 {
                return Err(format!("OOM changed stats: {before:?} -> {after:?}"));
            }
            if rep.requested != size as u64 || rep.live != kb[0] {
                return Err(format!("OOM report is wrong: {rep:?}"));
            }
            if !self.must_fit(size as u64) {
                return Ok(());
            }
            // Nothing in flight after this: the request must be served.
            self.sync_all();
            self.dev.harvest();
            r = self.try_alloc(size, s, raw);
            if let Err(e) = &r {
                return Err(format!(
                    "alloc({size}) fails with {} of {} granules pinned by {} live \
                     blocks, even with nothing in flight: {e}",
                    self.pinned_granules(),
                    CAPACITY / GRAN,
                    self.live.len()
                ));
            }
        }
        let h = r.map_err(|e| format!("alloc({size}) failed: {e}"))?;
        let ptr = match &h {
            Handle::Block(b) => {
                if b.size() != size {
                    return Err(format!("Block::size {} != {size}", b.size()));
                }
                b.ptr().addr()
            }
            Handle::Raw(p) => {
                if self.dev.raw_size(*p) != Some(size as u64) {
                    return Err(format!("raw_size of a fresh raw block is wrong: {p:?}"));
                }
                p.addr()
            }
        };
        if ptr % 256 != 0 {
            return Err(format!("{ptr:#x} is not 256-byte aligned"));
        }
        self.allocs += 1;
        self.next_tag += 2;
        let l = Live {
            h,
            ptr,
            size: size as u64,
            stream: si,
            tag: self.next_tag,
        };
        if trace() {
            eprintln!(
                "  alloc {size} on s{si} raw={raw} -> {ptr:#x} tag {}",
                l.tag
            );
        }
        self.write_markers(&l, Duration::ZERO)?;
        self.live.push(l);
        Ok(())
    }

    fn try_alloc(&self, size: usize, s: &'a Stream, raw: bool) -> Result<Handle<'a>, Error> {
        if raw {
            self.dev.alloc_raw(size, s).map(Handle::Raw)
        } else {
            self.dev.alloc(size, s).map(Handle::Block)
        }
    }

    fn free(&mut self, idx: usize, on: usize, us: u64) -> Check {
        let l = self.live.swap_remove(idx);
        if trace() {
            eprintln!(
                "  free {:#x}+{} (s{}, tag {}) on s{on} verify after {us}us",
                l.ptr, l.size, l.stream, l.tag
            );
        }
        if self.kernels {
            let s = self.streams[l.stream].handle();
            let d = Duration::from_micros(us);
            for (off, len, seed) in self.regions(&l) {
                self.sim
                    .launch_verify_pattern(0, s, DevicePtr(l.ptr + off), len, seed, d)
                    .map_err(|e| format!("verify launch: {e}"))?;
            }
        } else {
            self.check_markers(&l)?;
        }
        match l.h {
            Handle::Block(b) => drop(b),
            Handle::Raw(p) => {
                if self.kernels && on != l.stream {
                    // The free is ordered after `on` and recorded streams
                    // only: record the stream the kernels ran on.
                    self.dev
                        .record_stream_raw(p, &self.streams[l.stream])
                        .map_err(|e| format!("record_stream_raw of live {p:?}: {e}"))?;
                }
                self.dev
                    .free_raw(p, &self.streams[on])
                    .map_err(|e| format!("free_raw of live {p:?}: {e}"))?;
                if self.dev.raw_size(p).is_some() {
                    return Err(format!("{p:?} still raw-live after free_raw"));
                }
                self.freed_raw.push(l.ptr);
            }
        }
        self.frees += 1;
        Ok(())
    }

    fn record(&self, l: &Live<'_>, si: usize) -> Check {
        let s = &self.streams[si];
        match &l.h {
            Handle::Block(b) => b.record_stream(s),
            Handle::Raw(p) => self
                .dev
                .record_stream_raw(*p, s)
                .map_err(|e| format!("record_stream_raw of live {p:?}: {e}"))?,
        }
        Ok(())
    }

    fn use_block(&self, l: &Live<'_>, si: usize, us: u64, verify: bool) -> Check {
        let d = Duration::from_micros(us);
        let s = self.streams[si].handle();
        if si != l.stream {
            // Memory is the block's in its stream's order: another stream
            // must wait for that stream (as CUDA callers do), and the free
            // must wait for the other stream.
            self.record(l, si)?;
            let be = self.dev.backend();
            let ev = be.create_event(0).map_err(|e| e.to_string())?;
            be.record_event(0, ev, self.streams[l.stream].handle())
                .and_then(|()| be.stream_wait_event(0, s, ev))
                .and_then(|()| be.destroy_event(0, ev))
                .map_err(|e| format!("event: {e}"))?;
        }
        for (off, len, seed) in self.regions(l) {
            let p = DevicePtr(l.ptr + off);
            let r = if verify {
                self.sim
                    .launch_verify_pattern(0, s, p, len, seed, d)
                    .map(|_| ())
            } else {
                self.sim.launch_write_pattern(0, s, p, len, seed, d)
            };
            r.map_err(|e| format!("kernel launch: {e}"))?;
        }
        Ok(())
    }

    fn bad_free(&mut self, bad: &Bad, si: usize) -> Check {
        let pick = |i: &Pick| -> Option<&Live<'_>> {
            (!self.live.is_empty()).then(|| &self.live[i.index(self.live.len())])
        };
        let (ptr, record) = match bad {
            Bad::Freed(i) if !self.freed_raw.is_empty() => {
                (self.freed_raw[i.index(self.freed_raw.len())], false)
            }
            Bad::Interior(i, off) => match pick(i) {
                Some(l) if l.size > 1 => (l.ptr + 1 + off % (l.size - 1), false),
                _ => return Ok(()),
            },
            Bad::BlockPtr(i) => match pick(i) {
                Some(l) if !l.raw() => (l.ptr, false),
                _ => return Ok(()),
            },
            Bad::Unknown(a) => (*a, false),
            Bad::RecordUnknown(a) => (*a, true),
            Bad::Freed(_) => return Ok(()),
        };
        // A pointer that is (again) the start of a live raw block would be a
        // legitimate call.
        if self.live.iter().any(|l| l.ptr == ptr && l.raw()) {
            return Ok(());
        }
        let before = self.dev.stats();
        let s = &self.streams[si];
        let r = if record {
            self.dev.record_stream_raw(DevicePtr(ptr), s)
        } else {
            self.dev.free_raw(DevicePtr(ptr), s)
        };
        let ok_kind = matches!(
            r,
            Err(Error::DoubleFree { .. }
                | Error::UnknownPointer { .. }
                | Error::InvalidArgument(_))
        );
        if !ok_kind {
            return Err(format!(
                "{bad:?} at {ptr:#x}: expected a typed error, got {r:?}"
            ));
        }
        let after = self.dev.stats();
        if key_stats(&after) != key_stats(&before) {
            return Err(format!(
                "{bad:?} at {ptr:#x} ({r:?}) changed stats: {before:?} -> {after:?}"
            ));
        }
        Ok(())
    }

    fn step(&mut self, op: &Op) -> Check {
        let n = self.live.len();
        match op {
            Op::Alloc { size, stream, raw } => self.alloc(*size, *stream, *raw),
            Op::Free { pick, on, us } if n > 0 => self.free(pick.index(n), *on, *us),
            Op::Record { pick, stream } if n > 0 => self.record(&self.live[pick.index(n)], *stream),
            Op::Use {
                pick,
                stream,
                us,
                verify,
            } if n > 0 && self.kernels => {
                self.use_block(&self.live[pick.index(n)], *stream, *us, *verify)
            }
            Op::Free { .. } | Op::Record { .. } | Op::Use { .. } => Ok(()),
            Op::BadFree { bad, stream } => self.bad_free(bad, *stream),
            Op::Harvest => {
                self.dev.harvest();
                Ok(())
            }
            Op::MarkStep => self.dev.mark_step().map_err(|e| format!("mark_step: {e}")),
            Op::Trim => self
                .dev
                .trim()
                .map(|_| ())
                .map_err(|e| format!("trim: {e}")),
            Op::Sync { stream } => self
                .dev
                .backend()
                .sync_stream(0, self.streams[*stream].handle())
                .map_err(|e| format!("sync: {e}")),
            Op::Stall { stream, us } => self
                .sim
                .stall_stream(
                    0,
                    self.streams[*stream].handle(),
                    Duration::from_micros(*us),
                )
                .map_err(|e| format!("stall: {e}")),
        }
    }

    /// Lets all work finish and checks every live block's markers, frees
    /// everything, then checks the pool gives all memory back.
    fn finish(&mut self) -> Check {
        self.sync_all();
        for l in &self.live {
            self.check_markers(l)?;
        }
        while !self.live.is_empty() {
            self.free(0, 0, 0)?;
        }
        self.sync_all();
        self.check()?;
        self.dev.trim().map_err(|e| format!("final trim: {e}"))?;
        let st = self
            .dev
            .audit()
            .map_err(|e| format!("audit after trim: {e}"))?;
        if st.reserved_bytes.current != 0 || self.sim.used_bytes(0) != 0 {
            return Err(format!(
                "after freeing everything and trim: reserved {}, device memory held {}",
                st.reserved_bytes.current,
                self.sim.used_bytes(0)
            ));
        }
        self.check_device()
    }
}

fn run(ops: &[Op], vmm: bool, kernels: bool) -> Result<(), TestCaseError> {
    let rt = Runtime::builder()
        .backend(BackendKind::Sim(SimConfig {
            devices: 1,
            capacity_bytes: CAPACITY,
            granularity: GRAN,
            vmm,
            ..Default::default()
        }))
        .config(PoolConfig::default())
        // The model compares exact stats around each step: no background
        // harvesting between them.
        .maintenance(false)
        .build()
        .unwrap();
    let dev = rt.device(0).unwrap();
    let sim = dev
        .backend()
        .as_any()
        .downcast_ref::<SimBackend>()
        .expect("simulator");
    let mut streams: Vec<Stream> = (0..STREAMS - 1)
        .map(|_| dev.new_stream().unwrap())
        .collect();
    // Take every remaining stream slot so that the last stream has none.
    let fillers: Vec<Stream> = if vmm {
        (0..61).map(|_| dev.new_stream().unwrap()).collect()
    } else {
        Vec::new()
    };
    streams.push(dev.new_stream().unwrap());
    if vmm {
        let dbg = format!("{:?}", streams[STREAMS - 1]);
        assert!(
            dbg.contains("slot: None"),
            "expected a slotless stream: {dbg}"
        );
    }
    let mut m = Model {
        dev,
        sim,
        streams: &streams,
        vmm,
        kernels,
        edge: if kernels { 256 } else { 8 },
        live: Vec::new(),
        freed_raw: Vec::new(),
        allocs: 0,
        frees: 0,
        next_tag: 0,
    };
    for (i, op) in ops.iter().enumerate() {
        if trace() {
            eprintln!("step {i}: {op:?}");
        }
        m.step(op)
            .and_then(|()| m.check())
            .map_err(|e| TestCaseError::fail(format!("step {i} {op:?}: {e}")))?;
    }
    m.finish()
        .map_err(|e| TestCaseError::fail(format!("at the end: {e}")))?;
    drop(m);
    drop(fillers);
    Ok(())
}

fn trace() -> bool {
    std::env::var_os("MODEL_TRACE").is_some()
}

/// Cases per test: a debug run stays well under 30 s; set `PROPTEST_CASES`
/// for a longer hunt (e.g. with `--release`).
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10)
}

/// Runs of each case (timing-dependent failures shrink better with more).
fn repeat() -> u32 {
    std::env::var("MODEL_REPEAT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
}

fn ops(kernels: bool) -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op_strategy(kernels), 1..200)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn pool_matches_model_vmm(ops in ops(false)) {
        run(&ops, true, false)?;
    }

    #[test]
    fn pool_matches_model_segments(ops in ops(false)) {
        run(&ops, false, false)?;
    }

    #[test]
    fn stream_order_holds_under_delayed_kernels_vmm(ops in ops(true)) {
        for _ in 0..repeat() {
            run(&ops, true, true)?;
        }
    }

    #[test]
    fn stream_order_holds_under_delayed_kernels_segments(ops in ops(true)) {
        for _ in 0..repeat() {
            run(&ops, false, true)?;
        }
    }
}

/// Found by `stream_order_holds_under_delayed_kernels_vmm`, reduced by hand.
///
/// A large block used on two streams is freed (pending on both). A large
/// request on a third stream steals its granules by aliasing: the new stream
/// waits on the block's events, and the stolen granules' old addresses are
/// quarantined "until an event recorded on the requesting stream completes".
/// That event must come after the wait; if it is recorded before it, the
/// quarantine ends (and the old addresses are unmapped and reused) while the
/// block's last use on the other stream has not run yet.
#[test]
fn stolen_granules_stay_mapped_until_the_old_uses_ran() {
    let rt = Runtime::builder()
        .backend(BackendKind::Sim(SimConfig {
            capacity_bytes: CAPACITY,
            granularity: GRAN,
            ..Default::default()
        }))
        .build()
        .unwrap();
    let dev = rt.device(0).unwrap();
    let sim = dev.backend().as_any().downcast_ref::<SimBackend>().unwrap();
    let (s1, s2, s3) = (
        dev.new_stream().unwrap(),
        dev.new_stream().unwrap(),
        dev.new_stream().unwrap(),
    );
    let size = 60 * MIB;
    let b = dev.alloc_raw(size as usize, &s1).unwrap();
    sim.launch_write_pattern(0, s1.handle(), b, 4096, 1, Duration::ZERO)
        .unwrap();
    sim.sync_stream(0, s1.handle()).unwrap();
    // The block's last use: a verify on s2 (ordered after s1's write), late.
    let ev = sim.create_event(0).unwrap();
    sim.record_event(0, ev, s1.handle()).unwrap();
    sim.stream_wait_event(0, s2.handle(), ev).unwrap();
    let late = sim
        .launch_verify_pattern(0, s2.handle(), b, 4096, 1, Duration::from_millis(300))
        .unwrap();
    dev.record_stream_raw(b, &s2).unwrap();
    dev.free_raw(b, &s1).unwrap();
    // 60 MiB more on a 96 MiB device: served by stealing the block's granules.
    let e = dev.alloc_raw(size as usize, &s3).unwrap();
    // Let the quarantine event complete, harvest, and reuse what it freed.
    std::thread::sleep(Duration::from_millis(50));
    dev.harvest();
    let mut others = Vec::new();
    while let Ok(p) = dev.alloc_raw(GRAN as usize, &s3) {
        sim.launch_write_pattern(0, s3.handle(), p, GRAN, 2, Duration::ZERO)
            .unwrap();
        others.push(p);
    }
    sim.sync_stream(0, s2.handle()).unwrap();
    sim.sync_stream(0, s3.handle()).unwrap();
    assert_eq!(
        (late.wait(), sim.device_faults(0), sim.integrity_errors(0)),
        (0, 0, 0),
        "the freed block's last use on s2 ran on unmapped or reused memory"
    );
    for p in others.into_iter().chain([e]) {
        dev.free_raw(p, &s3).unwrap();
    }
}

/// Found by `tests/stress.rs`, reduced by hand.
///
/// A large request on stream s0 that needs fresh physical memory steals the
/// chunk of an idle granule that s0 freed but whose last use on s0 is still
/// queued (aliasing: fine for s0, whose new work runs after the old). The
/// new block ends inside the granule backed by that chunk; the rest of the
/// granule stays free and `Clean`, so a request on s1 gets it at once and
/// writes into physical memory that s0's queued work still reads.
#[test]
fn the_rest_of_an_aliased_granule_is_not_handed_to_another_stream() {
    let rt = Runtime::builder()
        .backend(BackendKind::Sim(SimConfig {
            capacity_bytes: 64 * MIB,
            granularity: GRAN,
            ..Default::default()
        }))
        .build()
        .unwrap();
    let dev = rt.device(0).unwrap();
    let sim = dev.backend().as_any().downcast_ref::<SimBackend>().unwrap();
    let (s0, s1) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let a_len = 3 * MIB;
    let a = dev.alloc(a_len as usize, &s0).unwrap();
    sim.launch_write_pattern(0, s0.handle(), a.ptr(), a_len, 1, Duration::ZERO)
        .unwrap();
    sim.sync_stream(0, s0.handle()).unwrap();
    // A's last use: a verify on s0 that runs late.
    let late = sim
        .launch_verify_pattern(
            0,
            s0.handle(),
            a.ptr(),
            a_len,
            1,
            Duration::from_millis(300),
        )
        .unwrap();
    drop(a);
    // 4.5 MiB on s0: new address space, partly backed by A's idle granule.
    let b = dev.alloc((9 * MIB / 2) as usize, &s0).unwrap();
    // 300 KiB on s1 right after B, in the same granule.
    let c = dev.alloc(300 << 10, &s1).unwrap();
    sim.launch_write_pattern(0, s1.handle(), c.ptr(), 300 << 10, 2, Duration::ZERO)
        .unwrap();
    sim.sync_stream(0, s1.handle()).unwrap();
    sim.sync_stream(0, s0.handle()).unwrap();
    assert_eq!(
        (late.wait(), sim.integrity_errors(0), sim.device_faults(0)),
        (0, 0, 0),
        "s1's new block aliased memory of a block still in use on s0 \
         (B at {:?}, C at {:?})",
        b.ptr(),
        c.ptr()
    );
}
