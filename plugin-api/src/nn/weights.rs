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
            load_file(&file, &mut tensors)?;
        }
        Ok(Weights { dir: dir.to_owned(), tensors })
    }

    /// Loads one safetensors file.
    pub fn load_file(file: &Path) -> Result<Weights, WeightsError> {
        let mut tensors = BTreeMap::new();
        load_file(file, &mut tensors)?;
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

fn load_file(file: &Path, into: &mut BTreeMap<String, Array>) -> Result<(), WeightsError> {
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
        let shape: Vec<i32> = view.shape().iter().map(|&d| d as i32).collect();
        // SAFETY: safetensors checked that the data holds exactly shape × dtype bytes;
        // mlx_array_new_data copies them.
        let array = unsafe { Array::from_raw_data(view.data().as_ptr().cast(), &shape, dtype) };
        into.insert(name, array);
    }
    Ok(())
}
