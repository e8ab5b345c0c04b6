//! How many drafts a round's trees hold, chosen before every round for the most tokens per
//! millisecond it is expected to produce, as `"auto"` chooses a chain's depth ([`super::depth`]).
//!
//! Drafters give a tree's nodes likeliest first, every parent before its children, so the
//! first n nodes of a tree are a tree too. The tokens a round gives a row are one plus the
//! nodes on its accepted path, so its expected tokens with the first n nodes are one plus the
//! sum, over ranks k < n, of the chance that the node at rank k is on that path. Each row keeps
//! those chances from its rounds ([`NodeAcceptance`]); a verify forward over a tree costs what
//! one over as many tokens does (the line of [`RoundCosts`], scaled by the rounds' own times).

use super::depth::RoundCosts;

/// Weight of earlier rounds, as for depths: a row's chances follow its last few dozen rounds,
/// and ranks no longer drafted drift back to the prior, which tries them again.
const DECAY: f64 = 0.95;
/// What a row is assumed to accept before it has drafted a tree: the first node with this
/// chance, and each further rank with [`PRIOR_STEP`] of the chance before it.
const PRIOR_FIRST: f64 = 0.7;
const PRIOR_STEP: f64 = 0.8;
/// How many rounds' worth of evidence the prior counts for at each rank.
const PRIOR_WEIGHT: f64 = 1.0;

/// One row's decayed counts, per node rank, of the tree rounds that offered a node there and
/// of those whose accepted path went through it.
#[derive(Debug, Clone, Default)]
pub(super) struct NodeAcceptance {
    offered: Vec<f64>,
    on_path: Vec<f64>,
}

impl NodeAcceptance {
    /// Counts a round whose tree had `nodes` nodes and kept the ranks in `path`.
    pub fn record(&mut self, nodes: usize, path: &[usize]) {
        let ranks = nodes.max(self.offered.len());
        self.offered.resize(ranks, 0.0);
        self.on_path.resize(ranks, 0.0);
        self.offered.iter_mut().chain(&mut self.on_path).for_each(|c| *c *= DECAY);
        self.offered[..nodes].iter_mut().for_each(|c| *c += 1.0);
        path.iter().filter(|&&k| k < nodes).for_each(|&k| self.on_path[k] += 1.0);
    }

    /// The chance that the node at each rank below `most` is on the accepted path.
    pub fn estimates(&self, most: usize) -> Vec<f64> {
        (0..most)
            .map(|k| {
                let prior = PRIOR_FIRST * PRIOR_STEP.powi(k as i32);
                let (offered, on_path) =
                    (self.offered.get(k).copied().unwrap_or(0.0), self.on_path.get(k).copied().unwrap_or(0.0));
                (on_path + PRIOR_WEIGHT * prior) / (offered + PRIOR_WEIGHT)
            })
            .collect()
    }
}

/// The most nodes, 1 to `most`, for a round whose rows' chances per rank are `rows[r]` and
/// which drafts `depth` deep: the count with the most expected tokens per millisecond. Ties go
/// to the smaller tree. More nodes than `depth` make a branching tree, which costs what the
/// rounds of branching trees have cost over a chain's line; fewer may still branch, and are
/// costed as a chain.
pub(super) fn choose_nodes(rows: &[Vec<f64>], most: usize, depth: usize, costs: &RoundCosts) -> usize {
    let rate = |n: usize| tree_rate(rows, n, depth, costs);
    let mut best = (1, rate(1));
    for n in 2..=most {
        let r = rate(n);
        if r > best.1 {
            best = (n, r);
        }
    }
    best.0
}

/// The tokens per millisecond expected of a round whose rows draft trees of `n` nodes, `depth`
/// deep.
pub(super) fn tree_rate(rows: &[Vec<f64>], n: usize, depth: usize, costs: &RoundCosts) -> f64 {
    let tokens: f64 = rows.iter().map(|p| 1.0 + p.iter().take(n).sum::<f64>()).sum();
    let window = rows.len() * (n + 1);
    let verify = if n > depth { costs.verify_branching(window) } else { costs.verify(window) };
    tokens / (costs.draft(depth) + verify)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_on_the_path_keep_high_chances_and_others_fall() {
        let mut a = NodeAcceptance::default();
        for i in 0..300 {
            // Rank 0 always on the path, rank 3 every other round, ranks 1, 2, 4, 5 never.
            let path: &[usize] = if i % 2 == 0 { &[0, 3] } else { &[0] };
            a.record(6, path);
        }
        let p = a.estimates(8);
        assert!(p[0] > 0.95 && (p[3] - 0.5).abs() < 0.05, "{p:?}");
        assert!(p[1] < 0.05 && p[5] < 0.05, "{p:?}");
        // Ranks never offered keep the prior.
        assert!((p[7] - PRIOR_FIRST * PRIOR_STEP.powi(7)).abs() < 1e-9, "{p:?}");
    }

    #[test]
    fn a_tree_grows_while_its_nodes_pay_for_their_verification() {
        // Verify costs 1 ms plus 0.05 ms per token; drafting nothing.
        let verify: Vec<f64> = (1..=9).map(|n| 1.0 + 0.05 * n as f64).collect();
        let costs = RoundCosts::new(&verify, true);
        // Each of the first four ranks is on the path half the time, the rest never: four.
        let p = vec![0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0];
        assert_eq!(choose_nodes(std::slice::from_ref(&p), 8, 4, &costs), 4);
        // Ranks worth a hundredth of a token each do not pay for their 0.05 ms.
        let q = vec![0.9, 0.8, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01];
        assert_eq!(choose_nodes(&[q], 8, 4, &costs), 2);
        // More rows share the forward: the same chances, a smaller tree or the same.
        let costly: Vec<f64> = (1..=9).map(|n| 1.0 + 0.3 * n as f64).collect();
        let costs = RoundCosts::new(&costly, true);
        assert!(choose_nodes(&vec![p; 4], 8, 4, &costs) < 4);
    }

    #[test]
    fn branching_pays_only_for_what_it_costs_over_a_chain() {
        let verify: Vec<f64> = (1..=9).map(|n| 1.0 + 0.05 * n as f64).collect();
        let mut costs = RoundCosts::new(&verify, true);
        // Two ranks past a depth of 2 worth 0.3 tokens each: while branching costs nothing
        // more, the tree takes them.
        let p = vec![0.9, 0.8, 0.3, 0.3, 0.0, 0.0];
        assert_eq!(choose_nodes(std::slice::from_ref(&p), 6, 2, &costs), 4);
        // Rounds of branching trees that cost 1 ms over the line: a chain of 2.
        for _ in 0..100 {
            costs.record(2, 0.0, 5, 1.0 + 0.05 * 5.0 + 1.0, true);
        }
        assert_eq!(choose_nodes(std::slice::from_ref(&p), 6, 2, &costs), 2);
        // And chains' own rounds keep their costs: the line's scale is unmoved.
        assert!((costs.verify(5) - 1.25).abs() < 1e-9, "{}", costs.verify(5));
    }
}
