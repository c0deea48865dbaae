//! Where each write's time went, from the `Server-Timing` header the gateway answers every
//! written request with (docs/operations.md, "Where a write's time goes"), and where the time of
//! a scenario's slowest requests went, so that a missed latency target names its stage.
//!
//! Every timed request's stages are added into a bucket of its latency (1/32 of an octave wide):
//! the mean of each stage over a band of latencies chosen after the run (the slowest 1 %, the
//! median's) then comes from memory that does not grow with the run (a soak runs for hours), and
//! the clients' and a scenario's turns add up exactly. The few slowest requests are kept whole,
//! with their request ids, to be found in the services' logs.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

/// The header's stages in its order; `other`, the sum of those a newer gateway names that this
/// list does not, so that they are counted and not taken for `rest`; then two that the header's
/// total leaves: `rest`, the gateway's time that no stage covers (the answer's own making after
/// the reply's read), and `client`, what the load generator saw beyond the gateway's total
/// (itself, the network, opening a connection, and in an open loop the wait from the request's
/// due time). A replies topic without append times gives `reply` in place of `reply-produce`
/// and `reply-read`.
pub const STAGES: [&str; 12] = [
    "gateway",
    "produce",
    "fetch",
    "queue",
    "apply",
    "commit",
    "reply-produce",
    "reply-read",
    "reply",
    "other",
    "rest",
    "client",
];
const OTHER: usize = 9;
const REST: usize = 10;
pub const CLIENT: usize = 11;

/// Milliseconds by stage, in the order of [`STAGES`], and which of them a header named (bit i
/// for stage i): a stage named at 0 is shown as 0, one never named not at all.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Breakdown {
    pub ms: [f64; STAGES.len()],
    pub named: u16,
}

/// A header's stages and its total (ms); none for a header that names none of them. A metric not
/// known here is added to `other`, so that a gateway with a stage more still parses.
pub fn parse(header: &str) -> Option<(Breakdown, Option<f64>)> {
    let mut stages = Breakdown::default();
    let mut total = None;
    for metric in header.split(',') {
        let mut params = metric.split(';');
        let name = params.next().unwrap_or("").trim();
        let Some(ms) = params.find_map(|p| p.trim().strip_prefix("dur=")).and_then(|d| d.parse::<f64>().ok()) else {
            continue;
        };
        if name == "total" {
            total = Some(ms);
        } else {
            let i = STAGES[..OTHER].iter().position(|s| *s == name).unwrap_or(OTHER);
            stages.ms[i] += ms;
            stages.named |= 1 << i;
        }
    }
    // A header of no stage known here is not the gateway's (a proxy's, say).
    (stages.named & !(1 << OTHER) != 0).then_some((stages, total))
}

impl Breakdown {
    /// A request's stages, `rest` and `client` included, from its header and the latency the
    /// load generator saw. Each stage is rounded to 10 µs and a span the clocks disagree on
    /// counts 0, so the two derived ones are kept from going below 0.
    pub fn of(header: &str, latency: Duration) -> Option<Breakdown> {
        let (mut stages, total) = parse(header)?;
        if let Some(total) = total {
            stages.ms[REST] = (total - stages.ms[..REST].iter().sum::<f64>()).max(0.0);
            stages.ms[CLIENT] = (millis(latency) - total).max(0.0);
            stages.named |= 1 << REST | 1 << CLIENT;
        }
        Some(stages)
    }

    /// The stage that took the most, and its ms.
    pub fn largest(&self) -> Option<(&'static str, f64)> {
        STAGES
            .iter()
            .zip(self.ms)
            .filter(|(_, ms)| *ms > 0.0)
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(n, ms)| (*n, ms))
    }

    fn add(&mut self, other: &Breakdown) {
        for (sum, ms) in self.ms.iter_mut().zip(other.ms) {
            *sum += ms;
        }
        self.named |= other.named;
    }
}

/// One of the slowest requests, whole.
#[derive(Clone, Debug)]
pub struct Slow {
    pub latency: Duration,
    /// When it started (or, open loop, was due), to lay beside the other processes' logs.
    pub started: SystemTime,
    pub stages: Breakdown,
    pub request_id: Option<String>,
    /// The header as received.
    pub server_timing: String,
}

