//! From the ranks' reports to one summary (pure: reports in, lines out). Each pending `wait()`
//! is an edge from the waiter to the rank it waits for, annotated with the signal count wanted
//! and the count it has. The peer's counts for the same connection say where that signal is:
//! not issued yet (the peer's program has not reached it: a real dependency), issued but not
//! sent (queued in the peer's proxy), sent but not arrived (in the transport), or arrived.
//! The real dependencies form the wait-for graph: its cycles are deadlocks; a chain that ends
//! at a rank that does not answer, or at one that waits for nobody, names the rank to look at.

use super::rank::{ConnCounts, RankReport, Waiting};
use crate::host::pending::Ended;
use crate::proxy::WaitOp;
use std::collections::BTreeMap;
use std::fmt::Write;

/// What a rank answered.
#[derive(Clone, Debug)]
pub enum Answer {
    Report(RankReport),
    /// No report: why (lost, gone, unreachable, silent, malformed).
    None(String),
}

/// The combined summary: its lines in order, and the cycles and chains it names (ranks in
/// order, a cycle without repeating its first rank).
#[derive(Clone, Debug, Default)]
pub struct Summary {
    pub lines: Vec<String>,
    pub cycles: Vec<Vec<usize>>,
    pub chains: Vec<Vec<usize>>,
}

/// What a peer sent on one connection: by its proxy (its own count; None where its report
/// left it out), and by its kernels directly (P2P's direct path: counted where they land, in
/// the waiter's epoch, so the waiter's record says it; such a store arrives as it is sent).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Sent {
    proxy: Option<u64>,
    direct: u64,
}

impl Sent {
    /// All of it, where the proxy's part is known.
    fn total(self) -> Option<u64> {
        self.proxy.map(|p| p + self.direct)
    }

    /// "sent 18 (1 by its proxy, 17 by its kernels directly)", "sent 3".
    fn text(self) -> String {
        let total = self.total().map_or_else(
            || format!("an unknown number (at least {})", self.direct),
            |t| t.to_string(),
        );
        match (self.direct, self.proxy) {
            (0, _) => total,
            (d, p) => format!(
                "{total} ({} by its proxy, {d} by its kernels directly)",
                p.map_or("unknown".into(), |p| p.to_string())
            ),
        }
    }
}

/// Where the signal a `wait()` wants is, by the peer's counts.
#[derive(Clone, Debug, PartialEq)]
enum Where {
    /// The waiter has it (it arrived after the wait ended, or just now).
    Arrived,
    /// The peer sent it; not (yet) in the waiter's epoch.
    NotArrived { sent: Sent },
    /// The peer issued it; its proxy has not sent it.
    Queued { issued: u64, sent: Sent },
    /// The peer has not issued it: a real dependency on the peer's program.
    NotSignalled { sent: Sent },
    /// The peer did not answer.
    NoAnswer(String),
}

struct Edge<'a> {
    from: usize,
    to: usize,
    w: &'a Waiting,
    at: Where,
}

impl Edge<'_> {
    /// "rank 0 waits for signal 18 from rank 1 (has 17)", with how a wait that ended did.
    fn text(&self) -> String {
        let p = &self.w.wait;
        let who = if p.device {
            format!("rank {}'s kernel", self.from)
        } else {
            format!("rank {}", self.from)
        };
        let mut s = format!(
            "{who} waits for signal {} from rank {} (has {}",
            p.wanted, self.to, p.seen
        );
        match self.w.ended {
            Some((Ended::TimedOut, ago)) => {
                let _ = write!(s, ", timed out {:.1} s ago", ago.as_secs_f64());
            }
            Some((Ended::Aborted, ago)) => {
                let _ = write!(s, ", aborted {:.1} s ago", ago.as_secs_f64());
            }
            None => {}
        }
        s.push(')');
        s
    }
    /// A real dependency: part of the wait-for graph.
    fn blocks(&self) -> bool {
        matches!(self.at, Where::NotSignalled { .. } | Where::NoAnswer(_))
    }
}

fn counts_of(r: &RankReport, peer: usize, tag: i32) -> Option<&ConnCounts> {
    r.conns
        .iter()
        .find(|c| c.remote_rank == peer && c.tag == tag)
}

