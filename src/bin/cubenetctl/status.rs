//! `cubenetctl status ID`: every field of one network.

use crate::dbus::Agent;
use crate::failure::{EXIT_OK, Res};
use crate::json::{Dict, network_json};
use crate::output::{NETWORK_FIELDS, Output, emit, key_values, print_json};

/// A network as `status` (and `ensure`) print it.
pub fn show(net: &Dict, out: &Output) {
    let j = network_json(net);
    if out.json() {
        print_json(out.json, &j);
    } else if let Some(o) = j.as_object() {
        emit(&key_values(o, NETWORK_FIELDS, out));
    }
}

pub async fn run(agent: &Agent, out: &Output, id: &str) -> Res<u8> {
    let net: Dict = agent.call("GetNetwork", &(id,)).await?;
    show(&net, out);
    Ok(EXIT_OK)
}
