//! A worker: takes a workspace's next messages from the scheduler and answers each of them, in
//! order, then hands the group back. The chunks to apply go to PostgreSQL together, in one
//! transaction; a chunk that reached the topic after its deadline, a message that cannot be
//! read and one whose reply partition does not exist are answered where they stand in the
//! workspace's order: their request is marked failed (so that no later chunk of it is applied)
//! and, but for the expired chunk, the message is dead-lettered. The group's replies leave
//! together, in one round trip. Small groups of plain chunks of several workspaces share one
//! transaction (one commit), each workspace under its own lock; a workspace in trouble is
//! applied alone (`Worker::gather`, docs/architecture.md "Isolation in the writer").
//!
//! A workspace whose lock is held elsewhere is handed back at once, unapplied, and the worker
//! goes on with another one. A run that fails for any reason but an outage is applied again one
//! message at a time, so that only the bad message fails; that one is dead-lettered after its
//! attempts, its request is marked failed, and the later chunks of that request are answered
//! failed without being applied.

use crate::inbox::{record, Body, BoxFuture, Inbound, Partitions};
use crate::metrics::Metrics;
use crate::outbox::{DeadLetter, Outbox, Reply, Unanswerable};
use crate::retry::{shutdown_asked, Interrupted, Policy, Probe, Stop};
use crate::schedule::{Group, Scheduler, Taken};
use crate::store::{Chunk, Commit, Database, Fence, Lock, Run, WorkspaceRun};
use intake_common::config::now_us;
use intake_model::message::{ChunkOutcome, ErasureV1, RequestPart, WriteRequestV1};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// What a worker asks of PostgreSQL: `store.rs` on the pool in the writer; a double in the
/// tests, which thereby cover the worker's rules without a database (what the statements do is
/// covered by the end-to-end tests).
pub trait Store: Probe {
    /// Workspaces' runs of chunks in one transaction, each [`Run::Busy`] at once when its lock is
    /// held elsewhere; all [`Run::Superseded`] when `fence` says so once connected.
    fn apply_runs<'a>(
        &'a self,
        runs: &'a [WorkspaceRun<'a>],
        fence: Fence<'a>,
    ) -> BoxFuture<'a, Result<Vec<Run>, sqlx::Error>>;

    /// No chunk of each part's request after that part is applied, by any writer: one
    /// transaction for them all.
    fn mark_failed<'a>(
        &'a self,
        workspace_id: &'a str,
        parts: &'a [&'a RequestPart],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>>;

    /// An erasure read from the requests topic, applied unless the database has it; true when
    /// applied now.
    fn apply_erasure<'a>(&'a self, erasure: &'a ErasureV1) -> BoxFuture<'a, Result<bool, sqlx::Error>>;
}

impl Store for Database {
    fn apply_runs<'a>(
        &'a self,
        runs: &'a [WorkspaceRun<'a>],
        fence: Fence<'a>,
    ) -> BoxFuture<'a, Result<Vec<Run>, sqlx::Error>> {
        Box::pin(Database::apply_runs_fenced(self, runs, Lock::Try, fence))
    }

    fn mark_failed<'a>(
        &'a self,
        workspace_id: &'a str,
        parts: &'a [&'a RequestPart],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(self.mark_requests_failed(workspace_id, parts))
    }

    fn apply_erasure<'a>(&'a self, erasure: &'a ErasureV1) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            // A database error keeps its class (an outage is waited out); any other is the
            // record's own (a workspace that does not exist).
            crate::erase::apply_record(self, erasure).await.map_err(|error| {
                error.downcast::<sqlx::Error>().unwrap_or_else(|other| sqlx::Error::Decode(other.into()))
            })
        })
    }
}

impl Probe for Database {
    fn takes_writes(&self) -> BoxFuture<'_, bool> {
        Box::pin(async move { !self.schema_is_behind().await && self.probe_writes().await.is_ok() })
    }

    fn moved(&self) -> BoxFuture<'static, ()> {
        Box::pin(self.moves.next_move())
    }
}

/// Items of several workspaces applied in one transaction at most: one chunk's worth, so that a
/// single send waits for little more than its own apply.
const TOGETHER_ITEMS: usize = 100;
/// How long the workspaces of a transaction that failed beside others are applied alone.
const SET_APART: Duration = Duration::from_secs(60);

pub struct Worker {
    pub store: Arc<dyn Store>,
    pub outbox: Arc<Outbox>,
    pub scheduler: Arc<Scheduler<Inbound>>,
    pub partitions: Arc<dyn Partitions>,
    pub metrics: Arc<Metrics>,
    pub policy: Policy,
    /// A workspace found busy counts as progress of its partitions while it has waited less
    /// than this (docs/operations.md, "Ops ports").
    pub wait_bound: Duration,
    pub failpoint: Option<Failpoint>,
}

/// A test's failpoint, off unless `INTAKE_WRITER_FAILPOINT_PANIC` is set to
/// `<workspace id>[:<times>]`: a worker that takes that workspace's messages panics, `times`
/// times (1 if not given).
pub struct Failpoint {
    workspace_id: String,
    left: AtomicU32,
}

impl Failpoint {
    pub fn from_env() -> Option<Failpoint> {
        let value = std::env::var("INTAKE_WRITER_FAILPOINT_PANIC").ok().filter(|v| !v.is_empty())?;
        let (workspace_id, times) = match value.split_once(':') {
            Some((workspace_id, times)) => (workspace_id, times.parse().unwrap_or(1)),
            None => (value.as_str(), 1),
        };
        tracing::warn!(workspace_id, times, "failpoint set: workers will panic on this workspace");
        Some(Failpoint { workspace_id: workspace_id.to_owned(), left: AtomicU32::new(times) })
    }

    fn hit(&self, workspace_id: &str) {
        let fire = self.workspace_id == workspace_id
            && self.left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| left.checked_sub(1)).is_ok();
        assert!(!fire, "failpoint: a worker dies holding workspace {workspace_id}");
    }
}

/// How one message was answered.
struct Answer {
    outcome: ChunkOutcome,
    label: &'static str,
    /// Whether a reply is sent (a message whose reply partition does not exist gets none).
    reply: bool,
    /// The commit that applied it, if any.
    commit: Option<Commit>,
}

impl Answer {
    fn failed() -> Answer {
        Answer { outcome: ChunkOutcome::Failed, label: "failed", reply: true, commit: None }
    }

    fn expired() -> Answer {
        Answer { outcome: ChunkOutcome::Expired, label: "expired", reply: true, commit: None }
    }
}

/// Why a message is answered without being applied.
enum Unapplied<'m> {
    Expired,
    Unreadable,
    Unanswerable(Unanswerable),
    Erasure(&'m ErasureV1),
}

#[derive(Clone)]
pub struct Signals {
    /// Take no new group.
    pub shutdown: watch::Receiver<bool>,
    /// Stop waiting in the group in hand.
    pub abort: watch::Receiver<bool>,
}

