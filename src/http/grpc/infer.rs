//! `ModelInfer`: a `ModelInferRequest` -> the image (decoded or copied on the blocking
//! pool) -> the request path REST's `infer` takes (`invocations::run_image`) -> the
//! outputs asked for, in raw contents when the input came raw (Triton's and KServe's
//! clients read either), else typed. The tensors are the REST routes': `image` (`BYTES
//! [1]`, an encoded image) or `image_rgb` (`UINT8 [H, W, 3]`); `alpha`, `trimap` (`UINT8
//! [H, W]`) and `cutout` (`BYTES [1]`, PNG, or WebP with the string parameter `format`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};

use crate::codec::decode::DecodeLimits;
use crate::codec::ImageFormat;
use crate::http::access::Inference;
use crate::http::answer_time::AnswerKind;
use crate::http::error::ApiError;
use crate::http::invocations::{
    blocking, refuse_unreachable_before_decoding, run_image, timed_decode,
};
use crate::http::urgency;
use crate::http::v2::{
    bad, bytes_element, model_named, rgb_pixels, rgb_shape, OutputTensor, INPUT_ENCODED, INPUT_RGB,
    MODEL_VERSION,
};
use crate::http::AppState;
use crate::matte::{MattePlanes, MissingPlane, Planes};
use crate::oip::inference::infer_parameter::ParameterChoice;
use crate::oip::inference::model_infer_request::InferInputTensor;
use crate::oip::inference::model_infer_response::InferOutputTensor;
use crate::oip::inference::{InferTensorContents, ModelInferRequest, ModelInferResponse};
use crate::pixels::{HostAlloc, RgbPixels};
use crate::sched::Readiness;

/// An output asked for.
#[derive(Debug, Clone, Copy)]
struct Asked {
    tensor: OutputTensor,
    format: ImageFormat,
}

/// A request once parsed: the image and what to answer, and how.
struct Parsed {
    image: RgbPixels,
    decode_time: Duration,
    id: String,
    asked: Vec<Asked>,
    /// The input came in `raw_input_contents`: answer in `raw_output_contents`.
    raw: bool,
}

/// Answers `message`, which arrived at `arrived`, by its deadline: the server's, or
/// sooner the client's (`client_within` of it: its `grpc-timeout`; or the request's
/// `timeout`, microseconds, or `deadline_ms` parameter), at its `priority` parameter.
/// What `Inference` says of the request goes to the access line and the metrics.
pub async fn model_infer(
    state: &Arc<AppState>,
    message: ModelInferRequest,
    arrived: Instant,
    client_within: Option<Duration>,
) -> Result<(ModelInferResponse, Inference), ApiError> {
    let mut route = vec![("model".to_string(), message.model_name.clone())];
    if !message.model_version.is_empty() {
        route.push(("version".to_string(), message.model_version.clone()));
    }
    model_named(state, &route)?;
    let mut asked = urgency(&message)?;
    asked.within = urgency::sooner(asked.within, client_within);
    let terms = asked.terms(arrived, state.limits.deadline)?;
    // Before the replicas are loaded (an engine build takes minutes; the CPU may serve
    // meanwhile) or after a failed load, UNAVAILABLE at once: a gRPC client retries that,
    // where a request queued behind the load would wait out its deadline. A draining
    // server still answers.
    if !matches!(
        state.scheduler.readiness(),
        Readiness::Ready | Readiness::Interim { .. }
    ) {
        return Err(ApiError::new(
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            "not_ready",
            "the model is not loaded (yet); grpc.health.v1 and ServerReady say when it is",
        ));
    }
    // The message is here whole (tonic read it under the size limit, holding no slot):
    // admitted now, before any decoding, as REST's bodies are once read.
    let admission = state.scheduler.admit()?;
    let limits = state.limits.decode;
    let pixels = state.pixels.clone();
    let checking = state.clone();
    let parsed = blocking(&state.work, move || {
        // Refused for its deadline from the image's header, before its decode, as an
        // image body to /invocations is.
        let before_decode = |encoded: &[u8], planes: Planes| {
            refuse_unreachable_before_decoding(
                &checking,
                encoded,
                planes,
                &terms,
                AnswerKind::V2Grpc,
            )
        };
        parse(message, &limits, pixels.as_ref(), &before_decode)
    })
    .await?;
    let planes = OutputTensor::planes(parsed.asked.iter().map(|a| a.tensor));
    let served = run_image(
        state,
        admission,
        parsed.image,
        parsed.decode_time,
        planes,
        terms,
        AnswerKind::V2Grpc,
    )
    .await?;
    let model = state.model.name.clone();
    let (id, asked, raw) = (parsed.id, parsed.asked, parsed.raw);
    let (response, inference, (w, h)) = served
        .encode(&state.work, move |planes| {
            answer(model, id, &asked, raw, planes)
        })
        .await?;
    let size = prost::Message::encoded_len(&response);
    if let Some(limit) = state.hosting.max_response_bytes.filter(|&l| size > l) {
        return Err(ApiError::new(
            axum::http::StatusCode::PAYLOAD_TOO_LARGE,
            "response_too_large",
            format!(
                "the answer for a {w}x{h} image is {size} bytes, over this server's response \
                 limit of {limit} bytes ({} hosting); ask for fewer outputs (`alpha` alone is \
                 {w}x{h} bytes), the cut-out with the parameter format=webp, or a smaller image",
                state.hosting.mode
            ),
        ));
    }
    Ok((response, inference))
}

