//! Peer access: letting other devices read and write this pool's memory.
//!
//! With virtual memory management, access rights belong to each mapping
//! (`cuMemSetAccess`), not to the allocation: the heap grants the peer set
//! on every chunk it maps, and [`DevicePool::enable_peer_access`] applies
//! it to what is mapped already.

use super::DevicePool;
use crate::error::{Error, Result};

impl DevicePool {
    /// Grants devices `peers` read/write access to all of this pool's
    /// memory, now and from now on (replacing the earlier peer set).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidDevice`] for a device the backend does not have,
    /// [`Error::InvalidArgument`] for this pool's own device or a peer the
    /// backend says cannot access this device
    /// (`Backend::can_access_peer`), [`Error::Unsupported`] where the pool
    /// runs on plain segments (no VMM). Nothing changes on an error.
    pub fn enable_peer_access(&self, peers: &[usize]) -> Result<()> {
        self.shared.check_live()?;
        let be = self.backend();
        let me = self.device();
        for &p in peers {
            if p >= be.device_count() {
                return Err(Error::InvalidDevice {
                    device: p,
                    count: be.device_count(),
                });
            }
            if p == me {
                return Err(Error::InvalidArgument(format!(
                    "device {me} is not its own peer"
                )));
            }
            if !be.can_access_peer(p, me)? {
                return Err(Error::InvalidArgument(format!(
                    "device {p} cannot access the memory of device {me}"
                )));
            }
        }
        let mut sorted = peers.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        self.shared.heap.lock().heap.set_peers(&sorted)
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::sim::SimBackend;
    use crate::backend::{Backend, Call};
    use crate::config::{PoolConfig, SimConfig};
    use crate::error::Error;
    use crate::pool::DevicePool;
    use std::sync::Arc;

    fn sim(devices: usize, vmm: bool) -> Arc<SimBackend> {
        Arc::new(
            SimBackend::new(SimConfig {
                devices,
                vmm,
                ..Default::default()
            })
            .unwrap(),
        )
    }

    #[test]
    fn peers_get_access_to_mapped_and_later_chunks() {
        let be = sim(3, true);
        let pool = DevicePool::new(be.clone(), 0, PoolConfig::default()).unwrap();
        let s = pool.new_stream().unwrap();
        let a = pool.alloc(8 << 20, &s).unwrap();
        let before = be.counters().get(Call::SetAccess);
        pool.enable_peer_access(&[2, 1]).unwrap();
        let granted = be.counters().get(Call::SetAccess) - before;
        // One grant for the mapped run (8 MiB: four 2 MiB granules), not
        // one per granule.
        assert_eq!(granted, 1);
        let b = pool.alloc(16 << 20, &s).unwrap();
        // The new run of 8 granules: one grant for the device (inside the
        // run's map) plus one for the peers.
        let later = be.counters().get(Call::SetAccess) - before - granted;
        assert_eq!(later, 2);
        drop((a, b));
        pool.audit().unwrap();
    }

    #[test]
    fn bad_peers_are_rejected_and_change_nothing() {
        let be = sim(2, true);
        let pool = DevicePool::new(be.clone(), 0, PoolConfig::default()).unwrap();
        assert!(matches!(
            pool.enable_peer_access(&[5]),
            Err(Error::InvalidDevice { device: 5, .. })
        ));
        assert!(matches!(
            pool.enable_peer_access(&[0]),
            Err(Error::InvalidArgument(_))
        ));
        let seg = sim(2, false);
        let pool = DevicePool::new(seg, 0, PoolConfig::default()).unwrap();
        assert!(matches!(
            pool.enable_peer_access(&[1]),
            Err(Error::Unsupported(_))
        ));
    }
}
