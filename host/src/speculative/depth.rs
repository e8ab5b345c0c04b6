//! `draft_tokens = "auto"`: how many tokens the rows of a round draft, chosen before every
//! round for the most tokens per millisecond that round is expected to produce.
//!
//! A round of B rows drafting d tokens each costs the drafter's d steps and a verify forward
//! over B·(d + 1) window tokens, and produces, per row, one token plus the drafts it accepts.
//! Each row keeps its own acceptance by draft position ([`Acceptance`]), so a row in a
//! passage the drafter knows by heart pulls the round deeper and one it cannot predict pulls
//! it shallower; the costs are measured on this target and this drafter ([`RoundCosts`]). The
//! rows of a round share one depth: the verify window is padded to its longest row, so a
//! shorter draft in one row would save the target nothing.

/// The most tokens a row drafts under "auto" (the caches' rollback room is sized for it).
pub const AUTO_MOST: usize = 8;

/// Each round, what earlier rounds taught is weighed by this factor: a row's acceptance follows
/// the last few dozen rounds, so it changes as the text moves between passages the drafter
/// predicts and passages it does not, and positions left undrafted drift back to the prior,
/// which tries them again.
const DECAY: f64 = 0.95;
/// What a row is assumed to accept before it has drafted: its first draft with this
/// probability, and each further one, once the one before was accepted, as often as the one
/// before it.
const PRIOR_FIRST: f64 = 0.7;
/// How many rounds' worth of evidence the prior counts for at each position.
const PRIOR_WEIGHT: f64 = 1.0;

/// One row's live acceptance, kept apart for rounds that follow a round whose every draft was
/// accepted and rounds that follow one with a rejection: a drafter that knows a passage tends
/// to know its next tokens too, and one that just missed tends to miss again.
#[derive(Debug, Clone, Default)]
pub(super) struct Acceptance {
    after_hit: Counts,
    after_miss: Counts,
    /// Whether the last round that drafted had a draft rejected.
    missed: bool,
}

/// Per draft position k, (decayed) counts of the rounds that drafted it with every draft before
/// it accepted, and of those that accepted it too.
#[derive(Debug, Clone, Default)]
struct Counts {
    reached: [f64; AUTO_MOST],
    accepted: [f64; AUTO_MOST],
}

impl Acceptance {
    /// Counts a round that drafted `drafted` tokens and accepted the first `accepted`.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            // Evidence fades while the row does not draft, so that it tries again.
            self.after_hit.fade();
            self.after_miss.fade();
            return;
        }
        if self.missed { &mut self.after_miss } else { &mut self.after_hit }.record(drafted, accepted);
        self.missed = accepted < drafted;
    }

    /// For each position k, the probability that the next round's first k + 1 drafts are all
    /// accepted (given it drafts that deep).
    pub fn estimates(&self) -> [f64; AUTO_MOST] {
        if self.missed { &self.after_miss } else { &self.after_hit }.estimates()
    }
}

impl Counts {
    fn record(&mut self, drafted: usize, accepted: usize) {
        self.fade();
        for k in 0..accepted.min(AUTO_MOST) {
            self.accepted[k] += 1.0;
        }
        for k in 0..drafted.min(accepted + 1).min(AUTO_MOST) {
            self.reached[k] += 1.0;
        }
    }

    /// Weighs what the counts hold by [`DECAY`].
    fn fade(&mut self) {
        self.reached.iter_mut().chain(&mut self.accepted).for_each(|c| *c *= DECAY);
    }

    /// Each position's acceptance once the drafts before it were accepted, from the counts
    /// shrunk toward the position before it (the first toward [`PRIOR_FIRST`]); their running
    /// products.
    fn estimates(&self) -> [f64; AUTO_MOST] {
        let mut p = [0.0; AUTO_MOST];
        let (mut prior, mut all) = (PRIOR_FIRST, 1.0);
        for ((p, accepted), reached) in p.iter_mut().zip(self.accepted).zip(self.reached) {
            let rate = (accepted + PRIOR_WEIGHT * prior) / (reached + PRIOR_WEIGHT);
            all *= rate;
            *p = all;
            prior = rate;
        }
        p
    }
}

/// The tokens a round drafting `depth` tokens is expected to give a row with acceptance `p`:
/// the target's own token and each draft accepted.
pub(super) fn expected_tokens(p: &[f64; AUTO_MOST], depth: usize) -> f64 {
    1.0 + p[..depth.min(AUTO_MOST)].iter().sum::<f64>()
}

