//! Size classes of the small path.
//!
//! Requests up to [`SizeClasses::small_max`] are rounded up to a class and
//! served from slabs of that class. Classes are multiples of 256 bytes (the
//! alignment every block gets, as `cudaMalloc` gives): every multiple of 256
//! up to 1 KiB, then four classes per power of two. The worst-case internal
//! waste is therefore 255 bytes below 1 KiB and under 25% above it
//! (1025 B → 1280 B); the mean over a log-uniform size mix is about 10%.
//!
//! Why the small/large threshold sits at 32 KiB (the default `small_max`):
//! a slab holds at least eight slots, so the largest class's slab is 256
//! KiB, an eighth of a 2 MiB granule. Every slab is then a sub-granule
//! range of the large path's address space, placed at the high end of free
//! ranges where it fills the partly used granules at the ends of large
//! blocks instead of holding granules of its own; and a partly used slab
//! strands at most 256 KiB per class. Above 32 KiB, exact-fit ranges
//! (rounded to 256 B) waste less than a 25%-spaced class would. In the four
//! PyTorch training traces in `shared/traces`, requests of at most 32 KiB are
//! 20–35% of allocations and under 0.1% of bytes, while 93–99% of bytes are
//! in requests above 1 MiB: small requests are frequent, so they get the
//! lock-free path; large ones carry the bytes, so they get exact fit. The
//! replay table in `docs/BENCHMARKS.md` shows the measured effect.

/// Every block is aligned to (and a multiple of) this many bytes.
pub const ALIGN: u64 = 256;

/// The class table for one pool.
#[derive(Debug, Clone)]
pub struct SizeClasses {
    /// Slot sizes, smallest first, in a table of 256 (there are fewer than
    /// 255 classes), so the fast lane's lookup masks the class instead of
    /// checking bounds.
    table: Box<[u64; 256]>,
    /// Number of classes.
    len: usize,
    /// Class index by `(size - 1) / ALIGN`: the fast path's lookup is one load.
    lut: Vec<u8>,
}

impl SizeClasses {
    /// Classes up to `small_max` (rounded down to a class boundary, at least 256).
    pub fn new(small_max: u64) -> SizeClasses {
        let small_max = small_max.max(ALIGN);
        let mut sizes = Vec::new();
        let mut s = ALIGN;
        while s <= small_max {
            sizes.push(s);
            // Every multiple of 256 up to 1 KiB; above a power of two p the
            // classes are 1.25p, 1.5p, 1.75p, 2p.
            let p = 1u64 << (63 - s.leading_zeros());
            s += if s < 1024 { ALIGN } else { p / 4 };
        }
        assert!(sizes.len() < 255, "too many size classes");
        let max = *sizes.last().expect("at least one class");
        let mut lut = Vec::with_capacity((max / ALIGN) as usize);
        let mut c = 0usize;
        for unit in 1..=max / ALIGN {
            while sizes[c] < unit * ALIGN {
                c += 1;
            }
            lut.push(c as u8);
        }
        let mut table = Box::new([0u64; 256]);
        table[..sizes.len()].copy_from_slice(&sizes);
        SizeClasses {
            table,
            len: sizes.len(),
            lut,
        }
    }

    /// The largest size served by a class.
    #[inline]
    pub fn small_max(&self) -> u64 {
        self.table[self.len - 1]
    }

    /// Number of classes.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no classes (never: at least one exists).
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The class of a request of `size` bytes (1..=small_max).
    #[inline]
    pub fn class_of(&self, size: u64) -> Option<usize> {
        // One bounds check is the whole range check: `lut` has
        // `small_max / ALIGN` entries and `small_max` is a multiple of
        // ALIGN, so `(size - 1) / ALIGN` is in bounds exactly for sizes
        // 1..=small_max, and size 0 wraps far past the end.
        let i = usize::try_from(size.wrapping_sub(1) / ALIGN).ok()?;
        self.lut.get(i).map(|&c| usize::from(c))
    }

    /// Slot size of class `c`.
    #[inline]
    pub fn size_of(&self, c: usize) -> u64 {
        debug_assert!(c < self.len);
        // The mask is the identity on classes (fewer than 255).
        self.table[c & 0xff]
    }

    /// All slot sizes, smallest first.
    pub fn sizes(&self) -> &[u64] {
        &self.table[..self.len]
    }
}

/// Rounds a large request up to the block alignment.
#[inline]
pub fn round_large(size: u64) -> u64 {
    size.div_ceil(ALIGN) * ALIGN
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_aligned_sorted_and_cover_every_size() {
        let sc = SizeClasses::new(256 << 10);
        assert_eq!(sc.small_max(), 256 << 10);
        assert!(sc.sizes().windows(2).all(|w| w[0] < w[1]));
        assert!(sc.sizes().iter().all(|s| s % ALIGN == 0));
        for size in
            (1..=(256u64 << 10))
                .step_by(97)
                .chain([1, 255, 256, 257, 1024, 1025, 256 << 10])
        {
            let c = sc.class_of(size).unwrap();
            let slot = sc.size_of(c);
            assert!(slot >= size, "{size} -> {slot}");
            if c > 0 {
                assert!(
                    sc.size_of(c - 1) < size,
                    "{size} not in the smallest fitting class"
                );
            }
            if size > 1024 {
                assert!((slot - size) * 4 < slot, "{size} -> {slot}: waste over 25%");
            } else {
                assert!(slot - size < ALIGN);
            }
        }
        assert_eq!(sc.class_of(0), None);
        assert_eq!(sc.class_of((256 << 10) + 1), None);
        assert_eq!(sc.class_of(u64::MAX), None);
        assert_eq!(sc.class_of(256 << 10), Some(sc.len() - 1));
    }

    #[test]
    fn the_table_matches_the_docs() {
        let sc = SizeClasses::new(8192);
        assert_eq!(
            sc.sizes(),
            &[
                256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096, 5120, 6144,
                7168, 8192
            ]
        );
        assert_eq!(round_large(1), 256);
        assert_eq!(round_large(512), 512);
    }
}
