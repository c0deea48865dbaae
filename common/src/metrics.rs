//! The `/metrics` registry both services build: the process metrics under their standard names
//! at the root, the service's own under its prefix (`intake_gateway_*`, `intake_writer_*`), its
//! version as `<prefix>_build_info`, and the OpenMetrics text the ops port serves.

use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Metric, Registry};

/// The `Content-Type` of [`encode`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Collects a service's metrics, each registered where its handle is made
/// (`field: registrar.register("name", "help", Counter::default())`), so that a metric is named
/// once; [`Registrar::finish`] gives the registry to encode.
pub struct Registrar {
    prefix: &'static str,
    // prometheus-client hands out a prefixed sub-registry only as a borrow of its root, which
    // the service's struct of handles cannot hold while it is being built: the registrations
    // wait here until the root is made.
    pending: Vec<Registration>,
}

type Registration = Box<dyn FnOnce(&mut Registry)>;

impl Registrar {
    /// `version` is the service's `env!("CARGO_PKG_VERSION")`, exported as `<prefix>_build_info`:
    /// which version each process runs, for rollouts one instance at a time.
    pub fn new(prefix: &'static str, version: &'static str) -> Self {
        let mut registrar = Registrar { prefix, pending: Vec::new() };
        registrar.add("build", "The program's version", Info::new(vec![("version", version)]));
        registrar
    }

    /// Registers `metric` under the prefix and gives back a handle to it.
    pub fn register<M: Metric + Clone>(&mut self, name: &'static str, help: &'static str, metric: M) -> M {
        self.add(name, help, metric.clone());
        metric
    }

    fn add(&mut self, name: &'static str, help: &'static str, metric: impl Metric) {
        self.pending.push(Box::new(move |registry: &mut Registry| registry.register(name, help, metric)));
    }

    /// The root registry: the process metrics (standard names, no prefix), then the service's.
    pub fn finish(self) -> Registry {
        let mut root = Registry::default();
        crate::process::register(&mut root);
        let registry = root.sub_registry_with_prefix(self.prefix);
        for register in self.pending {
            register(registry);
        }
        root
    }
}

/// The registry's text for a scrape, of type [`CONTENT_TYPE`].
pub fn encode(registry: &Registry) -> String {
    let mut text = String::new();
    // Writing to a String cannot fail; a metric's own encoding error leaves a partial page,
    // which the scraper reports, rather than failing the ops port.
    let _ = prometheus_client::encoding::text::encode(&mut text, registry);
    text
}

/// A histogram of seconds whose buckets start at 1 ms and double, `count` of them
/// (15: up to 16.4 s, 17: up to 65.5 s).
pub fn seconds_histogram(count: u16) -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, count))
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;

    #[test]
    fn the_service_metrics_go_under_the_prefix_and_the_process_metrics_do_not() {
        let mut registrar = Registrar::new("intake_test", "1.2.3");
        let counter = registrar.register("things", "Things seen", Counter::<u64>::default());
        let histogram = registrar.register("wait_seconds", "Time waited", seconds_histogram(3));
        let registry = registrar.finish();
        counter.inc();
        histogram.observe(0.003);
        let text = encode(&registry);
        assert!(text.contains("intake_test_build_info{version=\"1.2.3\"} 1\n"), "{text}");
        assert!(text.contains("# HELP intake_test_things Things seen.\n"), "{text}");
        assert!(text.contains("intake_test_things_total 1\n"), "{text}");
        assert!(text.contains("intake_test_wait_seconds_bucket{le=\"0.004\"} 1\n"), "{text}");
        assert!(text.contains("intake_test_wait_seconds_bucket{le=\"0.002\"} 0\n"), "{text}");
        if cfg!(target_os = "linux") {
            assert!(text.contains("\nprocess_open_fds "), "{text}");
        }
    }
}
