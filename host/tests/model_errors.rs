//! A broken checkpoint is a clear error naming what is wrong and where, never a crash.

use std::fs;
use std::path::{Path, PathBuf};

use host::generate::{generate, Request};
use host::model::load;
use host::sampling::SamplingParams;

/// A copy of the `dense` oracle checkpoint that a test may break.
fn copy_of_dense() -> (tempfile::TempDir, PathBuf) {
    copy_of("dense")
}

/// A copy of one oracle checkpoint that a test may break.
fn copy_of(name: &str) -> (tempfile::TempDir, PathBuf) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gemma4").join(name);
    assert!(src.join("config.json").exists(), "{} is missing: run `make oracle`", src.display());
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join(name);
    fs::create_dir(&dir).unwrap();
    for entry in fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    (tmp, dir)
}

fn error_of(dir: &Path) -> String {
    host::runtime::init();
    match load(dir) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let file = dir.join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&fs::read_to_string(&file).unwrap()).unwrap();
    edit(&mut config);
    fs::write(file, serde_json::to_string_pretty(&config).unwrap()).unwrap();
}

#[test]
fn a_corrupt_safetensors_header() {
    let (_tmp, dir) = copy_of_dense();
    let file = dir.join("model.safetensors");
    let mut bytes = fs::read(&file).unwrap();
    bytes[8..24].copy_from_slice(b"{ this is bad  \"");
    fs::write(&file, bytes).unwrap();
    let e = error_of(&dir);
    assert!(e.contains("model.safetensors: not a valid safetensors file"), "{e}");
}

#[test]
fn a_truncated_safetensors_file() {
    let (_tmp, dir) = copy_of_dense();
    let file = dir.join("model.safetensors");
    let bytes = fs::read(&file).unwrap();
    fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let e = error_of(&dir);
    assert!(e.contains("not a valid safetensors file: the header says"), "{e}");
    assert!(e.contains("of tensor data, the file has") && e.ends_with("(truncated)"), "{e}");
}

#[test]
fn a_missing_tensor() {
    let (_tmp, dir) = copy_of_dense();
    let file = dir.join("model.safetensors");
    let bytes = fs::read(&file).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView)> =
        tensors.tensors().into_iter().filter(|(name, _)| !name.ends_with("layers.1.mlp.up_proj.weight")).collect();
    assert_eq!(kept.len() + 1, tensors.len());
    let rewritten = safetensors::serialize(kept, &None).unwrap();
    fs::write(&file, rewritten).unwrap();
    let e = error_of(&dir);
    assert!(e.contains("missing tensor `layers.1.mlp.up_proj.weight`"), "{e}");
}

#[test]
fn a_tensor_of_the_wrong_shape() {
    let (_tmp, dir) = copy_of_dense();
    edit_config(&dir, |c| {
        let inter = c["intermediate_size"].as_i64().unwrap();
        c["intermediate_size"] = (inter + 8).into();
    });
    let e = error_of(&dir);
    assert!(e.contains("tensor `layers.0.mlp.gate_proj.weight` has shape"), "{e}");
    assert!(e.contains("expected"), "{e}");
}

#[test]
fn an_unknown_model_type() {
    let (_tmp, dir) = copy_of_dense();
    edit_config(&dir, |c| c["model_type"] = "llama".into());
    let e = error_of(&dir);
    assert!(e.contains("`model_type` = \"llama\" is not supported"), "{e}");
}

#[test]
fn an_unsupported_rope_type_names_its_key() {
    let (_tmp, dir) = copy_of_dense();
    edit_config(&dir, |c| c["rope_parameters"]["full_attention"]["rope_type"] = "yarn".into());
    let e = error_of(&dir);
    assert!(e.contains("`rope_parameters.full_attention.rope_type` = yarn is not supported"), "{e}");
}

#[test]
fn no_weights_at_all() {
    let (_tmp, dir) = copy_of_dense();
    fs::remove_file(dir.join("model.safetensors")).unwrap();
    let e = error_of(&dir);
    assert!(e.contains("no model.safetensors"), "{e}");
}

