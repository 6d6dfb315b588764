//! TLS and mutual TLS, with a CA, server and client certificates generated at test time.

use fence_proto::v1 as pb;
use fence_proto::v1::fence_client::FenceClient;
use fence_tests::*;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair, KeyUsagePurpose};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity, ServerTlsConfig};

struct Pki {
    ca: String,
    server: (String, String),
    client: (String, String),
    stranger: (String, String),
}

fn issue(ca: &CertifiedIssuer<'_, KeyPair>, name: &str) -> (String, String) {
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec![name.to_owned()])
        .unwrap()
        .signed_by(&key, ca)
        .unwrap();
    (cert.pem(), key.serialize_pem())
}

fn new_ca() -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

fn pki() -> Pki {
    let ca = new_ca();
    let other_ca = new_ca();
    Pki {
        ca: ca.pem(),
        server: issue(&ca, "localhost"),
        client: issue(&ca, "agent-1"),
        stranger: issue(&other_ca, "agent-2"),
    }
}

async fn server(pki: &Pki, mutual: bool) -> TestServer {
    let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(&pki.server.0, &pki.server.1));
    if mutual {
        tls = tls.client_ca_root(Certificate::from_pem(&pki.ca));
    }
    TestServer::start_with(Options {
        tls: Some(tls),
        ..Options::default()
    })
    .await
}

async fn connect(
    srv: &TestServer,
    pki: &Pki,
    identity: Option<&(String, String)>,
) -> Result<FenceClient<Channel>, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&pki.ca))
        .domain_name("localhost");
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    let url = srv.url.replace("http://", "https://");
    let channel = Channel::from_shared(url)
        .unwrap()
        .tls_config(tls)?
        .connect()
        .await?;
    Ok(FenceClient::new(channel))
}

async fn works(c: &mut FenceClient<Channel>) -> bool {
    c.start_run(pb::StartRunRequest { run_id: "r".into() })
        .await
        .is_ok()
}

#[tokio::test]
async fn tls_serves_trusting_clients_and_refuses_plaintext() {
    let pki = pki();
    let srv = server(&pki, false).await;
    let mut c = connect(&srv, &pki, None).await.unwrap();
    assert!(works(&mut c).await);
    // A plaintext client gets nowhere.
    let plain = FenceClient::connect(srv.url.clone()).await;
    let ok = match plain {
        Ok(mut p) => works(&mut p).await,
        Err(_) => false,
    };
    assert!(!ok, "plaintext must not be served on a TLS port");
}

#[tokio::test]
async fn mutual_tls_requires_a_client_certificate_from_the_trusted_ca() {
    let pki = pki();
    let srv = server(&pki, true).await;
    let mut c = connect(&srv, &pki, Some(&pki.client)).await.unwrap();
    assert!(works(&mut c).await);
    for identity in [None, Some(&pki.stranger)] {
        let ok = match connect(&srv, &pki, identity).await {
            Ok(mut c) => works(&mut c).await,
            Err(_) => false,
        };
        assert!(!ok, "a client without a trusted certificate was served");
    }
}
