//! `converged`'s one config file (TOML), parsed and checked before anything starts, so a
//! mistake is reported with the field that is wrong instead of a failure half-way up.

use converge_types::{parse_size, DriveRole, Knobs, MediaType, NodeId, DEFAULT_SLAB_SIZE_BYTES};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config {path} is not valid: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("config {path}: {field}: {message}")]
    Field {
        path: PathBuf,
        field: String,
        message: String,
    },
}

/// Most runtime threads a node may ask for.
pub const THREADS_MAX: usize = 1024;
/// etcd's own default space quota, assumed when `[etcd] quota` is not given.
pub const ETCD_QUOTA_DEFAULT_BYTES: u64 = 2 << 30;

/// A size given as bytes (integer) or text ("2G").
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum SizeField {
    Bytes(u64),
    Text(String),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    node: RawNode,
    network: RawNetwork,
    etcd: RawEtcd,
    #[serde(default, rename = "drive")]
    drives: Vec<RawDrive>,
    #[serde(default)]
    knobs: Knobs,
    #[serde(default)]
    api: RawApi,
    #[serde(default)]
    tls: RawTls,
    #[serde(default)]
    encryption: RawEncryption,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEncryption {
    /// The cluster key file (docs/adr/0011): wraps encrypted volumes' data keys.
    key_file: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTls {
    /// This node's PKI directory: ca.crt, node.crt, node.key (and ca.key where it signs).
    dir: Option<PathBuf>,
    /// On an etcd member's host: the file etcd's `--client-crl-file` names, which this node
    /// keeps listing the cluster's revoked certificates.
    etcd_crl_file: Option<PathBuf>,
    /// With `etcd_crl_file`: the local etcd member's client port, whose connections this
    /// node resets when the list gains a certificate (etcd checks it at connect only).
    etcd_client_port: Option<u16>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawApi {
    /// Where the node that bootstraps the cluster's tokens writes the first admin token.
    admin_token_file: Option<PathBuf>,
    /// Serve `/v1/lab` (the lab's fault views: drive paths, block offsets).
    #[serde(default)]
    lab: bool,
    /// Serve `/v1/fleet` (fio workers that overwrite volumes).
    #[serde(default)]
    fleet: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNode {
    id: u32,
    name: Option<String>,
    #[serde(default = "default_cluster_name")]
    cluster_name: String,
    slab_size: Option<SizeField>,
    threads: Option<usize>,
}

fn default_cluster_name() -> String {
    "converge".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNetwork {
    rpc: String,
    api: String,
    nbd_socket: PathBuf,
    /// Where vhost-user-blk sockets go, one per attached volume (default: `vhost` beside
    /// `nbd_socket`).
    vhost_dir: Option<PathBuf>,
    nbd_tcp: Option<String>,
    /// Serve NBD on `nbd_tcp` without TLS: anyone who reaches the port reads and writes
    /// every volume. Only on a network where every host is trusted.
    #[serde(default)]
    nbd_tcp_insecure: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEtcd {
    endpoints: Vec<String>,
    /// CA that signed etcd's server certificates (https endpoints; default: the cluster's
    /// CA, `ca.crt` of the [tls] dir).
    ca_file: Option<PathBuf>,
    /// Client certificate and key presented to etcd (its `--client-cert-auth`).
    cert_file: Option<PathBuf>,
    key_file: Option<PathBuf>,
    /// etcd user (its `auth enable`), with the password in `password_file`.
    username: Option<String>,
    password_file: Option<PathBuf>,
    /// etcd's space quota (its `--quota-backend-bytes`; etcd's default is 2 GiB).
    quota: Option<SizeField>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDrive {
    path: PathBuf,
    size: Option<SizeField>,
    #[serde(default)]
    role: DriveRole,
    #[serde(default)]
    media: MediaType,
    tbw: Option<SizeField>,
    warranty_years: Option<f64>,
}

/// The [etcd] section's security settings, as files (read when the node starts).
#[derive(Debug, Clone, Default)]
pub struct EtcdTlsConfig {
    /// `Some` when the endpoints are https.
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    pub username: Option<String>,
    pub password_file: Option<PathBuf>,
}

#[derive(Debug, Clone)]
pub struct DriveConfig {
    pub path: PathBuf,
    /// Create the file at this size if it does not exist.
    pub size_bytes: Option<u64>,
    pub role: DriveRole,
    pub media: MediaType,
    pub tbw_bytes: Option<u64>,
    pub warranty_years: Option<f64>,
}

#[derive(Debug, Clone)]
pub struct Config {
    pub node_id: NodeId,
    pub name: String,
    pub cluster_name: String,
    pub slab_size_bytes: u64,
    pub rpc_addr: SocketAddr,
    pub api_addr: SocketAddr,
    pub nbd_socket: PathBuf,
    /// vhost-user-blk sockets: `<vhost_dir>/<volume>.sock`, and the list of attached
    /// volumes (`attached`), so they are served again after a restart.
    pub vhost_dir: PathBuf,
    pub nbd_tcp: Option<SocketAddr>,
    /// NBD on TCP without TLS (the operator said so).
    pub nbd_tcp_insecure: bool,
    pub etcd_endpoints: Vec<String>,
    /// How to reach etcd securely: TLS files and a user ([etcd] section).
    pub etcd_tls: EtcdTlsConfig,
    /// etcd's space quota as its members were started with (`[etcd] quota`): `status` warns
    /// near it, and the leader disarms a NOSPACE alarm only once there is room below it.
    pub etcd_quota_bytes: u64,
    pub drives: Vec<DriveConfig>,
    pub knobs: Knobs,
    /// Threads of the runtime that serves I/O (client requests, peers, RAM drives inline);
    /// `None`: one per CPU core the process may use.
    pub threads: Option<usize>,
    /// Where the first admin token goes if this node bootstraps the cluster's tokens
    /// (default: `admin.token` beside the config file).
    pub admin_token_file: PathBuf,
    /// Serve the lab's fault views under `/v1/lab`.
    pub lab_api: bool,
    /// Serve the fleet's workers under `/v1/fleet`.
    pub fleet_api: bool,
    /// This node's PKI directory (default: `pki` beside the config file).
    pub tls_dir: PathBuf,
    /// Where to keep etcd's certificate revocation list (`[tls] etcd_crl_file`), if this
    /// host runs an etcd member.
    pub etcd_crl_file: Option<PathBuf>,
    /// The local etcd member's client port (`[tls] etcd_client_port`): when the list in
    /// `etcd_crl_file` gains a certificate, this node resets every connection to that
    /// port, so that each reconnects and meets the list (etcd checks it at connect only).
    pub etcd_client_port: Option<u16>,
    /// The cluster key file that wraps encrypted volumes' keys ([encryption] key_file);
    /// `None`: this node cannot create or serve encrypted volumes.
    pub key_file: Option<PathBuf>,
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::parse(path, &text)
    }

    pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let field = |field: &str, message: String| ConfigError::Field {
            path: path.to_path_buf(),
            field: field.to_string(),
            message,
        };
        match (raw.tls.etcd_client_port, &raw.tls.etcd_crl_file) {
            (Some(0), _) => {
                return Err(field(
                    "tls.etcd_client_port",
                    "must be the local etcd member's client port (1 to 65535)".into(),
                ))
            }
            (Some(_), None) => {
                return Err(field(
                    "tls.etcd_client_port",
                    "goes with tls.etcd_crl_file: only a node that keeps etcd's revocation \
                     list resets the member's connections"
                        .into(),
                ))
            }
            _ => {}
        }
        let size = |name: &str, s: &SizeField| -> Result<u64, ConfigError> {
            match s {
                SizeField::Bytes(b) => Ok(*b),
                SizeField::Text(t) => parse_size(t).map_err(|e| field(name, e.0)),
            }
        };
        if raw.node.id == 0 {
            return Err(field("node.id", "must be 1 or more".into()));
        }
        let etcd_quota_bytes = match &raw.etcd.quota {
            Some(q) => size("etcd.quota", q)?,
            None => ETCD_QUOTA_DEFAULT_BYTES,
        };
        if etcd_quota_bytes < (1 << 20) {
            return Err(field(
                "etcd.quota",
                format!("{etcd_quota_bytes} bytes: give etcd's --quota-backend-bytes (at least 1 MiB; etcd's default is 2G)"),
            ));
        }
        if let Some(name) = &raw.node.name {
            if !converge_types::valid_node_name(name) {
                return Err(field(
                    "node.name",
                    format!(
                        "{name:?} is not a node name: 1 to {} letters, digits, '.', '_' or \
                         '-', starting with a letter or digit (it names the host in tables, \
                         logs and `cluster rolling-restart --exec`)",
                        converge_types::NODE_NAME_BYTES_MAX
                    ),
                ));
            }
        }
        let slab_size_bytes = match &raw.node.slab_size {
            Some(s) => size("node.slab_size", s)?,
            None => DEFAULT_SLAB_SIZE_BYTES,
        };
        if let Some(t) = raw.node.threads {
            if !(1..=THREADS_MAX).contains(&t) {
                return Err(field(
                    "node.threads",
                    format!("{t}: must be between 1 and {THREADS_MAX} (leave it out for one per CPU core)"),
                ));
            }
        }
        if slab_size_bytes < (1 << 20) || !slab_size_bytes.is_power_of_two() {
            return Err(field(
                "node.slab_size",
                format!("{slab_size_bytes} bytes: must be a power of two, at least 1 MiB"),
            ));
        }
        let addr = |name: &str, s: &str| -> Result<SocketAddr, ConfigError> {
            s.parse()
                .map_err(|_| field(name, format!("{s:?} is not an address like 127.0.0.1:7100")))
        };
        if raw.etcd.endpoints.is_empty() {
            return Err(field(
                "etcd.endpoints",
                "needs at least one endpoint, e.g. [\"http://127.0.0.1:2379\"]".into(),
            ));
        }
        let https = raw
            .etcd
            .endpoints
            .iter()
            .filter(|e| e.starts_with("https://"))
            .count();
        for e in &raw.etcd.endpoints {
            if !e.starts_with("http://") && !e.starts_with("https://") {
                return Err(field(
                    "etcd.endpoints",
                    format!("{e:?} must start with https:// (or http:// on a trusted network)"),
                ));
            }
        }
        if https != 0 && https != raw.etcd.endpoints.len() {
            return Err(field(
                "etcd.endpoints",
                "mixes http:// and https://: use https:// for every endpoint".into(),
            ));
        }
        if raw.etcd.cert_file.is_some() != raw.etcd.key_file.is_some() {
            return Err(field(
                "etcd.cert_file",
                "cert_file and key_file go together (the client certificate and its key)".into(),
            ));
        }
        if https == 0 && (raw.etcd.ca_file.is_some() || raw.etcd.cert_file.is_some()) {
            return Err(field(
                "etcd.ca_file",
                "TLS files are given but the endpoints are http://: use https:// endpoints".into(),
            ));
        }
        if raw.etcd.username.is_some() != raw.etcd.password_file.is_some() {
            return Err(field(
                "etcd.username",
                "username and password_file go together".into(),
            ));
        }
        if raw.drives.is_empty() {
            return Err(field(
                "drive",
                "no [[drive]] given: a node must contribute at least one drive".into(),
            ));
        }
        let mut drives = Vec::new();
        for (i, d) in raw.drives.iter().enumerate() {
            let name = format!("drive[{i}]");
            let size_bytes = d
                .size
                .as_ref()
                .map(|s| size(&format!("{name}.size"), s))
                .transpose()?;
            if let Some(s) = size_bytes {
                if d.role == DriveRole::Cache {
                    if s < converge_engine::CACHE_MIN_BYTES {
                        return Err(field(
                            &format!("{name}.size"),
                            format!(
                                "{s} bytes is too small for a cache drive (at least {} MiB)",
                                converge_engine::CACHE_MIN_BYTES >> 20
                            ),
                        ));
                    }
                } else if s < 2 * slab_size_bytes {
                    return Err(field(
                        &format!("{name}.size"),
                        format!("{s} bytes is smaller than two slabs"),
                    ));
                }
            }
            if drives.iter().any(|x: &DriveConfig| x.path == d.path) {
                return Err(field(
                    &format!("{name}.path"),
                    format!("{} is listed twice", d.path.display()),
                ));
            }
            drives.push(DriveConfig {
                path: d.path.clone(),
                size_bytes,
                role: d.role,
                media: d.media,
                tbw_bytes: d
                    .tbw
                    .as_ref()
                    .map(|s| size(&format!("{name}.tbw"), s))
                    .transpose()?,
                warranty_years: d.warranty_years,
            });
        }
        if !drives.iter().any(|d| d.role == DriveRole::Capacity) {
            return Err(field(
                "drive",
                "every [[drive]] has role = \"cache\": a node needs at least one capacity drive"
                    .into(),
            ));
        }
        if raw.network.nbd_socket.as_os_str().len() > 100 {
            return Err(field(
                "network.nbd_socket",
                "path is too long for a unix socket (100 bytes max)".into(),
            ));
        }
        raw.knobs.check().map_err(|e| field("knobs", e))?;
        let tls_dir = raw
            .tls
            .dir
            .unwrap_or_else(|| path.parent().unwrap_or(Path::new(".")).join("pki"));
        let etcd_tls = EtcdTlsConfig {
            ca_file: if https > 0 {
                Some(
                    raw.etcd
                        .ca_file
                        .clone()
                        .unwrap_or_else(|| tls_dir.join(converge_pki::CA_CERT)),
                )
            } else {
                None
            },
            cert_file: raw.etcd.cert_file.clone(),
            key_file: raw.etcd.key_file.clone(),
            username: raw.etcd.username.clone(),
            password_file: raw.etcd.password_file.clone(),
        };
        Ok(Config {
            node_id: NodeId(raw.node.id),
            name: raw
                .node
                .name
                .unwrap_or_else(|| format!("node{}", raw.node.id)),
            cluster_name: raw.node.cluster_name,
            slab_size_bytes,
            rpc_addr: addr("network.rpc", &raw.network.rpc)?,
            api_addr: addr("network.api", &raw.network.api)?,
            vhost_dir: raw.network.vhost_dir.clone().unwrap_or_else(|| {
                raw.network
                    .nbd_socket
                    .parent()
                    .unwrap_or(Path::new("."))
                    .join("vhost")
            }),
            nbd_socket: raw.network.nbd_socket,
            nbd_tcp: raw
                .network
                .nbd_tcp
                .as_deref()
                .map(|s| addr("network.nbd_tcp", s))
                .transpose()?,
            nbd_tcp_insecure: raw.network.nbd_tcp_insecure,
            etcd_endpoints: raw.etcd.endpoints,
            etcd_tls,
            etcd_quota_bytes,
            drives,
            knobs: raw.knobs,
            threads: raw.node.threads,
            admin_token_file: raw
                .api
                .admin_token_file
                .unwrap_or_else(|| path.parent().unwrap_or(Path::new(".")).join("admin.token")),
            lab_api: raw.api.lab,
            fleet_api: raw.api.fleet,
            tls_dir,
            etcd_crl_file: raw.tls.etcd_crl_file,
            etcd_client_port: raw.tls.etcd_client_port,
            key_file: raw.encryption.key_file,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[node]
id = 1
slab_size = "64M"
[network]
rpc = "127.0.0.2:7100"
api = "127.0.0.2:7200"
nbd_socket = "/tmp/n1.sock"
[etcd]
endpoints = ["http://127.0.0.1:2379"]
[[drive]]
path = "/tmp/d1.img"
size = "1G"
"#;

    /// The example shipped for real hosts is a config converged accepts.
    #[test]
    fn the_packaged_example_config_parses() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging/converged.toml.example");
        let text = std::fs::read_to_string(&path).unwrap();
        let c = Config::parse(&path, &text).unwrap();
        assert_eq!(c.node_id, NodeId(2));
        assert_eq!(c.etcd_endpoints.len(), 3);
        assert_eq!(c.etcd_quota_bytes, 8 << 30, "the package's etcd quota");
        assert_eq!(c.tls_dir, Path::new("/etc/converge/pki"));
        assert_eq!(
            c.etcd_tls.ca_file.as_deref(),
            Some(Path::new("/etc/converge/pki/ca.crt"))
        );
    }

    #[test]
    fn the_cluster_key_file_is_optional() {
        let c = Config::parse(Path::new("x.toml"), GOOD).unwrap();
        assert_eq!(c.key_file, None);
        let text = format!("{GOOD}\n[encryption]\nkey_file = \"/etc/converge/cluster.keys\"\n");
        let c = Config::parse(Path::new("x.toml"), &text).unwrap();
        assert_eq!(
            c.key_file.as_deref(),
            Some(Path::new("/etc/converge/cluster.keys"))
        );
        let bad = format!("{GOOD}\n[encryption]\nkey = \"x\"\n");
        let e = Config::parse(Path::new("x.toml"), &bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field"), "{e}");
    }

    #[test]
    fn an_etcd_client_port_goes_with_the_revocation_list_it_enforces() {
        let with =
            |tls: &str| Config::parse(Path::new("x.toml"), &format!("{GOOD}\n[tls]\n{tls}\n"));
        let c = with("etcd_crl_file = \"/e/revoked.crl\"\netcd_client_port = 2379").unwrap();
        assert_eq!(c.etcd_client_port, Some(2379));
        assert_eq!(with("").unwrap().etcd_client_port, None);
        let e = with("etcd_client_port = 2379").unwrap_err().to_string();
        assert!(
            e.contains("tls.etcd_client_port") && e.contains("etcd_crl_file"),
            "{e}"
        );
        let e = with("etcd_crl_file = \"/e/revoked.crl\"\netcd_client_port = 0")
            .unwrap_err()
            .to_string();
        assert!(e.contains("tls.etcd_client_port"), "{e}");
    }

    #[test]
    fn parses_a_good_config() {
        let c = Config::parse(Path::new("x.toml"), GOOD).unwrap();
        assert_eq!(c.node_id, NodeId(1));
        assert_eq!(c.name, "node1");
        assert_eq!(c.slab_size_bytes, 64 << 20);
        assert_eq!(c.drives[0].size_bytes, Some(1 << 30));
        assert_eq!(c.drives[0].role, DriveRole::Capacity);
    }

    #[test]
    fn errors_name_the_field() {
        let bad = GOOD.replace("127.0.0.2:7100", "nowhere");
        let e = Config::parse(Path::new("x.toml"), &bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("network.rpc"), "{e}");
        let bad = GOOD.replace("slab_size = \"64M\"", "slab_size = \"3M\"");
        let e = Config::parse(Path::new("x.toml"), &bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("node.slab_size"), "{e}");
        let bad = GOOD.replace("id = 1", "id = 1\nbogus = 2");
        let e = Config::parse(Path::new("x.toml"), &bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("bogus"), "{e}");
        let bad = GOOD.replace("size = \"1G\"", "size = \"1Q\"");
        assert!(Config::parse(Path::new("x.toml"), &bad).is_err());
        let bad = GOOD.replace("http://127.0.0.1:2379", "127.0.0.1:2379");
        assert!(Config::parse(Path::new("x.toml"), &bad).is_err());
        let bad = GOOD.replace("id = 1", "id = 1\nthreads = 0");
        let e = Config::parse(Path::new("x.toml"), &bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("node.threads"), "{e}");
        // A name reaches shell commands (rolling-restart --exec): plain words only.
        let bad = GOOD.replace("id = 1", "id = 1\nname = \"n1;reboot\"");
        let e = Config::parse(Path::new("x.toml"), &bad)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("node.name") && e.contains("not a node name"),
            "{e}"
        );
        let good = GOOD.replace("id = 1", "id = 1\nname = \"rack1-n1\"");
        assert_eq!(
            Config::parse(Path::new("x.toml"), &good).unwrap().name,
            "rack1-n1"
        );
    }

    #[test]
    fn threads_default_to_one_per_core() {
        assert_eq!(
            Config::parse(Path::new("x.toml"), GOOD).unwrap().threads,
            None
        );
        let two = GOOD.replace("id = 1", "id = 1\nthreads = 2");
        assert_eq!(
            Config::parse(Path::new("x.toml"), &two).unwrap().threads,
            Some(2)
        );
    }
}
