//! Tail-split prefill of one row: every prompt token but the last, which heads the row's first
//! window. The row gets its own caches and drafter row; [`super::LiveBatch`] joins them to the
//! batch after.

use super::slot::DrafterSlot;
use super::{forward, Row, Taps};
use crate::generate::{Event, Flow, GenerateError, Request, StopReason, PREFILL_CHUNK};
use crate::model::{Gemma4, LayerCache};
use crate::plugin::LoadedDrafter;
use crate::target_view::TargetView;

/// The row's caches and its drafter row (`view` is what the drafter reads of the target).
/// Opening the drafter is fatal when it fails; a failing drafter prefill only drops the drafter.
#[expect(clippy::too_many_arguments, reason = "the inputs of one step of the loop, each used once")]
pub(super) fn prefill_row(
    model: &Gemma4,
    drafter: Option<&LoadedDrafter>,
    view: &TargetView,
    request: &Request,
    row: &mut Row,
    slack: usize,
    taps: &Taps,
    on_event: &mut impl FnMut(Event) -> Flow,
) -> Result<(Vec<LayerCache>, DrafterSlot), GenerateError> {
    let prefix = &request.prompt[..request.prompt.len() - 1];
    let mut caches = model.make_caches(1, slack);
    let mut contexts = Vec::new();
    let mut done = 0;
    for chunk in prefix.chunks(PREFILL_CHUNK) {
        let (hidden, context) = forward(model, &mut caches, &[chunk], taps)?;
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
    let mut one = drafter.open(view.boxed(), 1, model.config.vocab_size as u32).map_err(GenerateError::Drafter)?;
    let prefilled = if prefix.is_empty() {
        Ok(())
    } else {
        let context = if contexts.is_empty() { None } else { Some(mlx_rs::ops::concatenate(&contexts, 1)?) };
        one.prefill(prefix, context.as_ref())
    };
    let slot = match prefilled {
        Ok(()) => DrafterSlot::Active(one),
        Err(e) => DrafterSlot::Dropped(e.to_string()),
    };
    Ok((caches, slot))
}
