//! A drafter's per-row context held as keys and values per layer, for drafters that attend to
//! projected target hidden states (DFlash, DSpark, DeepSpec).

use abi_stable::std_types::RVec;
use mlx_rs::error::Exception;
use mlx_rs::Array;

use crate::abi::{RowState, TokenRows};
use crate::{OwnedArray, PluginError};

/// One row's context: per layer, keys and values [1, kv heads, N, head dim] of positions
/// 0..N, grown only by committed positions.
#[derive(Clone, Default)]
pub struct LayerContext {
    pub keys: Vec<Array>,
    pub values: Vec<Array>,
}

impl LayerContext {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.keys.first().map_or(0, |k| k.shape()[2] as usize)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends the keys and values of new positions to `layer`.
    pub fn push(&mut self, layer: usize, keys: Array, values: Array) -> Result<(), Exception> {
        if layer < self.keys.len() {
            self.keys[layer] = mlx_rs::ops::concatenate(&[&self.keys[layer], &keys], 2)?;
            self.values[layer] = mlx_rs::ops::concatenate(&[&self.values[layer], &values], 2)?;
        } else {
            self.keys.push(keys);
            self.values.push(values);
        }
        Ok(())
    }

    /// Layer `layer`'s keys and values followed by `keys`/`values` of a block, for attention.
    pub fn with_block(&self, layer: usize, keys: Array, values: Array) -> Result<(Array, Array), Exception> {
        match (self.keys.get(layer), self.values.get(layer)) {
            (Some(k), Some(v)) => {
                Ok((mlx_rs::ops::concatenate(&[k, &keys], 2)?, mlx_rs::ops::concatenate(&[v, &values], 2)?))
            }
            _ => Ok((keys, values)),
        }
    }

    /// As the tensors of a row state: k0, v0, k1, v1, …
    pub fn to_tensors(&self) -> RVec<OwnedArray> {
        self.keys
            .iter()
            .zip(&self.values)
            .flat_map(|(k, v)| [OwnedArray::new(k.clone()), OwnedArray::new(v.clone())])
            .collect()
    }

    pub fn from_tensors(tensors: RVec<OwnedArray>) -> LayerContext {
        let arrays: Vec<Array> = tensors.into_iter().map(OwnedArray::into_array).collect();
        let (keys, values) = arrays.chunks(2).map(|kv| (kv[0].clone(), kv[1].clone())).unzip();
        LayerContext { keys, values }
    }
}

/// Row `r` of x [B, L, F], positions `from..to`, as [1, to − from, F].
pub fn row_span(x: &Array, r: usize, from: usize, to: usize) -> Result<Array, Exception> {
    let row = x.take_axis(Array::from_slice(&[r as i32], &[1]), 0)?;
    let span: Vec<i32> = (from as i32..to as i32).collect();
    row.take_axis(Array::from_slice(&span, &[span.len() as i32]), 1)
}

/// Refuses tapped hidden states that do not cover every row and position of the tokens they
/// come with: `[rows, len, features]`.
fn check_span(call: &str, taps: &Array, rows: usize, len: usize) -> Result<(), PluginError> {
    match taps.shape() {
        [r, l, _] if *r as usize == rows && *l as usize == len => Ok(()),
        shape => Err(PluginError::invalid_argument(format!(
            "{call}: tapped hidden states of shape {shape:?} for {rows} rows of {len} tokens"
        ))),
    }
}

/// The row bookkeeping of drafters whose state is a [`LayerContext`] per row: prefill and
/// commit project the tapped rows the target kept, and rows are filtered, captured and
/// restored as a whole.
pub struct ContextRows {
    pub contexts: Vec<LayerContext>,
    /// The drafter's state namespace (see `ProviderInfo::namespace`).
    namespace: &'static str,
}

impl ContextRows {
    pub fn new(rows: usize, namespace: &'static str) -> ContextRows {
        ContextRows { contexts: vec![LayerContext::default(); rows], namespace }
    }

    pub fn len(&self) -> usize {
        self.contexts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.contexts.is_empty()
    }

    /// Refuses a call that speaks of another number of rows.
    pub fn check_rows(&self, what: &str, got: usize) -> Result<(), PluginError> {
        if got != self.contexts.len() {
            return Err(PluginError::invalid_argument(format!(
                "{what} has {got} rows, the group has {}",
                self.contexts.len()
            )));
        }
        Ok(())
    }

    /// Appends every row's new prompt positions, projected by `project`.
    pub fn prefill(
        &mut self,
        tokens: TokenRows<'_>,
        taps: Option<Array>,
        project: Project<'_>,
    ) -> Result<(), PluginError> {
        self.check_rows("prefill", tokens.rows as usize)?;
        let taps = taps.ok_or_else(|| PluginError::invalid_argument("prefill without tapped hidden states"))?;
        check_span("prefill", &taps, tokens.rows as usize, tokens.len as usize)?;
        for (r, ctx) in self.contexts.iter_mut().enumerate() {
            project(ctx, &row_span(&taps, r, 0, tokens.len as usize)?)?;
        }
        Ok(())
    }

    /// Appends each row's pending token and accepted drafts: window positions 0..=accepted[r].
    pub fn commit(
        &mut self,
        window: TokenRows<'_>,
        accepted: &[u32],
        taps: Option<Array>,
        project: Project<'_>,
    ) -> Result<(), PluginError> {
        self.check_rows("commit", window.rows as usize)?;
        self.check_rows("commit's accepted counts", accepted.len())?;
        let taps = taps.ok_or_else(|| PluginError::invalid_argument("commit without tapped hidden states"))?;
        check_span("commit", &taps, window.rows as usize, window.len as usize)?;
        for (r, ctx) in self.contexts.iter_mut().enumerate() {
            project(ctx, &row_span(&taps, r, 0, accepted[r] as usize + 1)?)?;
        }
        Ok(())
    }

    pub fn filter_rows(&mut self, keep: &[u32]) -> Result<(), PluginError> {
        if let Some(&bad) = keep.iter().find(|&&r| r as usize >= self.contexts.len()) {
            return Err(PluginError::invalid_argument(format!(
                "filter_rows keeps row {bad} of {}",
                self.contexts.len()
            )));
        }
        self.contexts = keep.iter().map(|&r| self.contexts[r as usize].clone()).collect();
        Ok(())
    }

    pub fn append(&mut self, states: Vec<RowState>) -> Result<(), PluginError> {
        for state in states {
            if state.namespace.as_str() != self.namespace {
                return Err(PluginError::invalid_argument(format!(
                    "row state of namespace `{}` given to a group of `{}`",
                    state.namespace, self.namespace
                )));
            }
            self.contexts.push(LayerContext::from_tensors(state.tensors));
        }
        Ok(())
    }

    pub fn capture(&self, row: usize) -> Result<RowState, PluginError> {
        let ctx = self
            .contexts
            .get(row)
            .ok_or_else(|| PluginError::invalid_argument(format!("capture of row {row} of {}", self.contexts.len())))?;
        Ok(RowState {
            namespace: self.namespace.into(),
            processed: ctx.len() as u64,
            ids: Default::default(),
            tensors: ctx.to_tensors(),
        })
    }
}

/// Projects tapped hidden states [1, S, taps·H] into a row's context.
pub type Project<'a> = &'a dyn Fn(&mut LayerContext, &Array) -> Result<(), PluginError>;
