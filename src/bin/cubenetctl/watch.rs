//! `cubenetctl watch`: follows the agent's varlink WatchNetworks stream (its
//! first reply lists the networks as they are, then one reply per change)
//! and prints one line per event until interrupted.

use serde_json::Value as Json;

use crate::args::Global;
use crate::failure::{EXIT_AGENT, Failure, Res};
use crate::output::{Output, cell, emit, json_text, jstr, text};
use crate::varlink::Varlink;

const METHOD: &str = "org.cube.NetworkAgent.WatchNetworks";

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

/// An event as text lines: one per network for `current`, one otherwise.
pub fn event_lines(ev: &Json, out: &Output) -> Vec<String> {
    let seq = ev.get("seq").map(jstr).unwrap_or_default();
    let kind = ev.get("kind").map(jstr).unwrap_or_default();
    if kind == "current" {
        let mut nets: Vec<&Json> = ev
            .get("networks")
            .and_then(Json::as_array)
            .map(|a| a.iter().collect())
            .unwrap_or_default();
        nets.sort_by_key(|n| n.get("sandbox_id").map(jstr).unwrap_or_default());
        return nets
            .into_iter()
            .map(|n| {
                let id = n.get("sandbox_id").map(jstr).unwrap_or_default();
                line(&seq, &kind, &id, Some(n), out)
            })
            .collect();
    }
    let id = ev.get("sandbox_id").map(jstr).unwrap_or_default();
    let mut l = line(&seq, &kind, &id, ev.get("network"), out);
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
            for l in event_lines(&ev, &g.out) {
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
        assert_eq!(
            event_lines(&cur, &OUT),
            [
                "4 current a 192.168.0.2 ctap1 tcp:80:20000",
                "4 current b 192.168.0.2 ctap1 tcp:80:20000"
            ]
        );
        assert!(
            event_lines(&json!({"seq": 0, "kind": "current", "networks": []}), &OUT).is_empty()
        );
        let c = json!({"seq": 5, "kind": "created", "sandbox_id": "a", "network": n("a")});
        assert_eq!(
            event_lines(&c, &OUT),
            ["5 created a 192.168.0.2 ctap1 tcp:80:20000"]
        );
        let w = json!({"seq": 7, "kind": "traffic_while_paused", "sandbox_id": "a",
            "traffic": {"protocol": "tcp", "port": 80, "remote_ip": "198.51.100.2",
                        "remote_port": 40000, "via": "port_mapping"}});
        assert_eq!(
            event_lines(&w, &OUT),
            ["7 traffic_while_paused a - - - tcp/80 from 198.51.100.2:40000 via port_mapping"]
        );
        let r = json!({"seq": 6, "kind": "released", "sandbox_id": "a"});
        assert_eq!(event_lines(&r, &OUT), ["6 released a - - -"]);
        let r = json!({"seq": 7, "kind": "repaired", "sandbox_id": "a", "network": n("a"),
            "repairs": ["tap ctap1 was missing, recreated", "neighbour re-added"]});
        assert_eq!(
            event_lines(&r, &OUT),
            [
                "7 repaired a 192.168.0.2 ctap1 tcp:80:20000 tap ctap1 was missing, recreated; neighbour re-added"
            ]
        );
    }
}
