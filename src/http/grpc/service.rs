//! `inference.GRPCInferenceService` over the app state the REST routes share: health and
//! metadata as `/v2` answers them, Triton's model configuration, and `ModelInfer`
//! (`infer.rs`) timed, counted and logged as REST's inferences are.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::{Request, Response, Status};

use super::access::CallNote;
use super::infer::model_infer;
use super::status::{code_name, code_of, status_of};
use crate::http::access::{request_id, RequestId};
use crate::http::error::ApiError;
use crate::http::spans::{record_grpc, sample_grpc, GrpcCall};
use crate::http::v2::{model_named, readiness, OutputTensor, INPUTS, MODEL_VERSION};
use crate::http::AppState;
use crate::oip::inference::grpc_inference_service_server::GrpcInferenceService;
use crate::oip::inference::model_config::SchedulingChoice;
use crate::oip::inference::model_metadata_response::TensorMetadata;
use crate::oip::inference::{
    DataType, ModelConfig, ModelConfigRequest, ModelConfigResponse, ModelDynamicBatching,
    ModelInferRequest, ModelInferResponse, ModelInput, ModelMetadataRequest, ModelMetadataResponse,
    ModelOutput, ModelReadyRequest, ModelReadyResponse, ServerLiveRequest, ServerLiveResponse,
    ServerMetadataRequest, ServerMetadataResponse, ServerReadyRequest, ServerReadyResponse,
};

/// When a call's head arrived (a request extension set by the listener's layer, in
/// server.rs): where tonic starts the client's `grpc-timeout`, so where the handler
/// counts it from too.
#[derive(Debug, Clone, Copy)]
pub struct Arrived(pub Instant);

pub struct InferenceService {
    pub state: Arc<AppState>,
}

impl InferenceService {
    /// The model a request names (and its version, when given) must be this server's.
    fn check_model(&self, name: &str, version: &str) -> Result<(), Status> {
        let mut route = vec![("model".to_string(), name.to_string())];
        if !version.is_empty() {
            route.push(("version".to_string(), version.to_string()));
        }
        model_named(&self.state, &route).map_err(|e| status_of(&e))
    }

    fn ready(&self) -> bool {
        readiness(&self.state).1
    }
}

fn protocol_datatype(datatype: &str) -> DataType {
    match datatype {
        "UINT8" => DataType::TypeUint8,
        "BYTES" => DataType::TypeString,
        _ => DataType::TypeInvalid,
    }
}

#[tonic::async_trait]
impl GrpcInferenceService for InferenceService {
    async fn server_live(
        &self,
        _: Request<ServerLiveRequest>,
    ) -> Result<Response<ServerLiveResponse>, Status> {
        Ok(Response::new(ServerLiveResponse { live: true }))
    }

    async fn server_ready(
        &self,
        _: Request<ServerReadyRequest>,
    ) -> Result<Response<ServerReadyResponse>, Status> {
        Ok(Response::new(ServerReadyResponse {
            ready: self.ready(),
        }))
    }

    async fn model_ready(
        &self,
        request: Request<ModelReadyRequest>,
    ) -> Result<Response<ModelReadyResponse>, Status> {
        let r = request.get_ref();
        self.check_model(&r.name, &r.version)?;
        Ok(Response::new(ModelReadyResponse {
            ready: self.ready(),
        }))
    }

    async fn server_metadata(
        &self,
        _: Request<ServerMetadataRequest>,
    ) -> Result<Response<ServerMetadataResponse>, Status> {
        Ok(Response::new(ServerMetadataResponse {
            name: "celer".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            extensions: vec!["model_configuration".into()],
        }))
    }

    async fn model_metadata(
        &self,
        request: Request<ModelMetadataRequest>,
    ) -> Result<Response<ModelMetadataResponse>, Status> {
        let r = request.get_ref();
        self.check_model(&r.name, &r.version)?;
        let tensor = |name: &str, datatype: &str, shape: &[i64]| TensorMetadata {
            name: name.into(),
            datatype: datatype.into(),
            shape: shape.to_vec(),
        };
        Ok(Response::new(ModelMetadataResponse {
            name: self.state.model.name.clone(),
            versions: vec![MODEL_VERSION.into()],
            platform: "celer".into(),
            inputs: INPUTS
                .iter()
                .map(|(name, datatype, shape)| tensor(name, datatype, shape))
                .collect(),
            outputs: OutputTensor::ALL
                .iter()
                .map(|o| {
                    let (datatype, shape) = o.datatype_and_shape();
                    tensor(o.name(), datatype, shape)
                })
                .collect(),
        }))
    }

