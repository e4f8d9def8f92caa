//! The saga demo as a test: `dtx-dev demo --saga`, the order saga over
//! three step services and the outside world they call (a payment provider
//! that loses its replies, a mail server that is busy) with the leader
//! killed by SIGKILL every 3 s, and a step service in between (restarted a
//! second later). It does not run at the same time as the other demos
//! (`common::DEMO_LOCK`). The audit must pass (stock and money conserved,
//! every completed order reserved, charged and confirmed exactly once,
//! every compensated order holding nothing and never charged, no duplicate
//! forward action), and the summary must show both endings and lost replies
//! settled by the status query.

use crate::common;

#[test]
fn t112_saga_demo_passes_its_audit_under_leader_kills() {
    let stdout = common::run_demo_audited(&["--saga", "--seconds", "10", "--kill-every-secs", "3", "--clients", "4"]);
    assert!(stdout.contains("kill -9 leader"), "no leader was killed: {stdout}");
    assert!(
        stdout.contains("kill -9 step service"),
        "no step service was killed: {stdout}"
    );
    let completed = common::summary_count(&stdout, "completed");
    let compensated = common::summary_count(&stdout, "compensated");
    let reconciled = common::summary_count(&stdout, "lost replies reconciled");
    let started = common::summary_count(&stdout, "sagas started");
    assert!(completed > 0, "no order completed: {stdout}");
    assert!(
        compensated > 0,
        "no order compensated (about 15% are unpayable or out of stock): {stdout}"
    );
    assert!(
        reconciled > 0,
        "the payment provider loses 20% of its replies, yet none was reconciled: {stdout}"
    );
    let parked = common::summary_count(&stdout, "parked");
    assert_eq!(
        completed + compensated + parked,
        started,
        "every saga ends or parks: {stdout}"
    );
}
