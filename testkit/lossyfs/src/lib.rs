//! A FUSE filesystem for crash tests that loses, at a simulated power cut,
//! every write not yet made durable (LazyFS-style; ADR 0032).
//!
//! `kill -9` keeps the page cache: a process killed after `write` and
//! before `fsync` leaves its data in the kernel, and a restarted process
//! reads it back. A power loss does not. [`LossyFs`] mounts an in-memory
//! filesystem (served by a background thread of the process that mounts
//! it) whose every file and directory has two images, the *current* one
//! that reads see and the *durable* one that survives [`LossyFs::power_cut`].
//!
//! # Durability model (exact)
//!
//! - A regular file's data and size: `write`, `truncate` (`ftruncate`,
//!   `set_len`, `O_TRUNC`) and `fallocate` change the current image only.
//!   `fsync` or `fdatasync` of the file (any descriptor of it; `sync_all`,
//!   `sync_data`) makes its whole current image durable, size included.
//!   Nothing else does: not `close`, not another file's `fsync`, not time.
//! - A directory's entries: `create`/`open(O_CREAT)`, `mkdir`, `rename`,
//!   `unlink`, `rmdir` change the current entries of the directories
//!   involved only. `fsync` of a directory (open it, `sync_all`) makes its
//!   whole current list of entries durable (names and which inode each
//!   names); a rename between two directories needs both synced.
//! - A file's own `fsync` does NOT make its directory entry durable: a new
//!   file that was fsynced but whose directory was not is gone after the
//!   cut, and a rename or unlink not followed by a `fsync` of the directory
//!   is undone. This is what POSIX and fsync(2) promise ("an explicit fsync
//!   on a file descriptor for the directory is also needed"), and what
//!   ext2 or ext4 without a journal give. ext4 with its journal (and
//!   data=ordered) is kinder: any fsync commits the running journal
//!   transaction, which holds every namespace change made before it, so
//!   there an fsynced new file usually keeps its name. The model is the
//!   stricter of the two on purpose: code that is right here is right on
//!   ext4, not the other way round.
//! - A directory's entry in its parent is like any other entry: a new
//!   directory lasts only once its parent is synced, and what is in it
//!   only once it is synced itself.
//! - Metadata other than size (mode, owner, times) is kept as is; it is
//!   not modelled.
//!
//! At [`LossyFs::power_cut`] every file's current image becomes its durable
//! one, every directory's current entries become its durable ones, and
//! whatever is no longer reachable from the root is freed: the mount then
//! shows exactly the durable state. [`LossyFs::power_cut_torn`] instead
//! keeps, for each file, a random prefix of the writes made since its last
//! sync, in the order they were made, the last one possibly cut short
//! within itself: the partly written tail a crash during a write leaves
//! (ext4 data=ordered may write back some of the dirty pages of a file
//! before the power goes). Directory entries are undone the same way in
//! both.
//!
//! What is not modelled: writes reaching the disk out of their order, a
//! torn sector in the middle of an earlier write (only the last kept write
//! is cut short), a sync that fails (EIO), a full disk (see the
//! `dtx-failpoint` disk faults for that), and mmap'ed files (every open is
//! `direct_io`: reads and writes bypass the page cache, so that after a cut
//! nothing stale is served from it).
//!
//! Locks: `flock` and `fcntl` locks are kept by the kernel itself (the
//! filesystem does not take them over), which is what a single machine
//! needs; a killed process's locks go with it. `statfs` answers a 16 GiB
//! filesystem minus what its files hold, so free-space checks pass; a
//! smaller size can be set ([`LossyFs::set_capacity`]), past which files
//! cannot grow (ENOSPC), for a full-disk fault on a lossy mount.
//!
//! # Use
//!
//! Mounting needs `/dev/fuse` and the right to call mount(2) (root, or the
//! `CAP_SYS_ADMIN` capability). [`mount_or_skip`] says loudly that a test
//! is skipped when that cannot be had, unless `DTX_REQUIRE_FUSE=1`
//! ([`REQUIRE_ENV`]), where it fails instead. The mount is unmounted
//! (lazily, if still busy) when the [`LossyFs`] is dropped. Kill every
//! process that uses the mount with SIGKILL before [`LossyFs::power_cut`]:
//! a process that outlives the cut goes on with descriptors of a machine
//! that lost power, which nothing models.
#![deny(unsafe_op_in_unsafe_fn)]

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::ffi::CString;
use std::ffi::OsStr;
use std::ffi::OsString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::MutexGuard;
use std::time::Duration;
use std::time::SystemTime;

