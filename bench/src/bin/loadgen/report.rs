//! report.json (the keys its readers check, then the context a reader needs to trust them) and
//! report.md (a table per scenario, the targets, and for each missed target the stage that
//! bounds it, from the CPU each process used and the writer's own timers, and for a latency
//! target the stage its requests' time went to, from each answered write's `Server-Timing`).

use crate::measure::{round1, round2, Counted, Recorder};
use crate::timing::{Band, Slow, Tally};
use crate::{Config, Scenario};
use intake_tests::serde_json::{self, json, Value};
use std::fmt::Write;

pub struct Run<'a> {
    pub config: &'a Config,
    pub started_at: String,
    pub machine: Value,
    pub versions: Value,
    pub commit: String,
    pub dirty: bool,
    pub scenarios: Vec<(&'static str, Scenario)>,
    pub gateway_peak_rss_mib: f64,
    pub writer_peak_rss_mib: f64,
    pub scale: Vec<Value>,
    /// batch_ingest with 1, 2, 4 writers / gateways under a CPU quota each (quota.rs).
    pub scale_writers: Value,
    pub scale_gateways: Value,
    pub profiles: Value,
    /// Per size of the runs at size: the load, the erasure, bytes per stored conversion, WAL per
    /// item, and what the capped scenarios read and held (sized.rs).
    pub sized: Vec<Value>,
    /// The cluster of the runs at size, when they had one of their own (capped.rs).
    pub sized_cluster: Value,
    /// The HA layout the `_ha` scenarios ran on (ha.rs); null when they did not run.
    pub ha: Value,
}

fn describe(name: &str, config: &Config) -> String {
    match name {
        "batch_ingest" => format!(
            "POST /v1/conversions/batch, 500 new conversions a batch (every identifier, a parent link in one item of three), over {} workspaces (one key each)",
            config.workspaces
        ),
        "batch_resend" => "the batches of batch_ingest sent again, byte for byte: every item `unchanged`".into(),
        "single_32" => "POST /v1/conversions, one new conversion a request (every identifier), client c to workspace c".into(),
        "single_200rps" => "POST /v1/conversions at a fixed rate, open loop: each latency runs from the time its request was due".into(),
        "reject_401" => "POST /v1/conversions with an unknown key".into(),
        "reject_422" => "POST /v1/conversions with an invalid body (bad event), valid key".into(),
        "workspace_read" => "GET /v1/workspace".into(),
        "direct_apply" => "baseline: the writer's apply code (store::apply_chunks via `bench-apply`) on batch_ingest's batches, validated and hashed beforehand, 5 chunks of 100; no HTTP, no Kafka".into(),
        "pg_upsert" => "baseline: pgbench, INSERT … ON CONFLICT of generated rows into a copy of `conversions` (same columns and indexes, no foreign keys)".into(),
        "pg_upsert_v1" => "fixed yardstick: pg_upsert into a table of the shape `conversions` had before its indexes were made lean (nine indexes, identifiers and digests as text after the workspace id)".into(),
        on_async if on_async.ends_with("_ha_async") => format!(
            "{}; on the HA layout with asynchronous replication: {}, each commit waiting for its disk alone",
            describe(on_async.strip_suffix("_ha_async").unwrap_or(on_async), config),
            crate::ha::writers_path()
        ),
        on_ha if on_ha.ends_with("_ha") => format!(
            "{}; on the HA layout: {}, each commit waiting for the synchronous standby",
            describe(on_ha.strip_suffix("_ha").unwrap_or(on_ha), config),
            crate::ha::writers_path()
        ),
        sized => describe_sized(sized, config),
    }
}

/// An instant as RFC 3339 in UTC, to the millisecond (as the logs of the other processes are).
fn utc(at: std::time::SystemTime) -> String {
    let at = time::OffsetDateTime::from(at);
    let at = at.replace_nanosecond(at.millisecond() as u32 * 1_000_000).unwrap_or(at);
    at.format(&time::format_description::well_known::Rfc3339).unwrap_or_default()
}

/// The runs at size (`batch_ingest_10m`, ...): their scenario at that size.
fn describe_sized(name: &str, config: &Config) -> String {
    let (name, capped) = match name.strip_suffix("_capped") {
        Some(name) => {
            (name, format!(", PostgreSQL capped at {} MiB of memory, page cache included", config.memory_mib))
        }
        None => (name, String::new()),
    };
    let Some((scenario, size)) = name.rsplit_once('_') else { return String::new() };
    let at = format!("on the database preloaded to {size} stored conversions{capped}");
    match scenario {
        "pg_upsert" => format!(
            "baseline: pgbench, INSERT … ON CONFLICT of generated rows into the preloaded `conversions` itself, on {} workspaces of its own, {at}",
            crate::sized::UPSERT_WORKSPACES
        ),
        "pg_upsert_v1" => format!(
            "fixed yardstick: pg_upsert into the preloaded table of the old shape (`{}`, the same rows as `conversions`), {at}",
            crate::baselines::V1_TABLE
        ),
        "batch_ingest" => format!(
            "POST /v1/conversions/batch, 500 new conversions a batch, {at}: to its {} workspaces in proportion to their size, the largest included",
            crate::sized::WORKSPACES
        ),
        "single_200rps" | "direct_apply" => format!("{}; {at}", describe(scenario, config)),
        _ => String::new(),
    }
}

#[derive(Clone)]
struct Target {
    name: &'static str,
    measured: f64,
    limit: f64,
    at_least: bool,
    unit: &'static str,
    /// The scenario whose stages explain a miss.
    scenario: &'static str,
    /// The quantile a latency target is of: its miss is placed in the stages of the
    /// requests about it (timing.rs).
    quantile: Option<f64>,
}

impl Target {
    fn met(&self) -> bool {
        if self.at_least {
            self.measured >= self.limit
        } else {
            self.measured < self.limit
        }
    }
}

fn field(value: &Value, key: &str) -> f64 {
    value.get(key).and_then(Value::as_f64).unwrap_or(0.0)
}

/// What the numbers say bounds a scenario: whether the machine's CPU is saturated and by which
/// of the run's processes, how much went to processes not of this run, and (on the Kafka path)
/// how busy the writers' apply loops were.
fn bound_by(scenario: &Scenario, cores_total: f64) -> String {
    let cores = &scenario.cores;
    let (busy, other, stolen) =
        (field(cores, "machine busy"), field(cores, "other processes"), field(cores, "stolen by the host"));
    let mut ours: Vec<(String, f64)> = cores
        .as_object()
        .map(|o| {
            o.iter()
                .filter(|(k, _)| !["machine busy", "other processes", "stolen by the host"].contains(&k.as_str()))
                .map(|(k, v)| (k.clone(), v.as_f64().unwrap_or(0.0)))
                .collect()
        })
        .unwrap_or_default();
    ours.sort_by(|a, b| b.1.total_cmp(&a.1));
    let list = ours.iter().map(|(k, v)| format!("{k} {v:.2}")).collect::<Vec<_>>().join(", ");
    let lanes_busy = scenario.writer.as_ref().map(|w| field(w, "apply_lanes_busy_per_writer"));
    let top = ours.first().map(|(k, _)| k.as_str()).unwrap_or("?");
    let mut text = if busy >= 0.9 * cores_total {
        format!(
            "CPU-bound: {busy:.2} of {cores_total} cores busy; of this run's processes {top} uses the most ({list})"
        )
    } else if lanes_busy.is_some_and(|b| b >= 0.8 * writer_lanes() as f64) {
        format!("bound by the writer's apply lanes (each applies one group at a time, waiting on PostgreSQL); cores busy {busy:.2} of {cores_total} ({list})")
    } else {
        format!("neither the CPU ({busy:.2} of {cores_total} cores busy: {list}) nor the writer's apply lanes are saturated: bound by waiting (round trips between the stages)")
    };
    if let Some(writer) = &scenario.writer {
        let _ = write!(text, "; {}", stages_text(writer));
    }
    if other >= 0.25 {
        let _ = write!(
            text,
            ". {other:.2} cores went to processes not of this run: the machine was shared, re-run it quiet"
        );
    }
    if stolen >= 0.1 {
        let _ = write!(text, ". The host took {stolen:.2} cores from this virtual machine (steal time)");
    }
    text
}

