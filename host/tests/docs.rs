//! The docs stay true to the repository: every relative link in README.md and docs/ names a file
//! that exists, every `host` command the README shows in a code block parses (a stale flag fails
//! here), and every `make` target it shows exists.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").canonicalize().unwrap()
}

/// README.md and every page under docs/.
fn pages() -> Vec<PathBuf> {
    let mut pages = vec![repo().join("README.md")];
    for entry in std::fs::read_dir(repo().join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path);
        }
    }
    pages
}

/// The targets of Markdown links `[text](target)` outside code.
fn links(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (i, block) in text.split("```").enumerate() {
        if i % 2 == 1 {
            continue; // inside a fenced code block
        }
        for part in block.split("](").skip(1) {
            if let Some(end) = part.find(')') {
                found.push(part[..end].to_owned());
            }
        }
    }
    found
}

/// The lines of the fenced code blocks, with the shell's line continuations joined.
fn code_lines(text: &str) -> Vec<String> {
    let mut lines = Vec::new();
    for block in text.split("```").skip(1).step_by(2) {
        let mut pending = String::new();
        for line in block.lines().skip(1) {
            match line.strip_suffix('\\') {
                Some(head) => pending.push_str(head),
                None => lines.push(std::mem::take(&mut pending) + line),
            }
        }
    }
    lines
}

/// A shell command line's words (quotes removed), up to a comment.
fn words(line: &str) -> Vec<String> {
    let (mut words, mut word, mut quote, mut in_word) = (Vec::new(), String::new(), None, false);
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '"' | '\'') => (quote, in_word) = (Some(c), true),
            (None, '#') if !in_word => break,
            (None, c) if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                }
                in_word = false;
            }
            (None, c) => (word.push(c), in_word = true).1,
        }
    }
    if in_word {
        words.push(word);
    }
    words
}

#[test]
fn the_helpers_read_markdown_and_shell_as_written() {
    assert_eq!(
        links("see [a](docs/a.md) and `[b](x)`\n```\n[c](no.md)\n```\n[d](../e.md#f)"),
        ["docs/a.md", "x", "../e.md#f"]
    );
    assert_eq!(code_lines("```sh\nhost run \\\n  --json   # x\n```\n"), ["host run   --json   # x"]);
    assert_eq!(
        words("host run --prompt \"In the beginning\" --seed 3   # a comment"),
        ["host", "run", "--prompt", "In the beginning", "--seed", "3"]
    );
    assert_eq!(words("a 'b # c' d#e"), ["a", "b # c", "d#e"]);
}

#[test]
fn every_relative_link_in_the_docs_resolves() {
    let mut broken = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for link in links(&text) {
            let path = link.split('#').next().unwrap();
            if path.is_empty() || link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            if !page.parent().unwrap().join(path).exists() {
                broken.push(format!("{}: {link}", page.display()));
            }
        }
    }
    assert!(broken.is_empty(), "links to nothing:\n{}", broken.join("\n"));
}

#[test]
fn every_command_the_readme_shows_parses() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let makefile = std::fs::read_to_string(repo().join("Makefile")).unwrap();
    let mut hosts = 0;
    for line in code_lines(&readme) {
        let words = words(line.trim_start_matches("$ "));
        let Some((program, args)) = words.split_first() else { continue };
        if program == "make" {
            for target in args.iter().filter(|a| !a.contains('=')) {
                let defined = makefile.lines().any(|l| l.starts_with(&format!("{target}:")));
                assert!(defined, "README shows `{line}`, and the Makefile has no target `{target}`");
            }
        } else if program == "host" || program.ends_with("/host") {
            hosts += 1;
            let out = Command::new(env!("CARGO_BIN_EXE_host")).args(args).arg("--help").output().unwrap();
            assert!(
                out.status.success(),
                "README shows `{line}`, which the host does not parse:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    assert!(hosts >= 3, "the README shows {hosts} host commands in code blocks");
}
