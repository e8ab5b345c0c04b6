//! A token datastore: a text as token ids, with its suffixes sorted, so that the places where
//! an n-gram occurred form one range of them, and the tokens that followed it split that range
//! into consecutive groups, in token order. The most frequent continuation is then the largest
//! group, and the next token's groups lie inside it. This is REST's lookup (He et al., 2023,
//! "REST: Retrieval-Based Speculative Decoding"); llama.cpp's static lookup cache counts the
//! same continuations in a hash table of n-grams.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::ops::Range;
use std::path::Path;

use plugin_api::draft_tree::Tree;
use plugin_api::PluginError;
use safetensors::{Dtype as SafeDtype, SafeTensors};

/// The datastore's file in an artifact directory, and its one tensor: token ids [N], unsigned
/// 16- or 32-bit, documents separated by the target's `<bos>`.
pub const FILE: &str = "datastore.safetensors";
pub const TENSOR: &str = "token_ids";

/// Suffixes are ordered by this many leading tokens: a lookup's n-gram and draft together reach
/// no further.
pub const SORTED: usize = 32;

pub struct Datastore {
    tokens: Vec<u32>,
    /// Every position of `tokens`, ordered by the [`SORTED`] tokens from it (where fewer are
    /// left, the shorter first), then by position.
    suffixes: Vec<u32>,
    /// The largest token id, which `open` checks against the target's vocabulary.
    largest: u32,
}

impl Datastore {
    /// Sorts the suffixes, each half on its own thread (the SDK's product helper), then merges
    /// them: for the demo's 1.2M tokens, a one-token `host run` spent 0.28 s sorting on one core
    /// and 0.13 s this way.
    pub fn new(tokens: Vec<u32>) -> Datastore {
        let order = |a: &u32, b: &u32| {
            let head = |p: u32| &tokens[p as usize..(p as usize + SORTED).min(tokens.len())];
            head(*a).cmp(head(*b)).then(a.cmp(b))
        };
        let mut halves: Vec<u32> = (0..tokens.len() as u32).collect();
        let (lower, upper) = halves.split_at_mut(tokens.len() / 2);
        plugin_api::nn::helper::join(|| lower.sort_unstable_by(order), || upper.sort_unstable_by(order));
        let (lower, upper) = halves.split_at(tokens.len() / 2);
        let mut suffixes = Vec::with_capacity(tokens.len());
        let (mut i, mut j) = (0, 0);
        while i < lower.len() && j < upper.len() {
            if order(&lower[i], &upper[j]).is_le() {
                suffixes.push(lower[i]);
                i += 1;
            } else {
                suffixes.push(upper[j]);
                j += 1;
            }
        }
        suffixes.extend_from_slice(&lower[i..]);
        suffixes.extend_from_slice(&upper[j..]);
        let largest = tokens.iter().copied().max().unwrap_or(0);
        Datastore { tokens, suffixes, largest }
    }

