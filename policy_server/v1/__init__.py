"""The wire protocol ``policy_server.v1``, shared by the client and the server (no torch, no cv2 at import).

- ``policy_server_pb2`` / ``policy_server_pb2_grpc``: stubs generated from
  ``protos/policy_server/v1/policy_server.proto`` at the module path the proto declares (so messages
  pickle); do not edit by hand, regenerate with ``python -m policy_server.v1.gen_proto``.
- ``wire``: numpy <-> protobuf for tensors and images.
- ``errors``: the trailing metadata a failed call carries.
- ``auth_token``: the bearer token a token file holds, as both sides read it.
"""
