//! A policy's pins ([`corepack::pin_thread`]) beside a running packer, on real threads
//! (a test binary of its own: the packer moves every thread of the process).

mod common;

use common::{affinity, wait_for};
use corepack::{allowed_cpus, pin_thread, CorePacker, PackConfig, PolicyConfig};
use std::sync::mpsc;
use std::time::Duration;

#[test]
fn a_policy_pin_is_narrowed_while_packed_and_is_the_mask_given_back() {
    let all = allowed_cpus();
    if all.len() < 2 {
        eprintln!("one CPU: nothing to pack");
        return;
    }
    let (first, last) = (all[0], *all.last().unwrap());
    let (id_tx, id_rx) = mpsc::channel();
    let (end_tx, end_rx) = mpsc::channel::<()>();
    let worker = std::thread::spawn(move || {
        corepack::allow_repin_current_thread();
        // SAFETY: no arguments, cannot fail.
        id_tx.send(unsafe { libc::gettid() }).unwrap();
        let _ = end_rx.recv();
    });
    let tid = id_rx.recv().unwrap();

    // No packer: a plain pin.
    pin_thread(tid, &[last]).unwrap();
    assert_eq!(affinity(tid), vec![last]);
    assert!(pin_thread(tid, &[]).is_err(), "an empty set is refused");
    assert!(
        pin_thread(tid, &[libc::CPU_SETSIZE as usize]).is_err(),
        "a CPU beyond the set is refused"
    );
    assert_eq!(affinity(tid), vec![last], "a refused pin changes nothing");

    let packer = CorePacker::start(PackConfig {
        interval: Duration::from_millis(1),
        policy: PolicyConfig {
            grow_busy: f64::INFINITY,
            shrink_busy: f64::INFINITY,
            shrink_after: Duration::from_millis(5),
            ..PolicyConfig::default()
        },
        cpus: None,
    })
    .unwrap();
    wait_for("one active CPU", || packer.stats().active == 1);
    wait_for("the worker packed", || affinity(tid) == vec![first]);

    // Pins while packed land on the active CPU at once, and race the packer's passes
    // (one a millisecond): the last one is the worker's own mask whatever the order.
    for i in 0..2000 {
        let cpus = if i % 2 == 0 { vec![first] } else { vec![last] };
        pin_thread(tid, &cpus).unwrap();
        assert_eq!(
            affinity(tid),
            vec![first],
            "pin {i} narrowed to the active CPU"
        );
    }
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(affinity(tid), vec![first], "still packed after the passes");
    assert!(packer.stats().affinity_errors == 0, "{:?}", packer.stats());

    packer.stop();
    assert_eq!(
        affinity(tid),
        vec![last],
        "the last pin is the mask given back"
    );
    end_tx.send(()).unwrap();
    worker.join().unwrap();
}
