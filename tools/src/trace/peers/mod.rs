//! Replay peers: other allocators' placement policies, ported so that a
//! trace can be replayed through them beside gpupool.
//!
//! The one peer today is PyTorch's CUDA caching allocator
//! (`c10/cuda/CUDACachingAllocator.cpp`, the 2.x algorithm), in both of its
//! modes: [`TorchAllocator::new`] with `expandable_segments` off (segments
//! from `cudaMalloc`) and on (one growing virtual segment per stream and
//! pool, mapped page by page). Peers are tools: they hold no memory, every
//! address is simulated, and every driver call the real allocator would make
//! is counted by its CUDA driver name (the names of
//! [`gpupool::backend::Call::name`]) so that a cost model can price it later.
//!
//! - [`PeerAllocator`]: what a replay or a benchmark drives.
//! - [`TorchConfig`]: PyTorch's `PYTORCH_CUDA_ALLOC_CONF` settings that
//!   change placement, and its size rules ([`TorchConfig::round_size`],
//!   [`allocation_size`]).
//! - [`torch`]: the allocator; [`torch_expandable`]: its
//!   expandable-segments half.
//! - [`recording`]: what a PyTorch snapshot recorded (segments, blocks,
//!   events with addresses, settings); [`validate`]: replaying a recording
//!   from its recorded start and checking the port against it, decision by
//!   decision; [`run`]: the cold and warm passes of `gpupool replay`.
//!
//! Invariants every peer keeps:
//! - `reserved_bytes() <= peak_reserved_bytes()`, and the peak is the
//!   maximum of reserved bytes since construction or the last
//!   [`PeerAllocator::reset_peak`].
//! - `driver_calls()` only grows; a replay reports the difference between
//!   two readings.
//! - An address returned by `alloc` stays valid until `free(addr)`, and two
//!   live blocks never overlap.

use std::collections::BTreeMap;

use gpupool::{Error, Result};

mod blocks;
mod device;
pub mod recording;
pub mod run;
pub mod torch;
pub mod torch_events;
pub mod torch_expandable;
pub mod validate;

pub use device::DriverCounter;
pub use torch::{BlockInfo, SegmentAction, SegmentEvent, SegmentInfo, TorchAllocator};
pub use torch_events::StreamEvents;

/// Driver calls by CUDA driver name (`cuMemAlloc`, `cuMemMap`, ...).
pub type DriverCalls = BTreeMap<&'static str, u64>;

/// An allocator a trace can be replayed through (see the [module
/// docs](self) for the invariants).
pub trait PeerAllocator {
    /// Name in reports (`torch`, `torch_expandable`).
    fn name(&self) -> &'static str;
    /// Allocates `size` bytes (requested, not rounded) on `stream`; returns
    /// the simulated device address.
    fn alloc(&mut self, size: u64, stream: u64) -> Result<u64>;
    /// Frees the block at `addr`, as returned by [`PeerAllocator::alloc`].
    fn free(&mut self, addr: u64) -> Result<()>;
    /// Device memory held now.
    fn reserved_bytes(&self) -> u64;
    /// Most device memory held since construction or the last
    /// [`PeerAllocator::reset_peak`].
    fn peak_reserved_bytes(&self) -> u64;
    /// Restarts the peak at the current reserved bytes.
    fn reset_peak(&mut self);
    /// Driver calls made so far, by kind.
    fn driver_calls(&self) -> DriverCalls;
    /// Bytes the driver calls of each kind covered (for costs that grow with
    /// the size mapped or allocated); kinds without a size are absent.
    fn driver_bytes(&self) -> DriverCalls {
        DriverCalls::new()
    }
}

/// PyTorch's `kMinBlockSize`: every block is a multiple of 512 bytes.
pub const MIN_BLOCK_SIZE: u64 = 512;
/// PyTorch's `kSmallSize`: rounded requests up to 1 MiB use the small pool.
pub const SMALL_SIZE: u64 = 1 << 20;
/// PyTorch's `kSmallBuffer`: small-pool segments (and expandable pages).
pub const SMALL_BUFFER: u64 = 2 << 20;
/// PyTorch's `kLargeBuffer`: segments for requests under 10 MiB, and the
/// page of large-pool expandable segments.
pub const LARGE_BUFFER: u64 = 20 << 20;
/// PyTorch's `kMinLargeAlloc`: from here on, segments are the request rounded
/// to [`ROUND_LARGE`].
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// PyTorch's `kRoundLarge`.
pub const ROUND_LARGE: u64 = 2 << 20;
/// Intervals of `roundup_power2_divisions`: 1 MiB, 2 MiB, ... 32 GiB and up.
pub const ROUNDUP_INTERVALS: usize = 16;

