//! `cubenetctl egress-rules ID FILE` (SetEgressRules: the rules alone,
//! e.g. a CNI attachment's after ADD) and `cubenetctl egress-ca` (the node
//! CA certificate guests trust for the rules' hosts).

use serde_json::json;

use crate::dbus::Agent;
use crate::failure::{EXIT_AGENT, EXIT_OK, Failure, Res};
use crate::json::Dict;
use crate::output::{Output, emit, print_json};
use crate::rules_file::{RulesFile, dbus_value, explain};

pub async fn set_rules(agent: &Agent, out: &Output, id: &str, f: &RulesFile) -> Res<u8> {
    let net: Dict = agent
        .call_explained("SetEgressRules", &(id, dbus_value(&f.rules)), &|m| {
            explain(&f.name, m)
        })
        .await?;
    if out.quiet && !out.json() {
        return Ok(EXIT_OK);
    }
    crate::status::show(&net, out);
    Ok(EXIT_OK)
}

pub async fn ca(agent: &Agent, out: &Output) -> Res<u8> {
    let pem = agent.string_property("EgressCaCertificate").await?;
    if pem.is_empty() {
        return Err(Failure::new(
            EXIT_AGENT,
            "the egress gateway does not run, so there is no CA certificate \
             ('cubenetctl health' and the agent's log say why)",
        ));
    }
    if out.json() {
        print_json(out.json, &json!({ "certificate": pem }));
    } else if pem.ends_with('\n') {
        emit(&pem);
    } else {
        emit(&format!("{pem}\n"));
    }
    Ok(EXIT_OK)
}