/// A band of a scenario's answered writes by latency: its bounds in ms and its requests' means
/// (timing.rs).
struct Banded {
    from_ms: f64,
    to_ms: f64,
    band: Band,
}

impl Banded {
    /// The requests whose latency lies from quantile `from` to quantile `to` of the scenario's.
    fn of(recorder: &Recorder, from: f64, to: f64) -> Banded {
        let at = |q: f64| recorder.latency.value_at_quantile(q);
        let (from_us, to_us) = (at(from), if to >= 1.0 { recorder.latency.max() } else { at(to) });
        let us = std::time::Duration::from_micros;
        #[allow(clippy::cast_precision_loss)]
        let ms = |us: u64| us as f64 / 1000.0;
        Banded { from_ms: ms(from_us), to_ms: ms(to_us), band: recorder.stages.band(us(from_us), us(to_us)) }
    }

    fn to_json(&self, tally: &Tally) -> Value {
        let b = &self.band;
        let mean: serde_json::Map<String, Value> =
            tally.named().map(|(i, name)| (name.to_owned(), json!(round2(b.stages.ms[i])))).collect();
        json!({
            "from_ms": round2(self.from_ms),
            "to_ms": round2(self.to_ms),
            "requests": b.requests,
            "latency_ms": round2(b.latency_ms),
            "mean_ms": mean,
            "dominant": b.dominant().map(|(stage, ms, share)| json!({ "stage": stage, "ms": round2(ms), "share": round2(share) })),
        })
    }

    /// "(60 requests of 40.10–74.00 ms, mean 52.3 ms) 31.2 ms in apply (70 %), 6.1 in fetch (14 %), …"
    fn in_words(&self) -> String {
        format!(
            "({} requests of {:.2}–{:.2} ms, mean {:.1} ms) {}",
            self.band.requests,
            self.from_ms,
            self.to_ms,
            self.band.latency_ms,
            self.band.in_words(4)
        )
    }
}

/// The slowest 1 % of a scenario's answered writes, from its p99 up.
fn slowest_percent(recorder: &Recorder) -> Banded {
    Banded::of(recorder, 0.99, 1.0)
}

/// The median's band, p45 to p55: what a request that is not slow spends, beside the slowest.
fn median_band(recorder: &Recorder) -> Banded {
    Banded::of(recorder, 0.45, 0.55)
}

/// report.json's `stages` of a scenario: where the time of its slowest 1 % and of its median's
/// band went, and its slowest requests whole, with their ids to find them in the services'
/// logs; none when no answer carried `Server-Timing` (reads, refusals, the baselines).
fn stages_json(recorder: &Recorder) -> Option<Value> {
    let tally = &recorder.stages;
    let timed = tally.requests();
    if timed == 0 {
        return None;
    }
    let slow = |s: &Slow| {
        json!({
            "ms": round2(s.latency.as_secs_f64() * 1000.0),
            "started_at": utc(s.started),
            "request_id": s.request_id,
            "server_timing": s.server_timing,
            "client_ms": round2(s.stages.ms[crate::timing::CLIENT]),
            "most_in": s.stages.largest().map(|(stage, _)| stage),
        })
    };
    Some(json!({
        "timed_requests": timed,
        "slowest_1_percent": slowest_percent(recorder).to_json(tally),
        "median_band": median_band(recorder).to_json(tally),
        "slowest": tally.slowest.iter().map(slow).collect::<Vec<_>>(),
    }))
}

/// report.md's table of where the slowest 1 % and the median's band went.
fn stages_table(md: &mut String, recorder: &Recorder) {
    let tally = &recorder.stages;
    if tally.requests() == 0 {
        return;
    }
    let named: Vec<(usize, &str)> = tally.named().collect();
    let _ = writeln!(
        md,
        "Where the slowest 1 % went, from each answered write's `Server-Timing` (mean ms a request; `rest`: the gateway's time no stage covers, `client`: the latency seen here beyond the gateway's total):\n"
    );
    let names = named.iter().map(|(_, name)| *name).collect::<Vec<_>>().join(" | ");
    let _ =
        writeln!(md, "| requests | n | latency | {names} | most in |\n|---|---|---|{}---|", "---|".repeat(named.len()));
    for (label, banded) in [("slowest 1 %", slowest_percent(recorder)), ("median band, p45–p55", median_band(recorder))]
    {
        let b = &banded.band;
        let each = named.iter().map(|(i, _)| format!("{:.2}", b.stages.ms[*i])).collect::<Vec<_>>().join(" | ");
        let most = b.dominant().map_or(String::new(), |(stage, _, share)| format!("{stage} ({:.0} %)", share * 100.0));
        let _ = writeln!(
            md,
            "| {label} ({:.2}–{:.2} ms) | {} | {:.2} | {each} | {most} |",
            banded.from_ms, banded.to_ms, b.requests, b.latency_ms
        );
    }
    let _ = writeln!(md);
}

/// A missed latency target placed in the stages: for a tail quantile, where the time of the
/// requests at or above it went (the slowest 1 % for a p99), with the median's band beside it;
/// for a p50, where the median's band's went. None for a target of no quantile or a scenario
/// without `Server-Timing`.
fn placed(target: &Target, scenario: &Scenario) -> Option<String> {
    let quantile = target.quantile?;
    let recorder = &scenario.measured.recorder;
    if recorder.stages.requests() == 0 {
        return None;
    }
    let missed = format!(
        "p{:.0} {}{} {} {}{}",
        quantile * 100.0,
        target.measured,
        target.unit,
        if target.at_least { "<" } else { "≥" },
        target.limit,
        target.unit
    );
    let median = format!("at the median {}", median_band(recorder).in_words());
    Some(if quantile >= 0.9 {
        let tail = Banded::of(recorder, quantile, 1.0);
        format!("{missed}: of the slowest {:.0} % {}; {median}", (1.0 - quantile) * 100.0, tail.in_words())
    } else {
        format!("{missed}: {median}")
    })
}

