//! The peer-access matrix of a runtime.

use crate::backend::Backend;
use crate::error::Error;
use crate::pool::DevicePool;
use std::fmt;

/// Which device may access which pool's memory.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct PeerMatrix {
    /// `access[d][p]`: device `p` was granted access to the pool of device
    /// `d` (always `true` on the diagonal).
    pub access: Vec<Vec<bool>>,
    /// Why some pairs have no access (backend refusal, no VMM), one line
    /// per cause; empty when every pair has it.
    pub notes: Vec<String>,
}

impl PeerMatrix {
    /// Enables access from every peer the backend allows to every pool.
    /// Failures are recorded, not fatal: a pool without peers still works.
    pub(crate) fn enable(backend: &dyn Backend, pools: &[DevicePool]) -> PeerMatrix {
        let n = pools.len();
        let mut m = PeerMatrix {
            access: vec![vec![false; n]; n],
            notes: Vec::new(),
        };
        for (d, pool) in pools.iter().enumerate() {
            m.access[d][d] = true;
            let mut peers = Vec::new();
            for p in (0..n).filter(|&p| p != d) {
                match backend.can_access_peer(p, d) {
                    Ok(true) => peers.push(p),
                    Ok(false) => m.notes.push(format!("device {p} cannot access device {d}")),
                    Err(e) => m
                        .notes
                        .push(format!("cuDeviceCanAccessPeer({p}, {d}): {e}")),
                }
            }
            if peers.is_empty() {
                continue;
            }
            match pool.enable_peer_access(&peers) {
                Ok(()) => peers.iter().for_each(|&p| m.access[d][p] = true),
                Err(Error::Unsupported(why)) => m.notes.push(format!("device {d}: {why}")),
                Err(e) => {
                    tracing::warn!(device = d, "enabling peer access failed: {e}");
                    m.notes.push(format!("device {d}: {e}"));
                }
            }
        }
        m
    }

    /// Whether device `peer` may access the memory of device `dev`.
    pub fn can_access(&self, dev: usize, peer: usize) -> bool {
        self.access
            .get(dev)
            .and_then(|r| r.get(peer))
            .copied()
            .unwrap_or(false)
    }
}

impl fmt::Display for PeerMatrix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "peer access (row: memory of device, column: accessing device)\n      "
        )?;
        for p in 0..self.access.len() {
            write!(f, "{p:>4}")?;
        }
        for (d, row) in self.access.iter().enumerate() {
            write!(f, "\n{d:>6}")?;
            for &a in row {
                write!(f, "{:>4}", if a { "yes" } else { "-" })?;
            }
        }
        for n in &self.notes {
            write!(f, "\nnote: {n}")?;
        }
        Ok(())
    }
}
