//! The model contract: what the pipeline description says a model takes (named NCHW
//! image inputs) and gives (the output celer reads), checked once, the same way, against
//! what ONNX Runtime or a TensorRT engine says the model declares. A model that does not
//! fit is refused when it loads, naming what differs, never at the first request.

/// An element type as a model declares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Element {
    F32,
    F16,
    /// Any other type, by the runtime's name for it.
    Other(String),
}

impl std::fmt::Display for Element {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Element::F32 => f.write_str("float32"),
            Element::F16 => f.write_str("float16"),
            Element::Other(name) => f.write_str(name),
        }
    }
}

/// One tensor a model declares; -1 for a dynamic dimension.
#[derive(Debug, Clone, PartialEq)]
pub struct Declared {
    pub name: String,
    pub is_input: bool,
    pub element: Element,
    pub shape: Vec<i64>,
}

/// What the pipeline feeds a model and reads from it.
#[derive(Debug, Clone, Copy)]
pub struct ModelContract<'a> {
    /// The model's name in messages.
    pub label: &'a str,
    /// Each input by name, with the `[N, C, H, W]` shape the pipeline feeds.
    pub inputs: &'a [(&'a str, [usize; 4])],
    pub output: &'a str,
    /// The element types the runtime can feed and read here: ONNX Runtime takes and gives
    /// float32 in celer; an engine may take float16 (the GPU's preprocessing writes it)
    /// and give float16 (a kernel converts it).
    pub elements: &'a [Element],
}

/// How a model fits its contract.
#[derive(Debug, Clone, PartialEq)]
pub struct Agreement {
    /// Per contract input, in order: its element type and whether its declared shape has
    /// a dynamic dimension (which a runtime must then set).
    pub inputs: Vec<(Element, bool)>,
    pub output: Element,
}

/// A model that does not fit the pipeline description.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("model {model} does not fit the pipeline description: {reason}")]
pub struct ContractError {
    pub model: String,
    pub reason: String,
}

impl ModelContract<'_> {
    /// Checks `declared` against the contract: every input fed by name with a shape that
    /// agrees (fixed dimensions equal) and an element type the runtime handles, no input
    /// left unfed, and the output present with such an element type.
    pub fn check(&self, declared: &[Declared]) -> Result<Agreement, ContractError> {
        let refuse = |reason: String| ContractError {
            model: self.label.to_string(),
            reason,
        };
        let inputs: Vec<&Declared> = declared.iter().filter(|d| d.is_input).collect();
        let outputs: Vec<&Declared> = declared.iter().filter(|d| !d.is_input).collect();
        let mut agreed = Vec::with_capacity(self.inputs.len());
        for (name, want) in self.inputs {
            let found = inputs.iter().find(|d| d.name == *name).ok_or_else(|| {
                refuse(format!(
                    "no input named `{name}`; the model's inputs are {}",
                    names(&inputs)
                ))
            })?;
            if !self.accepts(&found.element) {
                return Err(refuse(format!(
                    "input `{name}` is {}, celer feeds {}",
                    found.element,
                    self.handled()
                )));
            }
            let fits = found.shape.len() == want.len()
                && found
                    .shape
                    .iter()
                    .zip(want)
                    .all(|(&have, &want)| have < 0 || have == want as i64);
            if !fits {
                return Err(refuse(format!(
                    "input `{name}` has shape {:?}, the pipeline description gives {want:?}",
                    found.shape
                )));
            }
            agreed.push((found.element.clone(), found.shape.iter().any(|&d| d < 0)));
        }
        if let Some(extra) = inputs
            .iter()
            .find(|d| !self.inputs.iter().any(|(name, _)| *name == d.name))
        {
            return Err(refuse(format!(
                "the model takes an input `{}` that the pipeline description does not feed",
                extra.name
            )));
        }
        let output = outputs
            .iter()
            .find(|d| d.name == self.output)
            .ok_or_else(|| {
                refuse(format!(
                    "no output named `{}`; the model's outputs are {}",
                    self.output,
                    names(&outputs)
                ))
            })?;
        if !self.accepts(&output.element) {
            return Err(refuse(format!(
                "output `{}` is {}, celer reads {}",
                self.output,
                output.element,
                self.handled()
            )));
        }
        Ok(Agreement {
            inputs: agreed,
            output: output.element.clone(),
        })
    }

    /// Whether the runtime handles `element` here.
    fn accepts(&self, element: &Element) -> bool {
        self.elements.contains(element)
    }

    /// The types the runtime handles here, for a message: `float32 or float16`.
    fn handled(&self) -> String {
        let types: Vec<String> = self.elements.iter().map(Element::to_string).collect();
        types.join(" or ")
    }
}

fn names(list: &[&Declared]) -> String {
    list.iter()
        .map(|d| format!("`{}`", d.name))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(name: &str, is_input: bool, element: Element, shape: &[i64]) -> Declared {
        Declared {
            name: name.into(),
            is_input,
            element,
            shape: shape.to_vec(),
        }
    }

    const F32_ONLY: &[Element] = &[Element::F32];

    fn contract<'a>(inputs: &'a [(&'a str, [usize; 4])]) -> ModelContract<'a> {
        ModelContract {
            label: "m.onnx",
            inputs,
            output: "out",
            elements: F32_ONLY,
        }
    }

    #[test]
    fn a_model_that_fits_agrees_and_says_which_inputs_are_dynamic() {
        let declared = [
            tensor("image", true, Element::F32, &[-1, 3, 320, 320]),
            tensor("trimap", true, Element::F32, &[1, 1, 320, 320]),
            tensor("out", false, Element::F32, &[1, 1, 320, 320]),
            tensor("side", false, Element::Other("int64".into()), &[1]),
        ];
        let inputs = [("image", [1, 3, 320, 320]), ("trimap", [1, 1, 320, 320])];
        let agreed = contract(&inputs).check(&declared).unwrap();
        assert_eq!(
            agreed.inputs,
            vec![(Element::F32, true), (Element::F32, false)]
        );
        assert_eq!(agreed.output, Element::F32);
    }

    #[test]
    fn each_misfit_is_named() {
        let declared = [
            tensor("image", true, Element::F32, &[1, 3, 320, 320]),
            tensor("out", false, Element::F16, &[1, 1, 320, 320]),
        ];
        let refuse = |inputs: &[(&str, [usize; 4])], declared: &[Declared]| {
            contract(inputs).check(declared).unwrap_err().reason
        };
        let image = [("image", [1, 3, 320, 320])];
        assert!(refuse(&[("pixels", [1, 3, 320, 320])], &declared)
            .contains("no input named `pixels`; the model's inputs are `image`"));
        assert!(refuse(&[("image", [1, 3, 256, 256])], &declared).contains("has shape"));
        assert!(refuse(&image, &declared).contains("output `out` is float16, celer reads float32"));
        let unfed = [
            tensor("image", true, Element::F32, &[1, 3, 320, 320]),
            tensor("extra", true, Element::F32, &[1]),
            tensor("out", false, Element::F32, &[1, 1, 320, 320]),
        ];
        assert!(refuse(&image, &unfed)
            .contains("input `extra` that the pipeline description does not feed"));
        let no_output = [tensor("image", true, Element::F32, &[1, 3, 320, 320])];
        assert!(refuse(&image, &no_output).contains("no output named `out`"));
    }
}
