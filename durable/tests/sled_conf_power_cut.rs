//! sled 0.34 writes its `conf` file (a new directory's, or after finding it
//! empty) with two writes and no fsync. A power cut that keeps part of it
//! leaves a file sled refuses to open ("failed to parse minor version
//! value"): the node or store never starts again on that directory.
//! Found by the jepsen `power-cut` nemesis (torn cut).
use dtx_lossyfs::mount_or_skip;

#[test]
fn sled_conf_survives_a_torn_cut_after_dir_sync_open() {
    let mnt = tempfile::tempdir().unwrap();
    let Some(fs) = mount_or_skip("sled_conf_survives_a_torn_cut_after_dir_sync_open", mnt.path()) else {
        return;
    };
    let dir = fs.path().join("db");
    std::fs::create_dir(&dir).unwrap();
    std::fs::File::open(fs.path()).unwrap().sync_all().unwrap();
    for seed in 0..16u64 {
        {
            let db = sled::Config::new().path(&dir).flush_every_ms(None).open().unwrap();
            let s = dtx_durable::DirSync::open(&dir).unwrap();
            db.insert(b"k", &b"v"[..]).unwrap();
            s.flush(&db).unwrap();
        }
        // The first cut leaves an empty conf (sled rewrites it at the next
        // open); the torn one keeps a part of that rewrite.
        fs.power_cut();
        {
            let db = sled::Config::new().path(&dir).flush_every_ms(None).open().unwrap();
            let _s = dtx_durable::DirSync::open(&dir).unwrap();
            drop(db);
        }
        fs.power_cut_torn(seed);
        let conf = std::fs::read(dir.join("conf")).unwrap();
        let db = sled::Config::new().path(&dir).flush_every_ms(None).open();
        assert!(
            db.is_ok(),
            "seed {seed}: sled does not open after a torn cut; conf is {} bytes: {:?}",
            conf.len(),
            db.err()
        );
        let db = db.unwrap();
        assert_eq!(db.get(b"k").unwrap().as_deref(), Some(&b"v"[..]), "seed {seed}");
    }
}
