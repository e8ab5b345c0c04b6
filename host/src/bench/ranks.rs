//! `host bench --ranks N --manifest M`: the manifest's request decoded by one process against
//! the same request with the target sharded over N ranks on this machine (`host launch`), both
//! as runs of this executable, paired and interleaved; the tokens must agree.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Serialize;

use super::summary;

#[derive(Debug, Serialize)]
pub struct RanksBench {
    pub ranks: usize,
    /// Decode tokens per second of each run, one process and sharded.
    pub one_process: Vec<f64>,
    pub sharded: Vec<f64>,
    /// Sharded over one process, per pair.
    pub ratios: Vec<f64>,
    pub identical_tokens: bool,
    pub memory_gb_per_s: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum RanksError {
    #[error("--ranks: at least 2, and --pairs at least 1")]
    Counts,
    #[error("running `{command}`: {reason}")]
    Run { command: String, reason: String },
}

pub fn ranks(
    manifest: &Path,
    plugins_dir: Option<&Path>,
    ranks: usize,
    pairs: usize,
    max_tokens: u32,
) -> Result<RanksBench, RanksError> {
    if ranks < 2 || pairs == 0 {
        return Err(RanksError::Counts);
    }
    let mut run: Vec<OsString> = vec!["run".into(), "--manifest".into(), manifest.into()];
    if let Some(dir) = plugins_dir {
        run.extend(["--plugins-dir".into(), dir.into()]);
    }
    run.extend(["--max-tokens".into(), max_tokens.to_string().into()]);
    run.extend(["--temperature".into(), "0".into(), "--json".into()]);
    let mut launched: Vec<OsString> = vec!["launch".into(), "-n".into(), ranks.to_string().into(), "--".into()];
    launched.extend(run.iter().cloned());
    // One unmeasured run of each: neither side pays first-touch costs in the sample.
    let (_, reference) = decode(&run)?;
    decode(&launched)?;
    let (mut one_process, mut sharded, mut identical_tokens) = (Vec::new(), Vec::new(), true);
    for pair in 0..pairs {
        let sides = [(false, &run), (true, &launched)];
        let order = if pair % 2 == 0 { sides } else { [sides[1], sides[0]] };
        for (is_sharded, args) in order {
            let (rate, tokens) = decode(args)?;
            identical_tokens &= tokens == reference;
            if is_sharded {
                sharded.push(rate)
            } else {
                one_process.push(rate)
            }
        }
    }
    let ratios = sharded.iter().zip(&one_process).map(|(s, o)| s / o).collect();
    Ok(RanksBench {
        ranks,
        one_process,
        sharded,
        ratios,
        identical_tokens,
        memory_gb_per_s: super::memory_bandwidth_gb_per_s(),
    })
}

/// Decode tokens per second and the tokens of one `host …` run with `--json`.
fn decode(args: &[OsString]) -> Result<(f64, Vec<u64>), RanksError> {
    let exe: PathBuf = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("host"));
    let command = format!("host {}", args.iter().map(|a| a.to_string_lossy()).collect::<Vec<_>>().join(" "));
    let fail = |reason: String| RanksError::Run { command: command.clone(), reason };
    let out =
        crate::runtime::starting_children(|| Command::new(exe).args(args).output()).map_err(|e| fail(e.to_string()))?;
    if !out.status.success() {
        return Err(fail(String::from_utf8_lossy(&out.stderr).trim().to_owned()));
    }
    let json: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|e| fail(format!("its output is not JSON: {e}")))?;
    let rate = json["stats"]["decode_tokens_per_s"].as_f64().ok_or_else(|| fail("no decode rate".into()))?;
    let tokens = json["tokens"].as_array().map(|t| t.iter().filter_map(|v| v.as_u64()).collect()).unwrap_or_default();
    Ok((rate, tokens))
}

impl RanksBench {
    pub fn text(&self) -> String {
        let (ratio, low, high) = summary(&self.ratios);
        let (one, _, _) = summary(&self.one_process);
        let (sharded, _, _) = summary(&self.sharded);
        format!(
            "decode, one process: {one:.1} tok/s; over {} ranks: {sharded:.1} tok/s (medians of {} pairs)\n\
             ranks / one process: {ratio:.2}× [{low:.2}, {high:.2}]\n\
             tokens identical: {}\nmachine read bandwidth: {:.1} GB/s (shared by the ranks)\n",
            self.ranks,
            self.ratios.len(),
            if self.identical_tokens { "yes" } else { "NO" },
            self.memory_gb_per_s
        )
    }
}
