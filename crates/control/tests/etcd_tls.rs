//! The etcd client against a real etcd serving https with client-certificate auth, and
//! against etcd's username/password authentication: what works, and how each misconfiguration
//! is reported.
#![allow(clippy::unwrap_used)] // tests: a failed step is the failure we want to see

use converge_control::etcd::{
    Compare, Etcd, EtcdError, EtcdSecurity, EventKind, Op, SecurityError, TlsFailure, Txn,
};
use converge_control::testing::{unused_endpoint, EtcdServer, TestTls};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use std::time::Duration;

/// A throwaway certificate authority.
struct Ca {
    pem: String,
    issuer: Issuer<'static, KeyPair>,
}

/// A certificate and its key, as PEM.
struct Identity {
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().unwrap();
        let pem = params.self_signed(&key).unwrap().pem();
        Ca {
            pem,
            issuer: Issuer::new(params, key),
        }
    }

    fn issue(&self, mut params: CertificateParams, usages: &[ExtendedKeyUsagePurpose]) -> Identity {
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = usages.to_vec();
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Identity {
            cert_pem: cert.pem().into_bytes(),
            key_pem: key.serialize_pem().into_bytes(),
        }
    }

    /// etcd's certificate: for 127.0.0.1, usable as a client too (etcd's gateway dials its
    /// own gRPC with it).
    fn server(&self) -> Identity {
        let mut params = CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, "converge-test-etcd");
        self.issue(
            params,
            &[
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        )
    }

    /// A client certificate, with this CommonName or none (etcd's gateway refuses one that
    /// has a CN while auth is enabled).
    fn client(&self, common_name: Option<&str>) -> Identity {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::OrganizationName, "converge tests");
        if let Some(cn) = common_name {
            params.distinguished_name.push(DnType::CommonName, cn);
        }
        self.issue(params, &[ExtendedKeyUsagePurpose::ClientAuth])
    }

    fn security(&self, client: Option<&Identity>) -> EtcdSecurity {
        EtcdSecurity {
            ca_pem: Some(self.pem.clone().into_bytes()),
            client_cert_pem: client.map(|c| c.cert_pem.clone()),
            client_key_pem: client.map(|c| c.key_pem.clone()),
            ..Default::default()
        }
    }
}

/// An etcd serving https with a certificate from `ca`, requiring client certificates from
/// `ca` (the helper's own has no CN, so auth can be enabled).
fn tls_etcd(ca: &Ca) -> EtcdServer {
    let server = ca.server();
    let helper = ca.client(None);
    EtcdServer::start_tls(TestTls {
        server_cert_pem: server.cert_pem,
        server_key_pem: server.key_pem,
        trusted_ca_pem: ca.pem.clone().into_bytes(),
        client_cert_auth: true,
        client: ca.security(Some(&helper)),
    })
}

async fn next_events(w: &mut converge_control::Watch, n: usize) -> Vec<(EventKind, String)> {
    let mut events = Vec::new();
    while events.len() < n {
        let batch = tokio::time::timeout(Duration::from_secs(30), w.next())
            .await
            .expect("watch events arrive")
            .unwrap();
        events.extend(batch.into_iter().map(|e| (e.kind, e.kv.key)));
    }
    events
}

