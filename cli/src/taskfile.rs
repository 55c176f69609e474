//! Reading task files (`punchclock task apply -f FILE`): JSON (an object or
//! an array of objects) or YAML (documents, each an object or a list).
//!
//! Duplicate keys are an error, not "last one wins": YAML 1.2 requires
//! mapping keys to be unique (spec §3.2.1.1), RFC 8259 says names SHOULD be
//! unique, and silently dropping one of two `agent_id`s would run the wrong
//! agent. The error names the key's path.

use serde::Deserialize;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};
use std::fmt;
use std::path::Path;

/// A JSON value read with duplicate map keys rejected.
struct Strict(Value);

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(Strict)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON or YAML value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        serde_json::Number::from_f64(v).map(Value::Number).ok_or_else(|| E::custom(format!("{v} is not a JSON number")))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        Strict::deserialize(d).map(|s| s.0)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(Strict(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let Strict(v) = map.next_value()?;
            if out.contains_key(&key) {
                return Err(de::Error::custom(format!("duplicate key `{key}`")));
            }
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

/// A file's top value as task documents: a list becomes one JSON text per
/// element, converted as it is read (a 20 MB file is never one tree of
/// values in memory); anything else, one document.
struct Documents(Vec<String>);

impl<'de> Deserialize<'de> for Documents {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Top;
        impl<'de> Visitor<'de> for Top {
            type Value = Vec<String>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a task (an object) or a list of tasks")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<String>, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0));
                while let Some(Strict(v)) = seq.next_element()? {
                    out.push(v.to_string());
                }
                Ok(out)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Vec<String>, A::Error> {
                StrictVisitor.visit_map(map).map(|v| vec![v.to_string()])
            }
            fn visit_unit<E>(self) -> Result<Vec<String>, E> {
                Ok(Vec::new())
            }
            fn visit_none<E>(self) -> Result<Vec<String>, E> {
                Ok(Vec::new())
            }
            fn visit_str<E>(self, v: &str) -> Result<Vec<String>, E> {
                Ok(vec![Value::String(v.to_string()).to_string()])
            }
            fn visit_i64<E>(self, v: i64) -> Result<Vec<String>, E> {
                Ok(vec![v.to_string()])
            }
            fn visit_u64<E>(self, v: u64) -> Result<Vec<String>, E> {
                Ok(vec![v.to_string()])
            }
            fn visit_f64<E>(self, v: f64) -> Result<Vec<String>, E> {
                Ok(vec![v.to_string()])
            }
            fn visit_bool<E>(self, v: bool) -> Result<Vec<String>, E> {
                Ok(vec![v.to_string()])
            }
        }
        d.deserialize_any(Top).map(Documents)
    }
}

/// Reads a task file (`-`: standard input). Returns each task as a JSON
/// document, in file order. A file named `*.json` is JSON; standard input
/// is JSON when it starts with `{` or `[` (YAML when it is not valid JSON:
/// flow style such as `{task_id: a}`); anything else is YAML.
///
/// Errors (prefixed with the path, or `<stdin>`): unreadable file, syntax,
/// a duplicate key (with its path, e.g. `[0].execution: duplicate key
/// `max_retries``), no task in the file.
pub fn read(path: &Path) -> Result<Vec<String>, String> {
    let stdin = path == Path::new("-");
    let shown = if stdin { "<stdin>".to_string() } else { path.display().to_string() };
    let text = if stdin {
        let mut t = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut t).map_err(|e| format!("{shown}: {e}"))?;
        t
    } else {
        std::fs::read_to_string(path).map_err(|e| format!("{shown}: {e}"))?
    };
    // Editors on Windows may start a UTF-8 file with a byte-order mark.
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let json = if stdin { text.trim_start().starts_with(['{', '[']) } else { path.extension().is_some_and(|e| e == "json") };
    let fail = |e: &dyn fmt::Display| {
        let msg = e.to_string();
        // libyaml's words for a tab in indentation do not say "tab".
        let tab =
            if msg.contains("cannot start any token") && text.contains('\t') { " (a tab: YAML indents with spaces only)" } else { "" };
        format!("{shown}: {msg}{tab}")
    };
    let parse_json = || -> Result<Vec<String>, String> {
        let mut de = serde_json::Deserializer::from_str(text);
        let Documents(docs) = serde_path_to_error::deserialize(&mut de).map_err(|e| fail(&located(&e)))?;
        // One JSON value per file (an array for several tasks): trailing
        // text is an error, not ignored.
        de.end().map_err(|e| fail(&e))?;
        Ok(docs)
    };
    let parse_yaml = || -> Result<Vec<String>, String> {
        let mut out = Vec::new();
        for doc in serde_yaml_ng::Deserializer::from_str(text) {
            let Documents(docs) = serde_path_to_error::deserialize(doc).map_err(|e| fail(&located(&e)))?;
            out.extend(docs);
        }
        Ok(out)
    };
    let out = match (json, stdin) {
        (false, _) => parse_yaml()?,
        (true, false) => parse_json()?,
        // Standard input that starts like JSON may be YAML's flow style
        // (`{task_id: a, ...}`, unquoted keys): YAML takes it when JSON
        // does not; both errors are said when neither does.
        (true, true) => match parse_json() {
            Ok(docs) => docs,
            Err(json_err) => {
                parse_yaml().map_err(|yaml_err| format!("{json_err} (read as JSON: it starts with {{ or [); as YAML: {yaml_err}"))?
            }
        },
    };
    if out.is_empty() {
        return Err(format!("{shown}: no task in the file"));
    }
    Ok(out)
}