pub fn render(run: &Run) -> (Value, String) {
    let config = run.config;
    let cores_total = run.machine["cores"].as_f64().unwrap_or(1.0);
    let get = |name: &str| run.scenarios.iter().find(|(n, _)| *n == name).map(|(_, s)| s);
    let rate = |name: &str| get(name).map(|s| s.measured.rate(s.counted)).unwrap_or(0.0);
    let quantile = |name: &str, q: f64| {
        get(name).map(|s| s.measured.recorder.latency.value_at_quantile(q) as f64 / 1000.0).unwrap_or(0.0)
    };
    let ratio = |a: f64, b: f64| if b > 0.0 { round2(a / b) } else { 0.0 };
    let ran = |name: &str| get(name).is_some();
    let (ingest, direct, pg) = (rate("batch_ingest"), rate("direct_apply"), rate("pg_upsert"));
    let mut ratios = serde_json::Map::new();
    for (a, b) in [
        ("batch_ingest", "pg_upsert"),
        ("batch_ingest", "pg_upsert_v1"),
        ("batch_ingest", "direct_apply"),
        ("direct_apply", "pg_upsert"),
    ] {
        if ran(a) && ran(b) {
            ratios.insert(format!("{a} / {b}"), json!(ratio(rate(a), rate(b))));
        }
    }
    let ratios = Value::Object(ratios);
    // The reject paths' goal, measured by a client that is not their bottleneck (wrk).
    const REJECT_GOAL: f64 = 50_000.0;
    let targets = [
        Target {
            name: "batch_ingest / pg_upsert",
            measured: ratio(ingest, pg),
            limit: 0.5,
            at_least: true,
            unit: "",
            scenario: "batch_ingest",
            quantile: None,
        },
        Target {
            name: "batch_ingest / direct_apply",
            measured: ratio(ingest, direct),
            limit: 0.7,
            at_least: true,
            unit: "",
            scenario: "batch_ingest",
            quantile: None,
        },
        Target {
            name: "single_200rps p50",
            measured: round2(quantile("single_200rps", 0.5)),
            limit: 5.0,
            at_least: false,
            unit: " ms",
            scenario: "single_200rps",
            quantile: Some(0.5),
        },
        Target {
            name: "single_200rps p99",
            measured: round2(quantile("single_200rps", 0.99)),
            limit: 20.0,
            at_least: false,
            unit: " ms",
            scenario: "single_200rps",
            quantile: Some(0.99),
        },
        Target {
            name: "reject_401 requests/s",
            measured: round1(rate("reject_401")),
            limit: REJECT_GOAL,
            at_least: true,
            unit: "",
            scenario: "reject_401",
            quantile: None,
        },
        Target {
            name: "reject_422 requests/s",
            measured: round1(rate("reject_422")),
            limit: REJECT_GOAL,
            at_least: true,
            unit: "",
            scenario: "reject_422",
            quantile: None,
        },
        Target {
            name: "gateway peak RSS",
            measured: run.gateway_peak_rss_mib,
            limit: 200.0,
            at_least: false,
            unit: " MiB",
            scenario: "batch_ingest",
            quantile: None,
        },
    ];
    let mut targets = targets.to_vec();
    let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
    let single_p99 = |scenario: String, limit: f64| Target {
        name: leak(format!("{scenario} p99")),
        measured: round2(quantile(&scenario, 0.99)),
        limit,
        at_least: false,
        unit: " ms",
        scenario: leak(scenario),
        quantile: Some(0.99),
    };
    // The single sends' tail at every size, as on empty tables.
    for size in &run.sized {
        targets.push(single_p99(format!("single_200rps_{}", size["label"].as_str().unwrap_or("")), 20.0));
    }
    // At the largest size: the targets of the runs at size.
    if let Some(largest) = run.sized.last() {
        let label = largest["label"].as_str().unwrap_or("").to_owned();
        let (ingest_l, pg_l) = (rate(&format!("batch_ingest_{label}")), rate(&format!("pg_upsert_{label}")));
        targets.push(Target {
            name: leak(format!("batch_ingest_{label} / pg_upsert_{label}")),
            measured: ratio(ingest_l, pg_l),
            limit: 0.8,
            at_least: true,
            unit: "",
            scenario: leak(format!("batch_ingest_{label}")),
            quantile: None,
        });
        targets.push(Target {
            name: leak(format!("batch_ingest_{label} / batch_ingest")),
            measured: ratio(ingest_l, ingest),
            limit: 0.7,
            at_least: true,
            unit: "",
            scenario: leak(format!("batch_ingest_{label}")),
            quantile: None,
        });
        targets.push(Target {
            name: leak(format!("erase_{label} lock held")),
            measured: field(&largest["erase"], "lock_held_ms"),
            limit: 1000.0,
            at_least: false,
            unit: " ms",
            scenario: leak(format!("batch_ingest_{label}")),
            quantile: None,
        });
        // Index bytes per stored conversion against the old shape's, loaded with the same rows.
        let (lean, old) = (
            largest["bytes_per_conversion"]["index_bytes"].as_f64().unwrap_or(0.0),
            largest["bytes_per_conversion_v1"]["index_bytes"].as_f64().unwrap_or(0.0),
        );
        if old > 0.0 {
            targets.push(Target {
                name: leak(format!("index bytes per conversion at {label}, below the old shape's")),
                measured: round2(1.0 - lean / old),
                limit: 0.35,
                at_least: true,
                unit: "",
                scenario: leak(format!("batch_ingest_{label}")),
                quantile: None,
            });
        }
        if get(&format!("batch_ingest_{label}_capped")).is_some() {
            targets.push(Target {
                name: leak(format!("batch_ingest_{label}_capped / batch_ingest_{label}")),
                measured: ratio(rate(&format!("batch_ingest_{label}_capped")), ingest_l),
                limit: 0.8,
                at_least: true,
                unit: "",
                scenario: leak(format!("batch_ingest_{label}_capped")),
                quantile: None,
            });
            targets.push(single_p99(format!("single_200rps_{label}_capped"), 25.0));
        }
    }
    // A run of some of the scenarios (INTAKE_BENCH_SCENARIOS) has the targets of those alone.
    targets.retain(|t| ran(t.scenario) && (!t.name.contains(" / ") || t.name.split(" / ").all(ran)));
    let targets_json: Vec<Value> = targets
        .iter()
        .map(|t| {
            let mut value = json!({ "target": t.name, "measured": t.measured, "limit": t.limit, "at_least": t.at_least, "met": t.met() });
            if !t.met() {
                if let Some(scenario) = get(t.scenario) {
                    let bound = bound_by(scenario, cores_total);
                    value["bound_by"] = json!(match placed(t, scenario) {
                        Some(placed) => format!("{placed}. Over the whole run: {bound}"),
                        None => bound,
                    });
                }
            }
            value
        })
        .collect();

    let mut report = serde_json::Map::new();
    let mut details = serde_json::Map::new();
    for (name, scenario) in &run.scenarios {
        report.insert((*name).to_owned(), scenario.measured.to_json(scenario.counted));
        let recorder = &scenario.measured.recorder;
        details.insert(
            (*name).to_owned(),
            json!({
                "what": describe(name, config),
                "concurrency": scenario.measured.concurrency,
                "seconds": round2(scenario.measured.elapsed.as_secs_f64()),
                "requests": recorder.requests,
                "items": recorder.items,
                "first_error": recorder.first_error,
                "slowest_started_at": recorder.slowest_started.map(utc),
                "slow_requests": recorder.slow.iter().map(|(at, took)| json!([utc(*at), round2(took.as_secs_f64() * 1000.0)])).collect::<Vec<_>>(),
                "cores": scenario.cores,
                "writer_stage": scenario.writer,
                "stages": stages_json(recorder),
            }),
        );
    }
    let mut ratios = ratios;
    for row in &run.sized {
        let label = row["label"].as_str().unwrap_or("");
        let ingest_l = rate(&format!("batch_ingest_{label}"));
        ratios[format!("batch_ingest_{label} / pg_upsert_{label}")] =
            json!(ratio(ingest_l, rate(&format!("pg_upsert_{label}"))));
        ratios[format!("batch_ingest_{label} / batch_ingest")] = json!(ratio(ingest_l, ingest));
        ratios[format!("batch_ingest_{label} / direct_apply_{label}")] =
            json!(ratio(ingest_l, rate(&format!("direct_apply_{label}"))));
        ratios[format!("batch_ingest_{label} / pg_upsert_v1_{label}")] =
            json!(ratio(ingest_l, rate(&format!("pg_upsert_v1_{label}"))));
        report.insert(format!("erase_{label}"), row["erase"].clone());
    }
    for row in run.sized.iter().filter(|row| !row["capped"].is_null()) {
        let label = row["label"].as_str().unwrap_or("");
        let capped = |scenario: &str| rate(&format!("{scenario}_{label}_capped"));
        ratios[format!("batch_ingest_{label}_capped / pg_upsert_{label}_capped")] =
            json!(ratio(capped("batch_ingest"), capped("pg_upsert")));
        ratios[format!("batch_ingest_{label}_capped / batch_ingest_{label}")] =
            json!(ratio(capped("batch_ingest"), rate(&format!("batch_ingest_{label}"))));
        ratios[format!("batch_ingest_{label}_capped / pg_upsert_v1_{label}_capped")] =
            json!(ratio(capped("batch_ingest"), capped("pg_upsert_v1")));
    }
    report.insert("sized".into(), json!(run.sized));
    report.insert("sized_cluster".into(), run.sized_cluster.clone());
    report.insert("ratios".into(), ratios.clone());
    report.insert("gateway_peak_rss_mib".into(), json!(run.gateway_peak_rss_mib));
    report.insert("writer_peak_rss_mib".into(), json!(run.writer_peak_rss_mib));
    report.insert("targets".into(), json!(targets_json));
    report.insert("machine".into(), run.machine.clone());
    report.insert("versions".into(), run.versions.clone());
    report.insert("git_commit".into(), json!(run.commit));
    report.insert("git_dirty".into(), json!(run.dirty));
    report.insert("started_at".into(), json!(run.started_at));
    report.insert("config".into(), serde_json::to_value(config).unwrap_or_default());
    report.insert("scenario_details".into(), Value::Object(details));
    report.insert("scale".into(), json!(run.scale));
    report.insert("scale_writers".into(), run.scale_writers.clone());
    report.insert("scale_gateways".into(), run.scale_gateways.clone());
    report.insert("profile".into(), run.profiles.clone());
    if !run.ha.is_null() {
        report.insert("ha_replication".into(), json!({ "layout": run.ha, "comparison": ha_comparison(run) }));
    }
    let report = Value::Object(report);
    (report.clone(), markdown(run, &report, &targets))
}