/// The segment PyTorch asks the driver for to serve a rounded request of
/// `size` bytes (`get_allocation_size`): 2 MiB for the small pool, 20 MiB
/// below 10 MiB, else `size` rounded up to 2 MiB.
pub fn allocation_size(size: u64) -> u64 {
    if size <= SMALL_SIZE {
        SMALL_BUFFER
    } else if size < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        size.div_ceil(ROUND_LARGE) * ROUND_LARGE
    }
}

/// The settings of PyTorch's caching allocator that change where blocks go
/// (`PYTORCH_CUDA_ALLOC_CONF`), plus the device the port simulates.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TorchConfig {
    /// `expandable_segments:True`.
    pub expandable_segments: bool,
    /// `max_split_size_mb` in bytes (`u64::MAX`: unlimited, the default).
    /// Blocks this large or larger are never split.
    pub max_split_size: u64,
    /// `max_non_split_rounding_mb` in bytes: an oversize request may take a
    /// cached block at most this much larger (default 20 MiB).
    pub max_non_split_rounding_size: u64,
    /// `roundup_power2_divisions` per interval (1 MiB, 2 MiB, ... 32 GiB and
    /// up); 0 or 1 means plain 512-byte rounding.
    pub roundup_power2_divisions: [u64; ROUNDUP_INTERVALS],
    /// `garbage_collection_threshold` (0: off). Acts only with a memory
    /// fraction, as in PyTorch.
    pub garbage_collection_threshold: f64,
    /// `torch.cuda.set_per_process_memory_fraction` (None: not called).
    pub memory_fraction: Option<f64>,
    /// Total memory of the simulated device (`cudaMemGetInfo`'s total).
    pub capacity_bytes: u64,
    /// Peer devices granted access to this device's memory (each adds one
    /// `cuMemSetAccess` per mapped range of an expandable segment).
    pub peer_devices: usize,
    /// Spend each driver call's modeled time on the calling thread, under
    /// the port's locks as PyTorch makes it (`stress --spend-driver-time`);
    /// `None`: count only. Not a PyTorch setting.
    #[serde(skip)]
    pub driver_time: Option<std::sync::Arc<gpupool::backend::CostTable>>,
}

impl Default for TorchConfig {
    fn default() -> Self {
        TorchConfig {
            expandable_segments: false,
            max_split_size: u64::MAX,
            max_non_split_rounding_size: LARGE_BUFFER,
            roundup_power2_divisions: [0; ROUNDUP_INTERVALS],
            garbage_collection_threshold: 0.0,
            memory_fraction: None,
            capacity_bytes: 80 << 30,
            peer_devices: 0,
            driver_time: None,
        }
    }
}

fn conf_err(key: &str, msg: impl Into<String>) -> Error {
    Error::Config {
        key: key.to_owned(),
        msg: msg.into(),
    }
}

impl TorchConfig {
    /// The default settings with `expandable_segments` as given.
    pub fn with_mode(expandable_segments: bool) -> Self {
        TorchConfig {
            expandable_segments,
            ..Default::default()
        }
    }

