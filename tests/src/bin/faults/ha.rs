//! The fault harness's faults of the database's HA layout (deploy/faults.sh --ha): three etcd
//! members, three PostgreSQL nodes under Patroni with a synchronous standby, HAProxy as the
//! primary's address (deploy/ha.sh). Each fault is injected, then, once the harness saw writes
//! come back, settled: what was cut is joined again, what was killed is started again (as a
//! machine that comes back), and the layout must be whole again: a leader, a synchronous
//! standby, every member running. What each showed goes into the scenario's JSON line.
//!
//! Environment (set by faults.sh --ha): FAULTS_HA_DIR (the layout's directory, as deploy/ha.sh's
//! DIR), FAULTS_HA_BASE_PORT, FAULTS_PG_PORT (the primary's address), FAULTS_LIB (deploy/lib.sh).

use intake_tests::serde_json::{json, Value};
use std::process::Stdio;
use std::time::{Duration, Instant};

/// The leader key's lifetime (deploy/ha/dcs.yml): a frozen Patroni is held past it.
const TTL: Duration = Duration::from_secs(15);
/// How long the layout may take to be whole again after a fault is settled (a node that comes
/// back rewinds or is copied again).
const HEALING: Duration = Duration::from_secs(120);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Every process of the primary's node SIGKILLed: a lost machine.
    PrimaryKill,
    /// Every packet to and from the primary's node dropped: a machine gone silent, no resets.
    PrimaryCut,
    /// A planned switchover to the synchronous standby (patronictl).
    Switchover,
    /// Every process of the synchronous standby's node SIGKILLed.
    StandbyKill,
    /// The etcd member that leads etcd's own quorum SIGKILLed.
    EtcdKill,
    /// Two of the three etcd members SIGKILLed (its leader among them) for longer than the
    /// leader key's ttl: etcd has no quorum, and Patroni's failsafe mode keeps the primary
    /// while it reaches every other member.
    EtcdQuorumLoss,
    /// The primary's Patroni stopped (SIGSTOP) for longer than the leader key's ttl, while its
    /// PostgreSQL runs on.
    PatroniFreeze,
}

pub const ALL: [Fault; 7] = [
    Fault::PrimaryKill,
    Fault::PrimaryCut,
    Fault::Switchover,
    Fault::StandbyKill,
    Fault::EtcdKill,
    Fault::EtcdQuorumLoss,
    Fault::PatroniFreeze,
];

impl Fault {
    pub fn name(self) -> &'static str {
        match self {
            Fault::PrimaryKill => "ha_primary_kill",
            Fault::PrimaryCut => "ha_primary_cut",
            Fault::Switchover => "ha_switchover",
            Fault::StandbyKill => "ha_standby_kill",
            Fault::EtcdKill => "ha_etcd_kill",
            Fault::EtcdQuorumLoss => "ha_etcd_quorum_loss",
            Fault::PatroniFreeze => "ha_patroni_freeze",
        }
    }

    pub fn parse(name: &str) -> Option<Fault> {
        ALL.iter().copied().find(|f| f.name() == name)
    }

    /// Faults that must not refuse a single write: the primary stays where it is (or moves in
    /// a planned switchover), and commits keep reaching two nodes.
    pub fn refuses_nothing(self) -> bool {
        matches!(self, Fault::Switchover | Fault::StandbyKill | Fault::EtcdKill | Fault::EtcdQuorumLoss)
    }
}

/// A member of Patroni's /cluster.
#[derive(Clone, Debug)]
struct Member {
    name: String,
    role: String,
    state: String,
    timeline: Option<u64>,
    /// A standby's replay lag in bytes (Patroni says "unknown" while it cannot tell).
    lag: Option<u64>,
}

/// What a fault did, between its injection and its settling.
#[derive(Default)]
pub struct Injected {
    fault: Option<Fault>,
    /// The node the fault hit (1 to 3), or the etcd member.
    node: u16,
    /// The leader before the fault.
    leader_before: String,
    at: Option<Instant>,
    details: Value,
}

pub struct Layout {
    dir: String,
    base: u16,
    primary: u16,
    lib: String,
    http: reqwest::Client,
}

