//! Reading a JSON object cut down as it is parsed: only the fields the model reads are kept, the
//! rest skipped unread, never held.
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
pub(super) enum Keep {
    /// The whole value.
    All,
    /// Of an object, these fields, each read as its own `Keep` says. Any other value is read whole.
    Fields(&'static [(&'static str, Keep)]),
}

pub(super) use Keep::{All, Fields};

/// Reads one JSON value as its [`Keep`] says.
#[derive(Clone, Copy)]
pub(super) struct Reader(pub(super) &'static Keep);

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
                    kept.insert(name.to_string(), map.next_value_seed(Reader(keep))?);
                }
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Value::Object(kept))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Value, A::Error> {
        Value::deserialize(SeqAccessDeserializer::new(seq))
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

/// Reads an object's key: the field of `Keep::Fields` it names, `None` for one not kept.
struct FieldOf(&'static [(&'static str, Keep)]);

impl<'de> DeserializeSeed<'de> for FieldOf {
    type Value = Option<&'static (&'static str, Keep)>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for FieldOf {
    type Value = Option<&'static (&'static str, Keep)>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(self.0.iter().find(|(name, _)| *name == v))
    }
}
