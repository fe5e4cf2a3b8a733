//! The protocol-buffers wire format, as far as editing an ONNX file needs: a message is
//! its fields in order, each kept as read, so that what celer does not touch is written
//! back byte for byte (fields it has no name for included, which a generated decoder
//! would drop). Groups (wire types 3 and 4) are refused: ONNX never uses them.

/// A field's value as the wire carries it.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Varint(u64),
    Fixed64(u64),
    Bytes(Vec<u8>),
    Fixed32(u32),
}

/// One field: its number and value.
#[derive(Debug, Clone, PartialEq)]
pub struct Field {
    pub number: u32,
    pub value: Value,
}

/// A message: its fields in the order they came.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Message {
    pub fields: Vec<Field>,
}

/// Why bytes are not a message.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("not a protocol-buffers message: {0}")]
pub struct WireError(pub String);

fn read_varint(bytes: &[u8], at: &mut usize) -> Result<u64, WireError> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *bytes
            .get(*at)
            .ok_or_else(|| WireError("a varint runs past the end".into()))?;
        *at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(WireError("a varint longer than 10 bytes".into()))
}

fn write_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn take<'a>(bytes: &'a [u8], at: &mut usize, n: usize) -> Result<&'a [u8], WireError> {
    let end = at
        .checked_add(n)
        .filter(|&end| end <= bytes.len())
        .ok_or_else(|| WireError(format!("a field of {n} bytes runs past the end")))?;
    let slice = &bytes[*at..end];
    *at = end;
    Ok(slice)
}

