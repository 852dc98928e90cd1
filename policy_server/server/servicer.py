"""``policy_server.v1.PolicyService``: validates each request, calls the engine, answers.

Each method raises on failure; ``rpc_errors`` turns the exception into the precise gRPC status
with its machine-readable reason (see ``errors.py``), so the server keeps serving the next call.
"""

from __future__ import annotations

import time

import grpc

from policy_server.engine.api import EmbodimentSpec, Engine, SessionHandle, WarmingUp
from policy_server.server import convert, validate
from policy_server.server.control_stream import ControlCall, StartingStreams
from policy_server.server.errors import ServiceError, rpc_errors
from policy_server.server.metrics import ServerMetrics
from policy_server.server.running_calls import RunningCalls
from policy_server.v1 import policy_server_pb2 as pb
from policy_server.v1 import policy_server_pb2_grpc as pb_grpc

# gRPC reports "no deadline" as a time remaining far in the future.
_NO_DEADLINE_S = 1e8


class PolicyServicer(pb_grpc.PolicyServiceServicer):
    def __init__(self, engine: Engine, metrics: ServerMetrics, max_message_bytes: int, running: RunningCalls) -> None:
        """``running``: the calls being served, where each Control stream registers (a shutdown drains them)."""
        self.engine = engine
        self.metrics = metrics
        self.max_message_bytes = max_message_bytes
        self.starting_streams = StartingStreams()
        self.running = running

    def on_error(self, error: ServiceError) -> None:
        self.metrics.observe_error(error.reason)

    # -- helpers ------------------------------------------------------------------------------

    def _admit(self, request) -> None:
        """A request within the message limit, to a warm engine."""
        validate.message_size(request.ByteSize(), self.max_message_bytes, "request", "request")
        if not self.engine.ready():
            raise WarmingUp(self.engine.stats().warmup_progress)

    def _session_request(self, request) -> tuple[SessionHandle, EmbodimentSpec]:
        """A per-session request, admitted: the session it names at the epoch it names, and its embodiment."""
        self._admit(request)
        session_id = validate.session_id(request.session_id)
        return validate.session_at(self.engine, session_id, validate.epoch(request.epoch))

    @staticmethod
    def _deadline_s(context: grpc.ServicerContext, received: float) -> float | None:
        remaining = context.time_remaining()
        return received + remaining if remaining < _NO_DEADLINE_S else None

    # -- server and sessions -------------------------------------------------------------------

    @rpc_errors
    def GetServerInfo(self, request: pb.GetServerInfoRequest, context):
        budget = validate.budget_ms(request.budget_ms) if request.HasField("budget_ms") else None
        rate = validate.rate_hz(request.rate_hz) if request.HasField("rate_hz") else None
        return convert.server_info_to_proto(self.engine.info(), self.engine.ready(), self.max_message_bytes,
                                            self.engine.capacity(budget, rate))

    @rpc_errors
    def OpenSession(self, request: pb.OpenSessionRequest, context):
        self._admit(request)
        spec = validate.embodiment(self.engine.info(), request.embodiment)
        instruction = validate.instruction(request.instruction)
        budget = validate.budget_ms(request.budget_ms) if request.HasField("budget_ms") else None
        chunk = validate.chunk_size(spec, request.chunk_size) if request.HasField("chunk_size") else None
        seed = request.seed if request.HasField("seed") else None
        rate = validate.rate_hz(request.rate_hz) if request.HasField("rate_hz") else None
        executed = None
        if request.HasField("actions_per_chunk"):
            executed = validate.actions_per_chunk(request.actions_per_chunk, chunk or spec.default_chunk_size)
        handle = self.engine.open_session(
            spec.name, instruction, budget_ms=budget, chunk_size=chunk, seed=seed, rate_hz=rate,
            actions_per_chunk=executed, preview=request.preview, client_name=validate.client_name(request.client_name),
            request_id=validate.request_id(request.request_id),
        )
        return convert.session_to_proto(handle)

    @rpc_errors
    def ResetSession(self, request: pb.ResetSessionRequest, context):
        return convert.session_to_proto(self.engine.reset_session(validate.session_id(request.session_id)))

    @rpc_errors
    def CloseSession(self, request: pb.CloseSessionRequest, context):
        self.engine.close_session(validate.session_id(request.session_id))
        return pb.CloseSessionResponse()

    @rpc_errors
    def SetBudget(self, request: pb.SetBudgetRequest, context):
        session_id = validate.session_id(request.session_id)
        budget = validate.budget_ms(request.budget_ms)
        return convert.session_to_proto(self.engine.set_budget(session_id, budget))

    # -- acting --------------------------------------------------------------------------------

    @rpc_errors
    def Act(self, request: pb.ActRequest, context: grpc.ServicerContext):
        received = time.monotonic()
        handle, spec = self._session_request(request)
        with self.engine.reserve_tick(handle.session_id) as reservation:  # refused now: before frames are decoded
            observation = validate.observation(validate.ProtoObservation.of(request, "observation"), spec,
                                               handle.chunk_size)
            result = self.engine.act(
                handle.session_id,
                handle.epoch,
                observation,
                deadline_s=self._deadline_s(context, received),
                should_abort=lambda: not context.is_active(),
                reservation=reservation,
            )
        answer = convert.act_result_to_proto(result, handle.session_id, handle.epoch, observation.step_index,
                                             received, client_time_ns=request.observation.client_time_ns)
        self.metrics.observe_tick(result, answer.served_ms, "grpc")
        return answer

    # -- forward and inverse dynamics --------------------------------------------------------

    @rpc_errors
    def ForwardDynamics(self, request: pb.ForwardDynamicsRequest, context: grpc.ServicerContext):
        received = time.monotonic()
        handle, spec = self._session_request(request)
        sent = validate.ProtoObservation.of(request, "observation")
        validate.require(request.HasField("actions"), "actions", "the action chunk, a Tensor")
        with self.engine.reserve_dynamics(handle.session_id) as reservation:  # refused now: before decoding
            observation = validate.observation(sent, spec, chunk=None)  # a dynamics call takes no committed actions
            actions = validate.actions(request.actions, spec, handle.chunk_size)
            result = self.engine.forward_dynamics(
                handle.session_id, handle.epoch, observation, actions,
                seed=request.seed if request.HasField("seed") else None,
                deadline_s=self._deadline_s(context, received), should_abort=lambda: not context.is_active(),
                reservation=reservation,
            )
        return convert.predicted_video_to_proto(result, handle.session_id, handle.epoch, observation.step_index,
                                                received, client_time_ns=request.observation.client_time_ns)

    @rpc_errors
    def InverseDynamics(self, request: pb.InverseDynamicsRequest, context: grpc.ServicerContext):
        received = time.monotonic()
        handle, spec = self._session_request(request)
        with self.engine.reserve_dynamics(handle.session_id, inverse=True) as reservation:  # refused before decoding
            clip = validate.video_clip(request, spec, handle.chunk_size, ended=lambda: not context.is_active())
            result = self.engine.inverse_dynamics(
                handle.session_id, handle.epoch, clip, seed=request.seed if request.HasField("seed") else None,
                deadline_s=self._deadline_s(context, received), should_abort=lambda: not context.is_active(),
                reservation=reservation,
            )
        return convert.act_result_to_proto(result, handle.session_id, handle.epoch, clip.step_index, received,
                                           client_time_ns=request.client_time_ns)

    @rpc_errors
    def Control(self, request_iterator, context):
        call = ControlCall(self.engine, self.metrics, self.max_message_bytes, context, self.starting_streams)
        with self.running.stream(call):
            yield from call.run(request_iterator)

    # -- reasoner ------------------------------------------------------------------------------

    @rpc_errors
    def Reason(self, request: pb.ReasonRequest, context: grpc.ServicerContext):
        started = time.monotonic()
        self._admit(request)
        prompt = validate.text(request.prompt, "prompt", "prompt")
        max_new_tokens = validate.max_new_tokens(request.max_new_tokens, self.engine.info().max_reason_tokens)
        pieces = self.engine.reason(
            prompt,
            max_new_tokens,
            temperature=validate.temperature(request.temperature),
            seed=request.seed if request.HasField("seed") else None,
            should_abort=lambda: not context.is_active(),
            deadline_s=self._deadline_s(context, started),
        )
        count = 0
        while True:
            try:
                text = next(pieces)
            except StopIteration as ended:  # the engine's generator returns how the call ended
                end = ended.value
                break
            self.metrics.reason_pieces.inc()
            yield pb.ReasonChunk(text=text, index=count, elapsed_ms=(time.monotonic() - started) * 1e3)
            count += 1
        yield pb.ReasonChunk(done=True, index=count, elapsed_ms=(time.monotonic() - started) * 1e3,
                             finish_reason=end.finish_reason, tokens=end.tokens)
