//! Drafters whose rows are independent write one row, a [`DraftSource`], and get the group of
//! rows the verify loop drives, [`SourceRows`], with the row bookkeeping (row counts, filter,
//! capture, append, each row's slice of the tapped states) written once, here.

use std::marker::PhantomData;

use mlx_rs::Array;

use super::{GroupedDraftProvider, Proposal, TreeProposal};
use crate::abi::{RowState, TokenRows};
use crate::nn::{row_span, LayerContext};
use crate::{OwnedArray, PluginError};

pub use crate::nn::Snapshot;

/// One row of drafter state. `Shared` is what every row of a group uses alike: weights,
/// settings, the [`Target`](super::Target).
pub trait DraftSource: Clone + 'static {
    type Shared: 'static;

    /// New prompt tokens of this row, with the tapped hidden states [1, N, F] when the drafter
    /// declared the `taps` port.
    fn prefill(&mut self, shared: &Self::Shared, tokens: &[u32], context: Option<&Array>) -> Result<(), PluginError>;

    /// Up to `depth` tokens to follow `pending`; the committed state must not change. `row` is
    /// this row's index in the group (for target reads such as donors); `step` is the output
    /// index of the first draft, the only source of randomness.
    fn draft(
        &mut self,
        shared: &Self::Shared,
        row: usize,
        pending: u32,
        depth: usize,
        step: u64,
    ) -> Result<Proposal, PluginError>;

    /// Every row's proposal. One row at a time by default; override to draft rows in one pass.
    fn draft_rows(
        shared: &Self::Shared,
        rows: &mut [Self],
        pending: &[u32],
        depth: usize,
        steps: &[u64],
    ) -> Result<Vec<Proposal>, PluginError> {
        rows.iter_mut().enumerate().map(|(r, row)| row.draft(shared, r, pending[r], depth, steps[r])).collect()
    }

    /// Every row's proposal of exactly `depth` tokens as one array [rows, depth], left for the
    /// device to compute ([`GroupedDraftProvider::draft_on_device`]); `None` (the default):
    /// draft through [`draft_rows`](Self::draft_rows).
    fn draft_rows_on_device(
        _shared: &Self::Shared,
        _rows: &mut [Self],
        _pending: &[u32],
        _depth: usize,
        _steps: &[u64],
    ) -> Result<Option<Array>, PluginError> {
        Ok(None)
    }

    /// A tree of at most `nodes` nodes, no path longer than `depth`, to follow `pending` (the
    /// `draft-tree/1` extension), under [`draft`](Self::draft)'s rules. `None` (the default):
    /// this row drafts a chain through `draft`.
    fn draft_tree(
        &mut self,
        _shared: &Self::Shared,
        _row: usize,
        _pending: u32,
        _depth: usize,
        _nodes: usize,
        _step: u64,
    ) -> Result<Option<TreeProposal>, PluginError> {
        Ok(None)
    }

    /// Every row's [`draft_tree`](Self::draft_tree). One row at a time by default; override to
    /// draft the rows in one pass.
    fn draft_tree_rows(
        shared: &Self::Shared,
        rows: &mut [Self],
        pending: &[u32],
        depth: usize,
        nodes: usize,
        steps: &[u64],
    ) -> Result<Vec<Option<TreeProposal>>, PluginError> {
        rows.iter_mut()
            .enumerate()
            .map(|(r, row)| row.draft_tree(shared, r, pending[r], depth, nodes, steps[r]))
            .collect()
    }

    /// What the target kept of this row's window: the pending token and the accepted drafts,
    /// with their tapped hidden states [1, kept, F] when the drafter declared the `taps` port.
    fn commit(&mut self, shared: &Self::Shared, kept: &[u32], context: Option<&Array>) -> Result<(), PluginError>;

    /// Every row's [`commit`](Self::commit): row r kept the first `kept[r]` tokens of its window
    /// `window.row(r)`, with tapped hidden states [rows, window, F]. One row at a time by
    /// default; override to commit rows in one pass.
    fn commit_rows(
        shared: &Self::Shared,
        rows: &mut [Self],
        window: TokenRows<'_>,
        kept: &[usize],
        context: Option<&Array>,
    ) -> Result<(), PluginError> {
        for (r, row) in rows.iter_mut().enumerate() {
            let span = context.map(|c| row_span(c, r, 0, kept[r])).transpose()?;
            row.commit(shared, &window.row(r)[..kept[r]], span.as_ref())?;
        }
        Ok(())
    }

    fn snapshot(&self) -> Snapshot;

    fn restore(shared: &Self::Shared, snapshot: Snapshot) -> Result<Self, PluginError>;
}

/// The tapped hidden states a drafter that declared the `taps` port receives in `call`.
pub fn taps<'a>(context: Option<&'a Array>, call: &str) -> Result<&'a Array, PluginError> {
    context.ok_or_else(|| PluginError::invalid_argument(format!("{call} without the target's tapped hidden states")))
}

