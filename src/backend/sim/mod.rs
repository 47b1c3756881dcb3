//! The simulator backend: N devices whose memory is real host memory.
//!
//! It is the test bed for everything the CPU machines can check, so it keeps
//! CUDA's semantics rather than approximating them:
//!
//! * **Memory** (`memory.rs`): physical chunks live in a per-device memfd and
//!   are mapped into `PROT_NONE` reservations with `mmap(MAP_FIXED)`, so the
//!   same chunk mapped at two addresses shows the same bytes, and unmapped
//!   addresses really are inaccessible.
//! * **Streams** (`stream.rs`): each stream is a FIFO run by its own thread,
//!   with a configurable delay per operation; events complete exactly when
//!   the work before them on their stream has run; waiting on an event
//!   blocks only the waiting stream.
//! * **Kernels**: [`SimBackend::launch_write_pattern`] and
//!   [`SimBackend::launch_verify_pattern`] write and check byte patterns after
//!   a delay, so a block handed out before its last use finished shows up as
//!   corrupted bytes.
//! * **Faults**: fail the n-th physical allocation, cap the capacity, delay or
//!   fail event operations, stall a stream ([`SimBackend`]'s `fail_*`/`set_*`
//!   methods).
//! * **Counters**: every driver-level call and every host-blocking sync;
//!   with [`SimConfig::driver_time`], each call also takes its modeled time
//!   on the calling thread.
//!
//! Limits of the model: no caches or memory consistency beyond program
//! order per stream, no timing fidelity (delays are wall-clock sleeps), the
//! legacy default stream does not implicitly synchronize with other streams
//! (gpupool only uses non-blocking streams), and kernels from racing streams
//! race on host memory as they would on a device.

mod capture;
mod memory;
mod stream;

pub use stream::{count_mismatches, fill_pattern, pattern_byte, KernelOp, VerifyResult};

use super::{Backend, BackendCounters, Call, CallCounters, DeviceInfo, Move};
use crate::error::{Error, Result};
use crate::ptr::{ChunkHandle, DevicePtr, EventHandle, StreamHandle};
use capture::Checked;
use memory::DeviceMemory;
use parking_lot::{Mutex, RwLock};
use rustc_hash::FxHashMap as HashMap;
use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;
use stream::{Executor, Op, SimEvent, SimStream};

/// How simulated device memory is backed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum SimBacking {
    /// Real host memory (memfd + mmap); kernels and moves touch bytes.
    Memory,
    /// Byte counts only; addresses are not dereferenceable and work on memory
    /// is skipped. For replaying traces larger than host memory.
    Accounting,
}

/// [`SimConfig::queue_depth`]'s default: about a CUDA stream's launch
/// queue (a host runs on the order of a thousand launches ahead before it
/// blocks).
pub const DEFAULT_QUEUE_DEPTH: usize = 1024;

/// Configuration of the simulator.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SimConfig {
    /// Number of simulated devices.
    pub devices: usize,
    /// Memory of each device in bytes.
    pub capacity_bytes: u64,
    /// Physical allocation granularity in bytes (CUDA's is 2 MiB).
    pub granularity: u64,
    /// Whether devices report virtual memory management support; `false`
    /// makes the pool use its plain-segment fallback.
    pub vmm: bool,
    /// Delay before every stream operation runs.
    pub op_delay: Duration,
    /// How memory is backed.
    pub backing: SimBacking,
    /// Operations a stream queues before the host blocks on the next one
    /// (0: no bound). A GPU's launch queue is finite: a host that runs far
    /// ahead of a stream stalls in the launch (or event record) until the
    /// stream drains, which bounds the work, and the frees, in flight. An
    /// unbounded queue lets a fast host pile up memory that no real device
    /// would have pending.
    pub queue_depth: usize,
    /// Run every stream operation inline, at enqueue, on the calling thread
    /// (no worker threads). Work then completes in enqueue order across all
    /// streams, so results are deterministic; meant for trace replays in
    /// accounting mode, where there is no memory to touch and only the order
    /// of events matters. Off by default: the asynchronous model is the
    /// faithful one.
    pub sync_streams: bool,
    /// Spend each driver call's modeled host time (this table's) on the
    /// calling thread, as a device would, instead of returning at once
    /// (`None`, the default: calls are counted and costed in reports
    /// only). With it, a call made under a lock keeps the threads behind
    /// that lock waiting as long as on a GPU: `gpupool stress
    /// --spend-driver-time`.
    #[serde(skip)]
    pub driver_time: Option<Arc<super::CostTable>>,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            devices: 1,
            capacity_bytes: 8 << 30,
            granularity: 2 << 20,
            vmm: true,
            op_delay: Duration::ZERO,
            backing: SimBacking::Memory,
            queue_depth: DEFAULT_QUEUE_DEPTH,
            sync_streams: false,
            driver_time: None,
        }
    }
}

