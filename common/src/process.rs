//! The process's own resources on `/metrics`, under the names Prometheus' client libraries give
//! them (`process_resident_memory_bytes`, `process_cpu_seconds_total`, `process_open_fds`,
//! `process_start_time_seconds`), so that dashboards and rules written for any exporter read
//! them. Both services register [`ProcessCollector`] on their registry's root, outside their
//! `intake_*` prefix.
//!
//! Written by hand: prometheus-client has no process collector, and the crates that read
//! `/proc` (procfs, sysinfo) would add more to the build than these few lines. The values are
//! read from `/proc/self` at every scrape, as the Go client does; elsewhere than on Linux the
//! collector writes nothing. The page size and the clock's ticks per second, which `/proc` counts
//! in, come from the kernel's auxiliary vector (`/proc/self/auxv`), since the workspace forbids
//! the `unsafe` a call to `sysconf` needs.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use std::sync::OnceLock;

/// Registers the process metrics on `registry`, which must have no prefix of its own: the
/// names are the standard ones.
pub fn register(registry: &mut Registry) {
    registry.register_collector(Box::new(ProcessCollector));
}

#[derive(Debug, Default)]
pub struct ProcessCollector;

/// One reading of the process's resources; a value `/proc` did not give is `None`.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Sample {
    pub resident_memory_bytes: Option<u64>,
    pub cpu_seconds: Option<f64>,
    pub open_fds: Option<u64>,
    pub start_time_seconds: Option<f64>,
}

impl Sample {
    pub fn read() -> Sample {
        let units = units();
        let stat = std::fs::read_to_string("/proc/self/stat").ok().and_then(|text| Stat::parse(&text));
        let boot_time = std::fs::read_to_string("/proc/stat").ok().and_then(|text| boot_time(&text));
        let ticks = units.ticks_per_second as f64;
        Sample {
            resident_memory_bytes: stat.as_ref().map(|stat| stat.rss_pages * units.page_size),
            cpu_seconds: stat.as_ref().map(|stat| (stat.utime + stat.stime) as f64 / ticks),
            open_fds: std::fs::read_dir("/proc/self/fd").ok().map(|entries| entries.count() as u64),
            start_time_seconds: stat.zip(boot_time).map(|(stat, boot)| boot as f64 + stat.start_ticks as f64 / ticks),
        }
    }
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let sample = Sample::read();
        if let Some(bytes) = sample.resident_memory_bytes {
            let gauge = ConstGauge::new(bytes as i64);
            let metric = encoder.encode_descriptor(
                "process_resident_memory_bytes",
                "Resident memory size in bytes.",
                None,
                gauge.metric_type(),
            )?;
            gauge.encode(metric)?;
        }
        if let Some(seconds) = sample.cpu_seconds {
            let counter = ConstCounter::new(seconds);
            let metric = encoder.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds.",
                None,
                counter.metric_type(),
            )?;
            counter.encode(metric)?;
        }
        if let Some(fds) = sample.open_fds {
            let gauge = ConstGauge::new(fds as i64);
            let metric = encoder.encode_descriptor(
                "process_open_fds",
                "Number of open file descriptors.",
                None,
                gauge.metric_type(),
            )?;
            gauge.encode(metric)?;
        }
        if let Some(seconds) = sample.start_time_seconds {
            let gauge = ConstGauge::new(seconds);
            let metric = encoder.encode_descriptor(
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                None,
                gauge.metric_type(),
            )?;
            gauge.encode(metric)?;
        }
        Ok(())
    }
}

/// The fields of `/proc/self/stat` used here, in the kernel's units (clock ticks, pages).
#[derive(Debug, PartialEq)]
struct Stat {
    utime: u64,
    stime: u64,
    start_ticks: u64,
    rss_pages: u64,
}

impl Stat {
    /// The command name (field 2) is in parentheses and may hold spaces and parentheses itself:
    /// the fields are counted from the last `)`.
    fn parse(text: &str) -> Option<Stat> {
        let after_name = &text[text.rfind(')')? + 1..];
        let fields: Vec<&str> = after_name.split_whitespace().collect();
        // Field n of proc(5) is fields[n - 3]: state, field 3, is the first after the name.
        let field = |n: usize| fields.get(n - 3).and_then(|value| value.parse::<u64>().ok());
        Some(Stat { utime: field(14)?, stime: field(15)?, start_ticks: field(22)?, rss_pages: field(24)? })
    }
}

