//! Progress on standard error: a bar with rate and ETA on a terminal (indicatif), a plain line
//! every few seconds otherwise (a log file or CI keeps readable lines, not redraws).

use crate::tally::Counts;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::sync::watch;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// A bar when standard error is a terminal, lines otherwise.
    Auto,
    Bar,
    Lines,
    Off,
}

const LINE_EVERY: Duration = Duration::from_secs(5);
const BAR_EVERY: Duration = Duration::from_millis(200);

pub struct Progress {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

/// Shows progress until [`Progress::finish`]. `total` is the number of rows once known (it is
/// counted alongside for a file, never for standard input).
pub fn start(mode: Mode, total: Arc<OnceLock<u64>>, counts: impl Fn() -> Counts + Send + 'static) -> Progress {
    let mode = match mode {
        Mode::Auto if std::io::stderr().is_terminal() => Mode::Bar,
        Mode::Auto => Mode::Lines,
        other => other,
    };
    let (stop, stopped) = watch::channel(false);
    let task = tokio::spawn(async move {
        match mode {
            Mode::Bar => bar(total, counts, stopped).await,
            Mode::Lines => lines(total, counts, stopped).await,
            Mode::Auto | Mode::Off => {}
        }
    });
    Progress { stop, task }
}

impl Progress {
    pub async fn finish(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

/// Waits `every`; false once stopped.
async fn tick(stopped: &mut watch::Receiver<bool>, every: Duration) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(every) => true,
        _ = stopped.changed() => false,
    }
}

async fn bar(total: Arc<OnceLock<u64>>, counts: impl Fn() -> Counts, mut stopped: watch::Receiver<bool>) {
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template("{spinner} {elapsed} {pos} rows, {msg}") {
        bar.set_style(style);
    }
    // The bar, its length and its ETA once the total is known.
    let mut known = ProgressStyle::with_template("{elapsed} [{wide_bar}] {pos}/{len} rows, ETA {eta}, {msg}")
        .ok()
        .map(|style| style.progress_chars("=> "));
    loop {
        if let Some(total) = total.get().filter(|_| known.is_some()) {
            bar.set_length(*total);
            bar.set_style(known.take().unwrap_or_else(ProgressStyle::default_bar));
        }
        let now = counts();
        bar.set_position(now.done());
        bar.set_message(format!("{:.0} rows/s ({} failed, {} retries)", rate(&now), now.failed, now.retries));
        if !tick(&mut stopped, BAR_EVERY).await {
            break;
        }
    }
    bar.finish_and_clear();
}

async fn lines(total: Arc<OnceLock<u64>>, counts: impl Fn() -> Counts, mut stopped: watch::Receiver<bool>) {
    while tick(&mut stopped, LINE_EVERY).await {
        eprintln!("intake-send: {}", line(&counts(), total.get().copied()));
    }
}

fn line(now: &Counts, total: Option<u64>) -> String {
    let done = now.done();
    let rate = rate(now);
    let position = match total {
        Some(total) if total > 0 => {
            let eta =
                if rate > 0.0 { format!("{:.0} s", total.saturating_sub(done) as f64 / rate) } else { "?".to_owned() };
            format!("{done} of {total} rows ({}%), {rate:.0} rows/s, ETA {eta}", done * 100 / total)
        }
        _ => format!("{done} rows, {rate:.0} rows/s"),
    };
    format!("{position}; {} failed, {} retries", now.failed, now.retries)
}

/// Rows done a second since the start (the bar's own rate would be of recent ticks only).
fn rate(now: &Counts) -> f64 {
    if now.seconds > 0.0 {
        now.done() as f64 / now.seconds
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_has_the_rate_and_the_eta() {
        let now = Counts { created: 900, failed: 100, retries: 2, seconds: 10.0, ..Counts::default() };
        assert_eq!(line(&now, Some(4000)), "1000 of 4000 rows (25%), 100 rows/s, ETA 30 s; 100 failed, 2 retries");
        assert_eq!(line(&now, None), "1000 rows, 100 rows/s; 100 failed, 2 retries");
    }
}