/// What a round costs on this target and drafter, in milliseconds.
#[derive(Debug, Clone)]
pub(super) struct RoundCosts {
    /// A verify forward over n window tokens costs `fixed + per_token · n`: the line through
    /// the forwards measured once on this target, which smooths the machine's noise out of
    /// them and continues past the widths measured.
    fixed: f64,
    per_token: f64,
    /// Rounds' measured verify time over what the line predicted for them (a running mean):
    /// long contexts and sampling cost more than the measurement's short windows.
    scale: f64,
    /// What a round of branching trees cost over the scaled line for its window tokens (a
    /// running mean, ms): the tree route gathers each row's keys beside its nodes, and writes the
    /// accepted path after the forward.
    branching: f64,
    /// A round's drafting time against its depth, the sums of a least-squares line, each
    /// round weighing [`DECAY`] of the one after it.
    draft: LineSums,
    /// Whether rounds' times update the costs. Off for a tensor-parallel target, whose ranks
    /// must choose the same depths from the same numbers.
    learns: bool,
}

/// Weight of a round's time in the running means.
const LEARNING_RATE: f64 = 0.1;

impl RoundCosts {
    /// Costs from `verify_ms[n − 1]`, a forward's time over n tokens.
    pub fn new(verify_ms: &[f64], learns: bool) -> RoundCosts {
        let (fixed, per_token) = line_through(verify_ms);
        RoundCosts { fixed, per_token, scale: 1.0, branching: 0.0, draft: LineSums::default(), learns }
    }

    /// A verify forward over `tokens` window tokens (all rows together).
    pub fn verify(&self, tokens: usize) -> f64 {
        self.measured(tokens) * self.scale
    }

    /// A verify forward over `tokens` window tokens of branching trees.
    pub fn verify_branching(&self, tokens: usize) -> f64 {
        self.verify(tokens) + self.branching.max(0.0)
    }

    /// The measurement's line at `tokens`.
    fn measured(&self, tokens: usize) -> f64 {
        self.fixed + self.per_token * tokens as f64
    }

    /// Drafting `depth` tokens and committing the round: the line through the rounds' times,
    /// proportional to depth while one depth alone was drafted, nothing before any round
    /// drafted (the first finds out).
    pub fn draft(&self, depth: usize) -> f64 {
        if depth == 0 {
            return 0.0;
        }
        self.draft.at(depth as f64)
    }

    /// Learns from a round of `tokens` window tokens that drafted `depth` tokens per row, of
    /// branching trees or not.
    pub fn record(&mut self, depth: usize, draft_ms: f64, tokens: usize, verify_ms: f64, branched: bool) {
        if !self.learns {
            return;
        }
        let predicted = self.measured(tokens);
        if branched && verify_ms.is_finite() {
            self.branching += LEARNING_RATE * (verify_ms - self.verify(tokens) - self.branching);
        } else if predicted > 0.0 && verify_ms.is_finite() {
            self.scale += LEARNING_RATE * (verify_ms / predicted - self.scale);
        }
        if depth > 0 && draft_ms.is_finite() {
            self.draft.add(depth as f64, draft_ms);
        }
    }
}

/// Decayed sums of points (x, y), for the least-squares line through them.
#[derive(Debug, Clone, Default)]
struct LineSums {
    n: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

impl LineSums {
    fn add(&mut self, x: f64, y: f64) {
        for (sum, term) in
            [(&mut self.n, 1.0), (&mut self.x, x), (&mut self.y, y), (&mut self.xx, x * x), (&mut self.xy, x * y)]
        {
            *sum = *sum * DECAY + term;
        }
    }