fn markdown(run: &Run, report: &Value, targets: &[Target]) -> String {
    let config = run.config;
    let m = &run.machine;
    let v = &run.versions;
    let mut md = String::new();
    let _ = writeln!(md, "# Benchmark report\n");
    let _ = writeln!(
        md,
        "`deploy/bench.sh`, started {} UTC, commit `{}`{}; {} s a scenario; {} gateway(s), {} writer(s), release build.\n",
        run.started_at,
        run.commit,
        if run.dirty { " with uncommitted changes" } else { "" },
        config.seconds,
        config.gateways,
        config.writers
    );
    let _ = writeln!(
        md,
        "{}. Everything runs on it: PostgreSQL, Redis, Kafka, the gateway, the writer and the load generator.\n",
        machine_line(m)
    );
    let _ = writeln!(
        md,
        "Versions: Apache Kafka {}, PostgreSQL {} (fsync {}), Redis {}, {}.\n",
        v["kafka"].as_str().unwrap_or(""),
        v["postgresql"].as_str().unwrap_or(""),
        v["postgresql_fsync"].as_str().unwrap_or(""),
        v["redis"].as_str().unwrap_or(""),
        v["rustc"].as_str().unwrap_or("")
    );
    let _ = writeln!(
        md,
        "CPU columns are cores used over the middle of each scenario (from /proc); \"load generator\" counts the clients it runs (wrk, pgbench), \"other processes\" the load on the machine that is not this run's (a shared machine shows it there). Before the run, {} of {} cores were busy.\n",
        m["busy_cores_before_run"], m["cores"]
    );

    let _ = writeln!(md, "## Targets\n\n| target | measured | limit | met |\n|---|---|---|---|");
    for t in targets {
        let _ = writeln!(
            md,
            "| {} | {}{} | {} {}{} | {} |",
            t.name,
            t.measured,
            t.unit,
            if t.at_least { "≥" } else { "<" },
            t.limit,
            t.unit,
            if t.met() { "yes" } else { "**no**" }
        );
    }
    if let Some(ratios) = report["ratios"].as_object().filter(|r| !r.is_empty()) {
        let _ = writeln!(md, "\n| ratio | value |\n|---|---|");
        for (k, value) in ratios {
            let _ = writeln!(md, "| {k} | {value} |");
        }
    }
    let _ = writeln!(
        md,
        "\nPeak resident memory during batch_ingest: gateway {} MiB, writer {} MiB.\n",
        run.gateway_peak_rss_mib, run.writer_peak_rss_mib
    );
    let missed: Vec<&Value> = report["targets"]
        .as_array()
        .map(|t| t.iter().filter(|t| t["met"] == json!(false)).collect())
        .unwrap_or_default();
    if !missed.is_empty() {
        let _ = writeln!(md, "### What bounds the missed targets\n");
        for t in missed {
            let _ = writeln!(
                md,
                "- **{}**: {}",
                t["target"].as_str().unwrap_or(""),
                t["bound_by"].as_str().unwrap_or("no data")
            );
        }
        let _ = writeln!(md);
    }

    if !run.ha.is_null() {
        ha_section(&mut md, run);
    }

    if !run.sized.is_empty() {
        let _ = writeln!(md, "## At size\n");
        let _ = writeln!(
            md,
            "A database of its own preloaded (COPY, indexes built after) to each size: 1,000 workspaces of Zipf-distributed sizes, one conversion in three with a parent (a purchase in the chain of the lead before it), one visit per conversion; identifiers stored: visitor id and email digest on every conversion, phone digest on one in two, click id on one in four, contact id on one in five, no address; the same rows in the old shape's table (`pg_upsert_v1`); traffic to those workspaces in proportion to their size. {}\n",
            if run.sized_cluster.is_null() {
                "The OS caches most of it on this machine: that flatters the larger sizes."
            } else {
                "Uncapped, the OS caches most of it on this machine; capped, PostgreSQL and its page cache live within the memory budget below."
            }
        );
        let _ = writeln!(md, "![throughput and p99 against stored conversions](throughput_by_size.svg)\n");
        let _ = writeln!(md, "| stored conversions | batch_ingest items/s | batch_ingest p99 ms | single_200rps p99 ms | direct_apply items/s | pg_upsert items/s | pg_upsert_v1 items/s | load s (copy + indexes + vacuum) | erase ms | lock held ms | same-workspace write max ms |\n|---|---|---|---|---|---|---|---|---|---|---|");
        let at = |name: &str, key: &str| report[name][key].clone();
        let _ = writeln!(
            md,
            "| 0 (empty) | {} | {} | {} | {} | {} | {} | | | | |",
            at("batch_ingest", "items_per_s"),
            at("batch_ingest", "p99_ms"),
            at("single_200rps", "p99_ms"),
            at("direct_apply", "items_per_s"),
            at("pg_upsert", "items_per_s"),
            at("pg_upsert_v1", "items_per_s")
        );
        for row in &run.sized {
            let l = row["label"].as_str().unwrap_or("");
            let e = &row["erase"];
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} + {} + {} | {} | {} | {} |",
                row["size"],
                at(&format!("batch_ingest_{l}"), "items_per_s"),
                at(&format!("batch_ingest_{l}"), "p99_ms"),
                at(&format!("single_200rps_{l}"), "p99_ms"),
                at(&format!("direct_apply_{l}"), "items_per_s"),
                at(&format!("pg_upsert_{l}"), "items_per_s"),
                at(&format!("pg_upsert_v1_{l}"), "items_per_s"),
                row["load"]["copy_s"],
                row["load"]["indexes_s"],
                row["load"]["vacuum_s"],
                e["erase_command_ms"],
                e["lock_held_ms"],
                e["same_workspace_writes_meanwhile"]["max_ms"]
            );
        }
        for row in run.sized.iter().filter(|row| !row["capped"].is_null()) {
            let l = row["label"].as_str().unwrap_or("");
            let e = &row["capped"]["erase"];
            let _ = writeln!(
                md,
                "| {}, capped | {} | {} | {} | {} | {} | {} | | {} | {} | {} |",
                row["size"],
                at(&format!("batch_ingest_{l}_capped"), "items_per_s"),
                at(&format!("batch_ingest_{l}_capped"), "p99_ms"),
                at(&format!("single_200rps_{l}_capped"), "p99_ms"),
                at(&format!("direct_apply_{l}_capped"), "items_per_s"),
                at(&format!("pg_upsert_{l}_capped"), "items_per_s"),
                at(&format!("pg_upsert_v1_{l}_capped"), "items_per_s"),
                e["erase_command_ms"],
                e["lock_held_ms"],
                e["same_workspace_writes_meanwhile"]["max_ms"]
            );
        }
        let _ = writeln!(md);
        sized_storage(&mut md, run);
    }

    let _ = writeln!(md, "## Scenarios\n");
    for (name, scenario) in &run.scenarios {
        let r = &report[*name];
        let d = &report["scenario_details"][*name];
        let (unit, value) = match scenario.counted {
            Counted::Items => ("items/s", &r["items_per_s"]),
            Counted::Requests => ("requests/s", &r["requests_per_s"]),
        };
        let slowest = d["slowest_started_at"]
            .as_str()
            .map(|at| format!(" The slowest request started at {at}."))
            .unwrap_or_default();
        let _ = writeln!(
            md,
            "### {name}\n\n{}; {}.{slowest}\n",
            d["what"].as_str().unwrap_or(""),
            d["concurrency"].as_str().unwrap_or("")
        );
        let _ = writeln!(md, "| {unit} | requests | items | p50 ms | p90 ms | p99 ms | max ms | errors | seconds |\n|---|---|---|---|---|---|---|---|---|");
        let _ = writeln!(
            md,
            "| {value} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            d["requests"], d["items"], r["p50_ms"], r["p90_ms"], r["p99_ms"], r["max_ms"], r["errors"], d["seconds"]
        );
        if let Some(error) = d["first_error"].as_str() {
            let _ = writeln!(md, "First error: `{}`\n", error.replace('`', "'"));
        }
        let _ = writeln!(md, "{}\n", cores_table(&scenario.cores));
        if let Some(w) = &scenario.writer {
            let _ = writeln!(md, "Stages: {}.\n", stages_text(w));
        }
        stages_table(&mut md, &scenario.measured.recorder);
    }

    if !run.scale.is_empty() {
        let _ = writeln!(md, "## Scale: batch_ingest with 1 and 2 gateways and writers\n");
        let _ = writeln!(md, "| gateways | writers | items/s | p50 ms | p99 ms | errors | machine busy | writer lanes busy |\n|---|---|---|---|---|---|---|---|");
        for row in &run.scale {
            let b = &row["batch_ingest"];
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                row["gateways"],
                row["writers"],
                b["items_per_s"],
                b["p50_ms"],
                b["p99_ms"],
                b["errors"],
                row["cores"]["machine busy"],
                row["writer_stage"]["apply_lanes_busy_per_writer"]
            );
        }
        let _ = writeln!(md);
    }

    for (title, value) in [("writers", &run.scale_writers), ("gateways", &run.scale_gateways)] {
        if value.is_null() {
            continue;
        }
        let _ = writeln!(md, "## Scale: 1, 2 and 4 {title}, each under a CPU quota\n");
        if let Some(skipped) = value.get("skipped") {
            let _ = writeln!(md, "Skipped: {skipped}\n");
            continue;
        }
        let _ = writeln!(
            md,
            "Each {} capped at {} cores (cgroup {}); factors ×{} at 2, ×{} at 4 (targets ≥ 1.8 and ≥ 3.2); every capped process within its quota: {}.\n",
            title.trim_end_matches('s'), value["quota_cores_per_process"], value["cgroup"].as_str().unwrap_or(""),
            value["factor_2"], value["factor_4"], value["every_capped_process_within_its_quota"]
        );
        let _ = writeln!(md, "| {title} | items/s | p99 ms | cores of each capped process | throttled periods | machine busy |\n|---|---|---|---|---|---|");
        for row in value["runs"].as_array().into_iter().flatten() {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} |",
                row["processes"],
                row["batch_ingest"]["items_per_s"],
                row["batch_ingest"]["p99_ms"],
                row["capped_process_cores"],
                row["throttled_periods"],
                row["cores"]["machine busy"]
            );
        }
        let _ = writeln!(md);
    }

    let _ = writeln!(md, "## Profile\n");
    match run.profiles.as_object() {
        Some(profiles) if !profiles.contains_key("skipped") => {
            for (name, p) in profiles {
                if let Some(failed) = p.get("failed") {
                    let _ = writeln!(md, "- {name}: profile failed: {failed}");
                    continue;
                }
                let _ = writeln!(
                    md,
                    "### {name} ({} samples; flamegraph `{}`, summary `{}`)\n",
                    p["samples"],
                    p["flamegraph"].as_str().unwrap_or(""),
                    p["summary"].as_str().unwrap_or("")
                );
                let _ = writeln!(md, "| role | % of all samples | hottest functions (self time, % of the role) | own code, inclusive (% of the role) |\n|---|---|---|---|");
                let mut roles: Vec<(&String, &Value)> =
                    p["by_role"].as_object().map(|o| o.iter().collect()).unwrap_or_default();
                roles.sort_by(|a, b| field(b.1, "percent_of_samples").total_cmp(&field(a.1, "percent_of_samples")));
                for (role, r) in roles {
                    let list = |key: &str, n: usize| {
                        r[key]
                            .as_array()
                            .map(|h| {
                                h.iter()
                                    .take(n)
                                    .map(|f| {
                                        format!(
                                            "`{}` {}",
                                            short(f["function"].as_str().unwrap_or("")),
                                            f["percent_of_role"]
                                        )
                                    })
                                    .collect::<Vec<_>>()
                                    .join(", ")
                            })
                            .unwrap_or_default()
                    };
                    let _ = writeln!(
                        md,
                        "| {role} | {} | {} | {} |",
                        r["percent_of_samples"],
                        list("hottest", 4),
                        list("own_code_inclusive", 6)
                    );
                }
                let _ = writeln!(md);
            }
        }
        _ => {
            let _ = writeln!(md, "No profile: {}\n", run.profiles);
        }
    }
    md
}