/// Fault-injection and delay knobs of one device, all lock-free.
#[derive(Debug)]
struct Faults {
    /// Physical allocations (chunks and segments) attempted so far.
    physical_calls: AtomicU64,
    /// Fail the physical allocation whose 1-based count equals this (0: off).
    fail_physical_at: AtomicU64,
    /// `cuMemMap` calls attempted since `fail_map_at` was set.
    map_calls: AtomicU64,
    /// Fail the map whose 1-based count equals this (0: off, and maps
    /// are not counted: the hot path pays one load).
    fail_map_at: AtomicU64,
    /// `cuMemUnmap` calls to go before one fails (0: off): the next
    /// `fail_unmap_in`-th fails.
    fail_unmap_in: AtomicU64,
    /// Capacity cap below the configured capacity (`u64::MAX`: none).
    capacity_cap: AtomicU64,
    event_delay_ns: AtomicU64,
    op_delay_ns: AtomicU64,
    /// Extra host time of every `cuMemMap` call (a slow driver).
    map_delay_ns: AtomicU64,
    /// The next N event record/query calls fail.
    failing_event_ops: AtomicU64,
    /// Event records, queries and stream waits since `fail_event_at` was set.
    event_ops: AtomicU64,
    /// Fail the event operation whose 1-based count equals this (0: off).
    fail_event_at: AtomicU64,
}

/// One simulated device.
#[derive(Debug)]
struct SimDevice {
    info: DeviceInfo,
    mem: RwLock<DeviceMemory>,
    faults: Faults,
    integrity_errors: AtomicU64,
    device_faults: AtomicU64,
    /// Graph captures on the device's streams (`capture.rs`).
    capture: capture::CaptureState,
}

/// State shared with the stream workers.
#[derive(Debug)]
struct Shared {
    devices: Vec<SimDevice>,
}

