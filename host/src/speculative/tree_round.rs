//! A round whose rows drafted trees (the extension `draft-tree/1`): every node of every row in
//! one target forward ([`Gemma4::forward_tree`]), each row's path accepted
//! ([`super::tree::accept_tree`]), and exactly that path written to the caches and committed to
//! the drafter, as a chain of those tokens would have been.

use std::time::Instant;

use mlx_rs::{Array, Dtype};
use plugin_api::nn::layout;
use plugin_api::sdk::TreeProposal;

use super::catch_up::CatchUp;
use super::round::{ms_since, Batch, RoundTimes};
use super::slot::DrafterSlot;
use super::tree::accept_tree;
use super::{with_context, Row};
use crate::generate::{Event, Flow, GenerateError};
use crate::model::{Gemma4, TreeLayout};
use crate::sampling::{WindowRow, WindowTokens};

/// Whether the target verifies trees: where each node's attention equals, bit for bit, the
/// attention of its token decoded alone (the CPU loops in half precision), and in one process
/// (the ranks of a tensor-parallel target draft chains).
pub(super) fn trees_verified(model: &Gemma4) -> bool {
    kernels::route::on_cpu() && matches!(model.dtype, Dtype::Bfloat16 | Dtype::Float16) && model.group.is_none()
}

/// Each active row's tree, where the round drafts trees: a tree size is set, the target
/// verifies trees, and the drafter offers one this round. Each is cut to the depth its row may
/// draft (none for a row one token from `max_tokens`).
pub(super) fn draft_trees(
    batch: &Batch,
    rows: &[Row],
    pending: &[u32],
    slot: &mut DrafterSlot,
    catch_up: &mut CatchUp,
) -> Result<Option<Vec<TreeProposal>>, GenerateError> {
    let depths = batch.draft_depths(rows);
    let depth = depths.iter().copied().max().unwrap_or(0);
    if depth == 0 || batch.config.tree_nodes == 0 || !trees_verified(batch.model) {
        return Ok(None);
    }
    catch_up.flush(slot)?;
    let steps: Vec<u64> = batch.active.iter().map(|&r| rows[r].tokens.len() as u64).collect();
    let Some(Some(trees)) = slot.call(|g| g.draft_tree(pending, depth, batch.config.tree_nodes, &steps)) else {
        return Ok(None);
    };
    trees.into_iter().zip(depths).map(|(t, d)| within(t, d)).collect::<Result<_, _>>().map(Some)
}

/// `proposal` without its nodes deeper than `depth`.
fn within(proposal: TreeProposal, depth: usize) -> Result<TreeProposal, GenerateError> {
    let depths = proposal.tree.depths();
    if depths.iter().all(|&d| d <= depth) {
        return Ok(proposal);
    }
    let kept: Vec<usize> = (0..depths.len()).filter(|&i| depths[i] <= depth).collect();
    let mut tree = plugin_api::draft_tree::Tree::default();
    // Ancestors of a kept node are kept and come before it, so each finds its new index.
    let mut index = vec![0; depths.len()];
    for &i in &kept {
        index[i] = tree.push(proposal.tree.parent(i).map(|p| index[p]), proposal.tree.tokens[i]);
    }
    let rows = Array::from_slice(&kept.iter().map(|&i| i as i32).collect::<Vec<_>>(), &[kept.len() as i32]);
    // A row with no room to draft keeps no nodes, and no distributions of none.
    let probabilities = proposal.probabilities.filter(|_| !kept.is_empty());
    let probabilities = probabilities.map(|q| q.take_axis(&rows, 0)).transpose()?;
    Ok(TreeProposal { tree, probabilities })
}

/// The node rows of the rows' trees, each row padded to `width`: its pending token at its next
/// position, its nodes at that position plus their depth, then padding (the pending token
/// again, reading only itself). With the forward's token ids [N, 1].
fn layout_of(pending: &[u32], trees: &[TreeProposal], offsets: &[usize], width: usize) -> (TreeLayout, Array) {
    let mut layout = TreeLayout { width, ..TreeLayout::default() };
    let mut ids = Vec::with_capacity(pending.len() * width);
    for (r, (t, &offset)) in trees.iter().zip(offsets).enumerate() {
        let first = r * width;
        let depths = t.tree.depths();
        for j in 0..width {
            let (token, depth, path) = match j.checked_sub(1).filter(|&n| n < t.tree.len()) {
                Some(n) => {
                    let path = std::iter::once(first).chain(t.tree.path_to(n).into_iter().map(|m| first + 1 + m));
                    (t.tree.tokens[n], depths[n], path.collect())
                }
                None if j == 0 => (pending[r], 0, vec![first]),
                None => (pending[r], 0, vec![first + j]),
            };
            layout.cache_row.push(r);
            layout.positions.push((offset + depth) as i32);
            layout.paths.push(path);
            ids.push(token as i32);
        }
    }
    let n = ids.len() as i32;
    (layout, Array::from_slice(&ids, &[n, 1]))
}

