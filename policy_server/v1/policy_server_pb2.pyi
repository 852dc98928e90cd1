from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]

class ImageEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IMAGE_ENCODING_UNSPECIFIED: _ClassVar[ImageEncoding]
    IMAGE_ENCODING_JPEG: _ClassVar[ImageEncoding]
    IMAGE_ENCODING_PNG: _ClassVar[ImageEncoding]
    IMAGE_ENCODING_RAW: _ClassVar[ImageEncoding]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT64: DType
DTYPE_FLOAT16: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
DTYPE_UINT8: DType
DTYPE_BOOL: DType
IMAGE_ENCODING_UNSPECIFIED: ImageEncoding
IMAGE_ENCODING_JPEG: ImageEncoding
IMAGE_ENCODING_PNG: ImageEncoding
IMAGE_ENCODING_RAW: ImageEncoding

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("encoding", "height", "width", "channels", "data", "capture_time_ns")
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    encoding: ImageEncoding
    height: int
    width: int
    channels: int
    data: bytes
    capture_time_ns: int
    def __init__(self, encoding: _Optional[_Union[ImageEncoding, str]] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., channels: _Optional[int] = ..., data: _Optional[bytes] = ..., capture_time_ns: _Optional[int] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ("budget_ms", "rate_hz")
    BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    budget_ms: float
    rate_hz: float
    def __init__(self, budget_ms: _Optional[float] = ..., rate_hz: _Optional[float] = ...) -> None: ...

class CameraSpec(_message.Message):
    __slots__ = ("name", "height", "width", "channels", "encodings", "max_side", "min_side")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    ENCODINGS_FIELD_NUMBER: _ClassVar[int]
    MAX_SIDE_FIELD_NUMBER: _ClassVar[int]
    MIN_SIDE_FIELD_NUMBER: _ClassVar[int]
    name: str
    height: int
    width: int
    channels: int
    encodings: _containers.RepeatedScalarFieldContainer[ImageEncoding]
    max_side: int
    min_side: int
    def __init__(self, name: _Optional[str] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., channels: _Optional[int] = ..., encodings: _Optional[_Iterable[_Union[ImageEncoding, str]]] = ..., max_side: _Optional[int] = ..., min_side: _Optional[int] = ...) -> None: ...

class ActionSpec(_message.Message):
    __slots__ = ("dim", "names", "units", "low", "high")
    DIM_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    UNITS_FIELD_NUMBER: _ClassVar[int]
    LOW_FIELD_NUMBER: _ClassVar[int]
    HIGH_FIELD_NUMBER: _ClassVar[int]
    dim: int
    names: _containers.RepeatedScalarFieldContainer[str]
    units: _containers.RepeatedScalarFieldContainer[str]
    low: _containers.RepeatedScalarFieldContainer[float]
    high: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, dim: _Optional[int] = ..., names: _Optional[_Iterable[str]] = ..., units: _Optional[_Iterable[str]] = ..., low: _Optional[_Iterable[float]] = ..., high: _Optional[_Iterable[float]] = ...) -> None: ...

