//! systemd's service notifications (sd_notify(3)) for a unit of `Type=notify`: `READY=1` once
//! the program serves, then, under `WatchdogSec=`, `WATCHDOG=1` only while the program's own
//! health verdict holds, so that systemd restarts a program that runs but is stuck as a liveness
//! probe does on Kubernetes (deploy/systemd/intake-writer.service says how the timeout is chosen).
//! Outside systemd (`NOTIFY_SOCKET` unset) nothing is sent.
//!
//! Written here rather than taken from a crate: the protocol is one datagram of text to the
//! socket `NOTIFY_SOCKET` names (a path, or with a leading `@` an abstract name), a few lines
//! of std, and each dependency is one more in the shared build of every package
//! (workspace-hack/Cargo.toml).

use std::io;
use std::os::linux::net::SocketAddrExt as _;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

/// Where systemd listens for this process's notifications.
pub struct Notifier {
    socket: UnixDatagram,
    address: SocketAddr,
}

impl Notifier {
    /// The socket of `NOTIFY_SOCKET`; `None` when the process was not started by systemd with
    /// notifications on.
    pub fn from_env() -> io::Result<Option<Notifier>> {
        match std::env::var_os("NOTIFY_SOCKET") {
            Some(socket) if !socket.is_empty() => Notifier::to(&socket.to_string_lossy()).map(Some),
            _ => Ok(None),
        }
    }

    /// The socket `name`: a path, or an abstract name after a leading `@`.
    pub fn to(name: &str) -> io::Result<Notifier> {
        let address = match name.strip_prefix('@') {
            Some(abstract_name) => SocketAddr::from_abstract_name(abstract_name.as_bytes())?,
            None => SocketAddr::from_pathname(name)?,
        };
        Ok(Notifier { socket: UnixDatagram::unbound()?, address })
    }

    /// Sends `state` (`READY=1`, `WATCHDOG=1`, ...); a datagram, never waited for.
    pub fn notify(&self, state: &str) -> io::Result<()> {
        self.socket.send_to_addr(state.as_bytes(), &self.address).map(|_| ())
    }
}

/// The watchdog timeout systemd set for this process (`WATCHDOG_USEC`, for `WATCHDOG_PID` if
/// that is given), if any.
pub fn watchdog_timeout() -> Option<Duration> {
    let usec = std::env::var("WATCHDOG_USEC").ok();
    let pid = std::env::var("WATCHDOG_PID").ok();
    watchdog_timeout_of(usec.as_deref(), pid.as_deref(), std::process::id())
}

fn watchdog_timeout_of(usec: Option<&str>, pid: Option<&str>, own_pid: u32) -> Option<Duration> {
    if pid.is_some_and(|pid| pid.trim().parse::<u32>().ok() != Some(own_pid)) {
        return None;
    }
    usec.and_then(|usec| usec.trim().parse::<u64>().ok()).filter(|&usec| usec > 0).map(Duration::from_micros)
}

/// How often the verdict is asked, and a ping sent if it holds: often enough that systemd
/// restarts the program within a second of `WatchdogSec=` after the verdict turned, so that the
/// unit's timeout alone says when that happens.
fn ping_interval(timeout: Duration) -> Duration {
    (timeout / 4).min(Duration::from_secs(1))
}

/// Tells systemd the program is ready, then keeps its watchdog fed while `healthy()` holds,
/// until the process ends. Does nothing outside systemd.
pub async fn serve(healthy: impl Fn() -> bool) {
    let notifier = match Notifier::from_env() {
        Ok(Some(notifier)) => notifier,
        Ok(None) => return,
        Err(error) => return tracing::warn!(%error, "NOTIFY_SOCKET is set but not usable: systemd is told nothing"),
    };
    notify(&notifier, watchdog_timeout(), healthy).await;
}

