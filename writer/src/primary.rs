//! The database's primary, among the nodes its URL names. `DATABASE_URL` names one address, or
//! the nodes of an HA cluster in libpq's multi-host form
//! (`postgres://user@node-1:5432,node-2:5432,node-3:5432/intake`). With several, the writer
//! connects to whichever of them takes writes, as libpq's `target_session_attrs=read-write`
//! does, and follows it through a failover: every round trip of a write then goes straight to
//! the primary instead of through a proxy's relay (docs/architecture.md, "The primary's
//! address").
//!
//! sqlx connects to one host, so the following is ours: every node asked every [`CHECK_EVERY`]
//! (and at once when a new connection met a standby) whether it takes writes and on which
//! timeline, the primary chosen by [`choose`], and the pools' connect options pointed at it.
//! Then the work in flight on the old node is abandoned ([`Moves`]) and the pools' connections
//! to it are closed as they come up, as HAProxy cuts the sessions of a node it marks down.

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool};
use sqlx::Connection;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{watch, Notify};

/// How often every node is asked whether it is the primary: a failover is followed within about
/// this, as HAProxy's checks of the HA layout follow it.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// A node that does not answer a check within this is taken for away.
const CHECK_TIMEOUT: Duration = Duration::from_secs(1);

/// After a check that found no primary the nodes are asked again this soon, and after
/// [`DOWN_AFTER`] such checks in a row the node in use is down: its work in flight is ended, as
/// HAProxy (`fastinter 500ms fall 3`) marks a server down and cuts its sessions, so that writes
/// wait as an outage, retried, rather than in statements that a node cut off never answers.
const RECHECK_EVERY: Duration = Duration::from_millis(500);
const DOWN_AFTER: u32 = 2;

/// One node the URL names: its `host:port`, and the options that reach it.
#[derive(Clone, Debug)]
pub struct Node {
    pub address: String,
    pub options: PgConnectOptions,
}