class EmbodimentSpec(_message.Message):
    __slots__ = ("name", "cameras", "state_dim", "state_names", "state_units", "action", "default_chunk_size", "min_chunk_size", "max_chunk_size", "control_hz", "state_low", "state_high")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAMERAS_FIELD_NUMBER: _ClassVar[int]
    STATE_DIM_FIELD_NUMBER: _ClassVar[int]
    STATE_NAMES_FIELD_NUMBER: _ClassVar[int]
    STATE_UNITS_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MIN_CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTROL_HZ_FIELD_NUMBER: _ClassVar[int]
    STATE_LOW_FIELD_NUMBER: _ClassVar[int]
    STATE_HIGH_FIELD_NUMBER: _ClassVar[int]
    name: str
    cameras: _containers.RepeatedCompositeFieldContainer[CameraSpec]
    state_dim: int
    state_names: _containers.RepeatedScalarFieldContainer[str]
    state_units: _containers.RepeatedScalarFieldContainer[str]
    action: ActionSpec
    default_chunk_size: int
    min_chunk_size: int
    max_chunk_size: int
    control_hz: float
    state_low: _containers.RepeatedScalarFieldContainer[float]
    state_high: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, name: _Optional[str] = ..., cameras: _Optional[_Iterable[_Union[CameraSpec, _Mapping]]] = ..., state_dim: _Optional[int] = ..., state_names: _Optional[_Iterable[str]] = ..., state_units: _Optional[_Iterable[str]] = ..., action: _Optional[_Union[ActionSpec, _Mapping]] = ..., default_chunk_size: _Optional[int] = ..., min_chunk_size: _Optional[int] = ..., max_chunk_size: _Optional[int] = ..., control_hz: _Optional[float] = ..., state_low: _Optional[_Iterable[float]] = ..., state_high: _Optional[_Iterable[float]] = ...) -> None: ...

