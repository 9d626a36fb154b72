//! `cubenetctl watch`: follows the agent's varlink WatchNetworks stream (its
//! first reply lists the networks as they are, then one reply per change)
//! and prints one line per event until interrupted.

use std::collections::HashMap;

use serde_json::Value as Json;

use crate::args::Global;
use crate::failure::{EXIT_AGENT, Failure, Res};
use crate::output::{Output, cell, emit, json_text, jstr, text};
use crate::varlink::Varlink;

const METHOD: &str = "org.cube.NetworkAgent.WatchNetworks";

/// The header line (text output, unless --no-legend): the columns of
/// every event line, then what some kinds add.
pub const HEADER: &str = "SEQ KIND SANDBOX SANDBOX-IP TAP PORTS NOTE";

/// Whether each sandbox is paused, as the stream has shown it so far: an
/// `updated` event says "paused" or "resumed" when it changed that.
pub type Paused = HashMap<String, bool>;

/// `SEQ KIND SANDBOX SANDBOX-IP TAP PORTS` (the list's cells, `-` where an
/// event has no network), then for `repaired` what was repaired.
fn line(seq: &str, kind: &str, id: &str, net: Option<&Json>, out: &Output) -> String {
    let mut cells = vec![
        cell(seq, out.ascii),
        cell(kind, out.ascii),
        cell(id, out.ascii),
    ];
    match net {
        Some(n) => {
            let row = crate::list::row(n, out);
            cells.extend([row[1].clone(), row[2].clone(), row[4].clone()]);
        }
        None => cells.extend(["-".to_owned(), "-".to_owned(), "-".to_owned()]),
    }
    cells.join(" ")
}

fn is_paused(net: &Json) -> bool {
    net.get("paused").and_then(Json::as_bool).unwrap_or(false)
}

/// An event as text lines: one per network for `current`, one otherwise.
/// `paused` follows the stream (see [`Paused`]).
pub fn event_lines(ev: &Json, out: &Output, paused: &mut Paused) -> Vec<String> {
    let seq = ev.get("seq").map(jstr).unwrap_or_default();
    let kind = ev.get("kind").map(jstr).unwrap_or_default();
    if kind == "current" {
        let mut nets: Vec<&Json> = ev
            .get("networks")
            .and_then(Json::as_array)
            .map(|a| a.iter().collect())
            .unwrap_or_default();
        nets.sort_by_key(|n| n.get("sandbox_id").map(jstr).unwrap_or_default());
        paused.clear();
        return nets
            .into_iter()
            .map(|n| {
                let id = n.get("sandbox_id").map(jstr).unwrap_or_default();
                let mut l = line(&seq, &kind, &id, Some(n), out);
                if is_paused(n) {
                    l.push_str(" paused");
                }
                paused.insert(id, is_paused(n));
                l
            })
            .collect();
    }
    let id = ev.get("sandbox_id").map(jstr).unwrap_or_default();
    let mut l = line(&seq, &kind, &id, ev.get("network"), out);
    // Whether this change paused or resumed the sandbox's VM.
    match (kind.as_str(), ev.get("network")) {
        ("released", _) => {
            paused.remove(&id);
        }
        (k @ ("created" | "updated" | "repaired"), Some(n)) => {
            let now = is_paused(n);
            let before = paused.insert(id.clone(), now).unwrap_or(false);
            if k == "created" && now {
                l.push_str(" paused");
            } else if k == "updated" && now != before {
                l.push_str(if now { " paused" } else { " resumed" });
            }
        }
        _ => {}
    }
    if let Some(r) = ev.get("repairs").and_then(Json::as_array)
        && !r.is_empty()
    {
        let r: Vec<String> = r.iter().map(jstr).collect();
        l.push(' ');
        l.push_str(&text(&r.join("; "), out.ascii));
    }
    if let Some(t) = ev.get("traffic") {
        let f = |k: &str| t.get(k).map(jstr).unwrap_or_default();
        l.push(' ');
        l.push_str(&text(
            &format!(
                "{}/{} from {}:{} via {}",
                f("protocol"),
                f("port"),
                f("remote_ip"),
                f("remote_port"),
                f("via")
            ),
            out.ascii,
        ));
    }
    vec![l]
}

