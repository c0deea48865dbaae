//! Readiness (docs/operations.md, "Ops ports"): ready means able to do the work now: PostgreSQL answers, the broker
//! knows the requests topic, and this gateway's reply partition is assigned and its leader
//! answers. The checks run in the background every second, so that `/readyz` costs nothing and
//! a flood of probes cannot load PostgreSQL or Kafka. Not ready from the moment shutdown starts,
//! before the listener closes.

use crate::sink::WriteSink;
use sqlx::PgPool;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const CHECK_EVERY: Duration = Duration::from_secs(1);
const CHECK_TIMEOUT: Duration = Duration::from_secs(1);

#[derive(Default)]
pub struct Readiness {
    shutting_down: AtomicBool,
    /// What failed at the last check; `None` before the first check.
    failing: Mutex<Option<Vec<&'static str>>>,
}

impl Readiness {
    /// `Ok` when ready; otherwise what is failing.
    pub fn status(&self) -> Result<(), Vec<&'static str>> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(vec!["shutting_down"]);
        }
        match &*self.failing.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(failing) if failing.is_empty() => Ok(()),
            Some(failing) => Err(failing.clone()),
            None => Err(vec!["starting"]),
        }
    }

    pub fn shutting_down(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    /// Checks now and then every second, forever.
    pub async fn keep_checking(self: Arc<Self>, pool: PgPool, writes: Arc<dyn WriteSink>) {
        let mut interval = tokio::time::interval(CHECK_EVERY);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            let (postgres, kafka) =
                tokio::join!(check_postgres(&pool), tokio::time::timeout(CHECK_TIMEOUT * 3, writes.probe()));
            let kafka = kafka.unwrap_or_else(|_| Err("timed out".into()));
            let mut failing = Vec::new();
            let mut errors = Vec::new();
            for (name, result) in [("postgres", postgres), ("kafka", kafka)] {
                if let Err(error) = result {
                    failing.push(name);
                    errors.push(format!("{name}: {error}"));
                }
            }
            let previous = self.failing.lock().unwrap_or_else(|p| p.into_inner()).clone();
            // Said once per change, not once a second.
            if previous.as_ref() != Some(&failing) {
                if failing.is_empty() {
                    tracing::info!("ready");
                } else {
                    tracing::warn!(failing = ?errors, "not ready");
                }
            }
            *self.failing.lock().unwrap_or_else(|p| p.into_inner()) = Some(failing);
        }
    }
}

async fn check_postgres(pool: &PgPool) -> Result<(), String> {
    match tokio::time::timeout(CHECK_TIMEOUT, sqlx::query("SELECT 1").execute(pool)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(error)) => Err(error.to_string()),
        Err(_) => Err("timed out".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(failing: Option<Vec<&'static str>>) -> Readiness {
        let readiness = Readiness::default();
        *readiness.failing.lock().unwrap_or_else(|p| p.into_inner()) = failing;
        readiness
    }

    #[test]
    fn ready_only_after_a_check_found_nothing_failing_and_never_once_shutting_down() {
        assert_eq!(with(None).status(), Err(vec!["starting"]));
        assert_eq!(with(Some(vec!["postgres"])).status(), Err(vec!["postgres"]));
        let ready = with(Some(Vec::new()));
        assert_eq!(ready.status(), Ok(()));
        ready.shutting_down();
        assert_eq!(ready.status(), Err(vec!["shutting_down"]));
    }
}
