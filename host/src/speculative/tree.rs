//! Acceptance over a row's tree of drafts (the extension `draft-tree/1`): which path the target
//! keeps, and the token that follows it. Verification gives the target's distribution after
//! the pending token and after every node; a path is then accepted node by node from the
//! pending token down, as a chain is, choosing among a node's children instead of taking one.

use plugin_api::draft_tree::Tree;

/// Match: from the pending token down, the child whose token is the target's own token after
/// its parent, while there is one. `target(None)` is the target's token after the pending
/// token, `target(Some(u))` after node u, each drawn as plain decoding draws the token at that
/// depth, so the tokens kept are plain decoding's. The path (nodes) and the token after it.
pub fn match_path(tree: &Tree, mut target: impl FnMut(Option<usize>) -> u32) -> (Vec<usize>, u32) {
    let mut path = Vec::new();
    let mut at = None;
    loop {
        let token = target(at);
        match tree.child(at, token) {
            Some(child) => {
                path.push(child);
                at = Some(child);
            }
            None => return (path, token),
        }
    }
}

/// Rejection over several candidates (SpecInfer's multi-step speculative sampling): after a
/// node, with the target's distribution p there, each child c in turn is accepted with
/// probability min(1, p(c)/q_c(c)), q_c the distribution it was drawn from (`q`, [nodes, V]);
/// a rejected child leaves p ← normalize(max(p − q_c, 0)) for the next. Where every child is
/// rejected, or at a leaf, the token is drawn from p. Each step is a speculative sampling step
/// for the p it starts from, so the token kept at every depth is distributed as the target's
/// own, whether siblings were drawn with replacement or without (q_c then zero at earlier
/// siblings' tokens). `target(u)` is the target's distribution after node u (None: after the
/// pending token); `uniform(depth, k)` a uniform draw in [0, 1) for the k-th decision at that
/// depth. The path and the token after it.
pub fn rejection_path(
    tree: &Tree,
    q: &[f32],
    mut target: impl FnMut(Option<usize>) -> Vec<f64>,
    mut uniform: impl FnMut(usize, usize) -> f64,
) -> (Vec<usize>, u32) {
    let vocab = if tree.is_empty() { 0 } else { q.len() / tree.len() };
    let mut path = Vec::new();
    let mut at = None;
    loop {
        let depth = path.len();
        let mut p = target(at);
        let children: Vec<usize> = (0..tree.len()).filter(|&i| tree.parent(i) == at).collect();
        let mut accepted = None;
        for (k, &c) in children.iter().enumerate() {
            let qc = &q[c * vocab..(c + 1) * vocab];
            let token = tree.tokens[c] as usize;
            let (pc, qt) = (p[token], qc[token] as f64);
            if qt <= 0.0 || uniform(depth, k) < (pc / qt).min(1.0) {
                accepted = Some(c);
                break;
            }
            let residual: Vec<f64> = p.iter().zip(qc).map(|(&p, &q)| (p - q as f64).max(0.0)).collect();
            let mass: f64 = residual.iter().sum();
            // p = q_c exactly (mass 0) accepts with probability 1 above; rounding may leave
            // a sliver, where p stays as it was.
            if mass > 1e-12 {
                p = residual.into_iter().map(|r| r / mass).collect();
            }
        }
        match accepted {
            Some(c) => {
                path.push(c);
                at = Some(c);
            }
            None => return (path, draw(&p, uniform(depth, children.len()))),
        }
    }
}