pub(super) fn tree_round(
    batch: &Batch,
    rows: &mut [Row],
    pending: &[u32],
    trees: Vec<TreeProposal>,
    draft_ms: f64,
    slot: &mut DrafterSlot,
    on_event: &mut impl FnMut(usize, Event) -> Flow,
) -> Result<RoundTimes, GenerateError> {
    let verifying = Instant::now();
    let model = batch.model;
    let width = 1 + trees.iter().map(|t| t.tree.len()).max().unwrap_or(0);
    let offsets = batch.caches.borrow().first().map(|c| c.offsets().to_vec()).unwrap_or_else(|| vec![0; pending.len()]);
    let (tree, ids) = layout_of(pending, &trees, &offsets, width);
    let ((hidden, written), context) =
        with_context(batch.taps, |t| Ok(model.forward_tree(&ids, &tree, &batch.caches.borrow(), t)?))?;
    let logits = model.logits_from_hidden(&hidden)?;
    let vocab = logits.shape()[logits.ndim() - 1];
    let logits = layout::reshape(&logits, &[pending.len() as i32, width as i32, vocab])?;

    let window_rows: Vec<WindowRow> = batch
        .active
        .iter()
        .zip(&trees)
        .map(|(&r, t)| batch.window_row(r, &rows[r], t.probabilities.is_some()))
        .collect();
    let first_step = window_rows.iter().map(|w| w.first_step as usize).min().unwrap_or(0);
    let targets =
        WindowTokens::rows(&logits, &window_rows, &[]).map_err(|e| GenerateError::sampling_at(first_step, e))?;
    let mut paths = Vec::with_capacity(batch.active.len());
    for ((&r, tree), window) in batch.active.iter().zip(&trees).zip(&targets) {
        let verify = batch.config.verify;
        paths.push(accept_tree(&mut rows[r], &batch.requests[r], tree, window, verify, |t, logprob| {
            if let Some(l) = logprob {
                on_event(r, Event::Logprob(l));
            }
            on_event(r, Event::Token(t))
        })?);
    }

    // Each row keeps its pending token and its accepted path: written as a window of those
    // tokens would have written them, the rest of a padded window rolled back.
    let kept = 1 + paths.iter().map(Vec::len).max().unwrap_or(0);
    let mut index = Vec::with_capacity(pending.len() * kept);
    for (r, path) in paths.iter().enumerate() {
        let first = (r * width) as i32;
        let nodes = path.iter().map(|&n| first + 1 + n as i32);
        index.extend(std::iter::once(first).chain(nodes).chain(std::iter::repeat(first)).take(kept));
    }
    let index = Array::from_slice(&index, &[index.len() as i32]);
    // Node rows [N, Hkv, 1, D] along the paths, as [rows, Hkv, kept, D], copied on the host.
    let along_paths = |a: &Array| -> Result<Array, mlx_rs::error::Exception> {
        let s = a.shape();
        let taken = layout::take_rows(&layout::reshape(a, &[s[0], s[1] * s[3]])?, &index)?;
        layout::swap_axes_1_2(&layout::reshape(&taken, &[pending.len() as i32, kept as i32, s[1], s[3]])?)
    };
    let rollback: Vec<usize> = paths.iter().map(|p| kept - 1 - p.len()).collect();
    for (cache, (keys, values)) in batch.caches.borrow_mut().iter_mut().zip(&written) {
        cache.append(&along_paths(keys)?, &along_paths(values)?)?;
        cache.rollback(&rollback).map_err(|e| GenerateError::Internal(e.to_string()))?;
    }
    let verify_ms = ms_since(verifying);

    let committing = Instant::now();
    let window: Vec<u32> = pending
        .iter()
        .zip(&paths)
        .zip(&trees)
        .flat_map(|((&head, path), t)| {
            let tokens = path.iter().map(|&n| t.tree.tokens[n]);
            std::iter::once(head).chain(tokens).chain(std::iter::repeat(head)).take(kept).collect::<Vec<_>>()
        })
        .collect();
    let counts: Vec<u32> = paths.iter().map(|p| p.len() as u32).collect();
    let layout_rows = tree.len() as i32;
    let context = context
        .map(|c| {
            let features = c.shape()[c.ndim() - 1];
            let taken = layout::take_rows(&layout::reshape(&c, &[layout_rows, features])?, &index)?;
            layout::reshape(&taken, &[pending.len() as i32, kept as i32, features])
        })
        .transpose()?;
    slot.call(|g| g.commit(&window, &counts, context.as_ref()));
    let draft_ms = draft_ms + ms_since(committing);
    for &r in &batch.active {
        rows[r].stats.draft_ms += draft_ms;
        rows[r].stats.verify_ms += verify_ms;
    }
    let depth = trees.iter().flat_map(|t| t.tree.depths()).max().unwrap_or(0);
    Ok(RoundTimes { depth, window_tokens: tree.len(), draft_ms, verify_ms, branched: true })
}
