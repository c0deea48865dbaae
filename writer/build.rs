//! Embeds the migrations (../migrations/NNNN_description.sql) in the writer: writes
//! `$OUT_DIR/migrations.rs`, a list of (version, description, SQL) that `src/migrations.rs`
//! turns into sqlx's migrator. sqlx's own `migrate!` macro does the same at compile time, but
//! its proc-macro crate compiles a second copy of sqlx, tokio and url for the build host.

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../migrations");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut files: Vec<(i64, String, String)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|entry| entry.ok())
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            // sqlx's naming: <version>_<description>.sql, underscores read as spaces.
            let (version, rest) = name.split_once('_')?;
            let description = rest.strip_suffix(".sql")?.replace('_', " ");
            let version = version.parse().unwrap_or_else(|e| panic!("{name}: version: {e}"));
            let path = entry.path().canonicalize().unwrap_or_else(|e| panic!("{name}: {e}"));
            Some((version, description, path.display().to_string()))
        })
        .collect();
    files.sort();
    let mut out = String::from("pub const MIGRATIONS: &[(i64, &str, &str)] = &[\n");
    for (version, description, path) in &files {
        let _ = writeln!(out, "    ({version}, {description:?}, include_str!({path:?})),");
    }
    out.push_str("];\n");
    let target = Path::new(&std::env::var("OUT_DIR").unwrap_or_else(|e| panic!("OUT_DIR: {e}"))).join("migrations.rs");
    std::fs::write(&target, out).unwrap_or_else(|e| panic!("{}: {e}", target.display()));
}
