//! The repository carries its own documents, and what cites them stays true: every citation of
//! the form `docs/<file>.md, "<Heading>"` in a `.rs` or `.md` file names a document that exists
//! and a heading it has, word for word; no code comment cites the numbered sections of documents
//! outside the repository; nothing points at a folder beside the checkout. Pure file reading:
//! no Kafka, PostgreSQL or Redis.

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
}
