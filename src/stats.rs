//! The percentiles every report of the project takes (the benchmarks, `celer sim`), so
//! that one definition of a quantile holds everywhere. The ground floor.

/// The `q` quantile (0..=1) of `sorted`, the value at index `floor(len x q)`; `None`
/// when empty.
pub fn quantile<T: Copy>(sorted: &[T], q: f64) -> Option<T> {
    let last = sorted.len().checked_sub(1)?;
    Some(sorted[((sorted.len() as f64 * q) as usize).min(last)])
}

/// The median of `values` (sorted in place); 0 when empty.
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    quantile(values, 0.5).unwrap_or(0.0)
}
