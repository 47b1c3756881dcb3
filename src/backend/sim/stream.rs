//! Simulated streams and events.
//!
//! Each stream is a FIFO of operations run by its own worker thread, so work
//! really is asynchronous to the host: `record_event` returns at once and the
//! event completes only when the worker reaches it. Every `record` is a new
//! capture with its own sequence number, pending until the worker reaches
//! it. The event is complete when its latest capture is, which gives CUDA's
//! rules: an event never recorded is complete, and re-recording replaces the
//! earlier capture. A stream waiting on an event waits for the capture that
//! was latest at enqueue time (not for a later re-record on another stream,
//! which may complete first), and blocks only its own worker.
//!
//! Time-only work on a stream with nothing queued (a stalled stream, a
//! kernel modeled by its length) runs on the clock instead of the worker:
//! the stream is busy until a deadline, an event recorded meanwhile
//! completes at it, and a stream that waits on such an event is busy until
//! then too. On a device a 20 us kernel keeps its stream 20 us; a sleeping
//! worker would keep it until the host's scheduler woke it again, which on
//! a loaded machine is milliseconds, and every stream would read busy far
//! longer than a GPU's. Work queued behind a deadline waits for it on the
//! worker ([`Op::Until`]).

use crate::backend::Move;
use crate::clock::now_ns as clock_ns;
use crate::error::{Error, Result};
use parking_lot::{Condvar, Mutex};
use std::sync::atomic::AtomicU64;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Release};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

/// State of one event, shared by the host and the stream workers.
#[derive(Debug, Default)]
pub(crate) struct SimEvent {
    pub(crate) device: usize,
    state: Mutex<EventState>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct EventState {
    /// Sequence number of the latest capture.
    recorded: u64,
    /// Captures whose work has not run yet.
    pending: std::collections::BTreeSet<u64>,
    /// Pending captures that complete on the clock: `(seq, at)` (recorded
    /// on a stream busy only until `at`, see [`SimStream::complete_if_idle`]).
    due: Vec<(u64, u64)>,
}

impl EventState {
    /// When pending capture `seq` completes on the clock, if it does.
    fn due_at(&self, seq: u64) -> Option<u64> {
        self.due.iter().find(|&&(q, _)| q == seq).map(|&(_, at)| at)
    }

    /// Completes the captures due by now.
    fn settle(&mut self) {
        if self.due.is_empty() {
            return;
        }
        let now = clock_ns();
        let pending = &mut self.pending;
        self.due.retain(|&(seq, at)| {
            if at > now {
                return true;
            }
            pending.remove(&seq);
            false
        });
    }
}

/// Where one capture of an event stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Capture {
    /// Complete (or never recorded).
    Done,
    /// Completes on the clock at this time ([`clock_ns`]).
    DueAt(u64),
    /// Behind work queued on its stream.
    Queued,
}

impl SimEvent {
    pub(crate) fn new(device: usize) -> Self {
        SimEvent {
            device,
            ..Default::default()
        }
    }

    /// Starts a new capture; returns its sequence number.
    pub(crate) fn begin_record(&self) -> u64 {
        let mut s = self.state.lock();
        s.recorded += 1;
        let seq = s.recorded;
        s.pending.insert(seq);
        seq
    }

    /// The capture a waiter must see complete.
    pub(crate) fn current(&self) -> u64 {
        self.state.lock().recorded
    }

    pub(crate) fn is_complete(&self) -> bool {
        let mut s = self.state.lock();
        s.settle();
        !s.pending.contains(&s.recorded)
    }

    /// Where capture `seq` stands (a capture never recorded is done).
    pub(crate) fn capture(&self, seq: u64) -> Capture {
        let mut s = self.state.lock();
        s.settle();
        if !s.pending.contains(&seq) {
            return Capture::Done;
        }
        s.due_at(seq).map_or(Capture::Queued, Capture::DueAt)
    }

    fn complete(&self, seq: u64) {
        let mut s = self.state.lock();
        s.pending.remove(&seq);
        self.cv.notify_all();
    }

    /// Undoes [`SimEvent::begin_record`] of `seq`, whose record failed:
    /// the event reads as before it (unless recorded again since).
    pub(crate) fn abandon(&self, seq: u64) {
        let mut s = self.state.lock();
        s.pending.remove(&seq);
        if s.recorded == seq {
            s.recorded = seq - 1;
        }
        self.cv.notify_all();
    }

