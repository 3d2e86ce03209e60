//! converge's node: drives, peer RPC, volume owners, NBD and vhost-user exports, the HTTP
//! API and the background jobs (repair, scrub, rotation, etcd upkeep). `converged` runs it
//! ([`daemon::main`]); as a library it is there for tests and tools that link a node's
//! parts in process (docs/ARCHITECTURE.md).

pub mod api;
pub mod auth;
pub mod cache_api;
pub mod capacity;
pub mod clones;
pub mod config;
pub mod creds;
pub mod daemon;
pub mod drain;
pub mod encryption;
pub mod etcd_upkeep;
pub mod export;
pub mod fleet;
pub mod http_client;
pub mod join;
pub mod lab_api;
pub mod members;
pub mod metrics;
pub mod node;
pub mod orphans;
pub mod provisioning;
pub mod qos;
pub mod repair;
pub mod rotate;
pub mod scrub;
pub mod secret_files;
pub mod snapshots;
pub mod tiering;
pub mod usage;
pub mod vhost;
pub mod wear;
