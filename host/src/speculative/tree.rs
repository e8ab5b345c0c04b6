//! Acceptance over a row's tree of drafts (the extension `draft-tree/1`): which path the target
//! keeps, and the token that follows it. Verification gives the target's distribution after
//! the pending token and after every node; a path is then accepted node by node from the
//! pending token down, as a chain is, choosing among a node's children instead of taking one.

use kernels::{row_major, with_floats};
use plugin_api::draft_tree::Tree;
use plugin_api::sdk::TreeProposal;

use super::accept::{keep, softmax_at_temperature, REJECTION_STREAM};
use super::{Row, Verify};
use crate::generate::{Flow, GenerateError, Request};
use crate::sampling::{filtered_logprobs, step_key, token_logprob, uniform, TokenLogprob, WindowTokens};

/// The accept step of one row's tree: the path the target keeps ([`match_path`], or
/// [`rejection_path`] when the drafter gave probabilities), its tokens and the target's token
/// after it emitted as `accept` emits a chain's, stopping at an end-of-sequence token,
/// `max_tokens` or a stop. Window position 0 is after the pending token, position u + 1 after
/// node u; a node at depth d is output step `row.tokens.len() + d`. Returns the path.
pub(super) fn accept_tree(
    row: &mut Row,
    request: &Request,
    proposal: &TreeProposal,
    window: &WindowTokens,
    verify: Verify,
    mut emit: impl FnMut(u32, Option<TokenLogprob>) -> Flow,
) -> Result<Vec<usize>, GenerateError> {
    let tree = &proposal.tree;
    let step = row.tokens.len() as u64;
    let depths = tree.depths();
    let deepest = depths.iter().copied().max().unwrap_or(0);
    row.stats.rounds += 1;
    row.stats.target_forwards += 1;
    row.stats.drafted += tree.len();
    for d in row.by_position.iter_mut().take(deepest) {
        d.0 += 1;
    }
    let sampling = &request.sampling;
    let position = |at: Option<usize>| at.map_or(0, |u| u + 1);
    let depth = |at: Option<usize>| at.map_or(0, |u| depths[u]) as u64;
    // The tokens before the position after node `at`: the row's, then the path's.
    let before = |at: Option<usize>| -> Vec<u32> {
        let path = at.map(|u| tree.path_to(u)).unwrap_or_default();
        row.tokens.iter().copied().chain(path.iter().map(|&n| tree.tokens[n])).collect()
    };
    let mut failed = None;
    let mut plain = |at: Option<usize>| -> (u32, Option<TokenLogprob>) {
        let tokens = before(at);
        let s = step + depth(at);
        match window.token_after(position(at), sampling, s, &request.prefix(&tokens)) {
            Ok(chosen) => chosen,
            Err(e) => {
                failed.get_or_insert(GenerateError::sampling_at(s as usize, e));
                (0, None)
            }
        }
    };
    // Rejection needs the target's distributions, which a sampled row's window keeps.
    let q = match (verify, &proposal.probabilities) {
        (Verify::Rejection, Some(q)) if !sampling.is_greedy() && window.row(0).is_some() => {
            Some(with_floats(&row_major(q)?, <[f32]>::to_vec)?)
        }
        _ => None,
    };
    let (path, last) = match &q {
        None => {
            let (path, _) = match_path(tree, |at| plain(at).0);
            let last = plain(path.last().copied());
            (path, last)
        }
        Some(q) => {
            let target = |at: Option<usize>| {
                let tokens = before(at);
                let logits = window.row_after(position(at), &request.prefix(&tokens));
                let lp = filtered_logprobs(logits.as_deref().unwrap_or(&[]), sampling);
                softmax_at_temperature(&lp, sampling.temperature).1.into_iter().map(f64::from).collect()
            };
            let keys =
                |d: usize, k: usize| uniform(step_key(sampling.seed ^ REJECTION_STREAM, step + d as u64), k as u64);
            let mut drawn = None;
            let (path, token) = rejection_path(tree, q, target, keys, |at| {
                let chosen = plain(at);
                drawn = Some(chosen.clone());
                chosen.0
            });
            let logprob = match drawn.filter(|(t, _)| *t == token) {
                Some((_, logprob)) => logprob,
                None => request.logprobs.and_then(|top| {
                    let at = path.last().copied();
                    let tokens = before(at);
                    let logits = window.row_after(position(at), &request.prefix(&tokens))?;
                    Some(token_logprob(&logits, sampling, token, top))
                }),
            };
            (path, (token, logprob))
        }
    };
    if let Some(e) = failed {
        return Err(e);
    }
    // Each path token with its log-probability, then the target's own token.
    let mut tokens: Vec<(u32, Option<TokenLogprob>, bool)> = Vec::with_capacity(path.len() + 1);
    for (i, &n) in path.iter().enumerate() {
        let at = if i == 0 { None } else { Some(path[i - 1]) };
        let logprob = request.logprobs.and_then(|top| {
            let before = before(at);
            let logits = window.row_after(position(at), &request.prefix(&before))?;
            Some(token_logprob(&logits, sampling, tree.tokens[n], top))
        });
        tokens.push((tree.tokens[n], logprob, true));
    }
    tokens.push((last.0, last.1, false));
    let mut accepted = 0;
    for (i, (token, logprob, drafted)) in tokens.into_iter().enumerate() {
        if drafted {
            accepted += 1;
            row.by_position[i].1 += 1;
            row.stats.accepted += 1;
        }
        if !keep(row, request, token, logprob, &mut emit) {
            break;
        }
    }
    if let Some(&last) = row.tokens.last() {
        row.pending = last;
    }
    row.acceptance.record(deepest, accepted);
    row.nodes.record(tree.len(), &path[..accepted]);
    Ok(path[..accepted].to_vec())
}

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
/// a rejected child leaves p ← max(p − q_c, 0), normalized, for the next. Where every child is
/// rejected the token is drawn from what is left of p; at a leaf, or where nothing is left,
/// `plain(node)` draws it as plain decoding would. Each step is a speculative sampling step for
/// the p it starts from, so the token kept at every depth is distributed as the target's own,
/// whether siblings were drawn with replacement or without (q_c then zero at earlier siblings'
/// tokens). `target(u)` is the target's distribution after node u (None: after the pending
/// token); `uniform(depth, k)` a uniform draw in [0, 1) for the k-th decision at that depth.
/// A chain is decided exactly as `accept`'s rejection step decides it. The path and the token
/// after it.
pub fn rejection_path(
    tree: &Tree,
    q: &[f32],
    mut target: impl FnMut(Option<usize>) -> Vec<f64>,
    mut uniform: impl FnMut(usize, usize) -> f64,
    mut plain: impl FnMut(Option<usize>) -> u32,
) -> (Vec<usize>, u32) {
    let vocab = if tree.is_empty() { 0 } else { q.len() / tree.len() };
    let mut path = Vec::new();
    let mut at = None;
    loop {
        let depth = path.len();
        let children: Vec<usize> = (0..tree.len()).filter(|&i| tree.parent(i) == at).collect();
        if children.is_empty() {
            return (path, plain(at));
        }
        // What is left of p, and its mass (p itself, of mass 1, before any rejection).
        let (mut left, mut mass) = (target(at), 1.0);
        let mut accepted = None;
        for (k, &c) in children.iter().enumerate() {
            let qc = &q[c * vocab..(c + 1) * vocab];
            let token = tree.tokens[c] as usize;
            let (pc, qt) = (left[token] / mass, qc[token] as f64);
            if qt <= 0.0 || uniform(depth, k) < (pc / qt).min(1.0) {
                accepted = Some(c);
                break;
            }
            left = left.iter().zip(qc).map(|(&l, &q)| (l / mass - q as f64).max(0.0)).collect();
            mass = left.iter().sum();
            if mass <= 1e-12 {
                return (path, plain(at));
            }
        }
        match accepted {
            Some(c) => {
                path.push(c);
                at = Some(c);
            }
            None => return (path, draw(&left, mass, uniform(depth, children.len()))),
        }
    }
}

/// The token at which the running sum of `p` passes `u` · `mass` (the last with mass, at the
/// end): `accept`'s residual draw.
fn draw(p: &[f64], mass: f64, u: f64) -> u32 {
    let mut left = u * mass;
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
            let t = draw(&normalized, 1.0, u.next());
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
            let target = |at: Option<usize>| if at.is_none() { p1.to_vec() } else { p2.to_vec() };
            let leaf_draw = decisions[20];
            let plain = |at: Option<usize>| draw(&target(at), 1.0, leaf_draw);
            let (path, bonus) = rejection_path(&tree, &rows, target, |depth, k| decisions[depth * 8 + k], plain);
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
            let (path, bonus) = rejection_path(&t, &q, |_| vec![0.0, 0.0, 1.0, 0.0], |_, _| k as f64 / 10.0, |_| 2);
            assert_eq!((path, bonus), (vec![1], 2));
        }
        // The target draws only token 3: both rejected, 3 drawn from what is left.
        let (path, bonus) = rejection_path(&t, &q, |_| vec![0.0, 0.0, 0.0, 1.0], |_, _| 0.5, |_| 0);
        assert_eq!((path, bonus), (vec![], 3));
    }
}