use fuser::BackgroundSession;
use fuser::Errno;
use fuser::FileAttr;
use fuser::FileHandle;
use fuser::FileType;
use fuser::Filesystem;
use fuser::FopenFlags;
use fuser::Generation;
use fuser::INodeNo;
use fuser::LockOwner;
use fuser::OpenFlags;
use fuser::RenameFlags;
use fuser::ReplyAttr;
use fuser::ReplyCreate;
use fuser::ReplyData;
use fuser::ReplyDirectory;
use fuser::ReplyEmpty;
use fuser::ReplyEntry;
use fuser::ReplyOpen;
use fuser::ReplyStatfs;
use fuser::ReplyWrite;
use fuser::Request;
use fuser::TimeOrNow;
use fuser::WriteFlags;

/// Set to `1` (CI does), a test that needs the mount fails when it cannot
/// be had, instead of skipping.
pub const REQUIRE_ENV: &str = "DTX_REQUIRE_FUSE";

/// The size `statfs` reports.
const TOTAL_BYTES: u64 = 16 << 30;
const BLOCK: u64 = 4096;
const ROOT: u64 = 1;
/// Nothing is cached by the kernel: every lookup and stat asks again, so
/// that after a cut it sees the durable state.
const TTL: Duration = Duration::ZERO;

/// One write since the last sync of a file, in order.
#[derive(Debug, Clone)]
enum Op {
    Write { offset: u64, data: Vec<u8> },
    SetLen(u64),
}

impl Op {
    fn apply(&self, to: &mut Vec<u8>) {
        match self {
            Op::Write { offset, data } => write_into(to, *offset, data),
            Op::SetLen(len) => to.resize(*len as usize, 0),
        }
    }

    fn bytes(&self) -> u64 {
        match self {
            Op::Write { data, .. } => data.len() as u64,
            Op::SetLen(_) => 0,
        }
    }
}

fn write_into(to: &mut Vec<u8>, offset: u64, data: &[u8]) {
    let end = offset as usize + data.len();
    if to.len() < end {
        to.resize(end, 0);
    }
    to[offset as usize..end].copy_from_slice(data);
}

#[derive(Debug)]
enum Kind {
    File {
        current: Vec<u8>,
        durable: Vec<u8>,
        /// What turns `durable` into `current`, oldest first.
        pending: Vec<Op>,
    },
    Dir {
        current: BTreeMap<OsString, u64>,
        durable: BTreeMap<OsString, u64>,
    },
}

#[derive(Debug)]
struct Node {
    kind: Kind,
    perm: u16,
    uid: u32,
    gid: u32,
    atime: SystemTime,
    mtime: SystemTime,
    ctime: SystemTime,
}

impl Node {
    fn new(kind: Kind, perm: u16, uid: u32, gid: u32) -> Node {
        let now = SystemTime::now();
        Node {
            kind,
            perm,
            uid,
            gid,
            atime: now,
            mtime: now,
            ctime: now,
        }
    }

    fn is_dir(&self) -> bool {
        matches!(self.kind, Kind::Dir { .. })
    }
}

/// What a power cut threw away.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CutReport {
    /// Files whose content went back to an older image.
    pub files_reverted: usize,
    /// Bytes written since their file's last sync and lost.
    pub bytes_lost: u64,
    /// Directories whose entries went back to their last synced list.
    pub dirs_reverted: usize,
}

#[derive(Debug)]
struct State {
    nodes: HashMap<u64, Node>,
    next_ino: u64,
    /// The size `statfs` reports and past which a file cannot grow
    /// (ENOSPC); [`TOTAL_BYTES`] unless set ([`LossyFs::set_capacity`]).
    capacity: Option<u64>,
}

impl State {
    fn new() -> State {
        let mut nodes = HashMap::new();
        let root = Node::new(
            Kind::Dir {
                current: BTreeMap::new(),
                durable: BTreeMap::new(),
            },
            0o755,
            // SAFETY: getuid/getgid cannot fail and touch no memory.
            unsafe { libc::getuid() },
            unsafe { libc::getgid() },
        );
        nodes.insert(ROOT, root);
        State {
            nodes,
            next_ino: 2,
            capacity: None,
        }
    }

