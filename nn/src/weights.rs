//! Safetensors checkpoints as named MLX arrays: one file or shards with an index, headers
//! validated before any data is used, every error naming the file and the tensor.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use mlx_rs::{Array, Dtype};
use safetensors::SafeTensors;

use super::header;

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("{file}: {reason}")]
    File { file: PathBuf, reason: String },
    #[error("{file}: not a valid safetensors file: {reason}")]
    Corrupt { file: PathBuf, reason: String },
    #[error("{dir}: no model.safetensors, model.safetensors.index.json or model*.safetensors")]
    NoWeights { dir: PathBuf },
    #[error("{file}: tensor `{name}` has dtype {dtype}, which is not supported")]
    Dtype { file: PathBuf, name: String, dtype: String },
    #[error("missing tensor `{name}` in {dir}")]
    Missing { name: String, dir: PathBuf },
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    Shape { name: String, expected: Vec<i32>, found: Vec<i32> },
    #[error("tensor `{name}` is {found:?}; {role} must be {expected}")]
    Role { name: String, found: Dtype, role: &'static str, expected: &'static str },
    #[error("{file}: tensor `{name}` of shape {shape:?} cannot be split in {parts} equal parts along axis {axis}")]
    Split { file: PathBuf, name: String, shape: Vec<usize>, axis: usize, parts: usize },
}

/// One equal part of a tensor along one axis: what a rank of a tensor-parallel model holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    pub axis: usize,
    pub part: usize,
    pub parts: usize,
}

/// Every tensor of a checkpoint directory, by name.
pub struct Weights {
    pub dir: PathBuf,
    tensors: BTreeMap<String, Array>,
}

impl Weights {
    /// Loads `model.safetensors`, or the shards listed by `model.safetensors.index.json`, or
    /// else every `model*.safetensors` file of the directory.
    pub fn load_dir(dir: &Path) -> Result<Weights, WeightsError> {
        Weights::load_dir_split(dir, &|_| None)
    }