class ProfilePoint(_message.Message):
    __slots__ = ("label", "p50_ms", "p95_ms", "full_calls", "skipped_calls")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    P50_MS_FIELD_NUMBER: _ClassVar[int]
    P95_MS_FIELD_NUMBER: _ClassVar[int]
    FULL_CALLS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_CALLS_FIELD_NUMBER: _ClassVar[int]
    label: str
    p50_ms: float
    p95_ms: float
    full_calls: int
    skipped_calls: int
    def __init__(self, label: _Optional[str] = ..., p50_ms: _Optional[float] = ..., p95_ms: _Optional[float] = ..., full_calls: _Optional[int] = ..., skipped_calls: _Optional[int] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_sessions", "max_message_bytes", "max_reason_tokens", "max_instruction_tokens", "max_prompt_tokens", "max_text_bytes", "max_budget_ms", "max_rate_hz", "max_temperature", "max_frame_side", "max_dynamics_ms", "max_dynamics_calls", "min_rate_hz", "max_client_name_chars", "max_reason_calls", "max_request_id_chars")
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_REASON_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_INSTRUCTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TEXT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    MAX_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_SIDE_FIELD_NUMBER: _ClassVar[int]
    MAX_DYNAMICS_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_DYNAMICS_CALLS_FIELD_NUMBER: _ClassVar[int]
    MIN_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    MAX_CLIENT_NAME_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_REASON_CALLS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_ID_CHARS_FIELD_NUMBER: _ClassVar[int]
    max_sessions: int
    max_message_bytes: int
    max_reason_tokens: int
    max_instruction_tokens: int
    max_prompt_tokens: int
    max_text_bytes: int
    max_budget_ms: float
    max_rate_hz: float
    max_temperature: float
    max_frame_side: int
    max_dynamics_ms: float
    max_dynamics_calls: int
    min_rate_hz: float
    max_client_name_chars: int
    max_reason_calls: int
    max_request_id_chars: int
    def __init__(self, max_sessions: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_reason_tokens: _Optional[int] = ..., max_instruction_tokens: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., max_text_bytes: _Optional[int] = ..., max_budget_ms: _Optional[float] = ..., max_rate_hz: _Optional[float] = ..., max_temperature: _Optional[float] = ..., max_frame_side: _Optional[int] = ..., max_dynamics_ms: _Optional[float] = ..., max_dynamics_calls: _Optional[int] = ..., min_rate_hz: _Optional[float] = ..., max_client_name_chars: _Optional[int] = ..., max_reason_calls: _Optional[int] = ..., max_request_id_chars: _Optional[int] = ...) -> None: ...

class Capacity(_message.Message):
    __slots__ = ("embodiment", "chunk_size", "budget_ms", "rate_hz", "sessions_alone", "sessions_more")
    EMBODIMENT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_ALONE_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_MORE_FIELD_NUMBER: _ClassVar[int]
    embodiment: str
    chunk_size: int
    budget_ms: float
    rate_hz: float
    sessions_alone: int
    sessions_more: int
    def __init__(self, embodiment: _Optional[str] = ..., chunk_size: _Optional[int] = ..., budget_ms: _Optional[float] = ..., rate_hz: _Optional[float] = ..., sessions_alone: _Optional[int] = ..., sessions_more: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "digest", "device", "num_steps", "diffusion_cache", "temporal_compression", "quality_profile")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    DIFFUSION_CACHE_FIELD_NUMBER: _ClassVar[int]
    TEMPORAL_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    QUALITY_PROFILE_FIELD_NUMBER: _ClassVar[int]
    name: str
    digest: str
    device: str
    num_steps: int
    diffusion_cache: bool
    temporal_compression: int
    quality_profile: str
    def __init__(self, name: _Optional[str] = ..., digest: _Optional[str] = ..., device: _Optional[str] = ..., num_steps: _Optional[int] = ..., diffusion_cache: _Optional[bool] = ..., temporal_compression: _Optional[int] = ..., quality_profile: _Optional[str] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("protocol_version", "server_version", "model", "embodiments", "limits", "default_budget_ms", "warmup_profile", "ready", "capacity")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EMBODIMENTS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_PROFILE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    protocol_version: str
    server_version: str
    model: ModelInfo
    embodiments: _containers.RepeatedCompositeFieldContainer[EmbodimentSpec]
    limits: Limits
    default_budget_ms: float
    warmup_profile: _containers.RepeatedCompositeFieldContainer[ProfilePoint]
    ready: bool
    capacity: _containers.RepeatedCompositeFieldContainer[Capacity]
    def __init__(self, protocol_version: _Optional[str] = ..., server_version: _Optional[str] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., embodiments: _Optional[_Iterable[_Union[EmbodimentSpec, _Mapping]]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., default_budget_ms: _Optional[float] = ..., warmup_profile: _Optional[_Iterable[_Union[ProfilePoint, _Mapping]]] = ..., ready: _Optional[bool] = ..., capacity: _Optional[_Iterable[_Union[Capacity, _Mapping]]] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("embodiment", "instruction", "budget_ms", "chunk_size", "seed", "client_name", "rate_hz", "actions_per_chunk", "preview", "request_id")
    EMBODIMENT_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_PER_CHUNK_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    embodiment: str
    instruction: str
    budget_ms: float
    chunk_size: int
    seed: int
    client_name: str
    rate_hz: float
    actions_per_chunk: int
    preview: bool
    request_id: str
    def __init__(self, embodiment: _Optional[str] = ..., instruction: _Optional[str] = ..., budget_ms: _Optional[float] = ..., chunk_size: _Optional[int] = ..., seed: _Optional[int] = ..., client_name: _Optional[str] = ..., rate_hz: _Optional[float] = ..., actions_per_chunk: _Optional[int] = ..., preview: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id", "epoch", "embodiment", "instruction", "budget_ms", "chunk_size", "seed", "rate_hz", "slot_ms", "measured_rate_hz", "preview", "client_name")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EMBODIMENT_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    SLOT_MS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    embodiment: str
    instruction: str
    budget_ms: float
    chunk_size: int
    seed: int
    rate_hz: float
    slot_ms: float
    measured_rate_hz: float
    preview: bool
    client_name: str
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., embodiment: _Optional[str] = ..., instruction: _Optional[str] = ..., budget_ms: _Optional[float] = ..., chunk_size: _Optional[int] = ..., seed: _Optional[int] = ..., rate_hz: _Optional[float] = ..., slot_ms: _Optional[float] = ..., measured_rate_hz: _Optional[float] = ..., preview: _Optional[bool] = ..., client_name: _Optional[str] = ...) -> None: ...

class ResetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetBudgetRequest(_message.Message):
    __slots__ = ("session_id", "budget_ms")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    budget_ms: float
    def __init__(self, session_id: _Optional[str] = ..., budget_ms: _Optional[float] = ...) -> None: ...

class Observation(_message.Message):
    __slots__ = ("images", "state", "instruction", "step_index", "client_time_ns", "committed_actions")
    class ImagesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Image
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Image, _Mapping]] = ...) -> None: ...
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    images: _containers.MessageMap[str, Image]
    state: Tensor
    instruction: str
    step_index: int
    client_time_ns: int
    committed_actions: Tensor
    def __init__(self, images: _Optional[_Mapping[str, Image]] = ..., state: _Optional[_Union[Tensor, _Mapping]] = ..., instruction: _Optional[str] = ..., step_index: _Optional[int] = ..., client_time_ns: _Optional[int] = ..., committed_actions: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ActRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "observation")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    observation: Observation
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., observation: _Optional[_Union[Observation, _Mapping]] = ...) -> None: ...

