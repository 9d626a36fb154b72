//! The flow log through varlink `WatchFlows` (docs/flows.md).

use serde_json::{Value as Json, json};

/// Every reply of one `WatchFlows` call without follow: the kept records
/// of the last hour that `params` take (and loss reports).
pub fn watch(env: &super::Env, mut params: Json) -> Vec<Json> {
    use std::io::{Read, Write};
    params["follow"] = json!(false);
    params["since_seconds"] = json!(3600);
    let mut sock =
        std::os::unix::net::UnixStream::connect(env.dir.join("run/org.cube.NetworkAgent")).unwrap();
    sock.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    let call =
        json!({"method": "org.cube.NetworkAgent.WatchFlows", "parameters": params, "more": true});
    let mut msg = call.to_string().into_bytes();
    msg.push(0);
    sock.write_all(&msg).unwrap();
    let mut out = vec![];
    let mut buf = vec![];
    let mut byte = [0u8; 1];
    loop {
        assert_eq!(sock.read(&mut byte).unwrap(), 1, "stream ended early");
        if byte[0] != 0 {
            buf.push(byte[0]);
            continue;
        }
        let reply: Json = serde_json::from_slice(&buf).unwrap();
        buf.clear();
        assert!(reply.get("error").is_none(), "{reply}");
        let more = reply["continues"].as_bool().unwrap_or(false);
        out.push(reply["parameters"].clone());
        if !more {
            return out;
        }
    }
}

/// The kept records of sandbox `id`.
pub fn records(env: &super::Env, id: &str) -> Vec<Json> {
    watch(env, json!({"sandbox_id": id}))
        .into_iter()
        .filter_map(|r| r.get("flow").cloned())
        .collect()
}