/// The simulator backend. See the module docs for what it models.
#[derive(Debug)]
pub struct SimBackend {
    cfg: SimConfig,
    shared: Arc<Shared>,
    /// Per-device legacy default streams (`StreamHandle(0)`, also named
    /// [`StreamHandle::LEGACY`]).
    default_streams: Vec<Arc<SimStream>>,
    /// Per-thread default streams ([`StreamHandle::PER_THREAD`]): one
    /// stream per (host thread, device), made on the thread's first use,
    /// as CUDA does.
    per_thread: Mutex<HashMap<(std::thread::ThreadId, usize), Arc<SimStream>>>,
    streams: RwLock<HashMap<u64, Arc<SimStream>>>,
    events: RwLock<HashMap<u64, Arc<SimEvent>>>,
    next_handle: AtomicU64,
    counters: CallCounters,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

impl SimBackend {
    /// Creates the simulated devices described by `cfg`.
    pub fn new(cfg: SimConfig) -> Result<SimBackend> {
        if cfg.devices == 0 {
            return Err(Error::InvalidArgument(
                "the simulator needs at least one device".into(),
            ));
        }
        if !cfg.granularity.is_power_of_two() || cfg.granularity < 4096 {
            return Err(Error::InvalidArgument(format!(
                "granularity {} must be a power of two of at least 4096",
                cfg.granularity
            )));
        }
        let devices = (0..cfg.devices)
            .map(|i| {
                Ok(SimDevice {
                    info: DeviceInfo {
                        index: i,
                        name: format!("gpupool-sim-{i}"),
                        total_bytes: cfg.capacity_bytes,
                        pci_bus_id: format!("0000:{:02x}:00.0", 0x10 + i),
                        granularity: cfg.granularity,
                        vmm_supported: cfg.vmm,
                    },
                    mem: RwLock::new(DeviceMemory::new(i, cfg.granularity, cfg.backing)?),
                    faults: Faults {
                        physical_calls: AtomicU64::new(0),
                        fail_physical_at: AtomicU64::new(0),
                        map_calls: AtomicU64::new(0),
                        fail_map_at: AtomicU64::new(0),
                        fail_unmap_in: AtomicU64::new(0),
                        capacity_cap: AtomicU64::new(u64::MAX),
                        event_delay_ns: AtomicU64::new(0),
                        op_delay_ns: AtomicU64::new(cfg.op_delay.as_nanos() as u64),
                        map_delay_ns: AtomicU64::new(0),
                        failing_event_ops: AtomicU64::new(0),
                        event_ops: AtomicU64::new(0),
                        fail_event_at: AtomicU64::new(0),
                    },
                    integrity_errors: AtomicU64::new(0),
                    device_faults: AtomicU64::new(0),
                    capture: capture::CaptureState::default(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut sim = SimBackend {
            shared: Arc::new(Shared { devices }),
            default_streams: Vec::new(),
            per_thread: Mutex::new(HashMap::default()),
            streams: RwLock::new(HashMap::default()),
            events: RwLock::new(HashMap::default()),
            // Handles 0..=2 are the driver's default-stream values.
            next_handle: AtomicU64::new(16),
            counters: CallCounters::default(),
            workers: Mutex::new(Vec::new()),
            cfg,
        };
        sim.default_streams = (0..sim.cfg.devices)
            .map(|d| sim.spawn_stream(d))
            .collect::<Result<_>>()?;
        Ok(sim)
    }

    /// The configuration this simulator was built with.
    pub fn config(&self) -> &SimConfig {
        &self.cfg
    }

    fn spawn_stream(&self, dev: usize) -> Result<Arc<SimStream>> {
        let (tx, rx) = match self.cfg.queue_depth {
            0 => {
                let (tx, rx) = mpsc::channel();
                (stream::Tx::Unbounded(tx), rx)
            }
            n => {
                let (tx, rx) = mpsc::sync_channel(n);
                (stream::Tx::Bounded(tx, n), rx)
            }
        };
        let exec: Arc<dyn Executor> = self.shared.clone();
        let in_flight = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = in_flight.clone();
        let h = std::thread::Builder::new()
            .name(format!("sim-stream-{dev}"))
            .spawn(move || stream::run_worker(dev, rx, exec, counted))
            .map_err(|e| Error::backend("cuStreamCreate", e.to_string()))?;
        self.workers.lock().push(h);
        Ok(Arc::new(SimStream::new(dev, tx, in_flight)))
    }

    /// Whether an event operation on `st` may take the idle-stream
    /// shortcuts: not in synchronous mode (which runs everything inline
    /// anyway), not on the legacy default stream (whose pushes also order
    /// it after the blocking streams), and not while an operation or event
    /// delay is injected (those must be paid on the worker).
    fn inline_ok(&self, dev: usize, st: &Arc<SimStream>) -> bool {
        !self.cfg.sync_streams
            && !Arc::ptr_eq(st, &self.default_streams[dev])
            && self.shared.op_delay(dev).is_zero()
            && self.shared.event_delay(dev).is_zero()
    }

    /// Queues `op` on `st`, or runs it at once in synchronous mode.
    fn push_op(&self, dev: usize, st: &Arc<SimStream>, op: Op) -> Result<()> {
        if !self.cfg.sync_streams && Arc::ptr_eq(st, &self.default_streams[dev]) {
            // CUDA's implicit synchronization: work on the legacy default
            // stream waits for the work already enqueued on every blocking
            // stream, and per-thread default streams are blocking (streams
            // from `create_stream` are non-blocking and do not take part).
            let others: Vec<Arc<SimStream>> = self
                .per_thread
                .lock()
                .iter()
                .filter(|((_, d), _)| *d == dev)
                .map(|(_, s)| s.clone())
                .collect();
            for o in others {
                let marker = Arc::new(SimEvent::new(dev));
                let seq = marker.begin_record();
                if o.push(Op::Complete(marker.clone(), seq)).is_ok() {
                    st.push(Op::Wait(marker, seq))?;
                }
            }
        }
        if self.cfg.sync_streams {
            st.check_open()?;
            stream::execute(dev, op, &*self.shared);
            Ok(())
        } else {
            st.push(op)
        }
    }

    fn dev(&self, dev: usize) -> Result<&SimDevice> {
        self.shared.devices.get(dev).ok_or(Error::InvalidDevice {
            device: dev,
            count: self.shared.devices.len(),
        })
    }

    fn stream(&self, dev: usize, s: StreamHandle) -> Result<Arc<SimStream>> {
        self.dev(dev)?;
        if s.canonical() == StreamHandle(0) {
            return Ok(self.default_streams[dev].clone());
        }
        if s == StreamHandle::PER_THREAD {
            let key = (std::thread::current().id(), dev);
            if let Some(st) = self.per_thread.lock().get(&key) {
                return Ok(st.clone());
            }
            let st = self.spawn_stream(dev)?;
            self.per_thread.lock().insert(key, st.clone());
            return Ok(st);
        }
        match self.streams.read().get(&s.0) {
            Some(st) if st.device == dev => Ok(st.clone()),
            Some(st) => Err(Error::InvalidHandle(format!(
                "stream {} belongs to device {}, not {dev}",
                s.0, st.device
            ))),
            None => Err(Error::InvalidHandle(format!("unknown stream {}", s.0))),
        }
    }

    fn event(&self, dev: usize, e: EventHandle) -> Result<Arc<SimEvent>> {
        self.dev(dev)?;
        match self.events.read().get(&e.0) {
            Some(ev) if ev.device == dev => Ok(ev.clone()),
            Some(ev) => Err(Error::InvalidHandle(format!(
                "event {} belongs to device {}, not {dev}",
                e.0, ev.device
            ))),
            None => Err(Error::InvalidHandle(format!("unknown event {}", e.0))),
        }
    }

    /// Counts one physical allocation and applies the capacity and
    /// fail-at-n faults.
    fn admit_physical(&self, dev: usize, bytes: u64, used: u64) -> Result<()> {
        let d = self.dev(dev)?;
        let n = d.faults.physical_calls.fetch_add(1, Relaxed) + 1;
        if d.faults.fail_physical_at.load(Relaxed) == n {
            return Err(Error::InjectedFault(format!(
                "physical allocation #{n} on device {dev} failed"
            )));
        }
        let capacity = self
            .cfg
            .capacity_bytes
            .min(d.faults.capacity_cap.load(Relaxed));
        if used + bytes > capacity {
            return Err(Error::DeviceOutOfMemory {
                device: dev,
                requested: bytes,
                used,
                capacity,
            });
        }
        Ok(())
    }

    /// The n-th-operation fault of [`SimBackend::fail_nth_event_op`].
    fn nth_event_fault(&self, dev: usize) -> Result<()> {
        let f = &self.dev(dev)?.faults;
        let at = f.fail_event_at.load(Relaxed);
        if at != 0 && f.event_ops.fetch_add(1, Relaxed) + 1 == at {
            return Err(Error::InjectedFault(format!(
                "event operation #{at} on device {dev} failed"
            )));
        }
        Ok(())
    }

    fn event_fault(&self, dev: usize) -> Result<()> {
        self.nth_event_fault(dev)?;
        let f = &self.dev(dev)?.faults.failing_event_ops;
        let took = f
            .fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1))
            .is_ok();
        if took {
            Err(Error::InjectedFault(format!(
                "event operation on device {dev} failed"
            )))
        } else {
            Ok(())
        }
    }

    // ---- fault injection ---------------------------------------------------

    /// Makes the `n`-th physical allocation (chunk or segment) on `dev`,
    /// counted from now with 1 for the next one, fail with
    /// [`Error::InjectedFault`]. `n = 0` turns the fault off.
    pub fn fail_nth_physical(&self, dev: usize, n: u64) -> Result<()> {
        let f = &self.dev(dev)?.faults;
        let base = f.physical_calls.load(Relaxed);
        f.fail_physical_at
            .store(if n == 0 { 0 } else { base + n }, Relaxed);
        Ok(())
    }

    /// Makes the `n`-th `cuMemMap` on `dev`, counted from now with 1 for
    /// the next one, fail with [`Error::InjectedFault`] (nothing mapped).
    /// `n = 0` turns the fault off.
    pub fn fail_nth_map(&self, dev: usize, n: u64) -> Result<()> {
        let f = &self.dev(dev)?.faults;
        f.fail_map_at.store(0, Relaxed);
        f.map_calls.store(0, Relaxed);
        f.fail_map_at.store(n, Relaxed);
        Ok(())
    }

    /// Makes the `n`-th unmap call on `dev` (`cuMemUnmap`, one call per
    /// run of mappings), counted from now with 1 for the next one, fail
    /// with [`Error::InjectedFault`] (nothing unmapped). `n = 0` turns the
    /// fault off.
    pub fn fail_nth_unmap(&self, dev: usize, n: u64) -> Result<()> {
        self.dev(dev)?.faults.fail_unmap_in.store(n, Relaxed);
        Ok(())
    }

    /// An armed [`SimBackend::fail_nth_unmap`]'s error, if this call is
    /// the one that fails.
    fn unmap_fault(d: &SimDevice, dev: usize) -> Result<()> {
        let f = &d.faults.fail_unmap_in;
        let armed = f.fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1));
        match armed {
            Ok(1) => Err(Error::InjectedFault(format!(
                "cuMemUnmap on device {dev} failed"
            ))),
            _ => Ok(()),
        }
    }

    /// Counts `n` maps against an armed [`SimBackend::fail_nth_map`]: the
    /// index among them of the one that fails, with its error, if any.
    fn map_fault(d: &SimDevice, dev: usize, n: u64) -> Option<(u64, Error)> {
        let at = d.faults.fail_map_at.load(Relaxed);
        if at == 0 {
            return None;
        }
        let before = d.faults.map_calls.fetch_add(n, Relaxed);
        if !(before + 1..=before + n).contains(&at) {
            return None;
        }
        // Later maps count on from the failed one (they never fail again).
        d.faults.map_calls.store(at, Relaxed);
        let e = Error::InjectedFault(format!("cuMemMap #{at} on device {dev} failed"));
        Some((at - before - 1, e))
    }

    /// Spends [`SimBackend::set_map_delay`]'s delay, if any.
    fn map_delay(d: &SimDevice) {
        let delay = d.faults.map_delay_ns.load(Relaxed);
        if delay > 0 {
            std::thread::sleep(Duration::from_nanos(delay));
        }
    }

    /// Caps the memory of `dev` below its configured capacity (`None` lifts
    /// the cap). Memory already held stays held.
    pub fn set_capacity_limit(&self, dev: usize, cap: Option<u64>) -> Result<()> {
        self.dev(dev)?
            .faults
            .capacity_cap
            .store(cap.unwrap_or(u64::MAX), Relaxed);
        Ok(())
    }

    /// Delays every event completion on `dev` by `d`.
    pub fn set_event_delay(&self, dev: usize, d: Duration) -> Result<()> {
        self.dev(dev)?
            .faults
            .event_delay_ns
            .store(d.as_nanos() as u64, Relaxed);
        Ok(())
    }

    /// Sets the delay before each stream operation on `dev`.
    pub fn set_op_delay(&self, dev: usize, d: Duration) -> Result<()> {
        self.dev(dev)?
            .faults
            .op_delay_ns
            .store(d.as_nanos() as u64, Relaxed);
        Ok(())
    }

    /// Makes every map call on `dev` take `d` more on the calling thread,
    /// after it is counted and before the mapping exists (a slow driver;
    /// `Duration::ZERO` turns it off).
    pub fn set_map_delay(&self, dev: usize, d: Duration) -> Result<()> {
        self.dev(dev)?
            .faults
            .map_delay_ns
            .store(d.as_nanos() as u64, Relaxed);
        Ok(())
    }

    /// Makes the next `n` event record/query calls on `dev` fail.
    pub fn fail_next_event_ops(&self, dev: usize, n: u64) -> Result<()> {
        self.dev(dev)?.faults.failing_event_ops.store(n, Relaxed);
        Ok(())
    }

    /// Makes the `n`-th event operation on `dev` (event record, event
    /// query or stream wait on an event), counted from now with 1 for the
    /// next one, fail with [`Error::InjectedFault`] (nothing done). `n = 0`
    /// turns the fault off.
    pub fn fail_nth_event_op(&self, dev: usize, n: u64) -> Result<()> {
        let f = &self.dev(dev)?.faults;
        f.fail_event_at.store(0, Relaxed);
        f.event_ops.store(0, Relaxed);
        f.fail_event_at.store(n, Relaxed);
        Ok(())
    }

    /// Stalls `stream`: its next operation waits `d` first.
    /// With nothing queued on it the stream is busy on the clock (see
    /// `stream.rs`), and its stall ends at `d` however the host's
    /// scheduler runs the stream's worker, as a device's kernel would.
    pub fn stall_stream(&self, dev: usize, stream: StreamHandle, d: Duration) -> Result<()> {
        let st = self.stream(dev, stream)?;
        if self.inline_ok(dev, &st) && st.delay_on_clock(d)? {
            return Ok(());
        }
        self.push_op(dev, &st, Op::Delay(d))
    }

    // ---- simulated kernels ---------------------------------------------------

    /// Enqueues a simulated kernel on `[ptr, ptr+len)` that runs after `delay`.
    pub fn launch_kernel(
        &self,
        dev: usize,
        stream: StreamHandle,
        ptr: DevicePtr,
        len: u64,
        delay: Duration,
        op: KernelOp,
    ) -> Result<()> {
        self.push_op(
            dev,
            &self.stream(dev, stream)?,
            Op::Kernel {
                ptr: ptr.0,
                len,
                delay,
                op,
            },
        )
    }

    /// Enqueues a kernel that writes the pattern of `seed` after `delay`.
    pub fn launch_write_pattern(
        &self,
        dev: usize,
        stream: StreamHandle,
        ptr: DevicePtr,
        len: u64,
        seed: u64,
        delay: Duration,
    ) -> Result<()> {
        self.launch_kernel(
            dev,
            stream,
            ptr,
            len,
            delay,
            KernelOp::WritePattern { seed },
        )
    }

    /// Enqueues a kernel that checks the pattern of `seed` after `delay`;
    /// mismatches count as integrity errors of `dev` and in the result.
    pub fn launch_verify_pattern(
        &self,
        dev: usize,
        stream: StreamHandle,
        ptr: DevicePtr,
        len: u64,
        seed: u64,
        delay: Duration,
    ) -> Result<Arc<VerifyResult>> {
        let result = Arc::new(VerifyResult::default());
        let op = KernelOp::VerifyPattern {
            seed,
            result: result.clone(),
        };
        self.launch_kernel(dev, stream, ptr, len, delay, op)?;
        Ok(result)
    }

    /// Bytes that verify kernels found wrong on `dev` so far.
    pub fn integrity_errors(&self, dev: usize) -> u64 {
        self.dev(dev)
            .map_or(0, |d| d.integrity_errors.load(Relaxed))
    }

    /// Accesses by simulated work outside mapped memory on `dev` (CUDA's
    /// illegal-address faults).
    pub fn device_faults(&self, dev: usize) -> u64 {
        self.dev(dev).map_or(0, |d| d.device_faults.load(Relaxed))
    }

    /// Physical bytes held on `dev` (chunks and segments).
    pub fn used_bytes(&self, dev: usize) -> u64 {
        self.dev(dev).map_or(0, |d| d.mem.read().used)
    }
}

impl Drop for SimBackend {
    fn drop(&mut self) {
        for s in &self.default_streams {
            s.close();
        }
        for s in self.per_thread.lock().values() {
            s.close();
        }
        for s in self.streams.read().values() {
            s.close();
        }
        for h in self.workers.lock().drain(..) {
            let _ = h.join();
        }
    }
}

impl Shared {
    fn fault(&self, device: usize) {
        self.devices[device].device_faults.fetch_add(1, Relaxed);
        tracing::warn!(
            device,
            "simulated device fault: access outside mapped memory"
        );
    }
}

impl Executor for Shared {
    fn run_moves(&self, device: usize, moves: &[Move]) {
        let mem = self.devices[device].mem.read();
        if !mem.is_backed() {
            return;
        }
        for m in moves {
            if mem.check_access(m.src.0, m.len).is_err()
                || mem.check_access(m.dst.0, m.len).is_err()
            {
                self.fault(device);
                continue;
            }
            // SAFETY: both ranges are mapped (checked under the memory lock,
            // which map/unmap need exclusively); `copy` allows overlap.
            unsafe { std::ptr::copy(m.src.0 as *const u8, m.dst.0 as *mut u8, m.len as usize) };
        }
    }

