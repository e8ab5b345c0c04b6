//! The shipped demo target's quality figure, recomputed from the committed checkpoint: bits per
//! byte on a held-out slice, against the value its model card states (training/evaluate_target.py
//! measured it with mlx-lm).

use std::path::{Path, PathBuf};

use host::model::load;
use host::tokenizer::Tokenizer;
use mlx_rs::{Array, Dtype};

fn model_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/kjv-gemma4")
}

/// Sum over positions of -ln p(ids[i+1] | ids[..=i]), from one forward of the whole sequence.
fn total_nats(model: &host::model::Gemma4, ids: &[u32]) -> f64 {
    let mut caches = model.make_caches(1, 4);
    let input: Vec<i32> = ids[..ids.len() - 1].iter().map(|&t| t as i32).collect();
    let x = Array::from_slice(&input, &[1, input.len() as i32]);
    let hidden = model.forward_hidden(&x, &mut caches, None).unwrap();
    let logits = model.logits_from_hidden(&hidden).unwrap().as_dtype(Dtype::Float32).unwrap();
    let vocab = *logits.shape().last().unwrap() as usize;
    let logits = logits.as_slice::<f32>();
    ids[1..]
        .iter()
        .enumerate()
        .map(|(pos, &target)| {
            let row = &logits[pos * vocab..(pos + 1) * vocab];
            let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = max + row.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
            lse - row[target as usize] as f64
        })
        .sum()
}

#[test]
fn heldout_bits_per_byte_match_the_model_card() {
    host::runtime::init();
    let dir = model_dir();
    let eval: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("eval.json")).unwrap()).unwrap();
    let slice = &eval["test_slice"];
    let text = slice["text"].as_str().unwrap();
    let stated = slice["bits_per_byte"].as_f64().unwrap();

    let tokenizer = Tokenizer::load(&dir).unwrap();
    let ids = tokenizer.encode(text).unwrap();
    assert_eq!(ids.len() - 1, slice["tokens"].as_u64().unwrap() as usize, "the slice tokenizes differently");
    let model = load(&dir).unwrap();
    let measured = total_nats(&model, &ids) / std::f64::consts::LN_2 / text.len() as f64;
    eprintln!("held-out slice: {measured:.4} bits per byte (model card: {stated:.4})");
    // The model computes in bfloat16, as mlx-lm does, op for op; the parity test holds logits
    // to 1/16, which moves a per-byte figure far less than 0.01.
    assert!((measured - stated).abs() <= 0.01, "measured {measured:.4} bits per byte, the model card says {stated:.4}");

    let card = std::fs::read_to_string(dir.join("README.md")).unwrap();
    let quoted = format!("{stated:.3}");
    assert!(card.contains(&quoted), "the model card does not quote the slice's {quoted} bits per byte");
}