class TickRecord(_message.Message):
    __slots__ = ("budget_ms", "deadline_ms", "predicted_ms", "actual_ms", "knobs", "full_calls", "skipped_calls", "forced_skips", "fail_open", "fallbacks", "deadline_met", "setting", "thresholds", "branches", "feasible", "best_achievable_ms")
    class PredictedMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class ActualMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class KnobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class BranchesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: BranchCounts
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[BranchCounts, _Mapping]] = ...) -> None: ...
    BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_MS_FIELD_NUMBER: _ClassVar[int]
    ACTUAL_MS_FIELD_NUMBER: _ClassVar[int]
    KNOBS_FIELD_NUMBER: _ClassVar[int]
    FULL_CALLS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_CALLS_FIELD_NUMBER: _ClassVar[int]
    FORCED_SKIPS_FIELD_NUMBER: _ClassVar[int]
    FAIL_OPEN_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MET_FIELD_NUMBER: _ClassVar[int]
    SETTING_FIELD_NUMBER: _ClassVar[int]
    THRESHOLDS_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    FEASIBLE_FIELD_NUMBER: _ClassVar[int]
    BEST_ACHIEVABLE_MS_FIELD_NUMBER: _ClassVar[int]
    budget_ms: float
    deadline_ms: float
    predicted_ms: _containers.ScalarMap[str, float]
    actual_ms: _containers.ScalarMap[str, float]
    knobs: _containers.ScalarMap[str, float]
    full_calls: int
    skipped_calls: int
    forced_skips: int
    fail_open: int
    fallbacks: _containers.RepeatedScalarFieldContainer[str]
    deadline_met: bool
    setting: str
    thresholds: _containers.RepeatedScalarFieldContainer[float]
    branches: _containers.MessageMap[str, BranchCounts]
    feasible: bool
    best_achievable_ms: float
    def __init__(self, budget_ms: _Optional[float] = ..., deadline_ms: _Optional[float] = ..., predicted_ms: _Optional[_Mapping[str, float]] = ..., actual_ms: _Optional[_Mapping[str, float]] = ..., knobs: _Optional[_Mapping[str, float]] = ..., full_calls: _Optional[int] = ..., skipped_calls: _Optional[int] = ..., forced_skips: _Optional[int] = ..., fail_open: _Optional[int] = ..., fallbacks: _Optional[_Iterable[str]] = ..., deadline_met: _Optional[bool] = ..., setting: _Optional[str] = ..., thresholds: _Optional[_Iterable[float]] = ..., branches: _Optional[_Mapping[str, BranchCounts]] = ..., feasible: _Optional[bool] = ..., best_achievable_ms: _Optional[float] = ...) -> None: ...

