//! Metadata key/value store with typed getters whose errors name the key, the expected type and
//! the file.

use crate::value::{Array, Value};
use crate::{Error, Result};
use std::collections::HashMap;

/// The metadata of a GGUF file, in file order, with lookup by key.
#[derive(Debug, Clone)]
pub struct Metadata {
    path: String,
    entries: Vec<(String, Value)>,
    index: HashMap<String, usize>,
}

/// `$get` (the value of `key` as `$t`; absent is an error) and `$opt` (absent is `Ok(None)`):
/// `$conv` gives `Some` for a value `$v` of the type, else the error names `$name`.
macro_rules! getters {
    ($get:ident, $opt:ident, $t:ty, $name:literal, $doc:literal, |$v:ident| $conv:expr) => {
        #[doc = concat!("The value of `key` as ", $name, $doc)]
        pub fn $get(&self, key: &str) -> Result<$t> {
            self.$opt(key)?.ok_or_else(|| self.missing(key))
        }

        #[doc = concat!("Like [`Metadata::", stringify!($get), "`], but `Ok(None)` when the key is absent.")]
        pub fn $opt(&self, key: &str) -> Result<Option<$t>> {
            let Some($v) = self.get(key) else { return Ok(None) };
            $conv.map(Some).ok_or_else(|| self.wrong_type(key, $name, $v))
        }
    };
}

macro_rules! int_getters {
    ($get:ident, $opt:ident, $t:ty, $name:literal) => {
        getters!($get, $opt, $t, $name, "; any integer type that holds it losslessly is accepted.", |v| v
            .as_i128()
            .and_then(|i| <$t>::try_from(i).ok()));
    };
}

macro_rules! array_getter {
    ($get:ident, $variant:ident, $t:ty, $name:literal) => {
        #[doc = concat!("The value of `key`, which must be an ", $name, ".")]
        pub fn $get(&self, key: &str) -> Result<&[$t]> {
            match self.get(key) {
                None => Err(self.missing(key)),
                Some(Value::Array(Array::$variant(v))) => Ok(v),
                Some(v) => Err(self.wrong_type(key, $name, v)),
            }
        }
    };
}

/// llama.cpp's `--override-kv KEY=TYPE:VALUE`: TYPE is `int` (an i64), `float` (an f64),
/// `bool` (`true` or `false`) or `str`; the key and a string are at most 127 bytes, as llama.cpp
/// has them. The error says what is wrong with `spec`.
pub fn parse_kv_override(spec: &str) -> std::result::Result<(String, Value), String> {
    const MAX: usize = 127;
    let bad = |why: &str| format!("'{spec}': {why} (KEY=TYPE:VALUE, TYPE one of int, float, bool, str)");
    let (key, typed) = spec.split_once('=').ok_or_else(|| bad("no '='"))?;
    if key.is_empty() || key.len() > MAX {
        return Err(bad("the key must be 1 to 127 bytes"));
    }
    let (ty, text) = typed.split_once(':').ok_or_else(|| bad("no ':' after the type"))?;
    let value = match ty {
        "int" => Value::I64(text.trim().parse().map_err(|_| bad(&format!("'{text}' is not an integer")))?),
        "float" => match text.trim().parse::<f64>() {
            Ok(x) if x.is_finite() => Value::F64(x),
            _ => return Err(bad(&format!("'{text}' is not a finite number"))),
        },
        "bool" => match text {
            "true" => Value::Bool(true),
            "false" => Value::Bool(false),
            _ => return Err(bad(&format!("'{text}' is not true or false"))),
        },
        "str" if text.len() > MAX => return Err(bad("a string of at most 127 bytes")),
        "str" => Value::String(text.to_string()),
        _ => return Err(bad(&format!("unknown type '{ty}'"))),
    };
    Ok((key.to_string(), value))
}

impl Metadata {
    pub(crate) fn new(path: String, entries: Vec<(String, Value)>) -> Metadata {
        let index = entries.iter().enumerate().map(|(i, (k, _))| (k.clone(), i)).collect();
        Metadata { path, entries, index }
    }