fn machine_line(m: &Value) -> String {
    format!(
        "Machine: {} cores ({}), {} GiB, {}, kernel {}; load average at start {}",
        m["cores"],
        m["cpu_model"].as_str().unwrap_or(""),
        m["memory_gib"],
        m["os"].as_str().unwrap_or(""),
        m["kernel"].as_str().unwrap_or(""),
        m["load_average_at_start"].as_str().unwrap_or("")
    )
}

/// One metric of a scenario run on both the single node and the HA layout.
struct HaRow {
    scenario: &'static str,
    key: &'static str,
    label: &'static str,
    single: f64,
    ha: f64,
    /// On the layout with asynchronous replication; none when it did not run.
    ha_async: Option<f64>,
}

impl HaRow {
    fn ha_over_single(&self) -> Value {
        self.over_single(self.ha)
    }

    fn ha_async_over_single(&self) -> Value {
        self.ha_async.map_or(Value::Null, |ha_async| self.over_single(ha_async))
    }

    fn over_single(&self, value: f64) -> Value {
        if self.single > 0.0 {
            json!(round2(value / self.single))
        } else {
            Value::Null
        }
    }
}

/// A metric of [`ha_rows`]: its key in report.json, its label, and how it is read.
type Metric<'a> = (&'static str, &'static str, &'a dyn Fn(&Scenario) -> f64);

