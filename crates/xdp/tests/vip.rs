//! PP cluster mode (docs/pp-cluster.md): with a vIP group the program takes a VXLAN frame
//! only when its destination MAC is a vMAC this node owns, since a switch that has not
//! learned a vMAC floods its frames to every node. Run through `BPF_PROG_TEST_RUN` with
//! the golden corpus's offloaded SNAT case, whose frame would otherwise be transmitted.

use pipeline::golden::{self, Outcome};
use xdp::{XdpProgram, XdpRule, XdpVerdict};

const CASE: &str = "v4-udp-snat-reencap";

fn with_dmac(frame: &[u8], mac: [u8; 6]) -> Vec<u8> {
    let mut f = frame.to_vec();
    f[..6].copy_from_slice(&mac);
    f
}

#[test]
fn only_frames_to_an_owned_vmac_are_taken_once_vip_mode_is_on() {
    let (node, cases) = golden::load().expect("corpus");
    let c = cases.iter().find(|c| c.name == CASE).expect("corpus case");
    let rule = c.parsed_rule().unwrap().expect("case has a rule");
    assert!(matches!(c.expect, Some(Outcome::Out(..))));
    let mut prog = XdpProgram::load().expect("load the XDP program (needs root / CAP_BPF)");
    prog.set_node(&node).expect("set node");
    prog.install_rule(&rule.key, &XdpRule::from_rule(&rule).unwrap())
        .expect("install");
    let a = [0x02, 0x5f, 0x76, 0, 0, 1];
    let b = [0x02, 0x5f, 0x76, 0, 0, 2];
    let to_a = with_dmac(&c.input, a);
    let to_b = with_dmac(&c.input, b);

    // Not a cluster node: the destination MAC is not looked at.
    assert_eq!(prog.test_run(&to_a).unwrap().0, XdpVerdict::Tx);
    assert_eq!(prog.test_run(&to_b).unwrap().0, XdpVerdict::Tx);

    prog.set_vip_macs(&[a]).unwrap();
    assert_eq!(prog.vip_macs().unwrap(), vec![a]);
    assert_eq!(prog.test_run(&to_a).unwrap().0, XdpVerdict::Tx);
    assert_eq!(
        prog.test_run(&to_b).unwrap().0,
        XdpVerdict::Pass,
        "a flooded frame for another node's vMAC goes to the kernel, which drops it"
    );

    // The vIP moved: b is ours, a no longer.
    prog.set_vip_macs(&[b]).unwrap();
    assert_eq!(prog.vip_macs().unwrap(), vec![b]);
    assert_eq!(prog.test_run(&to_a).unwrap().0, XdpVerdict::Pass);
    assert_eq!(prog.test_run(&to_b).unwrap().0, XdpVerdict::Tx);

    prog.set_vip_macs(&[a, b]).unwrap();
    assert_eq!(prog.vip_macs().unwrap(), vec![a, b]);
    assert_eq!(prog.test_run(&to_a).unwrap().0, XdpVerdict::Tx);

    // Drained: a cluster node that owns nothing takes nothing.
    prog.set_vip_macs(&[]).unwrap();
    assert!(prog.vip_macs().unwrap().is_empty());
    assert_eq!(prog.test_run(&to_a).unwrap().0, XdpVerdict::Pass);
    assert_eq!(prog.test_run(&to_b).unwrap().0, XdpVerdict::Pass);
}