    fn run_fill(&self, device: usize, ptr: u64, len: u64, value: u8) {
        let mem = self.devices[device].mem.read();
        if !mem.is_backed() {
            return;
        }
        if mem.check_access(ptr, len).is_err() {
            return self.fault(device);
        }
        // SAFETY: the range is mapped and stays mapped while we hold the lock.
        unsafe { std::ptr::write_bytes(ptr as *mut u8, value, len as usize) };
    }

    fn run_kernel(&self, device: usize, ptr: u64, len: u64, op: &KernelOp) {
        let mem = self.devices[device].mem.read();
        if !mem.is_backed() {
            if let KernelOp::VerifyPattern { result, .. } = op {
                result.set(0);
            }
            return;
        }
        if mem.check_access(ptr, len).is_err() {
            if let KernelOp::VerifyPattern { result, .. } = op {
                result.set(len);
            }
            return self.fault(device);
        }
        if let KernelOp::Axpy { src, alpha } = *op {
            let overlap = src < ptr + len && ptr < src + len;
            if overlap || len % 4 != 0 || mem.check_access(src, len).is_err() {
                return self.fault(device);
            }
            // SAFETY: both ranges are mapped (checked above) and stay so
            // under the lock, and they do not overlap.
            let (d, s) = unsafe {
                (
                    std::slice::from_raw_parts_mut(ptr as *mut u8, len as usize),
                    std::slice::from_raw_parts(src as *const u8, len as usize),
                )
            };
            for (d, s) in d.chunks_exact_mut(4).zip(s.chunks_exact(4)) {
                let v = u32::from_le_bytes([d[0], d[1], d[2], d[3]])
                    .wrapping_add(alpha.wrapping_mul(u32::from_le_bytes([s[0], s[1], s[2], s[3]])));
                d.copy_from_slice(&v.to_le_bytes());
            }
            return;
        }
        // SAFETY: the range is mapped and stays mapped while we hold the
        // lock. Other streams may touch it concurrently only if the pool
        // broke stream order, which is what the verify kernel detects.
        let buf = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len as usize) };
        match op {
            KernelOp::WritePattern { seed } => fill_pattern(buf, *seed),
            KernelOp::VerifyPattern { seed, result } => {
                let bad = count_mismatches(buf, *seed);
                self.devices[device]
                    .integrity_errors
                    .fetch_add(bad, Relaxed);
                result.set(bad);
            }
            KernelOp::Axpy { .. } => unreachable!("handled above"),
        }
    }

