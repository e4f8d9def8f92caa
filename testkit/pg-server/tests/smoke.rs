//! Start, query, crash, restart, drop.

use std::io::Read;
use std::io::Write;
use std::net::TcpStream;

use dtx_pg_server::process_running;
use dtx_pg_server::PgServer;
use dtx_pg_server::PgServerOptions;

fn start_or_skip() -> Option<PgServer> {
    dtx_pg_server::start_or_skip("dtx-pg-server smoke", PgServerOptions::default())
}

/// An idle session: the startup message (protocol 3.0, trust), then read
/// until ReadyForQuery. The backend serving it stays until the socket
/// closes or the server dies.
fn idle_session(port: u16, db: &str) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut body = 196_608u32.to_be_bytes().to_vec();
    for part in ["user", "postgres", "database", db, ""] {
        body.extend_from_slice(part.as_bytes());
        body.push(0);
    }
    let mut msg = ((body.len() + 4) as u32).to_be_bytes().to_vec();
    msg.extend_from_slice(&body);
    s.write_all(&msg).unwrap();
    loop {
        let mut head = [0u8; 5];
        s.read_exact(&mut head).unwrap();
        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
        let mut rest = vec![0u8; len - 4];
        s.read_exact(&mut rest).unwrap();
        assert_ne!(head[0], b'E', "startup refused: {}", String::from_utf8_lossy(&rest));
        if head[0] == b'Z' {
            return s;
        }
    }
}

#[test]
fn start_crash_restart() {
    let Some(mut s) = start_or_skip() else { return };
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

/// PostgreSQL's backends call `setsid()`, so a SIGKILL to the postmaster's
/// process group misses them; they live on attached to the shared memory
/// until they notice, and a restart in that window fails with
/// "pre-existing shared memory block is still in use" (a CI failure of
/// t89). kill9 must leave no backend alive, and a restart right after it
/// must succeed, with client sessions open at each crash.
#[test]
fn kill9_leaves_no_backend_and_restart_follows_at_once() {
    let Some(mut s) = start_or_skip() else { return };
    s.create_database("app").unwrap();
    for round in 0..5 {
        let sessions: Vec<TcpStream> = (0..4).map(|_| idle_session(s.port(), "app")).collect();
        let backends = s.backend_pids();
        assert!(
            backends.len() >= sessions.len(),
            "round {round}: {} children for {} sessions",
            backends.len(),
            sessions.len()
        );
        s.kill9();
        let alive: Vec<u32> = backends.iter().copied().filter(|p| process_running(*p)).collect();
        assert!(alive.is_empty(), "round {round}: backends alive after kill9: {alive:?}");
        s.restart().unwrap_or_else(|e| panic!("round {round}: {e}"));
        s.execute("app", "SELECT 1").unwrap();
        drop(sessions);
    }
}