impl Worker {
    /// Runs until shutdown. At shutdown it finishes the groups in hand (unless aborted) and
    /// leaves the rest unanswered and uncommitted for the partitions' next owner.
    pub async fn work(self: Arc<Self>, signals: Signals) {
        let Signals { mut shutdown, mut abort } = signals;
        loop {
            let first = tokio::select! {
                biased;
                () = shutdown_asked(&mut shutdown) => return,
                taken = self.scheduler.take() => taken,
            };
            if self.step_all(self.gather(first), &mut abort).await.is_err() {
                return;
            }
        }
    }

    /// The group taken first and, when it is small and plain, the groups of other workspaces
    /// ready now that join it in one transaction (one commit: under many senders of single
    /// conversions it is most of a write's cost). At most the scheduler's group size in
    /// messages and [`TOGETHER_ITEMS`] items; the first group that does not join goes back.
    pub(crate) fn gather<'s>(&'s self, first: Taken<'s, Inbound>) -> Vec<Taken<'s, Inbound>> {
        let mut items = group_items(first.group());
        if items > TOGETHER_ITEMS || !self.joinable(first.group()) {
            return vec![first];
        }
        let mut room = self.scheduler.max_group().saturating_sub(first.group().messages.len());
        let mut taken = vec![first];
        while let Some(next) = self.scheduler.try_take(room) {
            let size = group_items(next.group());
            if items + size > TOGETHER_ITEMS || !self.joinable(next.group()) {
                next.put_back();
                break;
            }
            items += size;
            room = room.saturating_sub(next.group().messages.len());
            taken.push(next);
        }
        taken
    }

    /// Whether a group may share a transaction with other workspaces': it holds chunks to
    /// apply whose reply partitions are known to exist, and nothing else, and its workspace is
    /// neither waiting for its lock, nor set apart, nor one that workers died on. A workspace
    /// in trouble is applied alone, and so stays its own.
    fn joinable(&self, group: &Group<Inbound>) -> bool {
        group.generation == self.partitions.generation()
            && group.panics == 0
            && !group.alone
            && group.messages.iter().all(|queued| match &queued.message.body {
                Body::Request(request) => self.outbox.reply_partition_known(request.reply_partition),
                Body::Expired(_) | Body::Unreadable(_) | Body::Erasure(_) => false,
            })
    }

    /// Answers the groups gathered: one alone, several in one transaction. When that
    /// transaction fails for any reason but an outage, its groups go back to their queues, set
    /// apart, so that any worker applies each alone and the one at fault holds up nobody.
    async fn step_all(
        &self,
        mut taken: Vec<Taken<'_, Inbound>>,
        abort: &mut watch::Receiver<bool>,
    ) -> Result<(), Interrupted> {
        if taken.len() == 1 {
            return match taken.pop() {
                Some(group) => self.step(group, abort).await,
                None => Ok(()),
            };
        }
        let failed = self.step_together(taken, abort).await?;
        if failed.is_empty() {
            return Ok(());
        }
        self.metrics.shared_transactions_failed.inc();
        self.scheduler.set_apart(failed.iter().map(|t| t.group().workspace_id.as_str()), SET_APART);
        // In reverse: each goes to the front of the ready ones, and they keep their order.
        for group in failed.into_iter().rev() {
            group.put_back();
        }
        Ok(())
    }