    fn op_delay(&self, device: usize) -> Duration {
        Duration::from_nanos(self.devices[device].faults.op_delay_ns.load(Relaxed))
    }

    fn event_delay(&self, device: usize) -> Duration {
        Duration::from_nanos(self.devices[device].faults.event_delay_ns.load(Relaxed))
    }
}

/// Counting driver calls, and spending their time where the config asks.
impl SimBackend {
    /// One call of `call`.
    #[inline]
    fn call(&self, call: Call) {
        self.counters.count(call);
        self.spend(call, 1, 0);
    }

    /// `n` calls of `call` (a run of mappings).
    #[inline]
    fn call_n(&self, call: Call, n: u64) {
        self.counters.count_n(call, n);
        self.spend(call, n, 0);
    }

    /// `n` calls of `call` covering `units` ([`Call::unit`]).
    #[inline]
    fn call_units(&self, call: Call, n: u64, units: u64) {
        self.counters.count_units(call, n, units);
        self.spend(call, n, units);
    }

    /// The calls' modeled time on this thread, with
    /// [`SimConfig::driver_time`] set. Every call site counts before it
    /// takes the simulator's own locks, so that the time spent serializes
    /// only what the caller holds, as a driver call does.
    #[inline]
    fn spend(&self, call: Call, n: u64, units: u64) {
        if let Some(t) = &self.cfg.driver_time {
            t.spend(call, n, units);
        }
    }
}

