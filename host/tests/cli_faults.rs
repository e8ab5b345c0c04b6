//! Faults a user meets on the command line: Ctrl-C and closed pipes keep what was produced,
//! damaged plugin files and ambiguous plugin directories are refused in one line, a drafter's
//! panic stays off the terminal unless asked for, and requests beyond the model are refused.

mod common;

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{fixture, plugins_dir_with, workspace_plugin};
use kernels::os::processes::{self, Signal};

fn host(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_host")).args(args).env("RUST_BACKTRACE", "1").output().unwrap()
}

fn spawn(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_host")).args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A manifest for the dense fixture with `extra` TOML before `[generation]`, generating
/// `max_tokens` greedily from a short prompt (the fixture then meets no end of sequence for
/// thousands of tokens).
fn manifest(dir: &Path, extra: &str, max_tokens: usize) -> PathBuf {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gemma4/dense").canonicalize().unwrap();
    let file = dir.join("m.toml");
    let body = format!(
        "[target]\nmodel = \"{}\"\n{extra}[generation]\nprompt_ids = [2, 17, 40]\nmax_tokens = {max_tokens}\ntemperature = 0.0\n",
        model.display()
    );
    fs::write(&file, body).unwrap();
    file
}

/// Far more tokens than any test waits for: only an interruption ends these runs early.
const ENDLESS: usize = 100_000;

fn sigint(child: &Child) {
    assert!(processes::send(child.id(), Signal::Interrupt));
}

fn wait_for_output(child: Child, limit: Duration) -> Output {
    let started = Instant::now();
    let pid = child.id();
    let waiter = std::thread::spawn(move || child.wait_with_output().unwrap());
    while !waiter.is_finished() {
        if started.elapsed() > limit {
            processes::send(pid, Signal::Kill);
            panic!("the host did not stop within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    waiter.join().unwrap()
}

#[test]
fn ctrl_c_during_json_still_prints_the_json_of_what_was_produced() {
    let work = tempfile::tempdir().unwrap();
    let m = manifest(work.path(), "", ENDLESS);
    let child = spawn(&["run", "--manifest", m.to_str().unwrap(), "--json"]);
    std::thread::sleep(Duration::from_secs(3));
    sigint(&child);
    let out = wait_for_output(child, Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(130), "{}", text(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(json["stop"], "interrupted");
    let tokens = json["tokens"].as_array().unwrap().len();
    assert!(tokens < ENDLESS && json["stats"]["generated_tokens"] == tokens, "{json}");
}

#[test]
fn ctrl_c_while_streaming_ends_the_text_with_a_newline_and_prints_the_summary() {
    let work = tempfile::tempdir().unwrap();
    let m = manifest(work.path(), "", ENDLESS);
    let mut child = spawn(&["run", "--manifest", m.to_str().unwrap()]);
    let mut first = [0u8; 16];
    child.stdout.as_mut().unwrap().read_exact(&mut first).unwrap();
    sigint(&child);
    let out = wait_for_output(child, Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(130), "{}", text(&out.stderr));
    assert!(out.stdout.ends_with(b"\n"));
    assert!(text(&out.stderr).contains("generated (Interrupted)"), "{}", text(&out.stderr));
}

#[test]
fn sigterm_means_what_ctrl_c_means_and_the_json_of_what_was_produced_is_printed() {
    let work = tempfile::tempdir().unwrap();
    let m = manifest(work.path(), "", ENDLESS);
    let child = spawn(&["run", "--manifest", m.to_str().unwrap(), "--json"]);
    std::thread::sleep(Duration::from_secs(3));
    assert!(processes::send(child.id(), Signal::Terminate));
    let out = wait_for_output(child, Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(143), "{}", text(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(json["stop"], "interrupted");
    assert!(!json["tokens"].as_array().unwrap().is_empty(), "{json}");
}

/// A prompts file of a short request, an endless one and one after it, with or without a
/// drafter (`extra` manifest TOML), interrupted by `signal` once the first result is written.
fn interrupt_a_prompts_file(extra: &str, signal: Signal) -> (Output, Vec<serde_json::Value>) {
    let work = tempfile::tempdir().unwrap();
    let m = manifest(work.path(), extra, 8);
    let prompts = work.path().join("in.jsonl");
    let lines = [
        r#"{"prompt_ids": [2, 17, 40], "max_tokens": 4, "id": "a"}"#.to_owned(),
        format!(r#"{{"prompt_ids": [2, 17, 40], "max_tokens": {ENDLESS}, "id": "b"}}"#),
        format!(r#"{{"prompt_ids": [2, 17, 40], "max_tokens": {ENDLESS}, "id": "c"}}"#),
    ];
    fs::write(&prompts, lines.join("\n")).unwrap();
    let results = work.path().join("out.jsonl");
    let plugins = workspace_plugin("ngram").parent().unwrap().to_owned();
    let child = spawn(&[
        "run",
        "--manifest",
        m.to_str().unwrap(),
        "--prompts-file",
        prompts.to_str().unwrap(),
        "--output",
        results.to_str().unwrap(),
        "--plugins-dir",
        plugins.to_str().unwrap(),
    ]);
    let started = Instant::now();
    while fs::read_to_string(&results).map_or(true, |t| t.is_empty()) && started.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    assert!(processes::send(child.id(), signal));
    let out = wait_for_output(child, Duration::from_secs(60));
    let written = fs::read_to_string(&results).unwrap();
    (out, written.lines().map(|l| serde_json::from_str(l).unwrap()).collect())
}

#[test]
fn an_interrupted_prompts_file_keeps_every_result_and_what_each_row_produced() {
    // Plain decoding: one request after another; the first is done, the second interrupted,
    // the third never started.
    let (out, results) = interrupt_a_prompts_file("", Signal::Interrupt);
    assert_eq!(out.status.code(), Some(130), "{}", text(&out.stderr));
    assert_eq!(results.len(), 3, "{results:?}");
    assert_eq!((results[0]["id"].as_str(), results[0]["stop"].as_str()), (Some("a"), Some("max_tokens")));
    assert_eq!(results[1]["stop"], "interrupted", "{:?}", results[1]);
    assert!(!results[1]["tokens"].as_array().unwrap().is_empty());
    assert_eq!(results[2]["error"], "not generated: interrupted");

    // Speculative: the rows share rounds; the short one finished, the others stop at the next
    // token with what they produced.
    let (out, results) = interrupt_a_prompts_file("[drafter]\nkind = \"ngram\"\n", Signal::Terminate);
    assert_eq!(out.status.code(), Some(143), "{}", text(&out.stderr));
    let stops: Vec<_> = results.iter().map(|r| r["stop"].as_str().unwrap_or("none")).collect();
    assert_eq!(stops, ["max_tokens", "interrupted", "interrupted"], "{results:?}");
    assert!(results.iter().all(|r| !r["tokens"].as_array().unwrap().is_empty()));
}

#[test]
fn an_output_that_cannot_be_written_is_refused_before_anything_loads() {
    let work = tempfile::tempdir().unwrap();
    let m = manifest(work.path(), "", 4);
    let prompts = work.path().join("in.jsonl");
    fs::write(&prompts, r#"{"prompt_ids": [2, 17, 40]}"#).unwrap();
    for output in [work.path().join("missing/out.jsonl"), work.path().to_owned()] {
        let started = Instant::now();
        let out = host(&[
            "run",
            "--manifest",
            m.to_str().unwrap(),
            "--prompts-file",
            prompts.to_str().unwrap(),
            "--output",
            output.to_str().unwrap(),
        ]);
        let err = text(&out.stderr);
        assert!(
            !out.status.success() && err.contains(&format!("--output {}: cannot write it", output.display())),
            "{err}"
        );
        assert!(started.elapsed() < Duration::from_secs(5), "refused only after {:?}", started.elapsed());
    }
}

#[test]
fn a_closed_stdout_stops_generation_at_the_next_token() {
    let work = tempfile::tempdir().unwrap();
    let m = manifest(work.path(), "", ENDLESS);
    let mut child = spawn(&["run", "--manifest", m.to_str().unwrap()]);
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 16];
    stdout.read_exact(&mut first).unwrap();
    drop(stdout);
    let out = wait_for_output(child, Duration::from_secs(60));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("generated (Interrupted)"), "{}", text(&out.stderr));
}

#[test]
fn a_closed_stdout_stops_a_json_run_too() {
    let work = tempfile::tempdir().unwrap();
    let m = manifest(work.path(), "", ENDLESS);
    let mut child = spawn(&["run", "--manifest", m.to_str().unwrap(), "--json"]);
    std::thread::sleep(Duration::from_secs(2));
    drop(child.stdout.take());
    let closed = Instant::now();
    let out = wait_for_output(child, Duration::from_secs(120));
    assert!(closed.elapsed() < Duration::from_secs(5), "it decoded on for {:?}", closed.elapsed());
    assert!(!text(&out.stderr).contains("panicked"), "{}", text(&out.stderr));
}

#[test]
fn a_truncated_plugin_is_refused_in_one_line_and_the_others_still_load() {
    let dir = plugins_dir_with(&[&workspace_plugin("ngram")]);
    let bytes = fs::read(workspace_plugin("ngram")).unwrap();
    for (name, len) in [("libhalf.so", bytes.len() / 2), ("libheader.so", 64), ("libstub.so", 4096)] {
        fs::write(dir.path().join(name), &bytes[..len]).unwrap();
    }
    let out = host(&["plugins", "list", "--plugins-dir", dir.path().to_str().unwrap()]);
    let listing = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    for name in ["libhalf.so", "libheader.so", "libstub.so"] {
        let line = listing.lines().find(|l| l.contains(name)).unwrap_or_else(|| panic!("{name} missing: {listing}"));
        assert!(line.contains("not loadable:"), "{line}");
    }
    assert!(listing.lines().any(|l| l.contains("libngram.so") && l.contains("ngram")), "{listing}");
}

#[test]
fn broken_symlinks_are_reported_not_skipped() {
    let dir = plugins_dir_with(&[&workspace_plugin("ngram")]);
    let d = dir.path();
    kernels::os::files::symlink(d.join("libnothing.so"), d.join("libdangling.so")).unwrap();
    kernels::os::files::symlink(d.join("libloop-b.so"), d.join("libloop-a.so")).unwrap();
    kernels::os::files::symlink(d.join("libloop-a.so"), d.join("libloop-b.so")).unwrap();
    let out = host(&["plugins", "list", "--plugins-dir", d.to_str().unwrap()]);
    let listing = text(&out.stdout);
    assert!(listing.lines().any(|l| l.contains("libdangling.so") && l.contains("a symlink to nothing")), "{listing}");
    assert!(listing.lines().any(|l| l.contains("libloop-a.so") && l.contains("a symlink loop")), "{listing}");
    assert!(listing.lines().any(|l| l.contains("libngram.so") && l.contains("ngram")), "{listing}");
}

#[test]
fn two_libraries_of_one_kind_are_both_refused_naming_each_other() {
    let ngram = workspace_plugin("ngram");
    let dir = plugins_dir_with(&[&ngram]);
    fs::copy(&ngram, dir.path().join("libngram-copy.so")).unwrap();
    let d = dir.path().to_str().unwrap();
    let listing = text(&host(&["plugins", "list", "--plugins-dir", d]).stdout);
    for (this, other) in [("libngram.so", "libngram-copy.so"), ("libngram-copy.so", "libngram.so")] {
        let line = listing.lines().find(|l| l.contains(&format!("refused  {this}:"))).unwrap();
        assert!(line.contains(&format!("kind `ngram` is also provided by {other}")), "{line}");
    }
    let work = tempfile::tempdir().unwrap();
    let m = manifest(work.path(), "[drafter]\nkind = \"ngram\"\n", 4);
    for command in [&["manifest", "check", m.to_str().unwrap()][..], &["run", "--manifest", m.to_str().unwrap()]] {
        let mut args = command.to_vec();
        args.extend(["--plugins-dir", d]);
        let out = host(&args);
        assert!(!out.status.success());
        assert!(text(&out.stderr).contains("kind `ngram` is also provided by"), "{command:?}: {}", text(&out.stderr));
    }
}

#[test]
fn a_drafter_panic_stays_off_the_terminal_unless_verbose() {
    let plugins = plugins_dir_with(&[&fixture("misbehaving")]);
    let work = tempfile::tempdir().unwrap();
    let drafter = "[drafter]\nkind = \"misbehaving\"\n[drafter.options]\nmode = \"well-behaved\"\npanic_after = 2\n";
    let m = manifest(work.path(), drafter, 12);
    let args = ["run", "--manifest", m.to_str().unwrap(), "--plugins-dir", plugins.path().to_str().unwrap()];
    let quiet = host(&args);
    assert!(quiet.status.success(), "{}", text(&quiet.stderr));
    let stderr = text(&quiet.stderr);
    assert!(stderr.contains("misbehaving drafter panics after its last allowed draft"), "{stderr}");
    assert!(!stderr.contains("panicked at") && !stderr.contains("stack backtrace"), "{stderr}");

    let verbose = host(&[&args[..], &["--verbose"]].concat());
    assert!(verbose.status.success());
    assert!(text(&verbose.stderr).contains("panicked at"), "{}", text(&verbose.stderr));
    assert_eq!(quiet.stdout, verbose.stdout, "the text does not depend on --verbose");
}

#[test]
fn an_artifact_for_a_drafter_that_takes_none_is_refused() {
    let plugins = plugins_dir_with(&[&workspace_plugin("ngram")]);
    let work = tempfile::tempdir().unwrap();
    fs::create_dir(work.path().join("weights")).unwrap();
    let m = manifest(work.path(), "[drafter]\nkind = \"ngram\"\nartifact = \"weights\"\n", 4);
    let out = host(&["manifest", "check", m.to_str().unwrap(), "--plugins-dir", plugins.path().to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("drafter.artifact: drafter `ngram` takes no artifact"), "{}", text(&out.stderr));
}

#[test]
fn a_request_beyond_the_models_context_is_refused_before_prefill() {
    let work = tempfile::tempdir().unwrap();
    let m = manifest(work.path(), "", 131_072);
    let out = host(&["run", "--manifest", m.to_str().unwrap()]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("the prompt's 3 tokens plus max_tokens 131072 exceed the model's context of 131072"),
        "{stderr}"
    );
}

#[test]
fn a_long_prefill_reports_its_progress_chunk_by_chunk() {
    let work = tempfile::tempdir().unwrap();
    let m = manifest(work.path(), "", 2);
    let prompt: Vec<u32> = (0..1100).map(|i| 10 + i % 400).collect();
    let options = host::run::RunOptions {
        source: host::manifest::Source::manifest(&m),
        overrides: host::run::Overrides { prompt_ids: Some(prompt), ..Default::default() },
        plugins_dir: host::plugins_dir::resolve(Some(PathBuf::from("."))),
        compare_plain: false,
    };
    let mut seen = Vec::new();
    let output = host::run::run(&options, |event| {
        if let host::run::RunEvent::Prefill { done, total } = event {
            seen.push((done, total));
        }
        host::generate::Flow::Continue
    })
    .unwrap();
    assert_eq!(seen, [(512, 1100), (1024, 1100), (1100, 1100)]);
    assert_eq!(output.tokens.len(), 2);
}

#[test]
fn a_tokenizer_smaller_than_the_models_vocabulary_is_refused_and_check_model_reports_it() {
    // The demo target's weights with the 512-token tokenizer of a test fixture.
    let work = tempfile::tempdir().unwrap();
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/kjv-gemma4");
    for entry in fs::read_dir(&demo).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            fs::copy(&path, work.path().join(path.file_name().unwrap())).unwrap();
        }
    }
    let small = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gemma4/dense/tokenizer.json");
    fs::copy(small, work.path().join("tokenizer.json")).unwrap();
    let dir = work.path().to_str().unwrap();
    let out = host(&["run", "--model", dir, "--prompt-ids", "2,17", "--max-tokens", "4"]);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("tokenizer.json: does not fit the model: it has 512 tokens and the model's vocabulary 8192"),
        "{err}"
    );
    let out = host(&["check-model", dir]);
    let report = text(&out.stdout);
    assert!(
        !out.status.success() && report.contains("tokenizer: it has 512 tokens and the model's vocabulary 8192"),
        "{report}"
    );
}

#[test]
fn chat_with_the_manifests_prompt_ids_is_refused() {
    let work = tempfile::tempdir().unwrap();
    let m = manifest(work.path(), "", 4);
    let out = host(&["run", "--manifest", m.to_str().unwrap(), "--chat"]);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(
            "chat: a chat template wraps a text prompt, and the manifest's [generation] prompt_ids are already tokens"
        ),
        "{err}"
    );
}

#[test]
fn draft_tokens_without_a_drafter_is_refused() {
    let work = tempfile::tempdir().unwrap();
    let m = manifest(work.path(), "", 4);
    let out = host(&["run", "--manifest", m.to_str().unwrap(), "--draft-tokens", "3"]);
    let err = text(&out.stderr);
    assert!(!out.status.success() && err.contains("--draft-tokens: no drafter is set"), "{err}");
}

/// The error line of `host run --manifest` on [`manifest`]'s manifest with `extra`, with the
/// workspace's plugins.
fn manifest_refusal(extra: &str) -> String {
    let work = tempfile::tempdir().unwrap();
    let file = manifest(work.path(), extra, 4);
    let plugins = workspace_plugin("ngram").parent().unwrap().to_owned();
    let out = host(&["run", "--manifest", file.to_str().unwrap(), "--plugins-dir", plugins.to_str().unwrap()]);
    assert!(!out.status.success(), "{extra}");
    let err = text(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    err.trim().to_owned()
}

#[test]
fn manifest_refusals_are_one_line_at_the_key() {
    for (extra, says) in [
        ("[drafter]\nkind = \"\"\n", "m.toml:4: drafter.kind: `` is not a plugin kind"),
        ("[drafter]\nkind = \"../evil\"\n", "m.toml:4: drafter.kind: `../evil` is not a plugin kind"),
        ("[drafter]\nkind = \"ngram\"\n[drafter.options]\nmax_ngram = 1000\n", "m.toml:6: drafter.options.max_ngram: "),
        ("[target]\nmodel = \"x\"\n", "m.toml:3: invalid table header: duplicate key `target`"),
    ] {
        let err = manifest_refusal(extra);
        assert!(err.contains(says), "{extra}: {err}");
    }
}

#[test]
fn a_prompts_file_without_requests_or_with_a_line_that_is_no_object_says_so() {
    let work = tempfile::tempdir().unwrap();
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gemma4/dense");
    let prompts = work.path().join("p.jsonl");
    fs::write(&prompts, "\n  \n").unwrap();
    let args =
        ["run", "--model", model.to_str().unwrap(), "--max-tokens", "2", "--prompts-file", prompts.to_str().unwrap()];
    let out = host(&args);
    assert!(!out.status.success() && text(&out.stderr).contains("no request in it"), "{}", text(&out.stderr));
    fs::write(&prompts, "[]\n{\"prompt_ids\": [2]}\n").unwrap();
    let out = host(&args);
    let lines: Vec<serde_json::Value> = text(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines[0]["error"], "not a request: expected a JSON object with `prompt` or `prompt_ids`");
    assert_eq!(lines[1]["stop"], "max_tokens");
}
