//! Tail-split prefill of one row: every prompt token but the last, which heads the row's first
//! window. The row gets its own caches and drafter row; [`super::LiveBatch`] joins them to the
//! batch after.

use super::prefix_cache::Prefix;
use super::slot::DrafterSlot;
use super::{forward, Row, Taps};
use crate::generate::{token_ids, Event, Flow, GenerateError, Request, StopReason, PREFILL_CHUNK};
use crate::model::{Gemma4, LayerCache};
use crate::plugin::LoadedDrafter;
use crate::target_view::TargetView;

/// The row's caches and its drafter row (`view` is what the drafter reads of the target),
/// going on `from` a prefilled prefix of the prompt when there is one. A drafter that fails to
/// open, restore or prefill is dropped (the pairing was checked when it was first opened), and
/// the row decodes plainly.
#[expect(clippy::too_many_arguments, reason = "the inputs of one step of the loop, each used once")]
pub(super) fn prefill_row(
    model: &Gemma4,
    drafter: Option<&LoadedDrafter>,
    view: &TargetView,
    request: &Request,
    row: &mut Row,
    slack: usize,
    taps: &Taps,
    from: Option<Prefix>,
    on_event: &mut impl FnMut(Event) -> Flow,
) -> Result<(Vec<LayerCache>, DrafterSlot), GenerateError> {
    let prefix = &request.prompt[..request.prompt.len() - 1];
    let (mut caches, restored, mut done) = match from {
        Some(p) => (p.caches, Some(p.drafter), p.len),
        None => (model.make_caches(1, slack), None, 0),
    };
    let mut contexts = Vec::new();
    let rest = &prefix[done..];
    for chunk in rest.chunks(PREFILL_CHUNK) {
        let (hidden, context) = forward(model, &mut caches, &token_ids(chunk), taps)?;
        row.stats.target_forwards += 1;
        // MLX is lazy: computing each chunk here makes the progress real.
        hidden.eval()?;
        contexts.extend(context);
        done += chunk.len();
        if on_event(Event::Prefill { done, total: prefix.len() }) == Flow::Stop {
            row.stop = Some(StopReason::Interrupted);
        }
    }
    let Some(drafter) = drafter else { return Ok((caches, DrafterSlot::Absent)) };
    let vocab = model.config.vocab_size as u32;
    let context = if contexts.is_empty() { None } else { Some(mlx_rs::ops::concatenate(&contexts, 1)?) };
    let opened = match restored {
        None => drafter.open(view.boxed(), 1, vocab),
        Some(state) => drafter.open(view.boxed(), 0, vocab).and_then(|mut group| {
            let state = state.ok_or_else(|| crate::plugin::DrafterError::InvalidAnswer {
                kind: drafter.kind().to_owned(),
                call: "capture",
                reason: "the cached prefix has no drafter row".into(),
            })?;
            group.append(vec![state])?;
            Ok(group)
        }),
    };
    let prefilled = opened.and_then(|mut one| {
        if !rest.is_empty() {
            one.prefill(rest, context.as_ref())?;
        }
        Ok(one)
    });
    let slot = match prefilled {
        Ok(one) => DrafterSlot::Active(one),
        Err(e) => DrafterSlot::Dropped(e.to_string()),
    };
    Ok((caches, slot))
}
