//! Order by workspace, not by partition (docs/architecture.md, "Isolation in the writer").
//! Each workspace has an in-order queue of the messages read for it; a worker takes a
//! workspace's next messages, and no other worker touches that workspace until they are
//! finished. A workspace whose lock is held elsewhere is set aside (parked) and tried again
//! with backoff while the workers go on with the others, so a stuck workspace holds neither a
//! worker nor a connection. A partition's offset is stored only up to its lowest message not
//! yet finished, never past it: after a restart or a rebalance the messages from there are read
//! again, and `applied_messages` answers those already applied.
//!
//! Memory (docs/architecture.md, "Memory"): what is read and not yet answered is held within a
//! byte budget. At the budget every partition read is paused, until the held bytes are down to
//! three quarters of it. Past half the budget each workspace may hold its fair share, the budget
//! over the workspaces holding messages plus one; a workspace beyond it pauses its own partition
//! until it is down to half its share. Below half the budget nobody is held back: a stuck
//! workspace alone takes at most about half, and its neighbours on other partitions go on.
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
    /// What holding the message costs, counted against the budget.
    pub bytes: usize,
    pub message: M,
}

/// A workspace's next messages, in order, taken by one worker.
pub struct Group<M> {
    pub generation: u64,
    pub workspace_id: String,
    pub messages: Vec<Queued<M>>,
    /// Workers that died holding this workspace's first message since it last finished one:
    /// while any did, the group is that one message alone.
    pub panics: u32,
    /// Its workspace was found busy since it last finished a group, or was set apart (see
    /// [`Scheduler::set_apart`]): a worker applies it in a transaction of its own, not beside
    /// other workspaces.
    pub alone: bool,
}

impl<M> Group<M> {
    fn bytes(&self) -> usize {
        self.messages.iter().map(|q| q.bytes).sum()
    }
}

/// What the caller does after a group is finished.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Afterwards {
    /// (partition, next offset to read) to store for commit.
    pub store: Vec<(i32, i64)>,
    /// Partitions whose pause this ended (the consumer learns it from [`Scheduler::apply_pauses`]).
    pub resume: Vec<i32>,
    /// How long the workspace has waited for its lock, when it was found busy.
    pub waited: Option<Duration>,
}

pub struct Scheduler<M> {
    state: Mutex<State<M>>,
    /// The partitions paused in the consumer, as last applied.
    applied_pauses: Mutex<BTreeSet<i32>>,
    wake: Notify,
    budget: usize,
    max_group: usize,
}

struct State<M> {
    generation: u64,
    workspaces: HashMap<String, Workspace<M>>,
    /// Workspaces with messages, neither taken nor parked, in the order they became ready.
    ready: VecDeque<String>,
    partitions: HashMap<i32, Offsets>,
    /// Paused partitions, and why.
    paused: HashMap<i32, Pause>,
    /// Bytes of the messages in the queues, and of those in workers' hands.
    queued_bytes: usize,
    taken_bytes: usize,
    /// The budget was reached: every partition read is paused.
    full: bool,
    /// Workspaces applied alone until then.
    apart: HashMap<String, Instant>,
}

impl<M> State<M> {
    fn held(&self) -> usize {
        self.queued_bytes + self.taken_bytes
    }
}

#[derive(Default)]
struct Pause {
    /// By the whole budget.
    full: bool,
    /// By these workspaces, each beyond its share.
    workspaces: HashSet<String>,
}

impl Pause {
    fn is_empty(&self) -> bool {
        !self.full && self.workspaces.is_empty()
    }
}

