//! The rejects file: every failed row in the input's format with its error, so that it can be
//! corrected and sent again. CSV: the input's columns and an `error` column
//! (`code: path: message; ...`). JSON Lines: the object with an `_error` member holding the
//! API's error object; a line that was not a JSON object becomes `{"_line": "...", "_error": ...}`.

use crate::input::JSON_ERROR_MEMBER;
use crate::row::{Original, RowError};
use anyhow::{Context, Result};
use serde_json::{json, Value};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

pub enum Rejects {
    Csv(Box<csv::Writer<File>>),
    Jsonl(BufWriter<File>),
}

impl Rejects {
    /// Creates the file; `csv_header` for CSV input (see `Input::rejects_header`).
    pub fn create(path: &Path, csv_header: Option<Vec<String>>) -> Result<Rejects> {
        let file = File::create(path).with_context(|| format!("creating the rejects file {}", path.display()))?;
        Ok(match csv_header {
            Some(header) => {
                // Flexible: a row of the wrong length is written back as it was.
                let mut writer = csv::WriterBuilder::new().flexible(true).from_writer(file);
                writer.write_record(&header)?;
                Rejects::Csv(Box::new(writer))
            }
            None => Rejects::Jsonl(BufWriter::new(file)),
        })
    }

    /// Writes one failed row; `item` is the row's serialized item when it had one.
    pub fn write(&mut self, original: &Original, item: Option<&[u8]>, error: &RowError) -> Result<()> {
        match (self, original) {
            (Rejects::Csv(writer), Original::Csv(cells)) => {
                writer.write_record(cells.iter().map(String::as_str).chain([error.text().as_str()]))?;
            }
            (Rejects::Jsonl(writer), original) => {
                serde_json::to_writer(&mut *writer, &json_reject(original, item, error))?;
                writer.write_all(b"\n")?;
            }
            (Rejects::Csv(writer), _) => {
                // A CSV input only has CSV rows; written as a lone error cell all the same.
                writer.write_record([error.text()])?;
            }
        }
        Ok(())
    }

    pub fn flush(&mut self) -> Result<()> {
        match self {
            Rejects::Csv(writer) => writer.flush()?,
            Rejects::Jsonl(writer) => writer.flush()?,
        }
        Ok(())
    }
}

fn json_reject(original: &Original, item: Option<&[u8]>, error: &RowError) -> Value {
    let error = serde_json::to_value(error).unwrap_or(Value::Null);
    let object = match original {
        Original::JsonObject => item.and_then(|item| serde_json::from_slice::<Value>(item).ok()),
        _ => None,
    };
    match (object, original) {
        (Some(Value::Object(mut object)), _) => {
            object.insert(JSON_ERROR_MEMBER.to_owned(), error);
            Value::Object(object)
        }
        (_, Original::Line(line)) => json!({ "_line": line, JSON_ERROR_MEMBER: error }),
        _ => json!({ JSON_ERROR_MEMBER: error }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::CSV_ERROR_COLUMN;

    #[test]
    fn json_rejects_carry_the_object_and_its_error() {
        let error = RowError::new("validation_failed", "bad");
        let object = json_reject(&Original::JsonObject, Some(br#"{"event":"x y"}"#), &error);
        assert_eq!(object, json!({"event": "x y", "_error": {"code": "validation_failed", "message": "bad"}}));
        let line = json_reject(&Original::Line("{oops".to_owned()), None, &error);
        assert_eq!(line, json!({"_line": "{oops", "_error": {"code": "validation_failed", "message": "bad"}}));
    }

    #[test]
    fn csv_rejects_add_the_error_column() {
        let path = std::env::temp_dir().join(format!("intake-send-rejects-{}.csv", std::process::id()));
        let mut rejects = Rejects::create(&path, Some(vec!["event".into(), CSV_ERROR_COLUMN.into()]))
            .unwrap_or_else(|e| panic!("{e:#}"));
        let error = RowError::new("invalid_csv_row", "the row has 3 cells; the header has 1");
        rejects.write(&Original::Csv(vec!["a,b".into()]), None, &error).unwrap_or_else(|e| panic!("{e:#}"));
        rejects.flush().unwrap_or_else(|e| panic!("{e:#}"));
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let _ = std::fs::remove_file(&path);
        assert_eq!(text, "event,error\n\"a,b\",invalid_csv_row: the row has 3 cells; the header has 1\n");
    }
}