impl Backend for SimBackend {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn device_count(&self) -> usize {
        self.shared.devices.len()
    }

    fn device_info(&self, dev: usize) -> Result<DeviceInfo> {
        Ok(self.dev(dev)?.info.clone())
    }

    fn can_access_peer(&self, dev: usize, peer: usize) -> Result<bool> {
        self.dev(dev)?;
        self.dev(peer)?;
        Ok(dev != peer)
    }

    fn create_chunk(&self, dev: usize, bytes: u64) -> Result<ChunkHandle> {
        self.call_units(Call::MemCreate, 1, bytes);
        if !self.dev(dev)?.info.vmm_supported {
            return Err(Error::Unsupported(format!("device {dev} has no VMM")));
        }
        let mut mem = self.dev(dev)?.mem.write();
        self.admit_physical(dev, bytes, mem.used)?;
        mem.create_chunk(bytes).map(ChunkHandle)
    }

    fn release_chunk(&self, dev: usize, chunk: ChunkHandle) -> Result<()> {
        self.call(Call::MemRelease);
        self.capture_check(dev, "cuMemRelease", Checked::Release);
        self.dev(dev)?.mem.write().release_chunk(chunk.0)
    }

    fn export_chunk(&self, dev: usize, chunk: ChunkHandle) -> Result<(std::os::fd::OwnedFd, u64)> {
        self.call(Call::MemExport);
        self.dev(dev)?.mem.write().export_chunk(chunk.0)
    }

    fn import_chunk(
        &self,
        dev: usize,
        fd: std::os::fd::BorrowedFd<'_>,
        fd_offset: u64,
        bytes: u64,
    ) -> Result<ChunkHandle> {
        self.call(Call::MemImport);
        if !self.dev(dev)?.info.vmm_supported {
            return Err(Error::Unsupported(format!("device {dev} has no VMM")));
        }
        self.dev(dev)?
            .mem
            .write()
            .import_chunk(fd, fd_offset, bytes)
            .map(ChunkHandle)
    }

    fn alloc_segment(&self, dev: usize, bytes: u64) -> Result<DevicePtr> {
        self.call_units(Call::MemAlloc, 1, bytes);
        let mut mem = self.dev(dev)?.mem.write();
        self.admit_physical(dev, bytes, mem.used)?;
        mem.alloc_segment(bytes).map(DevicePtr)
    }

    fn free_segment(&self, dev: usize, ptr: DevicePtr) -> Result<()> {
        self.call(Call::MemFree);
        self.capture_check(dev, "cuMemFree", Checked::Release);
        self.dev(dev)?.mem.write().free_segment(ptr.0)
    }

    fn reserve_va(&self, dev: usize, bytes: u64) -> Result<DevicePtr> {
        self.call(Call::AddressReserve);
        self.dev(dev)?.mem.write().reserve_va(bytes).map(DevicePtr)
    }

    fn free_va(&self, dev: usize, base: DevicePtr, bytes: u64) -> Result<()> {
        self.call(Call::AddressFree);
        self.capture_check(dev, "cuMemAddressFree", Checked::Release);
        self.dev(dev)?.mem.write().free_va(base.0, bytes)
    }

