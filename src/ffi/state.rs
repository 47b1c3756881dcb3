//! The process-wide runtime behind the ABI: [`State`] (the [`Runtime`],
//! the streams the ABI knows per device), its lifecycle (`gpupool_init`,
//! `gpupool_shutdown`, `gpupool_device_count`), and the checks every call
//! makes on its device index and stream handle.
//!
//! Invariants:
//! - Every call reaches the runtime in one of two ways for its whole
//!   duration: through its thread's reader slot and [`readers::LIVE`]
//!   (the fast path, no lock: see `readers.rs`), or under a read lock of
//!   [`GLOBAL`] (when there is no live runtime, to say why, and on a
//!   thread whose slot is gone at exit). `gpupool_init` and
//!   `gpupool_shutdown` are the only writers: they take the write lock,
//!   and shutdown clears `LIVE` and waits for the fast-path calls
//!   (`readers::synchronize`) before tearing down, so no call ever sees
//!   a half-torn-down runtime.
//! - The lock is sharded (crossbeam's `ShardedLock`): a reader locks only
//!   its own thread's shard; writers (init, shutdown) lock every shard.
//! - A call made from inside a call on the same thread (an out-of-memory
//!   callback reading statistics) enters no second time: the thread's
//!   `current` (`thread.rs`) holds the outer call's state for exactly as
//!   long as the outer call holds it. Init and shutdown from inside a
//!   call are refused (they would wait for the caller's own call).
//! - Each thread remembers the last few (device, stream) pairs it named
//!   (`recent_streams`), so a call on one of them reads no stream map.
//!   Each memory is valid while the state's generation and the device's
//!   stream epoch are those it recorded: a
//!   removal from a stream map raises the epoch under the map's write
//!   lock, and the removed stream is dropped only after a grace period
//!   (a write lock of [`GLOBAL`], then `readers::synchronize`: every call
//!   that could still hold the old pointer has returned), or, when
//!   removed from inside a call, by the next grace period or the
//!   shutdown. Known streams are boxed, so an insert never moves one.

use super::limits::call_oom_callback;
use super::readers;
use super::status::{status, FResult, Fail, GpupoolStatus};
use super::text::c_str;
use super::thread::{with_thread, FfiThread, LastStream, RECENT_STREAMS};
use crate::config::PoolConfig;
use crate::error::Error;
use crate::pool::{DevicePool, Stream};
use crate::ptr::{DevicePtr, StreamHandle};
use crate::runtime::Runtime;
use crossbeam_utils::sync::ShardedLock;
// Stream handles are addresses the caller made: FxHash is enough (no
// adversary), and SipHash would be the costliest step of a call.
use rustc_hash::FxHashMap as HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{LazyLock, PoisonError};

/// A stream known to the ABI.
pub(super) struct Known {
    pub(super) stream: Stream,
    /// Made by `gpupool_stream_create` (and so destroyable through the ABI).
    pub(super) created: bool,
}

/// Per device: raw stream handle -> stream. Sharded like [`GLOBAL`]: a call
/// on another stream than its thread's previous call reads it.
pub(super) type StreamMap = ShardedLock<HashMap<u64, Box<Known>>>;

/// Everything `gpupool_init` builds.
pub(super) struct State {
    pub(super) rt: Runtime,
    /// Whether the backend is the simulator (no foreign streams there).
    sim: bool,
    /// Per device: the streams the ABI knows.
    pub(super) streams: Vec<StreamMap>,
    /// Per device: whether the pool calls the C out-of-memory callback.
    oom_hooked: Vec<AtomicBool>,
    /// Per device: raised with every removal from its stream map (see the
    /// file's invariants).
    stream_epochs: Vec<AtomicU64>,
    /// Which `gpupool_init` made this state (never 0).
    generation: u64,
    /// Streams removed from inside a call, dropped at the next grace
    /// period. Boxed as in the maps: other threads may still hold a
    /// pointer into the box, so the stream must not move.
    #[allow(clippy::vec_box)]
    graveyard: std::sync::Mutex<Vec<Box<Known>>>,
}

