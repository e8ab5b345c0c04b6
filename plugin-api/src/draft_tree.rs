//! The extension `draft-tree/1` (since API 1.2): a row proposes a tree of candidates.
//!
//! Acceptance decays along a chain, so after a chain's first miss the rest of its verify work
//! is wasted. A tree spends the same work on several candidates per position: the host verifies
//! every node of every row's tree in one target forward (each node reads the row's committed
//! tokens and its own ancestors) and keeps the longest path the target agrees with.
//!
//! A round through this extension:
//! 1. the host calls [`DraftTree::draft`] with each row's pending token, the deepest path and the
//!    most nodes it will verify (`depth`, `nodes`), and `steps` as for `draft`;
//! 2. each row answers a [`TreeRow`]: node tokens with the index of each node's parent
//!    ([`ROOT`] for a child of the pending token), every parent before its children;
//! 3. the host verifies, then commits the accepted path as a chain through
//!    [`RowGroupAbi::commit`](crate::abi::RowGroupAbi::commit): the window is
//!    `[pending, path…]` and `accepted[r]` the path's length, the context that of those
//!    positions. The window may be a path of any branch, not the chain a `draft` would have
//!    proposed: a drafter that keeps state from drafting checks the tokens it is given.
//!
//! A group answers `RNone` to draft chains through `draft` this round; a host that does not
//! know the extension never calls it, and a plugin without it drafts chains for a host that
//! does. The SDK exports the table for every drafter and answers through
//! [`GroupedDraftProvider::draft_tree`](crate::sdk::GroupedDraftProvider::draft_tree).

use abi_stable::std_types::{ROption, RResult, RSlice, RVec};
use abi_stable::StableAbi;

use crate::abi::RowGroupBox;
use crate::{OwnedArray, PluginError};

/// The id under which a plugin offers [`DraftTree`].
pub const DRAFT_TREE_ID: &str = "draft-tree/1";

/// The parent of a node that follows the row's pending token directly. **ABI-frozen.**
pub const ROOT: u32 = u32::MAX;

/// One row's tree. **ABI-frozen.**
#[repr(C)]
#[derive(StableAbi, Debug)]
pub struct TreeRow {
    /// Node token ids; none is a legal answer (the round becomes one plain step for the row).
    pub tokens: RVec<u32>,
    /// `parents[i]`: the node node i follows, an index below i, or [`ROOT`].
    pub parents: RVec<u32>,
    /// [nodes, V], when the drafter returns probabilities for its chains: row i is the
    /// distribution node i was drawn from, given its ancestors and the siblings drawn before
    /// it (for draws without replacement, the earlier siblings' tokens have probability 0).
    pub probabilities: ROption<OwnedArray>,
}

/// The extension [`DRAFT_TREE_ID`]. **ABI-frozen.**
#[repr(C)]
#[derive(StableAbi)]
pub struct DraftTree {
    /// A tree per row of `group`, a group this library opened, after each row's `pending`
    /// token: at most `nodes` nodes, no path longer than `depth`. The rules of `draft` hold:
    /// the committed state does not change and `steps` is the only randomness. `RNone`: this
    /// group drafts chains through `draft` this round.
    pub draft: extern "C" fn(
        group: &mut RowGroupBox,
        pending: RSlice<'_, u32>,
        depth: u32,
        nodes: u32,
        steps: RSlice<'_, u64>,
    ) -> RResult<ROption<RVec<TreeRow>>, PluginError>,
}

/// A tree in plain Rust: node tokens and their parents ([`ROOT`] or an earlier node).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tree {
    pub tokens: Vec<u32>,
    pub parents: Vec<u32>,
}