/// The error with its path in front, unless the parser's message already
/// starts with it (serde_yaml_ng's do).
fn located<E: fmt::Display>(e: &serde_path_to_error::Error<E>) -> String {
    let (path, inner) = (e.path().to_string(), e.inner().to_string());
    if path == "." || inner.starts_with(&format!("{path}: ")) { inner } else { format!("{path}: {inner}") }
}

#[cfg(test)]
mod tests {
    use super::read;

    fn file(name: &str, text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join(name);
        std::fs::write(&p, text).expect("write");
        (dir, p)
    }

    #[test]
    fn duplicate_keys_are_rejected_with_their_path() {
        let (_d, p) = file("t.yaml", "task_id: a\nagent_id: x\nexecution:\n  max_retries: 1\n  max_retries: 2\n");
        let e = read(&p).expect_err("duplicate in YAML");
        assert!(e.contains("duplicate key `max_retries`") && e.contains("execution"), "{e}");
        let (_d, p) = file("t.json", r#"[{"task_id": "a", "agent_id": "x", "agent_id": "y"}]"#);
        let e = read(&p).expect_err("duplicate in JSON");
        assert!(e.contains("duplicate key `agent_id`") && e.contains("[0]"), "{e}");
        let (_d, p) = file("t.yaml", "task_id: a\ncontext:\n  params: {a: 1, a: 2}\n");
        let e = read(&p).expect_err("nested duplicate");
        assert_eq!(e.matches("context.params").count(), 1, "the path once: {e}");
        let (_d, p) = file("t.json", r#"{"task_id": "a", "agent_id": "x"} {"task_id": "b", "agent_id": "y"}"#);
        let e = read(&p).expect_err("two JSON values");
        assert!(e.contains("trailing characters"), "{e}");
    }

    #[test]
    fn documents_and_lists_become_one_task_each() {
        let (_d, p) = file("t.yaml", "task_id: a\nagent_id: x\n---\n- {task_id: b, agent_id: y, n: 1.5}\n- {task_id: c, agent_id: z}\n");
        let tasks = read(&p).expect("reads");
        let ids: Vec<String> =
            tasks.iter().map(|t| serde_json::from_str::<serde_json::Value>(t).expect("json")["task_id"].to_string()).collect();
        assert_eq!(ids, ["\"a\"", "\"b\"", "\"c\""]);
        assert!(tasks[1].contains("1.5"), "{}", tasks[1]);
        let (_d, p) = file("t.json", "\u{feff}{\"task_id\": \"a\", \"agent_id\": \"x\"}");
        assert_eq!(read(&p).expect("a BOM is skipped").len(), 1);
    }
}