pub fn run(g: &Global) -> Res<u8> {
    let mut v = Varlink::connect(&g.varlink)?;
    v.call(METHOD, true)?;
    let mut paused = Paused::new();
    let mut header = !g.out.json() && g.out.legend;
    loop {
        let Some(reply) = v.recv()? else {
            return Err(Failure::new(
                EXIT_AGENT,
                "the agent ended the stream (it is stopping or restarting)",
            ));
        };
        let ev = reply.parameters.get("event").cloned().unwrap_or_default();
        if g.out.json() {
            emit(&format!("{}\n", json_text(g.out.json, &ev)));
        } else {
            let mut s = String::new();
            // Once the stream started (an error before it prints none).
            if std::mem::take(&mut header) {
                s.push_str(HEADER);
                s.push('\n');
            }
            for l in event_lines(&ev, &g.out, &mut paused) {
                s.push_str(&l);
                s.push('\n');
            }
            emit(&s);
        }
        if !reply.continues {
            return Err(Failure::new(EXIT_AGENT, "the agent ended the stream"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::JsonMode;
    use serde_json::json;

    const OUT: Output = Output {
        json: JsonMode::Off,
        legend: true,
        quiet: false,
        ascii: true,
    };

    #[test]
    fn one_line_per_event_six_fields() {
        let n = |id: &str| {
            json!({"sandbox_id": id, "sandbox_ip": "192.168.0.2", "tap_name": "ctap1",
                "port_mappings": [{"protocol": "tcp", "container_port": 80, "host_port": 20000, "host_ip": "0.0.0.0"}]})
        };
        let cur = json!({"seq": 4, "kind": "current", "networks": [n("b"), n("a")]});
        let mut p = Paused::new();
        assert_eq!(
            event_lines(&cur, &OUT, &mut p),
            [
                "4 current a 192.168.0.2 ctap1 tcp:80:20000",
                "4 current b 192.168.0.2 ctap1 tcp:80:20000"
            ]
        );
        assert!(
            event_lines(
                &json!({"seq": 0, "kind": "current", "networks": []}),
                &OUT,
                &mut Paused::new()
            )
            .is_empty()
        );
        let c = json!({"seq": 5, "kind": "created", "sandbox_id": "a", "network": n("a")});
        assert_eq!(
            event_lines(&c, &OUT, &mut p),
            ["5 created a 192.168.0.2 ctap1 tcp:80:20000"]
        );
        let w = json!({"seq": 7, "kind": "traffic_while_paused", "sandbox_id": "a",
            "traffic": {"protocol": "tcp", "port": 80, "remote_ip": "198.51.100.2",
                        "remote_port": 40000, "via": "port_mapping"}});
        assert_eq!(
            event_lines(&w, &OUT, &mut p),
            ["7 traffic_while_paused a - - - tcp/80 from 198.51.100.2:40000 via port_mapping"]
        );
        let r = json!({"seq": 6, "kind": "released", "sandbox_id": "a"});
        assert_eq!(event_lines(&r, &OUT, &mut p), ["6 released a - - -"]);
        let r = json!({"seq": 7, "kind": "repaired", "sandbox_id": "a", "network": n("a"),
            "repairs": ["tap ctap1 was missing, recreated", "neighbour re-added"]});
        assert_eq!(
            event_lines(&r, &OUT, &mut p),
            [
                "7 repaired a 192.168.0.2 ctap1 tcp:80:20000 tap ctap1 was missing, recreated; neighbour re-added"
            ]
        );
    }

    #[test]
    fn updates_that_pause_or_resume_say_which() {
        let n = |paused: bool| {
            json!({"sandbox_id": "a", "sandbox_ip": "192.168.0.2", "tap_name": "ctap1",
                "port_mappings": [], "paused": paused})
        };
        let ev = |seq: u64, kind: &str, paused: bool| json!({"seq": seq, "kind": kind, "sandbox_id": "a", "network": n(paused)});
        let mut p = Paused::new();
        let mut lines = |e: Json| event_lines(&e, &OUT, &mut p);
        assert_eq!(
            lines(ev(1, "created", false)),
            ["1 created a 192.168.0.2 ctap1 -"]
        );
        assert_eq!(
            lines(ev(2, "updated", true)),
            ["2 updated a 192.168.0.2 ctap1 - paused"]
        );
        // Another change while paused: nothing to add.
        assert_eq!(
            lines(ev(3, "updated", true)),
            ["3 updated a 192.168.0.2 ctap1 -"]
        );
        assert_eq!(
            lines(ev(4, "updated", false)),
            ["4 updated a 192.168.0.2 ctap1 - resumed"]
        );
        assert_eq!(
            lines(json!({"seq": 5, "kind": "released", "sandbox_id": "a"})),
            ["5 released a - - -"]
        );
        assert_eq!(
            lines(ev(6, "created", true)),
            ["6 created a 192.168.0.2 ctap1 - paused"]
        );
        // The networks at the start: a paused one says so, and its resume
        // is seen as one.
        let cur = json!({"seq": 9, "kind": "current", "networks": [n(true)]});
        assert_eq!(lines(cur), ["9 current a 192.168.0.2 ctap1 - paused"]);
        assert_eq!(
            lines(ev(10, "updated", false)),
            ["10 updated a 192.168.0.2 ctap1 - resumed"]
        );
    }
}
