//! `cubenetctl list`: one row per network.

use serde_json::Value as Json;

use crate::dbus::Agent;
use crate::failure::{EXIT_OK, Res};
use crate::json::{Dict, network_json};
use crate::output::{Output, cell, cni_cell, count, emit, jstr, ports_cell, print_json, table};

pub const HEADER: &[&str] = &["SANDBOX", "SANDBOX-IP", "TAP", "MTU", "PORTS", "CNI"];

/// A network as a row of whitespace-free cells.
pub fn row(n: &Json, out: &Output) -> Vec<String> {
    let f = |k: &str| cell(&n.get(k).map(jstr).unwrap_or_default(), out.ascii);
    vec![
        f("sandbox_id"),
        f("sandbox_ip"),
        f("tap_name"),
        f("mtu"),
        ports_cell(n.get("port_mappings"), out.ascii),
        cni_cell(n.get("metadata"), out.ascii),
    ]
}

pub async fn run(agent: &Agent, out: &Output) -> Res<u8> {
    let nets: Vec<Dict> = agent.call("ListNetworks", &()).await?;
    let mut js: Vec<Json> = nets.iter().map(network_json).collect();
    js.sort_by_key(|n| n.get("sandbox_id").map(jstr).unwrap_or_default());
    if out.json() {
        print_json(out.json, &Json::Array(js));
        return Ok(EXIT_OK);
    }
    let rows: Vec<Vec<String>> = js.iter().map(|n| row(n, out)).collect();
    if out.legend {
        emit(&table(Some(HEADER), &rows));
    } else if !rows.is_empty() {
        emit(&table(None, &rows));
    }
    if out.summaries() {
        emit(&format!("\n{}.\n", count(rows.len(), "network")));
    }
    Ok(EXIT_OK)
}
