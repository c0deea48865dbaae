//! The cap on `error.details`: at most [`MAX_DETAILS_PER_ITEM`] entries per object checked (a
//! conversion, a batch item, the batch envelope) and [`MAX_DETAILS_PER_RESPONSE`] per response.
//! When problems are left out, the last entry (path `""`, the root of the object) says how many.
//! This is the only place that caps; the gateway renders what it is given.

use crate::error::FieldError;
use std::fmt::Display;

pub const MAX_DETAILS_PER_ITEM: usize = 20;
pub const MAX_DETAILS_PER_RESPONSE: usize = 1000;

/// The problems found in one object: the first [`MAX_DETAILS_PER_ITEM`] of them, and how many
/// there were in all. Problems past the cap are counted, not built, so that a body of 100,000
/// unknown fields costs no more than counting them.
#[derive(Debug, Default)]
pub(crate) struct Problems {
    first: Vec<FieldError>,
    total: usize,
}

impl Problems {
    pub(crate) fn add(&mut self, path: impl Display, message: impl Display) {
        self.total += 1;
        if self.first.len() < MAX_DETAILS_PER_ITEM {
            self.first.push(FieldError::new(path.to_string(), message.to_string()));
        }
    }

    /// How many problems were found so far.
    pub(crate) fn count(&self) -> usize {
        self.total
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// At most `limit` (at least 1) entries; when some are left out, the last entry says how many.
    pub(crate) fn into_details(mut self, limit: usize) -> Vec<FieldError> {
        let limit = limit.clamp(1, MAX_DETAILS_PER_ITEM);
        if self.total <= limit {
            return self.first;
        }
        self.first.truncate(limit - 1);
        let left_out = self.total - self.first.len();
        let message = if self.first.is_empty() {
            format!("{left_out} problems not listed")
        } else {
            format!("{left_out} more problems not listed")
        };
        self.first.push(FieldError::new("", message));
        self.first
    }
}

/// Shares [`MAX_DETAILS_PER_RESPONSE`] among the refused items of one batch, in input order.
/// One entry is kept back for each refused item still to come, so that every refused item
/// names at least one problem (a batch has at most 500 items, fewer than the cap).
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
        let limit = self.entries_left.saturating_sub(self.lists_left).min(MAX_DETAILS_PER_ITEM);
        let details = problems.into_details(limit);
        self.entries_left = self.entries_left.saturating_sub(details.len());
        details
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(count: usize) -> Problems {
        let mut problems = Problems::default();
        for index in 0..count {
            problems.add(format_args!("field_{index}"), "is not a known field");
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
    fn a_small_batch_is_not_cut_below_the_item_cap() {
        let mut budget = ResponseBudget::new(3);
        for _ in 0..3 {
            assert_eq!(budget.details(problems(25)).len(), MAX_DETAILS_PER_ITEM);
        }
    }
}