/// The lines of the summary of `answers` (one per rank, the asking rank's own included).
pub fn summarize(answers: &[(usize, Answer)]) -> Summary {
    let reports: BTreeMap<usize, &RankReport> = answers
        .iter()
        .filter_map(|(r, a)| match a {
            Answer::Report(x) => Some((*r, x)),
            Answer::None(_) => None,
        })
        .collect();
    // Why a rank did not answer; "lost" as another rank saw it, if the asker could only say
    // that it was unreachable.
    let silent: BTreeMap<usize, String> = answers
        .iter()
        .filter_map(|(r, a)| match a {
            Answer::None(why) => Some((*r, why.clone())),
            Answer::Report(_) => None,
        })
        .map(|(r, why)| {
            let seen = reports
                .values()
                .find_map(|x| x.lost.iter().find(|(p, _)| *p == r).map(|l| (x.rank, &l.1)));
            match seen {
                Some((by, lost)) if !why.starts_with("lost") => {
                    (r, format!("lost: {lost} (seen by rank {by}); asked: {why}"))
                }
                _ => (r, why),
            }
        })
        .collect();
    let mut edges = Vec::new();
    let mut other_waits = Vec::new();
    for (&r, rep) in &reports {
        for w in &rep.waits {
            let p = &w.wait;
            if p.op != WaitOp::Wait {
                other_waits.push((r, w));
                continue;
            }
            let tag = rep.conns.iter().find(|c| c.index == p.conn).map(|c| c.tag);
            let q = p.remote_rank;
            let peer = tag.and_then(|t| reports.get(&q).and_then(|x| counts_of(x, r, t)));
            let sent = Sent {
                proxy: peer.and_then(|c| c.sent),
                direct: p.direct,
            };
            let at = if p.seen >= p.wanted {
                Where::Arrived
            } else if let Some(why) = silent.get(&q) {
                Where::NoAnswer(why.clone())
            } else {
                match peer {
                    _ if sent.total().is_some_and(|s| s >= p.wanted) => Where::NotArrived { sent },
                    Some(c) if c.issued.is_some_and(|i| i + p.direct >= p.wanted) => {
                        Where::Queued {
                            issued: c.issued.unwrap_or(0) + p.direct,
                            sent,
                        }
                    }
                    _ => Where::NotSignalled { sent },
                }
            };
            edges.push(Edge {
                from: r,
                to: q,
                w,
                at,
            });
        }
    }
    let mut out = Summary::default();
    if edges.is_empty() && other_waits.is_empty() {
        out.lines.push("no rank has a pending wait".into());
    }
    // The wait-for graph among ranks that answered, and its cycles.
    let dep: Vec<(usize, usize)> = edges
        .iter()
        .filter(|e| matches!(e.at, Where::NotSignalled { .. }))
        .map(|e| (e.from, e.to))
        .collect();
    out.cycles = cycles(&dep);
    let in_cycle = |a: usize, b: usize| {
        out.cycles
            .iter()
            .any(|c| (0..c.len()).any(|i| c[i] == a && c[(i + 1) % c.len()] == b))
    };
    for c in &out.cycles {
        let parts: Vec<String> = (0..c.len())
            .filter_map(|i| {
                let (a, b) = (c[i], c[(i + 1) % c.len()]);
                edges
                    .iter()
                    .find(|e| e.from == a && e.to == b && e.blocks())
                    .map(|e| e.text())
            })
            .collect();
        let ring: Vec<String> = c.iter().chain(c.first()).map(|r| r.to_string()).collect();
        out.lines
            .push(format!("{}: cycle {}", parts.join("; "), ring.join(" -> ")));
    }
    for e in edges.iter().filter(|e| !in_cycle(e.from, e.to)) {
        let q = e.to;
        let why = match &e.at {
            Where::Arrived => "it has arrived since".to_string(),
            // Sent, not arrived: the sender's copy-engine work may wait behind a running kernel
            // (the hint names the condition where it holds in this process).
            Where::NotArrived { sent } => format!(
                "rank {q} sent it (sent {}): signal sent but not arrived{}",
                sent.text(),
                crate::cuda::queue_hint_for_sender()
            ),
            Where::Queued { issued, sent } => format!(
                "rank {q} issued it (issued {issued}, sent {}): not yet sent by rank {q}'s proxy",
                sent.text()
            ),
            Where::NoAnswer(why) => format!("rank {q}: no answer ({why})"),
            Where::NotSignalled { sent } => {
                let sent = sent.text();
                let waits: Vec<String> = edges
                    .iter()
                    .filter(|x| x.from == q && x.blocks())
                    .map(|x| x.to.to_string())
                    .collect();
                if waits.is_empty() {
                    format!("rank {q} has sent {sent} and waits for no rank")
                } else {
                    format!(
                        "rank {q} has sent {sent} and waits for rank {}",
                        waits.join(", rank ")
                    )
                }
            }
        };
        out.lines.push(format!("{}: {why}", e.text()));
    }
    // Chains of real dependencies that end at a rank that did not answer, or at one that
    // waits for nobody: the rank to look at.
    let blocking: Vec<(usize, usize)> = edges
        .iter()
        .filter(|e| e.blocks())
        .map(|e| (e.from, e.to))
        .collect();
    let mut ends: Vec<usize> = blocking
        .iter()
        .map(|&(_, t)| t)
        .filter(|&t| !blocking.iter().any(|&(f, _)| f == t))
        .collect();
    ends.sort_unstable();
    ends.dedup();
    for t in ends {
        let mut chain = vec![t];
        // Ends: every step adds a rank not yet in the chain, and there are finitely many.
        while let Some(p) = blocking
            .iter()
            .filter(|&&(f, to)| to == chain[0] && !chain.contains(&f))
            .map(|&(f, _)| f)
            .min()
        {
            chain.insert(0, p);
        }
        if chain.len() < 3 {
            // One edge: its line above says it all.
            continue;
        }
        let names: Vec<String> = chain.iter().map(|r| r.to_string()).collect();
        let end = match silent.get(&t) {
            Some(why) => format!("rank {t}: no answer ({why})"),
            None => format!("rank {t} waits for no rank"),
        };
        out.lines
            .push(format!("chain {}: {end}", names.join(" -> ")));
        out.chains.push(chain);
    }
    for (r, w) in other_waits {
        let p = &w.wait;
        let what = match p.op {
            WaitOp::Flush => format!("a flush waits for ticket {} (tail {})", p.wanted, p.seen),
            _ => format!(
                "a push waits for room in its FIFO for ticket {} (tail {})",
                p.wanted, p.seen
            ),
        };
        let who = if p.device { "'s kernel" } else { "" };
        let ended = match w.ended {
            Some((Ended::TimedOut, _)) => ", timed out",
            Some((Ended::Aborted, _)) => ", aborted",
            None => "",
        };
        out.lines.push(format!(
            "rank {r}{who}: on its connection to rank {}, {what}{ended}",
            p.remote_rank
        ));
    }
    for (r, why) in &silent {
        out.lines.push(format!("rank {r}: no answer ({why})"));
    }
    // The counts of the ranks involved, on the connections between them.
    let mut involved: Vec<usize> = edges.iter().flat_map(|e| [e.from, e.to]).collect();
    involved.sort_unstable();
    involved.dedup();
    for r in &involved {
        let Some(rep) = reports.get(r) else { continue };
        let conns: Vec<String> = rep
            .conns
            .iter()
            .filter(|c| involved.contains(&c.remote_rank))
            .map(|c| {
                let n = |v: Option<u64>| v.map_or("?".into(), |v| v.to_string());
                format!(
                    "to rank {} (tag {}): issued {}, sent {}, received {}",
                    c.remote_rank,
                    c.tag,
                    n(c.issued),
                    n(c.sent),
                    n(c.received)
                )
            })
            .collect();
        if !conns.is_empty() {
            out.lines
                .push(format!("rank {r} signals: {}", conns.join("; ")));
        }
    }
    for rep in reports.values() {
        for n in &rep.notes {
            out.lines.push(format!("rank {}: {n}", rep.rank));
        }
    }
    out
}

