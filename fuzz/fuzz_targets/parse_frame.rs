#![no_main]
use libfuzzer_sys::fuzz_target;
fuzz_target!(|data: &[u8]| {
    if let Ok(f) = packet::parse_frame(data) {
        // Exercise the VXLAN inner frame too, when there is one.
        if let Some(inner) = f.vxlan_inner(data) {
            let _ = packet::parse_frame(inner);
        }
    }
});