    /// Applies the groups in one transaction and answers them; gives them back when that
    /// transaction failed for good, to be answered one at a time.
    async fn step_together<'s>(
        &self,
        taken: Vec<Taken<'s, Inbound>>,
        abort: &mut watch::Receiver<bool>,
    ) -> Result<Vec<Taken<'s, Inbound>>, Interrupted> {
        if let Some(failpoint) = &self.failpoint {
            for group in &taken {
                failpoint.hit(&group.group().workspace_id);
            }
        }
        let taken_us = now_us();
        let requests: Vec<Vec<&WriteRequestV1>> =
            taken.iter().map(|t| t.group().messages.iter().filter_map(|q| applicable(&q.message)).collect()).collect();
        let runs: Vec<WorkspaceRun<'_>> =
            taken.iter().zip(&requests).map(|(t, r)| (t.group().workspace_id.as_str(), r.as_slice())).collect();
        let started = std::time::Instant::now();
        let once = Policy { max_attempts: 1, ..self.policy };
        let generations: Vec<u64> = taken.iter().map(|t| t.group().generation).collect();
        let fence = || generations.iter().all(|&generation| generation == self.partitions.generation());
        let applied = once
            .run_probed(
                "apply",
                &self.metrics,
                None,
                abort,
                || self.store.apply_runs(&runs, &fence),
                self.store.as_ref(),
            )
            .await;
        let outcomes = match applied {
            Ok(outcomes) if outcomes.len() == taken.len() => outcomes,
            Err(Stop::Interrupted) => return Err(Interrupted),
            Ok(_) | Err(Stop::GaveUp { .. } | Stop::Busy { .. }) => return Ok(taken),
        };
        self.metrics.apply_seconds.observe(started.elapsed().as_secs_f64());
        let answered: Vec<(Taken<'s, Inbound>, Vec<Answer>)> = taken
            .into_iter()
            .zip(outcomes)
            .map(|(group, run)| match run {
                Run::Done(chunks) => (group, chunks.into_iter().map(answer).collect()),
                Run::Busy | Run::Superseded => (group, Vec::new()),
            })
            .collect();
        self.answer(answered.iter().map(|(t, answers)| (t.group(), answers.as_slice())), taken_us, abort).await;
        for (group, answers) in answered {
            self.conclude(group, answers.len());
        }
        Ok(Vec::new())
    }

    /// Answers one group and hands it back.
    async fn step(&self, taken: Taken<'_, Inbound>, abort: &mut watch::Receiver<bool>) -> Result<(), Interrupted> {
        let group = taken.group();
        if group.generation != self.partitions.generation() {
            // Read before a rebalance: the partitions' owners read it again.
            self.scheduler.rebalanced(self.partitions.generation());
            self.apply_pauses();
            return Ok(());
        }
        let taken_us = now_us();
        let answers = self.handle(group, abort).await?;
        self.answer(std::iter::once((group, answers.as_slice())), taken_us, abort).await;
        if group.generation != self.partitions.generation() {
            // Superseded while in hand (`store::Fence`): what is left of it is read again.
            self.scheduler.rebalanced(self.partitions.generation());
        }
        self.conclude(taken, answers.len());
        Ok(())
    }

    /// Hands a group back with its first `answered` messages answered: stores the offsets and
    /// resumes the partitions this allows.
    fn conclude(&self, taken: Taken<'_, Inbound>, answered: usize) {
        let generation = taken.group().generation;
        let mut partitions: Vec<i32> = taken.group().messages.iter().map(|q| q.partition).collect();
        partitions.dedup();
        let afterwards = taken.finish(answered);
        self.partitions.store(generation, &afterwards.store);
        if !afterwards.resume.is_empty() {
            self.apply_pauses();
        }
        // A workspace found busy is progress too while the wait is short: the worker is alive,
        // and the wait is the workspace's, not the writer's. Past the bound it no longer is.
        match afterwards.waited {
            Some(waited) if answered == 0 && waited >= self.wait_bound => self.partitions.held(&partitions),
            _ => self.partitions.progressed(&partitions),
        }
    }

    fn apply_pauses(&self) {
        self.scheduler.apply_pauses(|p| self.partitions.pause(p), |p| self.partitions.resume(p));
    }

    /// The answers of the group's first messages, in order: all of them, unless the workspace's
    /// lock is held elsewhere.
    async fn handle(
        &self,
        group: &Group<Inbound>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<Vec<Answer>, Interrupted> {
        if group.panics >= self.policy.max_attempts {
            // The message that workers died on, again and again: given up on like one that
            // fails for good (the group is that message alone).
            let mut answers = Vec::new();
            if let Some(queued) = group.messages.first() {
                let error = format!("{} workers died applying it", group.panics);
                answers.extend(self.give_up(&queued.message, "worker_died", error, group.panics, shutdown).await?);
            }
            return Ok(answers);
        }
        if let Some(failpoint) = &self.failpoint {
            failpoint.hit(&group.workspace_id);
        }
        let current = || group.generation == self.partitions.generation();
        let fence: Fence<'_> = &current;
        let mut answers = Vec::with_capacity(group.messages.len());
        let mut run: Vec<&Inbound> = Vec::new();
        let mut next = 0;
        while let Some(queued) = group.messages.get(next) {
            let message = &queued.message;
            next += 1;
            let unapplied = match &message.body {
                Body::Request(request) => {
                    match self.outbox.reply_partition_exists(request.reply_partition, shutdown).await? {
                        Ok(()) => {
                            run.push(message);
                            continue;
                        }
                        Err(unanswerable) => Unapplied::Unanswerable(unanswerable),
                    }
                }
                Body::Expired(_) => Unapplied::Expired,
                Body::Unreadable(_) => Unapplied::Unreadable,
                Body::Erasure(erasure) => Unapplied::Erasure(erasure),
            };
            // What came before it is applied first.
            if !self.apply(&std::mem::take(&mut run), &mut answers, fence, shutdown).await? {
                return Ok(answers);
            }
            if let Unapplied::Expired = unapplied {
                // After an outage most of the backlog is expired: the expired chunks in a row
                // fail their requests in one transaction, not one each.
                let mut expired = vec![message];
                while let Some(queued) = group.messages.get(next).filter(|q| matches!(q.message.body, Body::Expired(_)))
                {
                    expired.push(&queued.message);
                    next += 1;
                }
                if !self.fail_requests(&expired, shutdown).await? {
                    return Ok(answers);
                }
                answers.extend(expired.iter().map(|_| Answer::expired()));
                continue;
            }
            match self.answer_unapplied(message, unapplied, shutdown).await? {
                Some(answer) => answers.push(answer),
                None => return Ok(answers),
            }
        }
        self.apply(&run, &mut answers, fence, shutdown).await?;
        Ok(answers)
    }

    /// Applies a run of one workspace's chunks; false when its lock was held elsewhere before
    /// all of them were applied.
    async fn apply(
        &self,
        run: &[&Inbound],
        answers: &mut Vec<Answer>,
        fence: Fence<'_>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<bool, Interrupted> {
        let requests: Vec<&WriteRequestV1> = run.iter().filter_map(|m| applicable(m)).collect();
        let Some(first) = requests.first() else { return Ok(true) };
        let started = std::time::Instant::now();
        let once = Policy { max_attempts: 1, ..self.policy };
        let runs = [(first.workspace_id.as_str(), requests.as_slice())];
        let together = once
            .run_probed(
                "apply",
                &self.metrics,
                None,
                shutdown,
                || self.store.apply_runs(&runs, fence),
                self.store.as_ref(),
            )
            .await
            .map(only);
        let before = answers.len();
        let complete = match together {
            Ok(Run::Done(chunks)) => {
                let complete = chunks.len() == requests.len();
                answers.extend(chunks.into_iter().map(answer));
                complete
            }
            Ok(Run::Busy | Run::Superseded) | Err(Stop::Busy { .. }) => false,
            Err(Stop::Interrupted) => return Err(Interrupted),
            // Something in the run fails for good: one by one, so that only that one fails.
            Err(Stop::GaveUp { .. }) => {
                let mut complete = true;
                for message in run {
                    match self.apply_one(message, fence, shutdown).await? {
                        Some(answer) => answers.push(answer),
                        None => {
                            complete = false;
                            break;
                        }
                    }
                }
                complete
            }
        };
        if answers.len() > before {
            self.metrics.apply_seconds.observe(started.elapsed().as_secs_f64());
        }
        Ok(complete)
    }

    /// One message through the policy's attempts; `None` when its workspace is busy, or its
    /// request could not be marked failed.
    async fn apply_one(
        &self,
        message: &Inbound,
        fence: Fence<'_>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<Option<Answer>, Interrupted> {
        let Some(request) = applicable(message) else { return Ok(Some(Answer::failed())) };
        let requests = [request];
        let runs = [(request.workspace_id.as_str(), &requests[..])];
        let applying = self.policy.run_probed(
            "apply",
            &self.metrics,
            None,
            shutdown,
            || self.store.apply_runs(&runs, fence),
            self.store.as_ref(),
        );
        match applying.await.map(only) {
            Ok(Run::Done(mut chunks)) => Ok(chunks.pop().map(answer)),
            Ok(Run::Busy | Run::Superseded) | Err(Stop::Busy { .. }) => Ok(None),
            Err(Stop::Interrupted) => Err(Interrupted),
            Err(Stop::GaveUp { error, attempts }) => {
                self.give_up(message, "apply_failed", error.to_string(), attempts, shutdown).await
            }
        }
    }

    /// Fails the message's request, dead-letters it and answers it failed; `None`, leaving it
    /// unanswered, when its request could not be marked failed.
    async fn give_up(
        &self,
        message: &Inbound,
        reason: &'static str,
        error: String,
        attempts: u32,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<Option<Answer>, Interrupted> {
        if !self.fail_requests(&[message], shutdown).await? {
            return Ok(None);
        }
        if !message.answered_before {
            self.outbox.dead_letter(DeadLetter { reason, error, attempts, message }, shutdown).await?;
        }
        Ok(Some(Answer::failed()))
    }

    /// `None`: left unanswered, its request not marked failed.
    async fn answer_unapplied(
        &self,
        message: &Inbound,
        unapplied: Unapplied<'_>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<Option<Answer>, Interrupted> {
        match unapplied {
            // In its workspace's order: what came before it was applied first.
            Unapplied::Erasure(erasure) => {
                let applying =
                    self.policy.run("erasure", &self.metrics, None, shutdown, || self.store.apply_erasure(erasure));
                match applying.await {
                    Ok(again) => {
                        if again {
                            tracing::warn!(workspace_id = %erasure.workspace_id, kind = %erasure.kind, "an erasure the database lacked was applied again from the requests topic");
                        }
                        let outcome = ChunkOutcome::Applied { results: Vec::new(), merged: Vec::new() };
                        Ok(Some(Answer { outcome, label: "erasure", reply: false, commit: None }))
                    }
                    Err(Stop::Interrupted) => Err(Interrupted),
                    Err(Stop::Busy { .. }) => Ok(None),
                    Err(Stop::GaveUp { error, attempts }) => {
                        let answer =
                            self.give_up(message, "erasure_failed", error.to_string(), attempts, shutdown).await?;
                        Ok(answer.map(|answer| Answer { reply: false, ..answer }))
                    }
                }
            }
            // Its gateway answered 500 before it reached the topic. Its request is failed too,
            // so that the prefix rule does not rest on append times being in order (a later
            // chunk appended in time after a leader change is not applied either).
            Unapplied::Expired => Ok(self.fail_requests(&[message], shutdown).await?.then(Answer::expired)),
            Unapplied::Unreadable => {
                let Body::Unreadable(unreadable) = &message.body else { return Ok(Some(Answer::failed())) };
                tracing::error!(error = %unreadable.error, partition = message.partition, offset = message.offset, "unreadable request message");
                let error = unreadable.error.clone();
                let answer = self.give_up(message, "unreadable", error, 1, shutdown).await?;
                Ok(answer.map(|answer| Answer { reply: unreadable.envelope.is_some(), ..answer }))
            }
            // No gateway waits on that partition, so no client was told anything of it.
            Unapplied::Unanswerable(Unanswerable { reason, attempts }) => {
                tracing::error!(
                    error = %reason,
                    reply_partition = message.reply_to().map(|(_, partition, _)| partition),
                    partition = message.partition,
                    offset = message.offset,
                    "a request message names a reply partition that does not exist"
                );
                let answer = self.give_up(message, "no_reply_partition", reason, attempts, shutdown).await?;
                Ok(answer.map(|answer| Answer { reply: false, ..answer }))
            }
        }
    }

    /// Marks the messages' requests failed (they are one workspace's) before a next chunk of
    /// theirs can be applied (the worker holds the workspace until then). Retried through
    /// outages. False when the mark failed for good or met a lock held elsewhere: the messages
    /// are then left unanswered, their offsets unstored, and their workspace tried again later,
    /// for a later chunk of their request must not be applied (a prefix, never a gap).
    async fn fail_requests(
        &self,
        messages: &[&Inbound],
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<bool, Interrupted> {
        let parts: Vec<&RequestPart> = messages.iter().filter_map(|m| m.request_part()).collect();
        let Some(first) = messages.first().filter(|_| !parts.is_empty()) else { return Ok(true) };
        let workspace_id = first.workspace_id();
        let marking = self
            .policy
            .run("mark_failed", &self.metrics, None, shutdown, || self.store.mark_failed(workspace_id, &parts));
        match marking.await {
            Ok(()) => Ok(true),
            Err(Stop::Interrupted) => Err(Interrupted),
            Err(Stop::GaveUp { error, .. } | Stop::Busy { error }) => {
                let request_ids: Vec<&str> = parts.iter().map(|p| p.id.as_str()).collect();
                tracing::error!(%error, ?request_ids, "could not mark the requests failed; their chunks wait unanswered");
                Ok(false)
            }
        }
    }

    /// Logs and counts the groups' answered messages, and sends their replies together, each
    /// with its way through the writer since a worker took it at `taken_us`.
    async fn answer<'g>(
        &self,
        groups: impl Iterator<Item = (&'g Group<Inbound>, &'g [Answer])>,
        taken_us: i64,
        shutdown: &mut watch::Receiver<bool>,
    ) {
        let answered: Vec<(&Inbound, &Answer)> =
            groups.flat_map(|(group, answers)| group.messages.iter().map(|q| &q.message).zip(answers)).collect();
        for &(message, answer) in &answered {
            record(&self.metrics, message, answer.label, &answer.outcome);
            if message.answered_before && answer.label == "applied" {
                self.metrics.reapplied_messages.inc();
            }
        }
        let replies = answered
            .into_iter()
            .filter(|(message, answer)| answer.reply && !message.answered_before)
            .filter_map(|(message, answer)| {
                let (correlation_id, partition, deadline_ms) = message.reply_to()?;
                let timing = message.timing(taken_us, answer.commit);
                Some(Reply { correlation_id, partition, deadline_ms, outcome: answer.outcome.clone(), timing })
            })
            .collect();
        // Interrupted at shutdown: the messages stay uncommitted for the partition's next owner.
        let _ = self.outbox.reply_all(replies, shutdown).await;
    }
}

fn group_items(group: &Group<Inbound>) -> usize {
    group.messages.iter().filter_map(|q| applicable(&q.message)).map(|r| r.items.len()).sum()
}

/// The outcome of a transaction of one workspace's run.
fn only(mut runs: Vec<Run>) -> Run {
    // None only if the store broke its contract; Busy leaves the messages to be tried again.
    runs.pop().unwrap_or(Run::Busy)
}

fn applicable(message: &Inbound) -> Option<&WriteRequestV1> {
    match &message.body {
        Body::Request(request) => Some(request),
        Body::Expired(_) | Body::Unreadable(_) | Body::Erasure(_) => None,
    }
}

fn answer(chunk: Chunk) -> Answer {
    match chunk {
        Chunk::Applied(applied) => Answer {
            label: if applied.first_time { "applied" } else { "already_applied" },
            outcome: ChunkOutcome::Applied { results: applied.results, merged: applied.merged },
            reply: true,
            commit: applied.commit,
        },
        Chunk::RequestFailed => {
            Answer { outcome: ChunkOutcome::Failed, label: "request_failed", reply: true, commit: None }
        }
    }
}

#[cfg(test)]
pub mod testing {
    //! A PostgreSQL double and a worker wired to doubles, for the tests of the worker and of
    //! its supervisor.

    use super::*;
    use crate::inbox::testing::RecordedPartitions;
    use crate::outbox::testing::MemorySender;
    use crate::schedule::Queued;
    use crate::store::Applied;
    use intake_model::message::{ItemResult, WriteResult};
    use std::collections::HashSet;
    use std::sync::Mutex;

    /// Applies by remembering: each run's applied correlation ids, each request marked failed.
    #[derive(Default)]
    pub struct MemoryStore {
        pub runs: Mutex<Vec<Vec<String>>>,
        /// (workspace, request id, chunk index).
        pub marked: Mutex<Vec<(String, String, u32)>>,
        /// Transactions that marked requests failed.
        pub mark_calls: std::sync::atomic::AtomicUsize,
        /// Workspaces whose lock is held elsewhere.
        pub busy: Mutex<HashSet<String>>,
        /// Correlation ids whose apply fails for good.
        pub refused: Mutex<HashSet<String>>,
        /// A failpoint on the marking: marks fail for good while set.
        pub marks_fail: std::sync::atomic::AtomicBool,
    }

    impl MemoryStore {
        pub fn runs(&self) -> Vec<Vec<String>> {
            self.runs.lock().unwrap_or_else(|e| e.into_inner()).clone()
        }

        pub fn set_busy(&self, workspace_id: &str, busy: bool) {
            let mut held = self.busy.lock().unwrap_or_else(|e| e.into_inner());
            if busy {
                held.insert(workspace_id.to_owned());
            } else {
                held.remove(workspace_id);
            }
        }
    }

    fn applied_chunk(request: &WriteRequestV1) -> Chunk {
        Chunk::Applied(Applied {
            results: request
                .items
                .iter()
                .map(|item| ItemResult {
                    id: format!("cnv_{}", item.external_id.as_str()),
                    event: item.event.as_str().to_owned(),
                    external_id: item.external_id.as_str().to_owned(),
                    chain_id: "chn_1".into(),
                    result: WriteResult::Created,
                })
                .collect(),
            merged: Vec::new(),
            first_time: true,
            commit: None,
        })
    }

    impl Store for MemoryStore {
        /// One entry in `runs` per transaction that applied anything.
        fn apply_runs<'a>(
            &'a self,
            runs: &'a [WorkspaceRun<'a>],
            fence: Fence<'a>,
        ) -> BoxFuture<'a, Result<Vec<Run>, sqlx::Error>> {
            Box::pin(async move {
                if !fence() {
                    return Ok(runs.iter().map(|_| Run::Superseded).collect());
                }
                let busy = self.busy.lock().unwrap_or_else(|e| e.into_inner()).clone();
                let refused = self.refused.lock().unwrap_or_else(|e| e.into_inner());
                if runs.iter().flat_map(|(_, requests)| requests.iter()).any(|r| refused.contains(&r.correlation_id)) {
                    return Err(sqlx::Error::RowNotFound);
                }
                let marked = self.marked.lock().unwrap_or_else(|e| e.into_inner());
                let failed = |r: &WriteRequestV1| {
                    r.request.as_ref().is_some_and(|p| marked.iter().any(|(_, id, at)| *id == p.id && p.index > *at))
                };
                let mut applied: Vec<String> = Vec::new();
                let outcomes = runs
                    .iter()
                    .map(|&(workspace_id, requests)| {
                        if busy.contains(workspace_id) {
                            return Run::Busy;
                        }
                        applied.extend(requests.iter().filter(|r| !failed(r)).map(|r| r.correlation_id.clone()));
                        Run::Done(
                            requests
                                .iter()
                                .map(|r| if failed(r) { Chunk::RequestFailed } else { applied_chunk(r) })
                                .collect(),
                        )
                    })
                    .collect();
                if !applied.is_empty() {
                    self.runs.lock().unwrap_or_else(|e| e.into_inner()).push(applied);
                }
                Ok(outcomes)
            })
        }

        fn mark_failed<'a>(
            &'a self,
            workspace_id: &'a str,
            parts: &'a [&'a RequestPart],
        ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
            self.mark_calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if self.marks_fail.load(std::sync::atomic::Ordering::Relaxed) {
                return Box::pin(std::future::ready(Err(sqlx::Error::RowNotFound)));
            }
            let marks = parts.iter().map(|part| (workspace_id.to_owned(), part.id.clone(), part.index));
            self.marked.lock().unwrap_or_else(|e| e.into_inner()).extend(marks);
            Box::pin(std::future::ready(Ok(())))
        }

        /// An erasure is a run of its own, named `erase:<kind>`.
        fn apply_erasure<'a>(&'a self, erasure: &'a ErasureV1) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
            self.runs.lock().unwrap_or_else(|e| e.into_inner()).push(vec![format!("erase:{}", erasure.kind)]);
            Box::pin(std::future::ready(Ok(true)))
        }
    }

    impl Probe for MemoryStore {
        fn takes_writes(&self) -> BoxFuture<'_, bool> {
            Box::pin(std::future::ready(true))
        }

        fn moved(&self) -> BoxFuture<'static, ()> {
            Box::pin(std::future::pending())
        }
    }

    pub struct Rig {
        pub worker: Arc<Worker>,
        pub store: Arc<MemoryStore>,
        pub sender: Arc<MemorySender>,
        pub partitions: Arc<RecordedPartitions>,
    }

    /// A worker on doubles (replies topic of 2 partitions, 2 attempts, no budget to speak of);
    /// `failpoint`: (workspace, times).
    pub fn rig(wait_bound: Duration, failpoint: Option<(&str, u32)>) -> Rig {
        let store = Arc::new(MemoryStore::default());
        let sender = Arc::new(MemorySender::new(2));
        let partitions = Arc::new(RecordedPartitions::default());
        let metrics = Arc::new(Metrics::new());
        let policy = crate::outbox::testing::policy();
        let worker = Arc::new(Worker {
            store: store.clone(),
            outbox: Arc::new(crate::outbox::testing::outbox(sender.clone(), metrics.clone())),
            scheduler: Arc::new(Scheduler::new(1 << 30, 64)),
            partitions: partitions.clone(),
            metrics,
            policy,
            wait_bound,
            failpoint: failpoint.map(|(workspace_id, times)| Failpoint {
                workspace_id: workspace_id.to_owned(),
                left: AtomicU32::new(times),
            }),
        });
        Rig { worker, store, sender, partitions }
    }

    impl Rig {
        /// Queues a message for its workspace, as the reader does.
        pub fn read(&self, message: &impl rdkafka::message::Message) {
            let crate::inbox::Admission::Take { answered_before } =
                self.partitions.admit(message.partition(), message.offset())
            else {
                return;
            };
            let (mut inbound, bytes) = Inbound::read(message);
            inbound.answered_before = answered_before;
            let workspace_id = inbound.workspace_id().to_owned();
            let queued = Queued { partition: inbound.partition, offset: inbound.offset, bytes, message: inbound };
            self.worker.scheduler.push(&workspace_id, queued, true);
        }

        /// The worker answers the next group.
        pub async fn step(&self) {
            let taken = self.worker.scheduler.take().await;
            let _ = self.worker.step(taken, &mut watch::channel(false).1).await;
        }

        /// The worker answers the next group and the other workspaces' groups ready beside it.
        pub async fn step_all(&self) {
            let (_keep, mut abort) = watch::channel(false);
            // The reply partitions known, as once the writer has answered a message.
            let _ = self.worker.outbox.reply_partition_exists(0, &mut abort).await;
            let first = self.worker.scheduler.take().await;
            let _ = self.worker.step_all(self.worker.gather(first), &mut abort).await;
        }

        /// (correlation id, partition, status) of each reply sent.
        pub fn replies(&self) -> Vec<(String, Option<i32>, String)> {
            self.sender
                .sent_to("replies")
                .iter()
                .map(|s| {
                    let status = s.json()["outcome"]["status"].as_str().unwrap_or_default().to_owned();
                    (String::from_utf8_lossy(&s.key).into_owned(), s.partition, status)
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::rig;
    use super::*;
    use crate::inbox::testing::{message, raw, request, RecordedPartitions};
    use crate::metrics;
    use intake_model::message::WriteRequest;

    fn reply(correlation_id: &str, partition: i32, status: &str) -> (String, Option<i32>, String) {
        (correlation_id.to_owned(), Some(partition), status.to_owned())
    }

    /// Where [`read_three_workspaces`] puts the messages.
    enum Spread {
        /// Partition 0, in order.
        OnePartition,
        /// Each at offset 0 of a partition of its own.
        PartitionEach,
    }

    /// One single-item message of each of ws_a, ws_b and ws_c (correlation ids a1, b1, c1).
    fn read_three_workspaces(rig: &super::testing::Rig, spread: Spread) {
        for (n, (workspace, id)) in [("ws_a", "a1"), ("ws_b", "b1"), ("ws_c", "c1")].into_iter().enumerate() {
            let (partition, offset) = match spread {
                Spread::OnePartition => (0, i64::try_from(n).unwrap_or(0)),
                Spread::PartitionEach => (i32::try_from(n).unwrap_or(0), 0),
            };
            rig.read(&message(&request(workspace, id, 1), partition, offset, 0));
        }
    }

    fn part(request: &mut WriteRequestV1, id: &str, index: u32) {
        request.request = Some(RequestPart { id: id.to_owned(), index });
    }

    #[tokio::test]
    async fn an_erasure_read_from_the_topic_is_applied_in_its_workspaces_order_and_answered_to_nobody() {
        let rig = rig(Duration::from_secs(60), None);
        let erasure = intake_model::message::WriteRequest::Erasure(ErasureV1 {
            workspace_id: "ws_a".into(),
            kind: "email".into(),
            value: "ab".repeat(32),
            erased_at_us: 1,
        });
        let payload = serde_json::to_vec(&erasure).unwrap_or_default();
        rig.read(&message(&request("ws_a", "c1", 1), 0, 0, 0));
        rig.read(&crate::inbox::testing::raw(b"ws_a", payload, 0, 1, 0));
        rig.read(&message(&request("ws_a", "c2", 1), 0, 2, 0));
        rig.step().await;
        assert_eq!(rig.store.runs(), vec![vec!["c1"], vec!["erase:email"], vec!["c2"]]);
        assert_eq!(rig.replies(), vec![reply("c1", 1, "applied"), reply("c2", 1, "applied")]);
        assert_eq!(RecordedPartitions::stored(&rig.partitions), vec![(0, 3)]);
        assert!(rig.sender.sent_to("dlq").is_empty());
    }

    #[tokio::test]
    async fn what_a_rewind_reads_again_below_what_was_answered_is_applied_and_replied_to_once() {
        let rig = rig(Duration::from_secs(60), None);
        rig.partitions.answered_below.lock().unwrap_or_else(|e| e.into_inner()).insert(0, 2);
        for (offset, id) in ["c1", "c2", "c3"].into_iter().enumerate() {
            rig.read(&message(&request("ws_a", id, 1), 0, i64::try_from(offset).unwrap_or(0), 0));
        }
        rig.step().await;
        assert_eq!(rig.store.runs(), vec![vec!["c1", "c2", "c3"]], "the database may lack any of them");
        assert_eq!(rig.replies(), vec![reply("c3", 1, "applied")], "c1 and c2 were answered before the rewind");
        assert_eq!(RecordedPartitions::stored(&rig.partitions), vec![(0, 3)]);
    }

    #[tokio::test]
    async fn a_group_superseded_by_a_rewind_while_in_hand_is_neither_applied_nor_answered() {
        let rig = rig(Duration::from_secs(60), None);
        rig.read(&message(&request("ws_a", "c1", 1), 0, 0, 0));
        let taken = rig.worker.scheduler.take().await;
        // A connection found the database on another lineage meanwhile.
        rig.partitions.generation.store(1, std::sync::atomic::Ordering::SeqCst);
        let _ = rig.worker.step(taken, &mut watch::channel(false).1).await;
        assert!(rig.store.runs().is_empty());
        assert!(rig.replies().is_empty());
        assert!(RecordedPartitions::stored(&rig.partitions).is_empty());
        rig.partitions.rewinding.lock().unwrap_or_else(|e| e.into_inner()).push(0);
        rig.read(&message(&request("ws_a", "c1", 1), 0, 0, 0));
        assert_eq!(rig.worker.scheduler.backlog(), 0, "until its rewind, what is read of the partition is dropped");
    }

    #[tokio::test]
    async fn a_workspaces_messages_are_applied_together_answered_and_their_offsets_stored() {
        let rig = rig(Duration::from_secs(60), None);
        for (offset, id) in ["c1", "c2", "c3"].into_iter().enumerate() {
            rig.read(&message(&request("ws_a", id, 2), 0, i64::try_from(offset).unwrap_or(0), 0));
        }
        rig.step().await;
        assert_eq!(rig.store.runs(), vec![vec!["c1", "c2", "c3"]], "one transaction");
        assert_eq!(
            rig.replies(),
            vec![reply("c1", 1, "applied"), reply("c2", 1, "applied"), reply("c3", 1, "applied")]
        );
        assert_eq!(*rig.partitions.stored.lock().unwrap_or_else(|e| e.into_inner()), vec![(0, 3)]);
        assert_eq!(RecordedPartitions::take(&rig.partitions.progressed), vec![0]);
        let metrics = &rig.worker.metrics;
        assert_eq!(metrics.messages.get_or_create(&metrics::Outcome { outcome: "applied" }).get(), 3);
        assert_eq!(metrics.items.get_or_create(&metrics::ItemResult { result: "created" }).get(), 6);
        assert_eq!(rig.worker.scheduler.held_bytes(), 0, "nothing held once answered");
    }

    #[tokio::test]
    async fn single_sends_of_several_workspaces_share_one_transaction_and_are_each_answered() {
        let rig = rig(Duration::from_secs(60), None);
        read_three_workspaces(&rig, Spread::PartitionEach);
        rig.step_all().await;
        assert_eq!(rig.store.runs(), vec![vec!["a1", "b1", "c1"]], "one transaction");
        assert_eq!(
            rig.replies(),
            vec![reply("a1", 1, "applied"), reply("b1", 1, "applied"), reply("c1", 1, "applied")]
        );
        let mut stored = rig.partitions.stored.lock().unwrap_or_else(|e| e.into_inner()).clone();
        stored.sort_unstable();
        assert_eq!(stored, vec![(0, 1), (1, 1), (2, 1)]);
        assert_eq!(rig.worker.scheduler.held_bytes(), 0);
    }

    #[tokio::test]
    async fn a_busy_workspace_among_others_waits_and_is_applied_later_in_a_transaction_of_its_own() {
        let rig = rig(Duration::from_secs(60), None);
        rig.store.set_busy("ws_b", true);
        read_three_workspaces(&rig, Spread::OnePartition);
        rig.step_all().await;
        assert_eq!(rig.store.runs(), vec![vec!["a1", "c1"]]);
        assert_eq!(rig.replies(), vec![reply("a1", 1, "applied"), reply("c1", 1, "applied")]);
        assert_eq!(
            *rig.partitions.stored.lock().unwrap_or_else(|e| e.into_inner()),
            vec![(0, 1), (0, 1)],
            "not past b1"
        );
        assert_eq!(rig.worker.scheduler.waiting().len(), 1);
        rig.store.set_busy("ws_b", false);
        rig.read(&message(&request("ws_d", "d1", 1), 0, 3, 0));
        rig.step_all().await;
        rig.step_all().await;
        assert_eq!(rig.store.runs()[1..], [vec!["d1"], vec!["b1"]], "the workspace that waited, alone");
    }

    #[tokio::test]
    async fn workspaces_together_whose_transaction_fails_for_good_go_back_and_are_applied_each_alone() {
        let rig = rig(Duration::from_secs(60), None);
        rig.store.refused.lock().unwrap_or_else(|e| e.into_inner()).insert("b1".into());
        read_three_workspaces(&rig, Spread::OnePartition);
        rig.step_all().await;
        assert!(rig.store.runs().is_empty() && rig.replies().is_empty(), "handed back, for any worker to take");
        for _ in 0..3 {
            rig.step_all().await;
        }
        assert_eq!(rig.store.runs(), vec![vec!["a1"], vec!["c1"]]);
        let mut replies = rig.replies();
        replies.sort();
        assert_eq!(replies, vec![reply("a1", 1, "applied"), reply("b1", 1, "failed"), reply("c1", 1, "applied")]);
        let letters = rig.sender.sent_to("dlq");
        assert_eq!((letters.len(), letters[0].header("reason")), (1, Some("apply_failed")));
        assert_eq!(rig.worker.metrics.shared_transactions_failed.get(), 1);
        rig.read(&message(&request("ws_a", "a2", 1), 0, 3, 0));
        rig.read(&message(&request("ws_d", "d1", 1), 0, 4, 0));
        rig.step_all().await;
        rig.step_all().await;
        assert_eq!(rig.store.runs()[2..], [vec!["a2"], vec!["d1"]], "set apart for a while");
    }

    #[tokio::test]
    async fn a_group_of_more_than_a_chunk_of_items_is_applied_alone_and_others_join_each_other() {
        let rig = rig(Duration::from_secs(60), None);
        rig.read(&message(&request("ws_big", "big", 101), 0, 0, 0));
        rig.read(&message(&request("ws_a", "a1", 1), 1, 0, 0));
        rig.read(&message(&request("ws_b", "b1", 99), 1, 1, 0));
        rig.read(&message(&request("ws_c", "c1", 1), 1, 2, 0));
        rig.step_all().await;
        rig.step_all().await;
        rig.step_all().await;
        assert_eq!(rig.store.runs(), vec![vec!["big"], vec!["a1", "b1"], vec!["c1"]]);
    }

    #[tokio::test]
    async fn a_batch_among_steady_single_sends_is_applied_at_the_next_step() {
        let rig = rig(Duration::from_secs(60), None);
        rig.read(&message(&request("ws_a", "a1", 1), 1, 0, 0));
        rig.read(&message(&request("ws_big", "big", 101), 0, 0, 0));
        // One new single send of another workspace arrives before each step.
        for step in 0..4 {
            rig.read(&message(&request(&format!("ws_s{step}"), &format!("s{step}"), 1), 2, step, 0));
            rig.step_all().await;
        }
        let runs = rig.store.runs();
        let at = runs.iter().position(|run| run.iter().any(|id| id == "big"));
        assert_eq!(at, Some(1), "the batch is applied at the step after the one that could not take it in: {runs:?}");
    }

    #[tokio::test]
    async fn a_worker_takes_other_workspaces_only_up_to_the_group_size_in_messages() {
        let rig = rig(Duration::from_secs(60), None);
        for offset in 0..63 {
            rig.read(&message(&request("ws_a", &format!("a{offset}"), 1), 0, offset, 0));
        }
        rig.read(&message(&request("ws_b", "b1", 1), 1, 0, 0));
        rig.read(&message(&request("ws_b", "b2", 1), 1, 1, 0));
        rig.step_all().await;
        let runs = rig.store.runs();
        assert_eq!((runs.len(), runs[0].len(), runs[0].last().map(String::as_str)), (1, 64, Some("b1")));
        rig.step_all().await;
        assert_eq!(rig.store.runs()[1], ["b2"]);
    }

    #[tokio::test]
    async fn a_busy_workspace_waits_unanswered_and_past_the_bound_its_wait_is_no_progress() {
        let rig = rig(Duration::from_millis(60), None);
        rig.store.set_busy("ws_a", true);
        rig.read(&message(&request("ws_a", "c1", 1), 4, 0, 0));
        rig.step().await;
        assert!(rig.replies().is_empty() && rig.partitions.stored.lock().is_ok_and(|s| s.is_empty()));
        assert_eq!(RecordedPartitions::take(&rig.partitions.progressed), vec![4], "a short wait is progress");
        for _ in 0..10 {
            if !RecordedPartitions::take(&rig.partitions.held).is_empty() {
                break;
            }
            rig.step().await;
            assert!(RecordedPartitions::take(&rig.partitions.progressed).len() <= 1);
        }
        assert!(
            RecordedPartitions::take(&rig.partitions.progressed).is_empty(),
            "past the bound: held, not progressing"
        );
        rig.store.set_busy("ws_a", false);
        rig.step().await;
        assert_eq!(
            (rig.replies(), RecordedPartitions::take(&rig.partitions.progressed)),
            (vec![reply("c1", 1, "applied")], vec![4])
        );
    }

    #[tokio::test]
    async fn a_run_that_fails_for_good_is_applied_one_by_one_and_only_the_bad_message_is_dead_lettered() {
        let rig = rig(Duration::from_secs(60), None);
        rig.store.refused.lock().unwrap_or_else(|e| e.into_inner()).insert("c2".into());
        for (offset, id) in ["c1", "c2", "c3"].into_iter().enumerate() {
            rig.read(&message(&request("ws_a", id, 1), 0, i64::try_from(offset).unwrap_or(0), 0));
        }
        rig.step().await;
        assert_eq!(rig.store.runs(), vec![vec!["c1"], vec!["c3"]]);
        assert_eq!(rig.replies(), vec![reply("c1", 1, "applied"), reply("c2", 1, "failed"), reply("c3", 1, "applied")]);
        let marked = rig.store.marked.lock().unwrap_or_else(|e| e.into_inner()).clone();
        assert_eq!(marked, vec![("ws_a".to_owned(), "req-c2".to_owned(), 0)], "its request's later chunks fail too");
        let letters = rig.sender.sent_to("dlq");
        assert_eq!(
            (letters.len(), letters[0].header("reason"), letters[0].header("attempts")),
            (1, Some("apply_failed"), Some("2"))
        );
        assert!(
            matches!(WriteRequest::from_slice(&letters[0].payload), Ok(WriteRequest::V1(r)) if r.correlation_id == "c2")
        );
        assert_eq!(
            *rig.partitions.stored.lock().unwrap_or_else(|e| e.into_inner()),
            vec![(0, 3)],
            "and the partition goes on"
        );
    }

    #[tokio::test]
    async fn a_chunk_whose_request_cannot_be_marked_failed_stays_unanswered_and_no_later_chunk_is_applied() {
        let rig = rig(Duration::from_secs(60), None);
        rig.store.marks_fail.store(true, std::sync::atomic::Ordering::Relaxed);
        rig.store.refused.lock().unwrap_or_else(|e| e.into_inner()).insert("c0".into());
        let (mut first, mut second) = (request("ws_a", "c0", 1), request("ws_a", "c1", 1));
        part(&mut first, "req", 0);
        part(&mut second, "req", 1);
        rig.read(&message(&first, 0, 0, 0));
        rig.read(&message(&second, 0, 1, 0));
        rig.step().await;
        assert!(rig.replies().is_empty(), "neither answered: {:?}", rig.replies());
        assert!(rig.store.runs().is_empty(), "the later chunk not applied");
        assert!(rig.sender.sent_to("dlq").is_empty(), "not dead-lettered before its request is marked");
        assert!(rig.partitions.stored.lock().is_ok_and(|s| s.is_empty()), "no offset stored");
        // The marking works again: the failed chunk is answered failed, the later one is not
        // applied.
        rig.store.marks_fail.store(false, std::sync::atomic::Ordering::Relaxed);
        rig.step().await;
        assert_eq!(rig.replies(), vec![reply("c0", 1, "failed"), reply("c1", 1, "failed")]);
        assert!(rig.store.runs().is_empty(), "a prefix, never a gap");
        assert_eq!(*rig.partitions.stored.lock().unwrap_or_else(|e| e.into_inner()), vec![(0, 2)]);
    }

    #[tokio::test]
    async fn an_expired_chunk_is_answered_with_the_others_and_fails_its_request() {
        let rig = rig(Duration::from_secs(60), None);
        // Chunk 0 of a request reached the topic after its deadline; its chunk 1, appended in
        // time after a leader change, must not be applied either: a prefix, never a gap.
        let (mut first, mut second) = (request("ws_a", "c0", 1), request("ws_a", "c1", 1));
        part(&mut first, "req", 0);
        part(&mut second, "req", 1);
        first.deadline_ms = 10;
        rig.read(&message(&first, 0, 0, 11));
        rig.read(&message(&second, 0, 1, 5));
        rig.read(&message(&request("ws_a", "other", 1), 0, 2, 5));
        rig.step().await;
        assert_eq!(
            rig.replies(),
            vec![reply("c0", 1, "expired"), reply("c1", 1, "failed"), reply("other", 1, "applied")]
        );
        assert_eq!(rig.store.runs(), vec![vec!["other"]], "neither chunk of the request applied");
        let metrics = &rig.worker.metrics;
        let count = |outcome| metrics.messages.get_or_create(&metrics::Outcome { outcome }).get();
        assert_eq!((count("expired"), count("request_failed"), count("applied")), (1, 1, 1));
        assert!(rig.sender.sent_to("dlq").is_empty(), "an expired chunk is no dead letter");
    }

    #[tokio::test]
    async fn a_backlog_of_expired_chunks_fails_their_requests_in_one_transaction() {
        let rig = rig(Duration::from_secs(60), None);
        // After an outage: two requests' chunks, all appended after their deadlines, then a
        // fresh write of the same workspace.
        let mut offset = 0;
        for (id, chunks) in [("req_a", 3), ("req_b", 2)] {
            for index in 0..chunks {
                let mut chunk = request("ws_a", &format!("{id}-{index}"), 1);
                part(&mut chunk, id, index);
                chunk.deadline_ms = 10;
                rig.read(&message(&chunk, 0, offset, 11));
                offset += 1;
            }
        }
        rig.read(&message(&request("ws_a", "fresh", 1), 0, offset, 5));
        rig.step().await;
        let expired = ["req_a-0", "req_a-1", "req_a-2", "req_b-0", "req_b-1"].map(|c| reply(c, 1, "expired"));
        assert_eq!(rig.replies(), [expired.to_vec(), vec![reply("fresh", 1, "applied")]].concat());
        let mut marked = rig.store.marked.lock().unwrap_or_else(|e| e.into_inner()).clone();
        marked.sort();
        assert_eq!(marked.first().map(|m| (m.1.as_str(), m.2)), Some(("req_a", 0)));
        assert_eq!(marked.len(), 5, "every expired chunk's request marked");
        assert_eq!(rig.store.mark_calls.load(std::sync::atomic::Ordering::Relaxed), 1, "in one transaction");
    }

    #[tokio::test]
    async fn an_unreadable_message_is_dead_lettered_as_it_came_its_request_failed_and_answered() {
        let rig = rig(Duration::from_secs(60), None);
        let unknown = br#"{"v":"9","correlation_id":"u1","reply_partition":0,"workspace_id":"ws_a","request":{"id":"req","index":0}}"#;
        rig.read(&raw(b"ws_a", unknown.to_vec(), 2, 0, 0));
        rig.read(&raw(b"ws_a", b"\xff".to_vec(), 2, 1, 0));
        rig.step().await;
        assert_eq!(rig.replies(), vec![reply("u1", 0, "failed")], "the one whose envelope says where");
        let letters = rig.sender.sent_to("dlq");
        let payloads: Vec<&[u8]> = letters.iter().map(|l| l.payload.as_slice()).collect();
        assert_eq!(payloads, [&unknown[..], b"\xff"]);
        assert!(letters.iter().all(|l| l.header("reason") == Some("unreadable")));
        let marked = rig.store.marked.lock().unwrap_or_else(|e| e.into_inner()).clone();
        assert_eq!(marked, vec![("ws_a".to_owned(), "req".to_owned(), 0)]);
        assert_eq!(*rig.partitions.stored.lock().unwrap_or_else(|e| e.into_inner()), vec![(2, 2)]);
    }

    #[tokio::test]
    async fn a_message_whose_reply_partition_does_not_exist_is_dead_lettered_unapplied_and_unanswered() {
        let rig = rig(Duration::from_secs(60), None);
        let mut lost = request("ws_a", "lost", 1);
        lost.reply_partition = 7;
        rig.read(&message(&lost, 0, 0, 0));
        rig.read(&message(&request("ws_a", "next", 1), 0, 1, 0));
        rig.step().await;
        assert_eq!(rig.replies(), vec![reply("next", 1, "applied")]);
        assert_eq!(rig.store.runs(), vec![vec!["next"]]);
        let letters = rig.sender.sent_to("dlq");
        assert_eq!(
            (letters[0].header("reason"), letters[0].header("attempts")),
            (Some("no_reply_partition"), Some("2"))
        );
        assert_eq!(rig.store.marked.lock().map(|m| m.len()).unwrap_or(0), 1);
    }
}