/// Generations of states; 0 is none.
static GENERATIONS: AtomicU64 = AtomicU64::new(1);

impl State {
    /// The stream map of device `dev`, read.
    pub(super) fn read_streams(
        &self,
        dev: usize,
    ) -> crossbeam_utils::sync::ShardedLockReadGuard<'_, HashMap<u64, Box<Known>>> {
        // A panic never happens while a stream map is locked for writing
        // (inserts and removals only); a poisoned map is still consistent.
        self.streams[dev]
            .read()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The stream map of device `dev`, written.
    pub(super) fn write_streams(
        &self,
        dev: usize,
    ) -> crossbeam_utils::sync::ShardedLockWriteGuard<'_, HashMap<u64, Box<Known>>> {
        self.streams[dev]
            .write()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

enum Global {
    Uninit,
    Live(Box<State>),
    Shut,
}

/// The runtime. Calls that find no live state through `readers::LIVE`
/// (none, or a thread past its reader slot) hold a read lock (their
/// thread's shard) for their whole duration; init and shutdown write it
/// (see the file's invariants).
static GLOBAL: LazyLock<ShardedLock<Global>> = LazyLock::new(|| ShardedLock::new(Global::Uninit));

static LOG_INSTALLED: AtomicBool = AtomicBool::new(false);

/// Publishes the state in the thread's `current` for the duration of a
/// call; clears it on return and on unwind.
struct Entered<'t>(&'t FfiThread);

impl<'t> Entered<'t> {
    fn new(t: &'t FfiThread, st: &State) -> Entered<'t> {
        t.current.set(st);
        Entered(t)
    }
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        self.0.current.set(std::ptr::null());
    }
}

/// Runs `f` on the live state (see the file's invariants).
#[inline]
pub(super) fn with_state<T>(f: impl FnOnce(&State) -> FResult<T>) -> FResult<T> {
    with_thread(|t| with_state_in(t, f))
}

/// [`with_state`] with this thread's record already looked up (the hot
/// calls: one thread-local access per call, see `thread.rs`). The fast
/// path calls `f` at one place here and everything else is out of line,
/// so that `f` is inlined into the call.
#[inline(always)]
pub(super) fn with_state_in<T>(t: &FfiThread, f: impl FnOnce(&State) -> FResult<T>) -> FResult<T> {
    if t.current.get().is_null() {
        // The fast path: no lock (see `readers.rs`).
        if let Some(r) = readers::enter(t) {
            let st = r.state();
            let _entered = Entered::new(t, st);
            return f(st);
        }
    }
    with_state_slow(t, f)
}

/// [`with_state_in`] inside a call on this thread (nested) or past the
/// fast path.
#[inline(never)]
fn with_state_slow<T>(t: &FfiThread, f: impl FnOnce(&State) -> FResult<T>) -> FResult<T> {
    let cur = t.current.get();
    if !cur.is_null() {
        // SAFETY: `cur` was published by an outer call on this thread,
        // which keeps the boxed state alive and unmoved until it clears
        // `current`.
        return f(unsafe { &*cur });
    }
    // The locked path: no live state (to say why), or a thread past its
    // slot's release at exit. A panic never happens under the write lock
    // (init and shutdown swap the value); a poisoned lock still holds a
    // consistent value.
    let g = GLOBAL.read().unwrap_or_else(PoisonError::into_inner);
    match &*g {
        Global::Live(s) => {
            let _entered = Entered::new(t, s);
            f(s)
        }
        Global::Uninit => Err(Fail::new(
            GpupoolStatus::NotInitialized,
            "gpupool is not initialized: call gpupool_init first",
        )),
        Global::Shut => Err(Fail::new(
            GpupoolStatus::Shutdown,
            "gpupool is shut down (gpupool_shutdown was called); gpupool_init starts it again",
        )),
    }
}

