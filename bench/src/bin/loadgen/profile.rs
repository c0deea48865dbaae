//! A CPU profile of the run's processes (gateway, writer, PostgreSQL, Kafka, Redis, the load
//! generator) while a scenario runs again (not during the measured run: sampling costs CPU).
//! `perf record` with the software clock event (this sandbox has no hardware counters) and
//! DWARF call graphs (release builds have no frame pointers); the stacks are folded by
//! `inferno-collapse-perf`, each process renamed by its role in the stack,
//! drawn by `inferno-flamegraph`, and the hottest functions of each role listed in a text
//! summary. Skipped, with the reason in the report, when perf or inferno is missing.

use intake_tests::serde_json::{self, json, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Why a profile cannot be taken here, if it cannot.
pub fn unavailable() -> Option<String> {
    let probe = std::env::temp_dir().join(format!("intake-perf-probe-{}", std::process::id()));
    let works = Command::new("perf")
        .args(["record", "-q", "-e", "cpu-clock", "-p", &std::process::id().to_string(), "-o"])
        .arg(&probe)
        .args(["--", "sleep", "0.1"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let _ = std::fs::remove_file(&probe);
    if !works {
        return Some(
            "perf record -e cpu-clock does not work here (install linux-perf; kernel.perf_event_paranoid)".into(),
        );
    }
    for tool in ["inferno-collapse-perf", "inferno-flamegraph"] {
        if Command::new(tool).arg("--help").stdout(Stdio::null()).stderr(Stdio::null()).status().is_err() {
            return Some(format!("{tool} is not on PATH (cargo install inferno)"));
        }
    }
    None
}

/// Starts sampling the given processes (all their threads) for `duration`; wait on the child
/// to finish. Only this run's processes: unwinding other programs' stacks (a compiler's, on a
/// shared machine) makes `perf script` take many minutes, and /proc already says what they used.
pub fn record(data: &Path, pids: &[u32], duration: Duration) -> std::io::Result<std::process::Child> {
    let pids = pids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    Command::new("perf")
        .args(["record", "-q", "-e", "cpu-clock", "-F", "97", "--call-graph", "dwarf,16384", "-p", &pids, "-o"])
        .arg(data)
        .args(["--", "sleep", &duration.as_secs().to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
}

/// Folds the samples, names each process by its role (`roles`: pid to name; everything else is
/// "other processes", counted but not drawn), writes `<name>.svg` and `<name>.txt` into `out`,
/// and returns the share of samples per role with its hottest functions (self time) and, for
/// the gateway and writer, their own functions by inclusive time.
pub fn summarize(
    data: &Path,
    roles: &HashMap<u32, &'static str>,
    out: &Path,
    name: &str,
    title: &str,
) -> anyhow::Result<Value> {
    let script = Command::new("perf")
        .args(["script", "-F", "comm,pid,tid,time,event,ip,sym,dso", "-i"])
        .arg(data)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let folded = Command::new("inferno-collapse-perf")
        .args(["--pid", "--quiet"])
        .stdin(script.stdout.ok_or_else(|| anyhow::anyhow!("perf script: no output"))?)
        .output()?;
    anyhow::ensure!(folded.status.success(), "inferno-collapse-perf failed");
    let text = String::from_utf8_lossy(&folded.stdout);

    // "comm-PID;frame;...;leaf COUNT" -> "role;comm;frame;...;leaf COUNT"
    let mut renamed = String::new();
    let mut by_role: BTreeMap<&str, u64> = BTreeMap::new();
    let mut leaves: BTreeMap<&str, HashMap<String, u64>> = BTreeMap::new();
    let mut inclusive: BTreeMap<&str, HashMap<String, u64>> = BTreeMap::new();
    let mut total = 0u64;
    for line in text.lines() {
        let Some((stack, count)) = line.rsplit_once(' ') else { continue };
        let Ok(count) = count.parse::<u64>() else { continue };
        let (process, frames) = stack.split_once(';').unwrap_or((stack, ""));
        let (comm, pid) = process.rsplit_once('-').unwrap_or((process, ""));
        let role = pid.parse().ok().and_then(|pid: u32| roles.get(&pid).copied()).unwrap_or("other processes");
        total += count;
        *by_role.entry(role).or_default() += count;
        let leaf = frames.rsplit(';').next().filter(|f| !f.is_empty()).unwrap_or("[unknown]");
        *leaves.entry(role).or_default().entry(leaf.to_owned()).or_default() += count;
        // Our own functions, inclusive: where in the gateway's or writer's code the time goes.
        let mut own: Vec<&str> = frames
            .split(';')
            .filter(|f| f.starts_with("intake_"))
            .map(|f| f.split("::{{closure}}").next().unwrap_or(f))
            .collect();
        own.sort_unstable();
        own.dedup();
        for function in own {
            *inclusive.entry(role).or_default().entry(function.to_owned()).or_default() += count;
        }
        // Not drawn: the machine's other work (it is in the summary's shares).
        if role != "other processes" {
            renamed.push_str(&format!("{role};{comm};{frames} {count}\n"));
        }
    }
    anyhow::ensure!(total > 0, "no samples");

    let svg = std::fs::File::create(out.join(format!("{name}.svg")))?;
    let mut flamegraph = Command::new("inferno-flamegraph")
        .args(["--title", title, "--minwidth", "0.5", "--width", "1600"])
        .stdin(Stdio::piped())
        .stdout(svg)
        .spawn()?;
    if let Some(mut stdin) = flamegraph.stdin.take() {
        use std::io::Write;
        stdin.write_all(renamed.as_bytes())?;
    }
    flamegraph.wait()?;

    let share = |n: u64| (n as f64 / total as f64 * 1000.0).round() / 10.0;
    // Within a role, shares of the role's own samples: readable even when the machine is shared.
    let share_of = |n: u64, of: u64| (n as f64 / of.max(1) as f64 * 1000.0).round() / 10.0;
    let mut summary =
        format!("{title}\n{total} samples of this run's processes at 97 Hz (perf record -e cpu-clock -p ...)\n\n");
    let mut roles_json = serde_json::Map::new();
    let mut ordered: Vec<(&str, u64)> = by_role.iter().map(|(r, n)| (*r, *n)).collect();
    ordered.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    for (role, samples) in &ordered {
        summary.push_str(&format!(
            "{role}: {}% of all samples; hottest functions, self time, % of the role's samples:\n",
            share(*samples)
        ));
        let mut hot: Vec<(&String, &u64)> = leaves[role].iter().collect();
        hot.sort_by(|a, b| b.1.cmp(a.1));
        let top: Vec<Value> = hot
            .iter()
            .take(12)
            .map(|(f, n)| json!({ "function": f, "percent_of_role": share_of(**n, *samples) }))
            .collect();
        for (function, n) in hot.iter().take(12) {
            summary.push_str(&format!("  {:5.1}%  {function}\n", share_of(**n, *samples)));
        }
        let mut own: Vec<(&String, &u64)> = inclusive.get(role).map(|m| m.iter().collect()).unwrap_or_default();
        own.sort_by(|a, b| b.1.cmp(a.1));
        if !own.is_empty() {
            summary
                .push_str("  our functions, inclusive (time in them and what they call), % of the role's samples:\n");
        }
        for (function, n) in own.iter().take(15) {
            summary.push_str(&format!("  {:5.1}%  {function}\n", share_of(**n, *samples)));
        }
        let own: Vec<Value> = own
            .iter()
            .take(15)
            .map(|(f, n)| json!({ "function": f, "percent_of_role": share_of(**n, *samples) }))
            .collect();
        summary.push('\n');
        roles_json.insert(
            (*role).to_owned(),
            json!({ "percent_of_samples": share(*samples), "hottest": top, "own_code_inclusive": own }),
        );
    }
    std::fs::write(out.join(format!("{name}.txt")), summary)?;
    Ok(
        json!({ "samples": total, "flamegraph": format!("bench/profile/{name}.svg"), "summary": format!("bench/profile/{name}.txt"), "by_role": roles_json }),
    )
}