    /// Reads `dir`/[`FILE`].
    pub fn load(dir: &Path) -> Result<Datastore, PluginError> {
        let file = dir.join(FILE);
        if !file.is_file() {
            return Err(PluginError::invalid_artifact(format!(
                "{}: no {FILE} (token ids to look continuations up in; `make train-drafter KIND=lookup` writes one)",
                dir.display()
            )));
        }
        let refuse = |why: String| PluginError::invalid_artifact(format!("{}: {why}", file.display()));
        let bytes = std::fs::read(&file).map_err(|e| refuse(e.to_string()))?;
        let tensors =
            SafeTensors::deserialize(&bytes).map_err(|e| refuse(format!("not a valid safetensors file ({e})")))?;
        let ids = tensors.tensor(TENSOR).map_err(|_| refuse(format!("no tensor `{TENSOR}`")))?;
        let refuse = |why: String| refuse(format!("tensor `{TENSOR}` {why}"));
        if ids.shape().len() != 1 {
            return Err(refuse(format!("has shape {:?}, expected one axis of token ids", ids.shape())));
        }
        let tokens: Vec<u32> = match ids.dtype() {
            SafeDtype::U16 => ids.data().chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]]) as u32).collect(),
            SafeDtype::U32 => {
                ids.data().chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
            }
            other => return Err(refuse(format!("has dtype {other:?}, expected U16 or U32 token ids"))),
        };
        if tokens.is_empty() {
            return Err(refuse("is empty".to_owned()));
        }
        if u32::try_from(tokens.len()).is_err() {
            return Err(refuse(format!("holds {} token ids; positions past 2^32 are not indexed", tokens.len())));
        }
        Ok(Datastore::new(tokens))
    }

    /// Bytes held: the token ids and their sorted suffixes.
    pub fn bytes(&self) -> usize {
        (self.tokens.len() + self.suffixes.len()) * std::mem::size_of::<u32>()
    }

    pub fn largest_token(&self) -> u32 {
        self.largest
    }

    /// The token `offset` after suffix `s`'s start, if the text reaches it.
    fn token(&self, s: u32, offset: usize) -> Option<u32> {
        self.tokens.get(s as usize + offset).copied()
    }

    /// The suffixes that start with `pattern` (at most [`SORTED`] tokens), as a range of
    /// `suffixes`.
    fn occurrences(&self, pattern: &[u32]) -> Range<usize> {
        let head = |s: u32| &self.tokens[s as usize..(s as usize + pattern.len()).min(self.tokens.len())];
        let start = self.suffixes.partition_point(|&s| head(s) < pattern);
        let end = start + self.suffixes[start..].partition_point(|&s| head(s) == pattern);
        start..end
    }

    /// The suffixes of `range`, which agree on their first `offset` tokens, grouped by their
    /// token at `offset`, in token order: consecutive, as the range is ordered by that token
    /// (suffixes too short to have one first, left out).
    fn groups(&self, range: Range<usize>, offset: usize) -> Vec<(u32, Range<usize>)> {
        let suffixes = &self.suffixes[range.clone()];
        let mut at = suffixes.partition_point(|&s| self.token(s, offset).is_none());
        let mut groups = Vec::new();
        while at < suffixes.len() {
            let token = self.token(suffixes[at], offset).expect("past the short suffixes");
            let end = at + suffixes[at..].partition_point(|&s| self.token(s, offset) == Some(token));
            groups.push((token, range.start + at..range.start + end));
            at = end;
        }
        groups
    }

    /// The most frequent token at `offset` among the suffixes of `range` (the lowest on ties)
    /// and its suffixes.
    fn most_frequent(&self, range: Range<usize>, offset: usize) -> Option<(u32, Range<usize>)> {
        let mut best: Option<(u32, Range<usize>)> = None;
        for (token, group) in self.groups(range, offset) {
            if best.as_ref().is_none_or(|(_, b)| group.len() > b.len()) {
                best = Some((token, group));
            }
        }
        best
    }

    /// The longest trailing n-gram of `text` (n at most `longest`) that occurs here, as a range
    /// of suffixes, with n; None where no n-gram occurs.
    fn longest_match(&self, text: &[u32], longest: usize) -> Option<(usize, Range<usize>)> {
        (1..=longest.min(text.len()).min(SORTED))
            .rev()
            .map(|n| (n, self.occurrences(&text[text.len() - n..])))
            .find(|(_, range)| !range.is_empty())
    }

    /// The longest trailing n-gram of `text` (n at most `longest`) that occurs here: n, and up
    /// to `depth` tokens to follow it: the most frequent next token where it occurred, then the
    /// most frequent after both, and so on, stopping where that token follows less than
    /// `min_share` of the places the draft so far occurred. (0, none) where no n-gram occurs.
    pub fn continuation(&self, text: &[u32], longest: usize, depth: usize, min_share: f64) -> (usize, Vec<u32>) {
        let Some((n, mut range)) = self.longest_match(text, longest) else { return (0, Vec::new()) };
        let mut draft = Vec::new();
        for offset in n..(n + depth).min(SORTED) {
            let Some((token, group)) = self.most_frequent(range.clone(), offset) else { break };
            if (group.len() as f64) < min_share * range.len() as f64 {
                break;
            }
            draft.push(token);
            range = group;
        }
        (n, draft)
    }

    /// As [`continuation`](Self::continuation), every continuation at once as a tree of at
    /// most `nodes` nodes, the most frequent paths first (REST's trie of retrieved
    /// continuations): each node is a token that followed its path in at least `min_share`
    /// of the path's occurrences, and the nodes kept are those that followed the longest
    /// n-gram most often. The n-gram's length, and the tree.
    pub fn continuations(
        &self,
        text: &[u32],
        longest: usize,
        depth: usize,
        nodes: usize,
        min_share: f64,
    ) -> (usize, Tree) {
        let mut tree = Tree::default();
        let Some((n, range)) = self.longest_match(text, longest) else { return (0, tree) };
        let mut frontier = Frontier::new(self, (n + depth).min(SORTED), min_share);
        frontier.offer(None, range, n);
        while tree.len() < nodes {
            let Some(c) = frontier.next() else { break };
            let node = tree.push(c.parent, c.token);
            frontier.offer(Some(node), c.range, c.offset + 1);
        }
        (n, tree)
    }
}

/// The nodes [`Datastore::continuations`] may add next, the most frequent first.
struct Frontier<'a> {
    store: &'a Datastore,
    /// The offset no path reaches.
    end: usize,
    min_share: f64,
    candidates: Vec<Candidate>,
    /// Candidates by occurrences, ties to the one found first.
    order: BinaryHeap<(usize, Reverse<usize>)>,
}

/// A node that may follow `parent`: `token`, with the suffixes that continue its path.
#[derive(Clone)]
struct Candidate {
    parent: Option<usize>,
    token: u32,
    range: Range<usize>,
    offset: usize,
}

impl<'a> Frontier<'a> {
    fn new(store: &'a Datastore, end: usize, min_share: f64) -> Self {
        Frontier { store, end, min_share, candidates: Vec::new(), order: BinaryHeap::new() }
    }

