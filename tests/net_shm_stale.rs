//! A process killed with open shm endpoints leaves `/dev/shm/<pid>:<n>:<m>` behind; a later
//! process that gets the same pid must still open shm endpoints (libfabric's shm provider fails
//! with -EBUSY on an existing name).

use mscclpp::transport::net;

#[test]
fn shm_endpoint_opens_despite_a_stale_file_with_our_pid() {
    let stale = format!("/dev/shm/{}:0:0", std::process::id());
    if std::fs::write(&stale, b"left by a dead process").is_err() {
        println!("SKIPPED: cannot write {stale}");
        return;
    }
    // The first endpoint of this process: the stale name must not stop it.
    let ep = net::open(None, true, None);
    let removed = !std::path::Path::new(&stale).exists()
        || std::fs::read(&stale)
            .map(|b| b != b"left by a dead process")
            .unwrap_or(true);
    let _ = std::fs::remove_file(&stale);
    let ep = ep.expect("opening an shm endpoint with a stale name of our pid");
    assert!(ep.describe().contains("shm"), "{}", ep.describe());
    assert!(removed, "the stale file was neither removed nor replaced");
}