    fn attr(&self, ino: u64) -> Option<FileAttr> {
        let n = self.nodes.get(&ino)?;
        let (kind, size, nlink) = match &n.kind {
            Kind::File { current, .. } => (FileType::RegularFile, current.len() as u64, 1),
            Kind::Dir { current, .. } => {
                let subdirs = current
                    .values()
                    .filter(|c| self.nodes.get(c).is_some_and(Node::is_dir))
                    .count() as u32;
                (FileType::Directory, BLOCK, 2 + subdirs)
            }
        };
        Some(FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: n.atime,
            mtime: n.mtime,
            ctime: n.ctime,
            crtime: n.ctime,
            kind,
            perm: n.perm,
            nlink,
            uid: n.uid,
            gid: n.gid,
            rdev: 0,
            blksize: BLOCK as u32,
            flags: 0,
        })
    }

    fn dir(&self, ino: u64) -> Result<&BTreeMap<OsString, u64>, Errno> {
        match self.nodes.get(&ino).map(|n| &n.kind) {
            Some(Kind::Dir { current, .. }) => Ok(current),
            Some(_) => Err(Errno::ENOTDIR),
            None => Err(Errno::ENOENT),
        }
    }

    fn dir_mut(&mut self, ino: u64) -> Result<&mut BTreeMap<OsString, u64>, Errno> {
        let n = self.nodes.get_mut(&ino).ok_or(Errno::ENOENT)?;
        n.mtime = SystemTime::now();
        n.ctime = n.mtime;
        match &mut n.kind {
            Kind::Dir { current, .. } => Ok(current),
            _ => Err(Errno::ENOTDIR),
        }
    }

    fn lookup(&self, parent: u64, name: &OsStr) -> Result<u64, Errno> {
        self.dir(parent)?.get(name).copied().ok_or(Errno::ENOENT)
    }

    /// Adds a new node named `name` in `parent`.
    fn add(&mut self, parent: u64, name: &OsStr, kind: Kind, perm: u16, req: &Request) -> Result<u64, Errno> {
        if name.len() > 255 {
            return Err(Errno::ENAMETOOLONG);
        }
        if self.dir(parent)?.contains_key(name) {
            return Err(Errno::EEXIST);
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        self.nodes.insert(ino, Node::new(kind, perm, req.uid(), req.gid()));
        self.dir_mut(parent)?.insert(name.to_owned(), ino);
        Ok(ino)
    }

    fn file_op(&mut self, ino: u64, op: Op) -> Result<(), Errno> {
        let n = self.nodes.get_mut(&ino).ok_or(Errno::ENOENT)?;
        match &mut n.kind {
            Kind::File { current, pending, .. } => {
                op.apply(current);
                pending.push(op);
                n.mtime = SystemTime::now();
                n.ctime = n.mtime;
                Ok(())
            }
            Kind::Dir { .. } => Err(Errno::EISDIR),
        }
    }

    /// fsync of `ino`: a file's content, or a directory's entries.
    fn sync(&mut self, ino: u64) -> Result<(), Errno> {
        match &mut self.nodes.get_mut(&ino).ok_or(Errno::ENOENT)?.kind {
            Kind::File {
                current,
                durable,
                pending,
            } => {
                for op in pending.drain(..) {
                    op.apply(durable);
                }
                debug_assert!(durable == current);
            }
            Kind::Dir { current, durable } => *durable = current.clone(),
        }
        Ok(())
    }

    fn sync_everything(&mut self) {
        let inos: Vec<u64> = self.nodes.keys().copied().collect();
        for ino in inos {
            let _ = self.sync(ino);
        }
    }

    /// The cut: each file keeps its durable image plus, with `torn`, a
    /// prefix of its pending writes chosen by `torn`; each directory its
    /// durable entries; unreachable nodes are freed.
    fn cut(&mut self, mut torn: Option<&mut Rng>) -> CutReport {
        let mut report = CutReport::default();
        // Only what the namespace shows counts in the report: an unlinked
        // file's lost writes (a deleted scratch file) were lost anyway.
        let visible = self.reachable();
        let mut inos: Vec<u64> = self.nodes.keys().copied().collect();
        // The same seed keeps the same writes, whatever the map's order.
        inos.sort_unstable();
        for ino in inos {
            let n = self.nodes.get_mut(&ino).expect("listed");
            match &mut n.kind {
                Kind::File {
                    current,
                    durable,
                    pending,
                } => {
                    if pending.is_empty() {
                        continue;
                    }
                    let ops = std::mem::take(pending);
                    let mut image = durable.clone();
                    let mut kept = 0u64;
                    if let Some(rng) = torn.as_deref_mut() {
                        let whole = rng.below(ops.len() as u64 + 1) as usize;
                        for op in &ops[..whole] {
                            op.apply(&mut image);
                            kept += op.bytes();
                        }
                        if let Some(Op::Write { offset, data }) = ops.get(whole) {
                            let part = rng.below(data.len() as u64 + 1) as usize;
                            write_into(&mut image, *offset, &data[..part]);
                            kept += part as u64;
                        }
                    }
                    let all: u64 = ops.iter().map(Op::bytes).sum();
                    if visible.contains(&ino) {
                        report.bytes_lost += all - kept;
                        if image != *current {
                            report.files_reverted += 1;
                        }
                    }
                    // What reached the disk is on the disk, synced or not.
                    *durable = image.clone();
                    *current = image;
                }
                Kind::Dir { current, durable } => {
                    if current != durable {
                        report.dirs_reverted += 1;
                        *current = durable.clone();
                    }
                }
            }
        }
        // Free what the durable namespace (now the current one) no longer
        // reaches.
        let reached = self.reachable();
        self.nodes.retain(|ino, _| reached.contains(ino));
        report
    }

    /// The nodes reachable from the root through the current entries.
    fn reachable(&self) -> std::collections::HashSet<u64> {
        let mut reached = std::collections::HashSet::new();
        let mut stack = vec![ROOT];
        while let Some(ino) = stack.pop() {
            if !reached.insert(ino) {
                continue;
            }
            if let Some(Kind::Dir { current, .. }) = self.nodes.get(&ino).map(|n| &n.kind) {
                stack.extend(current.values().copied());
            }
        }
        reached
    }

    /// What the files and directories the current namespace reaches take,
    /// in whole blocks (an unlinked file's node is kept until the cut, in
    /// case its entry comes back, but it takes no room: `df` after `rm`).
    fn used_bytes(&self) -> u64 {
        let mut used = 0;
        let mut seen = std::collections::HashSet::new();
        let mut stack = vec![ROOT];
        while let Some(ino) = stack.pop() {
            if !seen.insert(ino) {
                continue;
            }
            match self.nodes.get(&ino).map(|n| &n.kind) {
                Some(Kind::File { current, .. }) => used += (current.len() as u64).div_ceil(BLOCK) * BLOCK,
                Some(Kind::Dir { current, .. }) => {
                    used += BLOCK;
                    stack.extend(current.values().copied());
                }
                None => {}
            }
        }
        used
    }

    fn total_bytes(&self) -> u64 {
        self.capacity.unwrap_or(TOTAL_BYTES)
    }

    /// ENOSPC when file `ino` growing to `new_len` bytes would take more
    /// than the capacity set (only a set capacity is checked: the default
    /// is never reached by a test).
    fn room_for(&self, ino: u64, new_len: u64) -> Result<(), Errno> {
        let Some(cap) = self.capacity else {
            return Ok(());
        };
        let Some(Kind::File { current, .. }) = self.nodes.get(&ino).map(|n| &n.kind) else {
            return Ok(());
        };
        let blocks = |len: u64| len.div_ceil(BLOCK) * BLOCK;
        let grow = blocks(new_len).saturating_sub(blocks(current.len() as u64));
        if grow > 0 && self.used_bytes() + grow > cap {
            return Err(Errno::ENOSPC);
        }
        Ok(())
    }

    fn len_of(&self, ino: u64) -> u64 {
        match self.nodes.get(&ino).map(|n| &n.kind) {
            Some(Kind::File { current, .. }) => current.len() as u64,
            _ => 0,
        }
    }
}

