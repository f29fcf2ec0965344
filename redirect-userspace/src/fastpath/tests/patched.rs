//! Random changes to one ServiceEntry: where the patch applies, it gives the tables the whole
//! compile gives, but for the numbers the namespaces go by.
use std::collections::BTreeSet;

use proptest::{
    prelude::*,
    test_runner::{Config, TestRunner},
};

use super::props::{Entry, World, entry, world, yaml};
use crate::{
    config::{Model, load_sources},
    fastpath::{HostAddresses, Limits, compile_after, compile_with, patch::services_changed},
    pipeline,
    state::Snapshot,
};

fn model(world: &World) -> Model {
    let yaml = yaml(world);
    match load_sources([("w.yaml", yaml.as_str())]) {
        Ok(model) => model,
        Err(e) => panic!("generated world does not load:\n{e}\n{yaml}"),
    }
}

/// Entry `i` of `world` changed to `to` (its namespace, name and age kept: it keeps its place),
/// or with `append` `to` added as a new entry without an age (last in the rank order when its
/// namespace and name sort last), patched and compiled whole. Whether the patch applied.
fn patch_agrees(
    world: &World,
    (i, append): (usize, bool),
    to: &Entry,
    hosts: &HostAddresses,
    limits: Limits,
) -> Result<bool, TestCaseError> {
    let mut changed_world = world.clone();
    let (i, ns) = match append {
        true => {
            changed_world.entries.push(Entry {
                age: None,
                ..to.clone()
            });
            (world.entries.len(), to.ns)
        }
        false => {
            let was = &world.entries[i];
            changed_world.entries[i] = Entry {
                ns: was.ns,
                age: was.age,
                ..to.clone()
            };
            (i, was.ns)
        }
    };
    let (before_model, after_model) = (model(world), model(&changed_world));
    let before = Snapshot::from_model(&before_model);
    let changed = BTreeSet::from([(super::props::NAMESPACES[ns].to_string(), format!("e{i}"))]);
    let Some((after, _)) = pipeline::with_entries(
        &before,
        &before_model.service_entries,
        &after_model,
        &changed,
    ) else {
        return Ok(false);
    };
    let (tables, stats) = compile_with(&before, limits, hosts);
    let Some((patched, patched_stats)) =
        services_changed(&before, &tables, &stats, &after, limits, hosts)
    else {
        return Ok(false);
    };
    let (whole, whole_stats) = compile_with(&after, limits, hosts);
    prop_assert_eq!(patched.by_name(), whole.by_name());
    prop_assert_eq!(patched_stats, whole_stats);
    // What the agent calls gives the same.
    let (through, _) = compile_after(
        Some((&before, &tables, &stats)),
        true,
        &after,
        limits,
        hosts,
    );
    prop_assert_eq!(through.by_name(), whole.by_name());
    Ok(true)
}

fn hosts(resolved: bool) -> HostAddresses {
    match resolved {
        true => HostAddresses::from([(
            "origin.example.org".to_string(),
            vec!["198.51.100.9".parse().unwrap()],
        )]),
        false => HostAddresses::new(),
    }
}

/// Runs `cases` random changes with `limits`; how many the patch applied to.
fn run(cases: u32, limits: impl Strategy<Value = Limits>) -> u32 {
    let mut runner = TestRunner::new(Config::with_cases(cases));
    let applied = std::cell::Cell::new(0);
    let change = (
        world(),
        (any::<prop::sample::Index>(), proptest::bool::weighted(0.25)),
        entry(),
        any::<bool>(),
        limits,
    )
        .prop_filter("a world with an entry", |(w, ..)| !w.entries.is_empty());
    let outcome = runner.run(&change, |(world, (i, append), to, resolved, limits)| {
        let i = i.index(world.entries.len());
        if patch_agrees(&world, (i, append), &to, &hosts(resolved), limits)? {
            applied.set(applied.get() + 1);
        }
        Ok(())
    });
    if let Err(e) = outcome {
        panic!("{e}");
    }
    applied.get()
}

#[test]
fn a_patched_change_gives_the_tables_of_the_whole_compile() {
    let applied = run(512, Just(Limits::default()));
    // Networks, moved entries and entries that do not stand alone are compiled whole: the patch
    // still applies to enough changes for the comparison above to mean something.
    assert!(
        applied >= 64,
        "the patch applied to {applied} of 512 changes"
    );
}

#[test]
fn a_patched_change_within_a_memory_budget_gives_the_tables_of_the_whole_compile() {
    // Budgets small enough that some namespaces do not fit: the patch then gives way.
    let applied = run(256, (0..16_384usize).prop_map(Limits::within));
    assert!(applied > 0, "the patch never applied");
}