    /// Applies a `PYTORCH_CUDA_ALLOC_CONF` string (`key:value` pairs,
    /// comma-separated): `expandable_segments`, `max_split_size_mb`,
    /// `max_non_split_rounding_mb`, `garbage_collection_threshold`,
    /// `roundup_power2_divisions` (one power of two for every interval, or a
    /// list `[MiB:div,...,>:div]`). Keys that do not change placement
    /// (`pinned_*`, `release_lock_on_cudamalloc`, `backend`) are accepted and
    /// ignored; any other key is an error.
    pub fn apply_alloc_conf(&mut self, conf: &str) -> Result<()> {
        let mut rest = conf.trim();
        while !rest.is_empty() {
            let (key, after) = rest
                .split_once(':')
                .ok_or_else(|| conf_err(rest, "expected key:value"))?;
            let key = key.trim();
            let after = after.trim_start();
            // A list value runs to its closing bracket.
            let end = if after.starts_with('[') {
                after
                    .find(']')
                    .map(|i| i + 1)
                    .ok_or_else(|| conf_err(key, "unclosed `[`"))?
            } else {
                after.find(',').unwrap_or(after.len())
            };
            let value = after[..end].trim();
            rest = after[end..].trim_start_matches([',', ' ']);
            let num = |v: &str| -> Result<f64> {
                v.parse::<f64>()
                    .map_err(|_| conf_err(key, format!("`{v}` is not a number")))
            };
            match key {
                "expandable_segments" => {
                    self.expandable_segments = match value {
                        "True" | "true" | "1" => true,
                        "False" | "false" | "0" => false,
                        v => return Err(conf_err(key, format!("`{v}` is not True or False"))),
                    }
                }
                "max_split_size_mb" => {
                    let mb = num(value)?;
                    if mb <= (LARGE_BUFFER >> 20) as f64 {
                        return Err(conf_err(key, "must be above 20 (MiB)"));
                    }
                    self.max_split_size = (mb as u64) << 20;
                }
                "max_non_split_rounding_mb" => {
                    self.max_non_split_rounding_size = (num(value)? as u64) << 20;
                }
                "garbage_collection_threshold" => {
                    let t = num(value)?;
                    if !(t > 0.0 && t < 1.0) {
                        return Err(conf_err(key, "must be in (0, 1)"));
                    }
                    self.garbage_collection_threshold = t;
                }
                "roundup_power2_divisions" => self.parse_divisions(key, value)?,
                "pinned_num_register_threads"
                | "pinned_use_cuda_host_register"
                | "pinned_use_background_threads"
                | "release_lock_on_cudamalloc"
                | "backend" => {}
                other => return Err(conf_err(other, "unknown allocator setting")),
            }
        }
        Ok(())
    }

    fn parse_divisions(&mut self, key: &str, value: &str) -> Result<()> {
        let div = |v: &str| -> Result<u64> {
            let d: u64 = v
                .trim()
                .parse()
                .map_err(|_| conf_err(key, format!("`{v}` is not an integer")))?;
            if d != 0 && !d.is_power_of_two() {
                return Err(conf_err(key, format!("{d} is not a power of two")));
            }
            Ok(d)
        };
        let Some(list) = value.strip_prefix('[').and_then(|v| v.strip_suffix(']')) else {
            self.roundup_power2_divisions = [div(value)?; ROUNDUP_INTERVALS];
            return Ok(());
        };
        // `[256:1,512:2,>:4]`: each entry sets its interval; the intervals
        // between two entries take the earlier entry's value.
        let mut last: Option<usize> = None;
        for entry in list.split(',').filter(|e| !e.trim().is_empty()) {
            let (size, d) = entry
                .split_once(':')
                .ok_or_else(|| conf_err(key, format!("`{entry}` is not size:divisions")))?;
            let d = div(d)?;
            let from = last.map_or(0, |i| i + 1);
            if size.trim() == ">" {
                for slot in &mut self.roundup_power2_divisions[from..] {
                    *slot = d;
                }
                return Ok(());
            }
            let mb: u64 = size
                .trim()
                .parse()
                .map_err(|_| conf_err(key, format!("`{size}` is not a size in MiB")))?;
            if !mb.is_power_of_two() {
                return Err(conf_err(key, format!("{mb} MiB is not a power of two")));
            }
            let index = (mb.ilog2() as usize).min(ROUNDUP_INTERVALS - 1);
            if let Some(l) = last {
                let prev = self.roundup_power2_divisions[l];
                for slot in &mut self.roundup_power2_divisions[from.min(index)..index] {
                    *slot = prev;
                }
            }
            self.roundup_power2_divisions[index] = d;
            last = Some(index);
        }
        Ok(())
    }

    /// `roundup_power2_divisions(size)`: the divisions of the interval
    /// holding `size` (intervals start at 1 MiB; smaller sizes use the
    /// first, 32 GiB and up the last).
    pub fn divisions_for(&self, size: u64) -> u64 {
        let log = 63 - u64::from(size.max(1).leading_zeros());
        let index = log.saturating_sub(20) as usize;
        self.roundup_power2_divisions[index.min(ROUNDUP_INTERVALS - 1)]
    }

    /// PyTorch's `round_size`: at least 512 bytes; with `d > 1` divisions
    /// for the size's interval and a size above `512 * d`, up to the next of
    /// `d` equal steps between two powers of two; otherwise up to a multiple
    /// of 512.
    pub fn round_size(&self, size: u64) -> u64 {
        if size < MIN_BLOCK_SIZE {
            return MIN_BLOCK_SIZE;
        }
        let d = self.divisions_for(size);
        if d > 1 && size > MIN_BLOCK_SIZE * d {
            roundup_power2_next_division(size, d)
        } else {
            size.div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE
        }
    }

