#![no_main]
//! Random op sequences on a `DevicePool` over the simulator, checked against
//! a tiny reference model (a list of live blocks).
//!
//! Per input: a fresh runtime with one 64 MiB simulated device (VMM or the
//! plain-segment fallback, chosen by the input), `sync_streams` so a run is
//! deterministic, 2 streams, at most 64 ops. Checked: live blocks never
//! overlap and keep their marker bytes; every error is a typed error of the
//! expected kind; bad frees change no stats; allocated bytes and alloc/free
//! counts match the model; reserved == device memory held; `audit()` Ok
//! every 8 ops and at the end; after freeing everything and `trim`,
//! reserved == 0 and the device holds nothing.

use arbitrary::Arbitrary;
use gpupool::backend::sim::{fill_pattern, SimBackend};
use gpupool::backend::Backend;
use gpupool::{
    BackendKind, Block, DevicePool, DevicePtr, Error, PoolConfig, PoolStats, Runtime, SimConfig,
    Stream,
};
use libfuzzer_sys::fuzz_target;

const MIB: u64 = 1 << 20;
const CAPACITY: u64 = 64 * MIB;
const GRAN: u64 = 2 * MIB;
const MAX_OPS: usize = 64;
const AUDIT_EVERY: usize = 8;
/// Marker bytes at each end of a block.
const EDGE: u64 = 8;

const EDGES: [usize; 16] = [
    1,
    255,
    256,
    257,
    1024,
    1025,
    4096,
    (256 << 10) - 1,
    256 << 10,
    (256 << 10) + 1,
    (1 << 20) - 1,
    1 << 20,
    (1 << 20) + 1,
    GRAN as usize - 256,
    GRAN as usize,
    GRAN as usize + 1,
];

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Size {
    Tiny(u16),
    Small(u32),
    Medium(u32),
    Edge(u8),
    /// May or may not fit: Ok or OutOfMemory.
    Big(u32),
    Zero,
    /// Over capacity: InvalidSize.
    Huge(u64),
}

