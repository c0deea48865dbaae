//! A worker: takes a workspace's next messages from the scheduler, applies them in one
//! transaction, answers each, and hands the group back. A workspace whose lock is held elsewhere
//! is handed back at once, unapplied, and the worker goes on with another one. A run that fails
//! for any reason but an outage is applied again one message at a time, so that only the bad
//! message fails; that one is dead-lettered after its attempts, its request is marked failed,
//! and the later chunks of that request are answered failed without being applied.

use crate::consume::{Consumer, Request};
use crate::metrics::{self, Metrics};
use crate::outbox::{request_id, DeadLetter, Outbox};
use crate::retry::{shutdown_asked, Interrupted, Policy, Stop};
use crate::schedule::{Group, Scheduler};
use crate::store::{self, Chunk, Lock, Run};
use intake_common::message::{ChunkOutcome, WriteRequestV1};
use rdkafka::message::{Message, OwnedMessage};
use sqlx::PgPool;
use std::sync::Arc;
use tokio::sync::watch;

pub struct Worker {
    pub pool: PgPool,
    pub outbox: Arc<Outbox>,
    pub scheduler: Arc<Scheduler<Request>>,
    pub consumer: Consumer,
    pub metrics: Arc<Metrics>,
    pub policy: Policy,
}

/// How one message was answered.
struct Answer {
    outcome: ChunkOutcome,
    label: &'static str,
}

/// What became of a group: its first messages were answered; the rest, if any, wait for their
/// workspace's lock.
struct Handled {
    answers: Vec<Answer>,
}

pub struct Signals {
    /// Take no new group.
    pub shutdown: watch::Receiver<bool>,
    /// Stop waiting in the group in hand.
    pub abort: watch::Receiver<bool>,
}

impl Worker {
    /// Runs until shutdown. At shutdown it finishes the group in hand (unless aborted) and
    /// leaves the rest unanswered and uncommitted for the partitions' next owner.
    pub async fn work(self: Arc<Self>, signals: Signals) {
        let Signals { mut shutdown, mut abort } = signals;
        loop {
            let group = tokio::select! {
                biased;
                () = shutdown_asked(&mut shutdown) => return,
                group = self.scheduler.take() => group,
            };
            if !self.consumer.current(group.generation) {
                // Read before a rebalance: the partitions' owners read it again.
                self.consumer.resume(self.scheduler.rebalanced(self.consumer.generation()));
                continue;
            }
            let Ok(handled) = self.handle(&group, &mut abort).await else { return };
            self.answer(&group, &handled.answers, &mut abort).await;
            let partitions: Vec<i32> = group.messages.iter().map(|q| q.partition).collect();
            let generation = group.generation;
            let afterwards = self.scheduler.finish(group, handled.answers.len());
            self.consumer.store(generation, &afterwards.store);
            self.consumer.resume(afterwards.resume);
            // Finding a workspace busy is progress too: the worker is alive, and the wait is
            // the workspace's, not the writer's.
            self.consumer.progressed(&partitions);
        }
    }

