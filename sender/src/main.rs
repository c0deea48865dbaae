//! `intake-send`: sends conversions from a CSV or JSON Lines file (or standard input) to
//! `POST {base}/conversions/batch`, for backfills and scripted uploads.
//!
//! The input is streamed: a reader thread turns rows into batches and hands them over a
//! channel as small as the number of batches in flight, so memory stays bounded whatever the
//! input's size. Exit status: 0 when every row was stored, 1 when some rows failed (they are in
//! the rejects file), 2 when the run could not finish (unreadable input, a refused key or
//! address, an unwritable rejects file, bad arguments).

mod batch;
mod client;
mod input;
mod progress;
mod rejects;
mod row;
mod tally;

use anyhow::{bail, Context, Result};
use batch::{Batch, Batcher, Item};
use clap::Parser;
use client::{Client, ItemResult, Outcome};
use input::{Format, Input};
use intake_model::validate::MAX_BATCH_ITEMS;
use rejects::Rejects;
use row::{Original, RowError};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tally::{Counts, Tally};
use tokio::sync::{mpsc, Semaphore};

/// Sends conversions from a CSV or JSON Lines file to the batch endpoint. CSV: a header row
/// names the fields; address.line1-style columns fill the address, tags.NAME columns the tags;
/// empty cells are omitted. Exit status 0 when every row was stored, 1 when some failed, 2 when
/// the run could not finish.
#[derive(Parser)]
#[command(name = "intake-send", version, about, long_about)]
struct Cli {
    /// The file to send (.csv, .jsonl or .ndjson), or - for standard input.
    input: PathBuf,
    /// The input's format; by default from the file's extension (required for standard input).
    #[arg(long, value_enum)]
    format: Option<Format>,
    /// The API's base address, ending in /v1 (https://api.example.com/v1).
    #[arg(long, env = "INTAKE_BASE_URL")]
    base_url: String,
    /// An API key with the conversions:write scope. Prefer the variable: a flag shows in the
    /// process list.
    #[arg(long, env = "INTAKE_API_KEY", hide_env_values = true)]
    key: String,
    /// Items per batch request (1 to 500); a batch is also kept under the 1 MiB body limit.
    #[arg(long, env = "INTAKE_SEND_BATCH_SIZE", default_value_t = MAX_BATCH_ITEMS as u16, value_parser = clap::value_parser!(u16).range(1..=MAX_BATCH_ITEMS as i64))]
    batch_size: u16,
    /// Batch requests in flight at once. Batches then finish out of input order: use 1 when the
    /// input sends the same conversion more than once and the last row must win.
    #[arg(long, env = "INTAKE_SEND_CONCURRENCY", default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    concurrency: u16,
    /// Retries of one batch (after a 429, a 5xx or a connection error) before its rows fail.
    #[arg(long, env = "INTAKE_SEND_MAX_RETRIES", default_value_t = 10)]
    max_retries: u32,
    /// Seconds one request may take before it counts as a connection error.
    #[arg(long, env = "INTAKE_SEND_TIMEOUT_SECS", default_value_t = 60)]
    timeout_secs: u64,
    /// Writes every failed row to this file in the input's format, with its error: an `error`
    /// column (CSV) or an `_error` member (JSON Lines). Corrected, it can be sent again as it is.
    #[arg(long)]
    rejects: Option<PathBuf>,
    /// The summary printed last on standard output: a line of text, or one JSON object
    /// {"rows","created","updated","unchanged","failed","retries","seconds"}.
    #[arg(long, value_enum, default_value = "text")]
    summary: Summary,
    /// Progress on standard error.
    #[arg(long, value_enum, default_value = "auto")]
    progress: progress::Mode,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Summary {
    Text,
    Json,
}

/// What the senders share: counts, the rejects file, and whether the run must stop.
struct Run {
    tally: Tally,
    client: Client,
    rejects: Option<Mutex<Rejects>>,
    stop: AtomicBool,
    /// Why the run could not finish.
    stopped_by: Mutex<Option<String>>,
}

/// What the reader hands to the senders.
enum Work {
    Batch(Batch),
    Reject(Original, Option<Vec<u8>>, RowError),
}

#[tokio::main]
async fn main() -> ExitCode {
    intake_common::reference::print_if_asked::<Cli>();
    let cli = Cli::parse();
    let summary = cli.summary;
    let (counts, stopped_by) = match start(cli).await {
        Ok(run) => {
            let counts = run.counts();
            let stopped_by = run.stopped_by.lock().unwrap_or_else(|e| e.into_inner()).take();
            (counts, stopped_by)
        }
        Err(error) => (Counts::default(), Some(format!("{error:#}"))),
    };
    if let Some(reason) = &stopped_by {
        eprintln!("intake-send: stopped: {reason}");
    }
    match summary {
        Summary::Json => println!("{}", counts.json()),
        Summary::Text => println!("{}", counts.text()),
    }
    match (stopped_by, counts.failed) {
        (Some(_), _) => ExitCode::from(2),
        (None, 0) => ExitCode::SUCCESS,
        (None, _) => ExitCode::from(1),
    }
}

/// Sends the whole input; an error only when the run cannot start.
async fn start(cli: Cli) -> Result<Arc<Run>> {
    let base_url = reqwest::Url::parse(&cli.base_url).context("--base-url")?;
    if !matches!(base_url.scheme(), "http" | "https") {
        bail!("--base-url must be an http:// or https:// address");
    }
    let stdin = cli.input.as_os_str() == "-";
    let format = match (cli.format, stdin) {
        (Some(format), _) => format,
        (None, true) => bail!("give --format csv or --format jsonl for standard input"),
        (None, false) => Format::of_path(&cli.input).with_context(|| {
            format!("cannot tell the format of {}: give --format csv or --format jsonl", cli.input.display())
        })?,
    };
    let input = Input::open(open(&cli.input)?, format)?;
    let rejects = cli.rejects.as_deref().map(|path| Rejects::create(path, input.rejects_header())).transpose()?;
    let client = Client::new(client::Settings {
        base_url: cli.base_url.clone(),
        key: cli.key.clone(),
        max_retries: cli.max_retries,
        timeout: Duration::from_secs(cli.timeout_secs),
    })?;
    let run = Arc::new(Run {
        tally: Tally::new(),
        client,
        rejects: rejects.map(Mutex::new),
        stop: AtomicBool::new(false),
        stopped_by: Mutex::new(None),
    });

    let total = Arc::new(OnceLock::new());
    if !stdin && cli.progress != progress::Mode::Off {
        count_in_background(cli.input.clone(), format, total.clone());
    }
    let progress = progress::start(cli.progress, total, {
        let run = run.clone();
        move || run.counts()
    });
    send_all(run.clone(), input, usize::from(cli.batch_size), usize::from(cli.concurrency)).await;
    progress.finish().await;
    if let Some(rejects) = &run.rejects {
        if let Err(error) = rejects.lock().unwrap_or_else(|e| e.into_inner()).flush() {
            run.stop_with(format!("writing the rejects file: {error:#}"));
        }
    }
    Ok(run)
}

fn open(path: &Path) -> Result<input::Source> {
    if path.as_os_str() == "-" {
        return Ok(Box::new(std::io::stdin()));
    }
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    Ok(Box::new(file))
}

/// Counts the file's rows alongside the run, for the progress bar's total and ETA.
fn count_in_background(path: PathBuf, format: Format, total: Arc<OnceLock<u64>>) {
    tokio::task::spawn_blocking(move || {
        if let Ok(count) = open(&path).and_then(|source| input::count_rows(source, format)) {
            let _ = total.set(count);
        }
    });
}

/// Reads the input on a thread of its own and sends its batches, `concurrency` at a time.
async fn send_all(run: Arc<Run>, mut input: Input, batch_size: usize, concurrency: usize) {
    let (work, mut works) = mpsc::channel::<Work>(concurrency);
    let reader = {
        let run = run.clone();
        tokio::task::spawn_blocking(move || read(&run, &mut input, batch_size, &work))
    };
    let permits = Arc::new(Semaphore::new(concurrency));
    let mut senders = tokio::task::JoinSet::new();
    while let Some(next) = works.recv().await {
        match next {
            Work::Reject(original, item, error) => run.reject(&original, item.as_deref(), &error),
            Work::Batch(batch) => {
                let Ok(permit) = permits.clone().acquire_owned().await else { break };
                if run.stop.load(Ordering::Relaxed) {
                    break;
                }
                let run = run.clone();
                senders.spawn(async move {
                    run.send(batch).await;
                    drop(permit);
                });
            }
        }
        while senders.try_join_next().is_some() {}
    }
    // The reader stops at its next row once the channel is closed.
    drop(works);
    while senders.join_next().await.is_some() {}
    match reader.await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => run.stop_with(format!("{error:#}")),
        Err(error) => run.stop_with(format!("the reader failed: {error}")),
    }
}

