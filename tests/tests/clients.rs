//! The client libraries of clients/ against a real stack: each library's own test suite (pytest
//! for Python, node --test for TypeScript) runs as a subprocess with the stack's address and a
//! key of its own, the way a user would point the library at the service. deploy/test.sh installs
//! the tools and sets INTAKE_CLIENTS_PYTHON (a virtualenv's python with httpx, pytest and mypy; the
//! library is imported from this checkout) and INTAKE_CLIENTS_NODE. A tool that is missing fails
//! these tests: only deploy/test.sh's filter (INTAKE_CLIENTS=skip) leaves them out of a run, and
//! its summary says so.

use intake_tests::Stack;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn clients() -> PathBuf {
    intake_tests::repo().join("clients")
}

/// The tool's path from the environment; a test without its tool fails.
fn tool(variable: &str) -> String {
    let path = std::env::var(variable).unwrap_or_else(|_| {
        panic!("{variable} is not set: run deploy/test.sh, which installs the client libraries' tools")
    });
    assert!(Path::new(&path).exists(), "{variable}={path} does not exist: run deploy/test.sh");
    path
}

/// Runs the command to its end; its output is printed, and shown in the panic when it failed.
fn succeed(mut command: Command, what: &str) -> Output {
    let output = command.output().unwrap_or_else(|e| panic!("starting {what}: {e}"));
    let text = output_text(&output);
    assert!(output.status.success(), "{what} failed ({}):\n{text}", output.status);
    println!("{text}");
    output
}

fn output_text(output: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

/// A library's suite skips a test when a tool or the live service is missing (friendly to a
/// developer running it alone); here a skip is a failure: every test of it must have run.
fn nothing_skipped(output: &Output, what: &str) {
    let text = output_text(output);
    let skipped = skipped_count(&text);
    assert_eq!(skipped, 0, "{what} skipped {skipped} test(s):\n{text}");
}

/// The skipped tests a pytest ("3 passed, 1 skipped in 0.2s") or node --test ("# skipped 1",
/// "# todo 1") summary reports.
fn skipped_count(text: &str) -> u32 {
    let pytest: u32 = text
        .lines()
        .map(|line| {
            let words: Vec<&str> = line.split([' ', ',', '=']).filter(|w| !w.is_empty()).collect();
            words.windows(2).filter(|w| w[1] == "skipped").filter_map(|w| w[0].parse::<u32>().ok()).sum::<u32>()
        })
        .sum();
    let node = |word: &str| {
        text.lines()
            .filter_map(|line| line.trim().strip_prefix(word))
            .filter_map(|rest| rest.trim().parse::<u32>().ok())
            .sum::<u32>()
    };
    pytest + node("# skipped") + node("# todo")
}

fn live(command: &mut Command, stack: &Stack) {
    let key = stack.workspace();
    command
        .env("INTAKE_BASE_URL", format!("{}/v1", stack.base_url))
        .env("INTAKE_API_KEY", &key.secret)
        .env("INTAKE_CLIENTS_REQUIRE_LIVE", "1");
}

#[tokio::test]
async fn the_python_library_passes_its_tests_against_the_service() {
    let python = tool("INTAKE_CLIENTS_PYTHON");
    let stack = Stack::start().await;
    let dir = clients().join("python");
    let mut command = Command::new(python);
    command
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"])
        .current_dir(&dir)
        .env("PYTHONPATH", dir.join("src"))
        .env("PYTHONDONTWRITEBYTECODE", "1");
    live(&mut command, &stack);
    let output = succeed(command, "pytest of clients/python");
    nothing_skipped(&output, "pytest of clients/python");
}

#[tokio::test]
async fn the_typescript_library_passes_its_tests_against_the_service() {
    let node = tool("INTAKE_CLIENTS_NODE");
    let stack = Stack::start().await;
    let dir = clients().join("typescript");
    let tests: Vec<PathBuf> = std::fs::read_dir(dir.join("test"))
        .unwrap_or_else(|e| panic!("{e}"))
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.to_string_lossy().ends_with(".test.mjs"))
        .collect();
    assert!(tests.len() >= 5, "{tests:?}");
    let mut command = Command::new(node);
    command.arg("--test").args(&tests).current_dir(&dir);
    live(&mut command, &stack);
    let output = succeed(command, "node --test of clients/typescript");
    nothing_skipped(&output, "node --test of clients/typescript");
}

/// `npm install ./clients/typescript` takes the committed dist/ as it is: it must be what src/
/// compiles to.
#[test]
fn the_typescript_dist_is_compiled_from_its_sources() {
    let node = tool("INTAKE_CLIENTS_NODE");
    let dir = clients().join("typescript");
    let tsc = dir.join("node_modules/typescript/bin/tsc");
    assert!(tsc.exists(), "{} is missing: run deploy/test.sh (npm ci in clients/typescript)", tsc.display());
    let out = std::env::temp_dir().join(format!("intake-clients-dist-{}", ulid::Ulid::new()));
    let mut command = Command::new(node);
    command.arg(&tsc).args(["-p", "tsconfig.json", "--outDir"]).arg(&out).current_dir(&dir);
    succeed(command, "tsc");
    let files = |root: &Path| -> Vec<(String, Vec<u8>)> {
        let mut files: Vec<_> = std::fs::read_dir(root)
            .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
            .filter_map(|entry| entry.ok())
            .map(|entry| {
                let bytes = std::fs::read(entry.path()).unwrap_or_default();
                (entry.file_name().to_string_lossy().into_owned(), bytes)
            })
            .collect();
        files.sort();
        files
    };
    let (built, committed) = (files(&out), files(&dir.join("dist")));
    let _ = std::fs::remove_dir_all(&out);
    let names = |files: &[(String, Vec<u8>)]| files.iter().map(|(name, _)| name.clone()).collect::<Vec<_>>();
    assert_eq!(names(&built), names(&committed), "dist/ has other files than src/ compiles to: npm run build");
    for ((name, built), (_, committed)) in built.iter().zip(&committed) {
        assert!(built == committed, "dist/{name} is not what src/ compiles to: npm run build, and commit dist/");
    }
}

#[test]
fn a_skip_in_either_summary_is_counted() {
    assert_eq!(skipped_count("12 passed, 1 skipped in 0.52s"), 1);
    assert_eq!(skipped_count("12 passed in 0.52s"), 0);
    assert_eq!(skipped_count("==== 10 passed, 2 skipped, 1 warning in 1.1s ===="), 2);
    assert_eq!(skipped_count("# tests 9\n# pass 7\n# skipped 2\n# todo 0\n"), 2);
    assert_eq!(skipped_count("# tests 9\n# pass 9\n# skipped 0\n# todo 1\n"), 1);
}
