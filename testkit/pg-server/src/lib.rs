//! A throwaway PostgreSQL server for tests and demos.
//!
//! [`PgServer::start`] runs `initdb` on a data directory inside a fresh
//! temporary folder and starts `postgres` on it as a real child process (no
//! container): it listens only on 127.0.0.1 on a free port, keeps its unix
//! socket inside the temporary folder, trusts every local connection (user
//! `postgres`, no password), runs with `fsync=on` and the configured
//! `max_prepared_transactions`. [`PgServer::kill9`] crashes it (SIGKILL of
//! the postmaster and each backend, waiting until all are gone),
//! [`PgServer::restart`] starts it again
//! on the same data directory and port (crash recovery included), and
//! dropping the value kills it and removes the folder. With
//! [`PgServerOptions::tls`] it also accepts TLS with the given certificate;
//! [`PgServer::stop_wal_writer`] makes unflushed commits observable.
//!
//! The binaries (`initdb`, `postgres`) are looked up in `DTX_PG_BIN` (a
//! directory), then on `PATH`, then under the newest
//! `/usr/lib/postgresql/<version>/bin`; when none is found,
//! [`PgServerError::BinariesMissing`] says how to install them.
//!
//! `initdb` and `postgres` refuse to run as root: when this process is root,
//! both run as the unprivileged system user `dtx-pg` (created with
//! `useradd --system` when absent), which owns the temporary folder.

use std::ffi::CString;
use std::fs::OpenOptions;
use std::io::Read;
use std::io::Write;
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::path::PathBuf;
use std::process::Child;
use std::process::Command;
use std::process::Stdio;
use std::time::Duration;
use std::time::Instant;

/// The only address the server listens on.
pub const HOST: &str = "127.0.0.1";

/// The OS user the server runs as when this process is root.
pub const SERVICE_USER: &str = "dtx-pg";

/// The database role every connection uses (trusted, no password).
pub const SUPERUSER: &str = "postgres";

#[derive(Debug)]
pub enum PgServerError {
    /// The PostgreSQL server binaries are not installed.
    BinariesMissing(String),
    /// Anything else: initdb, start-up, a query, the OS user.
    Failed(String),
}