impl Message {
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let mut fields = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let key = read_varint(bytes, &mut at)?;
            let number = u32::try_from(key >> 3)
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| WireError(format!("field number {}", key >> 3)))?;
            let value = match key & 7 {
                0 => Value::Varint(read_varint(bytes, &mut at)?),
                1 => {
                    let b = take(bytes, &mut at, 8)?;
                    Value::Fixed64(u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
                }
                2 => {
                    let n = usize::try_from(read_varint(bytes, &mut at)?)
                        .map_err(|_| WireError("a length beyond memory".into()))?;
                    Value::Bytes(take(bytes, &mut at, n)?.to_vec())
                }
                5 => {
                    let b = take(bytes, &mut at, 4)?;
                    Value::Fixed32(u32::from_le_bytes(b.try_into().unwrap_or([0; 4])))
                }
                other => return Err(WireError(format!("wire type {other} (field {number})"))),
            };
            fields.push(Field { number, value });
        }
        Ok(Self { fields })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode_into(&mut out);
        out
    }

    fn encode_into(&self, out: &mut Vec<u8>) {
        for field in &self.fields {
            let key = u64::from(field.number) << 3;
            match &field.value {
                Value::Varint(v) => {
                    write_varint(out, key);
                    write_varint(out, *v);
                }
                Value::Fixed64(v) => {
                    write_varint(out, key | 1);
                    out.extend_from_slice(&v.to_le_bytes());
                }
                Value::Bytes(b) => {
                    write_varint(out, key | 2);
                    write_varint(out, b.len() as u64);
                    out.extend_from_slice(b);
                }
                Value::Fixed32(v) => {
                    write_varint(out, key | 5);
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
    }

    /// The values of field `number`, in order.
    pub fn values(&self, number: u32) -> impl Iterator<Item = &Value> {
        self.fields
            .iter()
            .filter(move |f| f.number == number)
            .map(|f| &f.value)
    }

    /// Field `number`'s byte strings (strings, bytes and sub-messages).
    pub fn bytes(&self, number: u32) -> impl Iterator<Item = &[u8]> {
        self.values(number).filter_map(|v| match v {
            Value::Bytes(b) => Some(b.as_slice()),
            _ => None,
        })
    }

    /// Field `number`'s strings (invalid UTF-8 read lossily: ONNX names are UTF-8).
    pub fn strings(&self, number: u32) -> Vec<String> {
        self.bytes(number)
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .collect()
    }

    /// The last value of string field `number` (protobuf: the last one wins), or "".
    pub fn string(&self, number: u32) -> String {
        self.bytes(number)
            .last()
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .unwrap_or_default()
    }

    /// The last value of varint field `number`, or 0.
    pub fn varint(&self, number: u32) -> u64 {
        self.values(number)
            .filter_map(|v| match v {
                Value::Varint(v) => Some(*v),
                _ => None,
            })
            .last()
            .unwrap_or(0)
    }

    /// Repeated integer field `number`, packed or not, as i64.
    pub fn ints(&self, number: u32) -> Result<Vec<i64>, WireError> {
        let mut out = Vec::new();
        for value in self.values(number) {
            match value {
                Value::Varint(v) => out.push(*v as i64),
                Value::Bytes(packed) => {
                    let mut at = 0;
                    while at < packed.len() {
                        out.push(read_varint(packed, &mut at)? as i64);
                    }
                }
                _ => return Err(WireError(format!("field {number} is not an integer"))),
            }
        }
        Ok(out)
    }

    /// Repeated float field `number`, packed or not.
    pub fn floats(&self, number: u32) -> Result<Vec<f32>, WireError> {
        let mut out = Vec::new();
        for value in self.values(number) {
            match value {
                Value::Fixed32(v) => out.push(f32::from_bits(*v)),
                Value::Bytes(packed) if packed.len() % 4 == 0 => out.extend(
                    packed
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                ),
                _ => return Err(WireError(format!("field {number} is not a float"))),
            }
        }
        Ok(out)
    }

    /// Field `number`'s sub-messages, decoded.
    pub fn messages(&self, number: u32) -> Result<Vec<Message>, WireError> {
        self.bytes(number).map(Message::decode).collect()
    }

    /// Removes every value of field `number`.
    pub fn clear(&mut self, number: u32) {
        self.fields.retain(|f| f.number != number);
    }

    pub fn push_bytes(&mut self, number: u32, bytes: Vec<u8>) -> &mut Self {
        self.fields.push(Field {
            number,
            value: Value::Bytes(bytes),
        });
        self
    }

    pub fn push_string(&mut self, number: u32, s: &str) -> &mut Self {
        self.push_bytes(number, s.as_bytes().to_vec())
    }

    pub fn push_message(&mut self, number: u32, message: &Message) -> &mut Self {
        self.push_bytes(number, message.encode())
    }

    pub fn push_varint(&mut self, number: u32, v: u64) -> &mut Self {
        self.fields.push(Field {
            number,
            value: Value::Varint(v),
        });
        self
    }

    pub fn push_float(&mut self, number: u32, v: f32) -> &mut Self {
        self.fields.push(Field {
            number,
            value: Value::Fixed32(v.to_bits()),
        });
        self
    }

    /// A packed repeated integer field (ONNX's dims and ints).
    pub fn push_packed_ints(&mut self, number: u32, values: &[i64]) -> &mut Self {
        let mut packed = Vec::new();
        for &v in values {
            write_varint(&mut packed, v as u64);
        }
        self.push_bytes(number, packed)
    }

    /// Sets string field `number` to `s`: the first value replaced (others removed), or
    /// appended.
    pub fn set_string(&mut self, number: u32, s: &str) {
        match self.fields.iter().position(|f| f.number == number) {
            Some(i) => {
                self.fields[i].value = Value::Bytes(s.as_bytes().to_vec());
                let mut seen = 0;
                self.fields.retain(|f| {
                    seen += usize::from(f.number == number);
                    f.number != number || seen == 1
                });
            }
            None => {
                self.push_string(number, s);
            }
        }
    }

    /// Sets varint field `number` to `v` in place, or appends it.
    pub fn set_varint(&mut self, number: u32, v: u64) {
        match self.fields.iter_mut().find(|f| f.number == number) {
            Some(f) => f.value = Value::Varint(v),
            None => {
                self.push_varint(number, v);
            }
        }
    }

    /// Replaces the `index`-th value of repeated string field `number` in place.
    pub fn replace_string_at(&mut self, number: u32, index: usize, s: &str) -> bool {
        match self
            .fields
            .iter_mut()
            .filter(|f| f.number == number)
            .nth(index)
        {
            Some(f) => {
                f.value = Value::Bytes(s.as_bytes().to_vec());
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_round_trips_byte_for_byte() {
        let mut m = Message::default();
        m.push_varint(1, 300)
            .push_string(2, "conv")
            .push_float(3, 0.5)
            .push_packed_ints(4, &[1, -1, 3]);
        m.fields.push(Field {
            number: 99,
            value: Value::Fixed64(7),
        });
        let bytes = m.encode();
        let back = Message::decode(&bytes).expect("decode");
        assert_eq!(back, m);
        assert_eq!(back.encode(), bytes);
        assert_eq!(back.varint(1), 300);
        assert_eq!(back.string(2), "conv");
        assert_eq!(back.floats(3).expect("floats"), vec![0.5]);
        assert_eq!(back.ints(4).expect("ints"), vec![1, -1, 3]);
    }

    #[test]
    fn truncated_bytes_are_refused_not_read_past() {
        let mut m = Message::default();
        m.push_string(2, "a longer string");
        let bytes = m.encode();
        assert!(Message::decode(&bytes[..bytes.len() - 3]).is_err());
        assert!(Message::decode(&[0x0b]).is_err(), "wire type 3 (group)");
    }

    #[test]
    fn replacing_one_of_a_repeated_field_keeps_the_order() {
        let mut m = Message::default();
        m.push_string(1, "x")
            .push_string(2, "y")
            .push_string(1, "w");
        assert!(m.replace_string_at(1, 1, "w_dq"));
        assert_eq!(m.strings(1), vec!["x", "w_dq"]);
        assert_eq!(m.fields[1].number, 2);
    }
}
