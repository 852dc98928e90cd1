"""Engine dataclasses -> protobuf messages (the answer direction)."""

from __future__ import annotations

import time
from dataclasses import asdict

import numpy as np

from policy_server import __version__, limits
from policy_server.engine.api import (
    ActResult,
    Capacity,
    EmbodimentSpec,
    ImageEncoding,
    PredictedVideo,
    ServerInfo,
    SessionHandle,
    TickRecord,
)
from policy_server.v1 import policy_server_pb2 as pb
from policy_server.v1.wire import encode_image, tensor_to_proto

PROTOCOL_VERSION = "policy_server.v1"

FRAME_JPEG_QUALITY = 90  # predicted frames: ~1/10 the bytes of RAW, within a few levels of the decoded pixels

_ENCODINGS = {
    ImageEncoding.JPEG: pb.IMAGE_ENCODING_JPEG,
    ImageEncoding.PNG: pb.IMAGE_ENCODING_PNG,
    ImageEncoding.RAW: pb.IMAGE_ENCODING_RAW,
}


def embodiment_to_proto(spec: EmbodimentSpec) -> pb.EmbodimentSpec:
    return pb.EmbodimentSpec(
        name=spec.name,
        cameras=[
            pb.CameraSpec(
                name=c.name,
                height=c.height,
                width=c.width,
                channels=c.channels,
                encodings=[_ENCODINGS[e] for e in c.encodings],
                max_side=c.max_side,
                min_side=c.min_side,
            )
            for c in spec.cameras
        ],
        state_dim=spec.state_dim,
        state_names=list(spec.state_names),
        state_units=list(spec.state_units),
        action=pb.ActionSpec(
            dim=spec.action.dim,
            names=list(spec.action.names),
            units=list(spec.action.units),
            low=list(spec.action.low),
            high=list(spec.action.high),
        ),
        default_chunk_size=spec.default_chunk_size,
        min_chunk_size=spec.min_chunk_size,
        max_chunk_size=spec.max_chunk_size,
        control_hz=spec.control_hz,
        state_low=list(spec.state_low),
        state_high=list(spec.state_high),
    )


def server_info_to_proto(info: ServerInfo, ready: bool, max_message_bytes: int,
                         capacity: tuple[Capacity, ...]) -> pb.ServerInfo:
    return pb.ServerInfo(
        protocol_version=PROTOCOL_VERSION,
        server_version=__version__,
        model=pb.ModelInfo(
            name=info.model_name,
            digest=info.model_digest,
            device=info.device,
            num_steps=info.num_steps,
            diffusion_cache=info.diffusion_cache,
            temporal_compression=info.temporal_compression,
            quality_profile=info.quality_profile,
        ),
        embodiments=[embodiment_to_proto(e) for e in info.embodiments],
        limits=pb.Limits(
            max_sessions=info.max_sessions,
            max_message_bytes=max_message_bytes,
            max_reason_tokens=info.max_reason_tokens,
            max_reason_calls=info.max_reason_calls,
            max_instruction_tokens=info.max_instruction_tokens,
            max_prompt_tokens=info.max_prompt_tokens,
            max_text_bytes=limits.MAX_TEXT_BYTES,
            max_budget_ms=limits.MAX_BUDGET_MS,
            max_rate_hz=limits.MAX_RATE_HZ,
            min_rate_hz=limits.MIN_RATE_HZ,
            max_client_name_chars=limits.MAX_CLIENT_NAME_CHARS,
            max_request_id_chars=limits.MAX_REQUEST_ID_CHARS,
            max_temperature=limits.MAX_TEMPERATURE,
            max_frame_side=limits.MAX_FRAME_SIDE,
            max_dynamics_ms=limits.MAX_DYNAMICS_MS,
            max_dynamics_calls=info.max_dynamics_calls,
        ),
        default_budget_ms=info.default_budget_ms,
        warmup_profile=[
            pb.ProfilePoint(
                label=p.label,
                p50_ms=p.p50_ms,
                p95_ms=p.p95_ms,
                full_calls=p.full_calls,
                skipped_calls=p.skipped_calls,
            )
            for p in info.warmup_profile
        ],
        ready=ready,
        capacity=[
            pb.Capacity(embodiment=c.embodiment, chunk_size=c.chunk_size, budget_ms=c.budget_ms, rate_hz=c.rate_hz,
                        sessions_alone=c.sessions_alone, sessions_more=c.sessions_more)
            for c in capacity
        ],
    )