    fn map(
        &self,
        dev: usize,
        va: DevicePtr,
        bytes: u64,
        chunk: ChunkHandle,
        off: u64,
    ) -> Result<()> {
        self.call(Call::Map);
        // One chunk mapped, and its access granted.
        self.call_units(Call::SetAccess, 1, 1);
        let d = self.dev(dev)?;
        if let Some((_, e)) = Self::map_fault(d, dev, 1) {
            return Err(e);
        }
        Self::map_delay(d);
        d.mem.write().map(va.0, bytes, chunk.0, off)
    }

    fn map_run(&self, dev: usize, va: DevicePtr, gran: u64, chunks: &[ChunkHandle]) -> Result<()> {
        let d = self.dev(dev)?;
        let n = chunks.len() as u64;
        if let Some((k, e)) = Self::map_fault(d, dev, n) {
            // The CUDA backend would have mapped (and then unmapped) the
            // chunks before the failing one.
            self.call_n(Call::Map, k + 1);
            self.call_n(Call::Unmap, k);
            return Err(e);
        }
        self.call_n(Call::Map, n);
        Self::map_delay(d);
        d.mem.write().map_run(va.0, gran, chunks)?;
        // One access grant for the run, as the CUDA backend makes.
        self.call_units(Call::SetAccess, 1, n);
        Ok(())
    }

    fn unmap_run(&self, dev: usize, va: DevicePtr, gran: u64, n: u64) -> Result<()> {
        let d = self.dev(dev)?;
        self.call_n(Call::Unmap, n);
        self.capture_check(dev, "cuMemUnmap", Checked::Release);
        Self::unmap_fault(d, dev)?;
        // The memory table checks the whole run first (a set of whole
        // mappings) and then removes it, as the per-mapping calls would.
        d.mem.write().unmap(va.0, n * gran)
    }

    fn unmap(&self, dev: usize, va: DevicePtr, bytes: u64) -> Result<()> {
        self.call(Call::Unmap);
        self.capture_check(dev, "cuMemUnmap", Checked::Release);
        let d = self.dev(dev)?;
        Self::unmap_fault(d, dev)?;
        d.mem.write().unmap(va.0, bytes)
    }

    fn set_access(&self, dev: usize, va: DevicePtr, bytes: u64, peers: &[usize]) -> Result<()> {
        // The pool maps one chunk per granule: the range covers this many.
        let gran = self.dev(dev).map_or(1, |d| d.info.granularity.max(1));
        self.counters
            .count_units(Call::SetAccess, 1, bytes.div_ceil(gran));
        for &p in peers {
            self.dev(p)?;
        }
        self.dev(dev)?.mem.read().check_access(va.0, bytes)
    }

    fn create_stream(&self, dev: usize) -> Result<StreamHandle> {
        self.call(Call::StreamCreate);
        self.dev(dev)?;
        let s = self.spawn_stream(dev)?;
        let h = self.next_handle.fetch_add(1, Relaxed);
        self.streams.write().insert(h, s);
        Ok(StreamHandle(h))
    }

    fn destroy_stream(&self, dev: usize, stream: StreamHandle) -> Result<()> {
        self.call(Call::StreamDestroy);
        if stream.is_default() {
            return Err(Error::InvalidHandle(
                "a default stream cannot be destroyed".into(),
            ));
        }
        let s = self.stream(dev, stream)?;
        self.streams.write().remove(&stream.0);
        self.dev(dev)?.capture.forget(&s);
        s.close();
        Ok(())
    }

    fn create_event(&self, dev: usize) -> Result<EventHandle> {
        self.call(Call::EventCreate);
        self.dev(dev)?;
        let h = self.next_handle.fetch_add(1, Relaxed);
        self.events.write().insert(h, Arc::new(SimEvent::new(dev)));
        Ok(EventHandle(h))
    }

    fn destroy_event(&self, dev: usize, event: EventHandle) -> Result<()> {
        self.call(Call::EventDestroy);
        self.event(dev, event)?;
        self.events.write().remove(&event.0);
        Ok(())
    }

    fn record_event(&self, dev: usize, event: EventHandle, stream: StreamHandle) -> Result<()> {
        self.call(Call::EventRecord);
        let ev = self.event(dev, event)?;
        let st = self.stream(dev, stream)?;
        self.capture_check(dev, "cuEventRecord", Checked::Record(event, &st));
        self.event_fault(dev)?;
        let seq = ev.begin_record();
        let inline = if self.inline_ok(dev, &st) {
            st.complete_if_idle(&ev, seq)
        } else {
            Ok(false)
        };
        let r = inline.and_then(|done| {
            if done {
                return Ok(());
            }
            self.push_op(dev, &st, Op::Complete(ev.clone(), seq))
        });
        // A record that failed (a destroyed stream) leaves the event as it
        // was, as CUDA's does: a sync on it must not wait for a capture
        // that nothing will complete.
        if r.is_err() {
            ev.abandon(seq);
        }
        r
    }

    fn query_event(&self, dev: usize, event: EventHandle) -> Result<bool> {
        self.call(Call::EventQuery);
        let ev = self.event(dev, event)?;
        self.capture_check(dev, "cuEventQuery", Checked::QueryEvent(event));
        self.event_fault(dev)?;
        Ok(ev.is_complete())
    }

    fn sync_event(&self, dev: usize, event: EventHandle) -> Result<()> {
        self.call(Call::EventSynchronize);
        self.counters.count_host_sync(dev);
        let ev = self.event(dev, event)?;
        self.capture_check(dev, "cuEventSynchronize", Checked::QueryEvent(event));
        ev.wait_for(ev.current());
        Ok(())
    }