#[tokio::test]
async fn kv_txn_lease_and_watch_work_over_tls_with_a_client_certificate() {
    let ca = Ca::new("converge test CA");
    let srv = tls_etcd(&ca);
    assert!(srv.endpoint.starts_with("https://127.0.0.1:"));
    let me = ca.client(Some("converge-node"));
    let etcd = Etcd::with_security(vec![srv.endpoint.clone()], ca.security(Some(&me))).unwrap();
    assert_eq!(etcd.endpoints(), [srv.endpoint.as_str()]);

    let mut w = etcd.watch_prefix("/tls/", 0).await.unwrap();
    let r1 = etcd.put("/tls/a", b"1", None).await.unwrap();
    assert_eq!(etcd.get("/tls/a").await.unwrap().unwrap().value, b"1");
    let r = etcd
        .txn(Txn {
            compare: vec![Compare::ModRevision("/tls/a".into(), r1)],
            success: vec![
                Op::Put("/tls/b".into(), b"2".to_vec(), None),
                Op::Get("/tls/a".into()),
            ],
            failure: vec![],
        })
        .await
        .unwrap();
    assert!(r.succeeded);
    assert_eq!(r.gets[0].as_ref().unwrap().value, b"1");
    let lease = etcd.lease_grant(60).await.unwrap();
    assert!(etcd.create("/tls/c", b"3", Some(lease)).await.unwrap());
    assert!(etcd.lease_keepalive(lease).await.unwrap() > 0);
    etcd.lease_revoke(lease).await.unwrap();
    assert!(etcd.get("/tls/c").await.unwrap().is_none());
    let (kvs, _) = etcd.get_prefix("/tls/").await.unwrap();
    assert_eq!(kvs.len(), 2);
    assert_eq!(etcd.delete_prefix("/tls/").await.unwrap(), 2);

    assert_eq!(
        next_events(&mut w, 6).await,
        [
            (EventKind::Put, "/tls/a".to_string()),
            (EventKind::Put, "/tls/b".to_string()),
            (EventKind::Put, "/tls/c".to_string()),
            (EventKind::Delete, "/tls/c".to_string()),
            (EventKind::Delete, "/tls/a".to_string()),
            (EventKind::Delete, "/tls/b".to_string()),
        ]
    );
    // A clone with another timeout shares the TLS settings.
    let short = etcd.with_timeout(Duration::from_secs(10));
    assert!(short.get("/tls/a").await.unwrap().is_none());
    // A dead https endpoint is skipped like a dead http one.
    let dead = unused_endpoint().replace("http://", "https://");
    let etcd =
        Etcd::with_security(vec![dead, srv.endpoint.clone()], ca.security(Some(&me))).unwrap();
    etcd.put("/tls/d", b"4", None).await.unwrap();
}

#[tokio::test]
async fn without_a_client_certificate_etcd_refuses_the_handshake() {
    let ca = Ca::new("converge test CA");
    let srv = tls_etcd(&ca);
    let etcd = Etcd::with_security(vec![srv.endpoint.clone()], ca.security(None)).unwrap();
    let e = etcd.put("/k", b"v", None).await.unwrap_err();
    assert!(
        matches!(
            &e,
            EtcdError::Tls {
                failure: TlsFailure::ClientCertificateRequired { .. },
                ..
            }
        ),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.starts_with(&format!(
            "etcd at {} refused the TLS handshake (",
            srv.endpoint
        )),
        "{msg}"
    );
    assert!(msg.contains("client-cert-auth"), "{msg}");
    assert!(msg.contains("needs a client certificate"), "{msg}");
    let e = etcd.watch_prefix("/", 0).await.unwrap_err();
    assert!(matches!(e, EtcdError::Tls { .. }), "{e:?}");
    // Nothing was written.
    assert!(srv.client().get("/k").await.unwrap().is_none());
}

