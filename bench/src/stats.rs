//! A figure over repeated runs: median with min and max; and paired ratios to a baseline.

/// Median, min and max of one figure's runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Summary {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub runs: usize,
}

impl Summary {
    /// None for no runs. The median of an even count is the mean of the middle two.
    pub(crate) fn of(values: &[f64]) -> Option<Summary> {
        if values.is_empty() {
            return None;
        }
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let mid = v.len() / 2;
        let median = if v.len().is_multiple_of(2) {
            (v[mid - 1] + v[mid]) / 2.0
        } else {
            v[mid]
        };
        Some(Summary {
            median,
            min: v[0],
            max: v[v.len() - 1],
            runs: v.len(),
        })
    }
}

/// Ratios of runs made in the same round: `values[i] / baseline[i]`. Pairing by round cancels the drift of
/// a shared machine (another engineer's build slows both sides of a pair alike). Rounds where either side
/// is missing, or the baseline is zero, are skipped.
pub(crate) fn paired_ratios(values: &[Option<f64>], baseline: &[Option<f64>]) -> Vec<f64> {
    values
        .iter()
        .zip(baseline)
        .filter_map(|(v, b)| match (v, b) {
            (Some(v), Some(b)) if *b != 0.0 => Some(v / b),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_min_max_of_odd_and_even_counts() {
        let s = Summary::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.median, s.min, s.max, s.runs), (2.0, 1.0, 3.0, 3));
        let s = Summary::of(&[4.0, 1.0, 3.0, 2.0]).unwrap();
        assert_eq!((s.median, s.min, s.max), (2.5, 1.0, 4.0));
        assert_eq!(Summary::of(&[]), None);
    }

    #[test]
    fn ratios_pair_rounds_and_skip_gaps() {
        let r = paired_ratios(
            &[Some(8.0), None, Some(3.0), Some(1.0)],
            &[Some(10.0), Some(5.0), Some(0.0), Some(2.0)],
        );
        assert_eq!(r, vec![0.8, 0.5]);
    }
}