    /// Capture `seq` completes on the clock at `at`. Captures already due
    /// are settled first, so an event recorded again and again and never
    /// queried keeps only those still to complete.
    fn complete_at(&self, seq: u64, at: u64) {
        let mut s = self.state.lock();
        s.settle();
        s.due.push((seq, at));
        // A waiter that found the capture pending before it was due waits
        // with no timeout: it must look again, and wait until `at`.
        self.cv.notify_all();
    }

    /// Blocks until capture `seq` has completed.
    pub(crate) fn wait_for(&self, seq: u64) {
        let mut s = self.state.lock();
        loop {
            s.settle();
            if !s.pending.contains(&seq) {
                return;
            }
            match s.due_at(seq) {
                Some(at) => {
                    let left = Duration::from_nanos(at.saturating_sub(clock_ns()));
                    self.cv.wait_for(&mut s, left);
                }
                None => self.cv.wait(&mut s),
            }
        }
    }
}

/// A simulated kernel over device memory.
#[derive(Debug, Clone)]
pub enum KernelOp {
    /// Writes the pattern of `seed` over the range.
    WritePattern {
        /// Pattern seed.
        seed: u64,
    },
    /// Checks the range holds the pattern of `seed`; a mismatch counts as an
    /// integrity error on the device and in `result`.
    VerifyPattern {
        /// Pattern seed.
        seed: u64,
        /// Where the outcome is reported.
        result: Arc<VerifyResult>,
    },
    /// `dst[i] += alpha * src[i]` over little-endian `u32` words, modulo
    /// 2^32, where the range is `dst` (a whole number of words) and `src`
    /// starts at this address, as long, not overlapping it. Gradient
    /// accumulation and optimizer updates of the training harness.
    Axpy {
        /// Start of the source range.
        src: u64,
        /// Multiplier.
        alpha: u32,
    },
}

/// Outcome of a verify kernel, readable by the host once it ran.
#[derive(Debug, Default)]
pub struct VerifyResult {
    done: Mutex<Option<u64>>,
    cv: Condvar,
}

impl VerifyResult {
    pub(crate) fn set(&self, mismatched_bytes: u64) {
        *self.done.lock() = Some(mismatched_bytes);
        self.cv.notify_all();
    }

    /// Mismatched bytes, or `None` while the kernel has not run.
    pub fn mismatches(&self) -> Option<u64> {
        *self.done.lock()
    }

    /// Blocks until the kernel ran; returns mismatched bytes.
    pub fn wait(&self) -> u64 {
        let mut d = self.done.lock();
        loop {
            if let Some(v) = *d {
                return v;
            }
            self.cv.wait(&mut d);
        }
    }
}

/// One queued operation.
#[derive(Debug)]
pub(crate) enum Op {
    /// Sleep (a stalled stream, or a slow kernel).
    Delay(Duration),
    /// Sleep until this time on [`clock_ns`]: the rest of a deadline that
    /// work was queued behind.
    Until(u64),
    /// Mark an event capture complete, after an optional injected delay.
    Complete(Arc<SimEvent>, u64),
    /// Block this stream until an event capture completes.
    Wait(Arc<SimEvent>, u64),
    /// A batch of moves, run in order.
    Moves(Vec<Move>),
    /// A byte fill.
    Fill { ptr: u64, len: u64, value: u8 },
    /// A simulated kernel after a delay.
    Kernel {
        ptr: u64,
        len: u64,
        delay: Duration,
        op: KernelOp,
    },
    /// Signals the host that everything before it ran.
    Marker(Arc<SimEvent>, u64),
}

/// The sending end of a stream's queue: bounded like a launch queue (a
/// full queue blocks the host until the worker drains one operation), or
/// not.
#[derive(Debug)]
pub(crate) enum Tx {
    /// With the queue's depth.
    Bounded(mpsc::SyncSender<Op>, usize),
    Unbounded(mpsc::Sender<Op>),
}

impl Tx {
    /// How many operations the queue holds before a push blocks.
    fn depth(&self) -> Option<usize> {
        match self {
            Tx::Bounded(_, n) => Some(*n),
            Tx::Unbounded(_) => None,
        }
    }

