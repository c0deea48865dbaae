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
//! three quarters of what the stuck workspaces leave of it. Past half the budget each workspace
//! may hold its fair share, the budget over the workspaces holding messages plus one; a
//! workspace beyond it is passed over: its further messages are left in Kafka (a *spill*), and
//! its partition reads on for its neighbours. Once it is down to half its share its partition is
//! read again from its first message left (`reread.rs`) until it has caught up with the reader.
//! Below half the budget nobody is held back. No workspace, stuck or slow, pauses a partition.
//!
//! Generic over the message, so that the rules are tested without Kafka.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// A workspace found busy is tried again after this, doubling up to [`MAX_PARK`].
const FIRST_PARK: Duration = Duration::from_millis(25);
/// Bounds the time between a held lock's release and the workspace's next try.
const MAX_PARK: Duration = Duration::from_millis(500);
/// A workspace that gave up what it held at the budget, waiting for its lock, is read again
/// after this, one message at a time until one is answered: each time the budget fills it costs
/// a message read again, not its share.
const STUCK_RETRY: Duration = Duration::from_secs(1);

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

/// What became of a message read.
#[derive(Debug, PartialEq, Eq)]
pub enum Pushed {
    /// Queued for its workspace; when the budget is reached, the partitions it paused (to bring
    /// the consumer to with [`Scheduler::apply_pauses`]).
    Queued { pause: Vec<i32> },
    /// Its workspace is beyond its share: it, and the workspace's messages after it, are left
    /// in Kafka and read again later.
    PassedOver,
    /// Its workspace was passed over before: read again later with the others.
    LeftInKafka,
}

impl Pushed {
    fn queued() -> Self {
        Pushed::Queued { pause: Vec::new() }
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
    /// Tells the re-reader that what it is to read changed.
    read_again: Notify,
    budget: usize,
    max_group: usize,
}

struct State<M> {
    generation: u64,
    workspaces: HashMap<String, Workspace<M>>,
    /// Workspaces with messages, neither taken nor parked, in the order they became ready.
    ready: VecDeque<String>,
    partitions: HashMap<i32, Offsets>,
    /// Partitions paused by the budget.
    paused: BTreeSet<i32>,
    /// Workspaces passed over: their messages from there on are in Kafka only.
    spills: HashMap<String, Spill>,
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

    /// The offset up to which `partition` is finished: below its lowest message held and not
    /// finished, and below the first message left in Kafka of each workspace passed over.
    fn committable(&self, partition: i32) -> Option<i64> {
        let offsets = self.partitions.get(&partition)?;
        let left = self.spills.values().filter(|s| s.partition == partition).map(|s| s.next).min();
        Some(offsets.committable().min(left.unwrap_or(i64::MAX)))
    }
}

/// A workspace passed over: every message of it below `next` is queued or finished; those from
/// `next` on are in Kafka only.
#[derive(Debug)]
struct Spill {
    partition: i32,
    next: i64,
    /// What its message at `next` costs, once read: it is read again when that would be taken.
    bytes: usize,
    /// Its partition is read again from `next` for it: it is down to half its share.
    again: bool,
    /// It gave up what it held at the budget while waiting for its lock.
    stuck: Option<Stuck>,
}

/// A workspace that gave up what it held at the budget: read again from `retry_at` on, one
/// message at a time until one is answered; still waiting since `since` (for the wait bound of
/// `health.rs` and `workspace_waiting_seconds`) until then.
#[derive(Clone, Copy, Debug)]
struct Stuck {
    since: Instant,
    retry_at: Instant,
}

impl Spill {
    fn new<M>(left: &Queued<M>) -> Self {
        Spill { partition: left.partition, next: left.offset, bytes: left.bytes, again: false, stuck: None }
    }