/// The rows of a group, for a [`DraftSource`].
pub struct SourceRows<S: DraftSource> {
    pub shared: S::Shared,
    pub rows: Vec<S>,
    /// The drafter's state namespace (see [`ProviderInfo::namespace`](crate::ProviderInfo)).
    namespace: &'static str,
}

impl<S: DraftSource> SourceRows<S> {
    /// `rows` copies of `empty`.
    pub fn new(shared: S::Shared, empty: S, rows: usize, namespace: &'static str) -> Self {
        SourceRows { shared, rows: vec![empty; rows], namespace }
    }

    /// Refuses a call that speaks of another number of rows.
    fn check_rows(&self, what: &str, got: usize) -> Result<(), PluginError> {
        if got != self.rows.len() {
            return Err(PluginError::invalid_argument(format!(
                "{what} has {got} rows, the group has {}",
                self.rows.len()
            )));
        }
        Ok(())
    }
}

/// Refuses tapped hidden states that do not cover every row and position of their tokens:
/// `[rows, len, features]`.
fn check_span(call: &str, context: &Option<Array>, rows: usize, len: usize) -> Result<(), PluginError> {
    match context.as_ref().map(|c| c.shape()) {
        None => Ok(()),
        Some([r, l, _]) if *r as usize == rows && *l as usize == len => Ok(()),
        Some(shape) => Err(PluginError::invalid_argument(format!(
            "{call}: tapped hidden states of shape {shape:?} for {rows} rows of {len} tokens"
        ))),
    }
}

impl<S: DraftSource> GroupedDraftProvider for SourceRows<S> {
    fn prefill(&mut self, tokens: TokenRows<'_>, context: Option<Array>) -> Result<(), PluginError> {
        self.check_rows("prefill", tokens.rows as usize)?;
        check_span("prefill", &context, tokens.rows as usize, tokens.len as usize)?;
        for (r, row) in self.rows.iter_mut().enumerate() {
            let span = context.as_ref().map(|c| row_span(c, r, 0, tokens.len as usize)).transpose()?;
            row.prefill(&self.shared, tokens.row(r), span.as_ref())?;
        }
        Ok(())
    }

    fn draft(&mut self, pending: &[u32], depth: usize, steps: &[u64]) -> Result<Vec<Proposal>, PluginError> {
        self.check_rows("draft", pending.len())?;
        self.check_rows("draft's steps", steps.len())?;
        S::draft_rows(&self.shared, &mut self.rows, pending, depth, steps)
    }

    fn draft_on_device(&mut self, pending: &[u32], depth: usize, steps: &[u64]) -> Result<Option<Array>, PluginError> {
        self.check_rows("draft", pending.len())?;
        self.check_rows("draft's steps", steps.len())?;
        S::draft_rows_on_device(&self.shared, &mut self.rows, pending, depth, steps)
    }

    /// Each row's tree; a row without one drafts a chain (as deep as the budget allows), unless
    /// no row has a tree.
    fn draft_tree(
        &mut self,
        pending: &[u32],
        depth: usize,
        nodes: usize,
        steps: &[u64],
    ) -> Result<Option<Vec<TreeProposal>>, PluginError> {
        self.check_rows("draft_tree", pending.len())?;
        self.check_rows("draft_tree's steps", steps.len())?;
        let trees = S::draft_tree_rows(&self.shared, &mut self.rows, pending, depth, nodes, steps)?;
        if trees.iter().all(Option::is_none) {
            return Ok(None);
        }
        let mut rows = Vec::with_capacity(trees.len());
        for (r, tree) in trees.into_iter().enumerate() {
            rows.push(match tree {
                Some(tree) => tree,
                None => self.rows[r].draft(&self.shared, r, pending[r], depth.min(nodes), steps[r])?.into(),
            });
        }
        Ok(Some(rows))
    }

    fn commit(&mut self, window: TokenRows<'_>, accepted: &[u32], context: Option<Array>) -> Result<(), PluginError> {
        self.check_rows("commit", window.rows as usize)?;
        self.check_rows("commit's accepted counts", accepted.len())?;
        check_span("commit", &context, window.rows as usize, window.len as usize)?;
        let kept: Vec<usize> = accepted.iter().map(|&a| a as usize + 1).collect();
        if let Some(r) = (0..kept.len()).find(|&r| kept[r] > window.len as usize) {
            return Err(PluginError::invalid_argument(format!(
                "row {r} accepted {} drafts of a window of {}",
                accepted[r], window.len
            )));
        }
        S::commit_rows(&self.shared, &mut self.rows, window, &kept, context.as_ref())
    }