/// The boot time, in seconds since the epoch, from `/proc/stat`'s `btime` line.
fn boot_time(text: &str) -> Option<u64> {
    text.lines().find_map(|line| line.strip_prefix("btime ")).and_then(|value| value.trim().parse().ok())
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Units {
    page_size: u64,
    ticks_per_second: u64,
}

/// The page size and ticks per second of this machine, read once. Without an auxiliary vector,
/// the values of every Linux architecture intake builds for (x86_64, aarch64).
fn units() -> Units {
    static UNITS: OnceLock<Units> = OnceLock::new();
    *UNITS.get_or_init(|| {
        let auxv = std::fs::read("/proc/self/auxv").unwrap_or_default();
        units_from_auxv(&auxv)
    })
}

fn units_from_auxv(auxv: &[u8]) -> Units {
    const AT_NULL: u64 = 0;
    const AT_PAGESZ: u64 = 6;
    const AT_CLKTCK: u64 = 17;
    let mut units = Units { page_size: 4096, ticks_per_second: 100 };
    let word = std::mem::size_of::<usize>();
    for entry in auxv.chunks_exact(2 * word) {
        let read = |bytes: &[u8]| bytes.try_into().map(usize::from_ne_bytes).map(|value| value as u64).ok();
        let (Some(key), Some(value)) = (read(&entry[..word]), read(&entry[word..])) else { break };
        match key {
            AT_NULL => break,
            AT_PAGESZ if value > 0 => units.page_size = value,
            AT_CLKTCK if value > 0 => units.ticks_per_second = value,
            _ => {}
        }
    }
    units
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

    fn rendered() -> String {
        let mut registry = Registry::default();
        register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encoding");
        text
    }

    fn value(text: &str, name: &str) -> f64 {
        let line = text
            .lines()
            .find(|line| line.split(' ').next() == Some(name))
            .unwrap_or_else(|| panic!("no {name} in:\n{text}"));
        line.rsplit(' ').next().and_then(|value| value.parse().ok()).unwrap_or_else(|| panic!("{line}"))
    }

    #[test]
    fn the_four_series_have_positive_values() {
        // A fresh test process may not have used one clock tick of CPU yet.
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut spin = 0u64;
        while Sample::read().cpu_seconds.unwrap_or_default() <= 0.0 && Instant::now() < deadline {
            for i in 0..100_000u64 {
                spin = std::hint::black_box(spin.wrapping_mul(31).wrapping_add(i));
            }
        }
        let text = rendered();
        for name in [
            "process_resident_memory_bytes",
            "process_cpu_seconds_total",
            "process_open_fds",
            "process_start_time_seconds",
        ] {
            assert!(value(&text, name) > 0.0, "{name} is not positive:\n{text}");
        }
        // In bytes, not pages: a test process holds more than a megabyte.
        assert!(value(&text, "process_resident_memory_bytes") > 1_048_576.0, "{text}");
        let now = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_secs_f64();
        let started = value(&text, "process_start_time_seconds");
        assert!(started <= now + 1.0 && started > now - 3600.0, "started at {started}, now {now}");
        assert!(text.contains("# TYPE process_cpu_seconds counter"), "{text}");
    }

    #[test]
    fn a_command_name_with_spaces_and_parentheses_is_skipped() {
        let mut fields: Vec<String> = (3..=52).map(|n| n.to_string()).collect();
        fields[0] = "S".to_owned();
        let text = format!("4242 (a (b) c) {}\n", fields.join(" "));
        assert_eq!(Stat::parse(&text), Some(Stat { utime: 14, stime: 15, start_ticks: 22, rss_pages: 24 }));
        assert_eq!(Stat::parse("4242 (cut"), None);
    }

    #[test]
    fn units_come_from_the_auxiliary_vector() {
        let entry = |key: usize, value: usize| [key.to_ne_bytes(), value.to_ne_bytes()].concat();
        let auxv = [entry(6, 65536), entry(17, 250), entry(0, 0), entry(6, 1)].concat();
        assert_eq!(units_from_auxv(&auxv), Units { page_size: 65536, ticks_per_second: 250 });
        assert_eq!(units_from_auxv(&[]), Units { page_size: 4096, ticks_per_second: 100 });
    }

    #[test]
    fn boot_time_is_read_from_its_line() {
        assert_eq!(boot_time("cpu  1 2 3\nbtime 1700000000\nprocesses 5\n"), Some(1_700_000_000));
        assert_eq!(boot_time("cpu  1 2 3\n"), None);
    }
}