class BranchCounts(_message.Message):
    __slots__ = ("full", "skipped", "forced_skip", "fail_open", "sequence", "fail_open_reasons")
    class FailOpenReasonsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    FULL_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    FORCED_SKIP_FIELD_NUMBER: _ClassVar[int]
    FAIL_OPEN_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    FAIL_OPEN_REASONS_FIELD_NUMBER: _ClassVar[int]
    full: int
    skipped: int
    forced_skip: int
    fail_open: int
    sequence: str
    fail_open_reasons: _containers.ScalarMap[str, int]
    def __init__(self, full: _Optional[int] = ..., skipped: _Optional[int] = ..., forced_skip: _Optional[int] = ..., fail_open: _Optional[int] = ..., sequence: _Optional[str] = ..., fail_open_reasons: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ActionChunk(_message.Message):
    __slots__ = ("session_id", "epoch", "obs_id", "obs_step_index", "first_step_index", "actions", "tick", "served_ms", "client_time_ns", "preview_frames")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OBS_ID_FIELD_NUMBER: _ClassVar[int]
    OBS_STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    TICK_FIELD_NUMBER: _ClassVar[int]
    SERVED_MS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_FRAMES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    obs_id: int
    obs_step_index: int
    first_step_index: int
    actions: Tensor
    tick: TickRecord
    served_ms: float
    client_time_ns: int
    preview_frames: _containers.RepeatedCompositeFieldContainer[Image]
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., obs_id: _Optional[int] = ..., obs_step_index: _Optional[int] = ..., first_step_index: _Optional[int] = ..., actions: _Optional[_Union[Tensor, _Mapping]] = ..., tick: _Optional[_Union[TickRecord, _Mapping]] = ..., served_ms: _Optional[float] = ..., client_time_ns: _Optional[int] = ..., preview_frames: _Optional[_Iterable[_Union[Image, _Mapping]]] = ...) -> None: ...

class ForwardDynamicsRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "observation", "actions", "seed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    observation: Observation
    actions: Tensor
    seed: int
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., observation: _Optional[_Union[Observation, _Mapping]] = ..., actions: _Optional[_Union[Tensor, _Mapping]] = ..., seed: _Optional[int] = ...) -> None: ...

class PredictedFrames(_message.Message):
    __slots__ = ("session_id", "epoch", "obs_step_index", "frames", "latents_shape", "tick", "served_ms", "client_time_ns")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OBS_STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    LATENTS_SHAPE_FIELD_NUMBER: _ClassVar[int]
    TICK_FIELD_NUMBER: _ClassVar[int]
    SERVED_MS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    obs_step_index: int
    frames: _containers.RepeatedCompositeFieldContainer[Image]
    latents_shape: _containers.RepeatedScalarFieldContainer[int]
    tick: TickRecord
    served_ms: float
    client_time_ns: int
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., obs_step_index: _Optional[int] = ..., frames: _Optional[_Iterable[_Union[Image, _Mapping]]] = ..., latents_shape: _Optional[_Iterable[int]] = ..., tick: _Optional[_Union[TickRecord, _Mapping]] = ..., served_ms: _Optional[float] = ..., client_time_ns: _Optional[int] = ...) -> None: ...

class Video(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[Image]
    def __init__(self, frames: _Optional[_Iterable[_Union[Image, _Mapping]]] = ...) -> None: ...

class InverseDynamicsRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "videos", "state", "instruction", "step_index", "seed", "client_time_ns")
    class VideosEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Video
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Video, _Mapping]] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    videos: _containers.MessageMap[str, Video]
    state: Tensor
    instruction: str
    step_index: int
    seed: int
    client_time_ns: int
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., videos: _Optional[_Mapping[str, Video]] = ..., state: _Optional[_Union[Tensor, _Mapping]] = ..., instruction: _Optional[str] = ..., step_index: _Optional[int] = ..., seed: _Optional[int] = ..., client_time_ns: _Optional[int] = ...) -> None: ...