/// Whether this thread is inside a call (which holds the state).
fn in_call() -> bool {
    with_thread(|t| !t.current.get().is_null())
}

/// Puts `m` first among the thread's recent streams, in place of its
/// entry `i` (the entries before it move one down).
fn put_first(t: &FfiThread, i: usize, m: LastStream) {
    let r = &t.recent_streams;
    for j in (1..=i).rev() {
        r[j].set(r[j - 1].get());
    }
    r[0].set(m);
}

/// Drops a stream removed by [`State::remove_stream`] after a grace period:
/// a write lock of [`GLOBAL`] and `readers::synchronize`, which wait for
/// every call in flight (any of which may hold the stream through its
/// thread's `recent_streams`). From inside a call it is kept until the next
/// grace period or the shutdown instead.
pub(super) fn bury(gone: Option<Box<Known>>) {
    let Some(k) = gone else { return };
    let cur = with_thread(|t| t.current.get());
    if !cur.is_null() {
        // SAFETY: as in `with_state_in`: the outer call holds the state.
        unsafe { &*cur }.keep_until_grace(k);
        return;
    }
    let buried = match write_global("a stream removal") {
        Ok(g) => match &*g {
            Global::Live(st) => {
                std::mem::take(&mut *st.graveyard.lock().unwrap_or_else(PoisonError::into_inner))
            }
            _ => Vec::new(),
        },
        Err(_) => Vec::new(),
    };
    // The write lock waited for the calls on the locked path; the calls
    // that read the state without it are waited for here.
    readers::synchronize();
    // Outside every lock: dropping a stream flushes its free lists (and
    // destroys a stream gpupool made).
    drop(k);
    drop(buried);
}

/// The write lock of [`GLOBAL`], refused inside a call on this thread.
fn write_global(
    what: &str,
) -> FResult<crossbeam_utils::sync::ShardedLockWriteGuard<'static, Global>> {
    if in_call() {
        return Err(Fail::new(
            GpupoolStatus::InvalidArgument,
            format!(
                "{what} cannot be called from inside a gpupool call (an out-of-memory callback)"
            ),
        ));
    }
    Ok(GLOBAL.write().unwrap_or_else(PoisonError::into_inner))
}

fn install_logging() -> FResult<()> {
    let Ok(filter) = std::env::var("GPUPOOL_LOG") else {
        return Ok(());
    };
    if filter.trim().is_empty() || LOG_INSTALLED.load(Ordering::Acquire) {
        return Ok(());
    }
    let parsed = super::log::Filter::parse(&filter).map_err(|msg| {
        Fail::from(Error::Config {
            key: "GPUPOOL_LOG".into(),
            msg,
        })
    })?;
    // Fails only when the process already has a subscriber: keep that one.
    super::log::install(parsed);
    LOG_INSTALLED.store(true, Ordering::Release);
    Ok(())
}

fn init_from(conf: Option<&str>) -> FResult<()> {
    let cfg = match conf {
        Some(s) => PoolConfig::parse(s)?,
        None => PoolConfig::from_env()?,
    };
    init_with(cfg)
}

fn init_with(cfg: PoolConfig) -> FResult<()> {
    install_logging()?;
    let mut g = write_global("gpupool_init")?;
    if let Global::Live(_) = &*g {
        return Err(Fail::new(
            GpupoolStatus::AlreadyInitialized,
            "gpupool is already initialized (call gpupool_shutdown first to restart it)",
        ));
    }
    let rt = Runtime::builder().config(cfg).build()?;
    let sim = rt.backend().name() == "sim";
    tracing::info!(
        backend = rt.backend().name(),
        devices = rt.device_count(),
        "gpupool initialized through the C ABI"
    );
    let streams = (0..rt.device_count())
        .map(|_| ShardedLock::new(HashMap::default()))
        .collect();
    let oom_hooked = (0..rt.device_count())
        .map(|_| AtomicBool::new(false))
        .collect();
    let stream_epochs = (0..rt.device_count()).map(|_| AtomicU64::new(0)).collect();
    *g = Global::Live(Box::new(State {
        rt,
        sim,
        streams,
        oom_hooked,
        stream_epochs,
        generation: GENERATIONS.fetch_add(1, Ordering::Relaxed),
        graveyard: std::sync::Mutex::default(),
    }));
    if let Global::Live(st) = &*g {
        // Published under the write lock, after the value it points into.
        readers::LIVE.store(&**st as *const State as *mut State, Ordering::Release);
    }
    Ok(())
}