fn read(run: &Run, input: &mut Input, batch_size: usize, work: &mpsc::Sender<Work>) -> Result<()> {
    let mut batcher = Batcher::new(batch_size);
    while let Some(row) = input.next_row() {
        if run.stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        let row = row?;
        Tally::add(&run.tally.rows, 1);
        let next = match row.item {
            Err(error) => Some(Work::Reject(row.original, None, error)),
            Ok(json) => match Batcher::refuse(&json) {
                Some(error) => Some(Work::Reject(row.original, Some(json), error)),
                None => batcher.push(Item { original: row.original, json }).map(Work::Batch),
            },
        };
        if let Some(next) = next {
            if work.blocking_send(next).is_err() {
                return Ok(());
            }
        }
    }
    if let Some(batch) = batcher.take() {
        let _ = work.blocking_send(Work::Batch(batch));
    }
    Ok(())
}

impl Run {
    fn counts(&self) -> Counts {
        self.tally.counts(self.client.retries.load(Ordering::Relaxed))
    }

    async fn send(&self, batch: Batch) {
        match self.client.send(batch.body(), batch.items.len()).await {
            Outcome::Answered(results) => {
                for (item, result) in batch.items.iter().zip(results) {
                    match result {
                        ItemResult::Created => Tally::add(&self.tally.created, 1),
                        ItemResult::Updated => Tally::add(&self.tally.updated, 1),
                        ItemResult::Unchanged => Tally::add(&self.tally.unchanged, 1),
                        ItemResult::Failed(error) => self.reject(&item.original, Some(&item.json), &error),
                    }
                }
            }
            Outcome::Failed(error) => {
                for item in &batch.items {
                    self.reject(&item.original, Some(&item.json), &error);
                }
            }
            Outcome::Fatal(error) => self.stop_with(format!("the service refused the batch: {}", error.text())),
        }
    }

    fn reject(&self, original: &Original, item: Option<&[u8]>, error: &RowError) {
        Tally::add(&self.tally.failed, 1);
        if let Some(rejects) = &self.rejects {
            let written = rejects.lock().unwrap_or_else(|e| e.into_inner()).write(original, item, error);
            if let Err(error) = written {
                self.stop_with(format!("writing the rejects file: {error:#}"));
            }
        }
    }

    /// Stops the run (the first reason is kept).
    fn stop_with(&self, reason: String) {
        self.stop.store(true, Ordering::Relaxed);
        self.stopped_by.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(reason);
    }
}