    /// The line's value at `x` (never falling with x, nor below zero); through the origin while
    /// the points share one x, zero before any.
    fn at(&self, x: f64) -> f64 {
        if self.n == 0.0 {
            return 0.0;
        }
        let variance = self.xx / self.n - (self.x / self.n).powi(2);
        if variance < 1e-6 {
            return self.y / self.x * x;
        }
        let slope = ((self.xy / self.n - self.x * self.y / (self.n * self.n)) / variance).max(0.0);
        let intercept = (self.y - slope * self.x) / self.n;
        (intercept + slope * x).max(0.0)
    }
}

/// A line (intercept, slope ≥ 0) through the points (n, ms[n − 1]): through the one-token
/// forward's time, with the median of the slopes from it to each wider forward. A spell of load
/// on the machine while the widths are timed moves a few of the points; a least-squares line
/// through them could tilt until a one-token forward looked nearly free, and then no depth
/// would ever look worth drafting, nor be tried to correct it.
fn line_through(ms: &[f64]) -> (f64, f64) {
    let Some(&one) = ms.first() else {
        return (0.0, 0.0);
    };
    let mut slopes: Vec<f64> = ms.iter().enumerate().skip(1).map(|(i, &y)| (y - one) / i as f64).collect();
    slopes.sort_by(f64::total_cmp);
    let mid = slopes.len() / 2;
    let median = match slopes.len() {
        0 => 0.0,
        n if n % 2 == 1 => slopes[mid],
        _ => (slopes[mid - 1] + slopes[mid]) / 2.0,
    };
    let slope = median.max(0.0);
    (one - slope, slope)
}

/// The depth, 0 to `most`, for a round whose rows have acceptance `rows[r].0` and may draft at
/// most `rows[r].1` tokens: the one with the most expected tokens per millisecond. Ties go to
/// the shallower depth.
pub(super) fn choose_depth(rows: &[([f64; AUTO_MOST], usize)], most: usize, costs: &RoundCosts) -> usize {
    let rate = |depth: usize| chain_rate(rows, depth, costs);
    let mut best = (0, rate(0));
    for depth in 1..=most.min(AUTO_MOST) {
        let r = rate(depth);
        if r > best.1 {
            best = (depth, r);
        }
    }
    best.0
}

/// The tokens per millisecond expected of a round whose rows draft chains `depth` deep.
pub(super) fn chain_rate(rows: &[([f64; AUTO_MOST], usize)], depth: usize, costs: &RoundCosts) -> f64 {
    let tokens: f64 = rows.iter().map(|(p, cap)| expected_tokens(p, depth.min(*cap))).sum();
    tokens / (costs.draft(depth) + costs.verify(rows.len() * (depth + 1)))
}

/// The draft length as reports print it: "3", or "auto (up to 8)".
pub fn describe_draft_tokens(auto: bool, most: usize) -> String {
    if auto {
        format!("auto (up to {most})")
    } else {
        most.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs(verify_ms: &[f64], draft_ms: f64) -> RoundCosts {
        let mut c = RoundCosts::new(verify_ms, true);
        for d in 1..=AUTO_MOST {
            c.draft.add(d as f64, draft_ms * d as f64);
        }
        c
    }

    #[test]
    fn estimates_follow_the_rows_counts_and_never_rise() {
        let mut a = Acceptance::default();
        for _ in 0..200 {
            a.record(4, 4);
        }
        let p = a.estimates();
        assert!(p[..4].iter().all(|&x| x > 0.95), "{p:?}");
        // Undrafted positions continue the last position's rate.
        assert!(p[4..].iter().all(|&x| x > 0.9), "{p:?}");
        let mut b = Acceptance::default();
        for _ in 0..200 {
            b.record(4, 0);
        }
        let q = b.estimates();
        assert!(q[0] < 0.05, "{q:?}");
        assert!(q.windows(2).all(|w| w[1] <= w[0]), "{q:?}");
        // Half the rounds accept both drafts, half the first alone: the first always, the second
        // half the time.
        let mut c = Counts::default();
        for i in 0..400 {
            c.record(2, 1 + i % 2);
        }
        let r = c.estimates();
        assert!(r[0] > 0.95 && (r[1] - 0.5).abs() < 0.1, "{r:?}");
    }

    #[test]
    fn a_rejection_at_one_position_is_no_evidence_about_later_ones() {
        let mut a = Counts::default();
        for i in 0..400 {
            // Every other round misses at once; the others accept all four.
            a.record(4, if i % 2 == 0 { 0 } else { 4 });
        }
        let p = a.estimates();
        assert!((p[0] - 0.5).abs() < 0.1 && p[3] > 0.4, "{p:?}");
    }

    #[test]
    fn rounds_after_a_miss_are_estimated_apart() {
        let mut a = Acceptance::default();
        // Runs of ten fully accepted rounds, then ten missed at once.
        for i in 0..400 {
            a.record(4, if (i / 10) % 2 == 0 { 4 } else { 0 });
        }
        a.record(4, 4);
        let after_hit = a.estimates()[0];
        a.record(4, 0);
        let after_miss = a.estimates()[0];
        assert!(after_hit > 0.8 && after_miss < 0.2, "{after_hit} after a hit, {after_miss} after a miss");
    }

    #[test]
    fn undrafted_positions_return_to_the_prior() {
        let mut a = Acceptance::default();
        for _ in 0..50 {
            a.record(2, 0);
        }
        let low = a.estimates()[0];
        for _ in 0..200 {
            a.record(0, 0);
        }
        let later = a.estimates()[0];
        assert!(low < 0.1 && (later - PRIOR_FIRST).abs() < 0.01, "{low} then {later}");
    }

    #[test]
    fn a_well_predicted_row_drafts_deep_and_a_poor_one_not_at_all() {
        // Verify costs 1 ms plus 0.06 ms per extra token, drafting 0.01 ms per token.
        let verify: Vec<f64> = (0..9).map(|n| 1.0 + 0.06 * n as f64).collect();
        let c = costs(&verify, 0.01);
        assert_eq!(choose_depth(&[([0.95; AUTO_MOST], 8)], 8, &c), 8);
        assert_eq!(choose_depth(&[([0.02; AUTO_MOST], 8)], 8, &c), 0);
        // A row's cap and the round's most bound the depth.
        assert_eq!(choose_depth(&[([0.95; AUTO_MOST], 8)], 3, &c), 3);
        // Lookup's acceptance on the demo target: deeper than the fixed default's 4.
        let lookup = [0.84, 0.73, 0.66, 0.61, 0.57, 0.53, 0.50, 0.46];
        let d = choose_depth(&[(lookup, 8)], 8, &c);
        assert!(d > 4, "{d}");
        // A costly drafter drafts less with the same acceptance.
        let slow = costs(&verify, 0.3);
        assert!(choose_depth(&[(lookup, 8)], 8, &slow) < d);
    }

    #[test]
    fn a_spell_of_load_over_the_wider_widths_does_not_stop_a_faithful_drafter() {
        // 0.3 ms a forward, 0.01 ms a token, the widths from five on timed while the machine was
        // busy: a least-squares line through these starts near zero (0.013 ms at one token), and
        // no depth would beat not drafting.
        let c = costs(&[0.30, 0.31, 0.32, 0.33, 0.6, 0.9, 1.2, 1.5, 1.8], 0.0);
        assert!((c.verify(1) - 0.30).abs() < 1e-9, "{}", c.verify(1));
        assert!(choose_depth(&[([0.95; AUTO_MOST], 8)], 8, &c) >= 4);
    }

    #[test]
    fn more_rows_draft_less_when_the_forward_grows_with_them() {
        // A forward costs 1 ms for one token and 0.2 ms per token past the first few.
        let verify: Vec<f64> = (1..=9).map(|n: usize| 1.0 + 0.2 * n.saturating_sub(4) as f64).collect();
        let c = costs(&verify, 0.0);
        let p = [0.8, 0.65, 0.55, 0.45, 0.4, 0.35, 0.3, 0.25];
        let one = choose_depth(&[(p, 8)], 8, &c);
        let eight = choose_depth(&vec![(p, 8); 8], 8, &c);
        assert!(eight < one, "one row {one}, eight rows {eight}");
    }

    #[test]
    fn costs_learn_the_verify_scale_and_the_drafting_time() {
        // Noisy measurements around a line: through the one-token time, 1.1 ms, with the median
        // of the slopes from it (0.05, 0.125, 0.1 ms a token).
        let mut c = RoundCosts::new(&[1.1, 1.15, 1.35, 1.4], true);
        assert!((c.verify(5) - 1.5).abs() < 1e-9, "{}", c.verify(5));
        assert_eq!(c.draft(3), 0.0);
        for _ in 0..200 {
            c.record(2, 0.5, 3, 2.4, false);
        }
        assert!((c.verify(3) - 2.4).abs() < 1e-6, "{}", c.verify(3));
        // One depth alone: proportional to depth.
        assert!((c.draft(2) - 0.5).abs() < 1e-6 && (c.draft(4) - 1.0).abs() < 1e-6);
        // Rounds of 0.2 ms and 0.1 ms per token: that line.
        for d in (1..=8).cycle().take(400) {
            c.record(d, 0.2 + 0.1 * d as f64, 3, 2.4, false);
        }
        assert!((c.draft(6) - 0.8).abs() < 1e-6, "{}", c.draft(6));
        let mut fixed = RoundCosts::new(&[1.1, 1.2, 1.3], false);
        fixed.record(2, 0.5, 3, 2.4, false);
        assert!((fixed.verify(3) - 1.3).abs() < 1e-9 && fixed.draft(2) == 0.0);
    }
}
