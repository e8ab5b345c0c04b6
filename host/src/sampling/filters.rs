//! top-k and top-p over log-probabilities, exactly as a sort of the whole vocabulary gives them,
//! at the cost of a vector pass or two and a sort of a few tokens. Removed tokens become -inf.

use kernels::scan::{self, exponentials};

/// Keeps the `k` most likely tokens; of tokens tied at the k-th value, the first ones.
pub(super) fn top_k(lp: &mut [f32], k: usize) {
    // The k largest chunk maxima belong to k different tokens, so the k-th largest value lies at
    // or above the k-th largest maximum: only tokens there can be kept.
    let mut maxima = scan::chunk_maxima(lp);
    let floor = match k.checked_sub(1).filter(|&i| i < maxima.len()) {
        Some(i) => *maxima.select_nth_unstable_by(i, |a, b| b.total_cmp(a)).1,
        None => f32::NEG_INFINITY,
    };
    let candidates = scan::at_or_above(lp, floor);
    // Where the candidates are many (a vocabulary sorted by likelihood, say), a histogram bounds
    // the k-th value closer, so that few need sorting.
    let histogram = Histogram::of(lp, &candidates, false);
    let mut seen = 0usize;
    let mut cut = f32::NEG_INFINITY;
    for (b, &count) in histogram.counts.iter().enumerate() {
        seen += count as usize;
        if seen >= k {
            cut = histogram.floor_of(b);
            break;
        }
    }
    let kept = most_likely_first(lp, &candidates, cut);
    keep_only(lp, &kept[..k.min(kept.len())]);
}

/// Keeps the smallest set of most likely tokens whose mass reaches `p`, its mass summed most
/// likely first: what a sort of the whole vocabulary gives.
///
/// The set lies among the tokens at or above the first histogram bin by which the bins' mass
/// passes `p` by a margin far above its rounding; only those are sorted. Should their exact sum
/// still fall short of `p` (or the margin not fit below 1), every token is sorted.
pub(super) fn top_p(lp: &mut [f32], p: f32) {
    const MARGIN: f64 = 1e-4;
    // At most V tokens lie below `floor`, each with less than e^floor = (1 - p - MARGIN) / V of
    // the mass: the tokens at or above it hold more than p + MARGIN, and the histogram needs only
    // them. On a real vocabulary they are a few percent of it.
    let spare = 1.0 - p as f64 - MARGIN;
    let floor = if spare > 0.0 { (spare / lp.len() as f64).ln() as f32 } else { f32::NEG_INFINITY };
    let mut candidates = scan::at_or_above(lp, floor);
    let histogram = Histogram::of(lp, &candidates, true);
    let mut mass = 0.0f64;
    let mut cut = f32::NEG_INFINITY;
    for (b, &bin) in histogram.masses.iter().enumerate() {
        mass += bin;
        if mass >= p as f64 + MARGIN {
            cut = histogram.floor_of(b);
            break;
        }
    }
    let mut everything = floor == f32::NEG_INFINITY && cut == f32::NEG_INFINITY;
    let mut nucleus = most_likely_first(lp, &candidates, cut);
    let keep = loop {
        let mut mass = 0.0f64;
        let reached = nucleus.iter().position(|&t| {
            mass += (lp[t as usize] as f64).exp();
            mass >= p as f64
        });
        match reached {
            Some(i) => break i + 1,
            None if everything => break nucleus.len(),
            None => {
                everything = true;
                candidates = scan::at_or_above(lp, f32::NEG_INFINITY);
                nucleus = most_likely_first(lp, &candidates, f32::NEG_INFINITY);
            }
        }
    };
    keep_only(lp, &nucleus[..keep]);
}

/// Bins of [`Histogram`] per nat below the best log-probability.
const BINS_PER_NAT: f32 = 16.0;
/// The histogram's reach below the best log-probability, in nats; what lies further down shares
/// its last bin.
const HISTOGRAM_NATS: f32 = 64.0;

/// How many of some tokens, and how much of their mass, lie in each sixteenth of a nat below
/// their best log-probability: it bounds where the k-th token, or the edge of the nucleus, lies,
/// so that only the tokens above that bound need sorting.
struct Histogram {
    best: f32,
    counts: Vec<u32>,
    masses: Vec<f64>,
}

impl Histogram {
    /// The histogram of `tokens` of `lp`, with the bins' masses if asked for (in single
    /// precision: close enough to bound the nucleus, not to decide it).
    fn of(lp: &[f32], tokens: &[u32], with_masses: bool) -> Histogram {
        let values: Vec<f32> = tokens.iter().map(|&t| lp[t as usize]).collect();
        let best = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let last = (HISTOGRAM_NATS * BINS_PER_NAT) as usize;
        let mut counts = vec![0u32; last + 1];
        let mut masses = vec![0f64; if with_masses { last + 1 } else { 0 }];
        let mut exps = vec![0f32; if with_masses { values.len() } else { 0 }];
        exponentials(&values, &mut exps);
        for (i, &x) in values.iter().enumerate() {
            let bin = (((best - x) * BINS_PER_NAT) as usize).min(last);
            counts[bin] += 1;
            if with_masses {
                masses[bin] += exps[i] as f64;
            }
        }
        Histogram { best, counts, masses }
    }

    /// A bound every token of bins 0..=b lies at or above: the lower edge of bin b + 1, a bin
    /// below b's own edge so that rounding in the bin arithmetic cannot put one under it.
    fn floor_of(&self, b: usize) -> f32 {
        if b + 2 >= self.counts.len() {
            f32::NEG_INFINITY
        } else {
            self.best - (b + 2) as f32 / BINS_PER_NAT
        }
    }
}

/// Those of `tokens` at or above `cut`, most likely first, ties in token order: the order a full
/// sort gives them. Each is sorted as one integer (its log-probability's bits, ordered, then its
/// id).
fn most_likely_first(lp: &[f32], tokens: &[u32], cut: f32) -> Vec<u32> {
    let mut keys: Vec<u64> = tokens
        .iter()
        .filter(|&&t| lp[t as usize] >= cut)
        .map(|&t| ((descending_key(lp[t as usize]) as u64) << 32) | t as u64)
        .collect();
    keys.sort_unstable();
    keys.into_iter().map(|key| key as u32).collect()
}

/// A key whose ascending order is the descending order of `x` (total order on floats).
fn descending_key(x: f32) -> u32 {
    let bits = x.to_bits();
    let ascending = if bits >> 31 == 1 { !bits } else { bits | 0x8000_0000 };
    !ascending
}

/// Sets every token but `kept` to -inf.
fn keep_only(lp: &mut [f32], kept: &[u32]) {
    let values: Vec<f32> = kept.iter().map(|&t| lp[t as usize]).collect();
    lp.fill(f32::NEG_INFINITY);
    for (&t, x) in kept.iter().zip(values) {
        lp[t as usize] = x;
    }
}
