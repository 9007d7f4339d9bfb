//! README's table of environment variables names exactly the variables `config` reads
//! (`mscclpp::config::VARIABLES`): a variable added to the code without a line in README, or
//! a README line for a variable nothing reads, fails here.

use std::collections::BTreeSet;

/// The names in the first column of the table under "## Environment variables".
fn readme_variables() -> BTreeSet<String> {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let section = readme
        .split("\n## Environment variables")
        .nth(1)
        .expect("README has a section \"## Environment variables\"");
    let section = section.split("\n## ").next().unwrap();
    let mut names = BTreeSet::new();
    for line in section.lines().filter(|l| l.starts_with("| `")) {
        let first = line.split('|').nth(1).unwrap();
        for quoted in first.split('`').skip(1).step_by(2) {
            // `MSCCLPP_P2P_ENGINE=ce` names MSCCLPP_P2P_ENGINE.
            let name = quoted.split('=').next().unwrap();
            if !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
            {
                names.insert(name.to_string());
            }
        }
    }
    names
}

#[test]
fn readme_table_matches_the_config_module() {
    let readme = readme_variables();
    let code: BTreeSet<String> = mscclpp::config::VARIABLES
        .iter()
        .map(|s| s.to_string())
        .collect();
    let missing: Vec<_> = code.difference(&readme).collect();
    let stale: Vec<_> = readme.difference(&code).collect();
    assert!(
        missing.is_empty() && stale.is_empty(),
        "README's environment table and src/config.rs disagree: read but not documented {missing:?}; documented but not read {stale:?}"
    );
}
