//! A drafter's per-row context held as keys and values per layer, for drafters that attend to
//! projected target hidden states (DFlash, DSpark, DeepSpec).

use mlx_rs::error::Exception;
use mlx_rs::Array;

use kernels::layout::{concat, first_slots, put_slots, slice};

/// One row's state as plain arrays, as a row state carries it across groups (the SDK's
/// `Snapshot`).
pub struct Snapshot {
    /// Tokens of the row the state covers.
    pub processed: u64,
    pub ids: Vec<u32>,
    pub tensors: Vec<Array>,
}

/// One row's context: per layer, keys and values of positions 0..N, grown only by committed
/// positions.
///
/// Each layer's keys and values live in buffers [1, kv heads, capacity, head dim] of which the
/// first N slots are held. A push writes its positions into the free slots in place and a full
/// buffer doubles, so a round costs what it adds, not what the row holds: copied whole at every
/// push and every draft, a long prompt's context would take a large share of a drafter's round.
#[derive(Clone, Default)]
pub struct LayerContext {
    keys: Vec<Array>,
    values: Vec<Array>,
    held: Vec<usize>,
}

/// Slots a layer's buffers start with.
const FIRST_CAPACITY: usize = 64;

impl LayerContext {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.held.first().copied().unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Layer `layer`'s keys and values [1, kv heads, N, head dim]: views of its buffers.
    pub fn layer(&self, layer: usize) -> Result<Option<(Array, Array)>, Exception> {
        let (Some(k), Some(v), Some(&n)) = (self.keys.get(layer), self.values.get(layer), self.held.get(layer)) else {
            return Ok(None);
        };
        Ok(Some((first_slots(k, n)?, first_slots(v, n)?)))
    }

    /// Appends the keys and values [1, kv heads, n, head dim] of new positions to `layer`.
    pub fn push(&mut self, layer: usize, keys: Array, values: Array) -> Result<(), Exception> {
        let new = keys.shape().to_vec();
        let fits = |have: &[i32]| new[1] == have[1] && new[3] == have[3];
        if new.len() != 4
            || new[0] != 1
            || values.shape() != new
            || !self.keys.get(layer).is_none_or(|k| fits(k.shape()))
        {
            let held = self.keys.get(layer).map(|k| format!(" (it holds [1, {}, N, {}])", k.shape()[1], k.shape()[3]));
            return Err(Exception::custom(format!(
                "layer {layer}'s context takes keys and values [1, kv heads, n, head dim]{}; got {new:?} and {:?}",
                held.unwrap_or_default(),
                values.shape()
            )));
        }
        let added = new[2] as usize;
        if layer >= self.keys.len() {
            let capacity = added.max(FIRST_CAPACITY);
            self.keys.push(with_capacity(&keys, capacity)?);
            self.values.push(with_capacity(&values, capacity)?);
            self.held.push(added);
            return Ok(());
        }
        let held = self.held[layer];
        let capacity = self.keys[layer].shape()[2] as usize;
        if held + added > capacity {
            let capacity = (2 * capacity).max(held + added);
            self.keys[layer] = with_capacity(&first_slots(&self.keys[layer], held)?, capacity)?;
            self.values[layer] = with_capacity(&first_slots(&self.values[layer], held)?, capacity)?;
        }
        let slots = [(held..held + added).collect::<Vec<_>>()];
        // Taken out so that the buffer's only holder hands it over: `put_slots` writes in place
        // then, and copies otherwise (while a snapshot or a view of it lives).
        let empty = || Array::from_slice::<f32>(&[], &[0]);
        let k = std::mem::replace(&mut self.keys[layer], empty());
        self.keys[layer] = put_slots(k, &keys, &slots)?;
        let v = std::mem::replace(&mut self.values[layer], empty());
        self.values[layer] = put_slots(v, &values, &slots)?;
        self.held[layer] = held + added;
        Ok(())
    }

