//! `cubenetctl capacity`: the node's headroom, as Capacity answers it.

use std::collections::{BTreeMap, HashMap};

use serde_json::{Map, Value as Json};
use zbus::zvariant::OwnedValue;

use crate::dbus::Agent;
use crate::failure::{EXIT_OK, Res};
use crate::output::{Output, cell, emit, print_json, table};

pub async fn run(agent: &Agent, out: &Output) -> Res<u8> {
    let (cap,): (HashMap<String, OwnedValue>,) = agent.call("Capacity", &()).await?;
    let mut numbers: BTreeMap<String, u64> = BTreeMap::new();
    let mut labels: BTreeMap<String, String> = BTreeMap::new();
    for (k, v) in cap {
        if k == "labels" {
            if let Ok(m) = HashMap::<String, String>::try_from(v) {
                labels.extend(m);
            }
        } else if let Ok(n) = u64::try_from(v) {
            numbers.insert(k, n);
        }
    }
    if out.json() {
        let mut o: Map<String, Json> = numbers
            .iter()
            .map(|(k, v)| (k.clone(), Json::from(*v)))
            .collect();
        o.insert(
            "labels".into(),
            Json::Object(
                labels
                    .iter()
                    .map(|(k, v)| (k.clone(), Json::from(v.as_str())))
                    .collect(),
            ),
        );
        print_json(out.json, &Json::Object(o));
        return Ok(EXIT_OK);
    }
    let mut rows: Vec<Vec<String>> = numbers
        .iter()
        .map(|(k, v)| vec![cell(k, out.ascii), v.to_string()])
        .collect();
    rows.extend(
        labels
            .iter()
            .map(|(k, v)| vec![cell(&format!("label {k}"), out.ascii), cell(v, out.ascii)]),
    );
    let header: &[&str] = &["RESOURCE", "VALUE"];
    emit(&table(out.legend.then_some(header), &rows));
    Ok(EXIT_OK)
}