struct Workspace<M> {
    queue: VecDeque<Queued<M>>,
    taken: bool,
    /// Bytes of its queued messages and of its group in a worker's hands.
    bytes: usize,
    parked_until: Option<Instant>,
    park: Duration,
    /// When it was first found busy, since its last applied group.
    waiting_since: Option<Instant>,
    panics: u32,
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
    /// `budget`: bytes of messages held at most (see [`Queued::bytes`]); `max_group`: messages
    /// one worker takes at once.
    pub fn new(budget: usize, max_group: usize) -> Self {
        Scheduler {
            state: Mutex::new(State {
                generation: 0,
                workspaces: HashMap::new(),
                ready: VecDeque::new(),
                partitions: HashMap::new(),
                paused: HashMap::new(),
                queued_bytes: 0,
                taken_bytes: 0,
                full: false,
                apart: HashMap::new(),
            }),
            applied_pauses: Mutex::new(BTreeSet::new()),
            wake: Notify::new(),
            budget: budget.max(1),
            max_group: max_group.max(1),
        }
    }

    /// Messages one worker takes at once, across the workspaces it takes together.
    pub fn max_group(&self) -> usize {
        self.max_group
    }

    fn lock(&self) -> MutexGuard<'_, State<M>> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Brings the consumer's paused partitions to what the scheduler holds paused now, with
    /// `pause` and `resume` of the difference. The reader and every worker call it after a
    /// change. Pauses are decided under the state's lock and applied after it: applied as they
    /// were decided, a reader's pause could reach the consumer after a worker's resume that
    /// the scheduler decided later, and leave a partition paused that nothing would resume.
    /// Applying the state of the moment, one caller at a time, leaves the consumer as the
    /// last change left the scheduler.
    pub fn apply_pauses(&self, pause: impl FnOnce(&[i32]), resume: impl FnOnce(&[i32])) {
        let mut applied = self.applied_pauses.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let wanted: BTreeSet<i32> = self.lock().paused.keys().copied().collect();
        let to_pause: Vec<i32> = wanted.difference(&applied).copied().collect();
        let to_resume: Vec<i32> = applied.difference(&wanted).copied().collect();
        if !to_pause.is_empty() {
            pause(&to_pause);
        }
        if !to_resume.is_empty() {
            resume(&to_resume);
        }
        *applied = wanted;
    }

    /// What one of `holders` workspaces may hold once half the budget is used.
    fn share(&self, holders: usize) -> usize {
        self.budget / (holders + 1)
    }

    /// A rebalance: everything read before it is dropped (the partitions' owners read it again
    /// from the committed offsets), and groups in hand store no offset when they finish.
    /// Nothing is paused after it ([`Scheduler::apply_pauses`] resumes what was).
    pub fn rebalanced(&self, generation: u64) {
        let mut state = self.lock();
        if state.generation == generation {
            return;
        }
        state.generation = generation;
        state.workspaces.clear();
        state.ready.clear();
        state.partitions.clear();
        state.queued_bytes = 0;
        state.full = false;
        state.paused.clear();
    }

    /// Queues a message for its workspace. Returns the partitions to pause: every one read so
    /// far when the budget is reached, or the message's own when its workspace is beyond its
    /// share.
    pub fn push(&self, workspace_id: &str, queued: Queued<M>) -> Vec<i32> {
        let mut state = self.lock();
        let (partition, bytes) = (queued.partition, queued.bytes);
        let offsets = state.partitions.entry(partition).or_default();
        offsets.unfinished.insert(queued.offset);
        offsets.next = offsets.next.max(queued.offset + 1);
        state.queued_bytes += bytes;
        let workspace = state.workspaces.entry(workspace_id.to_owned()).or_insert_with(|| Workspace {
            queue: VecDeque::new(),
            taken: false,
            bytes: 0,
            parked_until: None,
            park: FIRST_PARK,
            waiting_since: None,
            panics: 0,
        });
        workspace.queue.push_back(queued);
        workspace.bytes += bytes;
        let (len, idle, workspace_bytes, stuck) = (
            workspace.queue.len(),
            !workspace.taken && workspace.parked_until.is_none(),
            workspace.bytes,
            workspace.waiting_since.is_some(),
        );
        if idle && len == 1 {
            state.ready.push_back(workspace_id.to_owned());
            self.wake.notify_one();
        }
        let held = state.held();
        let mut pause = Vec::new();
        if !state.full && held >= self.budget && stuck {
            // A workspace waiting for a lock held elsewhere reached the budget: it alone stops
            // reading, until it is answered; pausing every partition for it would make its
            // neighbours wait on each of its retries.
            let pausing = state.paused.entry(partition).or_default();
            if pausing.is_empty() {
                pause.push(partition);
            }
            pausing.workspaces.insert(workspace_id.to_owned());
        } else if state.full || held >= self.budget {
            state.full = true;
            let State { partitions, paused, .. } = &mut *state;
            for &read in partitions.keys() {
                let pausing = paused.entry(read).or_default();
                if pausing.is_empty() {
                    pause.push(read);
                }
                pausing.full = true;
            }
        } else if held >= self.budget / 2 && workspace_bytes >= self.share(state.workspaces.len()) {
            let pausing = state.paused.entry(partition).or_default();
            if pausing.is_empty() {
                pause.push(partition);
            }
            pausing.workspaces.insert(workspace_id.to_owned());
        }
        pause.sort_unstable();
        pause
    }