def session_to_proto(handle: SessionHandle) -> pb.Session:
    return pb.Session(
        session_id=handle.session_id,
        epoch=handle.epoch,
        embodiment=handle.embodiment,
        instruction=handle.instruction,
        budget_ms=handle.budget_ms,
        chunk_size=handle.chunk_size,
        seed=handle.seed,
        rate_hz=handle.rate_hz,
        slot_ms=handle.slot_ms,
        measured_rate_hz=handle.measured_rate_hz,
        preview=handle.preview,
        client_name=handle.client_name,
    )


def tick_to_proto(tick: TickRecord) -> pb.TickRecord:
    return pb.TickRecord(
        budget_ms=tick.budget_ms,
        deadline_ms=tick.deadline_ms,
        predicted_ms=dict(tick.predicted_ms),
        actual_ms=dict(tick.actual_ms),
        knobs=dict(tick.knobs),
        full_calls=tick.full_calls,
        skipped_calls=tick.skipped_calls,
        forced_skips=tick.forced_skips,
        fail_open=tick.fail_open,
        fallbacks=list(tick.fallbacks),
        deadline_met=tick.deadline_met,
        setting=tick.setting,
        thresholds=list(tick.thresholds),
        branches={
            name: pb.BranchCounts(full=b.full, skipped=b.skipped, forced_skip=b.forced_skip, fail_open=b.fail_open,
                                  sequence=b.sequence, fail_open_reasons=dict(b.fail_open_reasons))
            for name, b in tick.branches.items()
        },
        feasible=tick.feasible,
        best_achievable_ms=tick.best_achievable_ms,
    )


def tick_to_dict(tick: TickRecord) -> dict:
    """The record as plain data (msgpack / JSON), with the proto's call totals and `deadline_met`."""
    return {**asdict(tick), "full_calls": tick.full_calls, "skipped_calls": tick.skipped_calls,
            "forced_skips": tick.forced_skips, "fail_open": tick.fail_open, "deadline_met": tick.deadline_met}


def act_result_to_proto(
    result: ActResult,
    session_id: str,
    epoch: int,
    obs_step_index: int,
    received_s: float,
    obs_id: int = 0,
    client_time_ns: int = 0,
) -> pb.ActionChunk:
    """The answer to a request received at ``received_s`` (``time.monotonic()``), its ``served_ms`` ending once the
    preview frames are JPEG-encoded."""
    preview_frames = [] if result.preview_frames is None else frames_to_proto(result.preview_frames)
    return pb.ActionChunk(
        session_id=session_id,
        epoch=epoch,
        obs_id=obs_id,
        obs_step_index=obs_step_index,
        first_step_index=result.first_step_index,
        actions=tensor_to_proto(np.asarray(result.actions, dtype=np.float32)),
        tick=tick_to_proto(result.tick),
        served_ms=_ms_since(received_s),
        client_time_ns=client_time_ns,
        preview_frames=preview_frames,
    )


def frames_to_proto(frames: np.ndarray) -> list[pb.Image]:
    """uint8 RGB [F, H, W, 3] -> one JPEG Image per frame."""
    return [encode_image(frame, "jpeg", FRAME_JPEG_QUALITY) for frame in frames]


def predicted_video_to_proto(result: PredictedVideo, session_id: str, epoch: int, obs_step_index: int,
                             received_s: float, client_time_ns: int = 0) -> pb.PredictedFrames:
    """The answer to a request received at ``received_s``, its ``served_ms`` ending once the frames are encoded."""
    frames = frames_to_proto(result.frames)
    return pb.PredictedFrames(
        session_id=session_id,
        epoch=epoch,
        obs_step_index=obs_step_index,
        frames=frames,
        latents_shape=list(result.latents_shape),
        tick=tick_to_proto(result.tick),
        served_ms=_ms_since(received_s),
        client_time_ns=client_time_ns,
    )


def _ms_since(started_s: float) -> float:
    return (time.monotonic() - started_s) * 1e3
