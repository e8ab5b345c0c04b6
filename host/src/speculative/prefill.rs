//! Tail-split prefill, row by row: every prompt token but the last, which heads the row's first
//! window. Each row gets its own caches and drafter row; they are joined into one batch after.

use super::slot::DrafterSlot;
use super::{forward, Row, Taps};
use crate::generate::{Event, Flow, GenerateError, Request, StopReason, PREFILL_CHUNK};
use crate::model::{Gemma4, LayerCache};
use crate::plugin::drafter::DrafterGroup;
use crate::plugin::{DrafterError, LoadedDrafter};
use crate::target_view::TargetView;

/// The batch's caches (joined) and its drafter. Opening the drafter is fatal when it fails;
/// a failing drafter prefill only drops the drafter.
#[expect(clippy::too_many_arguments, reason = "the inputs of one step of the loop, each used once")]
pub(super) fn prefill_rows(
    model: &Gemma4,
    drafter: &LoadedDrafter,
    view: &TargetView,
    requests: &[Request],
    rows: &mut [Row],
    slack: usize,
    taps: &Taps,
    on_event: &mut impl FnMut(usize, Event) -> Flow,
) -> Result<(Vec<LayerCache>, DrafterSlot), GenerateError> {
    let vocab = model.config.vocab_size as u32;
    let mut row_caches = Vec::with_capacity(requests.len());
    let mut parts: Result<Vec<DrafterGroup>, String> = Ok(Vec::with_capacity(requests.len()));
    for (r, (row, request)) in rows.iter_mut().zip(requests).enumerate() {
        let prefix = &request.prompt[..request.prompt.len() - 1];
        let mut own = model.make_caches(1, slack);
        let mut contexts = Vec::new();
        let mut done = 0;
        for chunk in prefix.chunks(PREFILL_CHUNK) {
            let (hidden, context) = forward(model, &mut own, &[chunk], taps)?;
            row.stats.target_forwards += 1;
            // MLX is lazy: computing each chunk here makes the progress real.
            hidden.eval()?;
            contexts.extend(context);
            done += chunk.len();
            if on_event(r, Event::Prefill { done, total: prefix.len() }) == Flow::Stop {
                row.stop = Some(StopReason::Interrupted);
            }
        }
        row_caches.push(own);
        if let Ok(done) = parts.as_mut() {
            let mut one = drafter.open(view.boxed(), 1, vocab).map_err(GenerateError::Drafter)?;
            let prefilled = if prefix.is_empty() {
                Ok(())
            } else {
                let context = if contexts.is_empty() { None } else { Some(mlx_rs::ops::concatenate(&contexts, 1)?) };
                one.prefill(prefix, context.as_ref())
            };
            match prefilled {
                Ok(()) => done.push(one),
                Err(e) => parts = Err(e.to_string()),
            }
        }
    }
    let slot = match parts {
        Err(reason) => DrafterSlot::Dropped(reason),
        Ok(mut one) if one.len() == 1 => DrafterSlot::Active(one.remove(0)),
        Ok(parts) => match join_rows(drafter, view, parts, vocab) {
            Ok(group) => DrafterSlot::Active(group),
            Err(e) => DrafterSlot::Dropped(e.to_string()),
        },
    };
    Ok((join_caches(row_caches)?, slot))
}

/// The caches of rows prefilled apart, as one batch.
fn join_caches(rows: Vec<Vec<LayerCache>>) -> Result<Vec<LayerCache>, GenerateError> {
    let layers = rows.first().map_or(0, Vec::len);
    let mut by_layer: Vec<Vec<LayerCache>> = (0..layers).map(|_| Vec::new()).collect();
    for row in rows {
        for (layer, cache) in row.into_iter().enumerate() {
            by_layer[layer].push(cache);
        }
    }
    Ok(by_layer.into_iter().map(LayerCache::stack).collect::<Result<_, _>>()?)
}

/// One drafter group holding the rows prefilled apart: each captured and appended in order.
fn join_rows(
    drafter: &LoadedDrafter,
    view: &TargetView,
    parts: Vec<DrafterGroup>,
    vocab: u32,
) -> Result<DrafterGroup, DrafterError> {
    let mut group = drafter.open(view.boxed(), 0, vocab)?;
    let mut states = Vec::with_capacity(parts.len());
    for mut part in parts {
        states.push(part.capture(0)?);
    }
    group.append(states)?;
    Ok(group)
}