/// Initializes from `GPUPOOL_CONF` unless a runtime was started (or shut
/// down): the PyTorch hooks' implicit `gpupool_init`. Where `GPUPOOL_CONF`
/// names no backend (or `auto`), the backend is CUDA: memory handed to
/// PyTorch is device memory or an error, never the simulator's host
/// memory, unless `backend=sim` is asked for by name.
pub(super) fn ensure_init() -> FResult<()> {
    let uninit = !in_call()
        && matches!(
            &*GLOBAL.read().unwrap_or_else(PoisonError::into_inner),
            Global::Uninit
        );
    if uninit {
        let mut cfg = PoolConfig::from_env()?;
        if matches!(cfg.backend, crate::config::BackendKind::Auto) {
            cfg.backend = crate::config::BackendKind::Cuda;
        }
        match init_with(cfg) {
            Err(f) if f.status == GpupoolStatus::AlreadyInitialized => {}
            other => other?,
        }
    }
    Ok(())
}

impl State {
    #[inline]
    pub(super) fn pool(&self, device: c_int) -> FResult<&DevicePool> {
        let n = self.rt.device_count();
        let d = usize::try_from(device)
            .ok()
            .filter(|&d| d < n)
            .ok_or_else(|| {
                Fail::new(
                    GpupoolStatus::InvalidDevice,
                    format!("invalid device {device}: {n} device(s) present"),
                )
            })?;
        // Built on first use; the C out-of-memory callback is hooked to
        // each pool once, when the ABI first sees it.
        let pool = self.rt.device(d)?;
        // A load first: the swap is a write to a line every thread shares,
        // and this runs on every call.
        if !self.oom_hooked[d].load(Ordering::Acquire)
            && !self.oom_hooked[d].swap(true, Ordering::AcqRel)
        {
            pool.on_oom(Box::new(call_oom_callback));
        }
        Ok(pool)
    }

    /// Runs `f` with the pool of `device` and the stream `handle` of it.
    #[inline]
    pub(super) fn with_stream<T>(
        &self,
        device: c_int,
        handle: *mut c_void,
        f: impl FnOnce(&DevicePool, &Stream) -> FResult<T>,
    ) -> FResult<T> {
        with_thread(|t| self.with_stream_for(t, device, handle, None, f))
    }

    /// [`State::with_stream`] with this thread's record already looked up.
    #[inline(always)]
    pub(super) fn with_stream_in<T>(
        &self,
        t: &FfiThread,
        device: c_int,
        handle: *mut c_void,
        f: impl FnOnce(&DevicePool, &Stream) -> FResult<T>,
    ) -> FResult<T> {
        self.with_stream_for(t, device, handle, None, f)
    }

    /// [`State::with_stream`] for a call on the pointer `addr` (free,
    /// record_stream): fails as an unknown (or wrong-device) pointer,
    /// building nothing, when `device`'s pool was never built (see
    /// [`State::require_built`]). The check runs past this thread's last
    /// stream only: a remembered stream's pool is built.
    #[inline]
    pub(super) fn with_pointer_stream<T>(
        &self,
        device: c_int,
        handle: *mut c_void,
        addr: u64,
        f: impl FnOnce(&DevicePool, &Stream) -> FResult<T>,
    ) -> FResult<T> {
        with_thread(|t| self.with_stream_for(t, device, handle, Some(addr), f))
    }