    /// The next workspace's group: the ready one that waited longest, or a parked one whose
    /// time has come. Waits until there is one. Dropped without [`Taken::finish`] (its worker
    /// died or stopped), the group goes back to the front of its workspace's queue.
    pub async fn take(&self) -> Taken<'_, M> {
        loop {
            let notified = self.wake.notified();
            let wake_at = {
                let mut state = self.lock();
                if let Some(group) = self.take_ready(&mut state, self.max_group) {
                    return Taken { scheduler: self, group: Some(group) };
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

    /// Another ready group, of at most `room` messages, if there is one now: a worker applies
    /// the groups of several workspaces in one transaction (one commit) when they are small.
    pub fn try_take(&self, room: usize) -> Option<Taken<'_, M>> {
        if room == 0 {
            return None;
        }
        let group = self.take_ready(&mut self.lock(), room.min(self.max_group))?;
        Some(Taken { scheduler: self, group: Some(group) })
    }

    fn take_ready(&self, state: &mut State<M>, room: usize) -> Option<Group<M>> {
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
            let alone = workspace.waiting_since.is_some() || state.apart.get(&id).is_some_and(|until| *until > now);
            let count = if workspace.panics > 0 { 1 } else { workspace.queue.len().min(room) };
            let messages = workspace.queue.drain(..count).collect();
            let group =
                Group { generation: state.generation, workspace_id: id, messages, panics: workspace.panics, alone };
            let bytes = group.bytes();
            state.queued_bytes -= bytes;
            state.taken_bytes += bytes;
            return Some(group);
        }
        None
    }

    /// Records how a group ended: its first `answered` messages were answered; the rest (the
    /// workspace's lock was held elsewhere) go back to the front of its queue, and the
    /// workspace is parked. Says which offsets to store and which partitions to resume.
    fn finish(&self, group: Group<M>, answered: usize) -> Afterwards {
        let mut state = self.lock();
        state.taken_bytes -= group.bytes();
        if group.generation != state.generation {
            return Afterwards::default();
        }
        let Group { workspace_id, mut messages, .. } = group;
        let unanswered = messages.split_off(answered.min(messages.len()));
        let mut afterwards = Afterwards::default();
        let State { workspaces, ready, partitions, queued_bytes, .. } = &mut *state;
        let Some(workspace) = workspaces.get_mut(&workspace_id) else { return afterwards };
        workspace.taken = false;
        *queued_bytes += unanswered.iter().map(|q| q.bytes).sum::<usize>();
        let mut touched = BTreeSet::new();
        for queued in &messages {
            workspace.bytes -= queued.bytes;
            if let Some(offsets) = partitions.get_mut(&queued.partition) {
                offsets.unfinished.remove(&queued.offset);
                touched.insert(queued.partition);
            }
        }
        afterwards.store =
            touched.into_iter().filter_map(|p| partitions.get(&p).map(|o| (p, o.committable()))).collect();
        if !messages.is_empty() {
            workspace.panics = 0;
        }
        if unanswered.is_empty() {
            workspace.park = FIRST_PARK;
            workspace.waiting_since = None;
            if workspace.queue.is_empty() {
                workspaces.remove(&workspace_id);
            } else {
                ready.push_back(workspace_id);
                self.wake.notify_one();
            }
        } else {
            for queued in unanswered.into_iter().rev() {
                workspace.queue.push_front(queued);
            }
            let now = Instant::now();
            workspace.parked_until = Some(now + workspace.park);
            workspace.park = (workspace.park * 2).min(MAX_PARK);
            afterwards.waited = Some(now - *workspace.waiting_since.get_or_insert(now));
            // A taker sleeping until the earliest parked time must see this one.
            self.wake.notify_one();
        }
        afterwards.resume = self.resumable(&mut state);
        afterwards
    }

    /// A group whose worker died (or stopped) with it in hand goes back, unanswered, to the
    /// front of its workspace's queue, ready at once; a death is counted, so that the next
    /// group is its first message alone. The workspace goes to the front of the ready ones: it
    /// was next in line, and sent to the back it could wait behind every workspace that becomes
    /// ready meanwhile, again and again (a batch that cannot join single sends).
    fn release(&self, group: Group<M>, died: bool) {
        let mut state = self.lock();
        let bytes = group.bytes();
        state.taken_bytes -= bytes;
        if group.generation != state.generation {
            return;
        }
        state.queued_bytes += bytes;
        let State { workspaces, ready, .. } = &mut *state;
        let Some(workspace) = workspaces.get_mut(&group.workspace_id) else { return };
        workspace.taken = false;
        workspace.panics += u32::from(died);
        for queued in group.messages.into_iter().rev() {
            workspace.queue.push_front(queued);
        }
        ready.push_front(group.workspace_id);
        self.wake.notify_one();
    }

    /// The paused partitions whose reasons are gone: each workspace that paused one is down to
    /// half its share, and the budget is down to three quarters of what the stuck workspaces
    /// leave of it. Stuck: found busy (waiting for a lock held elsewhere), or beyond its share
    /// (its own partition paused for it). Their bytes stay until they are answered, which may be
    /// never: counted against the whole budget, two or three of them could keep it above three
    /// quarters for good, and every partition paused with it.
    fn resumable(&self, state: &mut State<M>) -> Vec<i32> {
        let share = self.share(state.workspaces.len());
        let half_share = share / 2;
        let held = state.held();
        let State { workspaces, paused, full, .. } = state;
        for pause in paused.values_mut() {
            pause.workspaces.retain(|id| workspaces.get(id).is_some_and(|w| w.bytes > half_share));
        }
        // A stuck workspace beyond its share that was read while the budget was full holds its
        // own partition paused too: the budget's pause ending must not let it read on.
        for (id, workspace) in workspaces.iter() {
            let partition = workspace.queue.front().map(|queued| queued.partition);
            if let (Some(_), Some(pause)) = (workspace.waiting_since, partition.and_then(|p| paused.get_mut(&p))) {
                if workspace.bytes >= share {
                    pause.workspaces.insert(id.clone());
                }
            }
        }
        let beyond_share: BTreeSet<&String> = paused.values().flat_map(|pause| pause.workspaces.iter()).collect();
        let parked: usize = workspaces
            .iter()
            .filter(|(id, w)| w.waiting_since.is_some() || beyond_share.contains(id))
            .map(|(_, w)| w.bytes)
            .sum();
        if *full && held.saturating_sub(parked) <= self.budget.saturating_sub(parked) / 4 * 3 {
            *full = false;
            for pause in paused.values_mut() {
                pause.full = false;
            }
        }
        let mut resume = Vec::new();
        paused.retain(|&partition, pause| {
            let done = pause.is_empty();
            if done {
                resume.push(partition);
            }
            !done
        });
        resume.sort_unstable();
        resume
    }

    /// These workspaces' next groups, for `period`, are applied alone: their transaction beside
    /// other workspaces failed, and one of them may fail it again.
    pub fn set_apart<'w>(&self, workspace_ids: impl IntoIterator<Item = &'w str>, period: Duration) {
        let mut state = self.lock();
        let now = Instant::now();
        state.apart.retain(|_, until| *until > now);
        for id in workspace_ids {
            state.apart.insert(id.to_owned(), now + period);
        }
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

    /// Bytes held: read and not yet answered, in the queues and in workers' hands.
    pub fn held_bytes(&self) -> usize {
        self.lock().held()
    }

    pub fn paused_partitions(&self) -> usize {
        self.lock().paused.len()
    }
}

/// A group in a worker's hands; see [`Scheduler::take`].
pub struct Taken<'a, M> {
    scheduler: &'a Scheduler<M>,
    group: Option<Group<M>>,
}

