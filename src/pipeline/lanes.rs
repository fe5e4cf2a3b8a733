//! `Lanes`: how many threads a stage may split its rows across. A lone request on an
//! otherwise idle device gets the device's cores (the replica holds the solo sessions,
//! see `crate::replica::cores`); under load every stage runs on its replica's thread
//! alone, so that the stages never take the cores the other replicas' models run on.
//!
//! Each lane computes whole output rows, and every row is computed the same way whatever
//! the split, so the result is the same bits for any number of lanes (the tests check).

use std::num::NonZeroUsize;

/// Threads for one stage's rows: the calling thread and `get() - 1` scoped helpers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lanes(NonZeroUsize);

impl Lanes {
    /// The calling thread alone.
    pub const ONE: Lanes = Lanes(NonZeroUsize::MIN);

    /// `n` lanes (0 reads as 1).
    pub fn new(n: usize) -> Self {
        Lanes(NonZeroUsize::new(n).unwrap_or(NonZeroUsize::MIN))
    }

    pub fn get(self) -> usize {
        self.0.get()
    }

    /// Calls `f(first_row, rows)` on disjoint runs of whole rows of `out` (rows of
    /// `row_len` items) that together cover it, one run per lane; the calling thread
    /// takes the first. Rows below `MIN_ROWS_PER_LANE` per lane are not worth a thread.
    pub fn rows<T: Send>(self, out: &mut [T], row_len: usize, f: impl Fn(usize, &mut [T]) + Sync) {
        let rows = out.len().checked_div(row_len).unwrap_or(0);
        let lanes = self.get().min(rows / MIN_ROWS_PER_LANE).max(1);
        if lanes == 1 {
            f(0, out);
            return;
        }
        let per_lane = rows.div_ceil(lanes);
        let f = &f;
        std::thread::scope(|scope| {
            let mut chunks = out.chunks_mut(per_lane * row_len).enumerate();
            let first = chunks.next();
            for (i, chunk) in chunks {
                scope.spawn(move || f(i * per_lane, chunk));
            }
            if let Some((_, chunk)) = first {
                f(0, chunk);
            }
        });
    }
}

/// Below this many rows a lane's work (tens of microseconds) costs less than starting
/// its thread.
const MIN_ROWS_PER_LANE: usize = 16;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_is_visited_once_with_its_index_whatever_the_lanes() {
        for lanes in 1..=5 {
            for rows in [0, 1, 15, 16, 33, 100, 101] {
                let mut out = vec![0usize; rows * 3];
                Lanes::new(lanes).rows(&mut out, 3, |first, chunk| {
                    for (r, row) in chunk.chunks_exact_mut(3).enumerate() {
                        for v in row {
                            *v += first + r + 1;
                        }
                    }
                });
                let want: Vec<usize> = (0..rows).flat_map(|r| [r + 1; 3]).collect();
                assert_eq!(out, want, "{lanes} lanes, {rows} rows");
            }
        }
    }

    #[test]
    fn zero_lanes_is_one() {
        assert_eq!(Lanes::new(0), Lanes::ONE);
        assert_eq!(Lanes::new(3).get(), 3);
    }
}
