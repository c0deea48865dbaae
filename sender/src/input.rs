//! Reading rows from CSV or JSON Lines, one at a time (the input is never held whole).
//!
//! CSV: the header row names the fields; `parent.child` columns (`address.line1`, `tags.plan`)
//! become members of the object `parent`; empty cells are omitted; every cell is sent as a
//! string (the API takes strings for every field). JSON Lines: one object a line, sent as it
//! is; blank lines are skipped. A column `error` (CSV) or a member `_error` (JSON Lines) is
//! ignored, so that a rejects file can be corrected and sent again as it is.

use crate::row::{Original, Row, RowError};
use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

/// The column a rejects file adds to CSV, and the member it adds to JSON Lines.
pub const CSV_ERROR_COLUMN: &str = "error";
pub const JSON_ERROR_MEMBER: &str = "_error";

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Jsonl,
    Csv,
}

impl Format {
    /// `.csv` is CSV; `.jsonl` and `.ndjson` are JSON Lines.
    pub fn of_path(path: &Path) -> Option<Format> {
        let extension = path.extension()?.to_str()?.to_ascii_lowercase();
        match extension.as_str() {
            "csv" => Some(Format::Csv),
            "jsonl" | "ndjson" => Some(Format::Jsonl),
            _ => None,
        }
    }
}

/// An open input: the header is read, rows follow.
pub enum Input {
    Csv(CsvRows),
    Jsonl(JsonRows),
}

pub type Source = Box<dyn Read + Send>;

impl Input {
    pub fn open(source: Source, format: Format) -> Result<Input> {
        Ok(match format {
            Format::Csv => Input::Csv(CsvRows::new(source)?),
            Format::Jsonl => Input::Jsonl(JsonRows { reader: BufReader::new(source), buffer: Vec::new() }),
        })
    }

    /// The header of a CSV rejects file: the input's columns and [`CSV_ERROR_COLUMN`].
    pub fn rejects_header(&self) -> Option<Vec<String>> {
        match self {
            Input::Csv(rows) => Some(rows.kept_header().chain([CSV_ERROR_COLUMN.to_owned()]).collect()),
            Input::Jsonl(_) => None,
        }
    }

    /// The next row; `None` at the end; an error only when the input cannot be read on.
    pub fn next_row(&mut self) -> Option<Result<Row>> {
        match self {
            Input::Csv(rows) => rows.next_row(),
            Input::Jsonl(rows) => rows.next_row(),
        }
    }
}

/// Rows in the input, counted without keeping them (for the progress bar's total).
pub fn count_rows(source: Source, format: Format) -> Result<u64> {
    let mut input = Input::open(source, format)?;
    let mut count = 0;
    while let Some(row) = input.next_row() {
        row?;
        count += 1;
    }
    Ok(count)
}

/// What a CSV column becomes in the item.
#[derive(Debug, PartialEq)]
enum Column {
    Field(String),
    Member(String, String),
    Ignored,
}

pub struct CsvRows {
    reader: csv::Reader<Source>,
    header: Vec<String>,
    columns: Vec<Column>,
    record: csv::ByteRecord,
}

impl CsvRows {
    fn new(source: Source) -> Result<CsvRows> {
        // Flexible: a row of the wrong length is that row's error, not the end of the run.
        let mut reader = csv::ReaderBuilder::new().flexible(true).has_headers(true).from_reader(source);
        let header: Vec<String> =
            reader.headers().context("reading the CSV header")?.iter().map(str::to_owned).collect();
        let columns = columns(&header)?;
        Ok(CsvRows { reader, header, columns, record: csv::ByteRecord::new() })
    }