    fn stream_wait_event(
        &self,
        dev: usize,
        stream: StreamHandle,
        event: EventHandle,
    ) -> Result<()> {
        self.call(Call::StreamWaitEvent);
        let ev = self.event(dev, event)?;
        let st = self.stream(dev, stream)?;
        self.capture_check(dev, "cuStreamWaitEvent", Checked::OnStream(&st));
        self.nth_event_fault(dev)?;
        let seq = ev.current();
        if self.inline_ok(dev, &st) {
            match ev.capture(seq) {
                // A wait for a completed capture orders nothing: not queued.
                stream::Capture::Done => return st.check_open(),
                // One due on the clock keeps an idle stream busy till then.
                stream::Capture::DueAt(at) if st.wait_on_clock(at)? => return Ok(()),
                _ => {}
            }
        }
        self.push_op(dev, &st, Op::Wait(ev, seq))
    }

    fn sync_stream(&self, dev: usize, stream: StreamHandle) -> Result<()> {
        self.call(Call::StreamSynchronize);
        self.counters.count_host_sync(dev);
        let st = self.stream(dev, stream)?;
        self.capture_check(dev, "cuStreamSynchronize", Checked::SyncStream);
        let marker = Arc::new(SimEvent::new(dev));
        let seq = marker.begin_record();
        self.push_op(dev, &st, Op::Marker(marker.clone(), seq))?;
        marker.wait_for(seq);
        Ok(())
    }

    fn enqueue_moves(&self, dev: usize, stream: StreamHandle, moves: &[Move]) -> Result<()> {
        let moved = moves.iter().map(|m| m.len).sum();
        self.call_units(Call::LaunchMoves, 1, moved);
        let st = self.stream(dev, stream)?;
        self.capture_check(dev, "launchMoves", Checked::OnStream(&st));
        self.push_op(dev, &st, Op::Moves(moves.to_vec()))
    }

    fn enqueue_fill(
        &self,
        dev: usize,
        stream: StreamHandle,
        ptr: DevicePtr,
        bytes: u64,
        value: u8,
    ) -> Result<()> {
        self.call_units(Call::MemsetAsync, 1, bytes);
        let st = self.stream(dev, stream)?;
        self.capture_check(dev, "cuMemsetD8Async", Checked::OnStream(&st));
        self.push_op(
            dev,
            &st,
            Op::Fill {
                ptr: ptr.0,
                len: bytes,
                value,
            },
        )
    }

    fn copy_to_host(&self, dev: usize, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
        self.counters
            .count_units(Call::MemcpyDtoH, 1, dst.len() as u64);
        self.counters.count_host_sync(dev);
        let mem = self.dev(dev)?.mem.read();
        mem.check_access(src.0, dst.len() as u64)?;
        if mem.is_backed() {
            // SAFETY: the source range is mapped and stays so under the lock;
            // `dst` is a distinct host buffer.
            unsafe {
                std::ptr::copy_nonoverlapping(src.0 as *const u8, dst.as_mut_ptr(), dst.len())
            };
        }
        Ok(())
    }

    fn copy_from_host(&self, dev: usize, dst: DevicePtr, src: &[u8]) -> Result<()> {
        self.counters
            .count_units(Call::MemcpyHtoD, 1, src.len() as u64);
        self.counters.count_host_sync(dev);
        let mem = self.dev(dev)?.mem.read();
        mem.check_access(dst.0, src.len() as u64)?;
        if mem.is_backed() {
            // SAFETY: the destination range is mapped and stays so under the
            // lock; `src` is a distinct host buffer.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.0 as *mut u8, src.len()) };
        }
        Ok(())
    }

    fn stream_capturing(&self, dev: usize, stream: StreamHandle) -> Result<bool> {
        self.capturing_now(dev, stream)
    }

    fn query_stream(&self, dev: usize, stream: StreamHandle) -> Result<bool> {
        self.call(Call::StreamQuery);
        let st = self.stream(dev, stream)?;
        self.capture_check(dev, "cuStreamQuery", Checked::QueryStream(&st));
        self.event_fault(dev)?;
        st.is_idle()
    }

    fn counters(&self) -> BackendCounters {
        self.counters.snapshot()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{CallCost, CostTable};
    use std::time::Instant;

    /// With `driver_time`, a call returns no sooner than its modeled time
    /// (per call, and per unit for a size-charged call) and is counted as
    /// without it.
    #[test]
    fn driver_time_spends_each_calls_modeled_time_on_the_caller() {
        let mut t = CostTable::h200();
        let cost = |us, us_per_unit| CallCost { us, us_per_unit };
        t.set(Call::AddressReserve, cost(3000.0, 0.0)).unwrap();
        t.set(Call::MemCreate, cost(0.0, 1000.0)).unwrap();
        let sim = SimBackend::new(SimConfig {
            driver_time: Some(Arc::new(t)),
            ..Default::default()
        })
        .unwrap();
        let start = Instant::now();
        sim.reserve_va(0, 64 << 20).unwrap();
        assert!(start.elapsed() >= Duration::from_millis(3));
        let start = Instant::now();
        // 2 MiB at 1000 µs per MiB.
        let chunk = sim.create_chunk(0, 2 << 20).unwrap();
        assert!(start.elapsed() >= Duration::from_millis(2));
        sim.release_chunk(0, chunk).unwrap();
        let c = sim.counters();
        assert_eq!(
            (c.get(Call::AddressReserve), c.get(Call::MemCreate)),
            (1, 1)
        );
        assert_eq!(c.units_of(Call::MemCreate), 2 << 20);
    }
}