    async fn handle(
        &self,
        group: &Group<Request>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<Handled, Interrupted> {
        let requests: Vec<&WriteRequestV1> = group.messages.iter().map(|q| &q.message.request).collect();
        let started = std::time::Instant::now();
        let once = Policy { max_attempts: 1, ..self.policy };
        let together = once
            .run_probed(
                "apply",
                &self.metrics,
                None,
                shutdown,
                || store::apply_run(&self.pool, &group.workspace_id, &requests, Lock::Try),
                || takes_writes(&self.pool),
            )
            .await;
        let handled = match together {
            Ok(Run::Done(chunks)) => Handled { answers: chunks.into_iter().map(answer).collect() },
            Ok(Run::Busy) | Err(Stop::Busy { .. }) => Handled { answers: Vec::new() },
            Err(Stop::Interrupted) => return Err(Interrupted),
            // Something in the run fails for good: one by one, so that only that one fails.
            Err(Stop::GaveUp { .. }) => {
                let mut answers = Vec::with_capacity(group.messages.len());
                for queued in &group.messages {
                    match self.apply_one(&queued.message, shutdown).await? {
                        Some(answer) => answers.push(answer),
                        None => return Ok(Handled { answers }),
                    }
                }
                Handled { answers }
            }
        };
        if !handled.answers.is_empty() {
            self.metrics.apply_seconds.observe(started.elapsed().as_secs_f64());
        }
        Ok(handled)
    }

    /// One message through the policy's attempts; `None` when its workspace is busy.
    async fn apply_one(
        &self,
        queued: &Request,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<Option<Answer>, Interrupted> {
        let request = &queued.request;
        let run = [request];
        let applying = self.policy.run_probed(
            "apply",
            &self.metrics,
            None,
            shutdown,
            || store::apply_run(&self.pool, &request.workspace_id, &run, Lock::Try),
            || takes_writes(&self.pool),
        );
        match applying.await {
            Ok(Run::Done(mut chunks)) => Ok(chunks.pop().map(answer)),
            Ok(Run::Busy) | Err(Stop::Busy { .. }) => Ok(None),
            Err(Stop::Interrupted) => Err(Interrupted),
            Err(Stop::GaveUp { error, attempts }) => {
                self.fail_request(request, shutdown).await?;
                let letter =
                    DeadLetter { reason: "apply_failed", error: error.to_string(), attempts, message: &queued.message };
                self.outbox.dead_letter(letter, shutdown).await?;
                Ok(Some(Answer { outcome: ChunkOutcome::Failed, label: "failed" }))
            }
        }
    }

    /// Marks the request failed before its next chunk can be applied (the worker holds the
    /// workspace until then). Retried through outages; a mark that fails for good is logged.
    pub async fn fail_request(
        &self,
        request: &WriteRequestV1,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), Interrupted> {
        fail_request(&self.pool, self.policy, &self.metrics, &request.workspace_id, request.request.as_ref(), shutdown)
            .await
    }

    async fn answer(&self, group: &Group<Request>, answers: &[Answer], shutdown: &mut watch::Receiver<bool>) {
        let answered = group.messages.iter().zip(answers);
        for (queued, answer) in answered.clone() {
            record(&self.metrics, &queued.message.message, &queued.message.request, answer.label, &answer.outcome);
        }
        let replies = answered.map(|(queued, answer)| (&queued.message.request, answer.outcome.clone())).collect();
        // Interrupted at shutdown: the messages stay uncommitted for the partition's next owner.
        let _ = self.outbox.reply_all(replies, shutdown).await;
    }
}

/// See [`Worker::fail_request`]; also for a message that cannot be read.
pub async fn fail_request(
    pool: &PgPool,
    policy: Policy,
    metrics: &Metrics,
    workspace_id: &str,
    part: Option<&intake_common::message::RequestPart>,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<(), Interrupted> {
    let Some(part) = part else { return Ok(()) };
    let marking =
        policy.run("mark_failed", metrics, None, shutdown, || store::mark_request_failed(pool, workspace_id, part));
    match marking.await {
        Ok(()) => Ok(()),
        Err(Stop::Interrupted) => Err(Interrupted),
        Err(Stop::GaveUp { error, .. } | Stop::Busy { error }) => {
            tracing::error!(%error, request_id = part.id, "could not mark the request failed");
            Ok(())
        }
    }
}

async fn takes_writes(pool: &PgPool) -> bool {
    store::probe_writes(pool).await.is_ok()
}

fn answer(chunk: Chunk) -> Answer {
    match chunk {
        Chunk::Applied(applied) => Answer {
            label: if applied.first_time { "applied" } else { "already_applied" },
            outcome: ChunkOutcome::Applied { results: applied.results, merged: applied.merged },
        },
        Chunk::RequestFailed => Answer { outcome: ChunkOutcome::Failed, label: "request_failed" },
    }
}

/// Metrics and the log line of one answered message, with the request id the gateway gave it.
pub fn record(
    metrics: &Metrics,
    message: &OwnedMessage,
    request: &WriteRequestV1,
    label: &'static str,
    outcome: &ChunkOutcome,
) {
    metrics.messages.get_or_create(&metrics::Outcome { outcome: label }).inc();
    if let (ChunkOutcome::Applied { results, .. }, "applied") = (outcome, label) {
        for result in results {
            metrics.items.get_or_create(&metrics::ItemResult { result: result.result.as_str() }).inc();
        }
    }
    tracing::info!(
        request_id = request_id(message).unwrap_or("-"),
        correlation_id = %request.correlation_id,
        workspace_id = %request.workspace_id,
        partition = message.partition(),
        offset = message.offset(),
        items = request.items.len(),
        outcome = label,
        "chunk"
    );
}