    fn kept_header(&self) -> impl Iterator<Item = String> + '_ {
        self.header.iter().zip(&self.columns).filter(|(_, c)| **c != Column::Ignored).map(|(h, _)| h.clone())
    }

    fn next_row(&mut self) -> Option<Result<Row>> {
        match self.reader.read_byte_record(&mut self.record) {
            Ok(false) => None,
            Ok(true) => Some(Ok(self.row())),
            Err(error) => Some(Err(anyhow::Error::new(error).context("reading the CSV input"))),
        }
    }

    fn row(&self) -> Row {
        let cells: Vec<String> = self.record.iter().map(|cell| String::from_utf8_lossy(cell).into_owned()).collect();
        let kept = cells.iter().enumerate().filter(|(index, _)| self.columns.get(*index) != Some(&Column::Ignored));
        let original = Original::Csv(kept.map(|(_, cell)| cell.clone()).collect());
        let item = if self.record.len() != self.header.len() {
            Err(RowError::new(
                "invalid_csv_row",
                format!("the row has {} cells; the header has {}", self.record.len(), self.header.len()),
            ))
        } else if std::str::from_utf8(self.record.as_slice()).is_err() {
            Err(RowError::new("invalid_csv_row", "the row is not valid UTF-8"))
        } else {
            Ok(serialize(&csv_item(&self.columns, &cells)))
        };
        Row { original, item }
    }
}

/// The meaning of each header cell; refuses a header the rows could not be read against.
fn columns(header: &[String]) -> Result<Vec<Column>> {
    let mut columns = Vec::with_capacity(header.len());
    let mut seen = std::collections::HashSet::new();
    for (index, name) in header.iter().enumerate() {
        // Spreadsheets often start the file with a byte-order mark.
        let name = if index == 0 { name.trim_start_matches('\u{feff}') } else { name.as_str() };
        if name.is_empty() {
            bail!("CSV column {} has no name in the header", index + 1);
        }
        if !seen.insert(name) {
            bail!("CSV column {name:?} appears twice in the header");
        }
        columns.push(match name.split_once('.') {
            _ if name == CSV_ERROR_COLUMN => Column::Ignored,
            Some((parent, child)) if !parent.is_empty() && !child.is_empty() => {
                Column::Member(parent.to_owned(), child.to_owned())
            }
            Some(_) => bail!("CSV column {name:?}: a dotted name is parent.child, e.g. address.line1 or tags.plan"),
            None => Column::Field(name.to_owned()),
        });
    }
    for column in &columns {
        if let Column::Member(parent, _) = column {
            if seen.contains(parent.as_str()) {
                bail!("CSV columns {parent:?} and {parent}.* both set {parent:?}");
            }
        }
    }
    Ok(columns)
}

fn csv_item(columns: &[Column], cells: &[String]) -> Value {
    let mut object = Map::new();
    for (column, cell) in columns.iter().zip(cells).filter(|(_, cell)| !cell.is_empty()) {
        match column {
            Column::Field(name) => {
                object.insert(name.clone(), Value::String(cell.clone()));
            }
            Column::Member(parent, child) => {
                if let Value::Object(members) =
                    object.entry(parent.clone()).or_insert_with(|| Value::Object(Map::new()))
                {
                    members.insert(child.clone(), Value::String(cell.clone()));
                }
            }
            Column::Ignored => {}
        }
    }
    Value::Object(object)
}

pub struct JsonRows {
    reader: BufReader<Source>,
    buffer: Vec<u8>,
}

impl JsonRows {
    fn next_row(&mut self) -> Option<Result<Row>> {
        loop {
            self.buffer.clear();
            match self.reader.read_until(b'\n', &mut self.buffer) {
                Ok(0) => return None,
                Ok(_) if self.buffer.iter().all(u8::is_ascii_whitespace) => continue,
                Ok(_) => return Some(Ok(json_row(&self.buffer))),
                Err(error) => return Some(Err(anyhow::Error::new(error).context("reading the JSON Lines input"))),
            }
        }
    }
}

fn json_row(line: &[u8]) -> Row {
    let text = String::from_utf8_lossy(line).trim_end_matches(['\r', '\n']).to_owned();
    match serde_json::from_slice::<Value>(line) {
        Ok(Value::Object(mut object)) => {
            object.remove(JSON_ERROR_MEMBER);
            Row { original: Original::JsonObject, item: Ok(serialize(&Value::Object(object))) }
        }
        // Sent all the same: the API says what is wrong with it.
        Ok(other) => Row { original: Original::Line(text), item: Ok(serialize(&other)) },
        Err(error) => Row {
            original: Original::Line(text),
            item: Err(RowError::new("invalid_json", format!("the line is not JSON: {error}"))),
        },
    }
}

