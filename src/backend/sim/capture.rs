//! Graph capture on simulated streams: which streams capture, and the
//! calls CUDA forbids (or that would land in the graph) while they do.
//!
//! Tests begin and end a capture with [`SimBackend::begin_capture`] and
//! [`SimBackend::end_capture`]; [`Backend::stream_capturing`](crate::backend::Backend::stream_capturing) reports it,
//! as `cuStreamIsCapturing` does. While any stream of a device captures,
//! these calls on that device count as *capture violations*
//! ([`SimBackend::capture_violations`]), the conservative rule of
//! `cudaStreamCaptureModeGlobal` that PyTorch's allocator follows:
//!
//! * an event record, a stream wait or enqueued work (moves, fills) on a
//!   capturing stream: it would become a node of the graph;
//! * any event query or synchronization and any stream synchronization
//!   ("potentially unsafe" calls that invalidate a global-mode capture);
//!   an event recorded during a capture stays *captured* until it is
//!   recorded again, and querying or synchronizing it is a violation even
//!   after the capture ended, as CUDA rejects it;
//! * giving memory back (`cuMemUnmap`, `cuMemRelease`, `cuMemFree`,
//!   `cuMemAddressFree`): the graph may hold addresses in it.
//!
//! Creating and mapping *new* memory is not a violation: it is not a stream
//! operation, and the CUDA backend makes those calls in relaxed capture
//! mode, as PyTorch makes `cudaMalloc` during a capture.
//!
//! Limits: work enqueued on a capturing stream still runs at once (the
//! simulator builds no graph and replays nothing); a violation is counted
//! and logged, and the call then does what it would outside a capture.

use super::{SimBackend, SimStream};
use crate::backend::Call;
use crate::error::{Error, Result};
use crate::ptr::{EventHandle, StreamHandle};
use parking_lot::Mutex;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// The capture state of one simulated device.
#[derive(Debug, Default)]
pub(super) struct CaptureState {
    /// Capturing streams, by the address of their simulated stream.
    streams: Mutex<HashSet<usize>>,
    /// `streams.len()`: one load when nothing captures.
    active: AtomicU64,
    /// Events last recorded during a capture (handles).
    captured_events: Mutex<HashSet<u64>>,
    /// `captured_events.len()`.
    captured_n: AtomicU64,
    violations: AtomicU64,
}

fn key(st: &Arc<SimStream>) -> usize {
    Arc::as_ptr(st) as usize
}

impl CaptureState {
    fn any(&self) -> bool {
        self.active.load(Relaxed) != 0
    }

    fn capturing(&self, st: &Arc<SimStream>) -> bool {
        self.any() && self.streams.lock().contains(&key(st))
    }

    fn is_captured_event(&self, e: EventHandle) -> bool {
        self.captured_n.load(Relaxed) != 0 && self.captured_events.lock().contains(&e.0)
    }

    fn violation(&self, dev: usize, call: &'static str) {
        self.violations.fetch_add(1, Relaxed);
        tracing::warn!(
            device = dev,
            call,
            "simulated capture violation: a forbidden call while a stream captures"
        );
    }

    /// A destroyed stream ends its capture.
    pub(super) fn forget(&self, st: &Arc<SimStream>) {
        if self.any() && self.streams.lock().remove(&key(st)) {
            self.active.fetch_sub(1, Relaxed);
        }
    }
}

/// The kinds of call [`SimBackend::capture_check`] judges.
pub(super) enum Checked<'a> {
    /// An event record on a stream.
    Record(EventHandle, &'a Arc<SimStream>),
    /// An event query or synchronization.
    QueryEvent(EventHandle),
    /// A stream synchronization.
    SyncStream,
    /// A stream query.
    QueryStream(&'a Arc<SimStream>),
    /// A stream waiting on an event, or work enqueued on a stream.
    OnStream(&'a Arc<SimStream>),
    /// Memory given back.
    Release,
}

impl SimBackend {
    /// Counts a capture violation of `call` on `dev`, if it is one.
    pub(super) fn capture_check(&self, dev: usize, call: &'static str, c: Checked<'_>) {
        let Ok(d) = self.dev(dev) else { return };
        let cap = &d.capture;
        match c {
            Checked::Record(e, st) => {
                if cap.capturing(st) {
                    cap.violation(dev, call);
                    if cap.captured_events.lock().insert(e.0) {
                        cap.captured_n.fetch_add(1, Relaxed);
                    }
                } else if cap.captured_n.load(Relaxed) != 0
                    && cap.captured_events.lock().remove(&e.0)
                {
                    cap.captured_n.fetch_sub(1, Relaxed);
                }
            }
            Checked::QueryEvent(e) => {
                if cap.any() || cap.is_captured_event(e) {
                    cap.violation(dev, call);
                }
            }
            Checked::QueryStream(st) => {
                if cap.any() || cap.capturing(st) {
                    cap.violation(dev, call);
                }
            }
            Checked::SyncStream | Checked::Release => {
                if cap.any() {
                    cap.violation(dev, call);
                }
            }
            Checked::OnStream(st) => {
                if cap.capturing(st) {
                    cap.violation(dev, call);
                }
            }
        }
    }

    /// Begins a (simulated) graph capture on `stream` of `dev`, as
    /// `cuStreamBeginCapture` in global mode does. An error if the stream
    /// captures already.
    pub fn begin_capture(&self, dev: usize, stream: StreamHandle) -> Result<()> {
        let st = self.stream(dev, stream)?;
        let cap = &self.dev(dev)?.capture;
        if !cap.streams.lock().insert(key(&st)) {
            return Err(Error::InvalidArgument(format!(
                "stream {:#x} of device {dev} captures already",
                stream.0
            )));
        }
        cap.active.fetch_add(1, Relaxed);
        Ok(())
    }

    /// Ends the capture of `stream` (`cuStreamEndCapture`). An error if it
    /// does not capture.
    pub fn end_capture(&self, dev: usize, stream: StreamHandle) -> Result<()> {
        let st = self.stream(dev, stream)?;
        let cap = &self.dev(dev)?.capture;
        if !cap.streams.lock().remove(&key(&st)) {
            return Err(Error::InvalidArgument(format!(
                "stream {:#x} of device {dev} does not capture",
                stream.0
            )));
        }
        cap.active.fetch_sub(1, Relaxed);
        Ok(())
    }

    /// Calls on `dev` that a capture forbids, made so far (see the module
    /// docs of `sim/capture.rs`).
    pub fn capture_violations(&self, dev: usize) -> u64 {
        self.dev(dev)
            .map_or(0, |d| d.capture.violations.load(Relaxed))
    }

    /// `cuStreamIsCapturing`.
    pub(super) fn capturing_now(&self, dev: usize, stream: StreamHandle) -> Result<bool> {
        self.call(Call::StreamIsCapturing);
        let st = self.stream(dev, stream)?;
        Ok(self.dev(dev)?.capture.capturing(&st))
    }
}