    /// [`State::with_pointer_stream`] with this thread's record already
    /// looked up.
    #[inline(always)]
    pub(super) fn with_pointer_stream_in<T>(
        &self,
        t: &FfiThread,
        device: c_int,
        handle: *mut c_void,
        addr: u64,
        f: impl FnOnce(&DevicePool, &Stream) -> FResult<T>,
    ) -> FResult<T> {
        self.with_stream_for(t, device, handle, Some(addr), f)
    }

    /// Whether `m` is a valid memory of (`device`, `h`) for this state
    /// (same generation, the device's stream epoch unchanged).
    #[inline(always)]
    fn remembers(&self, m: &LastStream, device: c_int, h: u64) -> bool {
        m.generation == self.generation
            && m.device == device
            && m.handle == h
            && usize::try_from(device)
                .ok()
                .and_then(|d| self.stream_epochs.get(d))
                .is_some_and(|e| e.load(Ordering::Acquire) == m.epoch)
    }

    /// A valid memory of (`device`, `h`) among the thread's other recent
    /// streams, moved to the front (the others one down).
    #[cold]
    #[inline(never)]
    fn recall(
        &self,
        t: &FfiThread,
        device: c_int,
        h: u64,
    ) -> Option<(*const DevicePool, *const Stream)> {
        let r = &t.recent_streams;
        let i = (1..RECENT_STREAMS).find(|&i| self.remembers(&r[i].get(), device, h))?;
        let m = r[i].get();
        put_first(t, i, m);
        Some((m.pool, m.stream))
    }

    #[inline(always)]
    fn with_stream_for<T>(
        &self,
        t: &FfiThread,
        device: c_int,
        handle: *mut c_void,
        pointer: Option<u64>,
        f: impl FnOnce(&DevicePool, &Stream) -> FResult<T>,
    ) -> FResult<T> {
        let h = handle as usize as u64;
        let last = t.recent_streams[0].get();
        let found = if self.remembers(&last, device, h) {
            Some((last.pool, last.stream))
        } else {
            self.recall(t, device, h)
        };
        if let Some((pool, stream)) = found {
            // SAFETY: recorded by this thread for this very state (same
            // generation), which outlives the call (the caller holds it).
            // The pool lives as long as the state; the stream is the
            // default stream of that pool or a boxed entry of the
            // device's map, not removed since (same epoch), or removed
            // but not yet dropped: a removed stream is dropped only after
            // a grace period, which waits for this call (see the file's
            // invariants).
            let (pool, stream) = unsafe { (&*pool, &*stream) };
            return f(pool, stream);
        }
        if let Some(addr) = pointer {
            self.require_built(device, addr)?;
        }
        self.with_stream_looked_up(t, device, h, f)
    }

