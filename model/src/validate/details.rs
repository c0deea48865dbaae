//! The cap on `error.details`. A field the schema names (`event`, `address.zip`, `tags`) is
//! always listed: there are a few dozen at most. What the sender names (unknown fields, tag
//! entries) can number 100,000 in a body: at most [`MAX_DETAILS_PER_ITEM`] of those are listed
//! per object checked (a conversion, a batch item, the batch envelope) and
//! [`MAX_DETAILS_PER_RESPONSE`] per response. When some are left out, the last entry (path
//! `""`, the root of the object) says how many. This is the only place that caps; the gateway
//! renders what it is given.

use crate::error::FieldError;
use std::fmt::Display;

pub const MAX_DETAILS_PER_ITEM: usize = 20;
pub const MAX_DETAILS_PER_RESPONSE: usize = 1000;

/// The problems found in one object: every problem of a schema field, the first
/// [`MAX_DETAILS_PER_ITEM`] of the fields the sender named, and how many of those there were in
/// all. Problems past the cap are counted, not built, so that a body of 100,000 unknown fields
/// costs no more than counting them.
#[derive(Debug, Default)]
pub(crate) struct Problems {
    /// In the order found; `true` for a field the sender named.
    listed: Vec<(FieldError, bool)>,
    sender_named_listed: usize,
    sender_named: usize,
    total: usize,
}

impl Problems {
    /// A problem of a field the schema names: always listed.
    pub(crate) fn add(&mut self, path: impl Display, message: impl Display) {
        self.total += 1;
        self.listed.push((FieldError::new(path.to_string(), message.to_string()), false));
    }

    /// A problem of a field the sender named (an unknown field, a tag entry).
    pub(crate) fn add_sender_named(&mut self, path: impl Display, message: impl Display) {
        self.total += 1;
        self.sender_named += 1;
        if self.sender_named_listed < MAX_DETAILS_PER_ITEM {
            self.sender_named_listed += 1;
            self.listed.push((FieldError::new(path.to_string(), message.to_string()), true));
        }
    }

    /// How many problems were found so far.
    pub(crate) fn count(&self) -> usize {
        self.total
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// Every schema field's problem and at most `limit` entries for the fields the sender named,
    /// the last of them saying how many were left out, if any; never an empty list.
    pub(crate) fn into_details(self, limit: usize) -> Vec<FieldError> {
        let limit = limit.clamp(1, MAX_DETAILS_PER_ITEM);
        let listed_sender_named = if self.sender_named <= limit { self.sender_named } else { limit.saturating_sub(1) };
        let left_out = self.sender_named - listed_sender_named;
        let mut kept = 0;
        let mut details: Vec<FieldError> = self
            .listed
            .into_iter()
            .filter(|(_, sender_named)| {
                let keep = !sender_named || kept < listed_sender_named;
                kept += usize::from(*sender_named && keep);
                keep
            })
            .map(|(detail, _)| detail)
            .collect();
        if left_out > 0 {
            let more = if details.is_empty() { "" } else { " more" };
            details.push(FieldError::new("", format!("{left_out}{more} problems not listed")));
        }
        details
    }

    /// How many entries [`Problems::into_details`] gives for the sender's fields with `limit`.
    fn sender_named_entries(&self, limit: usize) -> usize {
        self.sender_named.min(limit.clamp(1, MAX_DETAILS_PER_ITEM))
    }
}

/// Shares [`MAX_DETAILS_PER_RESPONSE`] entries for the fields the senders named among the
/// refused items of one batch, in input order. One entry is kept back for each refused item
/// still to come, so that every refused item names at least one problem (a batch has at most
/// 500 items, fewer than the cap).
pub(crate) struct ResponseBudget {
    entries_left: usize,
    lists_left: usize,
}

impl ResponseBudget {
    /// A budget for `lists` refused items.
    pub(crate) fn new(lists: usize) -> Self {
        ResponseBudget { entries_left: MAX_DETAILS_PER_RESPONSE, lists_left: lists }
    }

    pub(crate) fn details(&mut self, problems: Problems) -> Vec<FieldError> {
        self.lists_left = self.lists_left.saturating_sub(1);
        let limit = self.entries_left.saturating_sub(self.lists_left).max(1);
        let used = problems.sender_named_entries(limit);
        self.entries_left = self.entries_left.saturating_sub(used);
        problems.into_details(limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(count: usize) -> Problems {
        let mut problems = Problems::default();
        for index in 0..count {
            problems.add_sender_named(format_args!("field_{index}"), "is not a known field");
        }
        problems
    }

    #[test]
    fn up_to_the_cap_every_problem_is_listed() {
        let details = problems(MAX_DETAILS_PER_ITEM).into_details(MAX_DETAILS_PER_ITEM);
        assert_eq!(details.len(), MAX_DETAILS_PER_ITEM);
        assert_eq!(details.last().map(|d| d.path.as_str()), Some("field_19"));
    }

    #[test]
    fn past_the_cap_the_last_entry_counts_the_rest() {
        let details = problems(1234).into_details(MAX_DETAILS_PER_ITEM);
        assert_eq!(details.len(), MAX_DETAILS_PER_ITEM);
        assert_eq!(details[18].path, "field_18");
        assert_eq!(details[19], FieldError::new("", "1215 more problems not listed"));
    }

    #[test]
    fn a_limit_of_one_keeps_only_the_count() {
        assert_eq!(problems(7).into_details(1), vec![FieldError::new("", "7 problems not listed")]);
        assert_eq!(problems(1).into_details(1).len(), 1);
        assert_eq!(problems(1).into_details(0)[0].path, "field_0", "never less than one entry");
    }

    #[test]
    fn a_response_budget_is_shared_and_every_list_keeps_an_entry() {
        let lists = 500;
        let mut budget = ResponseBudget::new(lists);
        let all: Vec<Vec<FieldError>> = (0..lists).map(|_| budget.details(problems(30))).collect();
        let total: usize = all.iter().map(Vec::len).sum();
        assert_eq!(total, MAX_DETAILS_PER_RESPONSE);
        assert!(all.iter().all(|details| !details.is_empty()));
        assert_eq!(all[0].len(), MAX_DETAILS_PER_ITEM);
        assert_eq!(all[0][19].message, "11 more problems not listed");
        assert_eq!(all[lists - 1], vec![FieldError::new("", "30 problems not listed")]);
    }

    #[test]
    fn problems_of_schema_fields_are_all_listed_beside_the_capped_ones() {
        let mut mixed = problems(100);
        for index in 0..30 {
            mixed.add(format_args!("schema_{index}"), "is wrong");
        }
        let details = mixed.into_details(MAX_DETAILS_PER_ITEM);
        assert_eq!(details.len(), 30 + MAX_DETAILS_PER_ITEM);
        assert_eq!(details.iter().filter(|d| d.path.starts_with("schema_")).count(), 30);
        assert_eq!(details.last(), Some(&FieldError::new("", "81 more problems not listed")));
    }

    #[test]
    fn a_small_batch_is_not_cut_below_the_item_cap() {
        let mut budget = ResponseBudget::new(3);
        for _ in 0..3 {
            assert_eq!(budget.details(problems(25)).len(), MAX_DETAILS_PER_ITEM);
        }
    }
}
