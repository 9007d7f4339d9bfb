//! The network transport's address and region blobs and links, through a real tcp endpoint's
//! `add_peer`, `import` and `link_to` (the path a peer's bytes take). First input byte picks
//! which.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mscclpp::transport::{net, Endpoint, MemKind, Region};
use std::sync::{Mutex, OnceLock};

struct State {
    ep: Box<dyn Endpoint>,
    peer: usize,
    next_rank: usize,
    // Kept reachable for the whole run (the endpoints before the memory they registered, were
    // the state ever dropped).
    _other: Box<dyn Endpoint>,
    _mem: Vec<u64>,
}

fn state() -> &'static Mutex<State> {
    static S: OnceLock<Mutex<State>> = OnceLock::new();
    S.get_or_init(|| {
        let mut ep = net::open(Some("lo"), false, None).expect("a tcp endpoint on lo");
        let mut other = net::open(Some("lo"), false, None).expect("a tcp endpoint on lo");
        let mem = vec![0u64; 512];
        other
            .register(Region {
                addr: mem.as_ptr() as u64,
                len: 4096,
                kind: MemKind::Host,
            })
            .unwrap();
        let peer = ep.add_peer(1, &other.address().unwrap()).unwrap();
        Mutex::new(State {
            ep,
            peer,
            next_rank: 2,
            _other: other,
            _mem: mem,
        })
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, blob)) = data.split_first() else {
        return;
    };
    let mut s = state().lock().unwrap_or_else(|e| e.into_inner());
    let p = s.peer;
    match which % 3 {
        0 => {
            let r = s.next_rank;
            s.next_rank += 1;
            let _ = s.ep.add_peer(r, blob);
        }
        1 => {
            let _ = s.ep.import(p, blob);
        }
        _ => {
            let _ = s.ep.link_to(p, blob);
        }
    }
});
