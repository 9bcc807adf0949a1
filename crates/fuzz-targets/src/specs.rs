//! Run specs as `convene run FILE` reads them (YAML or JSON in the protobuf JSON
//! mapping) and as any JSON reaches `convene_proto::json::from_value`.

use std::path::Path;

use convene_proto::v1;

use crate::{fixtures, requests};

/// `convene run FILE`'s loader: the text parsed as a `.yaml` and as a `.json` file; a
/// spec that parses is explained as `convene check FILE` does (which validates it) and
/// then submitted as StartRun takes it.
pub fn run_spec_file(data: &[u8]) {
    let Some(text) = crate::text(data) else {
        return;
    };
    for name in ["spec.yaml", "spec.json"] {
        if let Ok(spec) = convene_cli::spec::parse(text, Path::new(name)) {
            let _ = convene_cli::spec::explain(&spec, fixtures::now());
            requests::run_spec(&spec);
        }
    }
}

/// `convene_proto::json::from_value::<RunSpec>` on any JSON value; a spec that reads
/// is validated and must survive the trip back to JSON.
pub fn run_spec_json(data: &[u8]) {
    if data.len() > crate::MAX_INPUT {
        return;
    }
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let Ok(spec) = convene_proto::json::from_value::<v1::RunSpec>(value) else {
        return;
    };
    requests::json_round_trip(&spec);
    requests::run_spec(&spec);
}
