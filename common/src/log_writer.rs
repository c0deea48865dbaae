//! Where log lines go: a buffer in memory that a thread of its own writes to stderr every few
//! milliseconds. A line costs its caller a copy under a short lock, never a write to stderr:
//! at tens of thousands of requests a second, the access log written on the request path cost
//! a write call a request and held every request behind a log destination that stopped taking
//! lines (a stuck pipe).
//!
//! Written here rather than with `tracing-appender`'s non-blocking writer: that one wakes its
//! thread for every line, and at the gateway's rate the wake-ups cost more than the writes did.

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// How long a line waits in the buffer at most, while stderr takes what it is given.
const FLUSH_INTERVAL: Duration = Duration::from_millis(20);
/// Past this much unwritten, new lines are dropped (and counted) instead of held.
const MAX_BUFFERED_BYTES: usize = 16 * 1024 * 1024;
/// How long a stopping process waits for the last lines to be written: a stuck destination
/// must not keep it from exiting.
const STOP_PATIENCE: Duration = Duration::from_secs(1);

struct Shared {
    buffer: Mutex<Vec<u8>>,
    stop: AtomicBool,
    wake: Condvar,
    dropped: AtomicU64,
}

/// The `MakeWriter` of the log: clones share one buffer.
#[derive(Clone)]
pub struct BufferedStderr {
    shared: Arc<Shared>,
}

/// Keeps the writing thread; dropped, it writes out what is buffered and stops.
pub struct LogGuard {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// The writer of the log and the guard of its thread.
pub fn buffered_stderr() -> (BufferedStderr, LogGuard) {
    buffered_to(std::io::stderr())
}

fn buffered_to(mut out: impl Write + Send + 'static) -> (BufferedStderr, LogGuard) {
    let shared = Arc::new(Shared {
        buffer: Mutex::new(Vec::with_capacity(64 * 1024)),
        stop: AtomicBool::new(false),
        wake: Condvar::new(),
        dropped: AtomicU64::new(0),
    });
    let writer = shared.clone();
    let thread = std::thread::Builder::new()
        .name("log-writer".into())
        .spawn(move || write_until_stopped(&writer, &mut out))
        .ok();
    (BufferedStderr { shared: shared.clone() }, LogGuard { shared, thread })
}

fn lock(buffer: &Mutex<Vec<u8>>) -> std::sync::MutexGuard<'_, Vec<u8>> {
    buffer.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Every interval (or when stopped), takes what is buffered and writes it in one write.
fn write_until_stopped(shared: &Shared, out: &mut impl Write) {
    let mut spare = Vec::with_capacity(64 * 1024);
    loop {
        let stopping = {
            let buffer = lock(&shared.buffer);
            let (mut buffer, _) = shared
                .wake
                .wait_timeout_while(buffer, FLUSH_INTERVAL, |_| !shared.stop.load(Ordering::Relaxed))
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            std::mem::swap(&mut *buffer, &mut spare);
            shared.stop.load(Ordering::Relaxed)
        };
        let dropped = shared.dropped.swap(0, Ordering::Relaxed);
        if dropped > 0 {
            let _ = writeln!(out, "the log could not keep up: {dropped} lines dropped");
        }
        if !spare.is_empty() {
            let _ = out.write_all(&spare);
            let _ = out.flush();
            spare.clear();
        }
        if stopping {
            return;
        }
    }
}

impl Drop for LogGuard {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.shared.wake.notify_one();
        let Some(thread) = self.thread.take() else { return };
        let deadline = std::time::Instant::now() + STOP_PATIENCE;
        // std has no join with a timeout; the thread ends within one write once stopped.
        while !thread.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        if thread.is_finished() {
            let _ = thread.join();
        }
    }
}

impl Write for BufferedStderr {
    fn write(&mut self, line: &[u8]) -> std::io::Result<usize> {
        let mut buffer = lock(&self.shared.buffer);
        if buffer.len() + line.len() > MAX_BUFFERED_BYTES {
            self.shared.dropped.fetch_add(1, Ordering::Relaxed);
        } else {
            buffer.extend_from_slice(line);
        }
        Ok(line.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for BufferedStderr {
    type Writer = BufferedStderr;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_written_in_order_and_what_is_buffered_is_written_on_stop() {
        let (mut writer, guard) = buffered_stderr();
        let shared = guard.shared.clone();
        drop(guard);
        writer.write_all(b"one\n").unwrap_or_else(|e| panic!("{e}"));
        writer.write_all(b"two\n").unwrap_or_else(|e| panic!("{e}"));
        let mut out = Vec::new();
        write_until_stopped(&shared, &mut out);
        assert_eq!(out, b"one\ntwo\n");
    }

    #[test]
    fn a_stuck_destination_does_not_hold_the_stop() {
        struct Stuck;
        impl Write for Stuck {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                loop {
                    std::thread::park();
                }
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let (mut writer, guard) = buffered_to(Stuck);
        writer.write_all(b"a line that is never taken\n").unwrap_or_else(|e| panic!("{e}"));
        // Until the thread has taken the line and is stuck writing it.
        let taken = std::time::Instant::now() + Duration::from_secs(5);
        while !lock(&guard.shared.buffer).is_empty() {
            assert!(std::time::Instant::now() < taken, "the line was never taken");
            std::thread::sleep(Duration::from_millis(5));
        }
        writer.write_all(b"and one more\n").unwrap_or_else(|e| panic!("{e}"));
        let started = std::time::Instant::now();
        drop(guard);
        assert!(started.elapsed() < STOP_PATIENCE * 2, "stopped after {:?}", started.elapsed());
    }

    #[test]
    fn a_full_buffer_drops_lines_and_says_how_many() {
        let (mut writer, guard) = buffered_stderr();
        let shared = guard.shared.clone();
        drop(guard);
        let line = vec![b'x'; MAX_BUFFERED_BYTES / 2];
        for _ in 0..3 {
            writer.write_all(&line).unwrap_or_else(|e| panic!("{e}"));
        }
        let mut out = Vec::new();
        write_until_stopped(&shared, &mut out);
        assert!(out.starts_with(b"the log could not keep up: 1 lines dropped\n"));
        assert_eq!(out.len() - out.iter().position(|b| *b == b'x').unwrap_or(0), MAX_BUFFERED_BYTES);
    }
}
