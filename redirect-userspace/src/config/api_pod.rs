//! A Pod as the API serves it, read from its JSON in one pass straight into the raw shape the
//! loader checks ([`RawPod`]): no JSON tree, no YAML, and the rest of the Pod (managed fields,
//! container specs, most of the status) skipped unread. At 100,000 Pods the first list is mostly
//! this.
//!
//! Only what reads the same from JSON as from YAML is read typed: text where text goes, a whole
//! number where a port goes, a mapping where a part goes, a list where a list goes. Anything else
//! (a number for a name, a list for a container, a null) is kept as the JSON it was
//! ([`Part::Odd`]), and then the whole Pod is read the YAML way, so its errors are word for word
//! those of a Pod read whole.
use std::fmt;

use serde::{
    Deserialize, Deserializer,
    de::{
        DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor,
        value::{MapAccessDeserializer, SeqAccessDeserializer},
    },
};
use serde_json::{Map, Value};

use super::{
    convert::RawMeta,
    kube::{RawContainer, RawContainerPort, RawPod, RawPodIp, RawPodSpec, RawPodStatus},
    labels::Labels,
};

/// A value read where a part of the Pod goes: that part, or the JSON it held instead.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Part<T> {
    Typed(T),
    Odd(Value),
}

/// A part of a Pod: what it is read from. Any other JSON is kept as it is ([`Part::Odd`]).
pub(crate) trait Shape: Sized {
    fn text(_: &str) -> Option<Self> {
        None
    }

    fn whole(_: i64) -> Option<Self> {
        None
    }

    fn mapping<'de, A: MapAccess<'de>>(map: A) -> Result<Part<Self>, A::Error> {
        Ok(Part::Odd(Value::deserialize(MapAccessDeserializer::new(
            map,
        ))?))
    }

    fn list<'de, A: SeqAccess<'de>>(seq: A) -> Result<Part<Self>, A::Error> {
        Ok(Part::Odd(Value::deserialize(SeqAccessDeserializer::new(
            seq,
        ))?))
    }

    /// Whether anything in it is kept as JSON.
    fn has_odd(&self) -> bool {
        false
    }

    /// As JSON: what a reader of the whole JSON would have kept of it.
    fn into_json(self) -> Value;
}

impl<T: Shape> Part<T> {
    fn has_odd(&self) -> bool {
        match self {
            Part::Typed(t) => t.has_odd(),
            Part::Odd(_) => true,
        }
    }

    /// As JSON: what a reader of the whole JSON would have kept of it.
    pub(crate) fn into_json(self) -> Value {
        match self {
            Part::Typed(t) => t.into_json(),
            Part::Odd(v) => v,
        }
    }

    /// The part; `None` for one kept as JSON (never asked once [`Part::has_odd`] said no).
    fn typed(self) -> Option<T> {
        match self {
            Part::Typed(t) => Some(t),
            Part::Odd(_) => None,
        }
    }
}

fn any_odd<T: Shape>(part: &Option<Part<T>>) -> bool {
    part.as_ref().is_some_and(Part::has_odd)
}

impl<'de, T: Shape> Deserialize<'de> for Part<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(PartVisitor(std::marker::PhantomData))
    }
}

struct PartVisitor<T>(std::marker::PhantomData<T>);