/// The `priority`, `timeout` (microseconds, as Triton reads it) and `deadline_ms`
/// parameters of a request, as whole numbers.
fn urgency(message: &ModelInferRequest) -> Result<urgency::Asked, ApiError> {
    let number = |key: &str| -> Result<Option<u64>, ApiError> {
        match message
            .parameters
            .get(key)
            .and_then(|p| p.parameter_choice.as_ref())
        {
            None => Ok(None),
            Some(ParameterChoice::Uint64Param(v)) => Ok(Some(*v)),
            Some(ParameterChoice::Int64Param(v)) if *v >= 0 => Ok(Some(*v as u64)),
            Some(other) => Err(bad(format!(
                "parameter `{key}` is {other:?}: expected a whole number"
            ))),
        }
    };
    let timeout = number("timeout")?.map(Duration::from_micros);
    let deadline = number("deadline_ms")?.map(Duration::from_millis);
    Ok(urgency::Asked {
        priority: number("priority")?,
        within: urgency::sooner(timeout, deadline),
    })
}

/// The number of elements a shape holds; every dimension must be known.
fn elements(name: &str, shape: &[i64]) -> Result<u64, ApiError> {
    shape.iter().try_fold(1u64, |n, &d| {
        u64::try_from(d)
            .ok()
            .and_then(|d| n.checked_mul(d))
            .ok_or_else(|| bad(format!("input `{name}`: bad shape {shape:?}")))
    })
}

/// What a request's parse asks before an encoded image is decoded: whether to go on,
/// from the image's bytes (its header says its size) and the planes its outputs need.
type BeforeDecode<'a> = &'a dyn Fn(&[u8], Planes) -> Result<(), ApiError>;

