//! `cubenetctl reconcile [ID]`.

use serde_json::Value as Json;

use crate::dbus::Agent;
use crate::failure::{EXIT_AGENT, EXIT_OK, Res};
use crate::json::{Dict, dict_json};
use crate::output::{Output, REPORT_FIELDS, emit, key_values, print_json};

pub async fn run(agent: &Agent, out: &Output, id: &str) -> Res<u8> {
    let report: Dict = agent.call("ReconcileNetwork", &(id,)).await?;
    let j = dict_json(&report);
    let errors = j
        .get("errors")
        .and_then(Json::as_array)
        .is_some_and(|e| !e.is_empty());
    if out.json() {
        print_json(out.json, &j);
    } else if let Some(o) = j.as_object() {
        emit(&key_values(o, REPORT_FIELDS, out));
    }
    Ok(if errors { EXIT_AGENT } else { EXIT_OK })
}