fn serialize(value: &Value) -> Vec<u8> {
    // A Value always serializes.
    serde_json::to_vec(value).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rows(text: &str, format: Format) -> (Option<Vec<String>>, Vec<Row>) {
        let mut input = Input::open(Box::new(std::io::Cursor::new(text.as_bytes().to_vec())), format)
            .unwrap_or_else(|e| panic!("{e:#}"));
        let mut rows = Vec::new();
        while let Some(row) = input.next_row() {
            rows.push(row.unwrap_or_else(|e| panic!("{e:#}")));
        }
        (input.rejects_header(), rows)
    }

    fn item(row: &Row) -> Value {
        serde_json::from_slice(row.item.as_ref().unwrap_or_else(|e| panic!("{e:?}"))).unwrap_or_default()
    }

    #[test]
    fn csv_columns_become_fields_members_and_omit_empty_cells() {
        let text = "\u{feff}event,external_id,occurred_at,address.line1,address.zip,tags.plan,value,error\n\
                    lead,A1,2026-01-02T03:04:05Z,1 Main St,10001,pro,19.99,old error\n\
                    lead,A2,1767225600000,,,,,\n";
        let (header, rows) = rows(text, Format::Csv);
        assert_eq!(
            item(&rows[0]),
            json!({"event": "lead", "external_id": "A1", "occurred_at": "2026-01-02T03:04:05Z",
                   "address": {"line1": "1 Main St", "zip": "10001"}, "tags": {"plan": "pro"}, "value": "19.99"})
        );
        assert_eq!(item(&rows[1]), json!({"event": "lead", "external_id": "A2", "occurred_at": "1767225600000"}));
        let header = header.unwrap_or_default();
        assert_eq!(header.last().map(String::as_str), Some("error"));
        assert_eq!(header.iter().filter(|h| *h == "error").count(), 1, "the old error column is not kept twice");
        match &rows[0].original {
            Original::Csv(cells) => assert_eq!(cells.len(), header.len() - 1),
            _ => panic!("not CSV"),
        }
    }

    #[test]
    fn a_csv_row_of_the_wrong_length_is_that_rows_error() {
        let (_, rows) = rows("event,external_id\nlead,1\nlead,2,extra\nlead,3\n", Format::Csv);
        assert_eq!(rows.len(), 3);
        assert!(rows[0].item.is_ok() && rows[2].item.is_ok());
        assert_eq!(rows[1].item.as_ref().err().map(|e| e.code.as_str()), Some("invalid_csv_row"));
    }

    #[test]
    fn a_csv_header_that_cannot_be_read_against_is_refused() {
        for header in ["event,event", "event,,x", "address,address.zip", "event,.zip"] {
            let source: Source = Box::new(std::io::Cursor::new(format!("{header}\n").into_bytes()));
            assert!(Input::open(source, Format::Csv).is_err(), "{header}");
        }
    }

    #[test]
    fn json_lines_are_sent_as_they_are_without_the_error_member() {
        let text = "{\"event\":\"lead\",\"external_id\":1,\"_error\":{\"code\":\"x\"}}\r\n\n  \n{not json\n[1]\n";
        let (header, rows) = rows(text, Format::Jsonl);
        assert_eq!(header, None);
        assert_eq!(rows.len(), 3);
        assert_eq!(item(&rows[0]), json!({"event": "lead", "external_id": 1}));
        assert_eq!(rows[1].item.as_ref().err().map(|e| e.code.as_str()), Some("invalid_json"));
        assert!(matches!(&rows[1].original, Original::Line(line) if line == "{not json"));
        assert_eq!(item(&rows[2]), json!([1]));
    }

    #[test]
    fn the_format_follows_the_extension() {
        assert_eq!(Format::of_path(Path::new("a/b.CSV")), Some(Format::Csv));
        assert_eq!(Format::of_path(Path::new("b.ndjson")), Some(Format::Jsonl));
        assert_eq!(Format::of_path(Path::new("b.jsonl")), Some(Format::Jsonl));
        assert_eq!(Format::of_path(Path::new("b.txt")), None);
    }

    #[test]
    fn rows_are_counted() {
        let source: Source = Box::new(std::io::Cursor::new(b"a,b\n1,2\n3,4\n".to_vec()));
        assert_eq!(count_rows(source, Format::Csv).ok(), Some(2));
    }
}