/// The request's image decoded (or copied from its raw tensor) within `limits`, once
/// `before_decode` has let an encoded one through, and the outputs it asks for.
fn parse(
    mut message: ModelInferRequest,
    limits: &DecodeLimits,
    pixels: &dyn HostAlloc,
    before_decode: BeforeDecode<'_>,
) -> Result<Parsed, ApiError> {
    let input: InferInputTensor = match std::mem::take(&mut message.inputs).try_into() {
        Ok::<[InferInputTensor; 1], _>([input]) => input,
        Err(inputs) => {
            return Err(bad(format!(
            "give one input, `{INPUT_ENCODED}` (BYTES) or `{INPUT_RGB}` (UINT8 [H, W, 3]); got {}",
            inputs.len()
        )))
        }
    };
    let raw = match std::mem::take(&mut message.raw_input_contents).try_into() {
        Ok::<[Bytes; 1], _>([raw]) => Some(raw),
        Err(raws) if raws.is_empty() => None,
        Err(raws) => {
            return Err(bad(format!(
                "{} raw_input_contents for one input",
                raws.len()
            )))
        }
    };
    let contents = match (raw.is_some(), input.contents) {
        (true, Some(_)) => {
            return Err(bad(format!(
                "input `{}` has both contents and raw_input_contents",
                input.name
            )))
        }
        (_, contents) => contents.unwrap_or_default(),
    };
    let asked: Vec<Asked> = if message.outputs.is_empty() {
        OutputTensor::ALL
            .into_iter()
            .map(|tensor| Asked {
                tensor,
                format: ImageFormat::Png,
            })
            .collect()
    } else {
        message
            .outputs
            .iter()
            .map(|o| {
                let format = match o
                    .parameters
                    .get("format")
                    .and_then(|p| p.parameter_choice.as_ref())
                {
                    None => ImageFormat::Png,
                    Some(ParameterChoice::StringParam(f)) if f == "png" => ImageFormat::Png,
                    Some(ParameterChoice::StringParam(f)) if f == "webp" => ImageFormat::Webp,
                    Some(other) => {
                        return Err(bad(format!(
                            "output `{}`: format {other:?}: expected the string png or webp",
                            o.name
                        )))
                    }
                };
                Ok(Asked {
                    tensor: OutputTensor::parse(&o.name)?,
                    format,
                })
            })
            .collect::<Result<_, _>>()?
    };
    let (image, decode_time) = match (input.name.as_str(), input.datatype.as_str()) {
        (INPUT_ENCODED, "BYTES") => {
            if elements(&input.name, &input.shape)? != 1 {
                return Err(bad(format!(
                    "input `{INPUT_ENCODED}` holds one image: shape [1], got {:?}",
                    input.shape
                )));
            }
            let encoded: &[u8] = match (&raw, &contents.bytes_contents[..]) {
                (Some(raw), _) => bytes_element(raw)?,
                (None, [one]) => one,
                (None, many) => {
                    return Err(bad(format!(
                        "input `{INPUT_ENCODED}` holds one image; its contents hold {}",
                        many.len()
                    )))
                }
            };
            before_decode(encoded, OutputTensor::planes(asked.iter().map(|a| a.tensor)))?;
            timed_decode(encoded, limits, pixels)?
        }
        (INPUT_RGB, "UINT8") => {
            let t = Instant::now();
            let size = rgb_shape(&input.shape, limits)?;
            let image = match &raw {
                Some(raw) => rgb_pixels(&input.shape, size, raw, pixels)?,
                None => {
                    let typed = &contents.uint_contents;
                    // Checked before copying: the count, then each value.
                    if typed.len() != size.2 {
                        return Err(bad(format!(
                            "input `{INPUT_RGB}` of shape {:?} needs {} values; got {}",
                            input.shape,
                            size.2,
                            typed.len()
                        )));
                    }
                    let bytes = typed
                        .iter()
                        .map(|&v| u8::try_from(v).map_err(|_| bad(format!("UINT8 data holds {v}"))))
                        .collect::<Result<Vec<u8>, _>>()?;
                    rgb_pixels(&input.shape, size, &bytes, pixels)?
                }
            };
            (image, t.elapsed())
        }
        (name, datatype) => {
            return Err(bad(format!(
                "input `{name}` of {datatype}: this model takes `{INPUT_ENCODED}` as BYTES or `{INPUT_RGB}` as UINT8"
            )))
        }
    };
    Ok(Parsed {
        image,
        decode_time,
        id: message.id,
        asked,
        raw: raw.is_some(),
    })
}