/// A small deterministic generator (splitmix64) for torn cuts.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        z % n.max(1)
    }
}

/// The FUSE side: every call takes the one lock.
struct Fs {
    state: Arc<Mutex<State>>,
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|p| p.into_inner())
}

impl Fs {
    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }
}

/// Every open file bypasses the page cache (see the crate docs).
fn open_flags() -> FopenFlags {
    FopenFlags::FOPEN_DIRECT_IO
}

fn perm_of(mode: u32, umask: u32) -> u16 {
    (mode & !umask & 0o7777) as u16
}

impl Filesystem for Fs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let s = self.state();
        match s.lookup(parent.0, name).map(|ino| s.attr(ino)) {
            Ok(Some(attr)) => reply.entry(&TTL, &attr, Generation(0)),
            Ok(None) => reply.error(Errno::ENOENT),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.state().attr(ino.0) {
            Some(attr) => reply.attr(&TTL, &attr),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let mut s = self.state();
        if let Some(len) = size {
            if let Err(e) = s.room_for(ino.0, len).and_then(|()| s.file_op(ino.0, Op::SetLen(len))) {
                return reply.error(e);
            }
        }
        let Some(n) = s.nodes.get_mut(&ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        let at = |t: TimeOrNow| match t {
            TimeOrNow::SpecificTime(t) => t,
            TimeOrNow::Now => SystemTime::now(),
        };
        if let Some(m) = mode {
            n.perm = (m & 0o7777) as u16;
        }
        if let Some(u) = uid {
            n.uid = u;
        }
        if let Some(g) = gid {
            n.gid = g;
        }
        if let Some(t) = atime {
            n.atime = at(t);
        }
        if let Some(t) = mtime {
            n.mtime = at(t);
        }
        n.ctime = SystemTime::now();
        let attr = s.attr(ino.0).expect("present");
        reply.attr(&TTL, &attr);
    }

    fn mkdir(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, reply: ReplyEntry) {
        let mut s = self.state();
        let kind = Kind::Dir {
            current: BTreeMap::new(),
            durable: BTreeMap::new(),
        };
        match s.add(parent.0, name, kind, perm_of(mode, umask), req) {
            Ok(ino) => reply.entry(&TTL, &s.attr(ino).expect("added"), Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        if mode & libc::S_IFMT != libc::S_IFREG {
            return reply.error(Errno::EPERM);
        }
        let mut s = self.state();
        match s.add(parent.0, name, new_file(), perm_of(mode, umask), req) {
            Ok(ino) => reply.entry(&TTL, &s.attr(ino).expect("added"), Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let mut s = self.state();
        match s.add(parent.0, name, new_file(), perm_of(mode, umask), req) {
            Ok(ino) => reply.created(
                &TTL,
                &s.attr(ino).expect("added"),
                Generation(0),
                FileHandle(0),
                open_flags(),
            ),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let mut s = self.state();
        match s.lookup(parent.0, name) {
            Ok(ino) if s.nodes.get(&ino).is_some_and(Node::is_dir) => reply.error(Errno::EISDIR),
            Ok(_) => {
                // The node stays until the cut: an open descriptor may still
                // use it, and its durable entry (if any) comes back then.
                s.dir_mut(parent.0).expect("a dir").remove(name);
                reply.ok()
            }
            Err(e) => reply.error(e),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let mut s = self.state();
        match s.lookup(parent.0, name) {
            Ok(ino) => match s.dir(ino) {
                Ok(d) if !d.is_empty() => reply.error(Errno::ENOTEMPTY),
                Ok(_) => {
                    s.dir_mut(parent.0).expect("a dir").remove(name);
                    reply.ok()
                }
                Err(e) => reply.error(e),
            },
            Err(e) => reply.error(e),
        }
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let mut s = self.state();
        let res = (|| -> Result<(), Errno> {
            let ino = s.lookup(parent.0, name)?;
            s.dir(newparent.0)?;
            let target = s.dir(newparent.0)?.get(newname).copied();
            if flags.contains(RenameFlags::RENAME_EXCHANGE) {
                let other = target.ok_or(Errno::ENOENT)?;
                s.dir_mut(parent.0)?.insert(name.to_owned(), other);
                s.dir_mut(newparent.0)?.insert(newname.to_owned(), ino);
                return Ok(());
            }
            if !(flags - RenameFlags::RENAME_NOREPLACE).is_empty() {
                return Err(Errno::EINVAL);
            }
            if let Some(t) = target {
                if t == ino {
                    return Ok(());
                }
                if flags.contains(RenameFlags::RENAME_NOREPLACE) {
                    return Err(Errno::EEXIST);
                }
                let moving_dir = s.nodes.get(&ino).is_some_and(Node::is_dir);
                match s.dir(t) {
                    Ok(d) if !moving_dir => {
                        let _ = d;
                        return Err(Errno::EISDIR);
                    }
                    Ok(d) if !d.is_empty() => return Err(Errno::ENOTEMPTY),
                    Ok(_) => {}
                    Err(_) if moving_dir => return Err(Errno::ENOTDIR),
                    Err(_) => {}
                }
            }
            s.dir_mut(parent.0)?.remove(name);
            s.dir_mut(newparent.0)?.insert(newname.to_owned(), ino);
            Ok(())
        })();
        match res {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let s = self.state();
        match s.nodes.get(&ino.0) {
            Some(n) if n.is_dir() => reply.error(Errno::EISDIR),
            Some(_) => {
                // O_TRUNC reaches the filesystem as a setattr of the size.
                let _ = flags;
                reply.opened(FileHandle(0), open_flags())
            }
            None => reply.error(Errno::ENOENT),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let s = self.state();
        match s.nodes.get(&ino.0).map(|n| &n.kind) {
            Some(Kind::File { current, .. }) => {
                let start = (offset as usize).min(current.len());
                let end = (start + size as usize).min(current.len());
                reply.data(&current[start..end])
            }
            Some(Kind::Dir { .. }) => reply.error(Errno::EISDIR),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let mut s = self.state();
        let end = offset + data.len() as u64;
        if end > TOTAL_BYTES {
            return reply.error(Errno::EFBIG);
        }
        if let Err(e) = s.room_for(ino.0, end.max(s.len_of(ino.0))) {
            return reply.error(e);
        }
        let op = Op::Write {
            offset,
            data: data.to_vec(),
        };
        match s.file_op(ino.0, op) {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(e),
        }
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        // close(2) makes nothing durable.
        reply.ok()
    }

    fn fsync(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        match self.state().sync(ino.0) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.state().dir(ino.0) {
            Ok(_) => reply.opened(FileHandle(0), FopenFlags::empty()),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let s = self.state();
        let dir = match s.dir(ino.0) {
            Ok(d) => d,
            Err(e) => return reply.error(e),
        };
        let mut all: Vec<(u64, FileType, OsString)> = vec![
            (ino.0, FileType::Directory, ".".into()),
            (ino.0, FileType::Directory, "..".into()),
        ];
        for (name, child) in dir {
            let kind = if s.nodes.get(child).is_some_and(Node::is_dir) {
                FileType::Directory
            } else {
                FileType::RegularFile
            };
            all.push((*child, kind, name.clone()));
        }
        for (i, (child, kind, name)) in all.into_iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(child), i as u64 + 1, kind, &name) {
                break;
            }
        }
        reply.ok()
    }

    fn fsyncdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        match self.state().sync(ino.0) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let s = self.state();
        let blocks = s.total_bytes() / BLOCK;
        let free = blocks.saturating_sub(s.used_bytes() / BLOCK);
        let files = 1 << 20;
        let ffree = files - (s.nodes.len() as u64).min(files);
        reply.statfs(blocks, free, free, files, ffree, BLOCK as u32, 255, BLOCK as u32);
    }

    fn access(&self, _req: &Request, ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        if self.state().nodes.contains_key(&ino.0) {
            reply.ok()
        } else {
            reply.error(Errno::ENOENT)
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let mut s = self.state();
        let size = match s.nodes.get(&ino.0).map(|n| &n.kind) {
            Some(Kind::File { current, .. }) => current.len() as u64,
            Some(_) => return reply.error(Errno::EISDIR),
            None => return reply.error(Errno::ENOENT),
        };
        let end = offset + length;
        let keep_size = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
        let zero = mode & (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE) != 0;
        if mode & !(libc::FALLOC_FL_KEEP_SIZE | libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE) != 0 {
            return reply.error(Errno::EOPNOTSUPP);
        }
        let mut ops = Vec::new();
        if zero && offset < size {
            let to = if keep_size { end.min(size) } else { end };
            ops.push(Op::Write {
                offset,
                data: vec![0; (to - offset) as usize],
            });
        }
        if !keep_size && end > size {
            if let Err(e) = s.room_for(ino.0, end) {
                return reply.error(e);
            }
            ops.push(Op::SetLen(end));
        }
        for op in ops {
            if let Err(e) = s.file_op(ino.0, op) {
                return reply.error(e);
            }
        }
        reply.ok()
    }
}

fn new_file() -> Kind {
    Kind::File {
        current: Vec::new(),
        durable: Vec::new(),
        pending: Vec::new(),
    }
}

/// A mounted lossy filesystem; unmounted when dropped.
pub struct LossyFs {
    mountpoint: PathBuf,
    state: Arc<Mutex<State>>,
    session: Option<BackgroundSession>,
}

impl std::fmt::Debug for LossyFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LossyFs").field("mountpoint", &self.mountpoint).finish()
    }
}

/// Why a mount could not be had here (no /dev/fuse, or no right to
/// mount): the cases [`mount_or_skip`] skips on.
pub fn unavailable_reason(e: &io::Error) -> Option<String> {
    if !Path::new("/dev/fuse").exists() {
        return Some("/dev/fuse is missing (no FUSE in this kernel or container)".into());
    }
    match e.raw_os_error() {
        Some(libc::EPERM) | Some(libc::EACCES) => Some(format!("not allowed to mount a FUSE filesystem: {e}")),
        Some(libc::ENODEV) | Some(libc::ENXIO) => Some(format!("FUSE is not usable here: {e}")),
        _ if e.kind() == io::ErrorKind::NotFound => Some(format!("cannot mount: {e}")),
        _ => None,
    }
}

impl LossyFs {
    /// Mounts an empty lossy filesystem on the existing empty directory
    /// `mountpoint`, served by a background thread of this process. The
    /// empty root is durable.
    pub fn mount(mountpoint: &Path) -> io::Result<LossyFs> {
        Self::mount_named(mountpoint, "dtx-lossyfs")
    }

    /// [`LossyFs::mount`] with `source` as the mount's source name (the
    /// first field of its line in /proc/mounts), so that whoever mounts
    /// several can find the ones a process killed outright left behind.
    pub fn mount_named(mountpoint: &Path, source: &str) -> io::Result<LossyFs> {
        if !Path::new("/dev/fuse").exists() {
            return Err(io::Error::new(io::ErrorKind::NotFound, "/dev/fuse is missing"));
        }
        let state = Arc::new(Mutex::new(State::new()));
        let fs = Fs { state: state.clone() };
        let mut config = fuser::Config::default();
        config.mount_options = vec![
            fuser::MountOption::FSName(source.into()),
            fuser::MountOption::Subtype("dtx-lossyfs".into()),
            fuser::MountOption::RW,
        ];
        // The node processes run as the same user (root in CI); allow
        // others only where the mounter may (root).
        // SAFETY: geteuid cannot fail and touches no memory.
        if unsafe { libc::geteuid() } == 0 {
            config.acl = fuser::SessionACL::All;
        }
        let session = fuser::spawn_mount(fs, mountpoint, &config)?;
        Ok(LossyFs {
            mountpoint: mountpoint.canonicalize()?,
            state,
            session: Some(session),
        })
    }

    /// The mount's root.
    pub fn path(&self) -> &Path {
        &self.mountpoint
    }

    /// The power cut: everything not durable is thrown away, so the mount
    /// shows exactly the durable state (crate docs). Kill the processes
    /// using the mount with SIGKILL first.
    pub fn power_cut(&self) -> CutReport {
        lock(&self.state).cut(None)
    }

    /// A power cut during writes: each file keeps, beyond its durable
    /// image, a prefix (chosen by `seed`) of the writes made since its last
    /// sync, in order, the last kept one possibly cut short; directories go
    /// back to their durable entries as with [`LossyFs::power_cut`].
    pub fn power_cut_torn(&self, seed: u64) -> CutReport {
        let mut rng = Rng(seed);
        lock(&self.state).cut(Some(&mut rng))
    }

    /// Makes everything durable, as `sync(1)` would: for setting up a test
    /// (files it placed before the processes under test start).
    pub fn sync_everything(&self) {
        lock(&self.state).sync_everything()
    }

    /// Sets the filesystem's size: `statfs` reports it, and a write,
    /// truncate or fallocate that would make the files the namespace
    /// reaches take more fails with ENOSPC (nothing is written). `None`
    /// (the default) is a roomy 16 GiB. For a full-disk fault on a lossy
    /// mount: lower it to what is in use plus a margin, fill the margin.
    pub fn set_capacity(&self, bytes: Option<u64>) {
        lock(&self.state).capacity = bytes;
    }

    /// Bytes the files and directories the namespace reaches take, in
    /// whole 4 KiB blocks (what `statfs` counts as used).
    pub fn used_bytes(&self) -> u64 {
        lock(&self.state).used_bytes()
    }

    /// Bytes written and not yet synced, over the files the namespace
    /// reaches (a deleted file's are not counted; 0 when a cut now would
    /// lose no data).
    pub fn unsynced_bytes(&self) -> u64 {
        let s = lock(&self.state);
        s.reachable()
            .iter()
            .filter_map(|ino| s.nodes.get(ino))
            .map(|n| match &n.kind {
                Kind::File { pending, .. } => pending.iter().map(Op::bytes).sum(),
                Kind::Dir { .. } => 0,
            })
            .sum()
    }
}

impl Drop for LossyFs {
    fn drop(&mut self) {
        // Detach first: a busy mount (a descriptor still open somewhere)
        // goes away from the namespace now and is freed when let go.
        if let Ok(c) = CString::new(self.mountpoint.as_os_str().as_bytes()) {
            // SAFETY: umount2(2) on a valid NUL-terminated path.
            unsafe {
                libc::umount2(c.as_ptr(), libc::MNT_DETACH);
            }
        }
        // Its own unmount then finds nothing mounted; the serving thread
        // ends when the kernel closes the connection.
        drop(self.session.take());
    }
}

/// For tests: mounts on `mountpoint`, or, when FUSE cannot be had here and
/// [`REQUIRE_ENV`] is not `1`, says loudly that `test` is skipped and
/// returns `None`. Any other failure panics.
pub fn mount_or_skip(test: &str, mountpoint: &Path) -> Option<LossyFs> {
    match LossyFs::mount(mountpoint) {
        Ok(fs) => Some(fs),
        Err(e) => match unavailable_reason(&e) {
            Some(why) if std::env::var(REQUIRE_ENV).as_deref() != Ok("1") => {
                eprintln!(
                    "\n*** {test} SKIPPED: {why}\n*** (it needs /dev/fuse and the right to mount, root in CI; {REQUIRE_ENV}=1 makes this a failure)\n"
                );
                None
            }
            _ => panic!(
                "{test}: could not mount the lossy filesystem on {}: {e}",
                mountpoint.display()
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torn_cut_keeps_a_prefix_of_the_writes_in_order() {
        let mut s = State::new();
        s.nodes.insert(9, Node::new(new_file(), 0o644, 0, 0));
        s.dir_mut(ROOT).unwrap().insert("f".into(), 9);
        s.sync(ROOT).unwrap();
        s.file_op(
            9,
            Op::Write {
                offset: 0,
                data: b"abc".to_vec(),
            },
        )
        .unwrap();
        s.sync(9).unwrap();
        for chunk in [b"def", b"ghi", b"jkl"] {
            let at = match &s.nodes[&9].kind {
                Kind::File { current, .. } => current.len() as u64,
                _ => unreachable!(),
            };
            s.file_op(
                9,
                Op::Write {
                    offset: at,
                    data: chunk.to_vec(),
                },
            )
            .unwrap();
        }
        let mut seen = std::collections::HashSet::new();
        for seed in 0..64 {
            let mut t = State::new();
            t.nodes = s.nodes.iter().map(|(k, v)| (*k, clone_node(v))).collect();
            t.cut(Some(&mut Rng(seed)));
            let Kind::File { current, .. } = &t.nodes[&9].kind else {
                unreachable!()
            };
            assert!(b"abcdefghijkl".starts_with(current), "{current:?}");
            assert!(current.len() >= 3);
            seen.insert(current.len());
        }
        assert!(seen.len() > 3, "different seeds keep different prefixes: {seen:?}");
    }

    fn clone_node(n: &Node) -> Node {
        let kind = match &n.kind {
            Kind::File {
                current,
                durable,
                pending,
            } => Kind::File {
                current: current.clone(),
                durable: durable.clone(),
                pending: pending.clone(),
            },
            Kind::Dir { current, durable } => Kind::Dir {
                current: current.clone(),
                durable: durable.clone(),
            },
        };
        Node::new(kind, n.perm, n.uid, n.gid)
    }
}
