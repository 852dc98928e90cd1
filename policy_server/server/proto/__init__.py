"""Generated protobuf / gRPC stubs for ``policy_server.v1``.

Do not edit by hand: regenerate with ``python -m policy_server.server.gen_proto``.
"""