    /// Like [`Weights::load_dir`], keeping of each tensor only the part `split` names for it:
    /// the part is copied out of the mapped file, so the whole tensor is never in memory.
    pub fn load_dir_split(dir: &Path, split: &dyn Fn(&str) -> Option<Split>) -> Result<Weights, WeightsError> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index.exists() {
            shard_files(&index)?.into_iter().map(|f| dir.join(f)).collect()
        } else if dir.join("model.safetensors").exists() {
            vec![dir.join("model.safetensors")]
        } else {
            let mut all: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|e| WeightsError::File { file: dir.to_owned(), reason: e.to_string() })?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                    name.starts_with("model") && name.ends_with(".safetensors")
                })
                .collect();
            all.sort();
            all
        };
        if files.is_empty() {
            return Err(WeightsError::NoWeights { dir: dir.to_owned() });
        }
        let mut tensors = BTreeMap::new();
        for file in files {
            load_file(&file, split, &mut tensors)?;
        }
        Ok(Weights { dir: dir.to_owned(), tensors })
    }

    /// Loads one safetensors file.
    pub fn load_file(file: &Path) -> Result<Weights, WeightsError> {
        let mut tensors = BTreeMap::new();
        load_file(file, &|_| None, &mut tensors)?;
        Ok(Weights { dir: file.parent().unwrap_or(Path::new(".")).to_owned(), tensors })
    }

    pub fn from_map(dir: &Path, tensors: BTreeMap<String, Array>) -> Weights {
        Weights { dir: dir.to_owned(), tensors }
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn get(&self, name: &str) -> Result<Array, WeightsError> {
        self.tensors
            .get(name)
            .cloned()
            .ok_or_else(|| WeightsError::Missing { name: name.to_owned(), dir: self.dir.clone() })
    }

    /// The floating-point tensor `name`, if the checkpoint has it.
    pub fn optional(&self, name: &str) -> Result<Option<Array>, WeightsError> {
        let Some(array) = self.tensors.get(name) else { return Ok(None) };
        check_float(name, array)?;
        Ok(Some(array.clone()))
    }

    /// The floating-point tensor `name` (a weight, norm, scale or bias), of exactly `shape`.
    pub fn shaped(&self, name: &str, shape: &[i32]) -> Result<Array, WeightsError> {
        let array = self.get(name)?;
        check_float(name, &array)?;
        check_shape(name, &array, shape)?;
        Ok(array)
    }

    /// The integer tensor `name` (token ids, an ordering), of exactly `shape`.
    pub fn indices(&self, name: &str, shape: &[i32]) -> Result<Array, WeightsError> {
        let array = self.get(name)?;
        if !matches!(array.dtype(), Dtype::Int32 | Dtype::Int64 | Dtype::Uint32 | Dtype::Uint8) {
            let (role, expected) = ("an index tensor", "an integer type");
            return Err(WeightsError::Role { name: name.to_owned(), found: array.dtype(), role, expected });
        }
        check_shape(name, &array, shape)?;
        Ok(array)
    }

    /// The quantized weight `name`: uint32 words of packed integers, of exactly `shape`.
    pub fn packed(&self, name: &str, shape: &[i32]) -> Result<Array, WeightsError> {
        let array = self.get(name)?;
        if array.dtype() != Dtype::Uint32 {
            let (role, expected) = ("a quantized weight", "uint32 (packed integers)");
            return Err(WeightsError::Role { name: name.to_owned(), found: array.dtype(), role, expected });
        }
        check_shape(name, &array, shape)?;
        Ok(array)
    }

    pub fn insert(&mut self, name: String, array: Array) {
        self.tensors.insert(name, array);
    }

    pub fn remove(&mut self, name: &str) -> Option<Array> {
        self.tensors.remove(name)
    }

    /// Renames every tensor whose name starts with `from` to start with `to` instead.
    pub fn rename_prefix(&mut self, from: &str, to: &str) {
        let old = std::mem::take(&mut self.tensors);
        self.tensors = old
            .into_iter()
            .map(|(k, v)| match k.strip_prefix(from) {
                Some(rest) => (format!("{to}{rest}"), v),
                None => (k, v),
            })
            .collect();
    }

    /// Total bytes of all tensors.
    pub fn nbytes(&self) -> usize {
        self.tensors.values().map(Array::nbytes).sum()
    }
}

pub fn check_shape(name: &str, array: &Array, expected: &[i32]) -> Result<(), WeightsError> {
    if array.shape() != expected {
        return Err(WeightsError::Shape {
            name: name.to_owned(),
            expected: expected.to_vec(),
            found: array.shape().to_vec(),
        });
    }
    Ok(())
}

fn check_float(name: &str, array: &Array) -> Result<(), WeightsError> {
    if !matches!(array.dtype(), Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16) {
        let (role, expected) = ("a weight, norm, scale or bias", "float32, float16 or bfloat16");
        return Err(WeightsError::Role { name: name.to_owned(), found: array.dtype(), role, expected });
    }
    Ok(())
}

fn shard_files(index: &Path) -> Result<Vec<String>, WeightsError> {
    let text = std::fs::read_to_string(index)
        .map_err(|e| WeightsError::File { file: index.to_owned(), reason: e.to_string() })?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| WeightsError::Corrupt { file: index.to_owned(), reason: e.to_string() })?;
    let map = json["weight_map"]
        .as_object()
        .ok_or_else(|| WeightsError::Corrupt { file: index.to_owned(), reason: "no `weight_map` object".into() })?;
    let mut files: Vec<String> = map.values().filter_map(|v| v.as_str().map(str::to_owned)).collect();
    files.sort();
    files.dedup();
    Ok(files)
}

