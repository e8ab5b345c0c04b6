//! Drafters without weights, that draft from a row's text alone: [`TextRow`] keeps the text
//! (every token the row has committed) and asks a [`FromText`] for each draft;
//! [`trailing_ngram`] is prompt lookup, the tokens that followed the text's longest trailing
//! n-gram where it occurred before.

use std::marker::PhantomData;

use mlx_rs::Array;

use super::{DraftSource, Proposal, Snapshot, TreeProposal};
use crate::draft_tree::Tree;
use crate::PluginError;

/// How a drafter that reads only the row's text drafts.
pub trait FromText: 'static {
    /// Up to `depth` tokens to follow `text` (the row's committed tokens, then its pending one).
    fn draft(&self, text: &[u32], depth: usize) -> Vec<u32>;

    /// A tree of at most `nodes` nodes, no path longer than `depth`, to follow `text`; `None`
    /// (the default): chains only.
    fn draft_tree(&self, _text: &[u32], _depth: usize, _nodes: usize) -> Option<Tree> {
        None
    }
}

/// A row that remembers every token it committed and drafts through `D`, the row group's
/// shared [`FromText`].
pub struct TextRow<D> {
    text: Vec<u32>,
    drafter: PhantomData<fn() -> D>,
}

impl<D> Clone for TextRow<D> {
    fn clone(&self) -> Self {
        TextRow { text: self.text.clone(), drafter: PhantomData }
    }
}

impl<D> Default for TextRow<D> {
    fn default() -> Self {
        TextRow { text: Vec::new(), drafter: PhantomData }
    }
}

impl<D: FromText> DraftSource for TextRow<D> {
    type Shared = D;

    fn prefill(&mut self, _: &D, tokens: &[u32], _context: Option<&Array>) -> Result<(), PluginError> {
        self.text.extend_from_slice(tokens);
        Ok(())
    }

    fn draft(&mut self, drafter: &D, _row: usize, pending: u32, depth: usize, _: u64) -> Result<Proposal, PluginError> {
        self.text.push(pending);
        let found = drafter.draft(&self.text, depth);
        self.text.pop();
        Ok(Proposal::tokens(found))
    }

    fn draft_tree(
        &mut self,
        drafter: &D,
        _row: usize,
        pending: u32,
        depth: usize,
        nodes: usize,
        _: u64,
    ) -> Result<Option<TreeProposal>, PluginError> {
        self.text.push(pending);
        let found = drafter.draft_tree(&self.text, depth, nodes);
        self.text.pop();
        Ok(found.map(|tree| TreeProposal { tree, probabilities: None }))
    }

    fn commit(&mut self, _: &D, kept: &[u32], _context: Option<&Array>) -> Result<(), PluginError> {
        self.text.extend_from_slice(kept);
        Ok(())
    }

    fn snapshot(&self) -> Snapshot {
        Snapshot { processed: self.text.len() as u64, ids: self.text.clone(), tensors: Vec::new() }
    }

    fn restore(_: &D, snapshot: Snapshot) -> Result<TextRow<D>, PluginError> {
        Ok(TextRow { text: snapshot.ids, drafter: PhantomData })
    }
}

/// The longest trailing n-gram of `text` (n in `min..=max`) at its first earlier occurrence:
/// n, and up to `depth` tokens that followed it there (none, and n = 0, where no n-gram
/// occurred before).
pub fn trailing_ngram(text: &[u32], min: usize, max: usize, depth: usize) -> (usize, &[u32]) {
    for n in (min..=max).rev() {
        if text.len() <= n {
            continue;
        }
        let tail = &text[text.len() - n..];
        // Occurrences that end before the tail starts, so at least one token follows them.
        if let Some(start) = text[..text.len() - 1].windows(n).position(|w| w == tail) {
            let from = start + n;
            return (n, &text[from..(from + depth).min(text.len())]);
        }
    }
    (0, &[])
}

#[cfg(test)]
mod tests {
    use super::trailing_ngram;

    #[test]
    fn prefers_the_longest_trailing_ngram() {
        // "1 2 3" occurs at 0; "3" alone first occurs at 2 too, but the 3-gram wins.
        let text = [1, 2, 3, 9, 1, 2, 3];
        assert_eq!(trailing_ngram(&text, 1, 3, 2), (3, &[9, 1][..]));
    }

    #[test]
    fn uses_the_first_earlier_occurrence() {
        let text = [5, 1, 5, 2, 5];
        assert_eq!(trailing_ngram(&text, 1, 1, 1), (1, &[1][..]));
    }

    #[test]
    fn falls_back_to_shorter_ngrams_and_stops_at_the_text_end() {
        let text = [7, 8, 4, 8];
        assert_eq!(trailing_ngram(&text, 1, 3, 5), (1, &[4, 8][..]));
        assert_eq!(trailing_ngram(&[1, 2, 3], 1, 3, 4), (0, &[][..]));
    }
}
