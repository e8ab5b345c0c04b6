//! `host check-model DIR`: every tensor of a checkpoint scanned once for NaN and infinity, then
//! the model built from it, which checks each tensor's shape and dtype against the config.

use std::path::Path;

use crate::model::Gemma4Config;
use mlx_rs::{Array, Dtype};
use plugin_api::nn::Weights;
use serde::Serialize;

#[derive(Debug, Serialize)]
pub struct TensorReport {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<i32>,
    pub nan: u64,
    pub inf: u64,
}

impl TensorReport {
    pub fn is_finite(&self) -> bool {
        self.nan == 0 && self.inf == 0
    }
}

#[derive(Debug, Serialize)]
pub struct ModelReport {
    pub tensors: Vec<TensorReport>,
    /// Why the target cannot be built from the checkpoint, if it cannot.
    pub build_error: Option<String>,
    /// Where `tokenizer.json` and the config disagree (vocabulary, special ids), or why the
    /// tokenizer cannot be read.
    pub tokenizer_problems: Vec<String>,
}

impl ModelReport {
    pub fn ok(&self) -> bool {
        self.build_error.is_none()
            && self.tokenizer_problems.is_empty()
            && self.tensors.iter().all(TensorReport::is_finite)
    }

    /// One line per tensor, then the verdict.
    pub fn text(&self) -> String {
        let mut out = String::new();
        for t in &self.tensors {
            let verdict = if t.is_finite() { "ok ".to_owned() } else { format!("BAD ({} NaN, {} Inf)", t.nan, t.inf) };
            out += &format!("{verdict}  {}  {}  {:?}\n", t.name, t.dtype, t.shape);
        }
        let bad = self.tensors.iter().filter(|t| !t.is_finite()).count();
        out += &format!("{} tensors, {bad} with NaN or Inf\n", self.tensors.len());
        match &self.build_error {
            None => out += "model: builds (every shape and dtype matches the config)\n",
            Some(e) => out += &format!("model: {e}\n"),
        }
        match self.tokenizer_problems.as_slice() {
            [] => out += "tokenizer: fits the model (vocabulary and special ids)\n",
            problems => problems.iter().for_each(|p| out += &format!("tokenizer: {p}\n")),
        }
        out
    }
}

/// Scans `dir`. Only an unreadable checkpoint is an `Err`; what is wrong inside it is reported.
pub fn check(dir: &Path) -> Result<ModelReport, plugin_api::nn::WeightsError> {
    let weights = Weights::load_dir(dir)?;
    let mut tensors = Vec::new();
    for name in weights.names() {
        let array = weights.get(name)?;
        let (nan, inf) = non_finite(&array).map_err(|e| plugin_api::nn::WeightsError::File {
            file: dir.to_owned(),
            reason: format!("scanning `{name}`: {e}"),
        })?;
        tensors.push(TensorReport {
            name: name.to_owned(),
            dtype: format!("{:?}", array.dtype()).to_lowercase(),
            shape: array.shape().to_vec(),
            nan,
            inf,
        });
    }
    drop(weights);
    let build_error = crate::model::load(dir).err().map(|e| e.to_string());
    let tokenizer_problems = match (crate::tokenizer::Tokenizer::load(dir), Gemma4Config::load(dir)) {
        (Ok(tokenizer), Ok(config)) => tokenizer.disagreements(config.vocab_size as usize, &config.special_ids()),
        (Err(e), _) => vec![e.to_string()],
        (_, Err(_)) => Vec::new(), // the build error says what is wrong with the config
    };
    Ok(ModelReport { tensors, build_error, tokenizer_problems })
}

/// Counts of NaN and infinite entries (zero for integer tensors).
fn non_finite(array: &Array) -> Result<(u64, u64), mlx_rs::error::Exception> {
    if !matches!(array.dtype(), Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16) {
        return Ok((0, 0));
    }
    let nan = array.is_nan()?.sum(None)?;
    let inf = array.is_inf()?.sum(None)?;
    mlx_rs::transforms::eval([&nan, &inf])?;
    Ok((nan.item_exact::<i32>() as u64, inf.item_exact::<i32>() as u64))
}
