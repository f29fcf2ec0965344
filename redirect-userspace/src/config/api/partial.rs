//! Reading a JSON value cut down as it is parsed: only the fields a [`Keep`] names are kept, the
//! rest skipped unread, never held. The one reader of the API's objects: each kind says what of
//! it the model reads as a tree of [`Keep`], and the same tree says where a part goes, for
//! [`super::reads_as_its_yaml`].
use std::fmt;

use serde::{
    Deserialize, Deserializer,
    de::{
        DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor,
        value::{MapAccessDeserializer, SeqAccessDeserializer},
    },
};
use serde_json::{Map, Value};

/// The parts of a JSON value to read; whatever else is skipped unread.
#[derive(Debug)]
pub(crate) enum Keep {
    /// The whole value.
    All,
    /// A part (a mapping): these fields, each read as its own `Keep` says; a field named `*`
    /// stands for every field not named. Any other value is read whole.
    Fields(&'static [(&'static str, Keep)]),
    /// A list: each item as this `Keep` says. Any other value is read whole.
    Each(&'static Keep),
}

pub(crate) use Keep::{All, Each, Fields};

/// A part kept whole: its fields, whatever they are.
pub(crate) const PART: Keep = Fields(&[("*", All)]);

/// Reads one JSON value as its [`Keep`] says.
#[derive(Clone, Copy)]
pub(crate) struct Reader(pub(crate) &'static Keep);

impl<'de> DeserializeSeed<'de> for Reader {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        match self.0 {
            All => Value::deserialize(deserializer),
            _ => deserializer.deserialize_any(self),
        }
    }
}

impl<'de> Visitor<'de> for Reader {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let Fields(fields) = self.0 else {
            return Value::deserialize(MapAccessDeserializer::new(map));
        };
        let mut kept = Map::new();
        while let Some(field) = map.next_key_seed(FieldOf(fields))? {
            match field {
                // A field given twice is its last value, as JSON read whole has it.
                Some((name, keep)) => {
                    kept.insert(name, map.next_value_seed(Reader(keep))?);
                }
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Value::Object(kept))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let Each(item) = self.0 else {
            return Value::deserialize(SeqAccessDeserializer::new(seq));
        };
        let mut kept = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(16));
        while let Some(value) = seq.next_element_seed(Reader(item))? {
            kept.push(value);
        }
        Ok(Value::Array(kept))
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

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::from(v))
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

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        self.deserialize(deserializer)
    }
}

/// Reads an object's key: the field of `Keep::Fields` it names (or `*`), `None` for one not kept.
struct FieldOf(&'static [(&'static str, Keep)]);

impl<'de> DeserializeSeed<'de> for FieldOf {
    type Value = Option<(String, &'static Keep)>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for FieldOf {
    type Value = Option<(String, &'static Keep)>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        let named = self.0.iter().find(|(name, _)| *name == v);
        let field = named.or_else(|| self.0.iter().find(|(name, _)| *name == "*"));
        Ok(field.map(|(_, keep)| (v.to_string(), keep)))
    }
}