impl Size {
    fn bytes(self) -> usize {
        match self {
            Size::Tiny(n) => 1 + n as usize % 4096,
            Size::Small(n) => 4097 + n as usize % (1 << 20),
            Size::Medium(n) => (1 << 20) + n as usize % (6 << 20),
            Size::Edge(i) => EDGES[i as usize % EDGES.len()],
            Size::Big(n) => (CAPACITY / 4) as usize + n as usize % (3 * CAPACITY as usize / 4 + 1),
            Size::Zero => 0,
            Size::Huge(n) => (CAPACITY as usize + 1).saturating_add(n as usize % (usize::MAX / 2)),
        }
    }
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Bad {
    /// A raw pointer freed before.
    Freed(u16),
    /// A pointer inside a live block.
    Interior(u16, u32),
    /// The pointer of a live RAII block.
    BlockPtr(u16),
    /// Any address.
    Unknown(u64),
    /// `record_stream_raw` on any address.
    RecordUnknown(u64),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Op {
    Alloc { size: Size, stream: bool, raw: bool },
    Free { pick: u16, on: bool },
    Record { pick: u16, stream: bool },
    BadFree { bad: Bad, stream: bool },
    Harvest,
    Trim,
    /// A step boundary: plans are built, followed, departed from and
    /// retired while blocks live.
    MarkStep,
}

#[derive(Arbitrary, Debug)]
struct Input {
    vmm: bool,
    ops: Vec<Op>,
}

enum Handle<'a> {
    Block(Block<'a>),
    Raw(DevicePtr),
}

struct Live<'a> {
    h: Handle<'a>,
    ptr: u64,
    size: u64,
    stream: usize,
    tag: u64,
}

fn key_stats(s: &PoolStats) -> [u64; 10] {
    [
        s.allocated_bytes.current,
        s.active_bytes.current,
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

/// `(offset, len, seed)` of a block's marker regions.
fn regions(size: u64, tag: u64) -> Vec<(u64, u64, u64)> {
    if size <= 2 * EDGE {
        vec![(0, size, tag)]
    } else {
        vec![(0, EDGE, tag), (size - EDGE, EDGE, tag + 1)]
    }
}

fn pattern(seed: u64, len: u64) -> Vec<u8> {
    let mut v = vec![0u8; len as usize];
    fill_pattern(&mut v, seed);
    v
}

struct Model<'a> {
    dev: &'a DevicePool,
    sim: &'a SimBackend,
    streams: &'a [Stream],
    live: Vec<Live<'a>>,
    freed_raw: Vec<u64>,
    allocs: u64,
    frees: u64,
    next_tag: u64,
}

impl<'a> Model<'a> {
    fn check_markers(&self, l: &Live<'_>) {
        for (off, len, seed) in regions(l.size, l.tag) {
            let mut b = vec![0u8; len as usize];
            self.sim
                .copy_to_host(0, DevicePtr(l.ptr + off), &mut b)
                .unwrap_or_else(|e| panic!("live block {:#x}+{} not mapped: {e}", l.ptr, l.size));
            assert!(
                b == pattern(seed, len),
                "live block {:#x}+{} overwritten near offset {off}",
                l.ptr,
                l.size
            );
        }
    }

    fn check(&self, full: bool) {
        let mut spans: Vec<(u64, u64)> = self.live.iter().map(|l| (l.ptr, l.size)).collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            assert!(
                w[0].0 + w[0].1 <= w[1].0,
                "live blocks overlap: {:#x}+{} and {:#x}+{}",
                w[0].0,
                w[0].1,
                w[1].0,
                w[1].1
            );
        }
        for l in &self.live {
            self.check_markers(l);
        }
        let st = if full {
            self.dev.audit().unwrap_or_else(|e| panic!("audit: {e}"))
        } else {
            self.dev.stats()
        };
        let live_bytes: u64 = self.live.iter().map(|l| l.size).sum();
        assert_eq!(st.requested_bytes.current, live_bytes, "requested != model");
        assert_eq!(
            (st.num_allocs, st.num_frees),
            (self.allocs, self.frees),
            "alloc/free counts != model"
        );
        assert!(st.active_bytes.current >= st.allocated_bytes.current);
        let used = self.sim.used_bytes(0);
        assert!(
            st.reserved_bytes.current == used && used <= CAPACITY,
            "reserved {} != device memory held {used}",
            st.reserved_bytes.current
        );
        assert_eq!(self.sim.integrity_errors(0), 0);
        assert_eq!(self.sim.device_faults(0), 0);
    }

    fn alloc(&mut self, size: usize, si: usize, raw: bool) {
        let s = &self.streams[si];
        let before = self.dev.stats();
        let r: Result<(Handle<'a>, u64), Error> = if raw {
            self.dev.alloc_raw(size, s).map(|p| (Handle::Raw(p), p.0))
        } else {
            self.dev.alloc(size, s).map(|b| {
                let p = b.ptr().0;
                assert_eq!(b.size(), size, "Block::size");
                (Handle::Block(b), p)
            })
        };
        if size == 0 || size as u64 > CAPACITY {
            match r {
                Err(Error::InvalidSize { .. }) => {
                    assert_eq!(key_stats(&before), key_stats(&self.dev.stats()), "InvalidSize changed stats");
                }
                other => panic!("alloc({size}) must be InvalidSize, got {:?}", other.map(|x| x.1)),
            }
            return;
        }
        match r {
            Ok((h, ptr)) => {
                if raw {
                    assert_eq!(self.dev.raw_size(DevicePtr(ptr)), Some(size as u64), "raw_size");
                }
                let l = Live { h, ptr, size: size as u64, stream: si, tag: self.next_tag };
                self.next_tag += 2;
                for (off, len, seed) in regions(l.size, l.tag) {
                    self.sim
                        .copy_from_host(0, DevicePtr(ptr + off), &pattern(seed, len))
                        .unwrap_or_else(|e| panic!("new block {ptr:#x}+{size} not writable: {e}"));
                }
                self.allocs += 1;
                self.live.push(l);
            }
            Err(Error::OutOfMemory(_)) | Err(Error::DeviceOutOfMemory { .. }) => {
                let after = self.dev.stats();
                assert_eq!(after.allocated_bytes.current, before.allocated_bytes.current);
                assert_eq!(after.num_allocs, before.num_allocs);
            }
            Err(e) => panic!("alloc({size}): untyped/unexpected error {e:?}"),
        }
    }

    fn free(&mut self, idx: usize, on: usize) {
        let l = self.live.swap_remove(idx);
        self.check_markers(&l);
        match l.h {
            Handle::Block(b) => {
                if on != l.stream {
                    b.record_stream(&self.streams[on]);
                }
                drop(b)
            }
            Handle::Raw(p) => {
                self.dev
                    .free_raw(p, &self.streams[on])
                    .unwrap_or_else(|e| panic!("free_raw of live {p:?}: {e}"));
                assert!(self.dev.raw_size(p).is_none(), "{p:?} still raw-live after free_raw");
                self.freed_raw.push(l.ptr);
            }
        }
        self.frees += 1;
    }

    fn bad_free(&mut self, bad: Bad, si: usize) {
        let n = self.live.len();
        let pick = |i: u16| (n > 0).then(|| &self.live[i as usize % n]);
        let (ptr, record) = match bad {
            Bad::Freed(i) if !self.freed_raw.is_empty() => {
                (self.freed_raw[i as usize % self.freed_raw.len()], false)
            }
            Bad::Freed(_) => return,
            Bad::Interior(i, off) => match pick(i) {
                Some(l) if l.size > 1 => (l.ptr + 1 + off as u64 % (l.size - 1), false),
                _ => return,
            },
            Bad::BlockPtr(i) => match pick(i) {
                Some(l) if matches!(l.h, Handle::Block(_)) => (l.ptr, false),
                _ => return,
            },
            Bad::Unknown(a) => (a, false),
            Bad::RecordUnknown(a) => (a, true),
        };
        // The start of a live raw block would be a legitimate call.
        if self.live.iter().any(|l| l.ptr == ptr && matches!(l.h, Handle::Raw(_))) {
            return;
        }
        let before = self.dev.stats();
        let s = &self.streams[si];
        let r = if record {
            self.dev.record_stream_raw(DevicePtr(ptr), s)
        } else {
            self.dev.free_raw(DevicePtr(ptr), s)
        };
        assert!(
            matches!(
                r,
                Err(Error::DoubleFree { .. } | Error::UnknownPointer { .. } | Error::InvalidArgument(_))
            ),
            "{bad:?} at {ptr:#x}: expected a typed error, got {r:?}"
        );
        assert_eq!(
            key_stats(&before),
            key_stats(&self.dev.stats()),
            "{bad:?} at {ptr:#x} ({r:?}) changed stats"
        );
    }

    fn step(&mut self, op: Op) {
        let n = self.live.len();
        match op {
            Op::Alloc { size, stream, raw } => self.alloc(size.bytes(), stream as usize, raw),
            Op::Free { pick, on } if n > 0 => self.free(pick as usize % n, on as usize),
            Op::Record { pick, stream } if n > 0 => {
                let l = &self.live[pick as usize % n];
                let s = &self.streams[stream as usize];
                match &l.h {
                    Handle::Block(b) => b.record_stream(s),
                    Handle::Raw(p) => self
                        .dev
                        .record_stream_raw(*p, s)
                        .unwrap_or_else(|e| panic!("record_stream_raw of live {p:?}: {e}")),
                }
            }
            Op::Free { .. } | Op::Record { .. } => {}
            Op::BadFree { bad, stream } => self.bad_free(bad, stream as usize),
            Op::Harvest => {
                self.dev.harvest();
            }
            Op::Trim => {
                self.dev.trim().unwrap_or_else(|e| panic!("trim: {e}"));
            }
            Op::MarkStep => {
                self.dev
                    .mark_step()
                    .unwrap_or_else(|e| panic!("mark_step: {e}"));
            }
        }
    }

    fn sync_all(&self) {
        for s in self.streams.iter().chain([self.dev.default_stream()]) {
            self.dev.backend().sync_stream(0, s.handle()).unwrap();
        }
    }

    fn finish(&mut self) {
        self.sync_all();
        self.check(true);
        while !self.live.is_empty() {
            self.free(0, 0);
        }
        self.sync_all();
        self.dev.harvest();
        self.dev.flush_thread_cache();
        self.check(true);
        self.dev.trim().unwrap_or_else(|e| panic!("final trim: {e}"));
        let st = self.dev.audit().unwrap_or_else(|e| panic!("audit after trim: {e}"));
        assert!(
            st.reserved_bytes.current == 0 && self.sim.used_bytes(0) == 0,
            "after freeing everything and trim: reserved {}, device memory held {}",
            st.reserved_bytes.current,
            self.sim.used_bytes(0)
        );
    }
}

fuzz_target!(|input: Input| {
    let rt = Runtime::builder()
        .backend(BackendKind::Sim(SimConfig {
            devices: 1,
            capacity_bytes: CAPACITY,
            granularity: GRAN,
            vmm: input.vmm,
            sync_streams: true,
            ..Default::default()
        }))
        .config(PoolConfig::default())
        // Stats are compared exactly against the model and before/after
        // each bad call: no background maintenance thread may harvest in
        // between (as in tests/model.rs).
        .maintenance(false)
        .build()
        .unwrap();
    let dev = rt.device(0).unwrap();
    let sim = dev
        .backend()
        .as_any()
        .downcast_ref::<SimBackend>()
        .expect("simulator");
    let streams: Vec<Stream> = (0..2).map(|_| dev.new_stream().unwrap()).collect();
    let mut m = Model {
        dev,
        sim,
        streams: &streams,
        live: Vec::new(),
        freed_raw: Vec::new(),
        allocs: 0,
        frees: 0,
        next_tag: 0,
    };
    for (i, op) in input.ops.iter().take(MAX_OPS).enumerate() {
        m.step(*op);
        m.check((i + 1) % AUDIT_EVERY == 0);
    }
    m.finish();
    drop(m);
    drop(streams);
});
