//! Embeds the migrations (../migrations/NNNN_description.sql) in the writer: writes
//! `$OUT_DIR/migrations.rs`, a list of (version, description, SQL) that `src/migrations.rs`
//! turns into sqlx's migrator. sqlx's own `migrate!` macro does the same at compile time, but
//! its proc-macro crate compiles a second copy of sqlx, tokio and url for the build host.

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    // Relative, so that cargo watches the migrations of the checkout being built: checkouts on
    // this machine share one target directory, and with it this script's last output.
    println!("cargo:rerun-if-changed=../migrations");
    // Read when the script runs, not when it compiles, for the same reason.
    let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|e| panic!("CARGO_MANIFEST_DIR: {e}"));
    let dir = Path::new(&manifest).join("../migrations");
    let mut migrations: Vec<(i64, String, String)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|entry| entry.ok())
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            // sqlx's naming: <version>_<description>.sql, underscores read as spaces.
            let (version, rest) = name.split_once('_')?;
            let description = rest.strip_suffix(".sql")?.replace('_', " ");
            let version = version.parse().unwrap_or_else(|e| panic!("{name}: version: {e}"));
            let sql = std::fs::read_to_string(entry.path()).unwrap_or_else(|e| panic!("{name}: {e}"));
            Some((version, description, sql))
        })
        .collect();
    migrations.sort();
    // The SQL as literals, not include_str! of paths: the output names no checkout.
    let mut out = String::from("pub const MIGRATIONS: &[(i64, &str, &str)] = &[\n");
    for (version, description, sql) in &migrations {
        let _ = writeln!(out, "    ({version}, {description:?}, {sql:?}),");
    }
    out.push_str("];\n");
    let target = Path::new(&std::env::var("OUT_DIR").unwrap_or_else(|e| panic!("OUT_DIR: {e}"))).join("migrations.rs");
    std::fs::write(&target, out).unwrap_or_else(|e| panic!("{}: {e}", target.display()));
}