    /// The file this metadata came from (for messages).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// All entries in file order.
    pub fn entries(&self) -> &[(String, Value)] {
        &self.entries
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    pub fn contains(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    /// Sets `key` to `value`, replacing the file's value or adding the key (llama.cpp's
    /// `--override-kv`); whatever reads the metadata checks it as it checks the file's.
    pub fn set(&mut self, key: &str, value: Value) {
        match self.index.get(key) {
            Some(&i) => self.entries[i].1 = value,
            None => {
                self.index.insert(key.to_string(), self.entries.len());
                self.entries.push((key.to_string(), value));
            }
        }
    }

    fn missing(&self, key: &str) -> Error {
        Error::MissingKey { path: self.path.clone(), key: key.to_string() }
    }

    fn wrong_type(&self, key: &str, expected: &str, found: &Value) -> Error {
        let found = match found.as_i128() {
            Some(i) => format!("{} {i}", found.type_description()),
            None => found.type_description(),
        };
        Error::WrongType { path: self.path.clone(), key: key.to_string(), expected: expected.to_string(), found }
    }

    int_getters!(get_u32, opt_u32, u32, "u32");
    int_getters!(get_i32, opt_i32, i32, "i32");
    int_getters!(get_u64, opt_u64, u64, "u64");
    int_getters!(get_u16, opt_u16, u16, "u16");

    getters!(get_f32, opt_f32, f32, "f32", " (an f64 is narrowed).", |v| match v {
        Value::F32(x) => Some(*x),
        Value::F64(x) => Some(*x as f32),
        _ => None,
    });
    getters!(get_bool, opt_bool, bool, "bool", ".", |v| match v {
        Value::Bool(x) => Some(*x),
        _ => None,
    });
    getters!(get_str, opt_str, &str, "string", ".", |v| match v {
        Value::String(x) => Some(x.as_str()),
        _ => None,
    });

    /// The value of `key`, which must be an array of any element type.
    pub fn get_array(&self, key: &str) -> Result<&Array> {
        match self.get(key) {
            None => Err(self.missing(key)),
            Some(Value::Array(a)) => Ok(a),
            Some(v) => Err(self.wrong_type(key, "array", v)),
        }
    }

    array_getter!(get_str_array, String, String, "array of string");
    array_getter!(get_f32_array, F32, f32, "array of f32");
    array_getter!(get_i32_array, I32, i32, "array of i32");

    /// The value of `key` as a list of u32: an integer array whose elements all fit, or a single
    /// integer (llama.cpp stores per-layer values either way).
    pub fn get_u32_list(&self, key: &str) -> Result<Vec<u32>> {
        let v = self.get(key).ok_or_else(|| self.missing(key))?;
        let bad = || self.wrong_type(key, "u32 or array of u32", v);
        if let Some(i) = v.as_i128() {
            return u32::try_from(i).map(|x| vec![x]).map_err(|_| bad());
        }
        let Value::Array(a) = v else { return Err(bad()) };
        (0..a.len())
            .map(|i| a.get(i).and_then(|e| e.as_i128()).and_then(|e| u32::try_from(e).ok()).ok_or_else(bad))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_parse_as_llama_cpp_writes_them() {
        let ok = |s: &str| parse_kv_override(s).unwrap();
        assert_eq!(ok("deepseek2.expert_used_count=int:6"), ("deepseek2.expert_used_count".into(), Value::I64(6)));
        assert_eq!(ok("a.b=float:-0.5").1, Value::F64(-0.5));
        assert_eq!(ok("tokenizer.ggml.add_bos_token=bool:false").1, Value::Bool(false));
        assert_eq!(ok("general.name=str:a=b:c").1, Value::String("a=b:c".into()));
        for (bad, says) in [
            ("novalue", "no '='"),
            ("=int:1", "1 to 127 bytes"),
            ("k=6", "no ':'"),
            ("k=int:six", "not an integer"),
            ("k=int:99999999999999999999", "not an integer"),
            ("k=float:nan", "finite"),
            ("k=bool:1", "true or false"),
            ("k=u32:1", "unknown type 'u32'"),
        ] {
            let e = parse_kv_override(bad).unwrap_err();
            assert!(e.contains(says) && e.contains(bad), "{bad}: {e}");
        }
        assert!(parse_kv_override(&format!("k=str:{}", "x".repeat(128))).is_err());
        assert!(parse_kv_override(&format!("{}=int:1", "k".repeat(128))).is_err());
    }

    #[test]
    fn a_set_value_replaces_or_adds_and_is_read_as_the_files() {
        let mut m = Metadata::new("f.gguf".into(), vec![("n".into(), Value::U32(8)), ("s".into(), Value::Bool(true))]);
        m.set("n", Value::I64(6));
        m.set("new", Value::F64(0.25));
        assert_eq!((m.get_u32("n").unwrap(), m.get_f32("new").unwrap(), m.len()), (6, 0.25, 3));
        m.set("n", Value::I64(-1));
        assert!(m.get_u32("n").unwrap_err().to_string().contains("'n': expected u32, found i64 -1"));
        assert_eq!(m.entries()[0].0, "n");
    }
}