fn load_file(
    file: &Path,
    split: &dyn Fn(&str) -> Option<Split>,
    into: &mut BTreeMap<String, Array>,
) -> Result<(), WeightsError> {
    let handle = File::open(file).map_err(|e| WeightsError::File { file: file.to_owned(), reason: e.to_string() })?;
    // SAFETY: the map is read-only and dropped before this function returns; every tensor is
    // copied into MLX-owned memory first.
    let bytes = unsafe { memmap2::Mmap::map(&handle) }
        .map_err(|e| WeightsError::File { file: file.to_owned(), reason: e.to_string() })?;
    let tensors = SafeTensors::deserialize(&bytes)
        .map_err(|e| WeightsError::Corrupt { file: file.to_owned(), reason: header::explain(&bytes, &e) })?;
    for (name, view) in tensors.tensors() {
        let dtype = match view.dtype() {
            safetensors::Dtype::F32 => Dtype::Float32,
            safetensors::Dtype::F16 => Dtype::Float16,
            safetensors::Dtype::BF16 => Dtype::Bfloat16,
            safetensors::Dtype::U32 => Dtype::Uint32,
            safetensors::Dtype::I32 => Dtype::Int32,
            safetensors::Dtype::U8 => Dtype::Uint8,
            safetensors::Dtype::I64 => Dtype::Int64,
            other => return Err(WeightsError::Dtype { file: file.to_owned(), name, dtype: format!("{other:?}") }),
        };
        let array = match split(&name) {
            None => {
                let shape: Vec<i32> = view.shape().iter().map(|&d| d as i32).collect();
                // SAFETY: safetensors checked that the data holds exactly shape × dtype bytes;
                // mlx_array_new_data copies them.
                unsafe { Array::from_raw_data(view.data().as_ptr().cast(), &shape, dtype) }
            }
            Some(s) => {
                let (shape, data) =
                    part_of(view.shape(), view.data(), view.dtype().size(), s).ok_or_else(|| WeightsError::Split {
                        file: file.to_owned(),
                        name: name.clone(),
                        shape: view.shape().to_vec(),
                        axis: s.axis,
                        parts: s.parts,
                    })?;
                // SAFETY: `data` holds exactly shape × dtype bytes; mlx_array_new_data copies them.
                unsafe { Array::from_raw_data(data.as_ptr().cast(), &shape, dtype) }
            }
        };
        into.insert(name, array);
    }
    Ok(())
}

/// The shape and row-major bytes of part `s.part` of `s.parts` along `s.axis` of a row-major
/// tensor; `None` when the axis does not exist or does not divide evenly.
fn part_of(shape: &[usize], data: &[u8], item: usize, s: Split) -> Option<(Vec<i32>, Vec<u8>)> {
    let len = *shape.get(s.axis)?;
    if s.parts == 0 || len % s.parts != 0 || s.part >= s.parts {
        return None;
    }
    let part = len / s.parts;
    let inner: usize = shape[s.axis + 1..].iter().product::<usize>() * item;
    let outer: usize = shape[..s.axis].iter().product();
    let mut bytes = Vec::with_capacity(outer * part * inner);
    for o in 0..outer {
        let start = (o * len + s.part * part) * inner;
        bytes.extend_from_slice(&data[start..start + part * inner]);
    }
    let mut shape: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
    shape[s.axis] = part as i32;
    Some((shape, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_part_along_an_axis_is_that_slice_of_the_tensor() {
        // A [2, 4, 3] tensor of bytes 0..24; part 1 of 2 along axis 1 is rows 2..4 of each block.
        let data: Vec<u8> = (0..24).collect();
        let (shape, part) = part_of(&[2, 4, 3], &data, 1, Split { axis: 1, part: 1, parts: 2 }).unwrap();
        assert_eq!(shape, vec![2, 2, 3]);
        assert_eq!(part, vec![6, 7, 8, 9, 10, 11, 18, 19, 20, 21, 22, 23]);
        // Along the last axis with 2-byte items: columns 2..4 of each row of [2, 4].
        let (shape, part) = part_of(&[2, 4], &data[..16], 2, Split { axis: 1, part: 1, parts: 2 }).unwrap();
        assert_eq!(shape, vec![2, 2]);
        assert_eq!(part, vec![4, 5, 6, 7, 12, 13, 14, 15]);
        assert!(part_of(&[2, 3], &data[..6], 1, Split { axis: 1, part: 0, parts: 2 }).is_none());
        assert!(part_of(&[2, 3], &data[..6], 1, Split { axis: 2, part: 0, parts: 1 }).is_none());
    }
}