/// The nodes `url` names, in its order: one for an ordinary URL, several for libpq's multi-host
/// form. Its `target_session_attrs` is dropped: the writer always needs the primary.
pub fn nodes(url: &str) -> Result<Vec<Node>, sqlx::Error> {
    let config = |message: String| sqlx::Error::Configuration(message.into());
    let Some((scheme, rest)) = url.split_once("://") else {
        return Ok(vec![Node { address: String::new(), options: PgConnectOptions::from_str(url)? }]);
    };
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let (user, hosts) = match authority.rsplit_once('@') {
        Some((user, hosts)) => (format!("{user}@"), hosts),
        None => (String::new(), authority),
    };
    let tail = without_session_attrs(tail);
    let nodes = hosts
        .split(',')
        .map(|host| {
            if host.is_empty() {
                return Err(config(format!("an empty host in the database URL's host list {hosts:?}")));
            }
            let options = PgConnectOptions::from_str(&format!("{scheme}://{user}{host}{tail}"))?;
            Ok(Node { address: host.to_owned(), options })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(nodes)
}

/// `tail` (the URL's path and query) without its `target_session_attrs` parameter, which sqlx
/// does not know.
fn without_session_attrs(tail: &str) -> String {
    let Some((path, query)) = tail.split_once('?') else { return tail.to_owned() };
    let kept: Vec<&str> = query.split('&').filter(|pair| !pair.starts_with("target_session_attrs=")).collect();
    if kept.is_empty() {
        path.to_owned()
    } else {
        format!("{path}?{}", kept.join("&"))
    }
}

/// How a pool's options are made from a node's (its timeouts and settings).
type Shape = Box<dyn Fn(PgConnectOptions) -> PgConnectOptions + Send + Sync>;

/// The nodes of the database, the one in use, and the pools that follow it.
pub struct Primary {
    nodes: Vec<Node>,
    current: AtomicUsize,
    pools: Mutex<Vec<(PgPool, Shape)>>,
    suspect: Notify,
    /// How many times the primary moved, for the work in flight ([`Moves`]).
    moves: watch::Sender<u64>,
    /// When it last moved: a pooled connection opened before then is on the old node.
    moved_at: Mutex<Option<Instant>>,
}

/// Ends the work in flight on a node when the primary moves off it or it stops answering, as HAProxy's
/// `on-marked-down shutdown-sessions` cuts its sessions: on a node cut off from the network a
/// statement would wait until TCP gives up (many minutes), holding its lane and its workspace.
/// The default never ends anything (a single node, the operator commands).
#[derive(Clone, Default)]
pub struct Moves(Option<watch::Receiver<u64>>);

impl Moves {
    /// Resolves once the primary moves (or stops answering) after this call, never for a single
    /// node: what waits out an outage on the old node tries again at once.
    pub fn next_move(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let receiver = self.0.clone().map(|mut receiver| {
            receiver.mark_unchanged();
            receiver
        });
        async move {
            // The sender lives as long as the writer: an error is its end, never a move.
            let moved = match receiver {
                Some(mut receiver) => receiver.changed().await.is_ok(),
                None => false,
            };
            if !moved {
                std::future::pending::<()>().await;
            }
        }
    }

    /// `work`'s outcome, or an outage (retried) if the primary moves or stops answering first.
    /// Abandoning it is as safe as a dropped connection: an answer needs the commit's
    /// confirmation on the connection that made it.
    pub async fn unless_moved<T>(
        &self,
        work: impl std::future::Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, sqlx::Error> {
        let Some(receiver) = &self.0 else { return work.await };
        let mut receiver = receiver.clone();
        receiver.mark_unchanged();
        tokio::select! {
            outcome = work => outcome,
            Ok(()) = receiver.changed() => {
                Err(sqlx::Error::Io(std::io::Error::other("the primary moved or stopped answering; the statement on its node was abandoned")))
            }
        }
    }
}

impl Primary {
    /// The nodes of `url`, the first in use until [`Primary::follow_changes`] finds otherwise.
    pub fn new(url: &str) -> Result<Arc<Primary>, sqlx::Error> {
        Ok(Arc::new(Primary {
            nodes: nodes(url)?,
            current: AtomicUsize::new(0),
            pools: Mutex::default(),
            suspect: Notify::new(),
            moves: watch::Sender::new(0),
            moved_at: Mutex::default(),
        }))
    }

    /// What ends the work in flight when the primary moves (nothing, for a single node).
    pub fn moves(&self) -> Moves {
        Moves(self.is_several().then(|| self.moves.subscribe()))
    }

    /// Whether a pooled connection `age` old was opened before the primary last moved, and so
    /// on the old node: it is closed, not used.
    pub fn opened_before_move(&self, age: Duration) -> bool {
        self.moved_at.lock().unwrap_or_else(|p| p.into_inner()).is_some_and(|at| age > at.elapsed())
    }

    /// The options of the node in use.
    pub fn options(&self) -> PgConnectOptions {
        self.nodes[self.current.load(Ordering::Relaxed)].options.clone()
    }

    /// Whether the URL named several nodes, among which the primary is followed.
    pub fn is_several(&self) -> bool {
        self.nodes.len() > 1
    }

    /// Points `pool` at the node in use from now on, its options made by `shape`.
    pub fn follow(&self, pool: &PgPool, shape: impl Fn(PgConnectOptions) -> PgConnectOptions + Send + Sync + 'static) {
        pool.set_connect_options(shape(self.options()));
        self.pools.lock().unwrap_or_else(|p| p.into_inner()).push((pool.clone(), Box::new(shape)));
    }

    /// A new connection met a node in recovery: the node in use is checked at once.
    pub fn suspect(&self) {
        self.suspect.notify_one();
    }

    /// Until shutdown: asks every node whether it is the primary, and when [`choose`] picks
    /// another than the one in use, points every pool at it. Returns at once for a single node.
    pub async fn follow_changes(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        if !self.is_several() {
            return;
        }
        let mut checks: Vec<Option<PgConnection>> = self.nodes.iter().map(|_| None).collect();
        let mut failures = 0u32;
        let mut several_writable = false;
        // The timeline of the node in use when it last answered as the primary.
        let mut in_use_timeline: Option<u32> = None;
        loop {
            let next = if failures > 0 { RECHECK_EVERY } else { CHECK_EVERY };
            tokio::select! {
                () = self.suspect.notified() => {}
                () = tokio::time::sleep(next) => {}
                _ = shutdown.changed() => return,
            }
            let current = self.current.load(Ordering::Relaxed);
            let roles = self.ask_all(&mut checks, in_use_timeline).await;
            let several = roles.iter().filter(|role| matches!(role, Role::Primary { .. })).count() > 1;
            if several && !several_writable {
                let writable: Vec<String> = (self.nodes.iter().zip(&roles))
                    .filter_map(|(node, role)| match role {
                        Role::Primary { timeline } => Some(format!("{} (timeline {timeline})", node.address)),
                        _ => None,
                    })
                    .collect();
                tracing::warn!(
                    ?writable,
                    "more than one node takes writes; using the latest timeline's (the others are primaries left behind by a promotion, their cluster manager frozen or gone)"
                );
            }
            several_writable = several;
            match choose(current, &roles) {
                Some(found) => {
                    failures = 0;
                    if let Role::Primary { timeline } = roles[found] {
                        in_use_timeline = Some(timeline);
                    }
                    self.point_at(current, found);
                }
                None => {
                    failures += 1;
                    if failures == DOWN_AFTER {
                        tracing::warn!(node = %self.nodes[current].address, "no node takes writes; the work in flight on the primary is abandoned");
                        self.end_work_in_flight();
                    }
                }
            }
        }
    }

    /// Every node's role, all asked at once, each on its connection in `checks` (opened when
    /// missing, dropped when the node does not answer). A node that takes writes on a timeline
    /// after `newer_than` ends the asking at once: the nodes not heard from yet count as away,
    /// rather than the new primary waiting out a node cut off ([`CHECK_TIMEOUT`]).
    async fn ask_all(&self, checks: &mut [Option<PgConnection>], newer_than: Option<u32>) -> Vec<Role> {
        let mut asked = tokio::task::JoinSet::new();
        for (i, node) in self.nodes.iter().enumerate() {
            let (mut check, options) = (checks[i].take(), node.options.clone());
            asked.spawn(async move { (i, role(&mut check, &options).await, check) });
        }
        let mut roles = vec![Role::Away; self.nodes.len()];
        while let Some(answer) = asked.join_next().await {
            if let Ok((i, role, check)) = answer {
                (roles[i], checks[i]) = (role, check);
                if matches!((role, newer_than), (Role::Primary { timeline }, Some(old)) if timeline > old) {
                    break;
                }
            }
        }
        roles
    }

    fn point_at(&self, from: usize, to: usize) {
        if from == to {
            return;
        }
        self.current.store(to, Ordering::Relaxed);
        for (pool, shape) in self.pools.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            pool.set_connect_options(shape(self.nodes[to].options.clone()));
        }
        self.end_work_in_flight();
        tracing::warn!(from = %self.nodes[from].address, to = %self.nodes[to].address, "the primary moved; new connections go to it");
    }
}

impl Primary {
    /// Ends the transactions in flight ([`Moves`]) and has the pooled connections opened until
    /// now closed as they come up ([`Primary::opened_before_move`]).
    fn end_work_in_flight(&self) {
        *self.moved_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        self.moves.send_modify(|moves| *moves += 1);
    }
}

/// The primary's options among `url`'s nodes, for an operator command's pool: asked once. An
/// error when no node takes writes.
pub async fn resolve(url: &str) -> Result<PgConnectOptions, sqlx::Error> {
    let primary = Primary::new(url)?;
    if !primary.is_several() {
        return Ok(primary.options());
    }
    let mut checks: Vec<Option<PgConnection>> = primary.nodes.iter().map(|_| None).collect();
    match choose(0, &primary.ask_all(&mut checks, None).await) {
        Some(found) => Ok(primary.nodes[found].options.clone()),
        None => Err(sqlx::Error::Configuration(
            format!(
                "no node of the database URL takes writes: {:?}",
                primary.nodes.iter().map(|n| &n.address).collect::<Vec<_>>()
            )
            .into(),
        )),
    }
}

/// What a node answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// No answer within [`CHECK_TIMEOUT`].
    Away,
    /// In recovery: a standby, or a demoted primary.
    Standby,
    /// Takes writes, on this timeline.
    Primary { timeline: u32 },
}

/// The node to use: the one that takes writes on the latest timeline, and on a tie the one in
/// use; none while none takes writes (a failover before the promotion). PostgreSQL alone says
/// which: each promotion starts a timeline after every earlier one, so an old primary that
/// still takes writes because its cluster manager is frozen or dead (Patroni's watchdog off),
/// whose standbys have gone to the new primary and whose commits no standby confirms, loses to
/// the node promoted in its place.
fn choose(current: usize, roles: &[Role]) -> Option<usize> {
    let timeline = |i: usize| match roles.get(i) {
        Some(Role::Primary { timeline }) => Some(*timeline),
        _ => None,
    };
    let latest = (0..roles.len()).filter_map(timeline).max()?;
    if timeline(current) == Some(latest) {
        return Some(current);
    }
    (0..roles.len()).find(|&i| timeline(i) == Some(latest))
}

/// A primary's timeline from its current WAL file's name (its first eight hex digits), which
/// carries a promotion's new timeline at once (`pg_control_checkpoint()` only after the next
/// checkpoint); null on a server in recovery, where `pg_current_wal_lsn()` fails.
const ROLE: &str = "SELECT CASE WHEN pg_is_in_recovery() THEN NULL ELSE pg_walfile_name(pg_current_wal_lsn()) END";

/// The role of the node of `options`, asked on `connection` when it is open, else on a new one
/// left there.
async fn role(connection: &mut Option<PgConnection>, options: &PgConnectOptions) -> Role {
    let asked = async {
        if connection.is_none() {
            *connection = Some(PgConnection::connect_with(options).await?);
        }
        let open = connection.as_mut().ok_or(sqlx::Error::PoolClosed)?;
        sqlx::query_scalar::<_, Option<String>>(ROLE).fetch_one(open).await
    };
    match tokio::time::timeout(CHECK_TIMEOUT, asked).await {
        Ok(Ok(None)) => Role::Standby,
        Ok(Ok(Some(walfile))) => match walfile.get(..8).and_then(|tli| u32::from_str_radix(tli, 16).ok()) {
            Some(timeline) => Role::Primary { timeline },
            None => Role::Away,
        },
        _ => {
            *connection = None;
            Role::Away
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn described(url: &str) -> Vec<(String, String, u16, String)> {
        nodes(url)
            .unwrap_or_else(|e| panic!("{url}: {e}"))
            .into_iter()
            .map(|n| {
                let o = &n.options;
                (n.address, o.get_host().to_owned(), o.get_port(), o.get_database().unwrap_or_default().to_owned())
            })
            .collect()
    }

    #[test]
    fn one_host_is_one_node() {
        assert_eq!(
            described("postgres://postgres@127.0.0.1:55432/intake"),
            vec![("127.0.0.1:55432".into(), "127.0.0.1".into(), 55432, "intake".into())]
        );
    }

    #[test]
    fn a_host_list_is_a_node_each_with_the_same_user_database_and_parameters() {
        let nodes = nodes("postgres://app:secret@10.0.0.1:5432,10.0.0.2:5433,db-3/intake?sslmode=disable&target_session_attrs=read-write")
            .unwrap_or_else(|e| panic!("{e}"));
        let seen: Vec<(String, u16, &str, Option<&str>)> = nodes
            .iter()
            .map(|n| {
                (
                    n.options.get_host().to_owned(),
                    n.options.get_port(),
                    n.options.get_username(),
                    n.options.get_database(),
                )
            })
            .collect();
        assert_eq!(
            seen,
            vec![
                ("10.0.0.1".into(), 5432, "app", Some("intake")),
                ("10.0.0.2".into(), 5433, "app", Some("intake")),
                ("db-3".into(), 5432, "app", Some("intake")),
            ]
        );
        assert_eq!(nodes[1].address, "10.0.0.2:5433");
    }

    #[test]
    fn target_session_attrs_is_dropped_and_the_other_parameters_kept() {
        assert_eq!(without_session_attrs("/intake?target_session_attrs=read-write"), "/intake");
        assert_eq!(
            without_session_attrs("/intake?sslmode=disable&target_session_attrs=primary&application_name=w"),
            "/intake?sslmode=disable&application_name=w"
        );
        assert_eq!(without_session_attrs("/intake"), "/intake");
    }

    #[tokio::test]
    async fn work_in_flight_ends_as_an_outage_when_the_primary_moves() {
        let primary = Primary::new("postgres://u@a:1,b:2/db").unwrap_or_else(|e| panic!("{e}"));
        let moves = primary.moves();
        let in_flight = moves.unless_moved(std::future::pending::<Result<(), sqlx::Error>>());
        let mover = async {
            tokio::task::yield_now().await;
            primary.point_at(0, 1);
        };
        let (outcome, ()) = tokio::join!(in_flight, mover);
        assert!(matches!(outcome, Err(sqlx::Error::Io(_))), "{outcome:?}");
        assert_eq!(primary.options().get_host(), "b");
        assert!(
            primary.opened_before_move(Duration::from_secs(60)),
            "a connection older than the move is on the old node"
        );
        assert!(!primary.opened_before_move(Duration::ZERO));
        // Work that starts after the move is not ended by it.
        assert!(primary.moves().unless_moved(async { Ok(1) }).await.is_ok_and(|n| n == 1));
    }

    #[tokio::test]
    async fn a_single_node_never_abandons_work_or_connections() {
        let primary = Primary::new("postgres://u@a:1/db").unwrap_or_else(|e| panic!("{e}"));
        assert!(primary.moves().0.is_none());
        assert!(!primary.opened_before_move(Duration::from_secs(60)));
    }

    #[test]
    fn the_primary_is_the_writable_node_on_the_latest_timeline_and_on_a_tie_the_one_in_use() {
        use Role::{Away, Primary, Standby};
        let p = |timeline| Primary { timeline };
        // The node in use stays while it takes writes and no later timeline does.
        assert_eq!(choose(0, &[p(3), Standby, Standby]), Some(0));
        assert_eq!(choose(1, &[Standby, p(3), Away]), Some(1));
        // A standby promoted beside an old primary still writable (its Patroni frozen or dead).
        assert_eq!(choose(0, &[p(3), p(4), Standby]), Some(1));
        assert_eq!(choose(2, &[p(5), Away, p(4)]), Some(0));
        // Two on one timeline: the one in use, else the first listed.
        assert_eq!(choose(2, &[p(4), Standby, p(4)]), Some(2));
        assert_eq!(choose(1, &[p(4), Away, p(4)]), Some(0));
        // The primary away or demoted: another takes writes, or none does yet.
        assert_eq!(choose(0, &[Away, Standby, p(2)]), Some(2));
        assert_eq!(choose(0, &[Standby, Standby, Away]), None);
        assert_eq!(choose(0, &[Away, Away, Away]), None);
    }

    #[test]
    fn an_empty_host_in_the_list_is_refused() {
        assert!(nodes("postgres://u@a:1,,b:2/intake").is_err());
    }
}