/// Per scenario run on both (on empty tables, then at each size): throughput, p50, p99, the writer's time per group (one
/// transaction, its commit included) and PostgreSQL's cores (on the layout, its three nodes').
fn ha_rows(run: &Run) -> Vec<HaRow> {
    let find = |name: &str| run.scenarios.iter().find(|(n, _)| *n == name).map(|(_, s)| s);
    let quantile = |s: &Scenario, q: f64| round2(s.measured.recorder.latency.value_at_quantile(q) as f64 / 1000.0);
    let postgresql = |s: &Scenario| {
        round2(
            field(&s.cores, "postgresql")
                + field(&s.cores, "postgresql walsenders")
                + field(&s.cores, "postgresql standbys"),
        )
    };
    let per_group = |s: &Scenario| s.writer.as_ref().map_or(0.0, |w| field(w, "mean_apply_ms_per_group"));
    let mut rows = Vec::new();
    for (scenario, single) in &run.scenarios {
        let Some(ha) = find(&format!("{scenario}_ha")) else { continue };
        let ha_async = find(&format!("{scenario}_ha_async"));
        let scenario: &'static str = scenario;
        let (key, label) = match single.counted {
            Counted::Items => ("items_per_s", "items/s"),
            Counted::Requests => ("requests_per_s", "requests/s"),
        };
        let rate = |s: &Scenario| round1(s.measured.rate(s.counted));
        let (cpu_key, cpu_label) = match single.counted {
            Counted::Items => ("primary_cpu_ms_per_1000_items", "the primary's CPU ms per 1,000 items"),
            Counted::Requests => ("primary_cpu_ms_per_request", "the primary's CPU ms a request"),
        };
        let primary_cpu = |s: &Scenario| {
            round2(cpu_ms_per_unit(s, field(&s.cores, "postgresql") + field(&s.cores, "postgresql walsenders")))
        };
        let metrics: [Metric<'_>; 6] = [
            (key, label, &rate),
            ("p50_ms", "p50 ms", &|s| quantile(s, 0.5)),
            ("p99_ms", "p99 ms", &|s| quantile(s, 0.99)),
            ("apply_ms_per_group", "writer ms a group (one transaction)", &per_group),
            ("postgresql_cores", "PostgreSQL cores", &postgresql),
            (cpu_key, cpu_label, &primary_cpu),
        ];
        for (key, label, metric) in metrics {
            let (single, ha, ha_async) = (metric(single), metric(ha), ha_async.map(metric));
            // The baselines have no writer, and so no time a group.
            if single > 0.0 || ha > 0.0 {
                rows.push(HaRow { scenario, key, label, single, ha, ha_async });
            }
        }
    }
    rows
}

/// CPU ms per request (per 1,000 items for a scenario that counts items) of `cores` used
/// over the scenario.
fn cpu_ms_per_unit(s: &Scenario, cores: f64) -> f64 {
    let rate = s.measured.rate(s.counted);
    let per = match s.counted {
        Counted::Items => 1_000_000.0,
        Counted::Requests => 1_000.0,
    };
    if rate > 0.0 {
        cores / rate * per
    } else {
        0.0
    }
}

/// The roles of the CPU table of the HA section, in its order.
const CPU_ROLES: [(&str, &str); 13] = [
    ("postgresql", "PostgreSQL: the primary (the single node), walsenders apart"),
    ("postgresql walsenders", "the primary's walsenders"),
    ("postgresql standbys", "the two standbys (replay, WAL receiver, restartpoints)"),
    ("haproxy", "HAProxy"),
    ("patroni", "Patroni (three)"),
    ("etcd", "etcd (three)"),
    ("writer", "writer"),
    ("gateway", "gateway"),
    ("kafka", "Kafka"),
    ("redis", "Redis"),
    ("load generator", "load generator"),
    ("other processes", "other processes (not this run's)"),
    ("machine busy", "the whole machine"),
];

/// Per scenario run on both, on empty tables and at each size: the CPU of each role a request
/// (or per 1,000 items), single node and HA: where the layout's extra CPU goes.
fn ha_cpu_rows(run: &Run) -> Vec<(&'static str, &'static str, f64, f64)> {
    let find = |name: &str| run.scenarios.iter().find(|(n, _)| *n == name).map(|(_, s)| s);
    let mut rows = Vec::new();
    for (scenario, single) in &run.scenarios {
        let Some(ha) = find(&format!("{scenario}_ha")) else { continue };
        for (role, label) in CPU_ROLES {
            let (a, b) =
                (cpu_ms_per_unit(single, field(&single.cores, role)), cpu_ms_per_unit(ha, field(&ha.cores, role)));
            if a > 0.0 || b > 0.0 {
                rows.push((*scenario, label, round3(a), round3(b)));
            }
        }
    }
    rows
}