    fn send(&self, op: Op) -> std::result::Result<(), mpsc::SendError<Op>> {
        match self {
            Tx::Bounded(t, _) => t.send(op),
            Tx::Unbounded(t) => t.send(op),
        }
    }
}

/// The host side of a stream: its queue.
///
/// A worker never takes a lock a host holds while it pushes, and a wait
/// it runs names an event capture whose completion was queued before the
/// wait was (record returns after its push): so a full queue always
/// drains, and blocking the pusher cannot deadlock.
///
/// `in_flight` counts the operations pushed and not yet run: the worker
/// lowers it after running each. At 0 the stream is idle, and an event
/// recorded on it completes at once, without a trip through the queue
/// ([`SimStream::complete_if_idle`]): on a device such a record completes
/// within microseconds, and here it spares a thread wake-up per record.
///
/// `busy_until` is the deadline of time-only work run on the clock (see
/// the module's header): written under the queue's lock, and moved onto
/// the queue as an [`Op::Until`] before any work pushed while it lies
/// ahead, so the worker runs that work after it.
#[derive(Debug)]
pub(crate) struct SimStream {
    pub(crate) device: usize,
    tx: Mutex<Option<Tx>>,
    in_flight: Arc<AtomicUsize>,
    busy_until: AtomicU64,
    /// When each operation taken on the clock behind an earlier one (a
    /// record, a wait, a stall) completes, in order: until then it would
    /// hold a place in a launch queue, and at the queue's depth the host
    /// waits for the first to complete (see [`SimStream::lock_with_room`]).
    /// Locked inside `tx`'s lock.
    on_clock: Mutex<std::collections::VecDeque<u64>>,
}

impl SimStream {
    /// The host side of a queue whose worker lowers `in_flight` after each
    /// operation it runs (see [`run_worker`]).
    pub(crate) fn new(device: usize, tx: Tx, in_flight: Arc<AtomicUsize>) -> Self {
        SimStream {
            device,
            tx: Mutex::new(Some(tx)),
            in_flight,
            busy_until: AtomicU64::new(0),
            on_clock: Mutex::new(Default::default()),
        }
    }