impl std::fmt::Display for PgServerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PgServerError::BinariesMissing(m) | PgServerError::Failed(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for PgServerError {}

impl PgServerError {
    pub fn is_binaries_missing(&self) -> bool {
        matches!(self, PgServerError::BinariesMissing(_))
    }
}

pub type Result<T> = std::result::Result<T, PgServerError>;

fn failed(msg: impl Into<String>) -> PgServerError {
    PgServerError::Failed(msg.into())
}

#[derive(Clone, Debug)]
pub struct PgServerOptions {
    /// `max_prepared_transactions` (0 disables PREPARE TRANSACTION).
    pub max_prepared_transactions: u32,
    /// `max_connections`.
    pub max_connections: u32,
    /// How long a start (or restart, crash recovery included) may take
    /// before it is an error.
    pub start_timeout: Duration,
    /// More `postgresql.conf` lines, as (name, value) with the value
    /// written as is (quote strings yourself).
    pub extra_settings: Vec<(String, String)>,
    /// SIGKILL the server when the thread that started it exits (Linux
    /// `PR_SET_PDEATHSIG`), so a test killed midway leaves no server
    /// behind. Only for servers started (and restarted) from a thread that
    /// outlives them, such as a test's own thread.
    pub kill_with_parent_thread: bool,
    /// TLS: `ssl = on` with this certificate and key (and, when set, the
    /// authority that client certificates are checked against). Plain
    /// connections stay allowed (the lines `initdb` writes say `host`).
    pub tls: Option<PgServerTls>,
    /// Lines put first in `pg_hba.conf` (first match wins), e.g. a
    /// `hostssl` line that asks one user for a client certificate.
    pub extra_hba: Vec<String>,
}

/// The server's TLS material, as PEM text (written into the data
/// directory, the key with mode 0600 and owned by the server's OS user, as
/// PostgreSQL requires).
#[derive(Clone, Debug)]
pub struct PgServerTls {
    pub cert_pem: String,
    pub key_pem: String,
    /// `ssl_ca_file`: the authorities client certificates must chain to.
    pub client_ca_pem: Option<String>,
}

impl Default for PgServerOptions {
    fn default() -> Self {
        PgServerOptions {
            max_prepared_transactions: 64,
            max_connections: 100,
            start_timeout: Duration::from_secs(60),
            extra_settings: Vec::new(),
            kill_with_parent_thread: false,
            tls: None,
            extra_hba: Vec::new(),
        }
    }
}

/// The directory holding `initdb` and `postgres`, or how to install them.
pub fn find_binaries() -> Result<PathBuf> {
    find_binaries_in(
        std::env::var_os("DTX_PG_BIN").map(PathBuf::from),
        std::env::var_os("PATH"),
        Path::new("/usr/lib/postgresql"),
    )
}

fn find_binaries_in(explicit: Option<PathBuf>, path: Option<std::ffi::OsString>, lib_root: &Path) -> Result<PathBuf> {
    let has_both = |d: &Path| d.join("initdb").is_file() && d.join("postgres").is_file();
    if let Some(d) = explicit {
        if has_both(&d) {
            return Ok(d);
        }
    }
    if let Some(path) = path {
        for d in std::env::split_paths(&path) {
            if has_both(&d) {
                return Ok(d);
            }
        }
    }
    let mut versions: Vec<(Vec<u64>, PathBuf)> = std::fs::read_dir(lib_root)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| {
                    let name = e.file_name().to_string_lossy().to_string();
                    let v: Option<Vec<u64>> = name.split('.').map(|p| p.parse().ok()).collect();
                    Some((v?, e.path().join("bin")))
                })
                .collect()
        })
        .unwrap_or_default();
    versions.sort();
    if let Some((_, d)) = versions.into_iter().rev().find(|(_, d)| has_both(d)) {
        return Ok(d);
    }
    Err(PgServerError::BinariesMissing(format!(
        "PostgreSQL server binaries (initdb, postgres) not found in DTX_PG_BIN, on PATH or under \
         {}/<version>/bin; install them (Debian/Ubuntu: `apt-get install postgresql`)",
        lib_root.display()
    )))
}

/// The uid and gid to run the server as, when this process is root.
#[derive(Clone, Copy, Debug)]
struct RunAs {
    uid: libc::uid_t,
    gid: libc::gid_t,
}

fn lookup_user(name: &str) -> Option<RunAs> {
    let c = CString::new(name).ok()?;
    // SAFETY: getpwnam returns a pointer to static storage or null; we copy
    // the two fields out at once (tests start servers from one thread at a
    // time per process at most through this function's callers; a race
    // would only mix up two lookups of the same user).
    unsafe {
        let pw = libc::getpwnam(c.as_ptr());
        if pw.is_null() {
            None
        } else {
            Some(RunAs {
                uid: (*pw).pw_uid,
                gid: (*pw).pw_gid,
            })
        }
    }
}

