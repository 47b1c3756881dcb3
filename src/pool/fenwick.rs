//! A Fenwick (binary indexed) tree of counts: point update and prefix sum
//! in O(log n). The heap keeps one over its granules to count mapped
//! granules in any address span without walking it.

/// Counts per index with O(log n) prefix sums.
#[derive(Debug, Clone)]
pub(crate) struct Fenwick {
    tree: Vec<i64>,
}

impl Fenwick {
    /// `n` zero counts.
    pub(crate) fn new(n: usize) -> Self {
        Fenwick {
            tree: vec![0; n + 1],
        }
    }

    /// Adds `delta` at index `i`.
    pub(crate) fn add(&mut self, i: usize, delta: i64) {
        let mut i = i + 1;
        while i < self.tree.len() {
            self.tree[i] += delta;
            i += i & i.wrapping_neg();
        }
    }

    /// Sum of indices `0..i`.
    pub(crate) fn prefix(&self, i: usize) -> i64 {
        let mut i = i.min(self.tree.len() - 1);
        let mut s = 0;
        while i > 0 {
            s += self.tree[i];
            i -= i & i.wrapping_neg();
        }
        s
    }

    /// Sum of indices `lo..=hi`.
    pub(crate) fn range(&self, lo: usize, hi: usize) -> i64 {
        self.prefix(hi + 1) - self.prefix(lo)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_plain_array() {
        let n = 37;
        let mut f = Fenwick::new(n);
        let mut a = vec![0i64; n];
        for k in 0..200usize {
            let i = (k * 7919) % n;
            let d = if k % 3 == 0 { -1 } else { 1 };
            f.add(i, d);
            a[i] += d;
            let (lo, hi) = ((k * 13) % n, (k * 13) % n + (k % (n - (k * 13) % n)));
            assert_eq!(f.range(lo, hi), a[lo..=hi].iter().sum::<i64>());
        }
    }
}