    /// The queue's lock, with room for one more operation on the clock:
    /// while the queue's depth of them are still to complete, the host
    /// waits for the first, as a full launch queue blocks it until the
    /// stream runs one more.
    fn lock_with_room(&self) -> Result<parking_lot::MutexGuard<'_, Option<Tx>>> {
        loop {
            let tx = self.tx.lock();
            let Some(q) = tx.as_ref() else {
                return Err(Error::InvalidHandle("stream was destroyed".into()));
            };
            let mut c = self.on_clock.lock();
            if c.is_empty() {
                drop(c);
                return Ok(tx);
            }
            let now = clock_ns();
            let first = {
                while c.front().is_some_and(|&t| t <= now) {
                    c.pop_front();
                }
                match q.depth() {
                    Some(d) if c.len() >= d => c.front().copied(),
                    _ => None,
                }
            };
            drop(c);
            let Some(first) = first else {
                return Ok(tx);
            };
            drop(tx);
            std::thread::sleep(Duration::from_nanos(first.saturating_sub(now)));
        }
    }

    /// One more operation on the clock behind the stream's deadline,
    /// complete at `at`.
    fn queue_on_clock(&self, at: u64) {
        self.on_clock.lock().push_back(at);
    }

    pub(crate) fn push(&self, op: Op) -> Result<()> {
        let tx = self.tx.lock();
        let Some(tx) = tx.as_ref() else {
            return Err(Error::InvalidHandle("stream was destroyed".into()));
        };
        let send = |op: Op| {
            self.in_flight.fetch_add(1, AcqRel);
            tx.send(op).map_err(|_| {
                self.in_flight.fetch_sub(1, AcqRel);
                Error::InvalidHandle("stream worker is gone".into())
            })
        };
        // The clock's deadline goes on the queue first: the worker runs
        // `op` after it.
        let until = self.busy_until.swap(0, Relaxed);
        if until != 0 {
            self.on_clock.lock().clear();
            if until > clock_ns() {
                send(Op::Until(until))?;
            }
        }
        send(op)
    }

    /// Makes the stream busy until `deadline(from)` on the clock, where
    /// `from` is the later of now and the current deadline, when nothing is
    /// queued on it; false (nothing changed): work is queued, and the
    /// caller queues its operation behind it.
    fn busy_on_clock(&self, deadline: impl FnOnce(u64) -> u64) -> Result<bool> {
        let _tx = self.lock_with_room()?;
        if self.in_flight.load(Acquire) != 0 {
            return Ok(false);
        }
        let (until, now) = (self.busy_until.load(Relaxed), clock_ns());
        let at = deadline(until.max(now));
        if until > now {
            self.queue_on_clock(at);
        }
        self.busy_until.store(at, Relaxed);
        Ok(true)
    }

    /// Time-only work of length `d` after what the stream runs now, on the
    /// clock (false: work is queued; queue an [`Op::Delay`] behind it).
    pub(crate) fn delay_on_clock(&self, d: Duration) -> Result<bool> {
        self.busy_on_clock(|from| from.saturating_add(d.as_nanos() as u64))
    }

    /// A wait for an event capture due on the clock at `at`: the stream is
    /// busy until then (false: work is queued; queue an [`Op::Wait`]).
    pub(crate) fn wait_on_clock(&self, at: u64) -> Result<bool> {
        self.busy_on_clock(|from| from.max(at))
    }

    /// Completes capture `seq` of `ev` now if nothing is queued or running
    /// on the stream; false: the record must be queued. Holding the queue's
    /// lock keeps other pushes out, and the worker lowers `in_flight` only
    /// after an operation has run, so at 0 everything queued before has.
    pub(crate) fn complete_if_idle(&self, ev: &SimEvent, seq: u64) -> Result<bool> {
        let _tx = self.lock_with_room()?;
        if self.in_flight.load(Acquire) != 0 {
            return Ok(false);
        }
        // Busy on the clock only: the capture completes at the deadline
        // (0: none; one that passed is cleared, sparing the next read of
        // the clock).
        let until = self.busy_until.load(Relaxed);
        if until != 0 {
            if until > clock_ns() {
                self.queue_on_clock(until);
                ev.complete_at(seq, until);
                return Ok(true);
            }
            self.busy_until.store(0, Relaxed);
        }
        ev.complete(seq);
        Ok(true)
    }

    /// Whether everything queued on the stream has run (`cuStreamQuery`):
    /// the worker lowers `in_flight` only after an operation has run, and
    /// time-only work on the clock has run at its deadline.
    pub(crate) fn is_idle(&self) -> Result<bool> {
        self.check_open()?;
        let until = self.busy_until.load(Relaxed);
        Ok(self.in_flight.load(Acquire) == 0 && (until == 0 || until <= clock_ns()))
    }

    /// An error if the stream was destroyed.
    pub(crate) fn check_open(&self) -> Result<()> {
        if self.tx.lock().is_some() {
            Ok(())
        } else {
            Err(Error::InvalidHandle("stream was destroyed".into()))
        }
    }

    /// Closes the queue; the worker drains what is queued and exits.
    pub(crate) fn close(&self) {
        self.tx.lock().take();
    }
}

/// What a worker needs to run operations on device memory.
pub(crate) trait Executor: Send + Sync + 'static {
    fn run_moves(&self, device: usize, moves: &[Move]);
    fn run_fill(&self, device: usize, ptr: u64, len: u64, value: u8);
    fn run_kernel(&self, device: usize, ptr: u64, len: u64, op: &KernelOp);
    fn op_delay(&self, device: usize) -> Duration;
    fn event_delay(&self, device: usize) -> Duration;
}

/// The worker loop of one stream.
pub(crate) fn run_worker(
    device: usize,
    rx: mpsc::Receiver<Op>,
    exec: Arc<dyn Executor>,
    in_flight: Arc<AtomicUsize>,
) {
    while let Ok(op) = rx.recv() {
        let done = run(device, op, &*exec);
        // The stream is idle before an event recorded last on it reads
        // complete: once a host sync on the event (or the stream) returns,
        // a query finds the stream idle, as on a device. (A record queued
        // meanwhile completes inline, after everything before it has run.)
        in_flight.fetch_sub(1, Release);
        if let Some((ev, seq)) = done {
            ev.complete(seq);
        }
    }
}

/// Runs one operation (inline, in synchronous mode).
pub(crate) fn execute(device: usize, op: Op, exec: &dyn Executor) {
    if let Some((ev, seq)) = run(device, op, exec) {
        ev.complete(seq);
    }
}