/// `dtx-pg`, created when absent. Test processes start servers at once
/// (nextest runs every test in its own process), so the look-up and the
/// creation happen under an exclusive lock on a file beside the servers'
/// folders: no process sees the user while another's `useradd` is still
/// writing the account files (an `initdb` started then failed with "could
/// not look up effective user ID"). The lock goes when the file closes.
fn service_user() -> Result<RunAs> {
    use std::os::fd::AsRawFd;
    let path = std::env::temp_dir().join("dtx-pg-useradd.lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(|e| failed(format!("open {}: {e}", path.display())))?;
    // SAFETY: flock on a descriptor this function owns until it returns.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(failed(format!(
            "lock {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        )));
    }
    if let Some(u) = lookup_user(SERVICE_USER) {
        return Ok(u);
    }
    let out = Command::new("useradd")
        .args([
            "--system",
            "--no-create-home",
            "--shell",
            "/usr/sbin/nologin",
            SERVICE_USER,
        ])
        .output()
        .map_err(|e| failed(format!("running useradd to create the OS user {SERVICE_USER}: {e}")))?;
    // Another process may have created it concurrently (exit code 9).
    if let Some(u) = lookup_user(SERVICE_USER) {
        return Ok(u);
    }
    Err(failed(format!(
        "could not create the OS user {SERVICE_USER} (initdb refuses to run as root): useradd exited with {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    )))
}

fn chown_tree(path: &Path, who: RunAs) -> Result<()> {
    std::os::unix::fs::chown(path, Some(who.uid), Some(who.gid))
        .map_err(|e| failed(format!("chown {}: {e}", path.display())))?;
    if path.is_dir() {
        let rd = std::fs::read_dir(path).map_err(|e| failed(format!("read {}: {e}", path.display())))?;
        for e in rd {
            let e = e.map_err(|e| failed(format!("read {}: {e}", path.display())))?;
            chown_tree(&e.path(), who)?;
        }
    }
    Ok(())
}

/// Runs the command as `who` (if set) in its own process group.
fn prepare_command(cmd: &mut Command, who: Option<RunAs>, pdeathsig: bool) {
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setpgid(0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if let Some(w) = who {
                if libc::setgroups(0, std::ptr::null()) != 0 || libc::setgid(w.gid) != 0 || libc::setuid(w.uid) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            // After setuid, which clears it.
            if pdeathsig && libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// The fields of `/proc/<pid>/stat` that [`PgServer::kill9`] needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ProcStat {
    pid: u32,
    state: char,
    parent: u32,
    /// Clock ticks after boot: with the pid, names one process even if the
    /// pid is later reused.
    start_time: u64,
}

/// Parses a `/proc/<pid>/stat` line. The command name (field 2) is in
/// parentheses and may itself contain spaces and parentheses, so fields are
/// counted from the last `)`.
fn parse_proc_stat(line: &str) -> Option<ProcStat> {
    let open = line.find('(')?;
    let close = line.rfind(')')?;
    let pid = line[..open].trim().parse().ok()?;
    let rest: Vec<&str> = line.get(close + 1..)?.split_whitespace().collect();
    // rest[0] is field 3 (state), rest[1] field 4 (ppid), rest[19] field 22
    // (starttime).
    Some(ProcStat {
        pid,
        state: rest.first()?.chars().next()?,
        parent: rest.get(1)?.parse().ok()?,
        start_time: rest.get(19)?.parse().ok()?,
    })
}

fn proc_stat(pid: u32) -> Option<ProcStat> {
    parse_proc_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// True while process `pid` exists and has not exited (a zombie has).
pub fn process_running(pid: u32) -> bool {
    proc_stat(pid).is_some_and(|s| !matches!(s.state, 'Z' | 'X'))
}

/// Every live process whose parent is `parent`.
fn children_of(parent: u32) -> Vec<ProcStat> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(proc_stat)
        .filter(|s| s.parent == parent && !matches!(s.state, 'Z' | 'X'))
        .collect()
}

/// Polls `done` every 10 ms until it holds (true) or `limit` passes (false).
fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn free_port() -> Result<u16> {
    dtx_ports::free_port(HOST).map_err(|e| failed(format!("finding a free port: {e}")))
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A running (or crashed) throwaway PostgreSQL server.
pub struct PgServer {
    // Declared first: dropped (the folder removed) after `Drop::drop` ran.
    dir: tempfile::TempDir,
    bin: PathBuf,
    run_as: Option<RunAs>,
    port: u16,
    opts: PgServerOptions,
    child: Option<Child>,
}

impl PgServer {
    /// initdb, configure, start, and wait until it accepts connections.
    pub fn start(opts: PgServerOptions) -> Result<PgServer> {
        let mut server = PgServer::new(opts)?;
        server.init_and_start()?;
        Ok(server)
    }

    /// A server not yet created: its temporary folder, port and OS user,
    /// without initdb or a start. For a caller that puts something on
    /// [`PgServer::data_dir`] first (a filesystem of its own, mounted there)
    /// and then calls [`PgServer::init_and_start`].
    pub fn new(opts: PgServerOptions) -> Result<PgServer> {
        let bin = find_binaries()?;
        // SAFETY: geteuid has no preconditions.
        let run_as = if unsafe { libc::geteuid() } == 0 {
            Some(service_user()?)
        } else {
            None
        };
        let dir = tempfile::Builder::new()
            .prefix("dtx-pg-")
            .tempdir()
            .map_err(|e| failed(format!("creating a temporary folder: {e}")))?;
        std::fs::create_dir(dir.path().join("sock")).map_err(|e| failed(format!("creating sock dir: {e}")))?;
        if let Some(w) = run_as {
            chown_tree(dir.path(), w)?;
        }
        Ok(PgServer {
            port: free_port()?,
            dir,
            bin,
            run_as,
            opts,
            child: None,
        })
    }

    /// initdb on [`PgServer::data_dir`] (missing, or empty), configure,
    /// start, and wait until it accepts connections.
    pub fn init_and_start(&mut self) -> Result<()> {
        self.initdb()?;
        self.spawn()
    }

    /// The data directory (PGDATA).
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn socket_dir(&self) -> PathBuf {
        self.dir.path().join("sock")
    }

    /// The server's log (stdout and stderr of `postgres`).
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("postgres.log")
    }

    fn initdb(&self) -> Result<()> {
        // A data directory made by the caller (a mount point, say) becomes
        // the server's: initdb insists on owning it.
        if let (Some(w), true) = (self.run_as, self.data_dir().is_dir()) {
            chown_tree(&self.data_dir(), w)?;
        }
        let mut cmd = Command::new(self.bin.join("initdb"));
        cmd.arg("-D")
            .arg(self.data_dir())
            .args([
                "-U",
                SUPERUSER,
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
            ])
            .stdin(Stdio::null());
        prepare_command(&mut cmd, self.run_as, false);
        let out = cmd.output().map_err(|e| failed(format!("running initdb: {e}")))?;
        if !out.status.success() {
            return Err(failed(format!(
                "initdb failed ({}): {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        let mut conf = format!(
            "\n# dtx-pg-server\nlisten_addresses = '{HOST}'\nport = {}\nunix_socket_directories = '{}'\n\
             max_prepared_transactions = {}\nmax_connections = {}\nfsync = on\nshared_buffers = 32MB\n",
            self.port,
            self.socket_dir().display(),
            self.opts.max_prepared_transactions,
            self.opts.max_connections,
        );
        if let Some(tls) = &self.opts.tls {
            self.write_server_file("server.crt", &tls.cert_pem)?;
            self.write_server_file("server.key", &tls.key_pem)?;
            conf.push_str("ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n");
            if let Some(ca) = &tls.client_ca_pem {
                self.write_server_file("client-ca.crt", ca)?;
                conf.push_str("ssl_ca_file = 'client-ca.crt'\n");
            }
        }
        if !self.opts.extra_hba.is_empty() {
            let hba = self.data_dir().join("pg_hba.conf");
            let old = std::fs::read_to_string(&hba).map_err(|e| failed(format!("read {}: {e}", hba.display())))?;
            let mut text = self.opts.extra_hba.join("\n");
            text.push('\n');
            text.push_str(&old);
            std::fs::write(&hba, text).map_err(|e| failed(format!("write {}: {e}", hba.display())))?;
        }
        for (k, v) in &self.opts.extra_settings {
            conf.push_str(&format!("{k} = {v}\n"));
        }
        let path = self.data_dir().join("postgresql.conf");
        let mut f = OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(|e| failed(format!("open {}: {e}", path.display())))?;
        f.write_all(conf.as_bytes())
            .map_err(|e| failed(format!("write {}: {e}", path.display())))?;
        Ok(())
    }

    /// Writes `name` into the data directory, mode 0600, owned by the
    /// server's OS user (PostgreSQL refuses a key others can read).
    fn write_server_file(&self, name: &str, text: &str) -> Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = self.data_dir().join(name);
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| failed(format!("create {}: {e}", path.display())))?;
        f.write_all(text.as_bytes())
            .map_err(|e| failed(format!("write {}: {e}", path.display())))?;
        if let Some(w) = self.run_as {
            chown_tree(&path, w)?;
        }
        Ok(())
    }

    fn spawn(&mut self) -> Result<()> {
        let log_path = self.log_path();
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| failed(format!("open {}: {e}", log_path.display())))?;
        let log2 = log.try_clone().map_err(|e| failed(e.to_string()))?;
        let mut cmd = Command::new(self.bin.join("postgres"));
        cmd.arg("-D")
            .arg(self.data_dir())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2);
        prepare_command(&mut cmd, self.run_as, self.opts.kill_with_parent_thread);
        let child = cmd.spawn().map_err(|e| failed(format!("starting postgres: {e}")))?;
        self.child = Some(child);
        self.wait_ready()
    }

    fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + self.opts.start_timeout;
        let mut last;
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    return Err(failed(format!(
                        "postgres exited during start-up ({status}); log tail:\n{}",
                        tail(&self.log_path(), 30)
                    )));
                }
            }
            match self.simple_query(SUPERUSER, "SELECT 1") {
                Ok(()) => return Ok(()),
                Err(e) => last = e.to_string(),
            }
            if Instant::now() >= deadline {
                return Err(failed(format!(
                    "postgres did not accept connections on {HOST}:{} within {:?} (last: {last}); log tail:\n{}",
                    self.port,
                    self.opts.start_timeout,
                    tail(&self.log_path(), 30)
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Whether the postmaster is running: started, not killed, and not
    /// exited by itself (as it does when its crash recovery fails).
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// The postmaster's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// The pids of the postmaster's live children (backends and auxiliary
    /// processes), empty when it is not running.
    pub fn backend_pids(&self) -> Vec<u32> {
        self.pid()
            .map(|pm| children_of(pm).iter().map(|s| s.pid).collect())
            .unwrap_or_default()
    }

    /// Stops (SIGSTOP) the server's WAL writer process and returns its pid.
    /// From then on, WAL that no backend flushes itself (the commit record
    /// of a transaction committed with `synchronous_commit = off`) stays in
    /// shared memory only, and a [`PgServer::kill9`] loses it, as a power
    /// cut would lose it from the page cache: a deterministic way to see
    /// whether a commit was flushed before it returned. A synchronous commit
    /// flushes the WAL itself and does not need the writer. The writer is
    /// killed with the rest by `kill9`; a restart starts a new one.
    pub fn stop_wal_writer(&self) -> Result<u32> {
        let pid = self
            .backend_pids()
            .into_iter()
            .find(|&pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .map(|c| String::from_utf8_lossy(&c).contains("walwriter"))
                    .unwrap_or(false)
            })
            .ok_or_else(|| failed("no walwriter process among the server's children"))?;
        // SAFETY: kill has no memory preconditions; `pid` is a child of the
        // running postmaster, which reaps it, so it cannot have been reused
        // while the postmaster runs.
        if unsafe { libc::kill(pid as libc::pid_t, libc::SIGSTOP) } != 0 {
            return Err(failed(format!(
                "SIGSTOP to the walwriter {pid}: {}",
                std::io::Error::last_os_error()
            )));
        }
        let stopped = wait_until(Duration::from_secs(5), || {
            proc_stat(pid).is_none_or(|s| matches!(s.state, 'T' | 't'))
        });
        if !stopped {
            return Err(failed(format!("the walwriter {pid} did not stop within 5 s")));
        }
        Ok(pid)
    }

    /// A tokio-postgres connection string for database `db`.
    pub fn conn_string(&self, db: &str) -> String {
        format!("host={HOST} port={} user={SUPERUSER} dbname={db}", self.port)
    }

    /// `CREATE DATABASE name` (the name is quoted as an identifier).
    pub fn create_database(&self, name: &str) -> Result<()> {
        let quoted = format!("\"{}\"", name.replace('"', "\"\""));
        self.simple_query("postgres", &format!("CREATE DATABASE {quoted}"))
    }

    /// Runs `sql` (simple query protocol, no results returned) on `db`.
    pub fn execute(&self, db: &str, sql: &str) -> Result<()> {
        self.simple_query(db, sql)
    }

    /// Crashes the server: SIGKILL to the postmaster and every backend, as
    /// a machine crash would stop them, and returns once none of them is
    /// alive any more.
    ///
    /// PostgreSQL's children call `setsid()`, so they are not in the
    /// postmaster's process group: a group kill reaches only the postmaster,
    /// and its backends live on until they notice it died, still attached
    /// to the shared memory segment. A start in that window fails with
    /// "pre-existing shared memory block is still in use". So the
    /// postmaster is stopped first (it forks no new child), its children
    /// are found by their parent pid and killed with it, and the call waits
    /// until each has exited (a zombie has released its memory).
    pub fn kill9(&mut self) {
        let Some(mut child) = self.child.take() else { return };
        let pm = child.id() as libc::pid_t;
        // SAFETY: kill has no memory preconditions; the pid is our child,
        // not yet reaped, so it cannot have been reused.
        unsafe {
            libc::kill(pm, libc::SIGSTOP);
        }
        wait_until(Duration::from_secs(5), || {
            proc_stat(pm as u32).is_none_or(|s| matches!(s.state, 'T' | 't' | 'Z' | 'X'))
        });
        let backends = children_of(pm as u32);
        for b in &backends {
            // SAFETY: as above; a backend cannot be reaped (and its pid
            // reused) while its parent, the stopped postmaster, lives.
            unsafe {
                libc::kill(b.pid as libc::pid_t, libc::SIGKILL);
            }
        }
        // SAFETY: as above; the group is the postmaster's own.
        unsafe {
            libc::kill(-pm, libc::SIGKILL);
        }
        let _ = child.kill();
        let _ = child.wait();
        let all_gone = wait_until(Duration::from_secs(10), || {
            backends
                .iter()
                .all(|b| proc_stat(b.pid).is_none_or(|s| s.start_time != b.start_time || matches!(s.state, 'Z' | 'X')))
        });
        if !all_gone {
            eprintln!("dtx-pg-server: a PostgreSQL backend outlived SIGKILL by 10 s; the next start may fail");
        }
    }

    /// Starts the server again on the same data directory and port (after
    /// [`PgServer::kill9`]; a running server is crashed first).
    pub fn restart(&mut self) -> Result<()> {
        self.kill9();
        self.spawn()
    }

    /// A minimal frontend: startup as `postgres` (trust), one simple query,
    /// read until ReadyForQuery, report an ErrorResponse as an error.
    fn simple_query(&self, db: &str, sql: &str) -> Result<()> {
        let addr = format!("{HOST}:{}", self.port);
        let mut s = TcpStream::connect_timeout(&addr.parse().expect("addr"), Duration::from_secs(2))
            .map_err(|e| failed(format!("connect {addr}: {e}")))?;
        s.set_read_timeout(Some(Duration::from_secs(30))).ok();
        let io = |e: std::io::Error| failed(format!("talking to {addr}: {e}"));
        let mut body = Vec::new();
        body.extend_from_slice(&196608u32.to_be_bytes());
        for (k, v) in [("user", SUPERUSER), ("database", db)] {
            body.extend_from_slice(k.as_bytes());
            body.push(0);
            body.extend_from_slice(v.as_bytes());
            body.push(0);
        }
        body.push(0);
        let mut msg = ((body.len() + 4) as u32).to_be_bytes().to_vec();
        msg.extend_from_slice(&body);
        s.write_all(&msg).map_err(io)?;
        let mut sent_query = false;
        let mut error: Option<String> = None;
        loop {
            let mut head = [0u8; 5];
            s.read_exact(&mut head).map_err(io)?;
            let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
            let mut payload = vec![0u8; len.saturating_sub(4)];
            s.read_exact(&mut payload).map_err(io)?;
            match head[0] {
                b'R' => {
                    let code = u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]);
                    if code != 0 {
                        return Err(failed(format!("server asks for authentication {code}; expected trust")));
                    }
                }
                b'E' => {
                    let text = error_message(&payload);
                    if !sent_query {
                        return Err(failed(text));
                    }
                    error = Some(text);
                }
                b'Z' => {
                    if !sent_query {
                        let mut q = vec![b'Q'];
                        q.extend_from_slice(&((sql.len() + 5) as u32).to_be_bytes());
                        q.extend_from_slice(sql.as_bytes());
                        q.push(0);
                        s.write_all(&q).map_err(io)?;
                        sent_query = true;
                    } else {
                        let _ = s.write_all(&[b'X', 0, 0, 0, 4]);
                        return match error {
                            Some(e) => Err(failed(format!("{sql}: {e}"))),
                            None => Ok(()),
                        };
                    }
                }
                _ => {}
            }
        }
    }
}

/// The severity and message fields of an ErrorResponse.
fn error_message(payload: &[u8]) -> String {
    let mut out = Vec::new();
    for field in payload.split(|b| *b == 0) {
        if let Some((&code, text)) = field.split_first() {
            if code == b'S' || code == b'M' {
                out.push(String::from_utf8_lossy(text).to_string());
            }
        }
    }
    out.join(": ")
}

impl Drop for PgServer {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Set to `1` (CI does), a test that needs PostgreSQL fails when the server
/// binaries are missing, instead of skipping.
pub const REQUIRE_ENV: &str = "DTX_REQUIRE_POSTGRES";

/// For tests: starts a server with `opts`, or, when the server binaries are
/// missing and [`REQUIRE_ENV`] is not `1`, says loudly that `test` is
/// skipped and returns `None`. Any other failure panics.
pub fn start_or_skip(test: &str, opts: PgServerOptions) -> Option<PgServer> {
    match PgServer::start(opts) {
        Ok(s) => Some(s),
        Err(e) if e.is_binaries_missing() && std::env::var(REQUIRE_ENV).as_deref() != Ok("1") => {
            eprintln!(
                "\n*** {test} SKIPPED: {e}\n*** (install them with scripts/postgres-deps; {REQUIRE_ENV}=1 makes this a failure)\n"
            );
            None
        }
        Err(e) => panic!("{test}: could not start PostgreSQL: {e}"),
    }
}

/// Whether the server binaries are present (for tests that skip without).
pub fn binaries_present() -> bool {
    find_binaries().is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_binaries_say_how_to_install_them() {
        let empty = tempfile::tempdir().unwrap();
        let e = find_binaries_in(None, Some(empty.path().as_os_str().to_owned()), empty.path()).unwrap_err();
        assert!(e.is_binaries_missing());
        assert!(e.to_string().contains("apt-get install postgresql"), "{e}");
    }

    #[test]
    fn proc_stat_fields_are_counted_from_the_last_parenthesis() {
        let line = "4242 (postgres: a (b) c) S 4200 4242 4242 0 -1 4194560 90 0 0 0 0 0 0 0 20 0 1 0 987654 1 2 3";
        let s = parse_proc_stat(line).unwrap();
        assert_eq!(
            s,
            ProcStat {
                pid: 4242,
                state: 'S',
                parent: 4200,
                start_time: 987654
            }
        );
        assert_eq!(parse_proc_stat("4242 (x) S 1"), None, "too few fields");
        assert_eq!(parse_proc_stat("garbage"), None);
        let me = proc_stat(std::process::id()).unwrap();
        assert_eq!(me.pid, std::process::id());
        assert!(process_running(me.pid));
    }

    #[test]
    fn newest_version_under_the_lib_root_wins() {
        let root = tempfile::tempdir().unwrap();
        for v in ["9.6", "15", "16"] {
            let bin = root.path().join(v).join("bin");
            std::fs::create_dir_all(&bin).unwrap();
            if v != "16" {
                std::fs::write(bin.join("initdb"), "").unwrap();
                std::fs::write(bin.join("postgres"), "").unwrap();
            }
        }
        let d = find_binaries_in(None, None, root.path()).unwrap();
        assert_eq!(d, root.path().join("15").join("bin"), "16 is incomplete");
    }
}
