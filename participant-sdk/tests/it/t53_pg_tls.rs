//! TLS to PostgreSQL (ADR 0035): the connection string's `sslmode` (with
//! `sslrootcert`, and `sslcert` / `sslkey` for a client certificate) as libpq
//! users write it, through rustls, always verified; against a real PostgreSQL
//! server started by dtx-pg-server with `ssl = on` and a certificate from a
//! throwaway authority.
//!
//! Without the PostgreSQL server binaries each test prints a loud message
//! and passes, unless DTX_REQUIRE_POSTGRES=1 (CI), where it fails.

#![cfg(feature = "postgres")]

use std::path::Path;
use std::path::PathBuf;

use dtx_pg_server::PgServer;
use dtx_pg_server::PgServerOptions;
use dtx_pg_server::PgServerTls;
use dtx_tls::dev::DevCa;
use dtx_tls::dev::Host;
use dtx_tls::dev::DEV_LIFETIME;
use dtx_tls::Role;
use participant_sdk::log::Message;
use participant_sdk::log::Vote;
use participant_sdk::participant::Answer;
use participant_sdk::participant::Participant;
use participant_sdk::participant::Verdict;
use participant_sdk::postgres::HandlerError;
use participant_sdk::postgres::PgHandler;
use participant_sdk::postgres::PgOptions;
use participant_sdk::postgres::PgParticipant;
use participant_sdk::postgres::Transaction;
use participant_sdk::store::Reply;
use participant_sdk::GlobalTxid;

const DB: &str = "bank";

/// `<n>` adds n to alice's balance.
struct Add;

impl PgHandler for Add {
    async fn prepare(&self, tx: &Transaction<'_>, _txid: GlobalTxid, payload: &[u8]) -> Result<Verdict, HandlerError> {
        let n: i64 = std::str::from_utf8(payload)?.parse()?;
        tx.execute("UPDATE accounts SET balance = balance + $1 WHERE id = 'alice'", &[&n])
            .await?;
        Ok(Verdict::yes())
    }
}

/// An authority, its certificate written to `dir/<name>/ca.pem`.
struct Authority {
    ca: DevCa,
    pem: PathBuf,
    dir: PathBuf,
}

fn authority(dir: &Path, name: &str) -> Authority {
    let dir = dir.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let ca = DevCa::new(name).unwrap();
    let pem = ca.write_ca(&dir).unwrap();
    Authority { ca, pem, dir }
}

const CERT_USER: &str = "certuser";

/// A server with TLS on (its certificate from `ca`, valid for `hosts`),
/// client certificates from `ca` checked for the role `certuser` (which
/// must use TLS and show one), and database `bank` with alice = 100.
fn tls_server(test: &str, ca: &Authority, hosts: &[&str]) -> Option<PgServer> {
    let hosts: Vec<Host> = hosts.iter().map(|h| Host::parse(h)).collect();
    let (cert_pem, key_pem) = ca
        .ca
        .issue(Role::Participant, "postgres", &hosts, DEV_LIFETIME)
        .unwrap();
    let opts = PgServerOptions {
        kill_with_parent_thread: true,
        tls: Some(PgServerTls {
            cert_pem,
            key_pem,
            client_ca_pem: Some(ca.ca.cert_pem().to_string()),
        }),
        extra_hba: vec![
            format!("hostssl all {CERT_USER} 127.0.0.1/32 trust clientcert=verify-ca"),
            format!("hostnossl all {CERT_USER} 127.0.0.1/32 reject"),
        ],
        ..PgServerOptions::default()
    };
    let s = dtx_pg_server::start_or_skip(test, opts)?;
    setup(&s);
    Some(s)
}

fn setup(s: &PgServer) {
    s.create_database(DB).unwrap();
    s.execute(
        DB,
        &format!(
            "CREATE TABLE accounts (id text PRIMARY KEY, balance bigint NOT NULL);
             INSERT INTO accounts VALUES ('alice', 100);
             CREATE ROLE {CERT_USER} LOGIN SUPERUSER"
        ),
    )
    .unwrap();
}

