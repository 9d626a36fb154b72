//! `cubenetctl health`: the agent's checks.

use serde_json::{Value as Json, json};

use crate::dbus::Agent;
use crate::failure::{EXIT_AGENT, EXIT_OK, Res};
use crate::output::{Output, cell, emit, print_json, table, text};

pub async fn run(agent: &Agent, out: &Output) -> Res<u8> {
    let (healthy, checks): (bool, Vec<(String, bool, String)>) = agent.call("Health", &()).await?;
    if out.json() {
        let checks: Vec<Json> = checks
            .iter()
            .map(|(n, ok, d)| json!({"name": n, "ok": ok, "detail": d}))
            .collect();
        print_json(out.json, &json!({"healthy": healthy, "checks": checks}));
    } else {
        // DETAIL is free text: the last column, the rest of the line.
        // -q: only what is wrong, no header (the exit status says the
        // rest: a quiet healthy agent prints nothing).
        let rows: Vec<Vec<String>> = checks
            .iter()
            .filter(|(_, ok, _)| !(out.quiet && *ok))
            .map(|(n, ok, d)| {
                vec![
                    cell(n, out.ascii),
                    if *ok { "yes" } else { "no" }.into(),
                    text(d, out.ascii),
                ]
            })
            .collect();
        let header: &[&str] = &["CHECK", "OK", "DETAIL"];
        if !(out.quiet && rows.is_empty()) {
            emit(&table((out.legend && !out.quiet).then_some(header), &rows));
        }
        if out.summaries() {
            emit(&format!(
                "\n{}\n",
                if healthy { "healthy" } else { "degraded" }
            ));
        }
    }
    Ok(if healthy { EXIT_OK } else { EXIT_AGENT })
}
