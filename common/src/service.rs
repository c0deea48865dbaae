//! What both services need at run time: the Kafka client settings and the shutdown signal.

use crate::config::KafkaArgs;

/// A librdkafka configuration with the program's defaults, then the operator's options, so
/// that an option given in configuration overrides a default.
pub fn kafka_config(args: &KafkaArgs, defaults: &[(&str, &str)]) -> rdkafka::ClientConfig {
    let mut config = rdkafka::ClientConfig::new();
    config.set("bootstrap.servers", &args.brokers);
    for (key, value) in defaults {
        config.set(*key, *value);
    }
    for (key, value) in &args.options {
        config.set(key, value);
    }
    config
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = terminate => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
