//! llama-server's slot actions: `POST /slots/{id}?action=save|restore|erase`. An agent saves
//! the cache of a long conversation to a file under `--slot-save-path` and restores it later
//! (after other conversations took the slot, or on a restarted server of the same model), so
//! its next prompt is not computed again. The answers are llama-server's.

use crate::http::ApiError;
use crate::service::State;
use axum::body::Bytes;
use axum::extract::{Path, Query, State as AxState};
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};
use std::sync::Arc;
use tandem_engine::{Error as EngineError, SlotAction};

#[derive(serde::Deserialize)]
pub(crate) struct ActionQuery {
    action: Option<String>,
}

/// `POST /slots/{id}?action=...`, with `{"filename": "..."}` for save and restore.
pub(crate) async fn slot_action(
    AxState(state): AxState<Arc<State>>,
    Path(id): Path<String>,
    Query(q): Query<ActionQuery>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let Some(dir) = state.slot_save_path() else {
        return Err(ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "This server does not support slots action. Start it with `--slot-save-path`",
        ));
    };
    let slot: usize = id.parse().map_err(|_| ApiError::bad(format!("Invalid slot ID {id:?}")))?;
    let action = q.action.unwrap_or_default();
    let file = || -> Result<String, ApiError> {
        let v: Value = serde_json::from_slice(&body).map_err(|e| ApiError::bad(format!("the body: {e}")))?;
        let name =
            v.get("filename").and_then(Value::as_str).ok_or_else(|| ApiError::bad("\"filename\" is required"))?;
        check_filename(name).map_err(|why| ApiError::bad(format!("Invalid filename {name:?}: {why}")))?;
        Ok(name.to_string())
    };
    let (what, filename) = match action.as_str() {
        "save" => {
            let f = file()?;
            (SlotAction::Save(dir.join(&f)), Some(f))
        }
        "restore" => {
            let f = file()?;
            (SlotAction::Restore(dir.join(&f)), Some(f))
        }
        "erase" => (SlotAction::Erase, None),
        other => return Err(ApiError::bad(format!("Invalid action {other:?} (save, restore or erase)"))),
    };
    let engine = state.engine()?.clone();
    let done = tokio::task::spawn_blocking(move || engine.slot_action(slot, what))
        .await
        .map_err(|e| ApiError::internal(format!("the slot action: {e}")))?;
    let done = match done {
        Ok(d) => d,
        // a file that cannot be restored is the client's: 400; a save that cannot be written, 500
        Err(EngineError::Model(e)) if action == "restore" => return Err(ApiError::bad(e.to_string())),
        Err(e) => return Err(ApiError::from(&e)),
    };
    let ms = (done.ms * 1e3).round() / 1e3;
    Ok(Json(match action.as_str() {
        "save" => json!({"id_slot": slot, "filename": filename, "n_saved": done.tokens, "n_written": done.bytes,
                         "timings": {"save_ms": ms}}),
        "restore" => json!({"id_slot": slot, "filename": filename, "n_restored": done.tokens, "n_read": done.bytes,
                            "timings": {"restore_ms": ms}}),
        _ => json!({"id_slot": slot, "n_erased": done.tokens}),
    }))
}

/// A file name (not a path) for a slot file, as llama.cpp's `fs_validate_filename` allows:
/// 1 to 255 bytes, no directory separators or characters Windows refuses, no control
/// characters, not `.` or `..`, no leading or trailing space, no trailing dot.
fn check_filename(name: &str) -> Result<(), &'static str> {
    if name.is_empty() || name.len() > 255 {
        return Err("1 to 255 bytes");
    }
    if name == "." || name == ".." {
        return Err("not a file name");
    }
    if let Some(c) = name.chars().find(|c| c.is_control() || "/\\:*?\"<>|".contains(*c)) {
        return Err(if c.is_control() { "a control character" } else { "a path character" });
    }
    if name.starts_with(' ') || name.ends_with(' ') || name.ends_with('.') {
        return Err("a leading or trailing space, or a trailing dot");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check_filename;

    #[test]
    fn slot_file_names_are_names_not_paths() {
        for ok in ["slot0.bin", "agent-42_conv.kv", "ünïcode.bin", ".hidden"] {
            assert_eq!(check_filename(ok), Ok(()), "{ok}");
        }
        let long = "a".repeat(256);
        for bad in ["", ".", "..", "../x", "a/b", "a\\b", "/etc/passwd", "c:x", "a\nb", " a", "a ", "a.", &long] {
            assert!(check_filename(bad).is_err(), "{bad:?}");
        }
    }
}