    fn filter_rows(&mut self, keep: &[u32]) -> Result<(), PluginError> {
        if let Some(&bad) = keep.iter().find(|&&r| r as usize >= self.rows.len()) {
            return Err(PluginError::invalid_argument(format!("filter_rows keeps row {bad} of {}", self.rows.len())));
        }
        self.rows = keep.iter().map(|&r| self.rows[r as usize].clone()).collect();
        Ok(())
    }

    fn append(&mut self, states: Vec<RowState>) -> Result<(), PluginError> {
        for state in states {
            if state.namespace.as_str() != self.namespace {
                return Err(PluginError::invalid_argument(format!(
                    "row state of namespace `{}` given to a group of `{}`",
                    state.namespace, self.namespace
                )));
            }
            let snapshot = Snapshot {
                processed: state.processed,
                ids: state.ids.into_vec(),
                tensors: state.tensors.into_iter().map(OwnedArray::into_array).collect(),
            };
            self.rows.push(S::restore(&self.shared, snapshot)?);
        }
        Ok(())
    }

    fn capture(&mut self, row: usize) -> Result<RowState, PluginError> {
        let state = self
            .rows
            .get(row)
            .ok_or_else(|| PluginError::invalid_argument(format!("capture of row {row} of {}", self.rows.len())))?
            .snapshot();
        Ok(RowState {
            namespace: self.namespace.into(),
            processed: state.processed,
            ids: state.ids.into(),
            tensors: state.tensors.into_iter().map(OwnedArray::new).collect(),
        })
    }
}

/// A drafter whose row is the projected context of its committed positions (DFlash, DSpark,
/// DeepSpec): it only says how tapped states extend a context and how a context drafts.
pub trait ContextDrafter: 'static {
    /// Appends the context of new positions from their tapped hidden states [1, N, F].
    fn extend(&self, context: &mut LayerContext, taps: &Array) -> Result<(), PluginError>;

    /// Each row's [`extend`](Self::extend) by the first `kept[r]` positions of row r of `taps`
    /// [rows, W, F]. One row at a time by default; override to extend the rows in one pass.
    fn extend_rows(&self, contexts: &mut [&mut LayerContext], taps: &Array, kept: &[usize]) -> Result<(), PluginError> {
        extend_each(self, contexts, taps, kept)
    }

    /// Up to `depth` (≥ 1) tokens after `pending` from a non-empty context. The context is
    /// lent mutably for its scratch slots ([`LayerContext::with_block`]); what it holds stays.
    fn draft(&self, context: &mut LayerContext, pending: u32, depth: usize, step: u64)
        -> Result<Proposal, PluginError>;

    /// Each row's [`draft`](Self::draft), one row at a time by default. Override to draft the
    /// rows in one pass: a small drafter's cost is its count of MLX ops, whatever the rows.
    fn draft_rows(
        &self,
        contexts: &mut [&mut LayerContext],
        pending: &[u32],
        depth: usize,
        steps: &[u64],
    ) -> Result<Vec<Proposal>, PluginError> {
        contexts.iter_mut().enumerate().map(|(r, context)| self.draft(context, pending[r], depth, steps[r])).collect()
    }

    /// [`draft_rows`](Self::draft_rows)' tokens, exactly `depth` per row, as one array
    /// [rows, depth] left for the device to compute ([`DraftSource::draft_rows_on_device`]);
    /// `None` (the default): draft through `draft_rows`.
    fn draft_rows_on_device(
        &self,
        _contexts: &mut [&mut LayerContext],
        _pending: &[u32],
        _depth: usize,
        _steps: &[u64],
    ) -> Result<Option<Array>, PluginError> {
        Ok(None)
    }

    /// Each row's tree from a non-empty context, at most `nodes` nodes and `depth` (≥ 1) deep
    /// ([`DraftSource::draft_tree`]); `None` (the default): chains through `draft_rows`.
    fn draft_tree_rows(
        &self,
        _contexts: &mut [&mut LayerContext],
        _pending: &[u32],
        _depth: usize,
        _nodes: usize,
        _steps: &[u64],
    ) -> Result<Option<Vec<TreeProposal>>, PluginError> {
        Ok(None)
    }
}

/// [`ContextDrafter::extend_rows`] one row at a time.
pub fn extend_each<M: ContextDrafter + ?Sized>(
    m: &M,
    contexts: &mut [&mut LayerContext],
    taps: &Array,
    kept: &[usize],
) -> Result<(), PluginError> {
    for (r, context) in contexts.iter_mut().enumerate() {
        m.extend(context, &row_span(taps, r, 0, kept[r])?)?;
    }
    Ok(())
}

/// The row of a [`ContextDrafter`]; `SourceRows<ContextRow<M>>` is its group.
pub struct ContextRow<M>(pub LayerContext, PhantomData<fn() -> M>);

impl<M> Default for ContextRow<M> {
    fn default() -> Self {
        ContextRow(LayerContext::default(), PhantomData)
    }
}