    /// [`State::with_stream`] past this thread's last stream: the device's
    /// pool and its stream map (out of line, so that a call on the last
    /// stream inlines only the check above).
    #[inline(never)]
    fn with_stream_looked_up<T>(
        &self,
        t: &FfiThread,
        device: c_int,
        h: u64,
        f: impl FnOnce(&DevicePool, &Stream) -> FResult<T>,
    ) -> FResult<T> {
        let pool = self.pool(device)?;
        let dev = pool.device();
        let remember = |stream: &Stream, epoch: u64| {
            // The least recent memory goes.
            put_first(
                t,
                RECENT_STREAMS - 1,
                LastStream {
                    generation: self.generation,
                    device,
                    handle: h,
                    epoch,
                    pool,
                    stream,
                },
            )
        };
        if StreamHandle(h).canonical() == StreamHandle(0) {
            let epoch = self.stream_epochs[dev].load(Ordering::Acquire);
            remember(pool.default_stream(), epoch);
            return f(pool, pool.default_stream());
        }
        if StreamHandle(h) == StreamHandle::PER_THREAD {
            // The calling thread's default stream: a wrapper per call, bound
            // to this thread (it has no slot, so this costs no retirement).
            let s = pool.stream_from_raw(StreamHandle::PER_THREAD);
            return f(pool, &s);
        }
        {
            let m = self.read_streams(dev);
            if let Some(k) = m.get(&h) {
                // Read under the map's lock: a removal raises it under the
                // write lock.
                let epoch = self.stream_epochs[dev].load(Ordering::Acquire);
                let stream: *const Stream = &k.stream;
                drop(m);
                remember(
                    // SAFETY: boxed in the map; dropped only after a grace
                    // period, which waits for this call.
                    unsafe { &*stream },
                    epoch,
                );
                // SAFETY: as above.
                return f(pool, unsafe { &*stream });
            }
        }
        if let Some(other) =
            (0..self.streams.len()).find(|&d| d != dev && self.read_streams(d).contains_key(&h))
        {
            return Err(Fail::new(
                GpupoolStatus::InvalidHandle,
                format!("stream {h:#x} belongs to device {other}, not device {dev}"),
            ));
        }
        if self.sim {
            return Err(Fail::new(
                GpupoolStatus::InvalidHandle,
                format!(
                    "unknown stream {h:#x} on device {dev}: the simulator only knows NULL \
                     (the default stream) and streams from gpupool_stream_create"
                ),
            ));
        }
        // A stream created elsewhere (PyTorch's): wrap it once, keep it.
        let stream = {
            let mut m = self.write_streams(dev);
            m.entry(h)
                .or_insert_with(|| {
                    Box::new(Known {
                        stream: pool.stream_from_raw(StreamHandle(h)),
                        created: false,
                    })
                })
                .stream
                .clone()
        };
        f(pool, &stream)
    }

    /// Removes stream `h` of device `dev` from its map if `take(entry)`
    /// says so (under the map's write lock, raising the device's stream
    /// epoch): `Ok` with the entry, to be passed to [`bury`] once the call
    /// has returned; `Err` with whether the map held `h`.
    pub(super) fn remove_stream(
        &self,
        dev: usize,
        h: u64,
        take: impl FnOnce(&Known) -> FResult<()>,
    ) -> FResult<Option<Box<Known>>> {
        let mut m = self.write_streams(dev);
        let Some(k) = m.get(&h) else {
            return Ok(None);
        };
        take(k)?;
        let gone = m.remove(&h);
        self.stream_epochs[dev].fetch_add(1, Ordering::Release);
        Ok(gone)
    }

    /// Keeps a removed stream until the next grace period (a removal made
    /// from inside a call).
    fn keep_until_grace(&self, k: Box<Known>) {
        self.graveyard
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(k);
    }

    /// The device (other than `dev`) on which `addr` is a live raw
    /// allocation, if any.
    fn owner_of(&self, addr: u64, dev: usize) -> Option<usize> {
        self.rt
            .active_devices()
            .into_iter()
            .find(|p| p.device() != dev && p.raw_size(DevicePtr(addr)).is_some())
            .map(|p| p.device())
    }

    /// For calls on a pointer (free, record_stream): fails as an unknown
    /// (or wrong-device) pointer when `device`'s pool was never built, so
    /// that a pointer presented to the wrong device builds no pool there
    /// (bad input changes nothing, no driver call included).
    fn require_built(&self, device: c_int, addr: u64) -> FResult<()> {
        match usize::try_from(device) {
            Ok(d) if d < self.rt.device_count() && self.rt.built_device(d).is_none() => Err(self
                .classify(
                    Error::UnknownPointer {
                        ptr: addr,
                        device: d,
                    },
                    addr,
                    d,
                )),
            // Built, or invalid: `pool` reports the invalid device.
            _ => Ok(()),
        }
    }

    /// Turns an unknown-pointer error into a wrong-device one when the
    /// pointer is live on another device.
    pub(super) fn classify(&self, e: Error, addr: u64, dev: usize) -> Fail {
        if let Error::UnknownPointer { .. } = e {
            if let Some(owner) = self.owner_of(addr, dev) {
                return Fail::new(
                    GpupoolStatus::WrongDevice,
                    format!(
                        "pointer {addr:#x} was allocated on device {owner}, not on device {dev}"
                    ),
                );
            }
        }
        e.into()
    }
}

