//! The connection options against a server that requires them: TLS and mutual TLS, bearer
//! tokens, and a per-tenant rate limit the client rides out.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use common::{Downstream, TestServer, builder, unique};
use fence_client::{
    Certificate, ClientTlsConfig, Error, Identity, OperationClass, OutcomeSource, RunHandle,
    ToolDef,
};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair, KeyUsagePurpose};

fn new_ca() -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

/// A certificate for `name` signed by `ca`: (cert PEM, key PEM).
fn issue(ca: &CertifiedIssuer<'_, KeyPair>, name: &str) -> (String, String) {
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec![name.to_owned()])
        .unwrap()
        .signed_by(&key, ca)
        .unwrap();
    (cert.pem(), key.serialize_pem())
}

fn tls(ca_pem: &str, identity: Option<&(String, String)>) -> ClientTlsConfig {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .domain_name("localhost");
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    tls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_admits_a_client_with_a_certificate_and_nobody_else() {
    let ca = new_ca();
    let ca_pem = ca.pem();
    let server_cert = issue(&ca, "localhost");
    let agent = issue(&ca, "agent-1");
    let stranger = issue(&new_ca(), "agent-2");
    let server = TestServer::start_with(|config, dir| {
        for (name, pem) in [
            ("server.crt", &server_cert.0),
            ("server.key", &server_cert.1),
            ("ca.crt", &ca_pem),
        ] {
            std::fs::write(dir.join(name), pem).unwrap();
        }
        config.tls_cert = Some(dir.join("server.crt"));
        config.tls_key = Some(dir.join("server.key"));
        config.tls_client_ca = Some(dir.join("ca.crt"));
    })
    .await;
    let url = server.url().replace("http://", "https://");

    let client = builder(&url)
        .tls(tls(&ca_pem, Some(&agent)))
        .connect()
        .await
        .unwrap();
    client
        .register_tool(ToolDef::new("pay", OperationClass::NonRetryable))
        .await
        .unwrap();
    let run = RunHandle::start(client, &unique("run")).await.unwrap();
    let bank = Downstream::default();
    let call = run
        .call("pay", r#"{"amount":1}"#)
        .step_key(run.step_key("pay"));
    let outcome = run
        .run_effect(&call, |ctx| {
            std::future::ready(Ok(bank.commit("pay", &ctx.downstream_key)))
        })
        .await
        .unwrap();
    assert_eq!(outcome.source, OutcomeSource::Executed);

    // No client certificate, a certificate from another CA, or no TLS at all: no service.
    for stranger_identity in [None, Some(&stranger)] {
        let refused = match builder(&url)
            .tls(tls(&ca_pem, stranger_identity))
            .connect()
            .await
        {
            Ok(client) => client.get_run(run.run_id()).await.is_err(),
            Err(_) => true,
        };
        assert!(refused, "a client without a trusted certificate was served");
    }
    let refused = match builder(&server.url()).connect().await {
        Ok(client) => client.get_run(run.run_id()).await.is_err(),
        Err(_) => true,
    };
    assert!(refused, "a plaintext client was served");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bearer_token_authenticates_and_selects_the_tenant() {
    let server = TestServer::start_with(|config, dir| {
        let tokens = format!(
            "acme {}\nglobex {}\n",
            blake3::hash(b"acme-secret").to_hex(),
            blake3::hash(b"globex-secret").to_hex()
        );
        std::fs::write(dir.join("tokens"), tokens).unwrap();
        config.auth_tokens_file = Some(dir.join("tokens"));
    })
    .await;
    let acme = builder(&server.url())
        .bearer_token("acme-secret")
        .connect()
        .await
        .unwrap();
    let run_id = unique("run");
    acme.start_run(&run_id).await.unwrap();

    // In authenticated mode the token decides the tenant: naming another one is refused.
    let impostor = builder(&server.url())
        .bearer_token("globex-secret")
        .tenant("acme")
        .connect()
        .await
        .unwrap();
    let err = impostor.get_run(&run_id).await.unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::PermissionDenied), "{err:?}");
    let globex = builder(&server.url())
        .bearer_token("globex-secret")
        .connect()
        .await
        .unwrap();
    let err = globex.get_run(&run_id).await.unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::NotFound), "{err:?}");
    // Whole-server actions take an admin token; neither of these is one.
    let err = acme.compact_store().await.unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::PermissionDenied), "{err:?}");

    for client in [
        builder(&server.url()).connect().await.unwrap(),
        builder(&server.url())
            .bearer_token("wrong")
            .connect()
            .await
            .unwrap(),
    ] {
        let err = client.get_run(&run_id).await.unwrap_err();
        assert!(
            matches!(
                err,
                Error::Rpc {
                    code: tonic::Code::Unauthenticated,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(!err.is_transient());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_client_waits_and_retries_without_running_anything_twice() {
    let server = TestServer::start_with(|config, _| {
        config.tenant_rate_limit = 20;
        config.tenant_burst = 2;
    })
    .await;
    let client = server.client().await;
    client
        .register_tool(ToolDef::new("pay", OperationClass::NonRetryable))
        .await
        .unwrap();
    let run = RunHandle::start(client.clone(), &unique("run"))
        .await
        .unwrap();
    let bank = Downstream::default();
    let runs = Arc::new(AtomicU32::new(0));
    // Without step keys: a rate-limited Begin applied nothing, so even these are re-sent.
    for i in 0..8 {
        let call = run.call("pay", &format!(r#"{{"invoice":{i}}}"#));
        let (bank, runs) = (bank.clone(), runs.clone());
        let outcome = run
            .run_effect(&call, move |ctx| {
                runs.fetch_add(1, Ordering::SeqCst);
                std::future::ready(Ok(bank.commit("pay", &ctx.downstream_key)))
            })
            .await
            .unwrap();
        assert_eq!(outcome.source, OutcomeSource::Executed);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 8);
    assert_eq!(bank.count("pay"), 8);
    // The limit did bite: a direct burst gets refused with a delay.
    let mut limited = None;
    for _ in 0..10 {
        if let Err(err) = client.get_run(run.run_id()).await {
            limited = Some(err);
            break;
        }
    }
    let err = limited.expect("the rate limit never refused a call");
    assert_eq!(err.reason(), Some(fence_client::ReasonCode::LimitExceeded));
    assert!(err.retry_after().is_some() && err.is_transient());
}