/// Whether faults.sh --ha --async started the layout with asynchronous replication.
fn asynchronous() -> bool {
    std::env::var("INTAKE_HA_REPLICATION").is_ok_and(|r| r == "async")
}

impl Layout {
    /// The layout faults.sh --ha started, if it did.
    pub fn from_env() -> Option<Layout> {
        let var = |name: &str| std::env::var(name).ok();
        Some(Layout {
            dir: var("FAULTS_HA_DIR")?,
            base: var("FAULTS_HA_BASE_PORT")?.parse().ok()?,
            primary: var("FAULTS_PG_PORT")?.parse().ok()?,
            lib: var("FAULTS_LIB")?,
            http: reqwest::Client::builder().timeout(Duration::from_secs(2)).build().unwrap_or_default(),
        })
    }

    fn pg_port(&self, node: u16) -> u16 {
        self.base + 19 + node
    }

    fn rest_port(&self, node: u16) -> u16 {
        self.base + 29 + node
    }

    fn etcd_port(&self, member: u16) -> u16 {
        self.base + member - 1
    }

    /// Runs `script` with deploy/lib.sh sourced and the layout's HA, RUN, LOGS, BASE and PRIMARY
    /// set (deploy/ha.sh's functions read them); its output, or why it failed.
    async fn sh(&self, script: &str) -> Result<String, String> {
        let full = format!(
            "source {lib} && HA={dir}/ha RUN={dir}/run LOGS={dir}/logs BASE={base} PRIMARY={primary} && {script}",
            lib = self.lib,
            dir = self.dir,
            base = self.base,
            primary = self.primary
        );
        let output = tokio::process::Command::new("bash")
            .args(["-c", &full])
            .stdin(Stdio::null())
            .output()
            .await
            .map_err(|e| format!("bash: {e}"))?;
        let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).trim().to_owned();
        match output.status.success() {
            true => Ok(text(&output.stdout)),
            false => Err(format!("{script}: {}{}", text(&output.stdout), text(&output.stderr))),
        }
    }

    /// Patroni's view of the cluster, from the first node that answers.
    async fn members(&self) -> Vec<Member> {
        for node in 1..=3 {
            let url = format!("http://127.0.0.1:{}/cluster", self.rest_port(node));
            let Ok(response) = self.http.get(url).send().await else { continue };
            let Ok(cluster) = response.json::<Value>().await else { continue };
            let text = |m: &Value, k: &str| m[k].as_str().unwrap_or_default().to_owned();
            return cluster["members"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|m| Member {
                    name: text(m, "name"),
                    role: text(m, "role"),
                    state: text(m, "state"),
                    timeline: m["timeline"].as_u64(),
                    lag: m["lag"].as_u64(),
                })
                .collect();
        }
        Vec::new()
    }

    async fn with_role(&self, role: &str) -> Option<String> {
        let live = |m: &Member| m.role == role && (m.state == "running" || m.state == "streaming");
        self.members().await.into_iter().find(live).map(|m| m.name)
    }

    async fn leader(&self) -> Option<String> {
        self.with_role("leader").await
    }

    async fn sync_standby(&self) -> Option<String> {
        self.with_role("sync_standby").await
    }

    /// A leader, a synchronous standby (any standby with asynchronous replication), and all
    /// three members running or streaming on the leader's timeline, each standby's lag known and
    /// small. A member that came back is listed as running while it still rewinds; the next
    /// fault must not start before it has rejoined.
    async fn whole(&self) -> bool {
        const CAUGHT_UP: u64 = 16 << 20;
        let members = self.members().await;
        let Some(leader) = members.iter().find(|m| m.role == "leader") else { return false };
        let live = |m: &&Member| m.state == "running" || m.state == "streaming";
        let rejoined =
            |m: &&Member| m.role == "leader" || (m.timeline == leader.timeline && m.lag.is_some_and(|l| l < CAUGHT_UP));
        let standby = |m: &Member| m.role == "sync_standby" || (asynchronous() && m.role == "replica");
        members.iter().filter(live).filter(rejoined).count() == 3 && members.iter().any(standby)
    }

    /// Polls `condition` every 100 ms for up to `patience`; how long it took, if it held.
    async fn within<F, Fut>(&self, patience: Duration, mut condition: F) -> Option<Duration>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let started = Instant::now();
        while started.elapsed() < patience {
            if condition().await {
                return Some(started.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        None
    }

    /// Whether node `node`'s PostgreSQL, asked directly (not through HAProxy), commits a
    /// transaction as a primary: its commit returns only once a synchronous standby confirmed it.
    /// The transaction must write WAL (a transactional logical message): one that only takes an
    /// xid commits without waiting for any standby.
    async fn commits_directly(&self, node: u16) -> bool {
        let output = tokio::process::Command::new("timeout")
            .args(["5", "psql", "-h", "127.0.0.1", "-p", &self.pg_port(node).to_string(), "-U", "postgres"])
            .args(["-d", "postgres", "-tAc", "SELECT pg_is_in_recovery()::text || ' ' || pg_logical_emit_message(true, 'intake-faults', 'probe')::text"])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .await;
        output.is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).starts_with("false "))
    }

    /// The iptables rules that make node `node` silent: nothing reaches its PostgreSQL or its
    /// Patroni REST API, and nothing its processes send (replies, replication, its Patroni's
    /// calls to etcd and to the other nodes) leaves. Dropped, never rejected: no resets.
    fn cut_rules(&self, node: u16) -> Vec<String> {
        let tag = format!("-m comment --comment intake-faults:{}", self.dir);
        let mut rules: Vec<String> = [self.pg_port(node), self.rest_port(node)]
            .iter()
            .map(|port| format!("INPUT -i lo -p tcp --dport {port} {tag} -j DROP"))
            .collect();
        rules.push(format!("OUTPUT -o lo -m owner --uid-owner intake-db{node} {tag} -j DROP"));
        rules
    }

    async fn iptables(&self, action: &str, rules: &[String]) -> Result<String, String> {
        let script: Vec<String> = rules.iter().map(|rule| format!("iptables {action} {rule}")).collect();
        self.sh(&script.join(" && ")).await
    }

    fn node_of(name: &str) -> u16 {
        name.trim_start_matches("node-").parse().unwrap_or(0)
    }

    /// The etcd member that leads etcd's quorum (etcd's v2 statistics).
    async fn etcd_leader(&self) -> Option<u16> {
        for member in 1..=3 {
            let url = format!("http://127.0.0.1:{}/v2/stats/self", self.etcd_port(member));
            let Ok(response) = self.http.get(url).send().await else { continue };
            if response.json::<Value>().await.is_ok_and(|s| s["state"] == json!("StateLeader")) {
                return Some(member);
            }
        }
        None
    }

    /// Injects the fault; returns once it is in place (a switchover, once patronictl has it
    /// done), with the moment recovery is measured from.
    pub async fn inject(&self, fault: Fault) -> Injected {
        // Each fault starts on a whole layout (the one before may still be rejoining).
        let waited = self.within(HEALING, || self.whole()).await;
        let leader_before = self.leader().await.unwrap_or_default();
        let mut injected = Injected { fault: Some(fault), leader_before: leader_before.clone(), ..Injected::default() };
        injected.details["whole_before_after_s"] = json!(waited.map(|w| w.as_secs_f64()));
        let dir = &self.dir;
        let outcome = match fault {
            Fault::PrimaryKill => {
                injected.node = Self::node_of(&leader_before);
                self.sh(&format!("ha_node_signal {dir} {} KILL", injected.node)).await
            }
            Fault::PrimaryCut => {
                injected.node = Self::node_of(&leader_before);
                self.iptables("-I", &self.cut_rules(injected.node)).await
            }
            Fault::Switchover => {
                injected.at = Some(Instant::now());
                let done = self.sh(&format!("ha_switchover {dir}")).await;
                if let Ok(line) = &done {
                    let printed = line.lines().last().unwrap_or_default();
                    injected.details["switchover"] = intake_tests::serde_json::from_str(printed).unwrap_or(json!(line));
                }
                done
            }
            Fault::StandbyKill => {
                let standby = self.sync_standby().await.unwrap_or_default();
                injected.node = Self::node_of(&standby);
                self.sh(&format!("ha_node_signal {dir} {} KILL", injected.node)).await
            }
            Fault::EtcdKill => {
                let leader = self.etcd_leader().await;
                injected.details["etcd_member_was_its_leader"] = json!(leader.is_some());
                injected.node = leader.unwrap_or(1);
                self.sh(&format!("kill -KILL \"$(cat {dir}/run/ha-etcd-{}.pid)\"", injected.node)).await
            }
            Fault::EtcdQuorumLoss => {
                // The primary's node, checked afterwards; etcd's leader and one more member go.
                injected.node = Self::node_of(&leader_before);
                let leader = self.etcd_leader().await.unwrap_or(1);
                let other = (1..=3).find(|m| *m != leader).unwrap_or(2);
                injected.details["etcd_members"] = json!([leader, other]);
                self.sh(&format!(
                    "kill -KILL \"$(cat {dir}/run/ha-etcd-{leader}.pid)\" \"$(cat {dir}/run/ha-etcd-{other}.pid)\""
                ))
                .await
            }
            Fault::PatroniFreeze => {
                injected.node = Self::node_of(&leader_before);
                self.sh(&format!("kill -STOP -- \"-$(cat {dir}/run/ha-node-{}.pid)\"", injected.node)).await
            }
        };
        // Recovery counts from the fault in place (a switchover's, from its start).
        injected.at.get_or_insert_with(Instant::now);
        if let Err(error) = outcome {
            injected.details["injection_failed"] = json!(error);
        }
        injected
    }

    /// The whole cluster restored to `target` from pgBackRest (the runbook's restore), the
    /// layout whole again afterwards.
    pub async fn restore_to(&self, target: time::OffsetDateTime) -> Result<(), String> {
        let format =
            time::macros::format_description!("[year]-[month]-[day] [hour]:[minute]:[second].[subsecond digits:6]+00");
        let target = target.format(&format).map_err(|e| e.to_string())?;
        self.sh(&format!("ha_restore_cluster {} '{target}' 2>&1", self.dir)).await?;
        match self.within(HEALING, || self.whole()).await {
            Some(_) => Ok(()),
            None => Err("the layout was not whole again after the restore".to_owned()),
        }
    }

    /// The moment recovery is measured from.
    pub fn at(injected: &Injected) -> Instant {
        injected.at.unwrap_or_else(Instant::now)
    }

    /// Ends the fault (the node cut off joins again, the frozen Patroni runs again, the killed
    /// node or etcd member starts again), waits for the layout to be whole, and says what the
    /// fault showed, with "ok" false when it broke a rule of its own.
    pub async fn settle(&self, mut injected: Injected) -> Value {
        let Some(fault) = injected.fault else { return Value::Null };
        let at = Self::at(&injected);
        let node = injected.node;
        let mut ok = injected.details.get("injection_failed").is_none();
        let mut details = std::mem::take(&mut injected.details);
        details[if fault == Fault::EtcdKill { "etcd_member" } else { "node" }] = match fault {
            Fault::Switchover => Value::Null,
            Fault::EtcdKill => json!(node),
            _ => json!(format!("node-{node}")),
        };
        details["leader_before"] = json!(injected.leader_before);
        details["replication"] = json!(if asynchronous() { "async" } else { "sync" });
        let old_leader = injected.leader_before.clone();
        let new_leader = || {
            let old = old_leader.clone();
            async move { self.leader().await.is_some_and(|leader| leader != old) }
        };
        match fault {
            Fault::PrimaryKill | Fault::PrimaryCut => {
                let moved = self.within(Duration::from_secs(30), new_leader).await;
                details["new_leader_listed_after_s"] = json!(moved.map(|_| at.elapsed().as_secs_f64()));
                ok &= moved.is_some();
                if fault == Fault::PrimaryCut {
                    // The machine answers again: lifted, it finds another leader and rejoins.
                    details["cut_s"] = json!(at.elapsed().as_secs_f64());
                    if let Err(error) = self.iptables("-D", &self.cut_rules(node)).await {
                        details["uncut_failed"] = json!(error);
                        ok = false;
                    }
                }
            }
            Fault::PatroniFreeze => {
                // Once another node leads, the old primary's PostgreSQL, still running as a
                // primary under its frozen Patroni, must not commit anything: no two primaries
                // take writes.
                let moved = self.within(Duration::from_secs(40), new_leader).await;
                details["new_leader_listed_after_s"] = json!(moved.map(|_| at.elapsed().as_secs_f64()));
                // The new primary first: once it has committed, its promotion is over, and it no
                // longer confirms anything the old one sends.
                // In strict synchronous mode its commits wait until a standby follows it.
                let new = Self::node_of(&self.leader().await.unwrap_or_default());
                let new_took = self.within(Duration::from_secs(20), || self.commits_directly(new)).await.is_some();
                let old_took = self.commits_directly(node).await;
                details["old_primary_took_a_write"] = json!(old_took);
                details["new_primary_took_a_write"] = json!(new_took);
                // With asynchronous replication nothing holds the old primary's commits: it takes
                // writes until its Patroni demotes it, and HAProxy (which no longer sends it any)
                // is what keeps two primaries from taking the service's writes.
                ok &= moved.is_some() && (asynchronous() || !old_took) && new_took;
                let frozen_for = TTL + Duration::from_secs(5);
                tokio::time::sleep(frozen_for.saturating_sub(at.elapsed())).await;
                details["frozen_s"] = json!(at.elapsed().as_secs_f64());
                let dir = &self.dir;
                if let Err(error) = self.sh(&format!("kill -CONT -- \"-$(cat {dir}/run/ha-node-{node}.pid)\"")).await {
                    details["thaw_failed"] = json!(error);
                    ok = false;
                }
            }
            Fault::StandbyKill => {
                // Commits reach two nodes again once the other standby is synchronous.
                let killed = format!("node-{node}");
                let other_sync = || async { self.sync_standby().await.is_some_and(|s| s != killed) };
                let again = self.within(Duration::from_secs(20), other_sync).await;
                details["synchronous_standby_again_after_s"] = json!(again.map(|_| at.elapsed().as_secs_f64()));
                details["leader_after"] = json!(self.leader().await);
                // With asynchronous replication no standby is synchronous.
                ok &= (asynchronous() || again.is_some())
                    && self.leader().await.as_deref() == Some(injected.leader_before.as_str());
            }
            Fault::EtcdKill => {
                // Nothing changes: the same leader, no failover.
                let leader_after = self.leader().await;
                details["leader_after"] = json!(leader_after);
                ok &= leader_after.as_deref() == Some(injected.leader_before.as_str());
            }
            Fault::EtcdQuorumLoss => {
                // Past the leader key's ttl without etcd, the primary is still the primary (its
                // own REST API says so: Patroni's view of the cluster needs etcd).
                tokio::time::sleep((TTL + Duration::from_secs(5)).saturating_sub(at.elapsed())).await;
                details["quorum_lost_s"] = json!(at.elapsed().as_secs_f64());
                let url = format!("http://127.0.0.1:{}/primary", self.rest_port(node));
                let kept = self.http.get(url).send().await.is_ok_and(|r| r.status().is_success());
                details["primary_kept_without_etcd"] = json!(kept);
                ok &= kept;
            }
            Fault::Switchover => {
                ok &= details["switchover"]["to"].is_string();
            }
        }
        details["new_leader"] = json!(self.leader().await);
        // What was killed starts again (a machine that comes back), and the layout is whole.
        let restarted = Instant::now();
        if let Err(error) =
            self.sh(&format!("start_ha_cluster {} {} {} >/dev/null", self.dir, self.base, self.primary)).await
        {
            details["restart_failed"] = json!(error);
            ok = false;
        }
        let whole = self.within(HEALING, || self.whole()).await;
        details["whole_again_after_restart_s"] = json!(whole.map(|_| restarted.elapsed().as_secs_f64()));
        details["members"] = json!(self
            .members()
            .await
            .iter()
            .map(|m| format!("{} {} {} timeline {:?}", m.name, m.role, m.state, m.timeline))
            .collect::<Vec<_>>());
        details["ok"] = json!(ok && whole.is_some());
        details
    }
}