    /// Offers the tokens that follow a path (after node `parent`) at `offset` in its suffixes
    /// `range`, each that follows at least `min_share` of them.
    fn offer(&mut self, parent: Option<usize>, range: Range<usize>, offset: usize) {
        if offset >= self.end {
            return;
        }
        for (token, group) in self.store.groups(range.clone(), offset) {
            if (group.len() as f64) >= self.min_share * range.len() as f64 {
                self.order.push((group.len(), Reverse(self.candidates.len())));
                self.candidates.push(Candidate { parent, token, range: group, offset });
            }
        }
    }

    fn next(&mut self) -> Option<Candidate> {
        let (_, Reverse(i)) = self.order.pop()?;
        Some(self.candidates[i].clone())
    }
}

#[cfg(test)]
mod tests {
    use plugin_api::draft_tree::ROOT;

    use super::*;

    /// Every suffix of a text in order: each is no greater than the next by its first
    /// `SORTED` tokens.
    #[test]
    fn suffixes_are_in_order() {
        let tokens: Vec<u32> = (0..500u32).map(|i| (i * 7 + i / 13) % 5).collect();
        let store = Datastore::new(tokens.clone());
        let head = |s: u32| &tokens[s as usize..(s as usize + SORTED).min(tokens.len())];
        assert_eq!(store.suffixes.len(), tokens.len());
        assert!(store.suffixes.windows(2).all(|w| head(w[0]) <= head(w[1])));
    }

    #[test]
    fn finds_every_occurrence_of_a_pattern() {
        let store = Datastore::new(vec![1, 2, 3, 1, 2, 4, 1, 2, 3, 9]);
        let mut at: Vec<u32> = store.suffixes[store.occurrences(&[1, 2])].to_vec();
        at.sort();
        assert_eq!(at, [0, 3, 6]);
        assert!(store.occurrences(&[2, 2]).is_empty());
    }

    #[test]
    fn follows_the_most_frequent_continuation() {
        // After "1 2": "3 5" twice, "4" once.
        let store = Datastore::new(vec![1, 2, 3, 5, 0, 1, 2, 4, 0, 1, 2, 3, 5, 0]);
        assert_eq!(store.continuation(&[7, 1, 2], 2, 3, 0.0), (2, vec![3, 5, 0]));
        // "3" follows two of the three places; at a share of 0.7 the draft is empty.
        assert_eq!(store.continuation(&[7, 1, 2], 2, 3, 0.7), (2, vec![]));
    }

    #[test]
    fn ties_go_to_the_lower_token_and_the_longest_ngram_wins() {
        // After "2": "8" once and "6" once; after "1 2", only "8".
        let store = Datastore::new(vec![1, 2, 8, 0, 5, 2, 6]);
        assert_eq!(store.continuation(&[9, 2], 2, 1, 0.0), (1, vec![6]));
        assert_eq!(store.continuation(&[1, 2], 2, 1, 0.0), (2, vec![8]));
    }

    #[test]
    fn a_tree_holds_the_most_frequent_paths_first() {
        // After "1 2": "3 5" three times, "3 6" once, "4 7" twice.
        let store = Datastore::new(vec![
            1, 2, 3, 5, 0, 1, 2, 3, 5, 0, 1, 2, 3, 5, 0, 1, 2, 3, 6, 0, 1, 2, 4, 7, 0, 1, 2, 4, 7, 0,
        ]);
        let (n, tree) = store.continuations(&[9, 1, 2], 2, 2, 8, 0.0);
        assert_eq!(n, 2);
        // 3 (4 times), 5 after 3 (3), 4 (2), 7 after 4 (2), 6 after 3 (1).
        assert_eq!(tree.tokens, [3, 5, 4, 7, 6]);
        assert_eq!(tree.parents, [ROOT, 0, ROOT, 2, 0]);
        // The budget keeps the most frequent; a share keeps rare branches out; depth bounds it.
        assert_eq!(store.continuations(&[9, 1, 2], 2, 2, 3, 0.0).1.tokens, [3, 5, 4]);
        assert_eq!(store.continuations(&[9, 1, 2], 2, 2, 8, 0.3).1.tokens, [3, 5, 4, 7]);
        assert_eq!(store.continuations(&[9, 1, 2], 2, 1, 8, 0.0).1.tokens, [3, 4]);
        // Its most frequent path is the chain's draft.
        assert_eq!(store.continuation(&[9, 1, 2], 2, 2, 0.0), (2, vec![3, 5]));
        assert_eq!(store.continuations(&[9, 8], 2, 2, 8, 0.0), (0, Tree::default()));
    }

    #[test]
    fn stops_at_the_end_of_the_text_and_when_nothing_matches() {
        let store = Datastore::new(vec![4, 5, 6]);
        assert_eq!(store.continuation(&[5], 3, 8, 0.0), (1, vec![6]));
        assert_eq!(store.continuation(&[6], 3, 8, 0.0), (1, vec![]));
        assert_eq!(store.continuation(&[9], 3, 8, 0.0), (0, vec![]));
        assert_eq!(store.continuation(&[], 3, 8, 0.0), (0, vec![]));
    }
}
