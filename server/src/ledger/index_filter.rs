//! Which step key and intent index entries each run may hold, so that a Begin skips the
//! store lookups that would find nothing: the step index read of a step key the run never
//! used and the intent index scan of an intent it never recorded. Most Begins are new calls,
//! and each of those lookups otherwise costs a point read or a fresh engine iterator.
//!
//! A run's filter holds a 64-bit tag (branch and the first bytes of the name or fingerprint,
//! both already hashes) of every such entry the store holds, and possibly more. It answers
//! "certainly absent" only for a tag it lacks; a tag it holds sends the caller to the store,
//! so a collision costs a lookup, never an answer. Coherence rests on two rules the ledger
//! keeps:
//! - a filter is installed from a scan of the run's whole step and intent indexes, by a
//!   decision holding the run's lock;
//! - every ledger write goes through [`super::Ledger::commit`], which adds the tag of every
//!   index key the batch writes to its run's filter before writing (every writer of a run's
//!   index keys holds the run's lock, so no write falls between a scan and its install).
//!
//! A filter is therefore never invalidated: a write that fails, or a delete, leaves a tag the
//! store no longer needs, which only costs a lookup. A run with more than
//! [`MAX_TAGS_PER_RUN`] entries is marked as not filtered (every lookup goes to the store).
//!
//! All filters together hold at most a budget of tags. When it would be exceeded the oldest
//! filters give way, and a run whose filter goes is marked unfiltered (one tag), not dropped:
//! its Begins look in the store instead of scanning its whole index again. Only once that
//! mark is the oldest and gives way in turn may the run's next Begin install a filter anew.
//! Rebuilding costs a scan of the run's index, so a working set larger than the budget must
//! not cause one per Begin: dropping every filter at once did, and with 64 runs of 16,000
//! effects each (two million tags) the ledger did little but re-scan them.

use std::collections::VecDeque;

use foldhash::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard};

use crate::store::keys::{self, NameKey, RunKey};

/// Most index entries one run's filter covers; a larger run is looked up in the store.
pub(crate) const MAX_TAGS_PER_RUN: usize = 1 << 16;

const STEP: u64 = 0x5354_4550_0000_0000;
const INTENT: u64 = 0x494e_5445_0000_0000;

fn tag(kind: u64, branch: u32, hash: &[u8]) -> u64 {
    let head = u64::from_le_bytes(hash[..8].try_into().expect("hashes have 8 bytes"));
    head ^ kind ^ u64::from(branch).rotate_left(17)
}

/// The tag of a step key (by its name key) in branch `branch`'s step index.
pub(crate) fn step_tag(branch: u32, name: &NameKey) -> u64 {
    tag(STEP, branch, name)
}

/// The tag of an intent (by its fingerprint) in branch `branch`'s intent index.
pub(crate) fn intent_tag(branch: u32, fp: &[u8; 32]) -> u64 {
    tag(INTENT, branch, fp)
}

/// The tag of a step or intent index key, with its run; `None` for any other key.
pub(crate) fn key_tag(key: &[u8]) -> Option<(RunKey, u64)> {
    if let Some((rk, branch, name)) = keys::decode_step(key) {
        return Some((rk, step_tag(branch, &name)));
    }
    keys::decode_intent(key).map(|(rk, branch, fp)| (rk, intent_tag(branch, &fp)))
}

enum RunFilter {
    /// Every index entry's tag (and maybe more).
    Tags(HashSet<u64>),
    /// Too many entries to filter: always look in the store.
    Unfiltered,
}

impl RunFilter {
    /// Tags it counts against the budget.
    fn size(&self) -> usize {
        match self {
            RunFilter::Tags(t) => t.len().max(1),
            RunFilter::Unfiltered => 1,
        }
    }
}

#[derive(Default)]
struct Filters {
    runs: HashMap<RunKey, RunFilter>,
    /// Runs by when their entry was made, oldest first: the order they give way in. May
    /// name a run more than once, or one no longer in `runs` (skipped).
    order: VecDeque<RunKey>,
    /// Tags held by all filters (an unfiltered run counts one).
    tags: usize,
}