/// Per scenario run on both: the gateway's CPU a request (or per 1,000 items) on HA over the
/// single node's. The layout changes nothing of the gateway's work (its key look-ups are
/// cached), so a ratio away from 1 is the host's speed changing between the two halves of the
/// run, and every HA / single ratio of that scenario carries it.
fn host_drift(cpu: &[(&'static str, &'static str, f64, f64)]) -> Vec<(&'static str, f64)> {
    cpu.iter()
        .filter(|(_, label, single, _)| *label == "gateway" && *single > 0.0)
        .map(|(scenario, _, single, ha)| (*scenario, round2(ha / single)))
        .collect()
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// report.json's `ha_replication.comparison`: scenario → metric → single, ha, ha_over_single.
fn ha_comparison(run: &Run) -> Value {
    let mut comparison = serde_json::Map::new();
    for row in ha_rows(run) {
        let entry = comparison.entry(row.scenario.to_owned()).or_insert_with(|| json!({}));
        entry[row.key] = json!({ "single": row.single, "ha": row.ha, "ha_over_single": row.ha_over_single(),
            "ha_async": row.ha_async, "ha_async_over_single": row.ha_async_over_single() });
    }
    for (scenario, label, single, ha) in ha_cpu_rows(run) {
        let entry = comparison.entry(scenario.to_owned()).or_insert_with(|| json!({}));
        entry["cpu_ms_by_role"][label] = json!({ "single": single, "ha": ha });
    }
    Value::Object(comparison)
}

/// Synchronous replication (HA layout): the scenarios on both, side by side.
fn ha_section(md: &mut String, run: &Run) {
    let layout = &run.ha;
    let _ = writeln!(md, "## Synchronous replication (HA layout)\n");
    if let Some(skipped) = layout.get("skipped") {
        let _ = writeln!(md, "Not measured: {}\n", skipped.as_str().unwrap_or(""));
        return;
    }
    let standbys = layout["standbys"]
        .as_array()
        .map(|s| {
            s.iter()
                .map(|s| {
                    format!(
                        "{} {} {}",
                        s["name"].as_str().unwrap_or("?"),
                        s["state"].as_str().unwrap_or("?"),
                        s["sync_state"].as_str().unwrap_or("?")
                    )
                })
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_default();
    let _ = writeln!(
        md,
        "The same scenarios in the same run: on empty tables first on the single node, then on the HA layout of deploy/ha.sh (three PostgreSQL {} nodes under Patroni, `synchronous_mode_strict`, one synchronous standby; three etcd members; HAProxy as the primary's address), started after the single node's runs ({} s to a writable primary) and stopped before this report, on a stack of its own (the same gateways and writers, topics of their own). A commit on the layout returns once the synchronous standby has flushed it. Primary {}; the standbys at the end of the runs: {standbys}. Each node: `shared_buffers` {}, no WAL archive (the settings below say what differs from the single node). The runs at size come after the empty tables' on the layout, and the single node's after the layout is stopped.\n",
        run.versions["postgresql"].as_str().and_then(|v| v.split_whitespace().next()).unwrap_or(""),
        layout["seconds_to_start"],
        layout["primary"].as_str().unwrap_or("?"),
        layout["shared_buffers_per_node"].as_str().unwrap_or("?"),
    );
    let _ = writeln!(md, "{}.\n", machine_line(&run.machine));
    for size in layout["sized"].as_array().into_iter().flatten() {
        if let Some(failed) = size["failed"].as_str() {
            let _ = writeln!(md, "At {}: not measured: {failed}.\n", size["label"].as_str().unwrap_or("?"));
            continue;
        }
        let load = &size["load"];
        let _ = writeln!(
            md,
            "At {}: loaded through the primary in {} s ({} GiB a node, {} s of it COPY, {} s indexes, {} s vacuum and checkpoint); the erasure held its lock {} ms; WAL {} bytes an item of batch_ingest; bytes a conversion: heap {}, indexes {}.\n",
            size["label"].as_str().unwrap_or("?"),
            load["total_s"],
            load["database_gib"],
            load["copy_s"],
            load["indexes_s"],
            load["vacuum_s"],
            size["erase"]["lock_held_ms"],
            size["wal_per_item"]["batch_ingest_bytes"],
            size["bytes_per_conversion"]["heap_bytes"],
            size["bytes_per_conversion"]["index_bytes"],
        );
    }
    let _ = writeln!(
        md,
        "| scenario | metric | single node | HA | HA / single | HA, asynchronous | asynchronous / single |\n|---|---|---|---|---|---|---|"
    );
    for row in ha_rows(run) {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} |",
            row.scenario,
            row.label,
            row.single,
            row.ha,
            row.ha_over_single(),
            row.ha_async.map_or("-".to_owned(), |v| v.to_string()),
            row.ha_async_over_single()
        );
    }
    let _ = writeln!(
        md,
        "\n\"HA, asynchronous\" is the same layout started again with asynchronous replication (`deploy/up.sh --ha --async`), on empty tables: a commit waits for the primary's disk alone, and what a promoted standby lacks is put back from the requests topic (docs/architecture.md, \"The log is the record\")."
    );
    let _ = writeln!(
        md,
        "\n\"writer ms a group\" is the writer's mean time to apply one group of messages, one transaction and its commit: where a commit's wait for the standby lands; with the writer's apply lanes all busy, throughput is lanes over that time. PostgreSQL cores on the layout are its three nodes' (the sections of the `_ha` scenarios below have the primary's and the standbys' apart, and HAProxy's, Patroni's and etcd's).\n"
    );
    let cpu = ha_cpu_rows(run);
    if !cpu.is_empty() {
        let _ = writeln!(
            md,
            "Where the CPU goes: each role's CPU time (from /proc, utime + stime, over the middle of the scenario) divided by what the scenario served, in ms a request (`single_*`) or per 1,000 items (`batch_ingest`). The primary's PostgreSQL counts its postmaster, background processes and the backends of the run's databases; its walsenders are apart; a shared server's other backends are among the other processes.\n\n| scenario | role | single node | HA | HA − single |\n|---|---|---|---|---|"
        );
        for &(scenario, label, single, ha) in &cpu {
            let _ = writeln!(md, "| {scenario} | {label} | {single} | {ha} | {} |", round3(ha - single));
        }
        let drift = host_drift(&cpu);
        if !drift.is_empty() {
            let list =
                drift.iter().map(|(scenario, ratio)| format!("{scenario} {ratio}")).collect::<Vec<_>>().join(", ");
            let _ = writeln!(
                md,
                "\nThe host's speed across the run: the gateway's CPU a request on HA over the single node's, for the same work: {list}. Away from 1 (beyond about 0.1), the host ran at another speed during one half of the run, and that scenario's HA / single ratios carry the difference."
            );
        }
        let _ = writeln!(md);
    }
    if let Some(settings) = layout["settings_differing"].as_object().filter(|s| !s.is_empty()) {
        let list = settings
            .iter()
            .map(|(name, v)| {
                let show = |v: &Value| v.as_str().map_or("(none)".to_owned(), |s| format!("`{s}`"));
                format!("{name} {} → {}", show(&v["single"]), show(&v["ha"]))
            })
            .collect::<Vec<_>>()
            .join("; ");
        let _ = writeln!(md, "Settings in which the two servers differ (single node → HA primary): {list}.\n");
    }
}

/// The stage timers of a scenario in words (the bucket bounds are powers of two from 1 ms).
fn stages_text(w: &Value) -> String {
    let rechecked = match field(w, "confirmations_rechecked") {
        n if n > 0.0 => format!("; {n} commits' replication confirmed only at a second look"),
        _ => String::new(),
    };
    format!(
        "each writer applied {:.2} groups at once on average, of {} lanes ({} groups, {} messages and {} ms a group; apply p50 ≤ {} ms, p99 ≤ {} ms); inside the gateway a write took p50 ≤ {} ms, p99 ≤ {} ms{rechecked}",
        field(w, "apply_lanes_busy_per_writer"),
        writer_lanes(),
        w["groups"], w["messages_per_group"], w["mean_apply_ms_per_group"],
        w["apply_p50_ms_at_most"], w["apply_p99_ms_at_most"],
        w["gateway_write_p50_ms_at_most"], w["gateway_write_p99_ms_at_most"],
    )
}

fn cores_table(cores: &Value) -> String {
    let Some(cores) = cores.as_object() else { return String::new() };
    let header = cores.keys().map(String::as_str).collect::<Vec<_>>().join(" | ");
    let values = cores.values().map(|v| v.to_string()).collect::<Vec<_>>().join(" | ");
    format!("| CPU | {header} |\n|---|{}\n| cores used | {values} |", "---|".repeat(cores.len()))
}

/// A function name without its hash suffix and generic noise, at most 80 characters.
fn short(function: &str) -> String {
    let name = function.split("::h").next().unwrap_or(function);
    if name.chars().count() > 80 {
        format!("…{}", name.chars().skip(name.chars().count() - 79).collect::<String>())
    } else {
        name.to_owned()
    }
}

/// The writers' `--apply-lanes` (the load generator starts them with the environment it has).
pub fn writer_lanes() -> usize {
    std::env::var("INTAKE_WRITER_APPLY_LANES").ok().and_then(|v| v.parse().ok()).unwrap_or(4)
}

/// The cluster of the runs at size, what a stored conversion costs, and what the capped runs
/// read and held.
fn sized_storage(md: &mut String, run: &Run) {
    let c = &run.sized_cluster;
    if !c.is_null() {
        let _ = writeln!(
            md,
            "The runs at size ran on a PostgreSQL cluster of their own in a memory cgroup ({}), `shared_buffers` {} MiB capped or not; capped, the group's limit was {} MiB, its page cache included.\n",
            c["cgroup"].as_str().unwrap_or(""),
            c["shared_buffers_mib"],
            c["budget_mib"]
        );
    }
    let _ = writeln!(md, "### Bytes per stored conversion\n");
    let _ = writeln!(md, "After each load (COPY, indexes built after, VACUUM); WAL per item written during `batch_ingest` and `pg_upsert` at that size.\n");
    let indexes: Vec<String> = run
        .sized
        .first()
        .and_then(|row| row["bytes_per_conversion"]["indexes"].as_object())
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default();
    let _ = writeln!(
        md,
        "| stored conversions | heap | all indexes | {} | WAL per item, batch_ingest | WAL per item, pg_upsert |",
        indexes.join(" | ")
    );
    let _ = writeln!(md, "|{}", "---|".repeat(indexes.len() + 5));
    for row in &run.sized {
        let b = &row["bytes_per_conversion"];
        let each: Vec<String> = indexes.iter().map(|i| b["indexes"][i].to_string()).collect();
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} |",
            row["size"],
            b["heap_bytes"],
            b["index_bytes"],
            each.join(" | "),
            row["uncapped"]["wal_per_item"]["batch_ingest_bytes"],
            row["uncapped"]["wal_per_item"]["pg_upsert_bytes"]
        );
    }
    let _ = writeln!(md);
    let _ = writeln!(
        md,
        "The same rows in a table of the old shape (`{}`, the fixed yardstick's):\n\n| stored conversions | heap | all indexes, old shape | all indexes, `conversions` | indexes below the old shape |\n|---|---|---|---|---|",
        crate::baselines::V1_TABLE
    );
    for row in &run.sized {
        let (b, v1) = (&row["bytes_per_conversion"], &row["bytes_per_conversion_v1"]);
        let (lean, old) = (b["index_bytes"].as_f64().unwrap_or(0.0), v1["index_bytes"].as_f64().unwrap_or(0.0));
        let below = if old > 0.0 { format!("{:.0} %", (1.0 - lean / old) * 100.0) } else { String::new() };
        let _ = writeln!(md, "| {} | {} | {} | {} | {below} |", row["size"], v1["heap_bytes"], old, lean);
    }
    let _ = writeln!(md);
    for row in run.sized.iter().filter(|row| !row["capped"].is_null()) {
        let _ = writeln!(md, "### Under the memory budget, at {}\n", row["size"]);
        let _ = writeln!(md, "| scenarios | group limit MiB | group peak MiB | page cache MiB at end (shared memory included) | anonymous MiB | shared memory MiB | dirty or in writeback, peak MiB | limit hits | PostgreSQL block reads/s | buffer hit ratio | PostgreSQL read ms | disk reads/s | disk MiB/s | disk read ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
        for (name, proof) in row["capped"]["under_budget"].as_object().into_iter().flatten() {
            let (m, r) = (&proof["memory"], &proof["reads"]);
            let _ = writeln!(
                md,
                "| {name} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                m["limit_mib"],
                m["peak_mib"],
                m["at_end"]["page_cache_mib"],
                m["at_end"]["anonymous_mib"],
                m["at_end"]["shared_memory_mib"],
                m["dirty_peak_mib"],
                m["limit_hits"],
                r["postgresql_block_reads_per_s"],
                r["postgresql_buffer_hit_ratio"],
                r["postgresql_read_ms_mean"],
                r["disk_reads_per_s"],
                r["disk_read_mib_per_s"],
                r["disk_read_ms_mean"]
            );
        }
        let _ = writeln!(md);
        for (name, proof) in row["capped"]["under_budget"].as_object().into_iter().flatten() {
            let by_relation: Vec<String> = proof["reads"]["postgresql_block_reads_per_s_by_relation"]
                .as_array()
                .into_iter()
                .flatten()
                .take(12)
                .map(|pair| format!("{} {}", pair[0].as_str().unwrap_or_default(), pair[1]))
                .collect();
            let _ = writeln!(md, "Block reads a second by table and index, {name}: {}.\n", by_relation.join(", "));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_s_drift_is_the_gateway_s_cpu_on_ha_over_the_single_node_s() {
        let cpu = [
            ("single_32", "writer", 0.374, 0.514),
            ("single_32", "gateway", 0.319, 0.415),
            ("single_200rps", "gateway", 0.85, 0.85),
            ("batch_ingest", "gateway", 0.0, 1.0),
        ];
        assert_eq!(host_drift(&cpu), vec![("single_32", 1.3), ("single_200rps", 1.0)]);
    }

    #[test]
    fn every_scenario_at_size_is_described_with_its_size() {
        let config = Config::from_env();
        for name in ["batch_ingest_10m", "single_200rps_1m", "direct_apply_50k", "pg_upsert_10m"] {
            let size = name.rsplit_once('_').map(|(_, size)| size).unwrap_or_default();
            let text = describe(name, &config);
            assert!(text.contains(&format!("preloaded to {size} stored conversions")), "{name}: {text}");
        }
        assert_eq!(describe("no_such_scenario", &config), "");
    }

    /// 985 writes of 4 ms, 2 of them in apply, and 15 of 50 ms, 40 of them in apply.
    fn stalled() -> Scenario {
        let mut recorder = Recorder::new();
        let header = |apply: f64, total: f64| {
            format!("gateway;dur=0.5, produce;dur=0.5, fetch;dur=0.5, queue;dur=0, apply;dur={apply}, reply-produce;dur=0.2, reply-read;dur=0.3, total;dur={total}")
        };
        for k in 0..1000u32 {
            let (took, apply) = if k < 15 { (50, 40.0) } else { (4, 2.0) };
            let took = std::time::Duration::from_millis(took);
            recorder.record(took, Ok(1));
            let answer = crate::client::Answer {
                status: 201,
                body: bytes::Bytes::new(),
                server_timing: http::HeaderValue::from_str(&header(apply, apply + 2.0)).ok(),
                request_id: http::HeaderValue::from_str(&format!("req-{k}")).ok(),
            };
            recorder.place(took, &answer);
        }
        let measured = crate::measure::Measured {
            recorder,
            elapsed: std::time::Duration::from_secs(5),
            concurrency: String::new(),
        };
        Scenario { measured, counted: Counted::Requests, cores: json!({}), writer: None }
    }

    #[test]
    fn a_missed_p99_says_which_stage_the_slowest_requests_time_went_to() {
        let scenario = stalled();
        let target = Target {
            name: "single_200rps p99",
            measured: 50.0,
            limit: 20.0,
            at_least: false,
            unit: " ms",
            scenario: "single_200rps",
            quantile: Some(0.99),
        };
        let text = placed(&target, &scenario).unwrap_or_default();
        assert!(text.starts_with("p99 50 ms ≥ 20 ms: of the slowest 1 % (15 requests of 50.0"), "{text}");
        assert!(text.contains("mean 50.0 ms) 40.0 ms in apply (80 %), 8.0 in client (16 %)"), "{text}");
        assert!(
            text.contains("at the median (985 requests of 4.00–4.00 ms, mean 4.0 ms) 2.0 ms in apply (50 %)"),
            "{text}"
        );
        assert_eq!(placed(&Target { quantile: None, ..target }, &scenario), None);

        let json = stages_json(&scenario.measured.recorder).unwrap_or_default();
        assert_eq!(json["timed_requests"], json!(1000));
        assert_eq!(json["slowest_1_percent"]["dominant"], json!({ "stage": "apply", "ms": 40.0, "share": 0.8 }));
        assert_eq!(json["median_band"]["mean_ms"]["apply"], json!(2.0));
        assert_eq!(json["median_band"]["mean_ms"].get("reply"), None, "a stage no header named is left out");
        assert_eq!(json["slowest"].as_array().map(Vec::len), Some(crate::timing::SLOWEST_KEPT));
        assert_eq!(json["slowest"][0]["request_id"], json!("req-0"));
        assert_eq!(json["slowest"][0]["client_ms"], json!(8.0));
        assert_eq!(json["slowest"][0]["most_in"], json!("apply"));

        let mut md = String::new();
        stages_table(&mut md, &scenario.measured.recorder);
        assert!(md.contains("| requests | n | latency | gateway | produce | fetch | queue | apply | reply-produce | reply-read | rest | client | most in |"), "{md}");
        assert!(
            md.contains(
                "| 15 | 50.00 | 0.50 | 0.50 | 0.50 | 0.00 | 40.00 | 0.20 | 0.30 | 0.00 | 8.00 | apply (80 %) |"
            ),
            "{md}"
        );
    }
}
