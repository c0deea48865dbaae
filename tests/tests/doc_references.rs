//! The repository carries its own documents, and what cites them stays true: every citation of
//! the form `docs/<file>.md, "<Heading>"` in a `.rs` or `.md` file names a document that exists
//! and a heading it has, word for word; no code comment cites the numbered sections of documents
//! outside the repository; nothing points at a folder beside the checkout; every citation of a
//! section of BENCHMARKS.md names a heading it has; README.md and BENCHMARKS.md name no commit
//! and no time of day (they give current figures with the command that reproduces them; the
//! history is git's), and docs/*.md name no commit. Pure file reading: no Kafka, PostgreSQL or
//! Redis.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// Folders that hold no sources of ours: build output, installed packages, git's own, the
/// quick start's state.
const SKIPPED: &[&str] = &["target", "node_modules", ".git", ".intake", "dist", "fuzz/corpus"];

fn root() -> PathBuf {
    intake_tests::repo()
}

fn files(dir: &Path, root: &Path, found: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let relative = path.strip_prefix(root).unwrap_or(&path).to_string_lossy().replace('\\', "/");
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if !SKIPPED.iter().any(|skip| name == *skip || relative.ends_with(skip)) {
                files(&path, root, found);
            }
        } else if name.ends_with(".rs") || name.ends_with(".md") {
            found.push(path);
        }
    }
}

fn sources() -> Vec<(String, String)> {
    let root = root();
    let mut found = Vec::new();
    files(&root, &root, &mut found);
    found.sort();
    found
        .into_iter()
        .filter_map(|path| {
            let text = std::fs::read_to_string(&path).ok()?;
            let relative = path.strip_prefix(&root).unwrap_or(&path).to_string_lossy().into_owned();
            Some((relative, text))
        })
        .collect()
}

/// A markdown file's headings (`#` to `######`), outside fenced code blocks.
fn headings(markdown: &str) -> BTreeSet<String> {
    let mut in_fence = false;
    let mut found = BTreeSet::new();
    for line in markdown.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence {
            continue;
        }
        let hashes = trimmed.chars().take_while(|&c| c == '#').count();
        if (1..=6).contains(&hashes) && trimmed[hashes..].starts_with(' ') {
            found.insert(trimmed[hashes..].trim().trim_end_matches('#').trim().to_owned());
        }
    }
    found
}

