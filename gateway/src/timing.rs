//! Where a write's time went, stage by stage (docs/operations.md, "Where a write's time goes"):
//! from the gateway's, the broker's and the writer's instants of the chunk answered last. The
//! response's `Server-Timing` header and the request's log line carry it, so that a slow
//! request names its slow stage wherever it is seen.
//!
//! The stages that cross from one process to another compare two clocks: across hosts they are
//! as good as the hosts' clock sync, and a negative span is shown as 0. The broker's times have
//! millisecond resolution.

use intake_model::message::WriterTiming;
use std::fmt::{self, Write as _};
use std::time::{Duration, Instant};

/// A chunk's way out of the gateway.
#[derive(Debug, Clone, Copy)]
pub struct Sent {
    pub at: Instant,
    /// Epoch µs, the gateway's clock.
    pub wall_us: i64,
}

/// Its reply's arrival.
#[derive(Debug, Clone, Copy)]
pub struct Received {
    /// The broker's append time of the reply (epoch ms), on a replies topic that stamps it
    /// (`intake-writer topics` sets LogAppendTime); none on one that keeps the sender's time.
    pub appended_ms: Option<i64>,
    /// Epoch µs, the gateway's clock.
    pub wall_us: i64,
}

/// The stages, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stages {
    /// From the request's arrival until its last chunk was handed to the producer: reading the
    /// body, validating and hashing, the rate limit.
    pub gateway: f64,
    /// Until the broker appended it.
    pub produce: f64,
    /// Until a writer read it.
    pub fetch: f64,
    /// Until a worker took it.
    pub queue: f64,
    /// Until its transaction's commit was asked for: a connection, the statements.
    pub apply: f64,
    /// Until committed: the WAL's flush and, on the HA layout, a synchronous standby's.
    pub commit: f64,
    pub reply: ReplyLeg,
}

/// The reply's way back.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ReplyLeg {
    /// Until the broker appended the reply, then until the gateway read it.
    Split { produce: f64, read: f64 },
    /// Both, on a replies topic without append times.
    Whole(f64),
}

impl Stages {
    pub fn of(started: Instant, sent: Sent, writer: WriterTiming, received: Received) -> Stages {
        let appended_us = writer.appended_ms.saturating_mul(1000);
        let reply = match received.appended_ms {
            Some(ms) => ReplyLeg::Split {
                produce: span(writer.committed_us, ms.saturating_mul(1000)),
                read: span(ms.saturating_mul(1000), received.wall_us),
            },
            None => ReplyLeg::Whole(span(writer.committed_us, received.wall_us)),
        };
        Stages {
            gateway: millis(sent.at.saturating_duration_since(started)),
            produce: span(sent.wall_us, appended_us),
            fetch: span(appended_us, writer.read_us),
            queue: span(writer.read_us, writer.taken_us),
            apply: span(writer.taken_us, writer.commit_us),
            commit: span(writer.commit_us, writer.committed_us),
            reply,
        }
    }

    /// The `Server-Timing` header's value (W3C Server Timing), the request's whole time last.
    pub fn header(&self, total: Duration) -> String {
        let mut value = self.to_string();
        let _ = write!(value, ", total;dur={:.2}", millis(total));
        value
    }
}

/// The stages as `name;dur=ms` pairs, for the header and the log line.
impl fmt::Display for Stages {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Stages { gateway, produce, fetch, queue, apply, commit, reply } = *self;
        write!(
            f,
            "gateway;dur={gateway:.2}, produce;dur={produce:.2}, fetch;dur={fetch:.2}, queue;dur={queue:.2}, \
             apply;dur={apply:.2}, commit;dur={commit:.2}"
        )?;
        match reply {
            ReplyLeg::Split { produce, read } => {
                write!(f, ", reply-produce;dur={produce:.2}, reply-read;dur={read:.2}")
            }
            ReplyLeg::Whole(both) => write!(f, ", reply;dur={both:.2}"),
        }
    }
}

/// From one epoch-µs instant to a later one, in ms; 0 when the clocks disagree on the order.
fn span(from_us: i64, to_us: i64) -> f64 {
    #[allow(clippy::cast_precision_loss)] // a span of µs far below 2^52
    let ms = to_us.saturating_sub(from_us).max(0) as f64 / 1000.0;
    ms
}

fn millis(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_stage_runs_from_one_instant_to_the_next_and_a_clock_behind_counts_zero() {
        let started = Instant::now();
        let sent = Sent { at: started + Duration::from_micros(1_500), wall_us: 10_000_500 };
        let writer = WriterTiming {
            appended_ms: 10_002,
            read_us: 10_004_250,
            taken_us: 10_004_300,
            commit_us: 10_008_300,
            committed_us: 10_009_300,
        };
        let received = Received { appended_ms: Some(10_010), wall_us: 10_011_000 };
        let stages = Stages::of(started, sent, writer, received);
        assert_eq!(
            stages,
            Stages {
                gateway: 1.5,
                produce: 1.5,
                fetch: 2.25,
                queue: 0.05,
                apply: 4.0,
                commit: 1.0,
                reply: ReplyLeg::Split { produce: 0.7, read: 1.0 },
            }
        );
        assert_eq!(
            stages.header(Duration::from_micros(11_000)),
            "gateway;dur=1.50, produce;dur=1.50, fetch;dur=2.25, queue;dur=0.05, apply;dur=4.00, commit;dur=1.00, \
             reply-produce;dur=0.70, reply-read;dur=1.00, total;dur=11.00"
        );

        // A broker clock a little behind the gateway's, and a replies topic without append times.
        let behind = WriterTiming { appended_ms: 10_000, ..writer };
        let stages = Stages::of(started, sent, behind, Received { appended_ms: None, ..received });
        assert_eq!((stages.produce, stages.fetch), (0.0, 4.25));
        assert_eq!(stages.reply, ReplyLeg::Whole(1.7));
        assert!(stages.to_string().ends_with(", reply;dur=1.70"), "{stages}");
    }
}
