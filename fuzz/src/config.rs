//! Target `node_config`: `converged`'s config file parser (crates/node/src/config.rs,
//! TOML → checked `Config`).
//!
//! converge-node is a binary crate, so its config module is compiled into this crate as
//! is (`#[path]`): it needs only converge-types, converge-engine, serde, toml and
//! thiserror, all dependencies here. No product code changes.
//!
//! Properties: no panic on any text; parsing is deterministic (the same text gives the
//! same answer twice).

#[allow(dead_code)]
#[path = "../../crates/node/src/config.rs"]
mod node_config;

use std::path::Path;

pub fn node_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let path = Path::new("/etc/converge/fuzz.toml");
    let a = node_config::Config::parse(path, text);
    let b = node_config::Config::parse(path, text);
    assert_eq!(
        format!("{a:?}"),
        format!("{b:?}"),
        "parsing is deterministic"
    );
}
