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
pub struct Lanes {
    n: NonZeroUsize,
    /// The fewest items a lane is started for (`MIN_ITEMS_PER_LANE`, or none in tests).
    min_items: usize,
}

impl Lanes {
    /// The calling thread alone.
    pub const ONE: Lanes = Lanes {
        n: NonZeroUsize::MIN,
        min_items: MIN_ITEMS_PER_LANE,
    };

    /// `n` lanes (0 reads as 1).
    pub fn new(n: usize) -> Self {
        Lanes {
            n: NonZeroUsize::new(n).unwrap_or(NonZeroUsize::MIN),
            min_items: MIN_ITEMS_PER_LANE,
        }
    }

    /// These lanes for work of any size (rows permitting): for the tests that hold a
    /// split to the same bits as none on small images.
    #[cfg(test)]
    pub fn at_any_size(self) -> Self {
        Lanes {
            min_items: 0,
            ..self
        }
    }

    pub fn get(self) -> usize {
        self.n.get()
    }

    /// Calls `f(first_row, rows)` on disjoint runs of whole rows of `out` (rows of
    /// `row_len` items) that together cover it, one run per lane; the calling thread
    /// takes the first. Fewer than `MIN_ROWS_PER_LANE` rows or `MIN_ITEMS_PER_LANE`
    /// items per lane are not worth a thread.
    pub fn rows<T: Send>(self, out: &mut [T], row_len: usize, f: impl Fn(usize, &mut [T]) + Sync) {
        let rows = out.len().checked_div(row_len).unwrap_or(0);
        let lanes = self
            .get()
            .min(rows / MIN_ROWS_PER_LANE)
            .min(out.len().checked_div(self.min_items).unwrap_or(usize::MAX))
            .max(1);
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

/// Below this many items (pixels, or samples of rows of pixels) a lane's work costs less
/// than its thread's start and its wait for a core: the stages run right after the
/// model, whose pool threads spin a while before they sleep. Measured with `bench local`
/// on the 320x320 photo, 2 threads: the matting stage with its 102 k alpha pixels in 2
/// lanes took 3.5 ms p50 against 1.2 in one. At 1920x1080 every split pass has at least
/// 2 lanes of this much (the model input's vertical pass, 320x320x3, the least).
const MIN_ITEMS_PER_LANE: usize = 1 << 17;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_is_visited_once_with_its_index_whatever_the_lanes() {
        for lanes in 1..=5 {
            for rows in [0, 1, 15, 16, 33, 100, 101] {
                let mut out = vec![0usize; rows * 3];
                Lanes::new(lanes)
                    .at_any_size()
                    .rows(&mut out, 3, |first, chunk| {
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
    fn small_work_stays_on_the_calling_thread() {
        let caller = std::thread::current().id();
        let threads = |len: usize| {
            let seen = std::sync::Mutex::new(Vec::new());
            let mut out = vec![0u8; len];
            Lanes::new(4).rows(&mut out, 64, |_, _| {
                let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
                seen.push(std::thread::current().id());
            });
            seen.into_inner().unwrap_or_else(|p| p.into_inner())
        };
        // 320x320 pixels: one lane, this thread.
        assert_eq!(threads(320 * 320), vec![caller]);
        // Two lanes' worth of items: two lanes, this thread one of them.
        let two = threads(2 * MIN_ITEMS_PER_LANE);
        assert_eq!(two.len(), 2);
        assert!(two.contains(&caller));
        // Four lanes' worth: all four.
        assert_eq!(threads(4 * MIN_ITEMS_PER_LANE).len(), 4);
    }

    #[test]
    fn zero_lanes_is_one() {
        assert_eq!(Lanes::new(0), Lanes::ONE);
        assert_eq!(Lanes::new(3).get(), 3);
    }
}