/// The devices `device` names: all of them for `-1`, else the one checked.
pub(super) fn check_device_or_all(st: &State, device: c_int) -> FResult<Vec<usize>> {
    if device == -1 {
        Ok((0..st.rt.device_count()).collect())
    } else {
        Ok(vec![st.pool(device)?.device()])
    }
}

// ---- lifecycle ----------------------------------------------------------------------------

/// Starts the runtime.
///
/// `conf` is a `GPUPOOL_CONF`-style string (`"backend=sim,devices=2,capacity=256MiB"`;
/// `backend=cuda|sim|auto` plus the pool's keys); `NULL` reads the
/// `GPUPOOL_CONF` environment variable (defaults where unset). Returns
/// `GPUPOOL_STATUS_CONFIG` naming the bad key, `GPUPOOL_STATUS_NO_DRIVER` for
/// `backend=cuda` without a GPU, `GPUPOOL_STATUS_ALREADY_INITIALIZED` when a
/// runtime is running, `GPUPOOL_STATUS_INVALID_ARGUMENT` from inside a
/// gpupool call (an out-of-memory callback). After `gpupool_shutdown` it
/// starts a fresh runtime.
///
/// # Safety
/// `conf` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn gpupool_init(conf: *const c_char) -> c_int {
    status("gpupool_init", || {
        let conf = if conf.is_null() {
            None
        } else {
            // SAFETY: non-NULL, NUL-terminated by the caller's contract.
            Some(unsafe { c_str(conf, "conf") }?)
        };
        init_from(conf)
    })
}

/// Stops the runtime: waits for calls in flight, then releases every pool,
/// stream and byte of device memory. Pointers still live become invalid.
/// Later calls return `GPUPOOL_STATUS_SHUTDOWN` until `gpupool_init` runs
/// again. From inside a gpupool call (an out-of-memory callback) it is
/// refused with `GPUPOOL_STATUS_INVALID_ARGUMENT`: it would wait for that
/// very call.
#[no_mangle]
pub extern "C" fn gpupool_shutdown() -> c_int {
    status("gpupool_shutdown", || {
        let old = {
            let mut g = write_global("gpupool_shutdown")?;
            match &mut *g {
                live @ Global::Live(_) => {
                    readers::LIVE.store(std::ptr::null_mut(), Ordering::Release);
                    std::mem::replace(live, Global::Shut)
                }
                Global::Uninit => {
                    return Err(Fail::new(
                        GpupoolStatus::NotInitialized,
                        "gpupool is not initialized: nothing to shut down",
                    ))
                }
                Global::Shut => {
                    return Err(Fail::new(
                        GpupoolStatus::Shutdown,
                        "gpupool is already shut down",
                    ))
                }
            }
        };
        // Calls that read the state without the lock (`readers.rs`).
        readers::synchronize();
        if let Global::Live(st) = old {
            for p in st.rt.active_devices() {
                let live = p.stats().requested_bytes.current;
                if live > 0 {
                    tracing::warn!(
                        device = p.device(),
                        live,
                        "gpupool_shutdown with live allocations; their pointers are now invalid"
                    );
                }
            }
            st.rt.shutdown();
            drop(st);
        }
        Ok(())
    })
}

/// Number of devices of the running runtime, into `*out`.
///
/// # Safety
/// `out` is NULL or valid for one `int` write.
#[no_mangle]
pub unsafe extern "C" fn gpupool_device_count(out: *mut c_int) -> c_int {
    status("gpupool_device_count", || {
        if out.is_null() {
            return Err(Fail::null("out"));
        }
        with_state(|st| {
            let n = c_int::try_from(st.rt.device_count()).unwrap_or(c_int::MAX);
            // SAFETY: `out` is non-NULL and valid for writes (caller's contract).
            unsafe { out.write(n) };
            Ok(())
        })
    })
}
