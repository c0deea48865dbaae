//! What one chunk does to the stored conversions, computed without touching the database:
//! the merge of each item into its stored state, created/updated/unchanged, and the chain rules
//! of docs/api.md, "Chains". The store fetches the related rows, calls [`plan_chunk`], and writes
//! the plan with a fixed number of statements.

use intake_model::conversion::Conversion;
use intake_model::ids;
use intake_model::message::{ChainMerge, ItemResult, WriteResult};
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// The stored values of a conversion that a send can change.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Fields {
    pub parent_external_id: Option<String>,
    pub occurred_at_ms: i64,
    pub visitor_id: Option<String>,
    pub click_id: Option<String>,
    pub contact_id: Option<String>,
    pub email_sha256: Option<String>,
    pub phone_sha256: Option<String>,
    pub address_sha256: Option<String>,
    pub country: Option<String>,
    pub value: Option<String>,
    pub currency: Option<String>,
    pub hdyhau: Option<String>,
    pub tags: Option<BTreeMap<String, String>>,
}

impl Fields {
    /// What visit matching reads (docs/api.md, "Matching to visits"): matches are recomputed only
    /// when one of these changes.
    fn matching_inputs(&self) -> (&Option<String>, &Option<String>, &Option<String>, i64) {
        (&self.visitor_id, &self.click_id, &self.contact_id, self.occurred_at_ms)
    }