#[test]
fn a_fused_expert_tensor_that_does_not_split_in_two() {
    let (_tmp, dir) = copy_of("moe");
    let file = dir.join("model.safetensors");
    let bytes = fs::read(&file).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let name = "model.layers.0.experts.gate_up_proj";
    let odd: Vec<u8> = vec![0; 4 * 63 * 64 * 4];
    let kept: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .tensors()
        .into_iter()
        .map(|(n, view)| {
            if n == name {
                (n, safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![4, 63, 64], &odd).unwrap())
            } else {
                (n, view)
            }
        })
        .collect();
    fs::write(&file, safetensors::serialize(kept, &None).unwrap()).unwrap();
    let e = error_of(&dir);
    assert!(e.contains("tensor `layers.0.experts.gate_up_proj` has shape [4, 63, 64]"), "{e}");
}

#[test]
fn config_values_outside_their_domain_are_refused_by_key() {
    for (key, value, expected) in [
        ("sliding_window", serde_json::json!(0), "`sliding_window`: must be positive for sliding layers"),
        ("rms_norm_eps", serde_json::json!(0.0), "`rms_norm_eps`: must be a positive number, found 0"),
        ("rms_norm_eps", serde_json::json!(-1e-6), "`rms_norm_eps`: must be a positive number"),
        ("final_logit_softcapping", serde_json::json!(0.0), "`final_logit_softcapping`: must be positive"),
        ("num_attention_heads", serde_json::json!(0), "`num_attention_heads`: must be positive"),
        ("num_attention_heads", serde_json::json!(2_000_000_000), "is beyond the sizes MLX can index"),
        ("num_key_value_heads", serde_json::json!(3), "3 does not divide num_attention_heads"),
        (
            "hidden_size",
            serde_json::json!(1_000_000_000_000_000u64),
            "1000000000000000 is too large (at most 2147483647)",
        ),
        ("head_dim", serde_json::json!(u64::MAX), "is too large (at most 2147483647)"),
        ("head_dim", serde_json::json!(-4), "expected a non-negative integer, found -4"),
        ("num_hidden_layers", serde_json::json!(0), "`num_hidden_layers`: must be positive, found 0"),
        ("max_position_embeddings", serde_json::json!(0), "`max_position_embeddings`: must be positive, found 0"),
    ] {
        let (_tmp, dir) = copy_of_dense();
        edit_config(&dir, |c| c[key] = value.clone());
        let e = error_of(&dir);
        assert!(e.contains(expected), "{key} = {value}: {e}");
        // The line the key is written on (the config is pretty-printed, one key a line).
        let text = fs::read_to_string(dir.join("config.json")).unwrap();
        let line = text.lines().position(|l| l.trim_start().starts_with(&format!("\"{key}\""))).unwrap() + 1;
        assert!(e.contains(&format!("config.json:{line}: `")), "{key}: {e}");
    }
}