    /// Layer `layer`'s keys and values followed by a block's `keys`/`values` [1, kv heads, W,
    /// head dim], for attention: views of its buffers, the block written into their free slots
    /// (which the next push overwrites), so that the context itself is not copied.
    pub fn with_block(&mut self, layer: usize, keys: Array, values: Array) -> Result<(Array, Array), Exception> {
        if layer >= self.keys.len() {
            return Ok((keys, values));
        }
        let held = self.held[layer];
        self.push(layer, keys, values)?;
        let views = self.layer(layer)?.expect("the layer was just pushed to");
        self.held[layer] = held;
        Ok(views)
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

    /// As a row state's tensors: k0, v0, k1, v1, … of the positions held.
    pub fn snapshot(&self) -> Snapshot {
        let view = |layer| self.layer(layer).ok().flatten().expect("a held layer's slots can be viewed");
        let tensors = (0..self.keys.len()).flat_map(|layer| <[Array; 2]>::from(view(layer))).collect();
        Snapshot { processed: self.len() as u64, ids: Vec::new(), tensors }
    }

    pub fn restore(snapshot: Snapshot) -> LayerContext {
        let (keys, values): (Vec<Array>, Vec<Array>) =
            snapshot.tensors.chunks(2).map(|kv| (kv[0].clone(), kv[1].clone())).unzip();
        let held = keys.iter().map(|k| k.shape()[2] as usize).collect();
        LayerContext { keys, values, held }
    }
}

/// x [1, H, n, D] followed by free slots, `capacity` in all.
fn with_capacity(x: &Array, capacity: usize) -> Result<Array, Exception> {
    let s = x.shape();
    let free = capacity - s[2] as usize;
    if free == 0 {
        return Ok(x.clone());
    }
    let zeros = Array::zeros::<f32>(&[s[0], s[1], free as i32, s[3]])?.as_dtype(x.dtype())?;
    concat(&[x, &zeros], 2)
}

/// Row `r` of x [B, L, F], positions `from..to`, as [1, to − from, F].
pub fn row_span(x: &Array, r: usize, from: usize, to: usize) -> Result<Array, Exception> {
    slice(x, &[r..r + 1, from..to, 0..x.shape().get(2).map_or(0, |&f| f as usize)])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn positions(from: usize, n: usize) -> Array {
        let values: Vec<f32> = (0..2 * n * 3).map(|i| (from * 100 + i) as f32).collect();
        // [1, 2 heads, n, 3]: head h, position p holds from·100 + (h·n + p)·3 + j.
        Array::from_slice(&values, &[1, 2, n as i32, 3])
    }

    fn floats(a: &Array) -> Vec<f32> {
        kernels::row_major(a).unwrap().as_slice::<f32>().to_vec()
    }

    #[test]
    fn pushes_past_the_capacity_keep_every_position_and_a_block_leaves_the_context_as_it_was() {
        let mut context = LayerContext::default();
        let mut expected: Vec<Array> = Vec::new();
        for (i, n) in [5, 70, 1, 200].into_iter().enumerate() {
            let part = positions(i, n);
            context.push(0, part.clone(), part.clone()).unwrap();
            expected.push(part);
        }
        let all = concat(&expected.iter().collect::<Vec<_>>(), 2).unwrap();
        assert_eq!(context.len(), 276);
        let (k, v) = context.layer(0).unwrap().unwrap();
        assert_eq!((floats(&k), floats(&v)), (floats(&all), floats(&all)));

        let block = positions(9, 4);
        let (k, _) = context.with_block(0, block.clone(), block.clone()).unwrap();
        assert_eq!(floats(&k), floats(&concat(&[&all, &block], 2).unwrap()));
        drop(k);
        assert_eq!(context.len(), 276);
        let (k, _) = context.layer(0).unwrap().unwrap();
        assert_eq!(floats(&k), floats(&all));

        let restored = LayerContext::restore(context.snapshot());
        assert_eq!(restored.len(), 276);
        assert_eq!(floats(&restored.layer(0).unwrap().unwrap().0), floats(&all));
    }

    #[test]
    fn a_push_that_fits_writes_into_the_buffer_it_has() {
        // SAFETY: evaluated float32 arrays; only the address of their data is read.
        let data = |a: &Array| unsafe { mlx_sys::mlx_array_data_float32(a.as_ptr()) } as usize;
        let mut context = LayerContext::default();
        context.push(0, positions(0, 3), positions(0, 3)).unwrap();
        let buffer = data(&context.keys[0]);
        context.push(0, positions(1, 7), positions(1, 7)).unwrap();
        let block = positions(2, 4);
        drop(context.with_block(0, block.clone(), block).unwrap());
        context.push(0, positions(3, 1), positions(3, 1)).unwrap();
        assert_eq!(data(&context.keys[0]), buffer, "the keys were copied");
        // A snapshot shares the buffer: the next push copies rather than write under it.
        let snapshot = context.snapshot();
        context.push(0, positions(4, 1), positions(4, 1)).unwrap();
        assert_ne!(data(&context.keys[0]), buffer);
        assert_eq!(LayerContext::restore(snapshot).len(), 11);
    }

    #[test]
    fn keys_of_another_shape_are_refused_with_what_the_layer_holds() {
        let mut context = LayerContext::default();
        context.push(0, positions(0, 2), positions(0, 2)).unwrap();
        let wrong = Array::zeros::<f32>(&[1, 3, 2, 3]).unwrap();
        let error = context.push(0, wrong.clone(), wrong).unwrap_err().to_string();
        assert!(error.contains("it holds [1, 2, N, 3]") && error.contains("[1, 3, 2, 3]"), "{error}");
        assert_eq!(context.len(), 2);
    }
}