    /// The stored values after a send: a field the send carries replaces the stored one; a field
    /// it omits (or sent null or "") keeps it.
    fn merged_with(&self, item: &Conversion) -> Fields {
        fn pick<T: Clone>(sent: Option<T>, stored: &Option<T>) -> Option<T> {
            sent.or_else(|| stored.clone())
        }
        Fields {
            parent_external_id: pick(
                item.parent_external_id.as_ref().map(|p| p.as_str().to_owned()),
                &self.parent_external_id,
            ),
            occurred_at_ms: item.occurred_at_ms,
            visitor_id: pick(item.visitor_id.clone(), &self.visitor_id),
            click_id: pick(item.click_id.clone(), &self.click_id),
            contact_id: pick(item.contact_id.clone(), &self.contact_id),
            email_sha256: pick(item.email_sha256.as_ref().map(|h| h.as_str().to_owned()), &self.email_sha256),
            phone_sha256: pick(item.phone_sha256.as_ref().map(|h| h.as_str().to_owned()), &self.phone_sha256),
            address_sha256: pick(item.address_sha256.as_ref().map(|h| h.as_str().to_owned()), &self.address_sha256),
            country: pick(item.country.clone(), &self.country),
            value: pick(item.value.as_ref().map(|v| v.as_str().to_owned()), &self.value),
            currency: pick(item.currency.clone(), &self.currency),
            hdyhau: pick(item.hdyhau.clone(), &self.hdyhau),
            tags: pick(item.tags.clone(), &self.tags),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredConversion {
    pub id: String,
    pub event: String,
    pub external_id: String,
    pub chain_id: String,
    pub fields: Fields,
}

/// A row the chunk creates or changes, with its final chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Write {
    pub row: StoredConversion,
    /// When the gateway received the last send that changed the row (the 90-day matching rule).
    pub received_at_ms: i64,
    /// Created, or a matching input changed: its visit matches are computed again.
    pub rematch: bool,
    /// Created by this chunk: it has no stored matches yet.
    pub created: bool,
}

#[derive(Debug, Default)]
pub struct Plan {
    /// One per item, in input order.
    pub results: Vec<ItemResult>,
    pub writes: Vec<Write>,
    /// Chains this chunk starts (some may already be merged into an older one by its end).
    pub new_chains: Vec<String>,
    /// (merged chain, chain it went into): every stored row of the first is relabelled.
    pub merges: Vec<(String, String)>,
    /// Per message, the merges made by the end of it (for its reply).
    pub merged_by_message: Vec<Vec<ChainMerge>>,
}

/// One item to apply, and when the gateway received it.
#[derive(Debug, Clone, Copy)]
pub struct Item<'a> {
    pub conversion: &'a Conversion,
    pub received_at_ms: i64,
    /// What the ids it creates derive from, when its message was read from the requests
    /// topic; else they are new ULIDs.
    pub seed: Option<ids::Seed<'a>>,
}

/// The items of one workspace, in the order they are applied: the chunks of several messages
/// may follow one another, `message_sizes` items each. `stored` holds every stored conversion
/// of the workspace whose (event, external_id) is an item's, whose external_id is an item's
/// parent_external_id, or whose parent_external_id is an item's external_id.
///
/// A message's results name each item's chain as that message leaves it: a later item of the
/// same message may merge the chain an earlier one joined, and the response names the chain
/// after the write, not after a later message's.
pub fn plan_chunk(items: &[Item<'_>], message_sizes: &[usize], stored: Vec<StoredConversion>) -> Plan {
    let mut state = ChunkState::new(stored);
    let mut results = Vec::with_capacity(items.len());
    let mut merged_by_message = Vec::with_capacity(message_sizes.len());
    let mut rest = items;
    for &size in message_sizes {
        let (message, after) = rest.split_at(size.min(rest.len()));
        let first = results.len();
        results.extend(message.iter().map(|item| state.apply(item)));
        for result in &mut results[first..] {
            result.chain_id = state.chains.find(&result.chain_id);
        }
        let merged = state.chains.merges().into_iter().map(|(from, into)| ChainMerge { from, into });
        merged_by_message.push(merged.collect());
        rest = after;
    }
    debug_assert!(rest.is_empty(), "the message sizes cover every item");
    state.finish(results, merged_by_message)
}

struct ChunkState {
    rows: Vec<StoredConversion>,
    /// The first `stored` rows were read from the database; the rest are created by the chunk.
    stored: usize,
    by_pair: HashMap<(String, String), usize>,
    by_external_id: HashMap<String, Vec<usize>>,
    by_parent: HashMap<String, Vec<usize>>,
    /// Rows created or changed, with when their last change was received.
    changed: BTreeMap<usize, i64>,
    /// Rows whose visit matches must be computed again.
    rematch: BTreeSet<usize>,
    chains: Chains,
    new_chains: Vec<String>,
}

impl ChunkState {
    fn new(stored: Vec<StoredConversion>) -> Self {
        let mut state = ChunkState {
            rows: Vec::with_capacity(stored.len()),
            stored: stored.len(),
            by_pair: HashMap::new(),
            by_external_id: HashMap::new(),
            by_parent: HashMap::new(),
            changed: BTreeMap::new(),
            rematch: BTreeSet::new(),
            chains: Chains::default(),
            new_chains: Vec::new(),
        };
        for row in stored {
            state.chains.add(&row.chain_id);
            state.insert(row);
        }
        state
    }

    fn insert(&mut self, row: StoredConversion) -> usize {
        let index = self.rows.len();
        self.by_pair.insert((row.event.clone(), row.external_id.clone()), index);
        self.by_external_id.entry(row.external_id.clone()).or_default().push(index);
        if let Some(parent) = &row.fields.parent_external_id {
            self.by_parent.entry(parent.clone()).or_default().push(index);
        }
        self.rows.push(row);
        index
    }

    fn apply(&mut self, Item { conversion: item, received_at_ms, seed }: &Item<'_>) -> ItemResult {
        let pair = (item.event.as_str().to_owned(), item.external_id.as_str().to_owned());
        let (index, result) = match self.by_pair.get(&pair).copied() {
            Some(index) => {
                let merged = self.rows[index].fields.merged_with(item);
                if merged == self.rows[index].fields {
                    (index, WriteResult::Unchanged)
                } else {
                    if merged.matching_inputs() != self.rows[index].fields.matching_inputs() {
                        self.rematch.insert(index);
                    }
                    self.set_fields(index, merged);
                    self.changed.insert(index, *received_at_ms);
                    (index, WriteResult::Updated)
                }
            }
            None => {
                let row = StoredConversion {
                    id: seed.as_ref().map_or_else(ids::conversion_id, ids::Seed::conversion_id),
                    event: pair.0,
                    external_id: pair.1,
                    chain_id: String::new(), // set by link() below
                    fields: Fields::default().merged_with(item),
                };
                let index = self.insert(row);
                self.changed.insert(index, *received_at_ms);
                self.rematch.insert(index);
                (index, WriteResult::Created)
            }
        };
        let chain_id = self.link(index, seed.as_ref());
        let row = &self.rows[index];
        ItemResult {
            id: row.id.clone(),
            event: row.event.clone(),
            external_id: row.external_id.clone(),
            chain_id,
            result,
        }
    }

    fn set_fields(&mut self, index: usize, fields: Fields) {
        let old_parent = self.rows[index].fields.parent_external_id.clone();
        if fields.parent_external_id != old_parent {
            if let Some(old) = old_parent.and_then(|p| self.by_parent.get_mut(&p)) {
                old.retain(|&i| i != index);
            }
            if let Some(new) = &fields.parent_external_id {
                self.by_parent.entry(new.clone()).or_default().push(index);
            }
        }
        self.rows[index].fields = fields;
    }

    /// Joins the row to the chains of its stored parents and children, merging them all into
    /// the oldest; a row with no relatives and no chain yet starts a chain. Returns its chain.
    fn link(&mut self, index: usize, seed: Option<&ids::Seed<'_>>) -> String {
        let row = &self.rows[index];
        let parents = row.fields.parent_external_id.as_ref().and_then(|p| self.by_external_id.get(p));
        let children = self.by_parent.get(&row.external_id);
        let mut related: BTreeSet<String> = parents
            .into_iter()
            .chain(children)
            .flatten()
            .filter(|&&other| other != index)
            .map(|&other| self.chains.find(&self.rows[other].chain_id))
            .collect();
        if !row.chain_id.is_empty() {
            related.insert(self.chains.find(&row.chain_id));
        }
        let oldest = match related.first() {
            Some(oldest) => oldest.clone(),
            None => {
                let chain = seed.map_or_else(ids::chain_id, ids::Seed::chain_id);
                self.chains.add(&chain);
                self.new_chains.push(chain.clone());
                chain
            }
        };
        for chain in &related {
            self.chains.merge(chain, &oldest);
        }
        self.rows[index].chain_id = oldest.clone();
        oldest
    }

    fn finish(self, results: Vec<ItemResult>, merged_by_message: Vec<Vec<ChainMerge>>) -> Plan {
        let writes = self
            .changed
            .iter()
            .map(|(&index, &received_at_ms)| {
                let mut row = self.rows[index].clone();
                row.chain_id = self.chains.find(&row.chain_id);
                Write { row, received_at_ms, rematch: self.rematch.contains(&index), created: index >= self.stored }
            })
            .collect();
        Plan { results, writes, new_chains: self.new_chains, merges: self.chains.merges(), merged_by_message }
    }
}

/// Union-find over chain ids; the root of a set is its oldest chain. Chain ids are ULIDs, so
/// the smallest id is the earliest created.
#[derive(Default)]
struct Chains {
    parent: BTreeMap<String, String>,
}

impl Chains {
    fn add(&mut self, chain: &str) {
        self.parent.entry(chain.to_owned()).or_insert_with(|| chain.to_owned());
    }

    fn find(&self, chain: &str) -> String {
        let mut current = chain;
        while let Some(parent) = self.parent.get(current).filter(|parent| parent.as_str() != current) {
            current = parent;
        }
        current.to_owned()
    }

    fn merge(&mut self, a: &str, b: &str) {
        let (a, b) = (self.find(a), self.find(b));
        let (oldest, newest) = if a <= b { (a, b) } else { (b, a) };
        self.parent.insert(newest, oldest);
    }

    fn merges(&self) -> Vec<(String, String)> {
        self.parent
            .keys()
            .filter_map(|chain| {
                let root = self.find(chain);
                (root != *chain).then(|| (chain.clone(), root))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