/// How many of the slowest requests are kept whole.
pub const SLOWEST_KEPT: usize = 5;

/// Buckets a power of two apart are cut in this many.
const BUCKETS_AN_OCTAVE: f64 = 32.0;

#[derive(Clone, Default)]
struct Bucket {
    requests: u64,
    latency_ms: f64,
    stages: Breakdown,
}

/// A scenario's timed requests: by latency bucket, and the slowest whole.
#[derive(Default)]
pub struct Tally {
    by_latency: BTreeMap<u32, Bucket>,
    /// Slowest first.
    pub slowest: Vec<Slow>,
    /// Which stages some header named (and `rest`, `client` once one had a total).
    named: u16,
}

fn bucket_of(latency: Duration) -> u32 {
    #[allow(clippy::cast_precision_loss)] // µs far below 2^52
    let us = latency.as_micros().max(1) as f64;
    (us.log2() * BUCKETS_AN_OCTAVE).floor() as u32
}

fn millis(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

impl Tally {
    /// An answered request with a `Server-Timing` header; `whole` gives its request id and
    /// header, asked only of one slow enough to be kept.
    pub fn add(&mut self, latency: Duration, stages: Breakdown, whole: impl FnOnce() -> (Option<String>, String)) {
        let bucket = self.by_latency.entry(bucket_of(latency)).or_default();
        bucket.requests += 1;
        bucket.latency_ms += millis(latency);
        bucket.stages.add(&stages);
        self.named |= stages.named;
        if self.slowest.len() < SLOWEST_KEPT || self.slowest.last().is_some_and(|s| latency > s.latency) {
            let (request_id, server_timing) = whole();
            let started = SystemTime::now().checked_sub(latency).unwrap_or(SystemTime::UNIX_EPOCH);
            self.keep(Slow { latency, started, stages, request_id, server_timing });
        }
    }

    /// [`Tally::add`] of an answer's headers; nothing for one without `Server-Timing`.
    pub fn add_answer(&mut self, latency: Duration, server_timing: &str, request_id: Option<&str>) {
        if let Some(stages) = Breakdown::of(server_timing, latency) {
            self.add(latency, stages, || (request_id.map(str::to_owned), server_timing.to_owned()));
        }
    }

    fn keep(&mut self, slow: Slow) {
        let at = self.slowest.partition_point(|s| s.latency >= slow.latency);
        self.slowest.insert(at, slow);
        self.slowest.truncate(SLOWEST_KEPT);
    }

    pub fn merge(&mut self, other: Tally) {
        for (key, theirs) in other.by_latency {
            let ours = self.by_latency.entry(key).or_default();
            ours.requests += theirs.requests;
            ours.latency_ms += theirs.latency_ms;
            ours.stages.add(&theirs.stages);
        }
        for slow in other.slowest {
            self.keep(slow);
        }
        self.named |= other.named;
    }

    pub fn requests(&self) -> u64 {
        self.by_latency.values().map(|b| b.requests).sum()
    }

    /// The stages some request's header named, in order: the tables leave out the others
    /// (`reply` on a replies topic that stamps its append times) rather than show them as 0.
    pub fn named(&self) -> impl Iterator<Item = (usize, &'static str)> + '_ {
        STAGES.iter().enumerate().filter(|(i, _)| self.named & (1 << i) != 0).map(|(i, name)| (i, *name))
    }

    /// The requests from `from`'s bucket to `to`'s, both included: with `from` a quantile's
    /// latency, the band holds every request at or above it, and those of its bucket just
    /// below (at most 1/32 of an octave, 2.2 %).
    pub fn band(&self, from: Duration, to: Duration) -> Band {
        let mut band = Band::default();
        for bucket in self.by_latency.range(bucket_of(from)..=bucket_of(to)).map(|(_, b)| b) {
            band.requests += bucket.requests;
            band.latency_ms += bucket.latency_ms;
            band.stages.add(&bucket.stages);
        }
        if band.requests > 0 {
            #[allow(clippy::cast_precision_loss)]
            let n = band.requests as f64;
            band.latency_ms /= n;
            band.stages.ms.iter_mut().for_each(|ms| *ms /= n);
        }
        band
    }
}

/// The requests of a band of latencies: how many, and their means.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Band {
    pub requests: u64,
    /// The mean latency the load generator saw.
    pub latency_ms: f64,
    /// The mean of each stage.
    pub stages: Breakdown,
}

impl Band {
    /// The stages from the largest mean down, with their share of the mean latency; those under
    /// 0.05 ms left out.
    pub fn ranked(&self) -> Vec<(&'static str, f64, f64)> {
        let mut ranked: Vec<(&'static str, f64, f64)> = STAGES
            .iter()
            .zip(self.stages.ms)
            .filter(|(_, ms)| *ms >= 0.05)
            .map(|(name, ms)| (*name, ms, if self.latency_ms > 0.0 { ms / self.latency_ms } else { 0.0 }))
            .collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
        ranked
    }

    /// Where most of the band's time went.
    pub fn dominant(&self) -> Option<(&'static str, f64, f64)> {
        self.ranked().into_iter().next()
    }

    /// "31.2 ms in apply (70 %), 6.1 in fetch (14 %), 3.0 in client (7 %)": the `top` largest.
    pub fn in_words(&self, top: usize) -> String {
        self.ranked()
            .into_iter()
            .take(top)
            .enumerate()
            .map(|(i, (name, ms, share))| {
                let unit = if i == 0 { " ms" } else { "" };
                format!("{ms:.1}{unit} in {name} ({:.0} %)", share * 100.0)
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str = "gateway;dur=0.45, produce;dur=0.12, fetch;dur=1.03, queue;dur=0.07, apply;dur=8.13, \
                          commit;dur=1.00, reply-produce;dur=0.00, reply-read;dur=1.04, total;dur=11.67";

    fn stages(pairs: &[(&str, f64)]) -> Breakdown {
        let mut b = Breakdown::default();
        for (name, ms) in pairs {
            let i = STAGES.iter().position(|s| s == name).unwrap_or_else(|| panic!("no stage {name}"));
            b.ms[i] = *ms;
            b.named |= 1 << i;
        }
        b
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-6
    }

    #[test]
    fn the_header_gives_each_stage_and_the_total_leaves_rest_and_client() {
        let (parsed, total) = parse(HEADER).unwrap_or_default();
        assert_eq!(total, Some(11.67));
        assert_eq!(parsed.ms[..REST], [0.45, 0.12, 1.03, 0.07, 8.13, 1.0, 0.0, 1.04, 0.0, 0.0]);
        assert_eq!(parsed.named, 0b1111_1111, "reply-produce named at 0; reply and other not named");
        let b = Breakdown::of(HEADER, Duration::from_micros(12_170)).unwrap_or_default();
        let sum: f64 = b.ms[..REST].iter().sum();
        assert!(close(sum, 11.84), "{sum}");
        assert_eq!(b.ms[REST], 0.0, "stages summing above the total (the broker's whole ms) leave 0");
        assert!(close(b.ms[CLIENT], 0.5), "{b:?}");
        assert_eq!(b.largest(), Some(("apply", 8.13)));
        assert_eq!(Breakdown::default().largest(), None);
        let rest = Breakdown::of("apply;dur=8, total;dur=10", Duration::from_millis(10)).unwrap_or_default();
        assert_eq!((rest.ms[REST], rest.ms[CLIENT]), (2.0, 0.0));
    }

    #[test]
    fn an_old_replies_topic_unknown_metrics_and_spacing_are_taken_as_they_come() {
        let b = Breakdown::of(
            "gateway;dur=1,apply;desc=\"statements\";dur=4.5 , reply;dur=2, later;dur=9, later-still;dur=1, total;dur=20",
            Duration::from_millis(23),
        )
        .unwrap_or_default();
        let expected =
            [("gateway", 1.0), ("apply", 4.5), ("reply", 2.0), ("other", 10.0), ("rest", 2.5), ("client", 3.0)];
        assert_eq!(b, stages(&expected));
        assert_eq!(parse("total;dur=3"), None, "no stage");
        assert_eq!(parse("gateway;dur=x"), None);
        assert_eq!(parse(""), None);
        let (_, total) = parse("gateway;dur=1").unwrap_or_default();
        assert_eq!(total, None);
    }

    #[test]
    fn a_band_is_the_mean_of_its_requests_and_names_where_most_went() {
        let mut tally = Tally::default();
        for _ in 0..98 {
            tally.add(Duration::from_millis(4), stages(&[("apply", 2.0), ("fetch", 1.0), ("client", 1.0)]), || {
                (None, String::new())
            });
        }
        for (ms, apply) in [(40, 30.0), (50, 34.0)] {
            tally.add(Duration::from_millis(ms), stages(&[("apply", apply), ("fetch", 6.0)]), || {
                (Some(format!("req-{ms}")), format!("apply;dur={apply}"))
            });
        }
        assert_eq!(tally.requests(), 100);
        let tail = tally.band(Duration::from_millis(40), Duration::from_millis(50));
        assert_eq!(tail.requests, 2);
        assert!(close(tail.latency_ms, 45.0) && close(tail.stages.ms[4], 32.0), "{tail:?}");
        let (name, ms, share) = tail.dominant().unwrap_or(("", 0.0, 0.0));
        assert_eq!(name, "apply");
        assert!(close(ms, 32.0) && close(share, 32.0 / 45.0));
        assert_eq!(tail.in_words(2), "32.0 ms in apply (71 %), 6.0 in fetch (13 %)");
        let median = tally.band(Duration::from_millis(4), Duration::from_millis(4));
        assert_eq!((median.requests, median.dominant().map(|d| d.0)), (98, Some("apply")));
        assert_eq!(tally.band(Duration::from_millis(5), Duration::from_millis(30)), Band::default());
        let seen: Vec<&str> = tally.named().map(|(_, name)| name).collect();
        assert_eq!(seen, ["fetch", "apply", "client"]);
    }

    #[test]
    fn a_band_from_a_quantile_takes_every_request_at_or_above_it_and_only_its_own_bucket_below() {
        let mut tally = Tally::default();
        for us in [9_900, 9_990, 10_000, 10_100, 30_000] {
            tally.add(Duration::from_micros(us), stages(&[("apply", 1.0)]), || (None, String::new()));
        }
        let band = tally.band(Duration::from_micros(10_000), Duration::from_micros(30_000));
        // 9.99 ms shares the bucket of 10 (from 9.976); 9.9 is in the one below.
        assert_eq!(band.requests, 4);
    }

    #[test]
    fn the_slowest_are_kept_whole_across_clients_and_the_rest_only_counted() {
        let whole = |ms: u64| move || (Some(format!("id-{ms}")), format!("apply;dur={ms}"));
        let (mut a, mut b) = (Tally::default(), Tally::default());
        for ms in [3, 90, 5, 70, 4, 60] {
            a.add(Duration::from_millis(ms), stages(&[("apply", ms as f64)]), whole(ms));
        }
        for ms in [80, 2, 100, 1] {
            b.add(Duration::from_millis(ms), stages(&[("fetch", ms as f64)]), whole(ms));
        }
        a.merge(b);
        let kept: Vec<u128> = a.slowest.iter().map(|s| s.latency.as_millis()).collect();
        assert_eq!(kept, [100, 90, 80, 70, 60]);
        assert_eq!(a.slowest[0].request_id.as_deref(), Some("id-100"));
        assert_eq!(a.slowest[0].server_timing, "apply;dur=100");
        assert_eq!(a.requests(), 10);
        let all = a.band(Duration::from_millis(1), Duration::from_millis(100));
        assert!(close(all.stages.ms[4], (3 + 90 + 5 + 70 + 4 + 60) as f64 / 10.0), "{all:?}");
        let seen: Vec<&str> = a.named().map(|(_, name)| name).collect();
        assert_eq!(seen, ["fetch", "apply"]);
    }

    #[test]
    fn a_request_without_the_header_is_not_counted() {
        let mut tally = Tally::default();
        tally.add_answer(Duration::from_millis(3), "", Some("r1"));
        tally.add_answer(Duration::from_millis(3), "cache;dur=1", Some("r2"));
        assert_eq!(tally.requests(), 0);
        tally.add_answer(Duration::from_millis(12), HEADER, Some("r3"));
        assert_eq!((tally.requests(), tally.slowest[0].request_id.as_deref()), (1, Some("r3")));
    }
}