class ControlStart(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ObservationFrame(_message.Message):
    __slots__ = ("epoch", "obs_id", "observation", "must_answer")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OBS_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    MUST_ANSWER_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    obs_id: int
    observation: Observation
    must_answer: bool
    def __init__(self, epoch: _Optional[int] = ..., obs_id: _Optional[int] = ..., observation: _Optional[_Union[Observation, _Mapping]] = ..., must_answer: _Optional[bool] = ...) -> None: ...

class BudgetUpdate(_message.Message):
    __slots__ = ("budget_ms",)
    BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    budget_ms: float
    def __init__(self, budget_ms: _Optional[float] = ...) -> None: ...

class Ping(_message.Message):
    __slots__ = ("client_time_ns",)
    CLIENT_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    client_time_ns: int
    def __init__(self, client_time_ns: _Optional[int] = ...) -> None: ...

class ControlRequest(_message.Message):
    __slots__ = ("start", "observation", "budget", "ping")
    START_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    start: ControlStart
    observation: ObservationFrame
    budget: BudgetUpdate
    ping: Ping
    def __init__(self, start: _Optional[_Union[ControlStart, _Mapping]] = ..., observation: _Optional[_Union[ObservationFrame, _Mapping]] = ..., budget: _Optional[_Union[BudgetUpdate, _Mapping]] = ..., ping: _Optional[_Union[Ping, _Mapping]] = ...) -> None: ...

class Superseded(_message.Message):
    __slots__ = ("obs_id", "by_obs_id", "epoch")
    OBS_ID_FIELD_NUMBER: _ClassVar[int]
    BY_OBS_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    obs_id: int
    by_obs_id: int
    epoch: int
    def __init__(self, obs_id: _Optional[int] = ..., by_obs_id: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class Pong(_message.Message):
    __slots__ = ("client_time_ns",)
    CLIENT_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    client_time_ns: int
    def __init__(self, client_time_ns: _Optional[int] = ...) -> None: ...

class ErrorDetail(_message.Message):
    __slots__ = ("code", "reason", "message", "field", "expected", "got", "best_achievable_ms", "retry_after_ms", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    GOT_FIELD_NUMBER: _ClassVar[int]
    BEST_ACHIEVABLE_MS_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    code: str
    reason: str
    message: str
    field: str
    expected: str
    got: str
    best_achievable_ms: float
    retry_after_ms: float
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, code: _Optional[str] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., field: _Optional[str] = ..., expected: _Optional[str] = ..., got: _Optional[str] = ..., best_achievable_ms: _Optional[float] = ..., retry_after_ms: _Optional[float] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ControlError(_message.Message):
    __slots__ = ("obs_id", "error")
    OBS_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    obs_id: int
    error: ErrorDetail
    def __init__(self, obs_id: _Optional[int] = ..., error: _Optional[_Union[ErrorDetail, _Mapping]] = ...) -> None: ...

class ControlEvent(_message.Message):
    __slots__ = ("started", "chunk", "superseded", "error", "pong", "budget")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PONG_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    started: Session
    chunk: ActionChunk
    superseded: Superseded
    error: ControlError
    pong: Pong
    budget: Session
    def __init__(self, started: _Optional[_Union[Session, _Mapping]] = ..., chunk: _Optional[_Union[ActionChunk, _Mapping]] = ..., superseded: _Optional[_Union[Superseded, _Mapping]] = ..., error: _Optional[_Union[ControlError, _Mapping]] = ..., pong: _Optional[_Union[Pong, _Mapping]] = ..., budget: _Optional[_Union[Session, _Mapping]] = ...) -> None: ...

class ReasonRequest(_message.Message):
    __slots__ = ("prompt", "max_new_tokens", "temperature", "seed")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    max_new_tokens: int
    temperature: float
    seed: int
    def __init__(self, prompt: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class ReasonChunk(_message.Message):
    __slots__ = ("text", "index", "done", "elapsed_ms", "finish_reason", "tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    index: int
    done: bool
    elapsed_ms: float
    finish_reason: str
    tokens: int
    def __init__(self, text: _Optional[str] = ..., index: _Optional[int] = ..., done: _Optional[bool] = ..., elapsed_ms: _Optional[float] = ..., finish_reason: _Optional[str] = ..., tokens: _Optional[int] = ...) -> None: ...
