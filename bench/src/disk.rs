//! The disk's fsync rate, measured by the bench itself in the same run, so
//! its ratios mean something on any machine.

use std::io::Write;
use std::time::Instant;

use crate::report::stats;
use crate::report::Stats;

/// Single-threaded fsync rate of the disk under `dir`: write 512 bytes at
/// the end of a file and `fdatasync`, `n` times; and the same through sled
/// (insert + flush), the store the nodes use.
pub fn measure_fsync(dir: &std::path::Path, n: usize) -> anyhow::Result<(Stats, Stats)> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join("fsync-probe.bin");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(&path)?;
    let buf = [7u8; 512];
    let mut lat = Vec::with_capacity(n);
    let start = Instant::now();
    for _ in 0..n {
        let t = Instant::now();
        f.write_all(&buf)?;
        f.sync_data()?;
        lat.push(t.elapsed().as_micros() as u64);
    }
    let raw = stats(lat, start.elapsed());
    drop(f);
    let _ = std::fs::remove_file(&path);

    let sled_dir = dir.join("fsync-probe-sled");
    let _ = std::fs::remove_dir_all(&sled_dir);
    let db = sled::Config::new().path(&sled_dir).flush_every_ms(None).open()?;
    // As the stores flush: sled's flush, then the fsync it leaves out.
    let sync = dtx_durable::DirSync::open(&sled_dir)?;
    let mut lat = Vec::with_capacity(n);
    let start = Instant::now();
    for i in 0..n as u64 {
        let t = Instant::now();
        db.insert(i.to_be_bytes(), &buf[..])?;
        sync.flush(&db)?;
        lat.push(t.elapsed().as_micros() as u64);
    }
    let sled_stats = stats(lat, start.elapsed());
    drop(db);
    let _ = std::fs::remove_dir_all(&sled_dir);
    Ok((raw, sled_stats))
}
