//! Order by workspace, not by partition (docs/architecture.md, "Isolation in the writer").
//! Each workspace has an in-order queue of the messages read for it; a worker takes a
//! workspace's next messages, and no other worker touches that workspace until they are
//! finished. A workspace whose lock is held elsewhere is set aside (parked) and tried again
//! with backoff while the workers go on with the others, so a stuck workspace holds neither a
//! worker nor a connection. A partition's offset is stored only up to its lowest message not
//! yet finished, never past it: after a restart or a rebalance the messages from there are read
//! again, and `applied_messages` answers those already applied.
//!
//! A workspace's backlog is bounded: when it reaches the bound its partition is paused (the
//! neighbours on that partition wait too, so the bound sits above what admission lets in from
//! every gateway) and resumed once the backlog is down to half.
//!
//! Generic over the message, so that the rules are tested without Kafka.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// A workspace found busy is tried again after this, doubling up to [`MAX_PARK`].
const FIRST_PARK: Duration = Duration::from_millis(25);
/// Bounds the time between a held lock's release and the workspace's next try.
const MAX_PARK: Duration = Duration::from_millis(500);

pub struct Queued<M> {
    pub partition: i32,
    pub offset: i64,
    pub message: M,
}

/// A workspace's next messages, in order, taken by one worker.
pub struct Group<M> {
    pub generation: u64,
    pub workspace_id: String,
    pub messages: Vec<Queued<M>>,
}

/// What the caller does after a group is finished.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Afterwards {
    /// (partition, next offset to read) to store for commit.
    pub store: Vec<(i32, i64)>,
    /// Partitions to resume.
    pub resume: Vec<i32>,
}

pub struct Scheduler<M> {
    state: Mutex<State<M>>,
    wake: Notify,
    backlog_bound: usize,
    max_group: usize,
}

struct State<M> {
    generation: u64,
    workspaces: HashMap<String, Workspace<M>>,
    /// Workspaces with messages, neither taken nor parked, in the order they became ready.
    ready: VecDeque<String>,
    partitions: HashMap<i32, Offsets>,
    /// Paused partitions, with the workspaces whose backlog paused them.
    paused: HashMap<i32, HashSet<String>>,
}

struct Workspace<M> {
    queue: VecDeque<Queued<M>>,
    taken: bool,
    parked_until: Option<Instant>,
    park: Duration,
    /// When it was first found busy, since its last applied group.
    waiting_since: Option<Instant>,
}

#[derive(Default)]
struct Offsets {
    unfinished: BTreeSet<i64>,
    /// One past the highest offset read.
    next: i64,
}

impl Offsets {
    fn committable(&self) -> i64 {
        self.unfinished.first().copied().unwrap_or(self.next)
    }
}