async fn notify(notifier: &Notifier, watchdog: Option<Duration>, healthy: impl Fn() -> bool) {
    if let Err(error) = notifier.notify("READY=1") {
        tracing::warn!(%error, "systemd not told that the program is ready");
    }
    let Some(timeout) = watchdog else { return };
    tracing::info!(timeout_ms = timeout.as_millis(), "feeding systemd's watchdog while healthy");
    let mut interval = tokio::time::interval(ping_interval(timeout));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut was_healthy = true;
    loop {
        interval.tick().await;
        let now_healthy = healthy();
        if now_healthy != was_healthy {
            if now_healthy {
                tracing::info!("healthy again: feeding systemd's watchdog again");
            } else {
                tracing::error!(timeout_ms = timeout.as_millis(), "not healthy: systemd's watchdog is no longer fed");
            }
            was_healthy = now_healthy;
        }
        if now_healthy {
            if let Err(error) = notifier.notify("WATCHDOG=1") {
                tracing::warn!(%error, "systemd's watchdog not fed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// A socket standing in for systemd's, and what arrives on it within `wait`.
    struct Systemd(UnixDatagram);

    impl Systemd {
        fn received(&self, wait: Duration) -> Vec<String> {
            let deadline = std::time::Instant::now() + wait;
            let mut received = Vec::new();
            let mut buffer = [0u8; 256];
            while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
                let _ = self.0.set_read_timeout(Some(left.max(Duration::from_millis(1))));
                match self.0.recv(&mut buffer) {
                    Ok(n) => received.push(String::from_utf8_lossy(&buffer[..n]).into_owned()),
                    Err(_) => break,
                }
            }
            received
        }
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn ready_then_watchdog_pings_only_while_healthy() {
        let dir = std::env::temp_dir().join(format!("intake-systemd-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        let path = dir.join("notify");
        let systemd = Systemd(UnixDatagram::bind(&path).unwrap_or_else(|e| panic!("{e}")));
        let notifier = Notifier::to(&path.to_string_lossy()).unwrap_or_else(|e| panic!("{e}"));
        let healthy = Arc::new(AtomicBool::new(true));
        let verdict = healthy.clone();
        // A timeout of 200 ms: a ping every 50 ms.
        let task = tokio::spawn(async move {
            notify(&notifier, Some(Duration::from_millis(200)), move || verdict.load(Ordering::SeqCst)).await;
        });

        let received = tokio::task::block_in_place(|| systemd.received(Duration::from_millis(400)));
        assert_eq!(received.first().map(String::as_str), Some("READY=1"), "{received:?}");
        let pings = received.iter().skip(1).filter(|r| *r == "WATCHDOG=1").count();
        assert!(pings >= 3 && pings == received.len() - 1, "pings while healthy: {received:?}");

        healthy.store(false, Ordering::SeqCst);
        tokio::task::block_in_place(|| systemd.received(Duration::from_millis(60)));
        let silent = tokio::task::block_in_place(|| systemd.received(Duration::from_millis(400)));
        assert!(silent.is_empty(), "no ping while unhealthy, for twice the timeout: {silent:?}");

        healthy.store(true, Ordering::SeqCst);
        let again = tokio::task::block_in_place(|| systemd.received(Duration::from_millis(200)));
        assert!(!again.is_empty() && again.iter().all(|r| r == "WATCHDOG=1"), "pings again: {again:?}");
        task.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn without_a_watchdog_only_ready_is_sent_and_an_abstract_socket_is_reached() {
        let name = format!("intake-systemd-test-{}", std::process::id());
        let address = SocketAddr::from_abstract_name(name.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
        let systemd = Systemd(UnixDatagram::bind_addr(&address).unwrap_or_else(|e| panic!("{e}")));
        let notifier = Notifier::to(&format!("@{name}")).unwrap_or_else(|e| panic!("{e}"));
        notify(&notifier, None, || true).await;
        assert_eq!(systemd.received(Duration::from_millis(100)), ["READY=1"]);
    }

    #[test]
    fn the_watchdog_timeout_is_systemd_s_for_this_process_only() {
        assert_eq!(watchdog_timeout_of(Some("120000000"), None, 7), Some(Duration::from_secs(120)));
        assert_eq!(watchdog_timeout_of(Some("120000000"), Some("7"), 7), Some(Duration::from_secs(120)));
        assert_eq!(watchdog_timeout_of(Some("120000000"), Some("8"), 7), None, "another process's (a parent's)");
        assert_eq!(watchdog_timeout_of(None, None, 7), None);
        assert_eq!(watchdog_timeout_of(Some("0"), None, 7), None);
        assert_eq!(ping_interval(Duration::from_secs(120)), Duration::from_secs(1));
        assert_eq!(ping_interval(Duration::from_millis(200)), Duration::from_millis(50));
    }
}