/// The answer: each output's tensor, its data raw (`raw_output_contents`, a BYTES element
/// with its 4-byte length) or typed (`uint_contents`, `bytes_contents`).
fn answer(
    model: String,
    id: String,
    asked: &[Asked],
    raw: bool,
    planes: &MattePlanes,
) -> Result<ModelInferResponse, ApiError> {
    let (w, h) = planes.dimensions();
    let missing = |e: MissingPlane| ApiError::internal(e);
    let mut response = ModelInferResponse {
        model_name: model,
        model_version: MODEL_VERSION.to_string(),
        id,
        ..ModelInferResponse::default()
    };
    for a in asked {
        let (datatype, _) = a.tensor.datatype_and_shape();
        let mut tensor = InferOutputTensor {
            name: a.tensor.name().to_string(),
            datatype: datatype.to_string(),
            ..InferOutputTensor::default()
        };
        match a.tensor {
            OutputTensor::Alpha | OutputTensor::Trimap => {
                let plane = if a.tensor == OutputTensor::Alpha {
                    planes.alpha()
                } else {
                    planes.trimap()
                }
                .map_err(missing)?;
                tensor.shape = vec![i64::from(h), i64::from(w)];
                if raw {
                    response
                        .raw_output_contents
                        .push(Bytes::copy_from_slice(plane.as_raw()));
                } else {
                    tensor.contents = Some(InferTensorContents {
                        uint_contents: plane.as_raw().iter().map(|&v| u32::from(v)).collect(),
                        ..InferTensorContents::default()
                    });
                }
            }
            OutputTensor::Cutout => {
                let rgba = planes.cutout().map_err(missing)?;
                let encoded = a
                    .format
                    .encode(rgba.as_raw(), w, h, image::ExtendedColorType::Rgba8)
                    .map_err(ApiError::internal)?;
                tensor.shape = vec![1];
                if raw {
                    let mut element = BytesMut::with_capacity(4 + encoded.len());
                    element.put_u32_le(encoded.len() as u32);
                    element.put_slice(&encoded);
                    response.raw_output_contents.push(element.freeze());
                } else {
                    tensor.contents = Some(InferTensorContents {
                        bytes_contents: vec![Bytes::from(encoded)],
                        ..InferTensorContents::default()
                    });
                }
            }
        }
        response.outputs.push(tensor);
    }
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oip::inference::model_infer_request::InferRequestedOutputTensor;
    use crate::pixels::Heap;

    fn png(w: u32, h: u32) -> Vec<u8> {
        let mut out = Vec::new();
        image::RgbImage::from_pixel(w, h, image::Rgb([9, 8, 7]))
            .write_to(&mut std::io::Cursor::new(&mut out), image::ImageFormat::Png)
            .unwrap();
        out
    }

    fn input(name: &str, datatype: &str, shape: Vec<i64>) -> InferInputTensor {
        InferInputTensor {
            name: name.into(),
            datatype: datatype.into(),
            shape,
            ..InferInputTensor::default()
        }
    }

    fn request(input: InferInputTensor, raw: Vec<Bytes>) -> ModelInferRequest {
        ModelInferRequest {
            model_name: "celer".into(),
            inputs: vec![input],
            raw_input_contents: raw,
            ..ModelInferRequest::default()
        }
    }

    fn parse_default(m: ModelInferRequest) -> Result<Parsed, ApiError> {
        parse(m, &DecodeLimits::default(), &Heap, &|_, _| Ok(()))
    }

    #[test]
    fn bytes_input_raw_and_typed() {
        let image = png(16, 12);
        let mut element = (image.len() as u32).to_le_bytes().to_vec();
        element.extend_from_slice(&image);
        let parsed = parse_default(request(
            input("image", "BYTES", vec![1]),
            vec![Bytes::from(element)],
        ))
        .unwrap();
        assert_eq!(parsed.image.dimensions(), (16, 12));
        assert!(parsed.raw);
        assert_eq!(parsed.asked.len(), 3);

        let mut typed = input("image", "BYTES", vec![1]);
        typed.contents = Some(InferTensorContents {
            bytes_contents: vec![Bytes::from(image.clone())],
            ..InferTensorContents::default()
        });
        let parsed = parse_default(request(typed, vec![])).unwrap();
        assert_eq!(parsed.image.dimensions(), (16, 12));
        assert!(!parsed.raw);
    }

    #[test]
    fn an_encoded_image_is_shown_to_the_check_before_its_decode() {
        // Cut inside its pixels: its decode would fail, its header is whole.
        let mut image = png(16, 12);
        image.truncate(image.len() - 12);
        let mut typed = input("image", "BYTES", vec![1]);
        typed.contents = Some(InferTensorContents {
            bytes_contents: vec![Bytes::from(image)],
            ..InferTensorContents::default()
        });
        let mut m = request(typed, vec![]);
        m.outputs = vec![InferRequestedOutputTensor {
            name: "cutout".into(),
            ..InferRequestedOutputTensor::default()
        }];
        let seen = std::sync::Mutex::new(None);
        let refuse = |encoded: &[u8], planes: Planes| {
            *seen.lock().unwrap() = Some((crate::codec::decode::dimensions(encoded), planes));
            Err(ApiError::new(
                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                "deadline_unreachable",
                "refused",
            ))
        };
        let refused = parse(m.clone(), &DecodeLimits::default(), &Heap, &refuse);
        assert_eq!(refused.err().unwrap().code, "deadline_unreachable");
        let (dimensions, planes) = seen.lock().unwrap().take().expect("checked");
        assert_eq!(dimensions, Some((16, 12)));
        assert!(planes.cutout && !planes.alpha);
        // Let through, the cut is found by the decode.
        let decoded = parse_default(m);
        assert_eq!(
            decoded.err().unwrap().status,
            axum::http::StatusCode::BAD_REQUEST
        );
    }

    #[test]
    fn uint8_input_checked_against_its_shape_and_the_limits() {
        let pixels: Vec<u8> = (0..10 * 8 * 3).map(|v| v as u8).collect();
        let parsed = parse_default(request(
            input("image_rgb", "UINT8", vec![8, 10, 3]),
            vec![Bytes::from(pixels.clone())],
        ))
        .unwrap();
        assert_eq!(parsed.image.dimensions(), (10, 8));
        assert_eq!(&parsed.image.as_raw()[..], &pixels[..]);

        let mut typed = input("image_rgb", "UINT8", vec![1, 8, 10, 3]);
        typed.contents = Some(InferTensorContents {
            uint_contents: pixels.iter().map(|&v| u32::from(v)).collect(),
            ..InferTensorContents::default()
        });
        let parsed = parse_default(request(typed, vec![])).unwrap();
        assert_eq!(&parsed.image.as_raw()[..], &pixels[..]);

        // Refused: a shape over the pixel limit (before a byte is read), one whose
        // product overflows, a wrong byte count, a value over 255, a wrong datatype, two
        // raw contents, and an unknown output.
        let huge = parse_default(request(
            input("image_rgb", "UINT8", vec![100_000, 100_000, 3]),
            vec![Bytes::new()],
        ));
        assert_eq!(
            huge.err().unwrap().status,
            axum::http::StatusCode::PAYLOAD_TOO_LARGE
        );
        let mut over = input("image_rgb", "UINT8", vec![8, 10, 3]);
        over.contents = Some(InferTensorContents {
            uint_contents: vec![300; 240],
            ..InferTensorContents::default()
        });
        let mut unknown_output = request(input("image", "BYTES", vec![1]), vec![]);
        unknown_output.outputs = vec![Default::default()];
        for m in [
            request(
                input("image", "BYTES", vec![i64::MAX, 4]),
                vec![Bytes::new()],
            ),
            request(
                input("image_rgb", "UINT8", vec![8, 10, 3]),
                vec![Bytes::from(vec![0; 7])],
            ),
            request(over, vec![]),
            request(input("image", "FP32", vec![1]), vec![Bytes::new()]),
            request(
                input("image", "BYTES", vec![1]),
                vec![Bytes::new(), Bytes::new()],
            ),
            request(
                input("image", "BYTES", vec![1]),
                vec![Bytes::from_static(&[9, 0, 0, 0, 1])],
            ),
            unknown_output,
        ] {
            let e = parse_default(m).err().expect("refused");
            assert!(e.status.is_client_error(), "{e:?}");
        }
    }

    #[test]
    fn answers_raw_and_typed() {
        let matte = crate::matte::Matte::from_images(
            image::GrayImage::from_raw(2, 1, vec![0, 255]).unwrap(),
            image::GrayImage::from_raw(2, 1, vec![0, 128]).unwrap(),
        );
        let cutout = image::RgbaImage::from_raw(2, 1, vec![0, 0, 0, 0, 1, 2, 3, 255]).unwrap();
        let planes = MattePlanes::from_matte(matte, Some(cutout.clone()));
        let all = OutputTensor::ALL.map(|tensor| Asked {
            tensor,
            format: ImageFormat::Png,
        });
        let raw = answer("m".into(), "7".into(), &all, true, &planes).unwrap();
        assert_eq!(raw.id, "7");
        assert_eq!(raw.outputs[0].shape, vec![1, 2]);
        assert_eq!(&raw.raw_output_contents[0][..], &[0, 255]);
        assert_eq!(&raw.raw_output_contents[1][..], &[0, 128]);
        let png = bytes_element(&raw.raw_output_contents[2]).unwrap();
        assert_eq!(
            image::load_from_memory(png).unwrap().into_rgba8().as_raw(),
            cutout.as_raw()
        );

        let typed = answer("m".into(), String::new(), &all, false, &planes).unwrap();
        assert!(typed.raw_output_contents.is_empty());
        let contents = |i: usize| typed.outputs[i].contents.as_ref().unwrap();
        assert_eq!(contents(0).uint_contents, vec![0, 255]);
        assert_eq!(contents(1).uint_contents, vec![0, 128]);
        assert_eq!(contents(2).bytes_contents.len(), 1);
    }
}