impl<M> Scheduler<M> {
    pub fn new(backlog_bound: usize, max_group: usize) -> Self {
        Scheduler {
            state: Mutex::new(State {
                generation: 0,
                workspaces: HashMap::new(),
                ready: VecDeque::new(),
                partitions: HashMap::new(),
                paused: HashMap::new(),
            }),
            wake: Notify::new(),
            backlog_bound: backlog_bound.max(1),
            max_group: max_group.max(1),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<M>> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A rebalance: everything read before it is dropped (the partitions' owners read it again
    /// from the committed offsets), and groups in hand store no offset when they finish.
    /// Returns the partitions that were paused, to resume.
    pub fn rebalanced(&self, generation: u64) -> Vec<i32> {
        let mut state = self.lock();
        if state.generation == generation {
            return Vec::new();
        }
        state.generation = generation;
        state.workspaces.clear();
        state.ready.clear();
        state.partitions.clear();
        state.paused.drain().map(|(partition, _)| partition).collect()
    }

    /// Queues a message for its workspace. Returns the partition to pause when the workspace's
    /// backlog reaches the bound.
    pub fn push(&self, workspace_id: &str, queued: Queued<M>) -> Option<i32> {
        let mut state = self.lock();
        let partition = queued.partition;
        let offsets = state.partitions.entry(partition).or_default();
        offsets.unfinished.insert(queued.offset);
        offsets.next = offsets.next.max(queued.offset + 1);
        let workspace = state.workspaces.entry(workspace_id.to_owned()).or_insert_with(|| Workspace {
            queue: VecDeque::new(),
            taken: false,
            parked_until: None,
            park: FIRST_PARK,
            waiting_since: None,
        });
        workspace.queue.push_back(queued);
        let (len, idle) = (workspace.queue.len(), !workspace.taken && workspace.parked_until.is_none());
        if idle && len == 1 {
            state.ready.push_back(workspace_id.to_owned());
            self.wake.notify_one();
        }
        if len < self.backlog_bound {
            return None;
        }
        let pausing = state.paused.entry(partition).or_default();
        let first = pausing.is_empty();
        pausing.insert(workspace_id.to_owned());
        first.then_some(partition)
    }

    /// A message answered as it was read (expired, unreadable): read and finished. Returns the
    /// offset to store.
    pub fn skipped(&self, partition: i32, offset: i64) -> (i32, i64) {
        let mut state = self.lock();
        let offsets = state.partitions.entry(partition).or_default();
        offsets.next = offsets.next.max(offset + 1);
        (partition, offsets.committable())
    }

    /// The next workspace's group: the ready one that waited longest, or a parked one whose
    /// time has come. Waits until there is one.
    pub async fn take(&self) -> Group<M> {
        loop {
            let notified = self.wake.notified();
            let wake_at = {
                let mut state = self.lock();
                if let Some(group) = self.take_ready(&mut state) {
                    return group;
                }
                state.workspaces.values().filter_map(|w| w.parked_until).min()
            };
            match wake_at {
                Some(at) => {
                    tokio::select! {
                        () = notified => {}
                        () = tokio::time::sleep_until(at) => {}
                    }
                }
                None => notified.await,
            }
        }
    }

    fn take_ready(&self, state: &mut State<M>) -> Option<Group<M>> {
        let now = Instant::now();
        let due: Vec<String> = state
            .workspaces
            .iter()
            .filter(|(_, w)| w.parked_until.is_some_and(|at| at <= now))
            .map(|(id, _)| id.clone())
            .collect();
        for id in due {
            if let Some(workspace) = state.workspaces.get_mut(&id) {
                workspace.parked_until = None;
            }
            state.ready.push_back(id);
        }
        while let Some(id) = state.ready.pop_front() {
            let Some(workspace) = state.workspaces.get_mut(&id) else { continue };
            if workspace.taken || workspace.parked_until.is_some() || workspace.queue.is_empty() {
                continue;
            }
            workspace.taken = true;
            let count = workspace.queue.len().min(self.max_group);
            let messages = workspace.queue.drain(..count).collect();
            return Some(Group { generation: state.generation, workspace_id: id, messages });
        }
        None
    }

    /// Records how a group ended: its first `answered` messages were answered; the rest (the
    /// workspace's lock was held elsewhere) go back to the front of its queue, and the
    /// workspace is parked. Says which offsets to store and which partitions to resume.
    pub fn finish(&self, group: Group<M>, answered: usize) -> Afterwards {
        let mut state = self.lock();
        if group.generation != state.generation {
            return Afterwards::default();
        }
        let Group { workspace_id, mut messages, .. } = group;
        let unanswered = messages.split_off(answered.min(messages.len()));
        let mut afterwards = Afterwards::default();
        let State { workspaces, ready, partitions, paused, .. } = &mut *state;
        let Some(workspace) = workspaces.get_mut(&workspace_id) else { return afterwards };
        workspace.taken = false;
        let mut touched = BTreeSet::new();
        for queued in &messages {
            if let Some(offsets) = partitions.get_mut(&queued.partition) {
                offsets.unfinished.remove(&queued.offset);
                touched.insert(queued.partition);
            }
        }
        afterwards.store =
            touched.into_iter().filter_map(|p| partitions.get(&p).map(|o| (p, o.committable()))).collect();
        if unanswered.is_empty() {
            workspace.park = FIRST_PARK;
            workspace.waiting_since = None;
            if workspace.queue.is_empty() {
                workspaces.remove(&workspace_id);
            } else {
                ready.push_back(workspace_id.clone());
                self.wake.notify_one();
            }
        } else {
            for queued in unanswered.into_iter().rev() {
                workspace.queue.push_front(queued);
            }
            let now = Instant::now();
            workspace.parked_until = Some(now + workspace.park);
            workspace.park = (workspace.park * 2).min(MAX_PARK);
            workspace.waiting_since.get_or_insert(now);
            // A taker sleeping until the earliest parked time must see this one.
            self.wake.notify_one();
        }
        let backlog = workspaces.get(&workspace_id).map_or(0, |w| w.queue.len());
        if backlog <= self.backlog_bound / 2 {
            paused.retain(|&partition, pausing| {
                pausing.remove(&workspace_id);
                let resume = pausing.is_empty();
                if resume {
                    afterwards.resume.push(partition);
                }
                !resume
            });
        }
        afterwards
    }

    /// Workspaces waiting for a lock held elsewhere, and for how long.
    pub fn waiting(&self) -> Vec<(String, Duration)> {
        let state = self.lock();
        state
            .workspaces
            .iter()
            .filter_map(|(id, w)| w.waiting_since.map(|since| (id.clone(), since.elapsed())))
            .collect()
    }

    /// Messages read and not yet finished.
    pub fn backlog(&self) -> usize {
        self.lock().partitions.values().map(|o| o.unfinished.len()).sum()
    }

    pub fn paused_partitions(&self) -> usize {
        self.lock().paused.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queued(partition: i32, offset: i64) -> Queued<&'static str> {
        Queued { partition, offset, message: "m" }
    }

    fn offsets(group: &Group<&str>) -> Vec<i64> {
        group.messages.iter().map(|q| q.offset).collect()
    }

    #[tokio::test]
    async fn a_busy_workspace_is_set_aside_and_its_neighbours_on_the_same_partition_go_on() {
        let scheduler = Scheduler::new(100, 64);
        scheduler.push("held", queued(0, 0));
        scheduler.push("other", queued(0, 1));
        scheduler.push("held", queued(0, 2));
        let held = scheduler.take().await;
        assert_eq!((held.workspace_id.as_str(), offsets(&held)), ("held", vec![0, 2]), "in order, together");
        let other = scheduler.take().await;
        assert_eq!(other.workspace_id, "other");
        assert_eq!(scheduler.finish(held, 0), Afterwards::default());
        let done = scheduler.finish(other, usize::MAX);
        assert_eq!(done.store, vec![(0, 0)], "never past the lowest message not finished");
        assert_eq!(scheduler.waiting().len(), 1);
        let again = scheduler.take().await;
        assert_eq!((again.workspace_id.as_str(), offsets(&again)), ("held", vec![0, 2]), "its order kept");
        assert_eq!(scheduler.finish(again, usize::MAX).store, vec![(0, 3)]);
        assert!(scheduler.waiting().is_empty());
    }

    #[tokio::test]
    async fn a_workspace_is_taken_by_one_worker_at_a_time() {
        let scheduler = Scheduler::new(100, 1);
        scheduler.push("ws", queued(0, 0));
        scheduler.push("ws", queued(0, 1));
        let first = scheduler.take().await;
        assert!(scheduler.lock().ready.is_empty(), "its next message waits for the first to finish");
        scheduler.finish(first, usize::MAX);
        assert_eq!(offsets(&scheduler.take().await), vec![1]);
    }

    #[tokio::test]
    async fn a_backlog_at_its_bound_pauses_the_partition_until_it_is_down_to_half() {
        let scheduler = Scheduler::new(4, 2);
        assert_eq!((0..3).filter_map(|o| scheduler.push("big", queued(5, o))).count(), 0);
        assert_eq!(scheduler.push("big", queued(5, 3)), Some(5));
        assert_eq!(scheduler.push("big", queued(5, 4)), None, "paused once");
        let group = scheduler.take().await;
        assert_eq!(scheduler.finish(group, usize::MAX).resume, Vec::<i32>::new(), "3 left, above half");
        let group = scheduler.take().await;
        assert_eq!(scheduler.finish(group, usize::MAX).resume, vec![5]);
    }

    #[tokio::test]
    async fn a_rebalance_drops_what_was_read_and_the_groups_in_hand_store_nothing() {
        let scheduler = Scheduler::new(100, 64);
        scheduler.push("a", queued(0, 7));
        scheduler.push("b", queued(1, 3));
        let in_hand = scheduler.take().await;
        scheduler.rebalanced(1);
        assert_eq!(scheduler.backlog(), 0);
        assert_eq!(scheduler.finish(in_hand, usize::MAX), Afterwards::default());
        assert_eq!(scheduler.skipped(1, 9), (1, 10), "after a message answered as read");
    }
}