fn conn(s: &PgServer, host: &str, user: &str, tls: &str) -> String {
    format!("host={host} port={} user={user} dbname={DB} {tls}", s.port())
}

fn opts(conn_string: String) -> PgOptions {
    let mut o = PgOptions::new("acct", conn_string);
    o.concurrency = 2;
    o.connect_attempts = 2;
    o
}

/// Whether the backend serving `c` talks TLS.
async fn encrypted(c: &tokio_postgres::Client) -> bool {
    c.query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0)
}

async fn connect_err(conn_string: String) -> String {
    match PgParticipant::connect(opts(conn_string), Add).await {
        Ok(_) => panic!("connected, expected a refusal"),
        Err(e) => {
            // What an operator would read.
            eprintln!("refused: {e}");
            e.to_string()
        }
    }
}

/// `sslmode=verify-full` with the server's authority: every connection of
/// the participant (and of `postgres::connect`) is TLS, by host name and by
/// IP address, and the participant works over it; `sslmode=disable` stays
/// plain text.
#[tokio::test]
async fn verify_full_connects_over_tls_and_the_participant_works() {
    let dir = tempfile::tempdir().unwrap();
    let ca = authority(dir.path(), "pg-ca");
    let Some(s) = tls_server("t53 verify-full", &ca, &["127.0.0.1", "localhost"]) else {
        return;
    };
    let tls = format!("sslmode=verify-full sslrootcert={}", ca.pem.display());
    for host in ["localhost", "127.0.0.1"] {
        let c = participant_sdk::postgres::connect(&conn(&s, host, "postgres", &tls))
            .await
            .unwrap_or_else(|e| panic!("{host}: {e}"));
        assert!(encrypted(&c).await, "{host}");
    }
    let p = PgParticipant::connect(opts(conn(&s, "localhost", "postgres", &tls)), Add)
        .await
        .unwrap();
    assert!(encrypted(&p.pool().get().await.unwrap()).await);
    assert_eq!(
        p.handle(1.into(), Message::Prepare { term: 1 }, b"5").await.unwrap(),
        Answer::new(Reply::Vote(Vote::Yes))
    );
    assert_eq!(
        p.handle(1.into(), Message::Commit { term: 1 }, b"").await.unwrap(),
        Answer::new(Reply::Ack)
    );
    let audit = participant_sdk::postgres::connect(&conn(&s, "127.0.0.1", "postgres", &tls))
        .await
        .unwrap();
    let (balance, plain): (i64, i64) = {
        let r = audit
            .query_one(
                "SELECT (SELECT balance FROM accounts WHERE id = 'alice'),
                        (SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
                          WHERE a.datname = current_database() AND a.backend_type = 'client backend' AND NOT s.ssl)",
                &[],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(balance, 105);
    assert_eq!(plain, 0, "every connection to the database is TLS");
    let c = participant_sdk::postgres::connect(&conn(&s, "127.0.0.1", "postgres", "sslmode=disable"))
        .await
        .unwrap();
    assert!(!encrypted(&c).await);
}

/// A certificate from another authority is refused, at once and saying
/// so (naming the file it was checked against); so is a certificate for
/// another name with verify-full, which verify-ca (the chain only) takes.
#[tokio::test]
async fn the_wrong_authority_or_name_is_refused_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let ca = authority(dir.path(), "pg-ca");
    let other = authority(dir.path(), "other-ca");
    let Some(s) = tls_server("t53 wrong authority", &ca, &["db.internal"]) else {
        return;
    };
    let wrong = format!("sslmode=verify-full sslrootcert={}", other.pem.display());
    let m = connect_err(conn(&s, "127.0.0.1", "postgres", &wrong)).await;
    assert!(m.contains("not issued by an authority in"), "{m}");
    assert!(m.contains(&other.pem.display().to_string()), "{m}");
    assert!(
        !m.contains("2 connection attempts"),
        "a certificate problem is not retried: {m}"
    );
    let e = participant_sdk::postgres::connect(&conn(&s, "127.0.0.1", "postgres", &wrong))
        .await
        .expect_err("refused")
        .to_string();
    assert!(e.contains("UnknownIssuer") || e.contains("not issued"), "{e}");
    // The right authority, but the certificate names db.internal only.
    let full = format!("sslmode=verify-full sslrootcert={}", ca.pem.display());
    let m = connect_err(conn(&s, "127.0.0.1", "postgres", &full)).await;
    assert!(m.contains("is not valid for 127.0.0.1"), "{m}");
    assert!(m.contains("verify-full"), "{m}");
    let chain = format!("sslmode=verify-ca sslrootcert={}", ca.pem.display());
    let p = PgParticipant::connect(opts(conn(&s, "127.0.0.1", "postgres", &chain)), Add)
        .await
        .unwrap();
    assert!(encrypted(&p.pool().get().await.unwrap()).await);
}

/// A role that must show a client certificate connects with `sslcert` and
/// `sslkey`, and is refused without them.
#[tokio::test]
async fn a_client_certificate_is_shown_when_given() {
    let dir = tempfile::tempdir().unwrap();
    let ca = authority(dir.path(), "pg-ca");
    let Some(s) = tls_server("t53 client certificate", &ca, &["127.0.0.1"]) else {
        return;
    };
    let mine = ca
        .ca
        .issue_to(&ca.dir, "client", Role::Participant, "acct", &[], DEV_LIFETIME)
        .unwrap();
    let without = format!("sslmode=verify-full sslrootcert={}", ca.pem.display());
    let m = connect_err(conn(&s, "127.0.0.1", CERT_USER, &without)).await;
    assert!(m.contains("certificate"), "{m}");
    let with = format!(
        "{without} sslcert={} sslkey={}",
        mine.cert.display(),
        mine.key.display()
    );
    let p = PgParticipant::connect(opts(conn(&s, "127.0.0.1", CERT_USER, &with)), Add)
        .await
        .unwrap();
    assert!(encrypted(&p.pool().get().await.unwrap()).await);
}

/// Settings that would connect without checking the server, or cannot
/// work, are refused before any connection, saying what to write instead;
/// TLS asked of a server without it says so.
#[tokio::test]
async fn unverified_or_impossible_tls_settings_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ca = authority(dir.path(), "pg-ca");
    let Some(s) = dtx_pg_server::start_or_skip(
        "t53 tls settings",
        PgServerOptions {
            kill_with_parent_thread: true,
            ..PgServerOptions::default()
        },
    ) else {
        return;
    };
    setup(&s);
    let root = format!("sslrootcert={}", ca.pem.display());
    for (tls, says) in [
        ("sslmode=require", "sslrootcert"),
        ("sslmode=verify-full", "sslrootcert"),
        ("sslmode=sometimes", "verify-full"),
        ("sslmode=allow", "not supported"),
        (root.as_str(), "sslmode"),
        (
            "sslmode=verify-full sslrootcert=/nonexistent/ca.pem",
            "/nonexistent/ca.pem",
        ),
        (&format!("sslmode=verify-full {root} sslcert=/tmp/x.pem"), "sslkey"),
    ] {
        let m = connect_err(conn(&s, "127.0.0.1", "postgres", tls)).await;
        assert!(m.contains(says), "{tls}: {says:?} missing from: {m}");
    }
    let m = connect_err(conn(
        &s,
        "127.0.0.1",
        "postgres",
        &format!("sslmode=verify-full {root}"),
    ))
    .await;
    assert!(m.contains("does not accept TLS"), "{m}");
    // Plain text as before when nothing is said.
    let p = PgParticipant::connect(opts(s.conn_string(DB)), Add).await.unwrap();
    assert!(!encrypted(&p.pool().get().await.unwrap()).await);
}
