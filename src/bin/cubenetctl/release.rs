//! `cubenetctl release ID`.

use serde_json::json;

use crate::dbus::Agent;
use crate::failure::{EXIT_NOT_FOUND, EXIT_OK, Failure, Res};
use crate::output::{Output, emit, print_json};

pub async fn run(agent: &Agent, out: &Output, id: &str) -> Res<u8> {
    let released: bool = agent.call("ReleaseNetwork", &(id,)).await?;
    if out.json() {
        print_json(out.json, &json!({"sandbox_id": id, "released": released}));
        return Ok(if released { EXIT_OK } else { EXIT_NOT_FOUND });
    }
    if !released {
        return Err(Failure::new(
            EXIT_NOT_FOUND,
            format!("{id}: no such network"),
        ));
    }
    if !out.quiet {
        emit(&format!("released {id}\n"));
    }
    Ok(EXIT_OK)
}