impl Filters {
    /// Makes the oldest entries give way until `need` more tags fit in `budget`: a filter
    /// becomes an unfiltered mark (and the youngest entry), a mark goes.
    fn make_room(&mut self, need: usize, budget: usize) {
        while self.tags + need > budget {
            let Some(rk) = self.order.pop_front() else {
                return;
            };
            match self.runs.insert(rk, RunFilter::Unfiltered) {
                Some(RunFilter::Tags(t)) => {
                    self.tags = self.tags - RunFilter::Tags(t).size() + 1;
                    self.order.push_back(rk);
                }
                Some(RunFilter::Unfiltered) => {
                    self.runs.remove(&rk);
                    self.tags -= 1;
                }
                None => {
                    self.runs.remove(&rk);
                }
            }
        }
    }
}

/// The index filters of every run that has one (see the module docs).
pub(crate) struct IndexFilters {
    filters: Mutex<Filters>,
    /// Most tags all filters hold together (0: no filters).
    budget: usize,
}

impl IndexFilters {
    /// Filters holding at most `budget` tags together (0: none; every lookup goes to the
    /// store).
    pub(crate) fn new(budget: usize) -> Self {
        Self {
            filters: Mutex::new(Filters::default()),
            budget,
        }
    }

    fn filters(&self) -> MutexGuard<'_, Filters> {
        // Every change under the lock leaves the map usable (at worst a count off), so a
        // panic elsewhere cannot make a filter wrong.
        self.filters.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Is there nothing to install for the run: its filter is installed (filtered or marked
    /// unfiltered), or filters are off?
    pub(crate) fn installed(&self, rk: &RunKey) -> bool {
        self.budget == 0 || self.filters().runs.contains_key(rk)
    }

    /// Installs the run's filter from `tags`, every index entry the store holds for it, or
    /// marks it unfiltered when `complete` is false (there were more than
    /// [`MAX_TAGS_PER_RUN`]). The caller holds the run's lock.
    pub(crate) fn install(&self, rk: RunKey, tags: impl IntoIterator<Item = u64>, complete: bool) {
        if self.budget == 0 {
            return;
        }
        let mut filter = if complete {
            RunFilter::Tags(tags.into_iter().collect())
        } else {
            RunFilter::Unfiltered
        };
        let mut filters = self.filters();
        // Installed twice (after a mark gave way while the caller scanned): the new one counts.
        if let Some(old) = filters.runs.remove(&rk) {
            filters.tags -= old.size();
        }
        if filter.size() > self.budget {
            // Larger than the whole budget: not filtered, and nothing else gives way for it.
            filter = RunFilter::Unfiltered;
        }
        filters.make_room(filter.size(), self.budget);
        filters.tags += filter.size();
        filters.runs.insert(rk, filter);
        filters.order.push_back(rk);
    }

    /// May the run's index hold an entry with `tag`? False only when its filter is installed
    /// and lacks the tag.
    pub(crate) fn may_hold(&self, rk: &RunKey, tag: u64) -> bool {
        if self.budget == 0 {
            return true;
        }
        match self.filters().runs.get(rk) {
            Some(RunFilter::Tags(tags)) => tags.contains(&tag),
            Some(RunFilter::Unfiltered) | None => true,
        }
    }

    /// Notes that an index entry with `tag` is being written to the run's index.
    pub(crate) fn note(&self, rk: &RunKey, tag: u64) {
        if self.budget == 0 {
            return;
        }
        let mut filters = self.filters();
        let len = match filters.runs.get_mut(rk) {
            Some(RunFilter::Tags(tags)) => {
                if !tags.insert(tag) {
                    return;
                }
                tags.len()
            }
            _ => return,
        };
        filters.tags += 1;
        if len > MAX_TAGS_PER_RUN {
            filters.tags -= len - 1;
            filters.runs.insert(*rk, RunFilter::Unfiltered);
        } else {
            filters.make_room(0, self.budget);
        }
    }

    /// Tags held by all filters.
    #[cfg(test)]
    fn tags(&self) -> usize {
        self.filters().tags
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_differ_by_kind_and_branch_and_decode_from_keys() {
        let rk = keys::run_key("t", "r");
        let name = keys::name_key("charge");
        let fp = [7u8; 32];
        assert_ne!(step_tag(0, &name), step_tag(1, &name));
        assert_ne!(intent_tag(0, &fp), intent_tag(1, &fp));
        let mut same = [0u8; 32];
        same[..16].copy_from_slice(&name);
        assert_ne!(step_tag(0, &name), intent_tag(0, &same));
        assert_eq!(
            key_tag(&keys::step(&rk, 3, "charge")),
            Some((rk, step_tag(3, &name)))
        );
        assert_eq!(
            key_tag(&keys::intent(&rk, 2, &fp, 5)),
            Some((rk, intent_tag(2, &fp)))
        );
        assert_eq!(key_tag(&keys::effect(&rk, 1)), None);
        assert_eq!(key_tag(&keys::run(&rk)), None);
    }

    #[test]
    fn only_an_installed_filter_lacking_the_tag_says_absent() {
        let f = IndexFilters::new(100);
        let rk = [1; 16];
        assert!(f.may_hold(&rk, 5), "no filter: look in the store");
        assert!(!f.installed(&rk));
        f.install(rk, [5, 6], true);
        assert!(f.installed(&rk));
        assert!(f.may_hold(&rk, 5));
        assert!(!f.may_hold(&rk, 7));
        f.note(&rk, 7);
        assert!(f.may_hold(&rk, 7), "a noted write is held");
        // Another run's filter is not this one's.
        assert!(f.may_hold(&[2; 16], 9));
        f.note(&[2; 16], 9);
        assert!(!f.installed(&[2; 16]), "a note installs nothing");
        // A run too large to filter always looks in the store.
        f.install([3; 16], [], false);
        assert!(f.installed(&[3; 16]));
        assert!(f.may_hold(&[3; 16], 1));
        // Off: every lookup goes to the store.
        let off = IndexFilters::new(0);
        assert!(off.installed(&rk), "off: nothing to install");
        off.install(rk, [5], true);
        assert!(off.may_hold(&rk, 6));
    }

    /// Through a ledger: a Begin installs its run's filter, which then says absent for the
    /// step keys and intents the run never had and holds every one it recorded; a filter
    /// installed from the store (after a drop) holds the same; and a repeat of a recorded
    /// intent under a new step key is still found in the store.
    #[test]
    fn a_ledger_skips_only_lookups_of_what_its_run_never_had() {
        use crate::ledger::Decision;
        use crate::ledger::test_support::{pay, pay_call, pay_ledger};

        let ledger = pay_ledger();
        let rk = keys::run_key("t", "r");
        let filters = &ledger.index_filters;
        let first = pay(&ledger, 1);
        assert!(filters.installed(&rk));
        let step = |n: u64| step_tag(0, &keys::name_key(&format!("s{n}")));
        let intent = |rec: &crate::ledger::records::EffectRecord| {
            intent_tag(0, &rec.intent_fp[..].try_into().unwrap())
        };
        assert!(filters.may_hold(&rk, step(1)));
        assert!(filters.may_hold(&rk, intent(&first)));
        assert!(!filters.may_hold(&rk, step(2)), "a step key never used");
        let second = pay(&ledger, 2);
        assert!(filters.may_hold(&rk, step(2)));
        assert!(filters.may_hold(&rk, intent(&second)));

        // Rebuilt from the store: the same answers.
        filters.filters().runs.clear();
        assert!(!filters.installed(&rk));
        ledger.ensure_index_filter(&rk).unwrap();
        for tag in [step(1), step(2), intent(&first), intent(&second)] {
            assert!(filters.may_hold(&rk, tag));
        }
        assert!(!filters.may_hold(&rk, step(3)));

        // The first call's intent again under a new step key: found, not a new effect.
        let decision = ledger
            .begin("t", &pay_call("r", "s-new", 1))
            .unwrap()
            .decision;
        assert!(
            !matches!(decision, Decision::Execute { .. }),
            "a repeat of a recorded intent was granted again: {decision:?}"
        );
    }

    #[test]
    fn filters_stay_within_their_budget_and_a_run_within_its_cap() {
        let f = IndexFilters::new(10);
        f.install([1; 16], 0..6, true);
        assert_eq!(f.tags(), 6);
        f.install([2; 16], 0..6, true);
        assert!(f.tags() <= 10);
        assert!(
            f.installed(&[1; 16]) && f.may_hold(&[1; 16], 12345),
            "over budget: the oldest filter became an unfiltered mark"
        );
        assert!(!f.may_hold(&[2; 16], 12345), "the newest filter stays");
        for t in 100..110 {
            f.note(&[2; 16], t);
            assert!(f.tags() <= 10);
        }
        assert!(f.may_hold(&[2; 16], 12345), "given way: look in the store");
        // Marks give way too, the oldest first: only then may a run install a filter anew.
        for r in 3..=12u8 {
            f.install([r; 16], [1], true);
            assert!(f.tags() <= 10);
        }
        assert!(!f.installed(&[1; 16]), "the oldest mark went");
        assert!(f.installed(&[12; 16]) && !f.may_hold(&[12; 16], 2));
        // A filter larger than the whole budget is a mark, and the others stay.
        f.install([13; 16], 0..11, true);
        assert!(f.installed(&[13; 16]) && f.may_hold(&[13; 16], 99));
        assert!(f.tags() <= 10);
        let g = IndexFilters::new(10);
        g.install([1; 16], 0..3, true);
        g.install([2; 16], 0..11, true);
        assert!(g.may_hold(&[2; 16], 99) && !g.may_hold(&[1; 16], 99));
        assert_eq!(g.tags(), 4, "nothing gave way for the mark");

        let big = IndexFilters::new(usize::MAX);
        big.install([4; 16], 0..MAX_TAGS_PER_RUN as u64, true);
        assert!(!big.may_hold(&[4; 16], u64::MAX));
        big.note(&[4; 16], u64::MAX);
        assert!(
            big.may_hold(&[4; 16], u64::MAX - 1),
            "past the cap: unfiltered"
        );
        assert_eq!(big.tags(), 1);
    }

    /// Through a ledger whose filters' budget is far smaller than its runs' indexes: filters
    /// give way and come back as runs interleave, and every answer stays right. (In debug
    /// builds every "absent" a filter gives is also checked against the store.)
    #[test]
    fn a_ledger_answers_right_while_its_filters_give_way() {
        use crate::ledger::test_support::{pay_call, pay_ledger_with};
        use crate::ledger::{Decision, LedgerConfig};

        let mut config = LedgerConfig::default();
        config.limits.max_filtered_index_entries = 12;
        let ledger = pay_ledger_with(config);
        let call = |run: u64, step: String, n: u64| pay_call(&format!("r{run}"), &step, n);
        for n in 0..8u64 {
            for run in 0..6u64 {
                let new = ledger.begin("t", &call(run, format!("s{n}"), n)).unwrap();
                assert!(
                    matches!(new.decision, Decision::Execute { .. }),
                    "run {run} call {n}: {:?}",
                    new.decision
                );
                assert!(ledger.index_filters.tags() <= 12);
                // An earlier call again, by step key and by intent under a new step key.
                let k = n / 2;
                for again in [call(run, format!("s{k}"), k), call(run, format!("x{n}"), k)] {
                    let d = ledger.begin("t", &again).unwrap().decision;
                    assert!(
                        !matches!(d, Decision::Execute { .. }),
                        "run {run}: a recorded call ran again: {d:?}"
                    );
                }
            }
        }
    }

    /// Runs that together outgrow the budget never have to be scanned again: whatever gives
    /// way is marked unfiltered, so every run stays installed while they all keep growing
    /// (dropping every filter at once made each next Begin re-scan its run's index).
    #[test]
    fn outgrowing_the_budget_makes_no_run_scan_again() {
        let f = IndexFilters::new(100);
        let runs: Vec<RunKey> = (0..4u8).map(|r| [r; 16]).collect();
        for rk in &runs {
            f.install(*rk, [], true);
        }
        for t in 0..40u64 {
            for rk in &runs {
                f.note(rk, t);
                assert!(f.tags() <= 100);
                for other in &runs {
                    assert!(f.installed(other), "a run would be scanned again");
                }
            }
        }
        // What stayed filtered still answers "absent"; what gave way looks in the store.
        let filtered = runs.iter().filter(|rk| !f.may_hold(rk, 1000)).count();
        assert!((1..4).contains(&filtered), "{filtered} filters kept");
        for rk in &runs {
            assert!(
                f.may_hold(rk, 39),
                "every recorded tag is held or unfiltered"
            );
        }
    }
}