    /// Triton's model configuration, as `/v2/models/{m}/config` answers it.
    async fn model_config(
        &self,
        request: Request<ModelConfigRequest>,
    ) -> Result<Response<ModelConfigResponse>, Status> {
        let r = request.get_ref();
        self.check_model(&r.name, &r.version)?;
        let model = &self.state.model;
        let config = ModelConfig {
            name: model.name.clone(),
            platform: "celer".into(),
            backend: "celer".into(),
            max_batch_size: 0,
            input: INPUTS
                .iter()
                .map(|(name, datatype, shape)| ModelInput {
                    name: (*name).into(),
                    data_type: protocol_datatype(datatype).into(),
                    dims: shape.to_vec(),
                })
                .collect(),
            output: OutputTensor::ALL
                .iter()
                .map(|o| {
                    let (datatype, shape) = o.datatype_and_shape();
                    ModelOutput {
                        name: o.name().into(),
                        data_type: protocol_datatype(datatype).into(),
                        dims: shape.to_vec(),
                    }
                })
                .collect(),
            scheduling_choice: (model.max_batch > 1).then(|| {
                SchedulingChoice::DynamicBatching(ModelDynamicBatching {
                    preferred_batch_size: vec![model.max_batch as i32],
                    max_queue_delay_microseconds: model.max_wait_us,
                })
            }),
        };
        Ok(Response::new(ModelConfigResponse {
            config: Some(config),
        }))
    }

    async fn model_infer(
        &self,
        request: Request<ModelInferRequest>,
    ) -> Result<Response<ModelInferResponse>, Status> {
        let start = Instant::now();
        let state = &self.state;
        // The listener's layer chose the call's id (and writes its access line).
        let id = match request.extensions().get::<RequestId>() {
            Some(id) => id.0.clone(),
            None => request_id(&request.metadata().clone().into_headers()),
        };
        let note = request.extensions().get::<CallNote>().cloned();
        let sampled = state
            .tracer
            .as_ref()
            .and_then(|t| sample_grpc(t, request.metadata()));
        let timeout = client_timeout(request.metadata());
        // The server's deadline reaches the scheduler, as REST's does: a run past it is
        // a stuck device's sign. The client's `grpc-timeout`, when sooner, ends the call
        // here instead: its ticket dropped, a request still queued is not run.
        // tonic also ends a call at the client's deadline, counted from the call's head,
        // but answers CANCELLED: this timer is set a little earlier, so that the client
        // reads DEADLINE_EXCEEDED, the code the protocol gives a deadline.
        let arrived = request.extensions().get::<Arrived>().map_or(start, |a| a.0);
        // The scheduler orders and refuses by the client's deadline too.
        let within = timeout.map(|t| t.saturating_sub(BEFORE_TONIC));
        let call = model_infer(state, request.into_inner(), arrived, within);
        let result = match timeout {
            // A call whose deadline is no longer than the margin is past it already.
            Some(t) if t <= BEFORE_TONIC => Err(past_client_deadline(t)),
            Some(t) if t < state.limits.deadline => {
                let until = arrived + t.saturating_sub(BEFORE_TONIC);
                tokio::time::timeout_at(until.into(), call)
                    .await
                    .unwrap_or_else(|_| Err(past_client_deadline(t)))
            }
            _ => call.await,
        };
        let took = start.elapsed();
        let (code, status, inference) = match &result {
            Ok((_, inference)) => (tonic::Code::Ok, axum::http::StatusCode::OK, Some(inference)),
            Err(e) => (code_of(e), e.status, None),
        };
        state
            .metrics
            .observe_grpc_inference(code_name(code), status, took, inference);
        if let (Some(tracer), Some(sampled)) = (&state.tracer, &sampled) {
            let call = GrpcCall {
                service: "inference.GRPCInferenceService",
                method: "ModelInfer",
                code: code as i32,
                code_name: code_name(code),
                request_id: &id,
                start,
                end: Instant::now(),
            };
            record_grpc(tracer, sampled, call, inference);
        }
        if let Some(note) = note {
            let trace_id = sampled.as_ref().map(|s| s.trace_id.to_string());
            note.answered(code, inference, trace_id);
        }
        match result {
            Ok((response, _)) => Ok(Response::new(response)),
            Err(e) => Err(status_of(&e)),
        }
    }
}

/// How much sooner than tonic's own timer the client's deadline is answered: more than
/// the timer wheel's millisecond.
const BEFORE_TONIC: Duration = Duration::from_millis(3);

/// The answer when the client's `grpc-timeout` passed first.
fn past_client_deadline(timeout: Duration) -> ApiError {
    ApiError::new(
        axum::http::StatusCode::SERVICE_UNAVAILABLE,
        "deadline_exceeded",
        format!(
            "the call's deadline ({} ms, grpc-timeout) passed before it was answered",
            timeout.as_millis()
        ),
    )
}

/// The client's `grpc-timeout`: up to 8 digits and a unit (H, M, S, m, u, n).
fn client_timeout(metadata: &tonic::metadata::MetadataMap) -> Option<Duration> {
    let text = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = text.split_at(text.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_in_each_unit() {
        let timeout = |v: &'static str| {
            let mut m = tonic::metadata::MetadataMap::new();
            m.insert("grpc-timeout", v.parse().unwrap());
            client_timeout(&m)
        };
        assert_eq!(timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(timeout("1500m"), Some(Duration::from_millis(1500)));
        assert_eq!(timeout("3M"), Some(Duration::from_secs(180)));
        assert_eq!(
            timeout("99999999u"),
            Some(Duration::from_micros(99_999_999))
        );
        for bad in ["", "S", "123456789S", "10x", "-1S"] {
            assert_eq!(timeout(bad), None, "{bad:?}");
        }
        assert_eq!(client_timeout(&tonic::metadata::MetadataMap::new()), None);
    }
}