impl<'de, T: Shape> Visitor<'de> for PartVisitor<T> {
    type Value = Part<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Part<T>, A::Error> {
        T::mapping(map)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Part<T>, A::Error> {
        T::list(seq)
    }

    fn visit_str<E>(self, v: &str) -> Result<Part<T>, E> {
        Ok(T::text(v).map_or_else(|| Part::Odd(Value::from(v)), Part::Typed))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Part<T>, E> {
        Ok(T::whole(v).map_or_else(|| Part::Odd(Value::from(v)), Part::Typed))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Part<T>, E> {
        Ok(i64::try_from(v)
            .ok()
            .and_then(T::whole)
            .map_or_else(|| Part::Odd(Value::from(v)), Part::Typed))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Part<T>, E> {
        Ok(Part::Odd(Value::from(v)))
    }

    fn visit_bool<E>(self, v: bool) -> Result<Part<T>, E> {
        Ok(Part::Odd(Value::Bool(v)))
    }

    fn visit_unit<E>(self) -> Result<Part<T>, E> {
        Ok(Part::Odd(Value::Null))
    }

    fn visit_none<E>(self) -> Result<Part<T>, E> {
        Ok(Part::Odd(Value::Null))
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Part<T>, D::Error> {
        Part::deserialize(deserializer)
    }
}

impl Shape for String {
    fn text(v: &str) -> Option<Self> {
        Some(v.to_string())
    }

    fn into_json(self) -> Value {
        Value::String(self)
    }
}

/// A port number: YAML and JSON read any whole number the same; a fraction they do not.
impl Shape for i64 {
    fn whole(v: i64) -> Option<Self> {
        Some(v)
    }

    fn into_json(self) -> Value {
        Value::from(self)
    }
}

/// Labels: text values. A label given twice is its last value, as JSON read whole has it.
impl Shape for Labels {
    fn mapping<'de, A: MapAccess<'de>>(mut map: A) -> Result<Part<Self>, A::Error> {
        let mut labels = Labels::new();
        while let Some(key) = map.next_key::<String>()? {
            match map.next_value::<Part<String>>()? {
                Part::Typed(value) => {
                    labels.insert(key, value);
                }
                Part::Odd(value) => {
                    let mut json: Map<String, Value> = labels
                        .into_iter()
                        .map(|(k, v)| (k, Value::String(v)))
                        .collect();
                    json.insert(key, value);
                    while let Some(key) = map.next_key::<String>()? {
                        json.insert(key, map.next_value()?);
                    }
                    return Ok(Part::Odd(Value::Object(json)));
                }
            }
        }
        Ok(Part::Typed(labels))
    }

    fn into_json(self) -> Value {
        Value::Object(
            self.into_iter()
                .map(|(k, v)| (k, Value::String(v)))
                .collect(),
        )
    }
}

/// A list of parts; an item kept as JSON leaves the others typed.
impl<T: Shape> Shape for Vec<Part<T>> {
    fn list<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<Part<Self>, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(16));
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Part::Typed(items))
    }

    fn has_odd(&self) -> bool {
        self.iter().any(Part::has_odd)
    }

    fn into_json(self) -> Value {
        Value::Array(self.into_iter().map(Part::into_json).collect())
    }
}

/// Reads an object's key: its place among `names`, `None` for a field not read.
struct FieldOf(&'static [&'static str]);

impl<'de> DeserializeSeed<'de> for FieldOf {
    type Value = Option<usize>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl Visitor<'_> for FieldOf {
    type Value = Option<usize>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(self.0.iter().position(|name| *name == v))
    }
}

/// Declares a part of a Pod read field by field: each field named, each an `Option<Part<_>>`
/// (absent, or what it held). A field given twice is its last value, as JSON read whole has it.
macro_rules! fields {
    ($(#[$doc:meta])* $name:ident { $($field:ident: $ty:ty = $json:literal),* $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Default, PartialEq)]
        pub(crate) struct $name {
            $(pub(crate) $field: Option<Part<$ty>>,)*
        }

        impl $name {
            const NAMES: &'static [&'static str] = &[$($json),*];
        }

        impl Shape for $name {
            fn mapping<'de, A: MapAccess<'de>>(mut map: A) -> Result<Part<Self>, A::Error> {
                let mut read = $name::default();
                while let Some(field) = map.next_key_seed(FieldOf(Self::NAMES))? {
                    let Some(field) = field else {
                        map.next_value::<IgnoredAny>()?;
                        continue;
                    };
                    let mut i = 0;
                    $(
                        if field == i {
                            read.$field = Some(map.next_value()?);
                            continue;
                        }
                        i += 1;
                    )*
                    let _ = i;
                }
                Ok(Part::Typed(read))
            }

            fn has_odd(&self) -> bool {
                false $(|| any_odd(&self.$field))*
            }

            fn into_json(self) -> Value {
                let mut json = Map::new();
                $(
                    if let Some(part) = self.$field {
                        json.insert($json.to_string(), part.into_json());
                    }
                )*
                Value::Object(json)
            }
        }
    };
}