impl<M> Clone for ContextRow<M> {
    fn clone(&self) -> Self {
        ContextRow(self.0.clone(), PhantomData)
    }
}

impl<M: ContextDrafter> DraftSource for ContextRow<M> {
    type Shared = M;

    fn prefill(&mut self, m: &M, _tokens: &[u32], context: Option<&Array>) -> Result<(), PluginError> {
        m.extend(&mut self.0, taps(context, "prefill")?)
    }

    fn draft(&mut self, m: &M, _row: usize, pending: u32, depth: usize, step: u64) -> Result<Proposal, PluginError> {
        let mut proposals = Self::draft_rows(m, std::slice::from_mut(self), &[pending], depth, &[step])?;
        Ok(proposals.remove(0))
    }

    fn draft_rows(
        m: &M,
        rows: &mut [Self],
        pending: &[u32],
        depth: usize,
        steps: &[u64],
    ) -> Result<Vec<Proposal>, PluginError> {
        // Nothing to draft from an empty context, nor at depth 0.
        let mut proposals: Vec<Proposal> = rows.iter().map(|_| Proposal::default()).collect();
        let drafting: Vec<usize> = (0..rows.len()).filter(|&r| depth > 0 && !rows[r].0.is_empty()).collect();
        if drafting.is_empty() {
            return Ok(proposals);
        }
        let pending: Vec<u32> = drafting.iter().map(|&r| pending[r]).collect();
        let steps: Vec<u64> = drafting.iter().map(|&r| steps[r]).collect();
        let mut contexts: Vec<&mut LayerContext> =
            rows.iter_mut().enumerate().filter(|(r, _)| drafting.contains(r)).map(|(_, row)| &mut row.0).collect();
        let drafted = m.draft_rows(&mut contexts, &pending, depth, &steps)?;
        for (r, proposal) in drafting.into_iter().zip(drafted) {
            proposals[r] = proposal;
        }
        Ok(proposals)
    }

    fn draft_rows_on_device(
        m: &M,
        rows: &mut [Self],
        pending: &[u32],
        depth: usize,
        steps: &[u64],
    ) -> Result<Option<Array>, PluginError> {
        // Every row must draft: a row with an empty context proposes nothing.
        if depth == 0 || rows.iter().any(|r| r.0.is_empty()) {
            return Ok(None);
        }
        let mut contexts: Vec<&mut LayerContext> = rows.iter_mut().map(|r| &mut r.0).collect();
        m.draft_rows_on_device(&mut contexts, pending, depth, steps)
    }

    fn draft_tree_rows(
        m: &M,
        rows: &mut [Self],
        pending: &[u32],
        depth: usize,
        nodes: usize,
        steps: &[u64],
    ) -> Result<Vec<Option<TreeProposal>>, PluginError> {
        let count = rows.len();
        let none = || (0..count).map(|_| None).collect();
        let drafting: Vec<usize> =
            (0..rows.len()).filter(|&r| depth > 0 && nodes > 0 && !rows[r].0.is_empty()).collect();
        if drafting.is_empty() {
            return Ok(none());
        }
        let pending: Vec<u32> = drafting.iter().map(|&r| pending[r]).collect();
        let steps: Vec<u64> = drafting.iter().map(|&r| steps[r]).collect();
        let mut contexts: Vec<&mut LayerContext> =
            rows.iter_mut().enumerate().filter(|(r, _)| drafting.contains(r)).map(|(_, row)| &mut row.0).collect();
        let Some(drafted) = m.draft_tree_rows(&mut contexts, &pending, depth, nodes, &steps)? else {
            return Ok(none());
        };
        // Rows with an empty context propose nothing: an empty tree.
        let mut trees: Vec<Option<TreeProposal>> = (0..count).map(|_| Some(TreeProposal::default())).collect();
        for (r, tree) in drafting.into_iter().zip(drafted) {
            trees[r] = Some(tree);
        }
        Ok(trees)
    }

    fn commit(&mut self, m: &M, _kept: &[u32], context: Option<&Array>) -> Result<(), PluginError> {
        m.extend(&mut self.0, taps(context, "commit")?)
    }

    fn commit_rows(
        m: &M,
        rows: &mut [Self],
        _window: TokenRows<'_>,
        kept: &[usize],
        context: Option<&Array>,
    ) -> Result<(), PluginError> {
        let mut contexts: Vec<&mut LayerContext> = rows.iter_mut().map(|r| &mut r.0).collect();
        m.extend_rows(&mut contexts, taps(context, "commit")?, kept)
    }

    fn snapshot(&self) -> Snapshot {
        self.0.snapshot()
    }

    fn restore(_: &M, snapshot: Snapshot) -> Result<Self, PluginError> {
        Ok(ContextRow(LayerContext::restore(snapshot), PhantomData))
    }
}
