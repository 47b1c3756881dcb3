//! Traces recorded from a live pool: [`DevicePool::record_history`] events
//! turned into a [`Trace`], which [`write_rmm_log`](super::write_rmm_log)
//! saves in the RMM log format.
//!
//! [`DevicePool::record_history`]: gpupool::DevicePool::record_history

use super::{Trace, TraceEvent, TraceFormat};
use gpupool::pool::{HistoryAction, HistoryEvent};
use gpupool::{Error, Result};
use std::collections::HashMap;

/// The trace of a pool's recorded history (blocks live when recording began
/// are not in it; their frees are skipped).
pub fn from_history(name: &str, events: &[HistoryEvent]) -> Result<Trace> {
    let mut t = Trace::new(name, TraceFormat::RmmLog);
    let mut live: HashMap<u64, u64> = HashMap::new();
    let mut next = 0u64;
    for (i, e) in events.iter().enumerate() {
        match e.action {
            HistoryAction::Alloc => {
                if live.insert(e.addr, next).is_some() {
                    return Err(Error::Trace {
                        file: name.into(),
                        msg: format!("event {i}: {:#x} allocated twice", e.addr),
                    });
                }
                t.events.push(TraceEvent::Alloc {
                    id: next,
                    size: e.size,
                    stream: e.stream,
                });
                next += 1;
            }
            HistoryAction::FreeRequested => {
                if let Some(id) = live.remove(&e.addr) {
                    t.events.push(TraceEvent::Free {
                        id,
                        stream: e.stream,
                    });
                }
            }
        }
    }
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpupool::backend::sim::SimConfig;
    use gpupool::{BackendKind, Runtime};

    #[test]
    fn a_recorded_history_round_trips_through_an_rmm_log() {
        let rt = Runtime::builder()
            .backend(BackendKind::Sim(SimConfig {
                capacity_bytes: 1 << 30,
                ..Default::default()
            }))
            .build()
            .unwrap();
        let dev = rt.device(0).unwrap();
        let s = dev.new_stream().unwrap();
        dev.record_history(true);
        let mut held = Vec::new();
        let mut live = 0u64;
        let mut peak = 0u64;
        for i in 0..300usize {
            let size = 1 + (i * 7919) % (3 << 20);
            held.push(dev.alloc(size, &s).unwrap());
            live += size as u64;
            peak = peak.max(live);
            if i % 3 == 2 {
                let b = held.remove((i * 31) % held.len());
                live -= b.size() as u64;
            }
        }
        drop(held);
        let trace = from_history("recorded", &dev.history()).unwrap();
        assert_eq!(trace.allocs(), 300);
        assert_eq!(trace.frees(), 300);
        assert_eq!(trace.peak_live_bytes(), peak);
        let mut log = Vec::new();
        crate::trace::write_rmm_log(&trace, &mut log).unwrap();
        let back = crate::trace::parse("recorded.csv", &log).unwrap();
        assert_eq!(back.format, TraceFormat::RmmLog);
        assert_eq!(back.peak_live_bytes(), peak);
        assert_eq!(back.events.len(), trace.events.len());
    }
}
