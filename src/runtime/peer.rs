//! The peer-access matrix of a runtime.

use crate::backend::Backend;
use crate::error::Error;
use crate::pool::DevicePool;
use std::fmt;

/// One pool's grants: `access[p]` for every device `p`, with notes.
#[derive(Debug)]
pub(crate) struct PeerRow {
    access: Vec<bool>,
    notes: Vec<String>,
}

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
    /// Enables access to `pool`'s memory from every other device of `n`
    /// that the backend allows: the pool's row of the matrix, with notes.
    /// Failures are recorded, not fatal: a pool without peers still works.
    pub(crate) fn enable_row(backend: &dyn Backend, pool: &DevicePool, n: usize) -> PeerRow {
        let d = pool.device();
        let mut row = PeerRow {
            access: (0..n).map(|p| p == d).collect(),
            notes: Vec::new(),
        };
        let mut peers = Vec::new();
        for p in (0..n).filter(|&p| p != d) {
            match backend.can_access_peer(p, d) {
                Ok(true) => peers.push(p),
                Ok(false) => row
                    .notes
                    .push(format!("device {p} cannot access device {d}")),
                Err(e) => row
                    .notes
                    .push(format!("cuDeviceCanAccessPeer({p}, {d}): {e}")),
            }
        }
        if peers.is_empty() {
            return row;
        }
        match pool.enable_peer_access(&peers) {
            Ok(()) => peers.iter().for_each(|&p| row.access[p] = true),
            Err(Error::Unsupported(why)) => row.notes.push(format!("device {d}: {why}")),
            Err(e) => {
                tracing::warn!(device = d, "enabling peer access failed: {e}");
                row.notes.push(format!("device {d}: {e}"));
            }
        }
        row
    }

    /// Sets the row of device `dev` (its pool was just built).
    pub(crate) fn set_row(&mut self, dev: usize, row: PeerRow) {
        self.access[dev] = row.access;
        self.notes.extend(row.notes);
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