fields!(
    /// What is read of a Pod: its metadata, spec and status.
    PodParts {
        metadata: MetaParts = "metadata",
        spec: SpecParts = "spec",
        status: StatusParts = "status",
    }
);

fields!(
    /// What is read of a Pod's metadata; `resourceVersion` is the watch's.
    MetaParts {
        name: String = "name",
        namespace: String = "namespace",
        labels: Labels = "labels",
        creation_timestamp: String = "creationTimestamp",
        uid: String = "uid",
        resource_version: String = "resourceVersion",
    }
);

fields!(
    SpecParts {
        node_name: String = "nodeName",
        containers: Vec<Part<ContainerParts>> = "containers",
    }
);

fields!(
    ContainerParts {
        ports: Vec<Part<PortParts>> = "ports",
    }
);

fields!(PortParts {
    name: String = "name",
    container_port: i64 = "containerPort",
});

fields!(
    StatusParts {
        pod_ip: String = "podIP",
        pod_ips: Vec<Part<IpParts>> = "podIPs",
    }
);

fields!(IpParts { ip: String = "ip" });

/// A Pod read from the API's JSON: typed, or (when anything in it is odd) as JSON.
pub(crate) type ApiPodParts = Part<PodParts>;

/// Reads a Pod's JSON, whatever it holds.
pub(crate) fn read_api_pod_parts<'de, D: Deserializer<'de>>(d: D) -> Result<ApiPodParts, D::Error> {
    Part::deserialize(d)
}

impl ApiPodParts {
    /// Its metadata to change in place, when it is typed.
    pub(crate) fn meta_mut(&mut self) -> Option<&mut MetaParts> {
        match self {
            Part::Typed(PodParts {
                metadata: Some(Part::Typed(meta)),
                ..
            }) => Some(meta),
            _ => None,
        }
    }

    /// The raw Pod when every part read typed (of another node's Pod, what that watch keeps:
    /// no uid, age or node), else what a reader of the whole JSON would have kept of it.
    pub(super) fn into_raw(self, elsewhere: bool) -> Result<RawPod, Value> {
        if self.has_odd() {
            return Err(self.into_json());
        }
        let pod = self.typed().unwrap_or_default();
        let meta = pod.metadata.and_then(Part::typed).map(|m| RawMeta {
            name: m.name.and_then(Part::typed),
            namespace: m.namespace.and_then(Part::typed),
            labels: m.labels.and_then(Part::typed),
            creation_timestamp: m
                .creation_timestamp
                .and_then(Part::typed)
                .filter(|_| !elsewhere),
            uid: m.uid.and_then(Part::typed).filter(|_| !elsewhere),
        });
        let spec = pod.spec.and_then(Part::typed).map(|s| RawPodSpec {
            node_name: s.node_name.and_then(Part::typed).filter(|_| !elsewhere),
            containers: s.containers.and_then(Part::typed).map(|cs| {
                cs.into_iter()
                    .filter_map(Part::typed)
                    .map(|c| RawContainer {
                        ports: c.ports.and_then(Part::typed).map(|ports| {
                            ports
                                .into_iter()
                                .filter_map(Part::typed)
                                .map(|p| RawContainerPort {
                                    name: p.name.and_then(Part::typed),
                                    container_port: p.container_port.and_then(Part::typed),
                                })
                                .collect()
                        }),
                    })
                    .collect()
            }),
        });
        let status = pod.status.and_then(Part::typed).map(|s| RawPodStatus {
            pod_ip: s.pod_ip.and_then(Part::typed),
            pod_ips: s.pod_ips.and_then(Part::typed).map(|ips| {
                ips.into_iter()
                    .filter_map(Part::typed)
                    .map(|ip| RawPodIp {
                        ip: ip.ip.and_then(Part::typed),
                    })
                    .collect()
            }),
        });
        Ok(RawPod {
            metadata: meta,
            spec,
            status,
        })
    }
}
