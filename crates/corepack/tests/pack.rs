//! The packer on this process's real threads (its own test binary: it moves every
//! thread of the process).

mod common;

use common::{affinity, wait_for};
use corepack::{allowed_cpus, CorePacker, PackConfig, PolicyConfig};
use std::sync::mpsc;
use std::time::Duration;

/// A thread that reports its id and waits until told to end.
fn thread(setup: fn()) -> (i32, mpsc::Sender<()>, std::thread::JoinHandle<()>) {
    let (id_tx, id_rx) = mpsc::channel();
    let (end_tx, end_rx) = mpsc::channel::<()>();
    let h = std::thread::spawn(move || {
        setup();
        // SAFETY: no arguments, cannot fail.
        id_tx.send(unsafe { libc::gettid() }).unwrap();
        let _ = end_rx.recv();
    });
    (id_rx.recv().unwrap(), end_tx, h)
}

#[test]
fn packed_threads_meet_on_the_first_cpu_and_get_their_masks_back() {
    let all = allowed_cpus();
    if all.len() < 2 {
        eprintln!("one CPU: nothing to pack");
        return;
    }
    let first = all[0];
    let last = *all.last().unwrap();
    let (plain, plain_end, plain_h) = thread(|| {});
    let (data, data_end, data_h) = thread(corepack::exclude_current_thread);
    // Pinned to the last CPU by a policy of the process (as SC's pool pins workers).
    let (worker, worker_end, worker_h) = thread(corepack::allow_repin_current_thread);
    set(worker, &[last]);
    // Pinned to the last CPU from outside (an operator's taskset).
    let (outside, outside_end, outside_h) = thread(|| {});
    set(outside, &[last]);

    // Thresholds that shrink at any load and never grow: the decision is the policy
    // tests'; this is the threads.
    let packer = CorePacker::start(PackConfig {
        interval: Duration::from_millis(10),
        policy: PolicyConfig {
            grow_busy: f64::INFINITY,
            shrink_busy: f64::INFINITY,
            shrink_after: Duration::from_millis(20),
            ..PolicyConfig::default()
        },
        cpus: None,
    })
    .unwrap();
    assert!(
        matches!(
            CorePacker::start(PackConfig::default()),
            Err(corepack::PackError::Running)
        ),
        "a second packer is refused"
    );
    wait_for("one active CPU", || packer.stats().active == 1);
    wait_for("the plain thread on the first CPU", || {
        affinity(plain) == vec![first]
    });
    wait_for("the repinnable worker on the first CPU", || {
        affinity(worker) == vec![first]
    });
    assert_eq!(affinity(data), all, "an excluded thread is never moved");
    assert_eq!(affinity(outside), vec![last], "an outside pin wins");
    let s = packer.stats();
    assert_eq!(s.cpus, all.len());
    assert!(s.shrinks >= 1 && s.grows == 0, "{s:?}");
    assert!(s.managed_threads >= 3, "{s:?}");

    // A thread started while packed is packed too.
    let (late, late_end, late_h) = thread(|| {});
    wait_for("a new thread packed", || affinity(late) == vec![first]);

    packer.stop();
    assert_eq!(affinity(plain), all, "the plain thread's own mask back");
    assert_eq!(affinity(worker), vec![last], "the worker's own pin back");
    assert_eq!(affinity(outside), vec![last]);
    assert_eq!(affinity(data), all);

    // A list narrower than the process's CPUs keeps the control threads on it at any
    // load (the default policy, on a machine busy or not).
    let pinned = CorePacker::start(PackConfig {
        interval: Duration::from_millis(10),
        cpus: Some(vec![first]),
        ..PackConfig::default()
    })
    .unwrap();
    wait_for("the plain thread on the listed CPU", || {
        affinity(plain) == vec![first]
    });
    assert_eq!(pinned.stats().active, 1);
    assert_eq!(affinity(data), all);
    drop(pinned);
    assert_eq!(
        affinity(plain),
        all,
        "dropping the packer gives the mask back"
    );

    for (end, h) in [
        (plain_end, plain_h),
        (data_end, data_h),
        (worker_end, worker_h),
        (outside_end, outside_h),
        (late_end, late_h),
    ] {
        end.send(()).unwrap();
        h.join().unwrap();
    }
}

fn set(tid: i32, cpus: &[usize]) {
    // SAFETY: a zeroed cpu_set_t is the empty set; the CPUs come from this process's mask.
    unsafe {
        let mut s: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c, &mut s);
        }
        assert_eq!(
            libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &s),
            0
        );
    }
}
