//! How much wall time stitching may take: a token bucket of modeled
//! driver time.
//!
//! Stitching keeps reserved memory close to live memory by remapping idle
//! granules under new addresses, and each stolen granule costs a map, an
//! unmap and an access grant (about 33 µs on an H200, `CostTable::h200`).
//! A server whose sizes never repeat steals a few hundred granules a
//! second: under 1% of its time, well spent. A training loop whose
//! shapes vary and that marks no steps steals on every step: on an H200 a
//! PyTorch loop remapped 30-40 granules every 10 ms step and ran up to
//! 1.67x PyTorch's step time (docs/BENCHMARKS.md §7). So the heap may
//! spend at most `share` of wall time stealing: credit accrues at `share`
//! µs per µs, up to [`StitchShare::BURST_US`], each stolen granule spends
//! its modeled cost, and a request the credit does not cover grows the
//! device memory instead (where the limit and the device allow; else it
//! steals all the same, since stitching is what averts the out of memory).
//!
//! Invariant: `0 <= credit_us <= BURST_US`; `share == 0` places no limit.

use crate::backend::{Call, CostTable};
use std::time::Instant;

/// The wall-time budget of stitching.
#[derive(Debug, Clone)]
pub(crate) struct StitchShare {
    /// Fraction of wall time stealing may take (0: no limit).
    share: f64,
    /// Modeled µs per stolen granule.
    cost_us: f64,
    /// Unspent µs.
    credit_us: f64,
    /// When the credit was last brought up to date (`None`: never; the
    /// bucket starts full).
    at: Option<Instant>,
}

impl StitchShare {
    /// The most credit the bucket holds: what a burst of stealing may
    /// spend at once (about 600 granules at 33 µs).
    pub(crate) const BURST_US: f64 = 20_000.0;

    /// A budget of `share` of wall time at `cost_us` per stolen granule.
    pub(crate) fn new(share: f64, cost_us: f64) -> StitchShare {
        StitchShare {
            share,
            cost_us,
            credit_us: Self::BURST_US,
            at: None,
        }
    }

    /// A budget of `share` of wall time, each stolen granule charged at
    /// `costs`: its old mapping unmapped, the new one mapped, access
    /// granted.
    pub(crate) fn charged(share: f64, costs: &CostTable) -> StitchShare {
        let cost_us = [Call::Map, Call::Unmap, Call::SetAccess]
            .iter()
            .map(|&c| costs.cost(c).micros(c, 1, 1))
            .sum();
        StitchShare::new(share, cost_us)
    }

    /// No limit: stitching steals whenever that serves.
    pub(crate) fn unlimited() -> StitchShare {
        StitchShare::new(0.0, 0.0)
    }

    /// Whether stealing `n` granules at `now` stays within the share.
    pub(crate) fn affords(&mut self, n: usize, now: Instant) -> bool {
        if self.share <= 0.0 || n == 0 {
            return true;
        }
        if let Some(at) = self.at {
            let earned = self.share * now.saturating_duration_since(at).as_secs_f64() * 1e6;
            self.credit_us = (self.credit_us + earned).min(Self::BURST_US);
        }
        // Never back: a clock read older than the last earns nothing now
        // and is not earned twice later.
        self.at = Some(self.at.map_or(now, |at| at.max(now)));
        self.credit_us >= n as f64 * self.cost_us
    }

    /// Spends the cost of `n` stolen granules (a steal the limit forced
    /// may overdraw: the credit stops at zero).
    pub(crate) fn spend(&mut self, n: usize) {
        if self.share > 0.0 {
            self.credit_us = (self.credit_us - n as f64 * self.cost_us).max(0.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn credit_accrues_with_time_up_to_the_burst_and_steals_spend_it() {
        let t0 = Instant::now();
        // 1% of wall time at 100 µs a granule: the full bucket (20 ms)
        // covers 200 granules.
        let mut s = StitchShare::new(0.01, 100.0);
        assert!(s.affords(200, t0));
        assert!(!s.affords(201, t0));
        s.spend(150);
        assert!(s.affords(50, t0) && !s.affords(51, t0));
        // A second of wall time earns 10 ms: 100 granules more.
        let t1 = t0 + Duration::from_secs(1);
        assert!(s.affords(150, t1) && !s.affords(151, t1));
        // Idle for long: no more than the burst.
        let t2 = t1 + Duration::from_secs(3600);
        assert!(s.affords(200, t2) && !s.affords(201, t2));
        // Overdrawn by a forced steal: zero, not below.
        s.spend(10_000);
        assert!(s.affords(0, t2) && !s.affords(1, t2));
        // A clock read earlier than the last (another thread's) earns nothing.
        assert!(!s.affords(1, t0));
    }

    #[test]
    fn no_share_places_no_limit() {
        let now = Instant::now();
        let mut s = StitchShare::unlimited();
        s.spend(1 << 20);
        assert!(s.affords(1 << 30, now));
        assert!(!StitchShare::new(0.01, 1e9).affords(1, now));
        assert!(StitchShare::new(0.0, 1e9).affords(1, now));
    }
}