    /// Whether the message at `offset` of `partition`, read again, is one this workspace left
    /// in Kafka and is now read again for.
    fn wants(&self, partition: i32, offset: i64) -> bool {
        self.again && self.partition == partition && offset >= self.next
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
                paused: BTreeSet::new(),
                spills: HashMap::new(),
                queued_bytes: 0,
                taken_bytes: 0,
                full: false,
                apart: HashMap::new(),
            }),
            applied_pauses: Mutex::new(BTreeSet::new()),
            wake: Notify::new(),
            read_again: Notify::new(),
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
        let wanted: BTreeSet<i32> = self.lock().paused.clone();
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
        state.spills.clear();
        self.read_again.notify_one();
    }

    /// Takes a message read: queued for its workspace, or left in Kafka when its workspace is
    /// beyond its share, or was passed over before (see [`Pushed`]). `keyed`: its Kafka key is
    /// its workspace, by which the re-reader finds it without parsing it. One that is not (an
    /// unreadable message, or one of another producer than the gateways) is always queued: left
    /// in Kafka, the re-reader would pass it by.
    pub fn push(&self, workspace_id: &str, queued: Queued<M>, keyed: bool) -> Pushed {
        let mut state = self.lock();
        let offsets = state.partitions.entry(queued.partition).or_default();
        offsets.next = offsets.next.max(queued.offset + 1);
        match state.spills.get(workspace_id) {
            Some(spill) if keyed && spill.partition == queued.partition => return Pushed::LeftInKafka,
            Some(_) => return self.queue(&mut state, workspace_id, queued),
            None if !keyed => return self.queue(&mut state, workspace_id, queued),
            None => {}
        }
        if self.beyond_share(&state, workspace_id, queued.bytes) {
            state.spills.insert(workspace_id.to_owned(), Spill::new(&queued));
            return Pushed::PassedOver;
        }
        self.queue(&mut state, workspace_id, queued)
    }

    /// Whether `workspace_id`, holding `bytes` more, would be beyond its share: past half the
    /// budget, more than the budget over the workspaces holding messages plus one; or, waiting
    /// for a lock held elsewhere, at the budget. A workspace that holds nothing is never beyond
    /// it, so that each goes on one message at a time however large.
    fn beyond_share(&self, state: &State<M>, workspace_id: &str, bytes: usize) -> bool {
        let Some(workspace) = state.workspaces.get(workspace_id).filter(|w| w.bytes > 0) else { return false };
        let held = state.held() + bytes;
        let stuck = workspace.waiting_since.is_some();
        (stuck && held >= self.budget)
            || (held >= self.budget / 2 && workspace.bytes + bytes >= self.share(state.workspaces.len()))
    }

    /// Whether a workspace passed over takes a message of `bytes` read again now: within its
    /// share and the budget not full; one that gave up what it held at the budget (`stuck`),
    /// only while it holds nothing and the budget is under half used, so that such workspaces
    /// trying again take at most half of it together.
    fn takes_again(&self, state: &State<M>, workspace_id: &str, stuck: bool, bytes: usize) -> bool {
        let holds = state.workspaces.get(workspace_id).map_or(0, |w| w.bytes);
        match (state.full, stuck) {
            (true, _) => false,
            (false, true) => holds == 0 && state.held() < self.budget / 2,
            (false, false) => !self.beyond_share(state, workspace_id, bytes),
        }
    }

    /// Queues a message for its workspace; at the budget every partition read so far is paused.
    fn queue(&self, state: &mut State<M>, workspace_id: &str, queued: Queued<M>) -> Pushed {
        let bytes = queued.bytes;
        state.partitions.entry(queued.partition).or_default().unfinished.insert(queued.offset);
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
        if !workspace.taken && workspace.parked_until.is_none() && workspace.queue.len() == 1 {
            state.ready.push_back(workspace_id.to_owned());
            self.wake.notify_one();
        }
        if !state.full && state.held() >= self.budget {
            Self::leave_stuck_in_kafka(state);
        }
        if !state.full && state.held() < self.budget {
            return Pushed::queued();
        }
        state.full = true;
        let State { partitions, paused, .. } = state;
        let mut pause: Vec<i32> = partitions.keys().copied().filter(|&read| paused.insert(read)).collect();
        pause.sort_unstable();
        Pushed::Queued { pause }
    }

    /// At the budget, the workspaces waiting for a lock held elsewhere give up what they hold
    /// (all of it queued: none is in a worker's hands) and are passed over from their first
    /// message: one stuck workspace takes at most about half the budget, but several could take
    /// all of it for good and leave every partition paused. Each is read again after
    /// [`STUCK_RETRY`], one message at a time until one is answered.
    fn leave_stuck_in_kafka(state: &mut State<M>) {
        let State { workspaces, spills, partitions, queued_bytes, .. } = state;
        workspaces.retain(|id, workspace| {
            let Some(first) = workspace.queue.front() else { return true };
            let one_partition = workspace.queue.iter().all(|queued| queued.partition == first.partition)
                && spills.get(id).is_none_or(|spill| spill.partition == first.partition);
            if workspace.taken || workspace.waiting_since.is_none() || !one_partition {
                return true;
            }
            let since = workspace.waiting_since.unwrap_or_else(Instant::now);
            let stuck = Stuck { since, retry_at: Instant::now() + STUCK_RETRY };
            let spill = Spill { stuck: Some(stuck), ..Spill::new(first) };
            for queued in workspace.queue.drain(..) {
                if let Some(offsets) = partitions.get_mut(&queued.partition) {
                    offsets.unfinished.remove(&queued.offset);
                }
                *queued_bytes -= queued.bytes;
            }
            tracing::warn!(
                workspace_id = id.as_str(),
                partition = spill.partition,
                offset = spill.next,
                "the read budget is reached: a workspace waiting for its lock leaves its messages in Kafka"
            );
            spills.insert(id.clone(), spill);
            false
        });
    }

    /// The partitions to read again, each from the first message left in Kafka of a workspace
    /// passed over and down to half its share, with the generation they belong to. Only the
    /// re-reader marks workspaces to be read again, here: each one marked is then read from its
    /// first message left, wherever the re-reader was.
    pub fn to_read_again(&self) -> (u64, BTreeMap<i32, i64>) {
        let mut state = self.lock();
        self.mark_to_read_again(&mut state);
        let mut from = BTreeMap::new();
        for spill in state.spills.values().filter(|s| s.again) {
            let next = from.entry(spill.partition).or_insert(spill.next);
            *next = (*next).min(spill.next);
        }
        (state.generation, from)
    }

    /// Waits until what is to be read again may have changed.
    pub async fn read_again_changed(&self) {
        self.read_again.notified().await;
    }

    /// Whether a message of `workspace_id` read again at `offset` of `partition` is one it
    /// left in Kafka and now takes: checked before the message is parsed.
    pub fn wants_again(&self, workspace_id: &str, partition: i32, offset: i64) -> bool {
        let state = self.lock();
        state.spills.get(workspace_id).is_some_and(|spill| spill.wants(partition, offset))
    }

    /// Takes a message read again (of `generation`): queued if its workspace wants it and is
    /// within its share; a workspace beyond it again (or the budget full) stops being read
    /// again from this message on.
    pub fn push_again(&self, generation: u64, workspace_id: &str, queued: Queued<M>) -> Pushed {
        let mut state = self.lock();
        if state.generation != generation {
            return Pushed::LeftInKafka;
        }
        let (partition, offset) = (queued.partition, queued.offset);
        if !state.spills.get(workspace_id).is_some_and(|spill| spill.wants(partition, offset)) {
            return Pushed::LeftInKafka;
        }
        let stuck = state.spills.get(workspace_id).and_then(|s| s.stuck);
        let takes = self.takes_again(&state, workspace_id, stuck.is_some(), queued.bytes);
        let Some(spill) = state.spills.get_mut(workspace_id) else { return Pushed::LeftInKafka };
        (spill.next, spill.bytes) = (offset, queued.bytes);
        if !takes {
            spill.again = false;
            return Pushed::PassedOver;
        }
        spill.next = offset + 1;
        let pushed = self.queue(&mut state, workspace_id, queued);
        if let (Some(stuck), Some(workspace)) = (stuck, state.workspaces.get_mut(workspace_id)) {
            workspace.waiting_since.get_or_insert(stuck.since);
        }
        pushed
    }

    /// The re-reader of `partition` (of `generation`) has read everything below `next`: the
    /// workspaces read again have all their messages below it queued, and those that reached
    /// what the reader has read are no longer passed over. Says the offset to store when this
    /// moved the partition's.
    pub fn read_again_to(&self, generation: u64, partition: i32, next: i64) -> Option<(i32, i64)> {
        let mut state = self.lock();
        if state.generation != generation {
            return None;
        }
        let before = state.committable(partition)?;
        let read = state.partitions.get(&partition).map_or(0, |o| o.next);
        state.spills.retain(|_, spill| {
            if spill.again && spill.partition == partition {
                spill.next = spill.next.max(next);
                return next < read;
            }
            true
        });
        let after = state.committable(partition)?;
        (after > before).then_some((partition, after))
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
        let State { workspaces, ready, partitions, queued_bytes, spills, .. } = &mut *state;
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
        if !messages.is_empty() {
            workspace.panics = 0;
            if let Some(spill) = spills.get_mut(&workspace_id) {
                spill.stuck = None;
            }
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
        afterwards.store = touched.into_iter().filter_map(|p| state.committable(p).map(|next| (p, next))).collect();
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

    /// Ends the budget's pause once the held bytes are down to three quarters of what the stuck
    /// workspaces leave of it, and marks the workspaces passed over that are down to half their
    /// share (and no longer waiting for a lock) to be read again. Stuck: waiting for a lock held
    /// elsewhere, or passed over. Their bytes stay until they are answered, which may be never:
    /// counted against the whole budget, two or three of them could keep it above three
    /// quarters for good, and every partition paused with it. Returns the partitions to resume.
    fn resumable(&self, state: &mut State<M>) -> Vec<i32> {
        let held = state.held();
        let State { workspaces, paused, full, spills, .. } = state;
        let stuck: usize = workspaces
            .iter()
            .filter(|(id, w)| w.waiting_since.is_some() || spills.contains_key(*id))
            .map(|(_, w)| w.bytes)
            .sum();
        let mut resume = Vec::new();
        if *full && held.saturating_sub(stuck) <= self.budget.saturating_sub(stuck) / 4 * 3 {
            *full = false;
            resume = std::mem::take(paused).into_iter().collect();
        }
        // Marked by the re-reader itself (`to_read_again`), right before it decides where to
        // read: marked here, a workspace could take the message the re-reader holds, past the
        // ones it left before it.
        if state.spills.values().any(|spill| !spill.again) {
            self.read_again.notify_one();
        }
        resume
    }

    /// Marks to be read again the workspaces passed over whose next message would be taken now
    /// (see [`Scheduler::takes_again`]): those down to half their share and no longer waiting
    /// for a lock, and those that gave up what they held at the budget once their retry is due.
    fn mark_to_read_again(&self, state: &mut State<M>) {
        let half_share = self.share(state.workspaces.len()) / 2;
        let now = Instant::now();
        let marked: Vec<String> = state
            .spills
            .iter()
            .filter(|(id, spill)| {
                let (waiting, holds) =
                    state.workspaces.get(*id).map_or((false, 0), |w| (w.waiting_since.is_some(), w.bytes));
                let due = spill.stuck.is_none_or(|stuck| stuck.retry_at <= now);
                !spill.again
                    && due
                    && !waiting
                    && holds <= half_share
                    && self.takes_again(state, id, spill.stuck.is_some(), spill.bytes)
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in &marked {
            if let Some(spill) = state.spills.get_mut(id) {
                spill.again = true;
            }
        }
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
        let held = state.workspaces.iter().filter_map(|(id, w)| w.waiting_since.map(|since| (id, since)));
        let given_up = state.spills.iter().filter_map(|(id, s)| s.stuck.map(|stuck| (id, stuck.since)));
        let mut waiting: HashMap<&String, Instant> = given_up.collect();
        waiting.extend(held);
        waiting.into_iter().map(|(id, since)| (id.clone(), since.elapsed())).collect()
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

    /// Workspaces passed over, whose messages from there on are left in Kafka.
    pub fn passed_over(&self) -> usize {
        self.lock().spills.len()
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
        scheduler.push("held", queued(0, 0), true);
        scheduler.push("other", queued(0, 1), true);
        scheduler.push("held", queued(0, 2), true);
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
        scheduler.push("ws", queued(0, 0), true);
        scheduler.push("ws", queued(0, 1), true);
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
            assert_eq!(scheduler.push(workspace, sized(partition, offset, 100), true), Pushed::queued());
        }
        assert_eq!(
            scheduler.push("f", sized(2, 5, 500), true),
            queued_pausing(&[0, 1, 2]),
            "every partition read so far"
        );
        let first_read_while_full = scheduler.push("g", sized(7, 0, 10), true);
        assert_eq!(first_read_while_full, queued_pausing(&[7]), "a partition first read while full pauses too");
        assert_eq!((scheduler.held_bytes(), scheduler.paused_partitions()), (1_010, 4));
        for held in [910, 810] {
            assert_eq!(scheduler.take().await.finish(usize::MAX).resume, Vec::<i32>::new());
            assert_eq!(scheduler.held_bytes(), held, "above three quarters: still paused");
        }
        assert_eq!(scheduler.take().await.finish(usize::MAX).resume, vec![0, 1, 2, 7]);
        assert_eq!(scheduler.paused_partitions(), 0);
    }

    fn queued_pausing(pause: &[i32]) -> Pushed {
        Pushed::Queued { pause: pause.to_vec() }
    }

    /// Takes and answers groups until only stuck workspaces (named `stuck…`) hold messages,
    /// each found busy: each time they are taken. Returns what was stored.
    async fn answer_all_but_the_stuck(scheduler: &Scheduler<&'static str>) -> BTreeMap<i32, i64> {
        let mut stored = BTreeMap::new();
        let left =
            |s: &State<&str>| s.workspaces.iter().any(|(id, w)| !id.starts_with("stuck") || w.waiting_since.is_none());
        while left(&scheduler.lock()) {
            let taken = scheduler.take().await;
            let answered = if taken.group().workspace_id.starts_with("stuck") { 0 } else { usize::MAX };
            stored.extend(taken.finish(answered).store);
        }
        stored
    }

    #[tokio::test]
    async fn past_half_the_budget_a_workspace_beyond_its_share_is_passed_over_and_read_again_in_order() {
        let scheduler = Scheduler::new(1_000, 64);
        for (partition, workspace) in ["a", "b", "c"].into_iter().enumerate() {
            scheduler.push(workspace, sized(i32::try_from(partition).unwrap_or(0), 0, 10), true);
        }
        assert_eq!(scheduler.push("stuck", sized(3, 0, 400), true), Pushed::queued(), "half the budget is free");
        assert_eq!(scheduler.push("stuck", sized(3, 1, 100), true), Pushed::PassedOver, "beyond its share");
        assert_eq!(scheduler.push("stuck", sized(3, 2, 100), true), Pushed::LeftInKafka);
        assert_eq!(
            scheduler.push("d", sized(3, 3, 10), true),
            Pushed::queued(),
            "its neighbour on its partition goes on"
        );
        assert_eq!((scheduler.paused_partitions(), scheduler.passed_over()), (0, 1));
        let stored = answer_all_but_the_stuck(&scheduler).await;
        assert_eq!(stored.get(&3), Some(&0), "never past the stuck workspace's first message");
        assert_eq!(scheduler.to_read_again().1, BTreeMap::new(), "not read again while stuck");
        // Its lock released: its message is answered, and it is read again from offset 1.
        let released = scheduler.take().await;
        assert_eq!(offsets(released.group()), vec![0]);
        assert_eq!(released.finish(usize::MAX).store, vec![(3, 1)], "up to its first message left in Kafka");
        let (generation, from) = scheduler.to_read_again();
        assert_eq!(from, BTreeMap::from([(3, 1)]));
        assert!(scheduler.wants_again("stuck", 3, 1) && !scheduler.wants_again("d", 3, 3));
        for offset in [1, 2] {
            assert_eq!(scheduler.push_again(generation, "stuck", sized(3, offset, 100)), Pushed::queued());
            assert_eq!(scheduler.read_again_to(generation, 3, offset + 1), None, "offset 1 is queued now");
        }
        assert_eq!(scheduler.push("stuck", sized(3, 4, 10), true), Pushed::LeftInKafka, "the reader is ahead");
        assert_eq!(scheduler.read_again_to(generation, 3, 4), None, "offset 4 not read again yet");
        assert_eq!(scheduler.push_again(generation, "stuck", sized(3, 4, 10)), Pushed::queued());
        assert_eq!(scheduler.read_again_to(generation, 3, 5), None);
        assert_eq!(scheduler.passed_over(), 0, "caught up with the reader");
        assert_eq!(scheduler.push("stuck", sized(3, 5, 10), true), Pushed::queued(), "queued by the reader again");
        let rest = scheduler.take().await;
        assert_eq!(offsets(rest.group()), vec![1, 2, 4, 5], "in order");
        assert_eq!(rest.finish(usize::MAX).store, vec![(3, 6)]);
    }

    #[tokio::test]
    async fn a_message_not_keyed_by_its_workspace_is_never_left_in_kafka() {
        let scheduler = Scheduler::new(1_000, 64);
        scheduler.push("other", sized(1, 0, 200), true);
        scheduler.push("slow", sized(0, 0, 200), true);
        assert_eq!(scheduler.push("slow", sized(0, 1, 200), false), Pushed::queued(), "beyond its share, yet kept");
        assert_eq!(scheduler.push("slow", sized(0, 2, 200), true), Pushed::PassedOver);
        assert_eq!(scheduler.push("slow", sized(0, 3, 100), false), Pushed::queued(), "the re-reader would pass it by");
    }

    #[tokio::test]
    async fn a_workspace_read_again_beyond_its_share_again_stops_there_and_holds_the_offset_below_it() {
        let scheduler = Scheduler::new(1_000, 64);
        scheduler.push("other", sized(1, 0, 300), true);
        scheduler.push("slow", sized(0, 0, 300), true);
        assert_eq!(scheduler.push("slow", sized(0, 1, 300), true), Pushed::PassedOver);
        for offset in 2..6 {
            scheduler.push("slow", sized(0, offset, 300), true);
        }
        let slow = scheduler.take().await;
        assert_eq!(slow.group().workspace_id, "other");
        slow.finish(usize::MAX);
        scheduler.take().await.finish(usize::MAX);
        let (generation, from) = scheduler.to_read_again();
        assert_eq!(from, BTreeMap::from([(0, 1)]));
        scheduler.push("other", sized(1, 1, 300), true);
        assert_eq!(scheduler.push_again(generation, "slow", sized(0, 1, 300)), Pushed::queued());
        assert_eq!(scheduler.push_again(generation, "slow", sized(0, 2, 300)), Pushed::PassedOver, "its share again");
        assert_eq!(scheduler.read_again_to(generation, 0, 3), None);
        assert_eq!(scheduler.to_read_again().1, BTreeMap::new(), "until it is down to half its share");
        let answered = scheduler.take().await.finish(usize::MAX).store;
        assert_eq!(answered, vec![(1, 2)]);
        let stored = scheduler.take().await.finish(usize::MAX).store;
        assert_eq!(stored, vec![(0, 2)], "offset 2 left in Kafka");
        assert!(!scheduler.wants_again("slow", 0, 2), "marked by the re-reader only, where it decides where to read");
        assert_eq!(scheduler.to_read_again().1, BTreeMap::from([(0, 2)]), "read again from it");
        assert!(scheduler.wants_again("slow", 0, 2));
    }

    #[tokio::test]
    async fn a_stuck_workspace_gives_up_what_it_holds_at_the_budget_and_is_read_again_one_message_at_a_time() {
        let scheduler = Scheduler::new(1_000, 64);
        scheduler.push("stuck", sized(0, 0, 200), true);
        scheduler.push("stuck", sized(0, 1, 200), true);
        scheduler.take().await.finish(0);
        for offset in 0..5 {
            assert_eq!(scheduler.push(&format!("b{offset}"), sized(1, offset, 100), true), Pushed::queued());
        }
        assert_eq!(scheduler.push("b5", sized(1, 5, 100), true), Pushed::queued(), "the stuck one gave way: no pause");
        assert_eq!((scheduler.held_bytes(), scheduler.passed_over()), (600, 1));
        assert_eq!(scheduler.waiting().len(), 1, "still waiting for its lock");
        assert_eq!(scheduler.push("stuck", sized(0, 2, 200), true), Pushed::LeftInKafka);
        assert_eq!(scheduler.to_read_again().1, BTreeMap::new(), "not before its retry");
        tokio::time::sleep(STUCK_RETRY).await;
        assert_eq!(scheduler.to_read_again().1, BTreeMap::new(), "not while half the budget is used");
        answer_all_but_the_stuck(&scheduler).await;
        let (generation, from) = scheduler.to_read_again();
        assert_eq!(from, BTreeMap::from([(0, 0)]), "from its first message");
        assert_eq!(scheduler.push_again(generation, "stuck", sized(0, 0, 200)), Pushed::queued());
        assert_eq!(scheduler.push_again(generation, "stuck", sized(0, 1, 200)), Pushed::PassedOver, "one at a time");
        let busy = scheduler.take().await.finish(0);
        assert!(busy.waited >= Some(STUCK_RETRY), "its wait counted from the first time: {busy:?}");
        assert_eq!(scheduler.to_read_again().1, BTreeMap::new(), "found busy again");
        let released = scheduler.take().await;
        assert_eq!(released.finish(usize::MAX).store, vec![(0, 1)], "up to its next message left in Kafka");
        assert_eq!(scheduler.to_read_again().1, BTreeMap::from([(0, 1)]), "answered: read again on at once");
        assert_eq!(scheduler.push_again(generation, "stuck", sized(0, 1, 200)), Pushed::queued());
        assert_eq!(scheduler.push_again(generation, "stuck", sized(0, 2, 200)), Pushed::queued(), "within its share");
    }

    #[tokio::test]
    async fn many_stuck_workspaces_with_a_small_budget_pause_no_partition_and_their_neighbours_go_on() {
        for stuck in [2, 3, 5, 8] {
            let scheduler = Scheduler::new(1_000, 64);
            let mut offset = 0;
            // Each stuck workspace, on a partition of its own, is read until it is beyond its share.
            for n in 0..stuck {
                let workspace = format!("stuck{n}");
                while scheduler.push(&workspace, sized(n, offset, 50), true) != Pushed::PassedOver {
                    offset += 1;
                    assert!(offset < 1_000, "{workspace} never beyond its share");
                }
                offset += 1;
            }
            answer_all_but_the_stuck(&scheduler).await;
            // A neighbour on every partition, the stuck ones' included, is read and answered.
            for round in 0..3 {
                for partition in 0..8 {
                    let pushed = scheduler.push(&format!("n{partition}"), sized(partition, offset, 10), true);
                    assert_eq!(pushed, Pushed::queued(), "{stuck} stuck, round {round}, partition {partition}");
                    offset += 1;
                }
                let stored = answer_all_but_the_stuck(&scheduler).await;
                assert_eq!(stored.len(), 8, "{stuck} stuck: every partition answered");
            }
            // A burst of many workspaces reaches the budget: every partition pauses, and reads
            // again once the burst is answered, whatever the stuck ones hold.
            let mut burst = 0;
            let paused = loop {
                match scheduler.push(&format!("burst{burst}"), sized(burst % 8, offset, 50), true) {
                    Pushed::Queued { pause } if !pause.is_empty() => break pause,
                    pushed => assert_eq!(pushed, Pushed::queued()),
                }
                (burst, offset) = (burst + 1, offset + 1);
            };
            assert_eq!(paused, (0..8).collect::<Vec<_>>(), "{stuck} stuck");
            answer_all_but_the_stuck(&scheduler).await;
            assert_eq!(scheduler.paused_partitions(), 0, "{stuck} stuck: the budget's pause ended");
            assert_eq!(scheduler.passed_over(), usize::try_from(stuck).unwrap_or(0));
        }
    }

    #[tokio::test]
    async fn a_group_whose_worker_died_goes_back_in_order_and_is_tried_one_message_at_a_time() {
        let scheduler = Scheduler::new(1_000, 64);
        for offset in 0..3 {
            scheduler.push("ws", queued(0, offset), true);
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
        assert_eq!(scheduler.push("a", sized(3, 0, 120), true), queued_pausing(&[3]));
        // ...and before the reader tells the consumer, a worker answers the message, which ends
        // the pause, and tells the consumer first.
        let finished = scheduler.take().await.finish(usize::MAX);
        assert_eq!(finished.resume, vec![3]);
        scheduler.apply_pauses(pause, resume);
        // The reader's turn comes last.
        scheduler.apply_pauses(pause, resume);
        assert!(consumer.lock().unwrap_or_else(|e| e.into_inner()).is_empty(), "partition 3 left paused");
        // In the other order the consumer pauses, then resumes.
        scheduler.push("a", sized(3, 1, 120), true);
        scheduler.apply_pauses(pause, resume);
        assert_eq!(*consumer.lock().unwrap_or_else(|e| e.into_inner()), BTreeSet::from([3]));
        let _ = scheduler.take().await.finish(usize::MAX);
        scheduler.apply_pauses(pause, resume);
        assert!(consumer.lock().unwrap_or_else(|e| e.into_inner()).is_empty());
    }

    #[tokio::test]
    async fn a_rebalance_drops_what_was_read_and_the_groups_in_hand_store_nothing() {
        let scheduler = Scheduler::new(100, 64);
        scheduler.push("a", sized(0, 7, 10), true);
        scheduler.push("b", sized(1, 3, 20), true);
        let in_hand = scheduler.take().await;
        scheduler.rebalanced(1);
        assert_eq!((scheduler.backlog(), scheduler.held_bytes()), (0, 10), "the group in hand is still held");
        assert_eq!(in_hand.finish(usize::MAX), Afterwards::default());
        assert_eq!(scheduler.held_bytes(), 0);
    }
}