/// The token at which the running sum of `p` passes `u` · Σp (the last with mass, at the end).
fn draw(p: &[f64], u: f64) -> u32 {
    let mut left = u * p.iter().sum::<f64>();
    for (t, &pt) in p.iter().enumerate() {
        if left < pt {
            return t as u32;
        }
        left -= pt;
    }
    p.iter().rposition(|&pt| pt > 0.0).unwrap_or(0) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// pending ─ 5 ─ 7
    ///         │   └ 2
    ///         └ 6 ─ 3 ─ 4
    fn tree() -> Tree {
        let mut t = Tree::default();
        let a = t.push(None, 5);
        t.push(Some(a), 7);
        t.push(Some(a), 2);
        let d = t.push(None, 6);
        let e = t.push(Some(d), 3);
        t.push(Some(e), 4);
        t
    }

    #[test]
    fn match_follows_the_targets_tokens_down_any_branch() {
        let t = tree();
        // The target's token after the pending token, then after each node.
        let target = |after: [u32; 7]| move |u: Option<usize>| after[u.map_or(0, |u| u + 1)];
        // Down the second branch to its leaf, then the target's token after it.
        assert_eq!(match_path(&t, target([6, 0, 0, 0, 3, 4, 9])), (vec![3, 4, 5], 9));
        // The first branch, second child.
        assert_eq!(match_path(&t, target([5, 2, 0, 0, 0, 0, 0])), (vec![0, 2], 0));
        // No child agrees at the root: the target's own token alone.
        assert_eq!(match_path(&t, target([8, 0, 0, 0, 0, 0, 0])), (vec![], 8));
    }

    /// A deterministic stream of uniforms in [0, 1).
    struct Uniforms(u64);

    impl Uniforms {
        fn next(&mut self) -> f64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    /// k tokens drawn without replacement from `q`, each with the distribution it was drawn
    /// from (q with the earlier tokens removed, renormalized).
    fn without_replacement(q: &[f64], k: usize, u: &mut Uniforms) -> Vec<(u32, Vec<f32>)> {
        let mut left = q.to_vec();
        let mut drawn = Vec::new();
        for _ in 0..k {
            let sum: f64 = left.iter().sum();
            let normalized: Vec<f64> = left.iter().map(|x| x / sum).collect();
            let t = draw(&normalized, u.next());
            drawn.push((t, normalized.iter().map(|&x| x as f32).collect()));
            left[t as usize] = 0.0;
        }
        drawn
    }

    #[test]
    fn rejection_over_trees_keeps_the_targets_distribution() {
        // The target's distributions at depth 1 and after any first token; the drafter's q,
        // far from them. Each trial drafts three siblings without replacement, each with one
        // child of its own.
        let p1 = [0.1, 0.2, 0.3, 0.4];
        let p2 = [0.5, 0.05, 0.05, 0.4];
        let q = [0.4, 0.3, 0.2, 0.1];
        let trials = 200_000;
        let mut u = Uniforms(0x2545_F491_4F6C_DD1D);
        let (mut first, mut second) = ([0usize; 4], [0usize; 4]);
        let mut accepted_nodes = 0;
        for _ in 0..trials {
            let mut tree = Tree::default();
            let mut rows = Vec::new();
            for (t, qt) in without_replacement(&q, 3, &mut u) {
                let node = tree.push(None, t);
                rows.extend(qt);
                let (child, qc) = without_replacement(&q, 1, &mut u).remove(0);
                tree.push(Some(node), child);
                rows.extend(qc);
            }
            let decisions: Vec<f64> = (0..24).map(|_| u.next()).collect();
            let (path, bonus) = rejection_path(
                &tree,
                &rows,
                |at| if at.is_none() { p1.to_vec() } else { p2.to_vec() },
                |depth, k| decisions[depth * 8 + k],
            );
            accepted_nodes += path.len();
            let tokens: Vec<u32> = path.iter().map(|&n| tree.tokens[n]).chain([bonus]).collect();
            first[tokens[0] as usize] += 1;
            if tokens.len() > 1 {
                second[tokens[1] as usize] += 1;
            }
        }
        let share = |counts: [usize; 4]| {
            let n: usize = counts.iter().sum();
            counts.map(|c| c as f64 / n as f64)
        };
        for (got, want) in [(share(first), p1), (share(second), p2)] {
            for (g, w) in got.iter().zip(want) {
                assert!((g - w).abs() < 0.006, "{got:?} against {want:?}");
            }
        }
        // Three candidates take more than one draft of q could (its acceptance: Σ min(p, q) = 0.6).
        assert!(accepted_nodes as f64 / trials as f64 > 1.0, "{accepted_nodes} nodes in {trials} trials");
    }

    #[test]
    fn rejection_takes_a_child_the_target_favours_and_never_one_it_cannot_draw() {
        // pending ─ 1 (q: certain)
        //         └ 2 (q: certain after 1 was removed)
        let mut t = Tree::default();
        t.push(None, 1);
        t.push(None, 2);
        let q = [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0];
        // The target draws only token 2: token 1 is always rejected, then 2 always accepted.
        for k in 0..10 {
            let (path, bonus) = rejection_path(&t, &q, |_| vec![0.0, 0.0, 1.0, 0.0], |_, _| k as f64 / 10.0);
            assert_eq!((path, bonus), (vec![1], 2));
        }
        // The target draws only token 3: both rejected, 3 drawn from what is left.
        let (path, bonus) = rejection_path(&t, &q, |_| vec![0.0, 0.0, 0.0, 1.0], |_, _| 0.5);
        assert_eq!((path, bonus), (vec![], 3));
    }
}