impl Tree {
    /// The chain `tokens`: each node follows the one before it.
    pub fn chain(tokens: &[u32]) -> Tree {
        let parents = (0..tokens.len() as u32).map(|i| if i == 0 { ROOT } else { i - 1 }).collect();
        Tree { tokens: tokens.to_vec(), parents }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether each node follows the one before it, as [`Tree::chain`] lays a chain out.
    pub fn is_chain(&self) -> bool {
        self.parents.iter().enumerate().all(|(i, &p)| p == if i == 0 { ROOT } else { i as u32 - 1 })
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Adds a node after `parent` (None: after the pending token); its index.
    pub fn push(&mut self, parent: Option<usize>, token: u32) -> usize {
        self.tokens.push(token);
        self.parents.push(parent.map_or(ROOT, |p| p as u32));
        self.tokens.len() - 1
    }

    /// Node i's parent, None for a child of the pending token.
    pub fn parent(&self, i: usize) -> Option<usize> {
        let p = self.parents[i];
        (p != ROOT).then_some(p as usize)
    }

    /// Each node's depth: 1 for a child of the pending token.
    pub fn depths(&self) -> Vec<usize> {
        let mut depths = Vec::with_capacity(self.len());
        for i in 0..self.len() {
            let d = self.parent(i).map_or(1, |p| depths[p] + 1);
            depths.push(d);
        }
        depths
    }

    /// The nodes from the pending token's child down to `node`.
    pub fn path_to(&self, node: usize) -> Vec<usize> {
        let mut path = vec![node];
        while let Some(p) = self.parent(*path.last().unwrap()) {
            path.push(p);
        }
        path.reverse();
        path
    }

    /// The child of `parent` (None: of the pending token) whose token is `token`, if any.
    pub fn child(&self, parent: Option<usize>, token: u32) -> Option<usize> {
        let parent = parent.map_or(ROOT, |p| p as u32);
        (0..self.len()).find(|&i| self.parents[i] == parent && self.tokens[i] == token)
    }

    /// Adds `other`'s nodes, in its order, while the tree has fewer than `nodes`: a node whose
    /// path is already here merges into it, and a node left out leaves its subtree out too.
    pub fn graft(&mut self, other: &Tree, nodes: usize) {
        // Where each of other's nodes is here, if it is.
        let mut here: Vec<Option<usize>> = Vec::with_capacity(other.len());
        for i in 0..other.len() {
            let parent = match other.parent(i) {
                None => None,
                Some(p) => match here[p] {
                    Some(q) => Some(q),
                    None => {
                        here.push(None);
                        continue;
                    }
                },
            };
            let node = match self.child(parent, other.tokens[i]) {
                Some(existing) => Some(existing),
                None if self.len() < nodes => Some(self.push(parent, other.tokens[i])),
                None => None,
            };
            here.push(node);
        }
    }

    /// The tree's rules, each broken one named: as many parents as tokens, each parent an
    /// earlier node or [`ROOT`], at most `nodes` nodes, no path longer than `depth`, every token
    /// below `vocab`, and no two siblings with one token (the second could never be accepted).
    pub fn check(&self, depth: usize, nodes: usize, vocab: u32) -> Result<(), String> {
        if self.parents.len() != self.tokens.len() {
            return Err(format!("{} tokens with {} parents", self.tokens.len(), self.parents.len()));
        }
        if self.len() > nodes {
            return Err(format!("{} nodes, over the budget of {nodes}", self.len()));
        }
        for (i, (&t, &p)) in self.tokens.iter().zip(&self.parents).enumerate() {
            if p != ROOT && p as usize >= i {
                return Err(format!("node {i} follows node {p}, which is not before it"));
            }
            if t >= vocab {
                return Err(format!("node {i}: token id {t} outside the vocabulary of {vocab}"));
            }
            if self.child(self.parent(i), t) != Some(i) {
                return Err(format!("node {i} repeats token {t} of an earlier sibling"));
            }
        }
        if let Some((i, d)) = self.depths().into_iter().enumerate().find(|&(_, d)| d > depth) {
            return Err(format!("node {i} at depth {d}, deeper than {depth}"));
        }
        Ok(())
    }
}

/// The tree of at most `nodes` nodes whose paths are the likeliest, for a drafter whose
/// positions are drafted independently (a block drafter): `positions[d]` holds the candidates
/// (token, probability) at depth d + 1, whatever comes before them, so a path's probability is
/// the product of its tokens'. Nodes join most probable path first (EAGLE-2's tree, with
/// these products as its scores); each joins under a node already there.
pub fn likeliest_paths(positions: &[Vec<(u32, f32)>], nodes: usize) -> Tree {
    let never = |depth: usize, _| Ok::<_, std::convert::Infallible>(positions[depth].clone());
    match likeliest_paths_with(positions.len(), nodes, never) {
        Ok(tree) => tree,
        Err(never) => match never {},
    }
}

/// [`likeliest_paths`] for a drafter whose candidates under a node depend on that node's token
/// (a head conditioned on the token before, as DeepSpec's Markov head is):
/// `candidates(d, token)` gives the candidates (token, probability) at depth d + 1 under a node
/// of `token` (`None`: the pending token, under which the first depth's nodes hang), asked for
/// once per node as it joins, and only for nodes above `depth`.
pub fn likeliest_paths_with<E>(
    depth: usize,
    nodes: usize,
    mut candidates: impl FnMut(usize, Option<u32>) -> Result<Vec<(u32, f32)>, E>,
) -> Result<Tree, E> {
    let mut tree = Tree::default();
    // Candidates: (path probability, parent, depth of the token, the token).
    let mut frontier: Vec<(f64, Option<usize>, usize, u32)> = Vec::new();
    let mut offer = |frontier: &mut Vec<_>, parent: Option<usize>, token: Option<u32>, score: f64, d: usize| {
        if d < depth && nodes > 0 {
            frontier.extend(candidates(d, token)?.into_iter().map(|(t, p)| (score * p as f64, parent, d, t)));
        }
        Ok(())
    };
    offer(&mut frontier, None, None, 1.0, 0)?;
    while tree.len() < nodes {
        // The likeliest candidate; ties to the one offered first.
        let Some(best) = (0..frontier.len()).reduce(|a, b| if frontier[b].0 > frontier[a].0 { b } else { a }) else {
            break;
        };
        let (score, parent, d, token) = frontier.remove(best);
        if score <= 0.0 {
            break;
        }
        let node = tree.push(parent, token);
        if tree.len() < nodes {
            offer(&mut frontier, Some(node), Some(token), score, d + 1)?;
        }
    }
    Ok(tree)
}

/// The `k` most probable tokens of a distribution with their probabilities, most probable
/// first (ties to the lower token, as a greedy draft's argmax takes them): a tree's candidates.
pub fn most_probable(p: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    for (t, &x) in p.iter().enumerate() {
        if best.len() < k || best.last().is_some_and(|&(_, y)| x > y) {
            let at = best.iter().position(|&(_, y)| x > y).unwrap_or(best.len());
            best.insert(at, (t as u32, x));
            best.truncate(k);
        }
    }
    best
}

impl From<TreeRow> for (Tree, Option<OwnedArray>) {
    fn from(row: TreeRow) -> Self {
        (Tree { tokens: row.tokens.into_vec(), parents: row.parents.into_vec() }, row.probabilities.into_option())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_is_a_tree_of_one_branch() {
        let t = Tree::chain(&[5, 6, 7]);
        assert_eq!(t.parents, vec![ROOT, 0, 1]);
        assert!(t.is_chain() && Tree::default().is_chain());
        let mut branching = t.clone();
        branching.push(Some(0), 9);
        assert!(!branching.is_chain());
        let mut siblings = Tree::chain(&[5]);
        siblings.push(None, 6);
        assert!(!siblings.is_chain());
        assert_eq!(t.depths(), vec![1, 2, 3]);
        assert_eq!(t.path_to(2), vec![0, 1, 2]);
        assert_eq!(t.check(3, 3, 8), Ok(()));
    }

    #[test]
    fn paths_depths_and_children_follow_the_parents() {
        // pending ─ 1 ─ 2 ─ 4
        //         │   └ 3
        //         └ 9 ─ 2
        let mut t = Tree::default();
        let a = t.push(None, 1);
        let b = t.push(Some(a), 2);
        t.push(Some(a), 3);
        let d = t.push(None, 9);
        let e = t.push(Some(d), 2);
        let f = t.push(Some(b), 4);
        assert_eq!(t.depths(), vec![1, 2, 2, 1, 2, 3]);
        assert_eq!(t.path_to(f), vec![a, b, f]);
        assert_eq!((t.child(None, 9), t.child(Some(d), 2), t.child(Some(d), 3)), (Some(d), Some(e), None));
        assert_eq!(t.check(3, 6, 10), Ok(()));
    }

    #[test]
    fn a_graft_merges_shared_paths_and_keeps_to_the_budget() {
        let mut t = Tree::chain(&[1, 2, 3]);
        let mut other = Tree::chain(&[1, 4, 5]);
        other.push(None, 6);
        t.graft(&other, 5);
        // 1 merges; 4 and 5 join under it; 6 is over the budget.
        assert_eq!((t.tokens.clone(), t.parents.clone()), (vec![1, 2, 3, 4, 5], vec![ROOT, 0, 1, 0, 3]));
        let mut u = Tree::chain(&[7]);
        u.graft(&Tree::chain(&[8, 9]), 1);
        assert_eq!(u, Tree::chain(&[7]), "a node left out leaves its children out");
    }

    #[test]
    fn candidates_that_hang_on_their_parent_make_the_likeliest_paths_among_them() {
        // Under token 1 the next is 3 (0.9) or 4 (0.1); under token 2 always 5.
        let next = |d: usize, token: Option<u32>| -> Result<Vec<(u32, f32)>, ()> {
            Ok(match (d, token) {
                (0, None) => vec![(1, 0.6), (2, 0.4)],
                (_, Some(1)) => vec![(3, 0.9), (4, 0.1)],
                (_, Some(2)) => vec![(5, 1.0)],
                _ => vec![(6, 0.5)],
            })
        };
        // Paths by probability: 1 (0.6), 1-3 (0.54), 2 (0.4), 2-5 (0.4), 1-3-6 (0.27), ...
        let t = likeliest_paths_with(2, 4, next).unwrap();
        assert_eq!((t.tokens.as_slice(), t.parents.as_slice()), (&[1, 3, 2, 5][..], &[ROOT, 0, ROOT, 2][..]));
        let deeper = likeliest_paths_with(3, 5, next).unwrap();
        assert_eq!(deeper.tokens, vec![1, 3, 2, 5, 6]);
        assert!(likeliest_paths_with(0, 5, next).unwrap().is_empty());
        assert!(likeliest_paths_with(2, 0, next).unwrap().is_empty());
    }

    #[test]
    fn the_most_probable_come_first_ties_to_the_lower_token() {
        let p = [0.1, 0.3, 0.05, 0.3, 0.25];
        assert_eq!(most_probable(&p, 3), vec![(1, 0.3), (3, 0.3), (4, 0.25)]);
        assert_eq!(most_probable(&p, 9).len(), 5);
    }

    #[test]
    fn the_likeliest_paths_join_first() {
        // Depth 1: 7 (0.6) or 8 (0.3); depth 2: 5 (0.9) or 6 (0.1), after either.
        let positions = vec![vec![(7, 0.6), (8, 0.3)], vec![(5, 0.9), (6, 0.1)]];
        let t = likeliest_paths(&positions, 4);
        // 7 (0.6), 7 5 (0.54), 8 (0.3), 8 5 (0.27); 7 6 (0.06) is left out.
        assert_eq!((t.tokens.clone(), t.parents.clone()), (vec![7, 5, 8, 5], vec![ROOT, 0, ROOT, 2]));
        assert_eq!(t.check(2, 4, 10), Ok(()));
        assert_eq!(likeliest_paths(&positions, 1), Tree::chain(&[7]));
        assert_eq!(likeliest_paths(&positions, 9).len(), 6, "every path, as deep as the positions go");
    }

    #[test]
    fn each_broken_rule_is_named() {
        let mut t = Tree::chain(&[1, 2, 3]);
        assert!(t.check(2, 3, 8).unwrap_err().contains("deeper than 2"));
        assert!(t.check(3, 2, 8).unwrap_err().contains("over the budget of 2"));
        assert!(t.check(3, 3, 3).unwrap_err().contains("token id 3 outside the vocabulary of 3"));
        t.parents[1] = 2;
        assert!(t.check(3, 3, 8).unwrap_err().contains("node 1 follows node 2"));
        let mut siblings = Tree::default();
        siblings.push(None, 4);
        siblings.push(None, 4);
        assert!(siblings.check(1, 2, 8).unwrap_err().contains("node 1 repeats token 4"));
        let short = Tree { tokens: vec![1, 2], parents: vec![ROOT] };
        assert!(short.check(2, 2, 8).unwrap_err().contains("2 tokens with 1 parents"));
    }
}