    /// Whether a block of `block_size` bytes serving a rounded request of
    /// `size` bytes in the given pool is split (`should_split`): in the
    /// small pool or with expandable segments when at least 512 bytes
    /// remain; in the large pool when the request is under
    /// `max_split_size` and more than 1 MiB remains.
    pub fn should_split(&self, small_pool: bool, block_size: u64, size: u64) -> bool {
        let remaining = block_size - size;
        if small_pool || self.expandable_segments {
            remaining >= MIN_BLOCK_SIZE
        } else {
            size < self.max_split_size && remaining > SMALL_SIZE
        }
    }
}

/// PyTorch's `roundup_power2_next_division`: `size` up to the next of
/// `divisions` equal steps between the powers of two around it.
fn roundup_power2_next_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << size.ilog2();
    let step = floor >> divisions.ilog2();
    if step == 0 {
        return floor << 1;
    }
    let down = size & !(step - 1);
    if down == size {
        size
    } else {
        down + step
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_size_follows_pytorch() {
        let c = TorchConfig::default();
        assert_eq!(c.round_size(1), 512);
        assert_eq!(c.round_size(512), 512);
        assert_eq!(c.round_size(513), 1024);
        assert_eq!(c.round_size(3 << 20), 3 << 20);
        // The example in PyTorch's comment: 1200 with 4 divisions of
        // [1024, 2048) is 1280; below 512 * 4 the plain rule applies.
        assert_eq!(roundup_power2_next_division(1200, 4), 1280);
        let c4 = TorchConfig {
            roundup_power2_divisions: [4; ROUNDUP_INTERVALS],
            ..Default::default()
        };
        assert_eq!(c4.round_size(1200), 1536, "1200 <= 512 * 4: plain rounding");
        assert_eq!(c4.round_size(5 << 20 | 1), 6 << 20);
        assert_eq!(c4.round_size(4 << 20), 4 << 20);
    }

    #[test]
    fn allocation_sizes() {
        assert_eq!(allocation_size(512), SMALL_BUFFER);
        assert_eq!(allocation_size(SMALL_SIZE), SMALL_BUFFER);
        assert_eq!(allocation_size(SMALL_SIZE + 512), LARGE_BUFFER);
        assert_eq!(allocation_size(MIN_LARGE_ALLOC - 512), LARGE_BUFFER);
        assert_eq!(allocation_size(MIN_LARGE_ALLOC), MIN_LARGE_ALLOC);
        assert_eq!(allocation_size(11 << 20 | 1), 12 << 20);
    }

    #[test]
    fn split_rules() {
        let c = TorchConfig::default();
        assert!(c.should_split(true, 2 << 20, (2 << 20) - 512));
        assert!(!c.should_split(true, 1024, 1024));
        assert!(
            !c.should_split(false, 3 << 20, 2 << 20),
            "1 MiB left: no split"
        );
        assert!(c.should_split(false, (3 << 20) + 512, 2 << 20));
        let e = TorchConfig::with_mode(true);
        assert!(e.should_split(false, (2 << 20) + 512, 2 << 20));
        let mut m = TorchConfig::default();
        m.apply_alloc_conf("max_split_size_mb:100").unwrap();
        assert!(!m.should_split(false, 400 << 20, 100 << 20));
        assert!(m.should_split(false, 400 << 20, 99 << 20));
    }

    #[test]
    fn alloc_conf_parses_pytorch_syntax() {
        let mut c = TorchConfig::default();
        c.apply_alloc_conf(
            "expandable_segments:True,roundup_power2_divisions:[1:2,4:4,>:8], \
             max_split_size_mb:512,garbage_collection_threshold:0.6",
        )
        .unwrap();
        assert!(c.expandable_segments);
        assert_eq!(c.max_split_size, 512 << 20);
        assert_eq!(c.garbage_collection_threshold, 0.6);
        assert_eq!(&c.roundup_power2_divisions[..4], &[2, 2, 4, 8]);
        assert_eq!(c.roundup_power2_divisions[15], 8);
        let mut d = TorchConfig::default();
        d.apply_alloc_conf("roundup_power2_divisions:4").unwrap();
        assert_eq!(d.roundup_power2_divisions, [4; ROUNDUP_INTERVALS]);
        for bad in [
            "max_split_size_mb:10",
            "roundup_power2_divisions:3",
            "nonsense:1",
            "expandable_segments:maybe",
            "garbage_collection_threshold:1.5",
        ] {
            let e = TorchConfig::default().apply_alloc_conf(bad).unwrap_err();
            assert!(matches!(e, Error::Config { .. }), "{bad}: {e}");
        }
    }
}
