//! Start, query, crash, restart, drop.

use dtx_pg_server::PgServer;
use dtx_pg_server::PgServerOptions;

#[test]
fn start_crash_restart() {
    let mut s = match PgServer::start(PgServerOptions::default()) {
        Ok(s) => s,
        Err(e) if e.is_binaries_missing() && std::env::var("DTX_REQUIRE_POSTGRES").as_deref() != Ok("1") => {
            eprintln!("!!!!! SKIPPED: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    s.create_database("app").unwrap();
    s.execute("app", "CREATE TABLE t (x int); INSERT INTO t VALUES (1)")
        .unwrap();
    let err = s.execute("app", "SELECT * FROM missing").unwrap_err();
    assert!(err.to_string().contains("missing"), "{err}");
    let port = s.port();
    s.kill9();
    assert!(s.execute("app", "SELECT 1").is_err());
    s.restart().unwrap();
    assert_eq!(s.port(), port);
    s.execute("app", "SELECT x FROM t").unwrap();
    let dir = s.log_path().parent().unwrap().to_path_buf();
    drop(s);
    assert!(!dir.exists());
}