/// Runs one operation but the completion of the event it records, which
/// it returns.
fn run(device: usize, op: Op, exec: &dyn Executor) -> Option<(Arc<SimEvent>, u64)> {
    let d = exec.op_delay(device);
    if !d.is_zero() {
        std::thread::sleep(d);
    }
    match op {
        Op::Delay(d) => std::thread::sleep(d),
        Op::Until(t) => std::thread::sleep(Duration::from_nanos(t.saturating_sub(clock_ns()))),
        Op::Complete(ev, seq) => {
            let d = exec.event_delay(device);
            if !d.is_zero() {
                std::thread::sleep(d);
            }
            return Some((ev, seq));
        }
        Op::Wait(ev, seq) => ev.wait_for(seq),
        Op::Moves(m) => exec.run_moves(device, &m),
        Op::Fill { ptr, len, value } => exec.run_fill(device, ptr, len, value),
        Op::Kernel {
            ptr,
            len,
            delay,
            op,
        } => {
            if !delay.is_zero() {
                std::thread::sleep(delay);
            }
            exec.run_kernel(device, ptr, len, &op);
        }
        Op::Marker(ev, seq) => return Some((ev, seq)),
    }
    None
}

/// The pattern word of `seed` at word `w` (splitmix64 of the pair), so
/// blocks written with different seeds differ almost everywhere.
#[inline]
fn pattern_word(seed: u64, w: u64) -> u64 {
    let mut z = seed ^ w.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The byte pattern of `seed` at offset `i` of a block.
#[inline]
pub fn pattern_byte(seed: u64, i: u64) -> u8 {
    pattern_word(seed, i >> 3).to_le_bytes()[(i & 7) as usize]
}

/// Writes the pattern of `seed` into `buf` (offset 0 of the block).
pub fn fill_pattern(buf: &mut [u8], seed: u64) {
    for (w, chunk) in buf.chunks_mut(8).enumerate() {
        let b = pattern_word(seed, w as u64).to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

/// Counts bytes of `buf` that differ from the pattern of `seed`.
pub fn count_mismatches(buf: &[u8], seed: u64) -> u64 {
    let mut bad = 0;
    for (w, chunk) in buf.chunks(8).enumerate() {
        let b = pattern_word(seed, w as u64).to_le_bytes();
        if chunk != &b[..chunk.len()] {
            bad += chunk.iter().zip(b).filter(|(x, y)| **x != *y).count() as u64;
        }
    }
    bad
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A capture that becomes due on the clock after a waiter found it
    /// pending (the record's two steps race a host sync on another thread)
    /// wakes that waiter, which then waits until the capture's time.
    #[test]
    fn a_waiter_before_the_capture_is_due_wakes_at_its_time() {
        let ev = Arc::new(SimEvent::new(0));
        let seq = ev.begin_record();
        let (tx, rx) = mpsc::channel();
        let waiter = {
            let ev = ev.clone();
            std::thread::spawn(move || {
                ev.wait_for(seq);
                let _ = tx.send(clock_ns());
            })
        };
        // The waiter is asleep with no timeout before the capture is due.
        std::thread::sleep(Duration::from_millis(50));
        let at = clock_ns() + Duration::from_millis(20).as_nanos() as u64;
        ev.complete_at(seq, at);
        let woke = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("the waiter never woke");
        assert!(woke >= at, "woke before the capture was due");
        waiter.join().unwrap();
        assert_eq!(ev.capture(seq), Capture::Done);
    }

    /// A record that failed after its capture began (its stream closed
    /// meanwhile) is undone: the event reads as before, and a host sync on
    /// it returns instead of waiting for a capture nothing will complete.
    #[test]
    fn an_abandoned_capture_leaves_the_event_as_it_was() {
        let ev = SimEvent::new(0);
        let first = ev.begin_record();
        ev.complete(first);
        let second = ev.begin_record();
        assert!(!ev.is_complete());
        ev.abandon(second);
        assert!(ev.is_complete());
        assert_eq!(ev.current(), first);
        ev.wait_for(ev.current());
        // Still pending before: still pending after.
        let third = ev.begin_record();
        let fourth = ev.begin_record();
        ev.abandon(fourth);
        assert_eq!(ev.current(), third);
        assert!(!ev.is_complete());
    }
}
