//! A drafter's per-row context held as keys and values per layer, for drafters that attend to
//! projected target hidden states (DFlash, DSpark, DeepSpec).

use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::layout::{concat, slice};
use crate::sdk::Snapshot;

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
            self.keys[layer] = concat(&[&self.keys[layer], &keys], 2)?;
            self.values[layer] = concat(&[&self.values[layer], &values], 2)?;
        } else {
            self.keys.push(keys);
            self.values.push(values);
        }
        Ok(())
    }

    /// Appends positions 0..count of row `row` of keys and values [B, Hkv, W, D] to `layer`.
    pub fn push_row(
        &mut self,
        layer: usize,
        keys: &Array,
        values: &Array,
        row: usize,
        count: usize,
    ) -> Result<(), Exception> {
        let whole = keys.shape()[0] == 1 && keys.shape()[2] as usize == count;
        let part = |a: &Array| match whole {
            true => Ok(a.clone()),
            false => {
                let s = a.shape();
                slice(a, &[row..row + 1, 0..s[1] as usize, 0..count, 0..s[3] as usize])
            }
        };
        self.push(layer, part(keys)?, part(values)?)
    }

    /// Layer `layer`'s keys and values followed by `keys`/`values` of a block, for attention.
    pub fn with_block(&self, layer: usize, keys: Array, values: Array) -> Result<(Array, Array), Exception> {
        match (self.keys.get(layer), self.values.get(layer)) {
            (Some(k), Some(v)) => Ok((concat(&[k, &keys], 2)?, concat(&[v, &values], 2)?)),
            _ => Ok((keys, values)),
        }
    }

    /// As a row state's tensors: k0, v0, k1, v1, …
    pub fn snapshot(&self) -> Snapshot {
        let tensors = self.keys.iter().zip(&self.values).flat_map(|(k, v)| [k.clone(), v.clone()]).collect();
        Snapshot { processed: self.len() as u64, ids: Vec::new(), tensors }
    }

    pub fn restore(snapshot: Snapshot) -> LayerContext {
        let (keys, values) = snapshot.tensors.chunks(2).map(|kv| (kv[0].clone(), kv[1].clone())).unzip();
        LayerContext { keys, values }
    }
}

/// Row `r` of x [B, L, F], positions `from..to`, as [1, to − from, F].
pub fn row_span(x: &Array, r: usize, from: usize, to: usize) -> Result<Array, Exception> {
    slice(x, &[r..r + 1, from..to, 0..x.shape().get(2).map_or(0, |&f| f as usize)])
}