/// The text with each line's comment markers and indentation removed and the lines joined by a
/// space, so that a citation broken over two comment lines reads as one.
fn flattened(text: &str) -> String {
    text.lines()
        .map(|line| {
            let line = line.trim_start();
            let line =
                ["//!", "///", "//", "#", "*", ">"].iter().find_map(|marker| line.strip_prefix(marker)).unwrap_or(line);
            line.trim()
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Every `docs/<file>.md, "<Heading>"` in the text: (file, heading).
fn citations(text: &str) -> Vec<(String, String)> {
    let flat = flattened(text);
    let mut found = Vec::new();
    let mut rest = flat.as_str();
    while let Some(at) = rest.find("docs/") {
        rest = &rest[at + "docs/".len()..];
        let name_len = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '-').count();
        let (name, after) = rest.split_at(name_len);
        let Some(after) = after.strip_prefix(".md,") else { continue };
        let Some(quoted) = after.trim_start().strip_prefix('"') else { continue };
        let Some(end) = quoted.find('"') else { continue };
        found.push((format!("docs/{name}.md"), quoted[..end].to_owned()));
    }
    found
}

/// Every heading of BENCHMARKS.md that the text cites: the file's name (with or without `.md`),
/// a comma, and the heading in double quotes.
fn benchmark_citations(text: &str) -> Vec<String> {
    let flat = flattened(text);
    let mut found = Vec::new();
    let mut rest = flat.as_str();
    while let Some(at) = rest.find("BENCHMARKS") {
        rest = &rest[at + "BENCHMARKS".len()..];
        let after = rest.strip_prefix(".md").unwrap_or(rest);
        let Some(after) = after.strip_prefix(',') else { continue };
        let Some(quoted) = after.trim_start().strip_prefix('"') else { continue };
        let Some(end) = quoted.find('"') else { continue };
        found.push(quoted[..end].to_owned());
    }
    found
}

/// Whether a word reads as a git commit id: 7 to 40 lowercase hexadecimal characters with at
/// least one digit and one letter, so that neither a number nor a word such as "deface" counts.
fn looks_like_commit(word: &str) -> bool {
    (7..=40).contains(&word.len())
        && word.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        && word.bytes().any(|b| b.is_ascii_digit())
        && word.bytes().any(|b| b.is_ascii_alphabetic())
}

/// The words of a line that read as commit ids; a word is a run of letters, digits and `_`.
fn commits_in(line: &str) -> Vec<&str> {
    line.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).filter(|word| looks_like_commit(word)).collect()
}

/// The times of day in a line: an hour (0 to 23, one or two digits) and two digits of minutes
/// after a colon, not part of a longer run of digits, colons or dots (an address and port, a
/// version). Durations are written in words ("3 min 7 s"), and ratios do not take this form.
fn times_of_day(line: &str) -> Vec<&str> {
    let bytes = line.as_bytes();
    let joined = |i: usize| bytes.get(i).is_some_and(|b| b.is_ascii_digit() || *b == b':' || *b == b'.');
    let mut found = Vec::new();
    for (colon, _) in line.match_indices(':') {
        let mut start = colon;
        while start > 0 && colon - start < 2 && bytes[start - 1].is_ascii_digit() {
            start -= 1;
        }
        let minutes = colon + 1..colon + 3;
        let is_time = start < colon
            && (start == 0 || !joined(start - 1))
            && line.get(minutes.clone()).is_some_and(|m| m.bytes().all(|b| b.is_ascii_digit()))
            && !bytes.get(minutes.end).is_some_and(|b| b.is_ascii_digit())
            && line[start..colon].parse::<u32>().is_ok_and(|hour| hour < 24)
            && line[minutes.clone()].parse::<u32>().is_ok_and(|minute| minute < 60);
        if is_time {
            found.push(&line[start..minutes.end]);
        }
    }
    found
}

#[test]
fn every_cited_heading_exists() {
    let sources = sources();
    let documents: HashMap<&str, BTreeSet<String>> = sources
        .iter()
        .filter(|(path, _)| path.starts_with("docs/"))
        .map(|(path, text)| (path.as_str(), headings(text)))
        .collect();
    let mut broken = Vec::new();
    let mut cited = 0;
    for (path, text) in &sources {
        for (document, heading) in citations(text) {
            cited += 1;
            match documents.get(document.as_str()) {
                None => broken.push(format!("{path}: {document} does not exist")),
                Some(headings) if !headings.contains(&heading) => {
                    broken.push(format!("{path}: {document} has no heading \"{heading}\""))
                }
                Some(_) => {}
            }
        }
    }
    assert!(cited > 0, "no citation found: is the repository root right? ({})", root().display());
    assert!(broken.is_empty(), "citations of headings that do not exist:\n{}", broken.join("\n"));
}

#[test]
fn every_cited_benchmark_section_exists() {
    let sources = sources();
    let benchmarks = std::fs::read_to_string(root().join("BENCHMARKS.md")).expect("BENCHMARKS.md");
    let known = headings(&benchmarks);
    let mut broken = Vec::new();
    for (path, text) in &sources {
        for heading in benchmark_citations(text) {
            if !known.contains(&heading) {
                broken.push(format!("{path}: BENCHMARKS.md has no heading \"{heading}\""));
            }
        }
    }
    assert!(broken.is_empty(), "citations of sections of BENCHMARKS.md that do not exist:\n{}", broken.join("\n"));
}

/// README.md and BENCHMARKS.md give current figures, each with the command that measures it
/// again: a commit id or the time of day of a run is a diary's, and belongs in git. Example
/// requests and outputs in fenced code blocks may hold times of day; no line may hold a commit.
#[test]
fn readme_and_benchmarks_name_no_commit_and_no_time_of_day() {
    let mut found = Vec::new();
    for document in ["README.md", "BENCHMARKS.md"] {
        let text = std::fs::read_to_string(root().join(document)).unwrap_or_else(|e| panic!("{document}: {e}"));
        let mut in_fence = false;
        for (number, line) in text.lines().enumerate() {
            let trimmed = line.trim_start();
            if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
                in_fence = !in_fence;
            }
            let commits = commits_in(line);
            let times = if in_fence { Vec::new() } else { times_of_day(line) };
            if !commits.is_empty() || !times.is_empty() {
                let what: Vec<&str> = commits.into_iter().chain(times).collect();
                found.push(format!("{document}:{}: {what:?}: {}", number + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "commit ids or times of day (give the figure, its host and its command; leave its history to git):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_documents_name_no_commit() {
    let mut found = Vec::new();
    for (path, text) in sources().iter().filter(|(path, _)| path.starts_with("docs/") && path.ends_with(".md")) {
        for (number, line) in text.lines().enumerate() {
            let commits = commits_in(line);
            if !commits.is_empty() {
                found.push(format!("{path}:{}: {commits:?}: {}", number + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "commit ids in the documents (say what the code does; its history is git's):\n{}",
        found.join("\n")
    );
}

#[test]
fn no_comment_cites_numbered_sections_of_outside_documents() {
    // Built from parts, so that this file does not match itself.
    let words = ["DESIGN", "SPEC"];
    let mut found = Vec::new();
    for (path, text) in sources().iter().filter(|(path, _)| path.ends_with(".rs")) {
        for (number, line) in text.lines().enumerate() {
            for word in words {
                let section = format!("{word} section");
                let numbered = line.match_indices(word).any(|(at, _)| {
                    let after = &line[at + word.len()..];
                    after.strip_prefix(' ').is_some_and(|a| a.starts_with(|c: char| c.is_ascii_digit()))
                });
                if line.contains(&section) || numbered {
                    found.push(format!("{path}:{}: {}", number + 1, line.trim()));
                }
            }
        }
    }
    assert!(found.is_empty(), "cite docs/api.md or docs/architecture.md by heading instead:\n{}", found.join("\n"));
}

#[test]
fn nothing_points_outside_the_repository() {
    let outside = ["..", "/shared/"].concat();
    let found: Vec<String> =
        sources().into_iter().filter(|(_, text)| text.contains(&outside)).map(|(path, _)| path).collect();
    assert!(found.is_empty(), "these files refer to a folder beside the checkout: {found:?}");
}

#[test]
fn the_parsers_read_what_they_should() {
    let text = "//! see (docs/architecture.md,\n//! \"Stale values\") and docs/api.md, \"Error order\".\n";
    assert_eq!(
        citations(text),
        vec![
            ("docs/architecture.md".to_owned(), "Stale values".to_owned()),
            ("docs/api.md".to_owned(), "Error order".to_owned())
        ]
    );
    assert!(citations("docs/configuration.md lists them").is_empty());
    let markdown = "# Title\n\n## Error order\n\n```sh\n# not a heading\n```\n### Key cache ##\n";
    let found = headings(markdown);
    assert!(found.contains("Error order") && found.contains("Key cache") && found.contains("Title"));
    assert!(!found.contains("not a heading"));
    assert_eq!(
        benchmark_citations(
            "see BENCHMARKS.md, \"A schema\n// migration\" and (BENCHMARKS, \"At size\"); BENCHMARKS.md lists"
        ),
        vec!["A schema migration".to_owned(), "At size".to_owned()]
    );
}

#[test]
fn the_commit_and_time_checks_flag_what_they_should() {
    // Built from parts, so that this file's own text holds no commit id.
    let commit = ["60ac", "a12"].concat();
    let line = format!("at {commit}, 08:39-09:05 UTC; `git show {commit}:bench/report.md`");
    assert_eq!(commits_in(&line), vec![commit.as_str(), commit.as_str()]);
    assert_eq!(times_of_day(&line), vec!["08:39", "09:05"]);
    assert_eq!(times_of_day("started at 9:05, and at 23:59"), vec!["9:05", "23:59"]);
    let full = ["3ac8cb7", "e1b2c3d4e5f60718293a4b5c6d7e8f9012345678"];
    assert!(full.iter().all(|word| looks_like_commit(word)));
    // Words, numbers, digests past 40 characters, upper case and durations are not flagged.
    let quiet = [
        "deface defaced facade cafebabe",
        "1234567 12345678901 9007199254740991",
        "a SHA-256 of 64 hex characters: 5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8",
        "ABCDEF1234 0x1f2e3d4c",
        "3 min 7 s, 25 min 42 s, a ratio of 1:2 and 16:9",
        "127.0.0.1:8080, ports 55432:5432, version 1.2:34, 10:000, 24:00 and 12:60",
        "the run's p99 2.48 / 6.96 ms",
    ];
    for text in quiet {
        assert!(commits_in(text).is_empty(), "{text}: {:?}", commits_in(text));
        assert!(times_of_day(text).is_empty(), "{text}: {:?}", times_of_day(text));
    }
}