/// Rewrites the checkpoint with `edit` applied to the tensor `name` (as f32 values); the
/// fixture stores the text model's tensors under `model.`.
fn rewrite_tensor(dir: &Path, name: &str, edit: impl FnOnce(Vec<f32>, &[usize]) -> (safetensors::Dtype, Vec<u8>)) {
    let file = dir.join("model.safetensors");
    let bytes = fs::read(&file).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let name = &format!("model.{name}");
    let view = tensors.tensor(name).unwrap();
    let values: Vec<f32> = match view.dtype() {
        safetensors::Dtype::F32 => view.data().chunks(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect(),
        other => panic!("the fixture's `{name}` is {other:?}"),
    };
    let shape = view.shape().to_vec();
    let (dtype, data) = edit(values, &shape);
    let replaced = safetensors::tensor::TensorView::new(dtype, shape, &data).unwrap();
    let all: Vec<(String, safetensors::tensor::TensorView)> =
        tensors.tensors().into_iter().map(|(n, v)| if &n == name { (n, replaced.clone()) } else { (n, v) }).collect();
    fs::write(&file, safetensors::serialize(all, &None).unwrap()).unwrap();
}

#[test]
fn a_norm_or_projection_of_an_integer_dtype_is_refused_naming_it() {
    for name in ["layers.0.input_layernorm.weight", "layers.1.self_attn.q_proj.weight"] {
        let (_tmp, dir) = copy_of_dense();
        rewrite_tensor(&dir, name, |values, _| {
            (safetensors::Dtype::I32, values.iter().flat_map(|&v| (v as i32).to_le_bytes()).collect())
        });
        let e = error_of(&dir);
        assert!(e.contains(&format!("tensor `{name}` is Int32; a weight, norm, scale or bias must be float32")), "{e}");
    }
}

#[test]
fn a_missing_size_key_is_refused_naming_it() {
    for key in ["hidden_size", "num_attention_heads", "head_dim", "vocab_size", "num_hidden_layers"] {
        let (_tmp, dir) = copy_of_dense();
        edit_config(&dir, |c| {
            c.as_object_mut().unwrap().remove(key);
        });
        let e = error_of(&dir);
        assert!(e.contains(&format!("`{key}`: is required (it fixes tensor shapes) and missing")), "{key}: {e}");
    }
}

#[test]
fn nan_weights_stop_generation_naming_the_step_and_check_model_names_the_tensor() {
    let (_tmp, dir) = copy_of_dense();
    let name = "layers.1.mlp.down_proj.weight";
    rewrite_tensor(&dir, name, |mut values, _| {
        values[3] = f32::NAN;
        values[7] = f32::INFINITY;
        (safetensors::Dtype::F32, values.iter().flat_map(|v| v.to_le_bytes()).collect())
    });
    host::runtime::init();
    let model = load(&dir).expect("NaN weights load; generation finds them");
    let request =
        Request { prompt: vec![2, 17, 40], max_tokens: 8, sampling: SamplingParams::default(), ..Default::default() };
    let e = generate(&model, &request, |_| {}).unwrap_err().to_string();
    assert!(e.contains("logits for output token 0 are NaN or infinite"), "{e}");

    let report = host::check_model::check(&dir).unwrap();
    assert!(!report.ok());
    let bad: Vec<_> = report.tensors.iter().filter(|t| !t.is_finite()).collect();
    assert_eq!(bad.len(), 1, "{}", report.text());
    assert_eq!((bad[0].name.as_str(), bad[0].nan, bad[0].inf), (format!("model.{name}").as_str(), 1, 1));
    assert!(report.text().contains(&format!("BAD (1 NaN, 1 Inf)  model.{name}  float32")), "{}", report.text());

    // `host run --json` still prints one object: what was produced, and the error.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_host"))
        .args(["run", "--model", dir.to_str().unwrap(), "--prompt-ids", "2,17,40", "--max-tokens", "8", "--json"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!((json["stop"].as_str(), json["tokens"].as_array().map(Vec::len)), (Some("error"), Some(0)), "{json}");
    assert!(json["error"].as_str().unwrap().contains("logits for output token 0 are NaN or infinite"), "{json}");
}

#[test]
fn check_model_passes_a_sound_checkpoint_and_reports_a_shape_it_cannot_build() {
    let (_tmp, dir) = copy_of_dense();
    let report = host::check_model::check(&dir).unwrap();
    assert!(report.ok(), "{}", report.text());
    assert!(report.tensors.iter().any(|t| t.name.ends_with("embed_tokens.weight")));

    edit_config(&dir, |c| c["intermediate_size"] = serde_json::json!(80));
    let report = host::check_model::check(&dir).unwrap();
    assert!(!report.ok());
    let build = report.build_error.unwrap();
    assert!(build.contains("has shape") && build.contains("mlp."), "{build}");
}

#[test]
fn a_directory_without_a_config_is_named_as_no_checkpoint() {
    let work = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_host"))
        .args(["run", "--model", work.path().to_str().unwrap(), "--prompt-ids", "2"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&format!("config.json: missing: {} is not a checkpoint directory", work.path().display())),
        "{err}"
    );
}
