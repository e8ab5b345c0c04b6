//! Why a safetensors file could not be read, in words. The safetensors crate reports a variant
//! name ("MetadataIncompleteBuffer", "InvalidOffset(..)"), so on failure the header is read again
//! here to say what is wrong and, where it is one tensor's fault, which.

use safetensors::SafeTensorError;

/// One sentence on what is wrong with `bytes` (the whole file), which safetensors refused.
pub fn explain(bytes: &[u8], error: &SafeTensorError) -> String {
    let size = bytes.len();
    if size < 8 {
        return format!("the file is {size} bytes; a safetensors file starts with an 8-byte header length");
    }
    let declared = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    if declared > (size - 8) as u64 {
        return format!(
            "the header length says {} but only {} follow it (a truncated file, or not safetensors)",
            human(declared),
            human((size - 8) as u64)
        );
    }
    let header = &bytes[8..8 + declared as usize];
    let json: serde_json::Value = match serde_json::from_slice(header) {
        Ok(json) => json,
        Err(e) => return format!("the {}-byte header is not JSON: {e}", declared),
    };
    let Some(entries) = json.as_object() else {
        return "the header is JSON but not an object of tensors".into();
    };
    let data = (size - 8 - declared as usize) as u64;
    let mut spans = Vec::new();
    for (name, info) in entries.iter().filter(|(name, _)| *name != "__metadata__") {
        match span(info) {
            Ok(span) => spans.push((span, name)),
            Err(reason) => return format!("tensor `{name}`: {reason}"),
        }
    }
    spans.sort();
    let mut end = 0;
    for ((start, stop), name) in &spans {
        if *start != end {
            return format!(
                "tensor `{name}` starts at byte {start} of the data, but the tensor before it ends at byte {end} \
                 (tensors overlap or leave a gap)"
            );
        }
        end = *stop;
    }
    if end != data {
        let fault = if end > data { "truncated" } else { "trailing bytes" };
        return format!("the header says {} of tensor data, the file has {} ({fault})", human(end), human(data));
    }
    match error {
        SafeTensorError::HeaderTooLarge => "the header is larger than 100 MB".into(),
        SafeTensorError::IoError(e) => e.to_string(),
        other => format!("the safetensors reader refused it ({other})"),
    }
}

/// The byte span [start, end) of one header entry, checked against its dtype and shape.
fn span(info: &serde_json::Value) -> Result<(u64, u64), String> {
    let dtype = info["dtype"].as_str().ok_or("no `dtype`")?;
    let width = dtype_bytes(dtype).ok_or_else(|| format!("unknown dtype `{dtype}`"))?;
    let shape: Vec<u64> = info["shape"]
        .as_array()
        .and_then(|dims| dims.iter().map(|d| d.as_u64()).collect())
        .ok_or("no `shape` of non-negative integers")?;
    let offsets: Vec<u64> = info["data_offsets"]
        .as_array()
        .and_then(|o| o.iter().map(|d| d.as_u64()).collect())
        .filter(|o: &Vec<u64>| o.len() == 2)
        .ok_or("no `data_offsets` [start, end]")?;
    let (start, end) = (offsets[0], offsets[1]);
    if end < start {
        return Err(format!("data offsets [{start}, {end}] run backwards"));
    }
    let needed =
        shape.iter().try_fold(width, |n, &d| n.checked_mul(d)).ok_or_else(|| format!("shape {shape:?} overflows"))?;
    if end - start != needed {
        return Err(format!(
            "{dtype} {shape:?} needs {} but its data offsets span {}",
            human(needed),
            human(end - start)
        ));
    }
    Ok((start, end))
}

fn dtype_bytes(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" => 1,
        "U16" | "I16" | "F16" | "BF16" => 2,
        "U32" | "I32" | "F32" => 4,
        "U64" | "I64" | "F64" => 8,
        _ => return None,
    })
}

/// Bytes as people read them: "512 bytes", "3.2 kB", "4.0 MB", "1.3 GB".
fn human(bytes: u64) -> String {
    let b = bytes as f64;
    match bytes {
        0..=999 => format!("{bytes} bytes"),
        1_000..=999_999 => format!("{:.1} kB", b / 1e3),
        1_000_000..=999_999_999 => format!("{:.1} MB", b / 1e6),
        _ => format!("{:.1} GB", b / 1e9),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(header: &str, data: usize) -> Vec<u8> {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend(std::iter::repeat_n(0u8, data));
        bytes
    }

    fn why(bytes: &[u8]) -> String {
        let error = safetensors::SafeTensors::deserialize(bytes).expect_err("the file is refused");
        explain(bytes, &error)
    }

    const ONE: &str = r#"{"w":{"dtype":"F32","shape":[1000,1000],"data_offsets":[0,4000000]}}"#;

    #[test]
    fn a_truncated_file_is_named_in_sizes() {
        assert_eq!(
            why(&file(ONE, 2_000_000)),
            "the header says 4.0 MB of tensor data, the file has 2.0 MB (truncated)"
        );
    }

    #[test]
    fn a_tensor_whose_offsets_disagree_with_its_shape_is_named() {
        let header = r#"{"w":{"dtype":"BF16","shape":[4,4],"data_offsets":[0,16]}}"#;
        assert_eq!(why(&file(header, 16)), "tensor `w`: BF16 [4, 4] needs 32 bytes but its data offsets span 16 bytes");
    }

    #[test]
    fn overlapping_tensors_are_named() {
        let header = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
        assert!(why(&file(header, 12))
            .starts_with("tensor `b` starts at byte 4 of the data, but the tensor before it ends at byte 8"));
    }

    #[test]
    fn a_header_length_past_the_end_and_a_header_that_is_not_json() {
        let mut bytes = file(ONE, 0);
        bytes.truncate(20);
        assert!(
            why(&bytes).starts_with("the header length says 68 bytes but only 12 bytes follow it"),
            "{}",
            why(&bytes)
        );
        assert!(why(&file("{not json", 0)).starts_with("the 9-byte header is not JSON"));
        assert_eq!(why(&[1, 2, 3]), "the file is 3 bytes; a safetensors file starts with an 8-byte header length");
    }
}
