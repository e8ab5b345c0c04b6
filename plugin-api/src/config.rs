//! Reading a drafter artifact's JSON config, with errors that name the file and the key.
//! A key that is absent or `null` reads as its default where it has one, as Hugging Face's
//! config classes read them; a key of the wrong type is an error, never a default.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::nn::Quantization;
use crate::PluginError;

pub struct ConfigFile {
    file: PathBuf,
    root: Value,
}

/// An object of the config, at a dotted key path (empty at the root).
#[derive(Clone, Copy)]
pub struct Section<'a> {
    file: &'a Path,
    path: &'a str,
    map: &'a Map<String, Value>,
}

impl ConfigFile {
    pub fn load(file: &Path) -> Result<ConfigFile, PluginError> {
        let text = std::fs::read_to_string(file)
            .map_err(|e| PluginError::invalid_artifact(format!("{}: {e}", file.display())))?;
        let root = serde_json::from_str(&text)
            .map_err(|e| PluginError::invalid_artifact(format!("{}: not valid JSON: {e}", file.display())))?;
        Ok(ConfigFile { file: file.to_owned(), root })
    }

    pub fn root(&self) -> Result<Section<'_>, PluginError> {
        let map = self.root.as_object().ok_or_else(|| {
            PluginError::invalid_artifact(format!("{}: the config is not a JSON object", self.file.display()))
        })?;
        Ok(Section { file: &self.file, path: "", map })
    }
}

impl<'a> Section<'a> {
    /// "{file}: `{key path}` {why}".
    pub fn error(&self, key: &str, why: impl std::fmt::Display) -> PluginError {
        PluginError::invalid_artifact(format!("{}: `{}` {why}", self.file.display(), self.key_path(key)))
    }

    fn key_path(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_owned()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    /// The value of `key`; `null` counts as absent.
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    /// The object at `key`, if present. Its errors name `self.key`.
    pub fn section(&self, key: &str, path: &'a str) -> Result<Option<Section<'a>>, PluginError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(map)) => Ok(Some(Section { file: self.file, path, map })),
            Some(_) => Err(self.error(key, "is not an object")),
        }
    }

    fn typed<T>(&self, key: &str, read: impl Fn(&'a Value) -> Option<T>, what: &str) -> Result<Option<T>, PluginError> {
        self.get(key).map(|v| read(v).ok_or_else(|| self.error(key, format!("= {v} is not {what}")))).transpose()
    }

    pub fn opt_int(&self, key: &str) -> Result<Option<i64>, PluginError> {
        self.typed(key, Value::as_i64, "an integer")
    }

    /// A required positive integer.
    pub fn int(&self, key: &str) -> Result<i64, PluginError> {
        match self.opt_int(key)? {
            Some(n) if n > 0 => Ok(n),
            Some(n) => Err(self.error(key, format!("= {n} must be positive"))),
            None => Err(self.error(key, "is missing")),
        }
    }

    pub fn opt_float(&self, key: &str) -> Result<Option<f64>, PluginError> {
        self.typed(key, Value::as_f64, "a number")
    }

    pub fn float_or(&self, key: &str, default: f64) -> Result<f64, PluginError> {
        Ok(self.opt_float(key)?.unwrap_or(default))
    }

    pub fn bool_or(&self, key: &str, default: bool) -> Result<bool, PluginError> {
        Ok(self.typed(key, Value::as_bool, "true or false")?.unwrap_or(default))
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&'a str>, PluginError> {
        self.typed(key, Value::as_str, "a string")
    }

    pub fn str_or(&self, key: &str, default: &'a str) -> Result<&'a str, PluginError> {
        Ok(self.opt_str(key)?.unwrap_or(default))
    }

    /// A list of strings, if present.
    pub fn opt_strings(&self, key: &str) -> Result<Option<Vec<&'a str>>, PluginError> {
        self.typed(key, |v| v.as_array()?.iter().map(Value::as_str).collect(), "a list of strings")
    }

    /// A required list of non-negative integers.
    pub fn u32_list(&self, key: &str) -> Result<Vec<u32>, PluginError> {
        self.typed(key, |v| v.as_array()?.iter().map(|n| n.as_u64().map(|n| n as u32)).collect(), "a list of integers")?
            .ok_or_else(|| self.error(key, "is missing"))
    }

    /// A list of numbers, if present.
    pub fn opt_floats(&self, key: &str) -> Result<Option<Vec<f32>>, PluginError> {
        self.typed(key, |v| v.as_array()?.iter().map(|n| n.as_f64().map(|x| x as f32)).collect(), "a list of numbers")
    }

    /// `layer_types`, if present: per layer, whether it attends over a sliding window. Its
    /// length must be `layers`.
    pub fn sliding_layers(&self, layers: usize) -> Result<Option<Vec<bool>>, PluginError> {
        let Some(types) = self.opt_strings("layer_types")? else { return Ok(None) };
        if types.len() != layers {
            return Err(self.error("layer_types", format!("has {} entries for {layers} layers", types.len())));
        }
        let kinds =
            types
                .iter()
                .map(|t| match *t {
                    "sliding_attention" => Ok(true),
                    "full_attention" => Ok(false),
                    other => Err(self
                        .error("layer_types", format!("has {other:?}, expected sliding_attention or full_attention"))),
                })
                .collect::<Result<Vec<_>, _>>()?;
        Ok(Some(kinds))
    }

    /// mlx-lm's `quantization` block (affine only), if present.
    pub fn quantization(&self) -> Result<Option<Quantization>, PluginError> {
        let Some(q) = self.section("quantization", "quantization")? else { return Ok(None) };
        let mode = q.str_or("mode", "affine")?;
        if mode != "affine" {
            return Err(q.error("mode", format!("= {mode:?} is not supported (only affine)")));
        }
        Ok(Some(Quantization {
            group_size: q.opt_int("group_size")?.unwrap_or(64) as i32,
            bits: q.int("bits")? as i32,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: &str) -> (tempfile::TempDir, ConfigFile) {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.json");
        std::fs::write(&file, json).unwrap();
        let config = ConfigFile::load(&file).unwrap();
        (dir, config)
    }

    #[test]
    fn errors_name_the_file_and_the_key_path() {
        let (_dir, c) = config(r#"{"a": 3, "b": "x", "n": null, "quantization": {"bits": "eight"}}"#);
        let root = c.root().unwrap();
        assert_eq!(root.int("a").unwrap(), 3);
        assert_eq!(root.float_or("n", 1.5).unwrap(), 1.5, "null reads as absent");
        let e = root.int("b").unwrap_err().to_string();
        assert!(e.contains("config.json: `b` = \"x\" is not an integer"), "{e}");
        let e = root.int("missing").unwrap_err().to_string();
        assert!(e.contains("`missing` is missing"), "{e}");
        let e = root.quantization().unwrap_err().to_string();
        assert!(e.contains("`quantization.bits` = \"eight\" is not an integer"), "{e}");
    }
}