#[tokio::test]
async fn a_client_certificate_from_another_ca_is_refused() {
    let ca = Ca::new("converge test CA");
    let srv = tls_etcd(&ca);
    let stranger = Ca::new("someone else's CA").client(None);
    let sec = EtcdSecurity {
        client_cert_pem: Some(stranger.cert_pem),
        client_key_pem: Some(stranger.key_pem),
        ..ca.security(None)
    };
    let etcd = Etcd::with_security(vec![srv.endpoint.clone()], sec).unwrap();
    let e = etcd.get("/k").await.unwrap_err();
    assert!(
        matches!(
            &e,
            EtcdError::Tls {
                failure: TlsFailure::ClientCertificateRejected { .. },
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        e.to_string().contains("refused our client certificate"),
        "{e}"
    );
    assert!(e.to_string().contains("--trusted-ca-file"), "{e}");
}

#[tokio::test]
async fn a_client_trusting_another_ca_refuses_etcd() {
    let ca = Ca::new("converge test CA");
    let srv = tls_etcd(&ca);
    let me = ca.client(None);
    let other = Ca::new("someone else's CA");
    let sec = EtcdSecurity {
        ca_pem: Some(other.pem.clone().into_bytes()),
        ..ca.security(Some(&me))
    };
    let etcd = Etcd::with_security(vec![srv.endpoint.clone()], sec).unwrap();
    let e = etcd.get("/k").await.unwrap_err();
    assert!(
        matches!(
            &e,
            EtcdError::Tls {
                failure: TlsFailure::UntrustedCertificate { .. },
                ..
            }
        ),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.starts_with(&format!(
            "etcd at {} presented a certificate not signed by the configured CA (",
            srv.endpoint
        )),
        "{msg}"
    );
    assert!(etcd.watch_prefix("/", 0).await.is_err());
}

#[tokio::test]
async fn a_host_missing_from_etcds_certificate_is_refused() {
    let ca = Ca::new("converge test CA");
    let srv = tls_etcd(&ca);
    let me = ca.client(None);
    // The certificate names 127.0.0.1 only.
    let by_name = srv.endpoint.replace("127.0.0.1", "localhost");
    let etcd = Etcd::with_security(vec![by_name.clone()], ca.security(Some(&me))).unwrap();
    let e = etcd.get("/k").await.unwrap_err();
    assert!(
        matches!(
            &e,
            EtcdError::Tls {
                failure: TlsFailure::WrongHost { .. },
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        e.to_string()
            .contains("presented a certificate that is not valid for localhost"),
        "{e}"
    );
}

#[tokio::test]
async fn plain_http_against_tls_and_tls_against_plain_http_fail_clearly() {
    let ca = Ca::new("converge test CA");
    let srv = tls_etcd(&ca);
    let as_http = srv.endpoint.replace("https://", "http://");
    let e = Etcd::new(vec![as_http.clone()])
        .unwrap()
        .get("/k")
        .await
        .unwrap_err();
    assert!(matches!(e, EtcdError::ClosedWithoutAnswer { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.starts_with(&format!("etcd at {as_http} closed the connection")),
        "{msg}"
    );
    assert!(msg.contains("use an https:// endpoint"), "{msg}");

    let plain = EtcdServer::start();
    let as_https = plain.endpoint.replace("http://", "https://");
    let me = ca.client(None);
    let e = Etcd::with_security(vec![as_https.clone()], ca.security(Some(&me)))
        .unwrap()
        .get("/k")
        .await
        .unwrap_err();
    assert!(
        matches!(
            &e,
            EtcdError::Tls {
                failure: TlsFailure::NotTls { .. },
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("did not answer in TLS"), "{e}");
}

#[tokio::test]
async fn tls_settings_load_from_files_and_name_the_bad_one() {
    let ca = Ca::new("converge test CA");
    let srv = tls_etcd(&ca);
    let me = ca.client(None);
    let dir = tempfile::tempdir().unwrap();
    let (ca_path, cert_path, key_path) = (
        dir.path().join("ca.pem"),
        dir.path().join("client.pem"),
        dir.path().join("client.key"),
    );
    std::fs::write(&ca_path, &ca.pem).unwrap();
    std::fs::write(&cert_path, &me.cert_pem).unwrap();
    std::fs::write(&key_path, &me.key_pem).unwrap();
    let sec = EtcdSecurity::from_pem_files(&ca_path, Some(&cert_path), Some(&key_path)).unwrap();
    let etcd = Etcd::with_security(vec![srv.endpoint.clone()], sec).unwrap();
    etcd.put("/files", b"ok", None).await.unwrap();

    // A key where the certificate should be: the error names the file and its role.
    let e = EtcdSecurity::from_pem_files(&ca_path, Some(&key_path), Some(&key_path)).unwrap_err();
    assert!(matches!(e, SecurityError::BadPem { .. }), "{e:?}");
    assert!(
        e.to_string().starts_with(&format!(
            "the etcd client certificate from {} is not usable: it holds no certificate",
            key_path.display()
        )),
        "{e}"
    );
}

#[tokio::test]
async fn password_auth_logs_in_and_logs_in_again_when_etcd_drops_the_token() {
    let srv = EtcdServer::start();
    srv.enable_auth("pw");
    let endpoints = vec![srv.endpoint.clone()];

    // No user: etcd's refusal is named.
    let e = Etcd::new(endpoints.clone())
        .unwrap()
        .put("/a", b"1", None)
        .await
        .unwrap_err();
    assert!(matches!(e, EtcdError::AuthRequired { .. }), "{e:?}");
    assert!(
        e.to_string().contains("give a username and password"),
        "{e}"
    );
    let e = Etcd::new(endpoints.clone())
        .unwrap()
        .watch_prefix("/", 0)
        .await
        .unwrap_err();
    assert!(matches!(e, EtcdError::AuthRequired { .. }), "{e:?}");
    // A wrong password.
    let wrong = Etcd::with_security(
        endpoints.clone(),
        EtcdSecurity::default().with_user("root", "nope"),
    )
    .unwrap();
    let e = wrong.get("/a").await.unwrap_err();
    assert!(matches!(e, EtcdError::AuthFailed { .. }), "{e:?}");
    assert!(
        e.to_string().contains("refused to log in user \"root\""),
        "{e}"
    );

    let etcd =
        Etcd::with_security(endpoints, EtcdSecurity::default().with_user("root", "pw")).unwrap();
    let rev = etcd.put("/a", b"1", None).await.unwrap();
    let mut w = etcd.watch_prefix("/a", 0).await.unwrap();

    // Setting the same password makes etcd drop every token of the user, ours included.
    let token = srv.authenticate("root", "pw");
    srv.change_password("root", "pw", &token);
    let (status, body) = srv
        .gateway_post("/v3/kv/range", r#"{"key":"L2E="}"#, Some(&token))
        .unwrap();
    assert_eq!(status, 401, "the old token must be dead: {body}");

    // The next request is refused for its token, logs in again and runs once: a compare on
    // the revision would fail on a second run.
    assert!(etcd.cas("/a", b"2", rev).await.unwrap());
    assert_eq!(etcd.get("/a").await.unwrap().unwrap().value, b"2");
    // The open watch keeps running (etcd checked its token when it was created).
    assert_eq!(
        next_events(&mut w, 1).await,
        [(EventKind::Put, "/a".to_string())]
    );

    // Opening a watch with a dropped token: logs in again too.
    let token = srv.authenticate("root", "pw");
    srv.change_password("root", "pw", &token);
    let mut w2 = etcd.watch_prefix("/b", 0).await.unwrap();
    etcd.put("/b", b"1", None).await.unwrap();
    assert_eq!(
        next_events(&mut w2, 1).await,
        [(EventKind::Put, "/b".to_string())]
    );

    // Concurrent requests that all hold the dropped token all succeed.
    let token = srv.authenticate("root", "pw");
    srv.change_password("root", "pw", &token);
    let mut tasks = Vec::new();
    for i in 0..8 {
        let etcd = etcd.clone();
        tasks.push(tokio::spawn(async move {
            etcd.put(&format!("/c/{i}"), b"x", None).await
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(etcd.get_prefix("/c/").await.unwrap().0.len(), 8);
}

#[tokio::test]
async fn a_user_configured_before_auth_is_enabled_logs_in_once_it_is() {
    let srv = EtcdServer::start();
    let etcd = Etcd::with_security(
        vec![srv.endpoint.clone()],
        EtcdSecurity::default().with_user("root", "pw"),
    )
    .unwrap();
    // Auth is off: requests go without a token.
    etcd.put("/k", b"1", None).await.unwrap();
    srv.enable_auth("pw");
    // Now etcd refuses a request without a user; the client logs in and sends it again.
    etcd.put("/k", b"2", None).await.unwrap();
    assert_eq!(etcd.get("/k").await.unwrap().unwrap().value, b"2");
    assert!(Etcd::new(vec![srv.endpoint.clone()])
        .unwrap()
        .get("/k")
        .await
        .is_err());
}

#[tokio::test]
async fn password_auth_over_tls_needs_a_client_certificate_without_a_common_name() {
    let ca = Ca::new("converge test CA");
    let srv = tls_etcd(&ca);
    srv.enable_auth("pw");
    let endpoints = vec![srv.endpoint.clone()];
    let no_cn = ca.client(None);
    let etcd = Etcd::with_security(
        endpoints.clone(),
        ca.security(Some(&no_cn)).with_user("root", "pw"),
    )
    .unwrap();
    etcd.put("/k", b"v", None).await.unwrap();
    let mut w = etcd.watch_prefix("/k", 0).await.unwrap();
    etcd.delete("/k").await.unwrap();
    assert_eq!(
        next_events(&mut w, 1).await,
        [(EventKind::Delete, "/k".to_string())]
    );

    // etcd's gateway refuses a certificate with a CN once auth is on (the CN would not be
    // the user); the error says what to change.
    let with_cn = ca.client(Some("root"));
    let etcd = Etcd::with_security(
        endpoints,
        ca.security(Some(&with_cn)).with_user("root", "pw"),
    )
    .unwrap();
    let e = etcd.get("/k").await.unwrap_err();
    assert!(
        matches!(e, EtcdError::ClientCertificateHasCommonName { .. }),
        "{e:?}"
    );
    assert!(e.to_string().contains("without a CN"), "{e}");
}