/// One cycle per strongly connected component of the graph `edges` (ranks as nodes) that has
/// one, each starting at its lowest rank.
fn cycles(edges: &[(usize, usize)]) -> Vec<Vec<usize>> {
    let mut nodes: Vec<usize> = edges.iter().flat_map(|&(a, b)| [a, b]).collect();
    nodes.sort_unstable();
    nodes.dedup();
    let succ = |a: usize| -> Vec<usize> {
        let mut v: Vec<usize> = edges
            .iter()
            .filter(|&&(f, _)| f == a)
            .map(|&(_, t)| t)
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    // Reachability by search from each node: the graphs here have a few edges per rank.
    let reach = |a: usize| -> Vec<usize> {
        let (mut seen, mut todo) = (vec![a], vec![a]);
        // Ends: each node is pushed at most once.
        while let Some(x) = todo.pop() {
            for y in succ(x) {
                if !seen.contains(&y) {
                    seen.push(y);
                    todo.push(y);
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<usize, Vec<usize>> = nodes.iter().map(|&n| (n, reach(n))).collect();
    let mut done: Vec<usize> = Vec::new();
    let mut out = Vec::new();
    for &n in &nodes {
        if done.contains(&n) {
            continue;
        }
        // n's component: the nodes n reaches that reach n back.
        let comp: Vec<usize> = reaches[&n]
            .iter()
            .copied()
            .filter(|m| reaches[m].contains(&n))
            .collect();
        done.extend(&comp);
        if comp.len() < 2 {
            continue;
        }
        // Walk from the lowest rank along the lowest successor inside the component until a
        // rank repeats: the walk from that rank on is a cycle.
        let mut walk = vec![n];
        // Ends: each step adds a rank, and within at most comp.len() steps one repeats.
        loop {
            let last = *walk.last().unwrap_or(&n);
            let Some(next) = succ(last).into_iter().find(|s| comp.contains(s)) else {
                break;
            };
            if let Some(i) = walk.iter().position(|&x| x == next) {
                let mut c = walk.split_off(i);
                let low = c.iter().enumerate().min_by_key(|x| x.1).map_or(0, |x| x.0);
                c.rotate_left(low);
                out.push(c);
                break;
            }
            walk.push(next);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::PendingWait;
    use std::time::Duration;

    /// A connection from rank `from`'s point of view, to `to`, tag 0, with what `from`
    /// issued and sent on it and what it received.
    fn conn(index: usize, to: usize, issued: u64, sent: u64, received: u64) -> ConnCounts {
        ConnCounts {
            index,
            remote_rank: to,
            tag: 0,
            issued: Some(issued),
            sent: Some(sent),
            received: Some(received),
        }
    }

    fn wait(conn: usize, from: usize, wanted: u64, seen: u64) -> Waiting {
        Waiting {
            wait: PendingWait {
                conn,
                remote_rank: from,
                op: WaitOp::Wait,
                wanted,
                seen,
                direct: 0,
                waited: Duration::from_secs(2),
                device: false,
            },
            ended: None,
        }
    }

    fn report(rank: usize, conns: Vec<ConnCounts>, waits: Vec<Waiting>) -> (usize, Answer) {
        (
            rank,
            Answer::Report(RankReport {
                rank,
                conns,
                waits,
                ..Default::default()
            }),
        )
    }

    fn has(s: &Summary, text: &str) {
        assert!(
            s.lines.iter().any(|l| l.contains(text)),
            "no line with {text:?} in:\n{}",
            s.lines.join("\n")
        );
    }

    #[test]
    fn two_rank_deadlock() {
        let s = summarize(&[
            report(0, vec![conn(0, 1, 4, 4, 17)], vec![wait(0, 1, 18, 17)]),
            report(1, vec![conn(0, 0, 17, 17, 4)], vec![wait(0, 0, 5, 4)]),
        ]);
        assert_eq!(s.cycles, vec![vec![0, 1]]);
        has(&s, "rank 0 waits for signal 18 from rank 1 (has 17); rank 1 waits for signal 5 from rank 0 (has 4): cycle 0 -> 1 -> 0");
        has(
            &s,
            "rank 0 signals: to rank 1 (tag 0): issued 4, sent 4, received 17",
        );
        assert!(s.chains.is_empty());
    }

    #[test]
    fn three_rank_cycle_with_one_wait_timed_out() {
        // Each rank waits for the one before it in the ring before it signals the next.
        let mut timed_out = wait(1, 2, 1, 0);
        timed_out.ended = Some((Ended::TimedOut, Duration::from_millis(300)));
        let s = summarize(&[
            report(
                0,
                vec![conn(0, 1, 0, 0, 0), conn(1, 2, 0, 0, 0)],
                vec![timed_out],
            ),
            report(
                1,
                vec![conn(0, 2, 0, 0, 0), conn(1, 0, 0, 0, 0)],
                vec![wait(1, 0, 1, 0)],
            ),
            report(
                2,
                vec![conn(0, 0, 0, 0, 0), conn(1, 1, 0, 0, 0)],
                vec![wait(1, 1, 1, 0)],
            ),
        ]);
        assert_eq!(s.cycles, vec![vec![0, 2, 1]]);
        has(&s, "rank 0 waits for signal 1 from rank 2 (has 0, timed out 0.3 s ago); rank 2 waits for signal 1 from rank 1 (has 0); rank 1 waits for signal 1 from rank 0 (has 0): cycle 0 -> 2 -> 1 -> 0");
    }

    #[test]
    fn chain_ending_at_a_dead_rank() {
        // Rank 0 waits for rank 1, which waits for rank 2, which died; rank 1 saw it go.
        let mut r1 = report(
            1,
            vec![conn(0, 0, 0, 0, 0), conn(1, 2, 0, 0, 0)],
            vec![wait(1, 2, 1, 0)],
        );
        if let Answer::Report(r) = &mut r1.1 {
            r.lost = vec![(
                2,
                "rank 2 closed its bootstrap connection without saying goodbye".into(),
            )];
        }
        let s = summarize(&[
            report(0, vec![conn(0, 1, 0, 0, 0)], vec![wait(0, 1, 1, 0)]),
            r1,
            (2, Answer::None("unreachable: connection refused".into())),
        ]);
        assert!(s.cycles.is_empty());
        assert_eq!(s.chains, vec![vec![0, 1, 2]]);
        has(&s, "chain 0 -> 1 -> 2: rank 2: no answer (lost: rank 2 closed its bootstrap connection without saying goodbye (seen by rank 1)");
        has(
            &s,
            "rank 0 waits for signal 1 from rank 1 (has 0): rank 1 has sent 0 and waits for rank 2",
        );
        has(&s, "rank 2: no answer (lost: ");
    }

    /// A kernel's wait counts the signals the peer's kernels stored themselves (P2P's direct
    /// path) with those its proxy sent; the peer counts only the latter. Rank 1 stored signals
    /// 1-17 itself; its 18th waits in its FIFO behind a slow put; it waits for rank 0 in turn.
    /// Not a cycle: rank 0's signal is queued at rank 1, and the line says how each came.
    #[test]
    fn direct_signals_count_as_sent() {
        let mut w0 = wait(0, 1, 18, 17);
        w0.wait.direct = 17;
        w0.wait.device = true;
        let gpu = |issued, sent| ConnCounts {
            issued: Some(issued),
            sent: Some(sent),
            received: None,
            ..conn(0, 0, 0, 0, 0)
        };
        let s = summarize(&[
            report(0, vec![gpu(4, 4)], vec![w0.clone()]),
            report(1, vec![gpu(1, 0)], vec![wait(0, 0, 5, 4)]),
        ]);
        assert!(s.cycles.is_empty(), "{s:?}");
        has(&s, "rank 0's kernel waits for signal 18 from rank 1 (has 17): rank 1 issued it (issued 18, sent 17 (0 by its proxy, 17 by its kernels directly)): not yet sent by rank 1's proxy");
        // Sent and not arrived: its proxy sent the 18th.
        let s = summarize(&[
            report(0, vec![gpu(4, 4)], vec![w0.clone()]),
            report(1, vec![gpu(1, 1)], vec![]),
        ]);
        has(&s, "rank 1 sent it (sent 18 (1 by its proxy, 17 by its kernels directly)): signal sent but not arrived");
        // Not issued at all: a real dependency, and it says how many came directly.
        let s = summarize(&[
            report(0, vec![gpu(4, 4)], vec![w0]),
            report(1, vec![gpu(0, 0)], vec![wait(0, 0, 5, 4)]),
        ]);
        assert_eq!(s.cycles, vec![vec![0, 1]]);
    }

    #[test]
    fn no_cycle_signal_in_flight_or_peer_busy() {
        let s = summarize(&[
            // Rank 0 waits for signal 3 from rank 1, which sent it: in flight.
            report(
                0,
                vec![conn(0, 1, 0, 0, 2), conn(1, 2, 5, 4, 0)],
                vec![wait(0, 1, 3, 2)],
            ),
            report(1, vec![conn(0, 0, 3, 3, 0), conn(1, 3, 0, 0, 0)], vec![]),
            // Rank 2 waits for signal 5 from rank 0, which issued it; its proxy sent 4.
            report(2, vec![conn(0, 0, 0, 0, 4)], vec![wait(0, 0, 5, 4)]),
            // Rank 3 waits for rank 1, which does not wait for anyone: the rank to look at.
            report(3, vec![conn(0, 1, 0, 0, 0)], vec![wait(0, 1, 1, 0)]),
        ]);
        assert!(s.cycles.is_empty() && s.chains.is_empty(), "{s:?}");
        has(&s, "rank 0 waits for signal 3 from rank 1 (has 2): rank 1 sent it (sent 3): signal sent but not arrived");
        has(&s, "rank 2 waits for signal 5 from rank 0 (has 4): rank 0 issued it (issued 5, sent 4): not yet sent by rank 0's proxy");
        has(&s, "rank 3 waits for signal 1 from rank 1 (has 0): rank 1 has sent 0 and waits for no rank");
        // Nothing pending is said too.
        let s = summarize(&[report(0, vec![], vec![]), report(1, vec![], vec![])]);
        assert_eq!(s.lines, vec!["no rank has a pending wait".to_string()]);
    }
}