impl<M> Taken<'_, M> {
    pub fn group(&self) -> &Group<M> {
        self.group.as_ref().unwrap_or_else(|| unreachable!("a group is only gone once finished"))
    }

    /// Gives the group back unanswered, to the front of its workspace's queue, ready for any
    /// worker.
    pub fn put_back(mut self) {
        if let Some(group) = self.group.take() {
            self.scheduler.release(group, false);
        }
    }

    /// See [`Scheduler::finish`].
    pub fn finish(mut self, answered: usize) -> Afterwards {
        match self.group.take() {
            Some(group) => self.scheduler.finish(group, answered),
            None => Afterwards::default(),
        }
    }
}

impl<M> Drop for Taken<'_, M> {
    fn drop(&mut self) {
        if let Some(group) = self.group.take() {
            self.scheduler.release(group, std::thread::panicking());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queued(partition: i32, offset: i64) -> Queued<&'static str> {
        sized(partition, offset, 1)
    }

    fn sized(partition: i32, offset: i64, bytes: usize) -> Queued<&'static str> {
        Queued { partition, offset, bytes, message: "m" }
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
        assert_eq!((held.group().workspace_id.as_str(), offsets(held.group())), ("held", vec![0, 2]), "in order");
        let other = scheduler.take().await;
        assert_eq!(other.group().workspace_id, "other");
        let busy = held.finish(0);
        assert_eq!((busy.store, busy.waited), (vec![], Some(Duration::ZERO)), "found busy just now");
        let done = other.finish(usize::MAX);
        assert_eq!(done.store, vec![(0, 0)], "never past the lowest message not finished");
        assert_eq!(scheduler.waiting().len(), 1);
        let again = scheduler.take().await;
        assert_eq!(
            (again.group().workspace_id.as_str(), offsets(again.group())),
            ("held", vec![0, 2]),
            "its order kept"
        );
        let busy = again.finish(0);
        assert!(busy.waited.is_some_and(|waited| waited >= FIRST_PARK), "counted from the first time: {busy:?}");
        let last = scheduler.take().await;
        assert_eq!(last.finish(usize::MAX).store, vec![(0, 3)]);
        assert!(scheduler.waiting().is_empty());
    }

    #[tokio::test]
    async fn a_workspace_is_taken_by_one_worker_at_a_time() {
        let scheduler = Scheduler::new(100, 1);
        scheduler.push("ws", queued(0, 0));
        scheduler.push("ws", queued(0, 1));
        let first = scheduler.take().await;
        assert!(scheduler.lock().ready.is_empty(), "its next message waits for the first to finish");
        first.finish(usize::MAX);
        assert_eq!(offsets(scheduler.take().await.group()), vec![1]);
    }

    #[tokio::test]
    async fn at_the_budget_every_partition_read_pauses_until_three_quarters_are_left() {
        let scheduler = Scheduler::new(1_000, 64);
        for (offset, (workspace, partition)) in
            [("a", 0), ("b", 1), ("c", 2), ("d", 0), ("e", 1)].into_iter().enumerate()
        {
            let offset = i64::try_from(offset).unwrap_or_default();
            assert_eq!(scheduler.push(workspace, sized(partition, offset, 100)), Vec::<i32>::new());
        }
        assert_eq!(scheduler.push("f", sized(2, 5, 500)), vec![0, 1, 2], "every partition read so far");
        assert_eq!(scheduler.push("g", sized(7, 0, 10)), vec![7], "a partition first read while full pauses too");
        assert_eq!((scheduler.held_bytes(), scheduler.paused_partitions()), (1_010, 4));
        for held in [910, 810] {
            assert_eq!(scheduler.take().await.finish(usize::MAX).resume, Vec::<i32>::new());
            assert_eq!(scheduler.held_bytes(), held, "above three quarters: still paused");
        }
        assert_eq!(scheduler.take().await.finish(usize::MAX).resume, vec![0, 1, 2, 7]);
        assert_eq!(scheduler.paused_partitions(), 0);
    }

    #[tokio::test]
    async fn past_half_the_budget_a_workspace_beyond_its_share_pauses_only_its_own_partition() {
        let scheduler = Scheduler::new(1_000, 64);
        for (offset, workspace) in ["a", "b", "c"].into_iter().enumerate() {
            scheduler.push(workspace, sized(i32::try_from(offset).unwrap_or(0), 0, 10));
        }
        assert_eq!(
            scheduler.push("stuck", sized(3, 0, 400)),
            Vec::<i32>::new(),
            "beyond its share, but half the budget is free"
        );
        assert_eq!(scheduler.push("stuck", sized(3, 1, 100)), vec![3]);
        assert_eq!(scheduler.push("stuck", sized(3, 2, 100)), Vec::<i32>::new(), "paused once");
        assert_eq!(scheduler.push("d", sized(1, 1, 10)), Vec::<i32>::new(), "its neighbours on other partitions go on");
        for _ in 0..4 {
            let taken = scheduler.take().await;
            let answered = if taken.group().workspace_id == "stuck" { 0 } else { usize::MAX };
            assert_eq!(taken.finish(answered).resume, Vec::<i32>::new(), "still beyond half its share");
        }
        let mut resumed = Vec::new();
        while resumed.is_empty() {
            let taken = scheduler.take().await;
            resumed = taken.finish(usize::MAX).resume;
        }
        assert_eq!(resumed, vec![3], "its lock released, its backlog answered");
    }

    #[tokio::test]
    async fn stuck_workspaces_on_several_partitions_never_keep_the_others_paused() {
        for stuck in [2, 3, 5] {
            let scheduler = Scheduler::new(1_000, 64);
            let mut offset = 0;
            // Each stuck workspace, on a partition of its own, is read until its share pauses it.
            for n in 0..stuck {
                let workspace = format!("stuck{n}");
                while !scheduler.push(&workspace, sized(n, offset, 50)).contains(&n) {
                    offset += 1;
                    assert!(offset < 1_000, "{workspace} never paused");
                }
                offset += 1;
            }
            // A burst of a healthy workspace on another partition reaches the budget.
            let healthy = stuck;
            while !scheduler.push("healthy", sized(healthy, offset, 50)).contains(&healthy) {
                offset += 1;
            }
            assert!(scheduler.held_bytes() >= 1_000, "{stuck} stuck: the budget reached");
            // Its messages are answered, the stuck ones never: the healthy partition reads again.
            let mut resumed = Vec::new();
            while !resumed.contains(&healthy) {
                let taken = scheduler.take().await;
                let answered = if taken.group().workspace_id.starts_with("stuck") { 0 } else { usize::MAX };
                resumed.extend(taken.finish(answered).resume);
                if !scheduler.lock().workspaces.contains_key("healthy") {
                    break;
                }
            }
            assert!(resumed.contains(&healthy), "{stuck} stuck: the healthy partition reads again");
            // The first two are beyond their share: their partitions stay paused (a stuck
            // workspace within its share leaves its neighbours reading, as before).
            assert!(!resumed.contains(&0) && !resumed.contains(&1), "{stuck} stuck: {resumed:?}");
            // A stuck workspace whose partition read on reaches the budget: it alone pauses.
            let last = stuck - 1;
            if resumed.contains(&last) {
                while scheduler.held_bytes() < 1_000 {
                    let paused = scheduler.push(&format!("stuck{last}"), sized(last, offset, 200));
                    offset += 1;
                    if !paused.is_empty() {
                        assert_eq!(paused, vec![last], "{stuck} stuck: only its own partition");
                        break;
                    }
                }
            }
        }
    }

    #[tokio::test]
    async fn a_group_whose_worker_died_goes_back_in_order_and_is_tried_one_message_at_a_time() {
        let scheduler = Scheduler::new(1_000, 64);
        for offset in 0..3 {
            scheduler.push("ws", queued(0, offset));
        }
        let taken = scheduler.take().await;
        let died = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _in_hand = taken;
            panic!("a worker dies");
        }));
        assert!(died.is_err());
        assert_eq!(scheduler.held_bytes(), 3, "still held, in the queue");
        let alone = scheduler.take().await;
        assert_eq!((offsets(alone.group()), alone.group().panics), (vec![0], 1), "the first message alone");
        assert_eq!(alone.finish(1).store, vec![(0, 1)]);
        let rest = scheduler.take().await;
        assert_eq!((offsets(rest.group()), rest.group().panics), (vec![1, 2], 0), "back to whole groups");
        drop(rest);
        assert_eq!(offsets(scheduler.take().await.group()), vec![1, 2], "a worker that stopped is no death");
    }

    #[tokio::test]
    async fn a_pause_applied_after_the_resume_that_followed_it_leaves_the_partition_resumed() {
        let scheduler = Scheduler::new(100, 64);
        let consumer = Mutex::new(BTreeSet::new());
        let pause = |p: &[i32]| consumer.lock().unwrap_or_else(|e| e.into_inner()).extend(p);
        let resume = |p: &[i32]| consumer.lock().unwrap_or_else(|e| e.into_inner()).retain(|x| !p.contains(x));
        // The reader reads past the budget: partition 3 is to be paused...
        assert_eq!(scheduler.push("a", sized(3, 0, 120)), vec![3]);
        // ...and before the reader tells the consumer, a worker answers the message, which ends
        // the pause, and tells the consumer first.
        let finished = scheduler.take().await.finish(usize::MAX);
        assert_eq!(finished.resume, vec![3]);
        scheduler.apply_pauses(pause, resume);
        // The reader's turn comes last.
        scheduler.apply_pauses(pause, resume);
        assert!(consumer.lock().unwrap_or_else(|e| e.into_inner()).is_empty(), "partition 3 left paused");
        // In the other order the consumer pauses, then resumes.
        scheduler.push("a", sized(3, 1, 120));
        scheduler.apply_pauses(pause, resume);
        assert_eq!(*consumer.lock().unwrap_or_else(|e| e.into_inner()), BTreeSet::from([3]));
        let _ = scheduler.take().await.finish(usize::MAX);
        scheduler.apply_pauses(pause, resume);
        assert!(consumer.lock().unwrap_or_else(|e| e.into_inner()).is_empty());
    }

    #[tokio::test]
    async fn a_rebalance_drops_what_was_read_and_the_groups_in_hand_store_nothing() {
        let scheduler = Scheduler::new(100, 64);
        scheduler.push("a", sized(0, 7, 10));
        scheduler.push("b", sized(1, 3, 20));
        let in_hand = scheduler.take().await;
        scheduler.rebalanced(1);
        assert_eq!((scheduler.backlog(), scheduler.held_bytes()), (0, 10), "the group in hand is still held");
        assert_eq!(in_hand.finish(usize::MAX), Afterwards::default());
        assert_eq!(scheduler.held_bytes(), 0);
    }
}
